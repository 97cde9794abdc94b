"""Simplify a per-rank program before it runs: drop the layout bookkeeping that tracing,
canonicalisation and lowering leave behind, and fold what reads no input.

A lowered training step of a 4-layer model holds ~1,700 nodes, ~650 of them views; the program
runs op by op from Python, so each costs a dispatcher call (a few microseconds) that PyTorch's
eager backward, running in C++, does not pay. Rewrites::

    view(x, shape(x))                     -> x                    (identity reshape)
    view(view(x, a), b)                   -> view(x, b)           (reshape chains: one reshape)
    permute(permute(x, p), q)             -> permute(x, p o q)    (t / transpose / permute)
    permute(x, identity)                  -> x
    v(x, a) and again v(x, a)             -> one node             (any view op: view, t, expand...)
    detach(x), detach_(x), alias(x)       -> x
    ones_like(wait(all_reduce(x)))        -> ones_like(x)         (any *_like: reads only metadata)
    f(no input)                           -> a constant, computed once (rotary tables...)

Safety: the layout rewrites keep every reader on the same storage (a view of a view is a view of
the source; an identity view, a transpose pair or a detach reads the source itself), so a reader
sees the same values even where an op writes in place (an embedding gradient's ``index_put_``);
so does a view shared by its duplicates (the backward's ``view(x, [M, K])`` for a weight's
gradient is the forward's). Two rewrites would not, and run only in a graph where no op writes
in place: a reshape chain whose source is not contiguous becomes a ``reshape`` (which may copy),
and folding constants (a folded buffer written in place would carry one step's writes into the
next). A chain over a contiguous source becomes a ``view`` (a view of it to any shape of the
same size exists). A ``*_like`` factory reads only its input's shape, dtype and device, which an
all_reduce keeps, so it need not wait for one (the backward's seed gradient then does not wait
for the loss's all_reduce). Composition needs every node's recorded shape (``meta['val']``); a
node without one is left as it is. A subgraph is folded only when all its inputs are real (not
fake) constants, it holds no collective or random op, and its result is at most
``CONST_FOLD_MAX_BYTES`` (a large factory output is cheaper to make each step than to keep: the
segmentation pass's rule); the result becomes a buffer of the module.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from shardwise.ir.match import (
    AUTOGRAD_ONLY_INPLACE_OPS,
    LIKE_OPS,
    PERMUTE_OPS,
    RESHAPE_OPS,
    VIEW_OPS,
    CollectiveKind,
    collective,
    is_op,
    writes_in_place,
)

aten = torch.ops.aten
_ALIAS_OPS = (aten.detach.default, aten.alias.default, *AUTOGRAD_ONLY_INPLACE_OPS)
# Small tables (rotary cos/sin, masks of a few rows) are worth keeping; a folded constant holds
# memory for the whole run, so anything bigger is left to be recomputed.
CONST_FOLD_MAX_BYTES = 1 << 20
_FOLDED_PREFIX = "_folded_"


@dataclass
class Counts:
    aliases: int = 0
    metadata_reads: int = 0
    reshapes: int = 0
    permutes: int = 0
    shared_views: int = 0
    folded: int = 0

    @property
    def total(self) -> int:
        return (self.aliases + self.metadata_reads + self.reshapes + self.permutes + self.shared_views
                + self.folded)


def _val(node: object) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _permutation(node: fx.Node) -> list[int] | None:
    """The dim order ``node`` (a t / transpose / permute) applies to its input."""
    src = _val(node.args[0])
    if src is None:
        return None
    ndim = src.dim()
    if node.target is aten.permute.default:
        return [d % ndim for d in node.args[1]]
    order = list(range(ndim))
    if node.target is aten.t.default:
        if ndim < 2:
            return order
        a, b = 0, 1
    else:
        a, b = node.args[1] % ndim, node.args[2] % ndim
    order[a], order[b] = order[b], order[a]
    return order


def _replace(node: fx.Node, value: fx.Node) -> None:
    node.replace_all_uses_with(value)
    node.graph.erase_node(node)


def _fold_aliases(graph: fx.Graph, counts: Counts) -> None:
    for node in list(graph.nodes):
        if is_op(node, *_ALIAS_OPS) and isinstance(node.args[0], fx.Node):
            _replace(node, node.args[0])
            counts.aliases += 1


def _skip_all_reduces(graph: fx.Graph, counts: Counts) -> None:
    for node in list(graph.nodes):
        if not is_op(node, *LIKE_OPS) or not isinstance(node.args[0], fx.Node):
            continue
        c = collective(node.args[0])
        if c is not None and c.kind is CollectiveKind.ALL_REDUCE and c.value is node.args[0]:
            node.update_arg(0, c.input)
            counts.metadata_reads += 1


def _fold_layout(graph: fx.Graph, counts: Counts, *, may_copy: bool) -> None:
    """One sweep in graph order: each reshape / permute reads past a producer of its own kind,
    then disappears if it is the identity. Without ``may_copy`` a reshape chain folds only onto
    a contiguous source (a view, never a copy)."""
    for node in list(graph.nodes):
        if is_op(node, *RESHAPE_OPS):
            src, val = node.args[0], _val(node)
            if not isinstance(src, fx.Node) or val is None:
                continue
            if is_op(src, *RESHAPE_OPS) and (inner := _val(src.args[0])) is not None \
                    and (may_copy or inner.is_contiguous()):
                src = src.args[0]
                target = aten.view.default if inner.is_contiguous() else aten.reshape.default
                node.target, node.args = target, (src, list(val.shape))
                counts.reshapes += 1
            if _val(src) is not None and tuple(_val(src).shape) == tuple(val.shape):
                _replace(node, src)
                counts.reshapes += 1
        elif is_op(node, *PERMUTE_OPS):
            order = _permutation(node)
            if order is None:
                continue
            src = node.args[0]
            if is_op(src, *PERMUTE_OPS) and (inner := _permutation(src)) is not None:
                order = [inner[d] for d in order]
                src = src.args[0]
                node.target, node.args, node.kwargs = aten.permute.default, (src, order), {}
                counts.permutes += 1
            if order == sorted(order):
                _replace(node, src)
                counts.permutes += 1


def _frozen(value: object) -> object:
    """``value`` (a node's argument) as a hashable key: lists become tuples."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def _share_views(graph: fx.Graph, counts: Counts) -> None:
    """Each view of the same input with the same arguments becomes the first one made."""
    first: dict[object, fx.Node] = {}
    for node in list(graph.nodes):
        if not is_op(node, *VIEW_OPS):
            continue
        key = (node.target, _frozen(node.args), _frozen(node.kwargs))
        try:
            hash(key)
        except TypeError:  # an argument that is no plain value (a slice object...): left alone
            continue
        if key in first:
            _replace(node, first[key])
            counts.shared_views += 1
        else:
            first[key] = node


def _foldable(node: fx.Node, constant: set[fx.Node]) -> bool:
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None or schema.is_mutable or node.target.namespace != "aten":
        return False
    if torch.Tag.nondeterministic_seeded in node.target.tags:
        return False
    inputs = node.all_input_nodes
    return all(n in constant for n in inputs)


def _fold_constants(gm: fx.GraphModule, counts: Counts) -> None:
    graph = gm.graph
    values: dict[fx.Node, torch.Tensor] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            v = getattr(gm, node.target, None)
            if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor):
                values[node] = v
        elif _foldable(node, values.keys()):
            args = fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
            out = node.target(*args[0], **args[1])
            if isinstance(out, torch.Tensor):
                values[node] = out
    folded = 0
    for node, value in values.items():
        if node.op != "call_function" or value.numel() * value.element_size() > CONST_FOLD_MAX_BYTES:
            continue
        if all(u in values and u.op == "call_function" for u in node.users):
            continue  # only its folded consumers read it
        name = next(n for i in itertools.count() if not hasattr(gm, n := f"{_FOLDED_PREFIX}{i}"))
        gm.register_buffer(name, value)
        with graph.inserting_before(node):
            attr = graph.get_attr(name)
        attr.meta = dict(node.meta)
        node.replace_all_uses_with(attr)
        folded += 1
    graph.eliminate_dead_code()
    counts.folded += folded


def is_functional(graph: fx.Graph) -> bool:
    """No node writes its inputs' data in place."""
    return not any(writes_in_place(n) for n in graph.nodes)



def apply(gm: fx.GraphModule, *, fold_constants: bool = True) -> int:
    """Simplify ``gm`` in place; returns the number of rewrites."""
    functional = is_functional(gm.graph)
    counts = Counts()
    _fold_aliases(gm.graph, counts)
    _skip_all_reduces(gm.graph, counts)
    _fold_layout(gm.graph, counts, may_copy=functional)
    _share_views(gm.graph, counts)
    if fold_constants and functional:
        _fold_constants(gm, counts)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return counts.total
