"""GraphModules to and from bytes, for ranks that run in processes of their own.

``pickle`` cannot take a lowered program as it is: ``torch.fx.GraphModule`` pickles as Python
source that the receiver re-traces, and that tracer runs every call whose arguments are all
constants, collectives included, at load time (before the groups exist, and out of order); op
overloads do not pickle at all. So a graph travels as rows, one per node: op, name, target,
arguments (nodes named, not embedded), plus the module attributes its ``get_attr`` nodes read.
Op overloads travel by name and are looked up on arrival, where the ops must be registered (the
caller imports their namespaces first). Node metadata (fake values) stays behind.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass

import torch
from torch import fx


@dataclass(frozen=True)
class _NodeRef:
    name: str


@dataclass
class WireGraph:
    rows: list[tuple[str, str, object, tuple, dict]]  # (op, name, target, args, kwargs)
    attrs: dict[str, object]  # get_attr target -> value

    @classmethod
    def of(cls, gm: fx.GraphModule) -> WireGraph:
        def refs(a: object) -> object:
            return fx.node.map_arg(a, lambda n: _NodeRef(n.name))

        rows, attrs = [], {}
        for n in gm.graph.nodes:
            rows.append((n.op, n.name, n.target, refs(n.args), refs(n.kwargs)))
            if n.op == "get_attr":
                attrs[n.target] = _get_attr(gm, n.target)
        return cls(rows, attrs)

    def module(self) -> fx.GraphModule:
        graph = fx.Graph()
        env: dict[str, fx.Node] = {}

        def node(a: object) -> object:
            return env[a.name] if isinstance(a, _NodeRef) else a

        for op, name, target, args, kwargs in self.rows:
            args = fx.node.map_aggregate(args, node)
            kwargs = fx.node.map_aggregate(kwargs, node)
            if op == "output":
                graph.output(args[0])
                continue
            env[name] = graph.create_node(op, target, args, kwargs, name=name)
        root = torch.nn.Module()
        for path, value in self.attrs.items():
            _set_attr(root, path, value)
        return fx.GraphModule(root, graph)


def _get_attr(module: torch.nn.Module, path: str) -> object:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _set_attr(root: torch.nn.Module, path: str, value: object) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        if not hasattr(root, part):
            root.add_module(part, torch.nn.Module())
        root = getattr(root, part)
    setattr(root, leaf, value)


def _op_named(namespace: str, name: str, overload: str) -> torch._ops.OpOverload:
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: object):
        if isinstance(obj, torch._ops.OpOverload):
            return _op_named, (obj.namespace, obj._opname, obj._overloadname)
        return NotImplemented


def dumps(obj: object) -> bytes:
    """``pickle.dumps`` that also takes op overloads (by name)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()
