"""Trace a stack of identical decoder layers once, then stamp the other layers' nodes.

Tracing costs about a millisecond per ATen op, so an 80-layer joint graph takes tens of seconds
although its layers are the same ops on the same shapes. Here the model is traced with two
layers (the first and the last; they differ only in what they read and feed), with hooks that
mark where each layer's forward and backward nodes start and end:

    placeholders | P | F0 | F1 | M | B1 | B0 | Q | output

(``P`` the prefix: embedding, rope tables; ``F``/``B`` a layer's forward/backward; ``M`` the head,
loss and the head's backward; ``Q`` the embedding backward). The L-layer graph is written as

    placeholders | P | F0 | F1 x (L-1) | M | B1 x (L-1) | B0 | Q | output

copying ``F1``/``B1`` once per middle layer with its inputs re-bound: the layer's own parameter
placeholders, the previous layer's output (forward) and the next layer's input gradient
(backward). Safety: each copied segment may read only what the rebinding knows (the prefix, its
own layer's forward, one incoming value); anything else (an unexpected cross-layer edge) makes
``stamp`` return None and the caller traces the whole model instead. Copies share their
source's ``meta`` values (same shapes and dtypes); parameter placeholders get their own.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

from shardwise.ir.meta import SEQ_NR


class Seg(enum.Enum):
    PREFIX = "P"
    F0 = "F0"
    F1 = "F1"
    HEAD = "M"
    B1 = "B1"
    B0 = "B0"
    TAIL = "Q"


# Segment order in the two-layer trace; a mark switches to the next segment after the mark node.
TRAIN_ORDER = (Seg.PREFIX, Seg.F0, Seg.F1, Seg.HEAD, Seg.B1, Seg.B0, Seg.TAIL)
INFER_ORDER = (Seg.PREFIX, Seg.F0, Seg.F1, Seg.HEAD)
# The stamped stack's parameter names: "<stack>.<index>.<rest>".
LAYER_NAME = re.compile(r"^(?P<stack>.+?)\.(?P<i>\d+)\.(?P<rest>.+)$")


class StampRefused(Exception):
    """The two-layer graph has an edge the stamping cannot re-bind."""


@dataclass
class Marks:
    """Segment boundaries and the layers' boundary values, recorded by hooks while tracing."""

    ends: list[fx.Node | None] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)
    handles: list = field(default_factory=list)

    def tail(self) -> fx.Node | None:
        mode = get_proxy_mode()
        if mode is None:
            raise StampRefused("hook ran outside the trace")
        nodes = mode.tracer.graph.nodes
        return next(iter(reversed(nodes)), None)

    def node_of(self, t: torch.Tensor) -> fx.Node:
        return get_proxy_slot(t, get_proxy_mode().tracer).proxy.node


def install_marks(stack: nn.ModuleList, train: bool) -> Marks:
    """Hooks on the two layers of ``stack`` that record segment ends (see module docstring)."""
    if len(stack) != 2:
        raise StampRefused("stamping traces exactly two layers")
    marks = Marks()

    def pre(i):
        def hook(mod, args):
            marks.ends.append(marks.tail())  # end of P (i=0) or of F0 (i=1)
            if train and i == 0:
                x = args[0]
                if not x.requires_grad:
                    raise StampRefused("the first layer's input needs a gradient")
                x.register_hook(lambda g: marks.ends.append(marks.tail()))  # end of B0
        return hook

    def post(i):
        def hook(mod, args, out):
            if not isinstance(out, torch.Tensor):
                raise StampRefused("a layer must return one tensor")
            marks.outputs.append(marks.node_of(out))
            if i == 1:
                marks.ends.append(marks.tail())  # end of F1
                if train:
                    out.register_hook(lambda g: marks.ends.append(marks.tail()))  # end of M
            if train and i == 0:
                out.register_hook(lambda g: marks.ends.append(marks.tail()))  # end of B1
        return hook

    for i, layer in enumerate(stack):
        marks.handles.append(layer.register_forward_pre_hook(pre(i)))
        marks.handles.append(layer.register_forward_hook(post(i)))
    return marks


