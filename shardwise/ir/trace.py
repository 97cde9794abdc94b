"""Trace a model into one functional ATen fx graph on fake tensors.

Training (``train=True``): the graph computes ``(loss, *grads)`` for every trainable parameter:
forward and backward in one joint graph. Inference: the graph computes the model's outputs.
Parameters are graph placeholders (first, in ``named_parameters`` order), then the example
inputs. Everything runs under a ``FakeTensorMode``: no parameter memory is ever allocated, so a
70B model traces on a laptop; every tensor node carries ``meta["val"]``, a FakeTensor.
"""

from __future__ import annotations

import enum
import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch import fx, nn
from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

from shardwise.errors import UserError, first_line
from shardwise.gcpause import paused_gc
from shardwise.ir.stamp import StampRefused
from shardwise.stdio import quiet_logger

T = TypeVar("T")
# Logs a fake kernel's failure with its traceback, on stderr, before the error is raised.
FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass
class Traced:
    """A traced step and what each placeholder and output means.

    ``params`` maps a parameter name to its placeholder's node name; ``grads`` maps it to the
    name of the node whose value is returned as its gradient. ``inputs`` lists the placeholders of
    the example inputs; ``loss`` (training) or ``outputs`` (inference) name the returned nodes;
    ``output_tree`` (inference) is how the forward nested them (a tuple, a dict, a transformers
    ``ModelOutput``): the graph returns its leaves in order.
    """

    gm: fx.GraphModule
    train: bool
    params: dict[str, str]
    inputs: list[str]
    grads: dict[str, str] = field(default_factory=dict)
    loss: str | None = None
    outputs: list[str] = field(default_factory=list)
    phases: dict[str, Phase] = field(default_factory=dict)
    model_name: str = ""
    output_tree: pytree.TreeSpec | None = None
    # A buffer the forward reads is traced as a fake graph constant: the buffer each constant is
    # (its attribute name in ``gm`` -> the module's buffer name), so that it gets its own real
    # value where several buffers share a shape (GPT-Neo's global and local attention masks).
    constant_buffers: dict[str, str] = field(default_factory=dict)
    _index: dict[str, fx.Node] = field(default_factory=dict, repr=False, compare=False)
    _analyses: dict[str, tuple[int, object]] = field(default_factory=dict, repr=False, compare=False)

    def node(self, name: str) -> fx.Node:
        """The node called ``name``; the index is rebuilt when a pass has renamed, replaced or
        erased what it holds (callers ask thousands of times per plan)."""
        n = self._index.get(name)
        if n is None or n.name != name or n.graph is not self.gm.graph or n._erased:
            self._index = _node_index(self.gm)
            n = self._index[name]
        return n

    def phase(self, node: fx.Node) -> Phase:
        return self.phases.get(node.name, Phase.FORWARD)

    def param_of_placeholder(self) -> dict[str, str]:
        return {v: k for k, v in self.params.items()}

    def analysis(self, name: str, compute: Callable[[fx.GraphModule], T]) -> T:
        """``compute(gm)``, kept under ``name`` until the graph changes: an analysis of the graph
        alone, which every plan of it reads (the step schedule's segmentation of a compiled
        step: 5 s on llama3-70b's 80 layers, once for the dozen plans a budget fit prices)."""
        key = _graph_key(self.gm)
        hit = self._analyses.get(name)
        if hit is None or hit[0] != key:
            hit = self._analyses[name] = (key, compute(self.gm))
        return hit[1]

    def refresh_phases(self) -> None:
        """Recompute forward/backward marks after a pass changed the graph."""
        self.phases = _phases(self.gm, self.train)


