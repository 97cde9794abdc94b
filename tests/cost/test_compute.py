import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardwise.cost.compute import (
    Bound,
    elementwise_estimate,
    graph_compute_time,
    matmul_estimate,
    node_time,
    roofline_time,
)
from shardwise.cost.hardware import get_hardware
from shardwise.ir.flops import NodeCost, node_cost

aten = torch.ops.aten
H100 = get_hardware("h100")


def test_big_matmul_is_compute_bound_near_peak():
    n = 8192
    est = matmul_estimate(n, n, n, "bf16", H100)
    assert est.bound is Bound.COMPUTE and est.flops == 2 * n**3
    ideal = 2 * n**3 / (989e12 * H100.compute_eff)  # figures.md peak
    assert est.time_s == pytest.approx(ideal, rel=0.15)


def test_gib_add_is_memory_bound():
    numel = 2**30 // 2  # 1 GiB of bf16 per operand
    est = elementwise_estimate(numel, 2, "bf16", H100)
    assert est.bound is Bound.MEMORY and est.flops == 0
    assert est.time_s == pytest.approx(3 * 2**30 / (H100.mem_bw * H100.mem_eff) + H100.launch_s)


def test_small_kernel_pays_the_launch_floor_and_empty_costs_nothing():
    tiny = roofline_time(NodeCost(2, 8, 4), H100, "bf16")
    assert H100.launch_s <= tiny < 1.01 * H100.launch_s
    assert roofline_time(NodeCost(0, 0, 0), H100, "bf16") == 0.0


def test_roofline_grows_with_work_and_knows_dtypes():
    def mm(n, dtype="bf16"):
        return matmul_estimate(n, n, n, dtype, H100)

    assert mm(2048).time_s > mm(1024).time_s
    assert mm(4096, "fp32").time_s > mm(4096).time_s
    # a skinny matmul (a matrix-vector product) reads the matrix once: memory-bound
    assert matmul_estimate(1, 8192, 8192, "bf16", H100).bound is Bound.MEMORY


def _graph(dtype):
    def f(x, w):
        y = x.view(-1, 64) @ w
        return (y + 1).view(4, 16, 32)
    x = torch.randn(4, 16, 64, dtype=dtype)
    w = torch.randn(64, 32, dtype=dtype)
    return make_fx(f, tracing_mode="fake")(x, w)


def test_node_time_on_fake_values():
    gm = _graph(torch.bfloat16)
    times = {n: node_time(n, H100) for n in gm.graph.nodes}
    views = [n for n in gm.graph.nodes if n.target in (aten.view.default, aten._unsafe_view.default)]
    mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    assert views and all(times[v] == 0.0 for v in views)
    assert all(times[n] == 0.0 for n in gm.graph.nodes if n.op in ("placeholder", "output"))
    assert times[mm] == pytest.approx(roofline_time(node_cost(mm), H100, torch.bfloat16))
    assert times[add] > 0 and times[mm] > 0
    assert graph_compute_time(gm, H100) == pytest.approx(sum(times.values()))


def test_node_dtype_comes_from_the_fake_value():
    big = make_fx(lambda a, b: a @ b, tracing_mode="fake")
    bf = big(torch.randn(2048, 2048, dtype=torch.bfloat16), torch.randn(2048, 2048, dtype=torch.bfloat16))
    fp = big(torch.randn(2048, 2048), torch.randn(2048, 2048))
    mm_bf = next(n for n in bf.graph.nodes if n.target is aten.mm.default)
    mm_fp = next(n for n in fp.graph.nodes if n.target is aten.mm.default)
    # fp32 runs on the (much slower) non-tensor-core peak of the spec
    assert node_time(mm_fp, H100) > 5 * node_time(mm_bf, H100)


def test_collectives_are_not_compute():
    from shardwise.mesh import ensure_fake_world
    ensure_fake_world(2)
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    f = lambda x: funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
    gm = make_fx(f, tracing_mode="fake")(torch.randn(64, 64))
    coll = [n for n in gm.graph.nodes if n.op == "call_function" and "c10d" in str(n.target)]
    assert coll and all(node_time(n, H100) == 0.0 for n in coll)
