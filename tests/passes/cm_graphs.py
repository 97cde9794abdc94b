"""Graphs with collectives around matmuls, for the collective-matmul pass and runtime tests.

Each ``Case`` builds a function over the default process group and says how many fusions the
pass must make at a given world size. Functions are traced with ``make_fx`` on fake tensors;
under a fake process group (pass tests) or inside a real gloo worker (numerics), so that
``torch.distributed.group.WORLD``'s name resolves. ``pre_dispatch`` tracing keeps ``aten.einsum``
(and writes the functional collectives' reassembly with ``chunk``); the default tracing turns
``x @ w`` on a 3-D ``x`` into flatten -> mm -> unflatten.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed._functional_collectives import all_gather_tensor, reduce_scatter_tensor
from torch.fx.experimental.proxy_tensor import make_fx

c10d = torch.ops._c10d_functional

# Local sizes: rows per rank, contracted dim, output columns (multiples of every world size used).
R, K, N = 4, 8, 8


def _world() -> tuple[int, dist.ProcessGroup]:
    return dist.get_world_size(), dist.group.WORLD


def _ag(x: torch.Tensor, dim: int) -> torch.Tensor:
    return all_gather_tensor(x, gather_dim=dim, group=dist.group.WORLD)


def _rs(x: torch.Tensor, dim: int, op: str = "sum") -> torch.Tensor:
    return reduce_scatter_tensor(x, op, scatter_dim=dim, group=dist.group.WORLD)


# --- the seed's two functions (two narrows: per-rank chunks only at world size 2) -------------

def seed_ag_slice_cat_mm(x, w):
    y = _ag(x, 0)
    y = torch.cat([y.narrow(0, 0, 64), y.narrow(0, 64, 64)], dim=1)
    return y @ w


def seed_mm_slice_cat_rs(x, w):
    y = x @ w
    y = torch.cat([y.narrow(1, 0, 8), y.narrow(1, 8, 8)], dim=0)
    return _rs(y, 0, "avg")


# --- the same patterns with one narrow per rank ------------------------------------------------

def narrow_per_rank_ag(x, w):
    world, _ = _world()
    y = _ag(x, 0)
    rows = x.shape[0]
    return torch.cat([y.narrow(0, r * rows, rows) for r in range(world)], dim=1) @ w


def narrow_per_rank_rs(x, w):
    world, _ = _world()
    y = x @ w
    cols = y.shape[1] // world
    return _rs(torch.cat([y.narrow(1, r * cols, cols) for r in range(world)], dim=0), 0, "avg")


# --- plain forms -----------------------------------------------------------------------------

def direct_c10d_ag_mm(x, w):
    world, group = _world()
    y = c10d.wait_tensor(c10d.all_gather_into_tensor(x, world, group.group_name))
    return torch.mm(y, w)


def direct_c10d_mm_rs(x, w):
    world, group = _world()
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(torch.mm(x, w), "sum", world, group.group_name))


def ag_matmul(dim: int) -> Callable:
    def f(x, w):
        return _ag(x, dim) @ w
    f.__name__ = f"ag{dim}_matmul"
    return f


def ag_einsum(dim: int) -> Callable:
    def f(x, w):
        return torch.einsum("bsk,kn->bsn", _ag(x, dim), w)
    f.__name__ = f"ag{dim}_einsum"
    return f


def matmul_rs(dim: int) -> Callable:
    def f(x, w):
        return _rs(x @ w, dim)
    f.__name__ = f"matmul_rs{dim}"
    return f


def einsum_rs(dim: int) -> Callable:
    def f(x, w):
        return _rs(torch.einsum("bsk,kn->bsn", x, w), dim, "avg")
    f.__name__ = f"einsum_rs{dim}"
    return f


def ag_two_matmuls(x, w1, w2):
    g = _ag(x, 1)
    return g @ w1, torch.relu(g @ w2)


def ag_matmul_and_other_reader(x, w):
    g = _ag(x, 0)
    return g @ w, g * 2.0


def ag_flatten_mm_2d_out(x, w):
    g = _ag(x, 1)
    return torch.mm(g.reshape(-1, g.shape[-1]), w)


# --- must not fuse ---------------------------------------------------------------------------

def ag_cat_out_of_order(x, w):
    world, _ = _world()
    y = _ag(x, 0)
    rows = x.shape[0]
    return torch.cat([y.narrow(0, r * rows, rows) for r in reversed(range(world))], dim=1) @ w


def ag_partial_reassembly(x, w):
    world, _ = _world()
    y = _ag(x, 0)
    rows = x.shape[0]
    return torch.cat([y.narrow(0, r * rows, rows) for r in range(world - 1)], dim=1) @ w


def ag_b_depends_on_gather(x, w):
    g = _ag(x, 0)
    return g @ (g.t() @ g)


def rs_input_with_other_user(x, w):
    y = x @ w
    return _rs(y, 0), y.sum()


def rs_cat_out_of_order(x, w):
    world, _ = _world()
    y = x @ w
    cols = y.shape[1] // world
    return _rs(torch.cat([y.narrow(1, r * cols, cols) for r in reversed(range(world))], dim=0), 0)


@dataclass(frozen=True)
class Case:
    """``fn`` on inputs of ``shapes(world)``; the pass must make ``fusions(world)`` rewrites."""

    fn: Callable
    shapes: Callable[[int], list[tuple[int, ...]]]
    fusions: Callable[[int], int]
    pre_dispatch: bool = False

    @property
    def name(self) -> str:
        return self.fn.__name__


def _always(n: int) -> Callable[[int], int]:
    return lambda world: n


def _seed_ag_shapes(world: int) -> list[tuple[int, ...]]:
    # 128 gathered rows cut into two narrows of 64; cat on dim 1 doubles the columns.
    return [(128 // world, K), (2 * K, N)]


CASES: list[Case] = [
    Case(seed_ag_slice_cat_mm, _seed_ag_shapes, lambda world: 1 if world == 2 else 0),
    Case(seed_mm_slice_cat_rs, lambda world: [(2 * R * world, K), (K, 16)],
         lambda world: 1 if world == 2 else 0),
    Case(narrow_per_rank_ag, lambda world: [(R, K), (world * K, N)], _always(1)),
    Case(narrow_per_rank_rs, lambda world: [(R, K), (K, N * world)], _always(1)),
    Case(direct_c10d_ag_mm, lambda world: [(R, K), (K, N)], _always(1)),
    Case(direct_c10d_mm_rs, lambda world: [(R * world, K), (K, N)], _always(1)),
    Case(ag_matmul(0), lambda world: [(R, K), (K, N)], _always(1)),
    Case(ag_matmul(1), lambda world: [(R, K), (K * world, N)], _always(1)),
    Case(ag_matmul(0), lambda world: [(2, R, K), (K, N)], _always(1)),  # 3-D A: flatten -> mm
    Case(ag_matmul(1), lambda world: [(2, R, K), (K, N)], _always(1)),
    Case(ag_matmul(2), lambda world: [(2, R, K), (K * world, N)], _always(1)),
    Case(ag_einsum(0), lambda world: [(2, R, K), (K, N)], _always(1), pre_dispatch=True),
    Case(ag_einsum(1), lambda world: [(2, R, K), (K, N)], _always(1), pre_dispatch=True),
    Case(ag_einsum(2), lambda world: [(2, R, K), (K * world, N)], _always(1), pre_dispatch=True),
    Case(matmul_rs(0), lambda world: [(R * world, K), (K, N)], _always(1)),
    Case(matmul_rs(1), lambda world: [(R, K), (K, N * world)], _always(1)),
    Case(matmul_rs(0), lambda world: [(world, R, K), (K, N)], _always(1)),
    Case(matmul_rs(1), lambda world: [(2, R * world, K), (K, N)], _always(1)),
    Case(matmul_rs(2), lambda world: [(2, R, K), (K, N * world)], _always(1)),
    Case(einsum_rs(0), lambda world: [(world, R, K), (K, N)], _always(1), pre_dispatch=True),
    Case(einsum_rs(1), lambda world: [(2, R * world, K), (K, N)], _always(1), pre_dispatch=True),
    Case(einsum_rs(2), lambda world: [(2, R, K), (K, N * world)], _always(1), pre_dispatch=True),
    Case(ag_two_matmuls, lambda world: [(2, R, K), (K, N), (K, 2 * N)], _always(1)),
    Case(ag_matmul_and_other_reader, lambda world: [(R, K), (K, N)], _always(1)),
    Case(ag_flatten_mm_2d_out, lambda world: [(2, R, K), (K, N)], _always(1)),
    Case(ag_cat_out_of_order, lambda world: [(R, K), (world * K, N)], _always(0)),
    Case(ag_partial_reassembly, lambda world: [(R, K), ((world - 1) * K, N)], _always(0)),
    Case(ag_b_depends_on_gather, lambda world: [(R, K), (K, N)], _always(0)),
    Case(rs_input_with_other_user, lambda world: [(R * world, K), (K, N)], _always(0)),
    Case(rs_cat_out_of_order, lambda world: [(R, K), (K, N * world)], _always(0)),
]


def case_id(case: Case) -> str:
    dims = "x".join(str(len(s)) for s in case.shapes(2))
    return f"{case.name}[{dims}]"


def trace_case(case: Case, world: int) -> fx.GraphModule:
    """Trace ``case`` on fake tensors over the current default process group of size ``world``."""
    inputs = [torch.empty(s) for s in case.shapes(world)]
    return make_fx(case.fn, tracing_mode="fake", pre_dispatch=case.pre_dispatch)(*inputs)


def count_target(gm: fx.GraphModule, target: object) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)