def label_segments(graph: fx.Graph, marks: Marks, train: bool) -> dict[fx.Node, Seg]:
    """Each node's segment, from the recorded segment ends (in graph order)."""
    order = TRAIN_ORDER if train else INFER_ORDER
    # ends arrive in order: P, F0, F1, M, B1, B0 (training) / P, F0, F1 (inference)
    if len(marks.ends) != len(order) - 1 or len(marks.outputs) != 2:
        raise StampRefused(f"expected {len(order) - 1} segment marks, got {len(marks.ends)}")
    labels: dict[fx.Node, Seg] = {}
    k = 0
    for n in graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        labels[n] = order[k]
        while k < len(marks.ends) and n is marks.ends[k]:
            k += 1
    if k != len(marks.ends):
        raise StampRefused("segment marks are not in graph order")
    return labels


def stamp(
    gm: fx.GraphModule,
    labels: dict[fx.Node, Seg],
    layer_out: tuple[fx.Node, fx.Node],
    names: list[str],
    full_names: list[str],
    full_vals: dict[str, torch.Tensor],
    stack: str,
    n_layers: int,
    train: bool,
) -> tuple[fx.Graph, list[str]] | None:
    """The ``n_layers`` graph stamped from the two-layer ``gm`` (see module docstring).

    ``names``: the two-layer trace's parameter names (its leading placeholders); ``full_names``
    / ``full_vals``: the full model's parameter names (in order) and fake values. Returns the new
    graph and its placeholder names for the parameters, or None when an edge cannot be re-bound.
    """
    try:
        return _stamp(gm, labels, layer_out, names, full_names, full_vals, stack, n_layers, train)
    except StampRefused:
        return None


def _split_name(name: str, stack: str) -> tuple[int, str] | None:
    m = LAYER_NAME.match(name)
    if m is None or m["stack"] != stack:
        return None
    return int(m["i"]), m["rest"]


