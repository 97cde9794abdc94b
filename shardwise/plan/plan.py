"""A sharding plan: the placement every node computes and the placements it reads its inputs in.

``NodeSpec.output`` holds one ``Placements`` per tensor output of a node (one for most ops; one
per element for tuple-returning ops such as attention); ``NodeSpec.inputs`` one per tensor
argument, in ``tensor_args(node)`` order, or ``None`` where the plan does not constrain it.
A consumer reading a producer's output in another placement implies a redistribution, which is
where every collective of the plan comes from.

``Plan.ac`` (``ACChoice``, optional) is the activation checkpointing the plan runs: per cluster of
identical decoder layers, how many of them run none, selective or full (``plan/checkpointing.py``
chooses it); a plan file without it (older files) runs no checkpointing unless told.

Plans are saved as versioned JSON; a plan is tied to its model, its mesh and its graph (the
graph fingerprint), and ``Plan.load`` + ``check_matches`` refuse one made for something else.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import fx

from shardwise.errors import UserError
from shardwise.ir.meta import flat_leaves
from shardwise.mesh import Mesh
from shardwise.passes.remat import ACPolicy, LayerPolicies
from shardwise.plan.placement import Placements, parse_placements, placements_str

PLAN_FORMAT_VERSION = 1


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued argument nodes of ``node`` in flattened (args, kwargs) order."""
    nodes = flat_leaves((node.args, node.kwargs), fx.Node)
    return [a for a in nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """A short hash of the graph's ops and shapes: a plan only applies to the graph it was made for."""
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        shp = tuple(v.shape) if isinstance(v, torch.Tensor) else None
        h.update(f"{n.op}|{n.target}|{shp};".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class NodeSpec:
    output: tuple[Placements, ...]
    inputs: tuple[Placements | None, ...] = ()

    def to_json(self) -> dict:
        return {"output": [placements_str(p) for p in self.output],
                "inputs": [None if p is None else placements_str(p) for p in self.inputs]}

    @classmethod
    def from_json(cls, d: dict) -> NodeSpec:
        return cls(tuple(parse_placements(p) for p in d["output"]),
                   tuple(None if p is None else parse_placements(p) for p in d["inputs"]))


@dataclass(frozen=True)
class CollectiveCount:
    count: int = 0
    bytes: int = 0

    def __add__(self, other: CollectiveCount) -> CollectiveCount:
        return CollectiveCount(self.count + other.count, self.bytes + other.bytes)


@dataclass(frozen=True)
class ACGroup:
    """One cluster of identical decoder layers (their indices) and how many of them run each
    activation checkpointing policy. Which layers: the first ``full`` (lowest indices) full, the
    next ``selective`` selective, the rest none (torchtitan's per-layer AC wraps chosen blocks;
    the choice between identical layers changes neither the recompute time nor the saved bytes)."""

    layers: tuple[int, ...]
    none: int
    selective: int
    full: int

    def __post_init__(self) -> None:
        if min(self.none, self.selective, self.full) < 0 or \
                self.none + self.selective + self.full != len(self.layers):
            raise ValueError(f"an AC group of {len(self.layers)} layers cannot run {self.none} none, "
                             f"{self.selective} selective and {self.full} full")

    def count(self, policy: ACPolicy) -> int:
        return {ACPolicy.NONE: self.none, ACPolicy.SELECTIVE: self.selective,
                ACPolicy.FULL: self.full}[policy]

    def policies(self) -> dict[int, ACPolicy]:
        """Layer index -> its policy (see the class docstring)."""
        order = ([ACPolicy.FULL] * self.full + [ACPolicy.SELECTIVE] * self.selective
                 + [ACPolicy.NONE] * self.none)
        return dict(zip(sorted(self.layers), order, strict=True))


@dataclass(frozen=True)
class ACChoice:
    """The activation checkpointing of every decoder layer, by cluster of identical layers."""

    groups: tuple[ACGroup, ...]

    @classmethod
    def uniform(cls, layers: list[int], policy: ACPolicy) -> ACChoice:
        """Every layer in one group running ``policy``."""
        n = len(layers)
        return cls((ACGroup(tuple(sorted(layers)), *(n * (p is policy) for p in ACPolicy)),))

    def layer_policies(self) -> LayerPolicies:
        """One policy per decoder layer, in layer order (what the remat pass and the schedule take)."""
        by_layer: dict[int, ACPolicy] = {}
        for g in self.groups:
            by_layer.update(g.policies())
        return LayerPolicies(tuple(by_layer[k] for k in sorted(by_layer)))

    def describe(self) -> str:
        return self.layer_policies().describe()

    def to_json(self) -> list[dict]:
        return [{"layers": list(g.layers), "none": g.none, "selective": g.selective, "full": g.full}
                for g in self.groups]

    @classmethod
    def from_json(cls, doc: list) -> ACChoice:
        return cls(tuple(ACGroup(tuple(int(k) for k in g["layers"]), int(g["none"]), int(g["selective"]),
                                 int(g["full"])) for g in doc))


@dataclass
class Estimate:
    """Predicted step: compute and communication time (seconds), memory per device (bytes)."""

    compute_s: float = 0.0
    comm_s: float = 0.0
    memory_bytes: int = 0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass
class Plan:
    name: str
    model: str
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]
    hardware: str
    train: bool
    fingerprint: str
    nodes: dict[str, NodeSpec]
    params: dict[str, Placements] = field(default_factory=dict)
    # The placement each graph output is delivered in (gradients: their parameter's; loss: R).
    outputs: list[Placements] = field(default_factory=list)
    estimate: Estimate = field(default_factory=Estimate)
    collectives: dict[str, CollectiveCount] = field(default_factory=dict)
    fallback_ops: list[str] = field(default_factory=list)
    status: str = "fixed"
    mip_gap: float = 0.0
    info: dict = field(default_factory=dict)
    ac: ACChoice | None = None  # None: no checkpointing recorded (runs none unless told)

    @property
    def mesh(self) -> Mesh:
        """The mesh (shape, dim names, hardware) the plan was made for."""
        return Mesh(tuple(self.mesh_shape), tuple(self.mesh_names), self.hardware)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    def to_json(self) -> dict:
        return {
            "version": PLAN_FORMAT_VERSION,
            "name": self.name, "model": self.model, "mesh_shape": list(self.mesh_shape),
            "mesh_names": list(self.mesh_names), "hardware": self.hardware, "train": self.train,
            "fingerprint": self.fingerprint,
            "params": {k: placements_str(v) for k, v in self.params.items()},
            "nodes": {k: v.to_json() for k, v in self.nodes.items()},
            "outputs": [placements_str(p) for p in self.outputs],
            "estimate": asdict(self.estimate),
            "collectives": {k: asdict(v) for k, v in self.collectives.items()},
            "fallback_ops": self.fallback_ops, "status": self.status, "mip_gap": self.mip_gap,
            "info": self.info, "ac": None if self.ac is None else self.ac.to_json(),
        }

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            doc = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise UserError(f"plan file {str(path)!r} does not exist.") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"plan file {str(path)!r} cannot be read as JSON "
                            f"({e.__class__.__name__}).") from None
        return cls.from_json(doc, f"plan file {str(path)!r}")

    @classmethod
    def from_json(cls, doc: object, what: str = "the plan") -> Plan:
        if not isinstance(doc, dict) or doc.get("version") != PLAN_FORMAT_VERSION:
            raise UserError(f"{what} is not a shardwise plan of format version {PLAN_FORMAT_VERSION}.")
        try:
            return cls(
                name=doc["name"], model=doc["model"], mesh_shape=tuple(doc["mesh_shape"]),
                mesh_names=tuple(doc["mesh_names"]), hardware=doc["hardware"], train=doc["train"],
                fingerprint=doc["fingerprint"],
                nodes={k: NodeSpec.from_json(v) for k, v in doc["nodes"].items()},
                params={k: parse_placements(v) for k, v in doc["params"].items()},
                outputs=[parse_placements(p) for p in doc["outputs"]],
                estimate=Estimate(**doc["estimate"]),
                collectives={k: CollectiveCount(**v) for k, v in doc["collectives"].items()},
                fallback_ops=list(doc["fallback_ops"]), status=doc["status"], mip_gap=doc["mip_gap"],
                info=doc.get("info", {}),
                ac=None if doc.get("ac") is None else ACChoice.from_json(doc["ac"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{what} is malformed ({e.__class__.__name__}: {e}).") from None

    def check_matches(self, model: str, mesh_shape: tuple[int, ...], train: bool, fingerprint: str) -> None:
        """Refuse a plan made for another model, mesh, mode or graph, saying which."""
        if self.model != model:
            raise UserError(f"the plan was made for model {self.model!r}, not {model!r}.")
        if tuple(self.mesh_shape) != tuple(mesh_shape):
            raise UserError(f"the plan was made for mesh {'x'.join(map(str, self.mesh_shape))}, "
                            f"not {'x'.join(map(str, mesh_shape))}.")
        if self.train != train:
            raise UserError(f"the plan was made for {'training' if self.train else 'inference'}.")
        if self.fingerprint != fingerprint:
            raise UserError("the plan was made for a different graph of this model (other layers, batch, "
                            "sequence or dtype); plan again with the same options.")