def _node_index(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def _graph_key(gm: fx.GraphModule) -> int:
    """A hash of the graph's nodes and edges, by identity: any pass that adds, erases or rewires a
    node changes it."""
    return hash(tuple((id(n), n.target, tuple(map(id, n.all_input_nodes))) for n in gm.graph.nodes))


def forward_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The loss (a training graph's first output) and everything it depends on."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    results = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    fwd: set[fx.Node] = set()
    stack = [results[0]] if results and isinstance(results[0], fx.Node) else []
    while stack:
        n = stack.pop()
        if n in fwd:
            continue
        fwd.add(n)
        stack.extend(n.all_input_nodes)
    # A getitem of a forward op (attention's logsumexp, read only by the backward) is forward too.
    for n in gm.graph.nodes:
        if n.target is operator.getitem and n.args[0] in fwd:
            fwd.add(n)
    return fwd


def _phases(gm: fx.GraphModule, train: bool) -> dict[str, Phase]:
    """Forward = the loss and everything it depends on; the rest of a training graph is backward."""
    if not train:
        return {n.name: Phase.FORWARD for n in gm.graph.nodes}
    fwd = forward_nodes(gm)
    return {n.name: (Phase.FORWARD if n in fwd or n.op == "placeholder" else Phase.BACKWARD)
            for n in gm.graph.nodes}


aten = torch.ops.aten
# In-place ops whose functional form is not their name without the trailing underscore.
_FUNCTIONAL_FORMS = {aten.bernoulli_.float: aten.bernoulli.p}


def _functional_form(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``op``'s functional twin (``div_.Scalar`` -> ``div.Scalar``), None if it has none."""
    if op in _FUNCTIONAL_FORMS:
        return _FUNCTIONAL_FORMS[op]
    name = op._schema.name.split("::")[-1]
    packet = getattr(aten, name[:-1], None) if name.endswith("_") else None
    fn = getattr(packet, op._overloadname, None) if packet is not None else None
    return fn if fn is not None and not fn._schema.is_mutable else None


def _writes_first_only(op: torch._ops.OpOverload) -> bool:
    args = op._schema.arguments
    written = [a.alias_info is not None and a.alias_info.is_write for a in args]
    return bool(written) and written[0] and not any(written[1:])


def _replace_by_call(node: fx.Node, target: object, args: tuple, kwargs: dict) -> None:
    """``node`` becomes a call of ``target`` with the same value (its meta kept)."""
    with node.graph.inserting_before(node):
        new = node.graph.call_function(target, tuple(args), kwargs)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)


def _functionalize_fresh(gm: fx.GraphModule) -> None:
    """An in-place op on a buffer that the graph made and nothing else reads becomes its
    functional form. Dropout traces as ``mask = bernoulli_(empty_like(x), 1 - p)`` then
    ``div_(mask, 1 - p)``: no other op sees the buffer before or after the write, so
    ``bernoulli(empty_like(x), 1 - p)`` and ``div(mask, 1 - p)`` give every reader the same
    values."""
    graph = gm.graph
    for n in list(graph.nodes):
        op = n.target
        if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or not op._schema.is_mutable:
            continue
        buf = n.args[0] if n.args else None
        fn = _functional_form(op)
        if (fn is None or not _writes_first_only(op) or not isinstance(buf, fx.Node)
                or buf.op != "call_function" or len(buf.users) != 1):
            continue
        _replace_by_call(n, fn, n.args, n.kwargs)


# Random draws shaped like a value, and the same draws made from the shape alone (for a
# contiguous value: the kernels fill the same layout in the same order).
_DRAWS_FROM_SHAPE = {aten.rand_like.default: aten.rand.default, aten.randn_like.default: aten.randn.default}


def _draws_from_shapes(gm: fx.GraphModule) -> None:
    """Random draws read no value, only a shape: ``bernoulli(empty_like(x), p)`` draws into
    ``empty_strided`` of x's shape and strides, ``randn_like(x)`` becomes ``randn`` of x's shape.
    The planner then need not move x to draw (a draw is planned replicated,
    ``plan/strategies.py``), and a draw is no value carrying the batch that a data-parallel hand
    plan must keep split (``plan/baselines.py``)."""
    graph = gm.graph
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        src = n.args[0] if n.args else None
        if not isinstance(src, fx.Node):
            continue
        if n.target is aten.bernoulli.p and src.target is aten.empty_like.default and len(src.users) == 1:
            val = src.meta["val"]
            _replace_by_call(src, aten.empty_strided.default, (list(val.shape), list(val.stride())),
                             {"dtype": val.dtype, "device": val.device})
        elif n.target in _DRAWS_FROM_SHAPE and src.meta["val"].is_contiguous():
            val = n.meta["val"]
            _replace_by_call(n, _DRAWS_FROM_SHAPE[n.target], (list(val.shape),),
                             {"dtype": val.dtype, "device": val.device})


def _check_functional(gm: fx.GraphModule) -> None:
    """One clear sentence for a graph shardwise cannot plan: what the model does that it needs
    it not to, and what to change."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) \
                or not n.target._schema.is_mutable:
            continue
        op = n.target._schema.name.replace("::", ".")
        written = n.args[0] if n.args else None
        if isinstance(written, fx.Node) and written.op in ("placeholder", "get_attr"):
            raise UserError(f"the model's forward writes a parameter, buffer or input in place ({op}; "
                            "BatchNorm's running statistics, for one); shardwise needs a forward that only "
                            "reads them (freeze such layers with .eval() or track_running_stats=False).")
        raise UserError(f"the traced graph writes a tensor in place ({op}) that other ops read; shardwise "
                        "needs a functional graph.")


def trace(
    model: nn.Module,
    *example_inputs: torch.Tensor,
    train: bool = True,
    fake_mode: FakeTensorMode | None = None,
    model_name: str = "",
) -> Traced:
    """Trace ``model`` on ``example_inputs`` into a joint (or forward-only) ATen graph.

    ``model`` may hold real or fake parameters; the trace itself always runs on fake tensors.
    In training mode the model's forward must return a scalar loss.
    """
    # Every parameter is a placeholder; a training step differentiates the trainable ones
    # (frozen ones get no gradient output: None in their slot).
    named = list(model.named_parameters())
    names = [k for k, _ in named]
    trainable = [train and p.requires_grad for _, p in named]
    mode = fake_mode or _mode_of([p for _, p in named], example_inputs) or FakeTensorMode()
    params = [_to_fake(mode, p) for _, p in named]
    inputs = [_to_fake(mode, x) for x in example_inputs]
    buffers = {k: _to_fake(mode, b) for k, b in model.named_buffers()}
    n_params = len(params)
    output_tree: list[pytree.TreeSpec] = []

    def step(*flat: torch.Tensor):
        ps = flat[:n_params]
        state = {**buffers, **dict(zip(names, ps, strict=True))}
        out = functional_call(model, state, tuple(flat[n_params:]))
        if not train:
            leaves, tree = pytree.tree_flatten(out)
            other = next((x for x in leaves if x is not None and not isinstance(x, torch.Tensor)), None)
            if other is not None:
                raise UserError(f"the forward returns a {type(other).__name__} among its outputs; an "
                                "inference program returns tensors (a transformers model: set "
                                "config.use_cache = False).")
            output_tree.append(tree)
            return tuple(leaves)
        if not (isinstance(out, torch.Tensor) and out.dim() == 0):
            raise UserError("a training trace needs a model whose forward returns a scalar loss.")
        # Backward nodes take the seq_nr of the forward node they differentiate (as in
        # aot_autograd), so forward/backward pairs can be matched in the joint graph.
        setup_stacktrace_preservation_hooks([out.grad_fn])
        wrt = [p for p, t in zip(ps, trainable, strict=True) if t]
        grads = iter(torch.autograd.grad(out, wrt, allow_unused=True) if wrt else ())
        return (out, *[next(grads) if t else None for t in trainable])

    with mode:
        if train:
            params = [p.detach().requires_grad_(t) for p, t in zip(params, trainable, strict=True)]
        # A lazy GraphModule generates its Python code on first call, not on every recompile():
        # tracing and canonicalising a 7,500-node graph would otherwise regenerate and compile
        # its code once per pass (seconds each at 32 layers) for a graph nobody runs here.
        with _use_lazy_graph_module(True), fx_traceback.preserve_node_meta():
            try:
                # A failing op's fake kernel is logged with its traceback before it raises: the
                # error below says it in one sentence instead.
                with quiet_logger(FAKE_TENSOR_LOG, logging.CRITICAL):
                    gm = make_fx(step, tracing_mode="real", record_module_stack=True)(*params, *inputs)
            except (UserError, StampRefused):
                raise
            except Exception as e:
                # The model's own forward failed on these shapes, or uses an op without a fake
                # (meta) kernel: a model shardwise cannot take, said in one sentence.
                raise UserError("the model's forward cannot be traced on fake tensors: "
                                f"{first_line(e)}") from e
    _functionalize_fresh(gm)
    _draws_from_shapes(gm)
    _check_functional(gm)
    if gm.graph.eliminate_dead_code():
        gm.recompile()

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    results = list(out_node.args[0])
    traced = Traced(
        gm=gm,
        train=train,
        params={k: placeholders[i].name for i, k in enumerate(names)},
        inputs=[n.name for n in placeholders[n_params:]],
        model_name=model_name,
        output_tree=output_tree[0] if output_tree else None,
        constant_buffers=_constant_buffers(gm, buffers),
    )
    if train:
        traced.loss = results[0].name
        traced.grads = {k: g.name for k, g in zip(names, results[1:], strict=True) if isinstance(g, fx.Node)}
    else:
        traced.outputs = [r.name for r in results if isinstance(r, fx.Node)]
    traced.refresh_phases()
    return traced


def graph_constants(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """The tensors ``gm`` holds as attributes (buffers and plain tensor attributes), by name."""
    consts = dict(gm.named_buffers())
    consts.update({k: v for k, v in vars(gm).items() if isinstance(v, torch.Tensor)})
    return consts


def _constant_buffers(gm: fx.GraphModule, buffers: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each constant of ``gm`` that is one of ``buffers`` (the same object): its buffer's name."""
    name_of = {id(b): k for k, b in buffers.items()}
    return {k: name_of[id(v)] for k, v in graph_constants(gm).items() if id(v) in name_of}


def _mode_of(params: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> FakeTensorMode | None:
    from torch._guards import detect_fake_mode

    return detect_fake_mode([*params, *inputs])


def _to_fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t, FakeTensor):
        return t
    return mode.from_tensor(t, static_shapes=True)


@paused_gc()
def trace_model(
    name: str,
    *,
    train: bool = True,
    layers: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    dtype: str | torch.dtype | None = None,
    stamp_layers: bool = True,
) -> Traced:
    """Build a named model on fake tensors and trace it (see ``shardwise.models.get_model``).

    ``stamp_layers``: trace two of the built-in llama's identical layers and copy the others'
    nodes (same graph, many times faster); False traces every layer.
    """
    from shardwise.models import get_model

    spec = get_model(name, layers=layers, batch=batch, seq=seq, dtype=dtype)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        module = spec.build_module()
        if not train:
            module.eval()
    inputs = spec.example_inputs(train)
    if stamp_layers:
        from shardwise.ir.stamp import find_stack, trace_stacked

        stack = find_stack(module, spec.n_layers)
        if stack is not None and _uniform_layer_types(module):
            # Identical decoder layers: trace two, stamp the rest (see ir/stamp.py); None when
            # the graph does not allow it, and then the whole model is traced.
            stamped = trace_stacked(module, stack, inputs, train=train, fake_mode=mode, model_name=name)
            if stamped is not None:
                return stamped
    return trace(module, *inputs, train=train, fake_mode=mode, model_name=name)


def _uniform_layer_types(module: nn.Module) -> bool:
    """A transformers config may give layers different attention (``layer_types``: sliding vs
    full); such layers are not copies of each other."""
    for m in module.modules():
        types = getattr(getattr(m, "config", None), "layer_types", None)
        if types is not None and len(set(types)) > 1:
            return False
    return True