def _stamp(gm, labels, layer_out, names, full_names, full_vals, stack, n_layers, train):
    g = gm.graph
    h0, h1 = layer_out
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    param_ph = dict(zip(names, placeholders[: len(names)], strict=True))
    input_ph = placeholders[len(names):]
    last_params = {}  # rest -> short placeholder of layer 1 (the stamped layer)
    for name, ph in param_ph.items():
        s = _split_name(name, stack)
        if s is not None and s[0] == 1:
            last_params[ph] = s[1]
    seg_of = labels.get

    new = fx.Graph()
    base: dict[fx.Node, fx.Node] = {}
    layer_ph: dict[int, dict[fx.Node, fx.Node]] = {j: {} for j in range(1, n_layers)}
    new_param_names: list[str] = []

    # Placeholders: the full model's parameters in named order, then the inputs.
    for name in full_names:
        s = _split_name(name, stack)
        if s is not None and s[0] >= 1:
            src = next((ph for ph, rest in last_params.items() if rest == s[1]), None)
            if src is None:
                raise StampRefused(f"no traced parameter for {name}")
            ph = new.placeholder(_ph_name(len(new_param_names)))
            ph.meta = dict(src.meta)
            layer_ph[s[0]][src] = ph
        else:
            if name not in param_ph:
                raise StampRefused(f"no traced parameter for {name}")
            src = param_ph[name]
            ph = new.placeholder(_ph_name(len(new_param_names)))
            ph.meta = dict(src.meta)
            base[src] = ph
        ph.meta["val"] = full_vals[name]
        new_param_names.append(ph.name)
    for i, ph in enumerate(input_ph):
        base[ph] = new.placeholder(_ph_name(len(new_param_names) + i))
        base[ph].meta = dict(ph.meta)

    seq = SeqShift.of(g, labels, n_layers)

    def copy_segment(seg: Seg, lookup: Callable[[fx.Node], fx.Node], shift: int = 0,
                     ) -> dict[fx.Node, fx.Node]:
        env: dict[fx.Node, fx.Node] = {}
        for n in g.nodes:
            if seg_of(n) is seg:
                env[n] = new.node_copy(n, lambda a: env[a] if a in env else lookup(a))
                seq.apply(env[n], shift)
        return env

    def from_base(a: fx.Node) -> fx.Node:
        if a not in base:
            raise StampRefused(f"{a.name} is read across a segment the stamping cannot re-bind")
        return base[a]

    base.update(copy_segment(Seg.PREFIX, from_base))
    base.update(copy_segment(Seg.F0, from_base))

    # Forward of layers 1 .. n-1: copies of F1, reading layer j-1's output and layer j's params.
    fwd: dict[int, dict[fx.Node, fx.Node]] = {}
    out_of = {0: base[h0]}
    for j in range(1, n_layers):
        def fwd_lookup(a, j=j):
            if a is h0:
                return out_of[j - 1]
            if a in last_params:
                return layer_ph[j][a]
            if seg_of(a) in (Seg.PREFIX, None):
                return from_base(a)
            raise StampRefused(f"layer forward reads {a.name} from another layer")
        fwd[j] = copy_segment(Seg.F1, fwd_lookup, (j - 1) * seq.span)
        out_of[j] = fwd[j][h1]
    last = n_layers - 1

    def head_lookup(a):
        if seg_of(a) is Seg.F1:
            return fwd[last][a]
        if a in last_params:
            return layer_ph[last][a]
        return from_base(a)

    base.update(copy_segment(Seg.HEAD, head_lookup))
    if train:
        b1 = [n for n in g.nodes if seg_of(n) is Seg.B1]
        b1_set = set(b1)
        incoming = {a for n in b1 for a in n.all_input_nodes if seg_of(a) is Seg.HEAD}
        later = [n for n in g.nodes if seg_of(n) in (Seg.B0, Seg.TAIL) or n.op == "output"]
        outgoing_nodes = {a for n in later for a in n.all_input_nodes if a in b1_set}
        out_node = next(n for n in reversed(g.nodes) if n.op == "output")
        grads = list(out_node.args[0])[1:]
        grad_of_short = dict(zip(names, grads, strict=True))
        layer_grad_nodes = {grad_of_short[n] for n, ph in param_ph.items() if ph in last_params}
        dh = outgoing_nodes - layer_grad_nodes
        if len(incoming) != 1 or len(dh) != 1:
            raise StampRefused("a layer's backward must read one incoming and give one outgoing gradient")
        (g_in,), (dh0,) = incoming, dh
        bwd: dict[int, dict[fx.Node, fx.Node]] = {}
        dh_of: dict[int, fx.Node] = {}
        for j in range(last, 0, -1):
            def bwd_lookup(a, j=j):
                if a is g_in:
                    return base[a] if j == last else dh_of[j + 1]
                if a is h0:
                    return out_of[j - 1]
                if a in last_params:
                    return layer_ph[j][a]
                s = seg_of(a)
                if s is Seg.F1:
                    return fwd[j][a]
                if s in (Seg.PREFIX, None):
                    return from_base(a)
                raise StampRefused(f"layer backward reads {a.name} from another segment")
            bwd[j] = copy_segment(Seg.B1, bwd_lookup, (j - 1) * seq.span)
            dh_of[j] = bwd[j][dh0]

        def late_lookup(a):
            if a is dh0:
                return dh_of[1]
            if seg_of(a) in (Seg.B1, Seg.F1):
                raise StampRefused(f"{a.name} is read after its layer")
            return from_base(a)

        base.update(copy_segment(Seg.B0, late_lookup))
        base.update(copy_segment(Seg.TAIL, late_lookup))
        results = [late_lookup(out_node.args[0][0])]
        for name in full_names:
            s = _split_name(name, stack)
            if s is not None and s[0] >= 1:
                short = grad_of_short[f"{stack}.1.{s[1]}"]
                if short is None:
                    results.append(None)
                elif seg_of(short) is Seg.B1:
                    results.append(bwd[s[0]][short])
                else:
                    raise StampRefused(f"the gradient of {name} is not computed in its layer")
            else:
                short = grad_of_short[name]
                results.append(None if short is None else late_lookup(short))
        out = new.output(tuple(results))
    else:
        out_node = next(n for n in reversed(g.nodes) if n.op == "output")
        out = new.output(tuple(head_lookup(a) if isinstance(a, fx.Node) else a for a in out_node.args[0]))
    out.meta = dict(out_node.meta)
    seq.apply(out, 0)
    new.lint()
    return new, new_param_names


