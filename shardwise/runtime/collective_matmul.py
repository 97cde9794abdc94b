"""Running the fused collective-matmul ops: a ring decomposition that overlaps, and the references.

``all_gather_matmul(a_shard, bs, gather_dim)`` computes ``g = all_gather(a_shard, gather_dim)``
and ``g @ b`` for every ``b``; ``matmul_reduce_scatter(a, b, scatter_dim, op)`` computes
``reduce_scatter(a @ b, scatter_dim, op)``. Three implementations, which agree:

- ``RING``: W steps around the group. All-gather: each rank multiplies the chunk it holds while
  it passes that chunk to the next rank and receives the previous rank's (``batch_isend_irecv``),
  so the transfer of chunk s+1 overlaps the matmul of chunk s. Reduce-scatter: each rank computes
  its partial product for one output chunk while the running sum of the previous chunk travels
  one hop; after W steps rank r holds chunk r summed over all ranks. Works on gloo and NCCL.
- ``SYMM_MEM``: PyTorch's own fused ops (``torch.ops.symm_mem``) on CUDA, when symmetric memory
  is enabled for the group.
- ``UNFUSED``: the c10d functional collective, then the matmul (the program before the pass).

The implementation is chosen by the ``impl`` argument (the pass records it on the node) or, for a
stretch of code, by ``with collective_matmul_impl(Impl.UNFUSED): ...``, which wins over it.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

c10d = torch.ops._c10d_functional


class Impl(enum.Enum):
    AUTO = "auto"  # SYMM_MEM where available, else RING
    RING = "ring"
    SYMM_MEM = "symm_mem"
    UNFUSED = "unfused"


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"


_OVERRIDE: contextvars.ContextVar[Impl | None] = contextvars.ContextVar("collective_matmul_impl",
                                                                       default=None)


@contextlib.contextmanager
def collective_matmul_impl(impl: Impl) -> Iterator[None]:
    """Run every fused collective-matmul op inside the block with ``impl``."""
    token = _OVERRIDE.set(Impl(impl))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def symm_mem_available(t: torch.Tensor, group_name: str) -> bool:
    """PyTorch's fused symm_mem ops can run here: CUDA tensors and symmetric memory on the group."""
    if not t.is_cuda or not hasattr(torch.ops, "symm_mem"):
        return False
    try:
        from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group

        return bool(is_symm_mem_enabled_for_group(group_name))
    except (ImportError, RuntimeError):  # a build without symmetric memory
        return False


def resolve_impl(requested: Impl, t: torch.Tensor, group_name: str) -> Impl:
    """The implementation to run: the context manager's override, else ``requested``; AUTO becomes
    SYMM_MEM where available, else RING."""
    impl = _OVERRIDE.get() or requested
    if impl is Impl.AUTO:
        impl = Impl.SYMM_MEM if symm_mem_available(t, group_name) else Impl.RING
    if impl is Impl.SYMM_MEM and not symm_mem_available(t, group_name):
        raise RuntimeError(f"collective-matmul impl symm_mem needs CUDA tensors and symmetric memory "
                           f"enabled for group {group_name!r}; use Impl.RING or Impl.AUTO.")
    return impl


# ---------------------------------------------------------------------------------------------
# Unfused reference: c10d functional collectives + matmul.
# ---------------------------------------------------------------------------------------------

def gather_along(x: torch.Tensor, dim: int, group_size: int, group_name: str) -> torch.Tensor:
    """all_gather along ``dim`` the way ``_functional_collectives`` does: gather dim 0, reassemble."""
    y = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), group_size, group_name))
    return y if dim == 0 else torch.cat(torch.chunk(y, group_size, dim=0), dim=dim)


def scatter_along(x: torch.Tensor, dim: int, op: ReduceOp, group_size: int, group_name: str) -> torch.Tensor:
    """reduce_scatter along ``dim``: cut into per-rank chunks along dim, stack on dim 0, scatter."""
    if dim != 0:
        x = torch.cat(torch.chunk(x, group_size, dim=dim), dim=0)
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x.contiguous(), op.value, group_size, group_name))


def unfused_all_gather_matmul(a: torch.Tensor, bs: list[torch.Tensor], gather_dim: int, group_name: str,
                              group_size: int) -> list[torch.Tensor]:
    g = gather_along(a, gather_dim, group_size, group_name)
    return [g, *(torch.matmul(g, b) for b in bs)]


def unfused_matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, scatter_dim: int, op: ReduceOp,
                                  group_name: str, group_size: int) -> torch.Tensor:
    return scatter_along(torch.matmul(a, b), scatter_dim, op, group_size, group_name)


# ---------------------------------------------------------------------------------------------
# Ring decomposition with asynchronous point-to-point transfers.
# ---------------------------------------------------------------------------------------------

class _Ring:
    """Neighbours of this rank in a ring over ``group`` (global ranks, as P2P ops take them)."""

    def __init__(self, group_name: str) -> None:
        self.group = _resolve_process_group(group_name)
        self.size = self.group.size()
        self.rank = self.group.rank()
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def shift(self, send: torch.Tensor, recv: torch.Tensor) -> list[dist.Work]:
        """Start sending ``send`` to the next rank and receiving the previous rank's into ``recv``."""
        return dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, self.next, self.group),
            dist.P2POp(dist.irecv, recv, self.prev, self.group),
        ])


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


