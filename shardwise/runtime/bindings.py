"""Call a bound program's most frequent ATen ops through PyTorch's own Python bindings.

A per-rank program runs op by op from Python: its code calls ``torch.ops.aten.mul.Tensor(a, b)``,
an ``OpOverload``, whose call adds a Python frame and then parses the arguments against the op's
schema onto a stack for the boxed kernel. PyTorch's binding of the same op (``torch.mul``,
``Tensor.view``) parses them in C++ straight into the unboxed call. The kernel is the same; the
call costs 0.5-1 us less (``Tensor.view`` 1.1 us against ``aten.view.default`` 1.7 us, ``torch.t``
0.7 against 1.2, ``torch.sum`` 2.5 against 3.4, one thread of this project's 2-core machine).
``benchmarks/bindings.py``: llama-tiny's traced step (927 nodes, 762 of them listed) took 16.90
ms a call against 17.40; inside its lowered ddp step over two gloo ranks, swapping the program in
and out within one run gave 0.7-1.0 ms less CPU of 15-17 ms, where PyTorch's own backward runs
in C++.

``direct_calls(gm)`` returns a new module over a copy of the graph (the attributes are shared,
not copied) whose nodes call the bindings; ``gm`` keeps its ``OpOverload`` targets, which every
pass and matcher reads, so this is the last thing done to a program before it runs eagerly.

Safety: an op is listed only where its binding runs the same ATen op for the arguments a traced
graph passes, so the values, dtypes and strides are the same bit for bit. Where the binding picks
another overload of that op it is one that computes the same: ``aten.mul.Scalar(x, 2.0)`` is
``aten.mul.Tensor`` of ``x`` and the wrapped number 2.0, which is what ``torch.mul(x, 2.0)`` calls.
``tests/runtime/test_bindings.py`` checks each entry under a dispatch mode that records the ATen
ops reached, and a training step against the graph it came from.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

aten = torch.ops.aten
_VF = torch._C._VariableFunctions

DIRECT_CALLS: dict[torch._ops.OpOverload, Callable] = {
    aten.view.default: torch.Tensor.view,
    aten.reshape.default: _VF.reshape,
    aten.t.default: _VF.t,
    aten.transpose.int: _VF.transpose,
    aten.permute.default: _VF.permute,
    aten.expand.default: torch.Tensor.expand,
    aten.unsqueeze.default: _VF.unsqueeze,
    aten.squeeze.dims: _VF.squeeze,
    aten.split.Tensor: _VF.split,
    aten.cat.default: _VF.cat,
    aten.clone.default: _VF.clone,
    aten.mm.default: _VF.mm,
    aten.bmm.default: _VF.bmm,
    aten.mul.Tensor: _VF.mul,
    aten.mul.Scalar: _VF.mul,
    aten.add.Tensor: _VF.add,
    aten.sub.Tensor: _VF.sub,
    aten.div.Tensor: _VF.div,
    aten.div.Scalar: _VF.div,
    aten.neg.default: _VF.neg,
    aten.pow.Tensor_Scalar: _VF.pow,
    aten.rsqrt.default: _VF.rsqrt,
    aten.sum.dim_IntList: _VF.sum,
    aten.mean.dim: _VF.mean,
    aten.silu.default: torch._C._nn.silu,
    aten.embedding.default: _VF.embedding,
}


def direct_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every op of ``DIRECT_CALLS`` called through its binding (a new module over a
    copy of the graph; ``gm`` is left as it is)."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen  # how inputs and outputs are (un)flattened, unchanged
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if node.op == "call_function" and node.target in DIRECT_CALLS:
            node.target = DIRECT_CALLS[node.target]
    return fx.GraphModule(gm, graph)