@dataclass(frozen=True)
class SeqShift:
    """Autograd sequence numbers (``meta["seq_nr"]``) of stamped nodes.

    Every layer creates the same autograd nodes, so layer ``j``'s numbers are layer 1's plus
    ``(j - 1) * span`` (``span``: the distance between two layers' first numbers). Numbers from
    ``first_after`` on (the head's, and the "current" number that gradient accumulations carry)
    move past the ``n_layers - 2`` inserted layers. Backward nodes carry their forward node's
    number, so they move with it; numbers of the prefix and the first layer stay.
    """

    lo: int = 0
    first_after: int = 0
    span: int = 0
    head_shift: int = 0

    @staticmethod
    def of(graph: fx.Graph, labels: dict[fx.Node, Seg], n_layers: int) -> SeqShift:
        def seqs(seg):
            return [n.meta[SEQ_NR] for n in graph.nodes if labels.get(n) is seg and SEQ_NR in n.meta]
        f0, f1 = seqs(Seg.F0), seqs(Seg.F1)
        if not f0 or not f1:
            return SeqShift()
        span = min(f1) - min(f0)
        return SeqShift(lo=min(f1), first_after=max(f1) + 1, span=span, head_shift=(n_layers - 2) * span)

    def apply(self, node: fx.Node, layer_shift: int) -> None:
        """Renumber a copied node: head numbers by ``head_shift``, its layer's by ``layer_shift``."""
        s = node.meta.get(SEQ_NR)
        if not isinstance(s, int) or self.span == 0:
            return
        if s >= self.first_after:
            node.meta[SEQ_NR] = s + self.head_shift
        elif s >= self.lo:
            node.meta[SEQ_NR] = s + layer_shift


def identical_layers(layers: nn.ModuleList) -> bool:
    """Every layer is the same class with the same parameters (names, shapes, dtypes, grads),
    buffers and training flag, so one layer's nodes stand for all."""
    def signature(m: nn.Module):
        return (type(m), m.training,
                [(k, tuple(p.shape), p.dtype, p.requires_grad) for k, p in m.named_parameters()],
                [(k, tuple(b.shape), b.dtype) for k, b in m.named_buffers()],
                [(k, type(c)) for k, c in m.named_modules()])
    first = signature(layers[0])
    return all(signature(m) == first for m in layers)


def find_stack(module: nn.Module, n_layers: int) -> str | None:
    """The dotted name of the ``nn.ModuleList`` named ``layers`` holding ``n_layers`` layers."""
    for name, m in module.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) == n_layers and name.rpartition(".")[2] == "layers":
            return name
    return None


def _ph_name(index: int) -> str:
    """make_fx's placeholder names, so a stamped graph reads like a fully traced one."""
    return f"arg{index}_1"


def trace_stacked(module: nn.Module, stack: str, inputs: tuple, *, train: bool, fake_mode,
                  model_name: str = ""):
    """Trace ``module`` whose submodule ``stack`` (a dotted name) is an ``nn.ModuleList`` of
    identical layers by tracing two of them and stamping the rest; None when stamping is refused
    (the module is always left as it was)."""
    from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

    from shardwise.ir.trace import Traced, trace

    parent, _, attr = stack.rpartition(".")
    owner = module.get_submodule(parent)
    layers = getattr(owner, attr)
    n_layers = len(layers)
    full = list(module.named_parameters())
    if n_layers <= 2 or not identical_layers(layers) or (train and not all(p.requires_grad for _, p in full)):
        return None
    short = nn.ModuleList([layers[0], layers[1]])
    setattr(owner, attr, short)
    marks = install_marks(short, train)
    try:
        traced = trace(module, *inputs, train=train, fake_mode=fake_mode, model_name=model_name)
        labels = label_segments(traced.gm.graph, marks, train)
    except StampRefused:
        return None
    finally:
        for h in marks.handles:
            h.remove()
        setattr(owner, attr, layers)
    names = list(traced.params)
    full_names = [k for k, _ in full]
    result = stamp(traced.gm, labels, (marks.outputs[0], marks.outputs[1]), names, full_names,
                   dict(full), stack, n_layers, train)
    if result is None:
        return None
    graph, ph_names = result
    with _use_lazy_graph_module(True):
        gm = _make_graph_module(traced.gm, graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    results = list(out.args[0])
    new = Traced(gm=gm, train=train, params=dict(zip(full_names, ph_names, strict=True)),
                 inputs=[n.name for n in placeholders[len(full_names):]], model_name=model_name,
                 output_tree=traced.output_tree)
    if train:
        new.loss = results[0].name
        grads = zip(full_names, results[1:], strict=True)
        new.grads = {k: r.name for k, r in grads if isinstance(r, fx.Node)}
    else:
        new.outputs = [r.name for r in results if isinstance(r, fx.Node)]
    new.refresh_phases()
    return new