def ring_all_gather_matmul(a: torch.Tensor, bs: list[torch.Tensor], gather_dim: int,
                           group_name: str) -> list[torch.Tensor]:
    """Step s multiplies the chunk of rank ``r - s`` while it travels on to rank ``r + 1``.

    Gathering a batch dim of ``a``, chunk j of each output is ``chunk_j(a) @ b``; gathering the
    contracted (last) dim, each output is ``sum_j chunk_j(a) @ b[rows of j]``.
    """
    ring = _Ring(group_name)
    dim = gather_dim % a.dim()
    contracting = dim == a.dim() - 1
    k = a.shape[-1]
    cur = a.contiguous()
    chunks: list[torch.Tensor | None] = [None] * ring.size
    parts: list[list[torch.Tensor | None]] = [[None] * ring.size for _ in bs]
    sums: list[torch.Tensor | None] = [None] * len(bs)
    for step in range(ring.size):
        owner = (ring.rank - step) % ring.size
        works, nxt = [], None
        if step < ring.size - 1:
            nxt = torch.empty_like(cur)
            works = ring.shift(cur, nxt)
        for i, b in enumerate(bs):  # overlaps the transfer above
            if contracting:
                p = torch.matmul(cur, b.narrow(0, owner * k, k))
                sums[i] = p if sums[i] is None else sums[i].add_(p)
            else:
                parts[i][owner] = torch.matmul(cur, b)
        chunks[owner] = cur
        _wait(works)
        cur = nxt
    gathered = torch.cat(chunks, dim=dim)
    outs = sums if contracting else [torch.cat(p, dim=dim) for p in parts]
    return [gathered, *outs]


def _output_chunk(a: torch.Tensor, b: torch.Tensor, dim: int, index: int, size: int) -> torch.Tensor:
    """Chunk ``index`` (of ``size`` rows along ``dim``) of ``a @ b``, computing only that chunk."""
    if dim == a.dim() - 1:  # the output's last dim comes from b's columns
        return torch.matmul(a, b.narrow(1, index * size, size))
    return torch.matmul(a.narrow(dim, index * size, size), b)


def ring_matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, scatter_dim: int, op: ReduceOp,
                               group_name: str) -> torch.Tensor:
    """Step s computes this rank's partial for chunk ``r - s - 1`` while the running sum of the
    previous chunk travels one hop; chunk c starts at rank c + 1 and ends, complete, at rank c."""
    ring = _Ring(group_name)
    out_rank = max(a.dim(), 2)
    dim = scatter_dim % out_rank
    full = b.shape[-1] if dim == out_rank - 1 else a.shape[dim]
    size = full // ring.size
    acc = _output_chunk(a, b, dim, (ring.rank - 1) % ring.size, size).contiguous()
    for step in range(1, ring.size):
        recv = torch.empty_like(acc)
        works = ring.shift(acc, recv)
        part = _output_chunk(a, b, dim, (ring.rank - step - 1) % ring.size, size)  # overlaps
        _wait(works)
        acc = recv.add_(part)
    return acc.div_(ring.size) if op is ReduceOp.AVG else acc


# ---------------------------------------------------------------------------------------------
# PyTorch's symmetric-memory fused ops (CUDA).
# ---------------------------------------------------------------------------------------------

def symm_mem_all_gather_matmul(a: torch.Tensor, bs: list[torch.Tensor], gather_dim: int,
                               group_name: str) -> list[torch.Tensor]:
    gathered, outs = torch.ops.symm_mem.fused_all_gather_matmul(a.contiguous(), bs, gather_dim, group_name)
    return [gathered, *outs]


def symm_mem_matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, scatter_dim: int, op: ReduceOp,
                                   group_name: str) -> torch.Tensor:
    return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, op.value, scatter_dim, group_name)


# ---------------------------------------------------------------------------------------------
# Dispatch (the custom ops' real implementations call these).
# ---------------------------------------------------------------------------------------------

def all_gather_matmul(a: torch.Tensor, bs: list[torch.Tensor], gather_dim: int, group_name: str,
                      group_size: int, impl: Impl = Impl.AUTO) -> list[torch.Tensor]:
    """``[all_gather(a, gather_dim), all_gather(a, gather_dim) @ b for b in bs]``."""
    impl = resolve_impl(impl, a, group_name)
    if impl is Impl.UNFUSED or group_size == 1:
        return unfused_all_gather_matmul(a, bs, gather_dim, group_name, group_size)
    if impl is Impl.SYMM_MEM:
        return symm_mem_all_gather_matmul(a, bs, gather_dim, group_name)
    return ring_all_gather_matmul(a, bs, gather_dim, group_name)


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, scatter_dim: int, op: ReduceOp, group_name: str,
                          group_size: int, impl: Impl = Impl.AUTO) -> torch.Tensor:
    """``reduce_scatter(a @ b, scatter_dim, op)``."""
    impl = resolve_impl(impl, a, group_name)
    if impl is Impl.UNFUSED or group_size == 1:
        return unfused_matmul_reduce_scatter(a, b, scatter_dim, op, group_name, group_size)
    if impl is Impl.SYMM_MEM:
        return symm_mem_matmul_reduce_scatter(a, b, scatter_dim, op, group_name)
    return ring_matmul_reduce_scatter(a, b, scatter_dim, op, group_name)
