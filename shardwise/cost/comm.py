"""Collective time, modelled the way NCCL chooses: every (algorithm, protocol) pair the collective
supports on this group is priced as ``latency + bytes / bandwidth`` and the fastest one wins.

Byte convention (nccl-tests "size", used everywhere in shardwise): all_reduce and broadcast the
tensor's bytes; all_gather the gathered OUTPUT; reduce_scatter the full INPUT; all_to_all the
input. Algorithm bandwidth ``algbw = size / time``; bus bandwidth ``busbw = algbw * factor`` with
factor 2(n-1)/n for all_reduce, (n-1)/n for all_gather / reduce_scatter / all_to_all, 1 for
broadcast (figures.md: nccl-tests conventions).

Links. A group of ``ranks`` devices spread evenly over ``nodes`` nodes has ``r = ranks / nodes``
devices per node. Inside a node devices talk through NVSwitch at ``intra_bw * intra_eff`` per
device; the group's traffic between nodes leaves each node through the NICs of its ``r`` devices
(one NIC per GPU, NCCL runs one channel per NIC), so the group's inter-node bandwidth per node is
``r * inter_bw * inter_eff``. A ring that crosses nodes runs at the slower of the two.

Algorithms (figures.md: "Ring all_reduce time ~ 2(n-1)*alpha + 2(n-1)/n * S / B; tree ~ 2 log2(n)
alpha + 2 S / B"):

- ring: every collective. Steps 2(n-1) for all_reduce, n-1 otherwise; each step is one hop of
  latency (NVLink hops and NIC hops priced separately). all_gather, reduce_scatter and
  all_to_all also copy the rank's own shard through device memory (read + write of size/n):
  that term is what makes a 2-rank all_gather (537 GB/s in figures.md) slower per bus byte
  than an 8-rank one (394 GB/s), and with it one NVLink efficiency fits 2, 4 and 8 ranks.
- tree (all_reduce across nodes): NCCL's double binary tree between nodes and a chain inside
  each node: latency 2((r-1) intra hops + log2(nodes) NIC hops), bandwidth 2 S / B.
- NVLS (all_reduce inside one NVSwitch node with in-switch reduction, Simple protocol only):
  each device sends and receives about S once, at ``nvls_bw`` (the 460-480 GB/s all_reduce busbw
  of 8 H100s in figures.md is NVLS; a ring cannot reach it).
- all_to_all: direct sends to every peer at once (NCCL's grouped send/recv, Simple protocol);
  intra-node peers over NVSwitch, remote peers through the device's own NIC.

Protocols (figures.md: "LL has ~1/4 the bandwidth at the lowest latency, LL128 ~0.92, Simple
full"): each scales the link bandwidth and has a base latency and a per-hop latency multiplier.
Latencies are fitted to the latency floors of figures.md (H100, 8 KiB-class messages:
all_gather 8 / 17 / 30 us and all_reduce 10 / 15 / 31 us at 2 / 4 / 8 ranks, all_to_all ~50 us
at 8) with one per-hop NVLink latency in the hardware spec.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass

from shardwise.cost.hardware import Hardware
from shardwise.errors import UserError
from shardwise.ir.match import CollectiveKind

GB = 1e9  # GB/s in reports are decimal, as nccl-tests prints them


class Algorithm(enum.Enum):
    RING = "ring"
    TREE = "tree"
    NVLS = "nvls"
    DIRECT = "direct"  # all_to_all: one send/recv per peer


class Protocol(enum.Enum):
    LL = "LL"
    LL128 = "LL128"
    SIMPLE = "Simple"


@dataclass(frozen=True)
class ProtocolSpec:
    bw_factor: float   # fraction of the link bandwidth the protocol achieves (figures.md)
    base_s: float      # fixed cost of one collective call (kernel launch, handshakes)
    hop_factor: float  # per-hop latency as a multiple of the spec's LL hop latency


# base_s and hop_factor: fitted so the LL floors match figures.md (see module docstring) and the
# other protocols keep NCCL's ordering (LL < LL128 < Simple in latency, reverse in bandwidth).
PROTOCOLS: dict[Protocol, ProtocolSpec] = {
    Protocol.LL: ProtocolSpec(bw_factor=0.25, base_s=5.5e-6, hop_factor=1.0),
    Protocol.LL128: ProtocolSpec(bw_factor=0.92, base_s=7.5e-6, hop_factor=1.5),
    Protocol.SIMPLE: ProtocolSpec(bw_factor=1.0, base_s=8.5e-6, hop_factor=2.5),
}
# NVLS sets up multicast memory and synchronises through the switch before moving data; NCCL only
# picks it for large messages. An estimate that keeps small all_reduces on ring/LL as NCCL does.
NVLS_SETUP_S = 20e-6
# NVLS all_reduce: one hop into the switch (reduce) and one out of it (multicast).
NVLS_HOPS = 2


@dataclass(frozen=True)
class CollectiveEstimate:
    time_s: float
    algorithm: str
    protocol: str
    algbw_GBps: float
    busbw_GBps: float


def bus_factor(kind: CollectiveKind, ranks: int) -> float:
    """nccl-tests' bus bandwidth factor (figures.md)."""
    if ranks <= 1:
        return 0.0
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * (ranks - 1) / ranks
    if kind is CollectiveKind.BROADCAST:
        return 1.0
    return (ranks - 1) / ranks


@dataclass(frozen=True)
class _Group:
    """Where a group's ranks sit: ``ranks`` over ``nodes`` nodes, ``per_node`` on each."""

    ranks: int
    nodes: int

    @property
    def per_node(self) -> int:
        return max(1, self.ranks // self.nodes)


def _link_bw(group: _Group, hw: Hardware) -> float:
    """Per-device bandwidth a ring over this group sustains (bytes/s)."""
    if group.nodes == 1:
        return hw.intra_bus_bw
    return min(hw.intra_bus_bw, group.per_node * hw.nic_bw)


# When a group spans nodes, NCCL's tuner charges LL's intra-node hops 1.8x (its flags are polled
# through the network proxy path too); NCCL src/graph/tuning.cc, "intraLat *= 1.8".
LL_MULTI_NODE_INTRA_FACTOR = 1.8


def _hops_latency(intra_hops: int, inter_hops: int, hw: Hardware, proto: ProtocolSpec,
                  multi_node: bool = False) -> float:
    intra = hw.intra_latency_s
    if multi_node and proto is PROTOCOLS[Protocol.LL]:
        intra *= LL_MULTI_NODE_INTRA_FACTOR
    return proto.hop_factor * (intra_hops * intra + inter_hops * hw.inter_latency_s)


def _own_shard_copy_s(kind: CollectiveKind, nbytes: int, group: _Group, hw: Hardware) -> float:
    """all_gather / reduce_scatter / all_to_all place the rank's own shard with a device-memory
    copy (read + write of size/n); an all_reduce or broadcast works in place."""
    if kind in (CollectiveKind.ALL_REDUCE, CollectiveKind.BROADCAST):
        return 0.0
    return hw.memory_time(2 * nbytes // group.ranks)


def _ring(kind: CollectiveKind, nbytes: int, g: _Group, hw: Hardware, p: Protocol) -> float:
    spec = PROTOCOLS[p]
    steps = 2 * (g.ranks - 1) if kind is CollectiveKind.ALL_REDUCE else g.ranks - 1
    inter_steps = 2 * (g.nodes - 1) if kind is CollectiveKind.ALL_REDUCE else g.nodes - 1
    latency = spec.base_s + _hops_latency(steps - inter_steps, inter_steps, hw, spec, g.nodes > 1)
    bus_bytes = nbytes * bus_factor(kind, g.ranks)
    return latency + bus_bytes / (_link_bw(g, hw) * spec.bw_factor) + _own_shard_copy_s(kind, nbytes, g, hw)


def _tree(nbytes: int, g: _Group, hw: Hardware, p: Protocol) -> float:
    spec = PROTOCOLS[p]
    inter_hops = 2 * math.ceil(math.log2(g.nodes))
    latency = spec.base_s + _hops_latency(2 * (g.per_node - 1), inter_hops, hw, spec, multi_node=True)
    return latency + 2 * nbytes / (_link_bw(g, hw) * spec.bw_factor)


def _nvls(nbytes: int, hw: Hardware) -> float:
    spec = PROTOCOLS[Protocol.SIMPLE]
    return spec.base_s + NVLS_SETUP_S + _hops_latency(NVLS_HOPS, 0, hw, spec) + nbytes / hw.nvls_bw


def _direct_all_to_all(nbytes: int, g: _Group, hw: Hardware, p: Protocol) -> float:
    spec = PROTOCOLS[p]
    remote = g.ranks - g.per_node  # peers on other nodes
    latency = spec.base_s + _hops_latency(g.per_node - 1, remote, hw, spec, g.nodes > 1)
    intra_t = nbytes * (g.per_node - 1) / g.ranks / (hw.intra_bus_bw * spec.bw_factor)
    inter_t = nbytes * remote / g.ranks / (hw.nic_bw * spec.bw_factor)
    return latency + max(intra_t, inter_t) + _own_shard_copy_s(CollectiveKind.ALL_TO_ALL, nbytes, g, hw)


def candidates(kind: CollectiveKind, nbytes: int, ranks: int, hw: Hardware,
               nodes: int = 1) -> dict[tuple[Algorithm, Protocol], float]:
    """Time of every (algorithm, protocol) NCCL could run for this collective on this group."""
    g = _Group(ranks, nodes)
    out: dict[tuple[Algorithm, Protocol], float] = {}
    if kind is CollectiveKind.ALL_TO_ALL:
        out[(Algorithm.DIRECT, Protocol.SIMPLE)] = _direct_all_to_all(nbytes, g, hw, Protocol.SIMPLE)
        return out
    for p in Protocol:
        out[(Algorithm.RING, p)] = _ring(kind, nbytes, g, hw, p)
    if kind is CollectiveKind.ALL_REDUCE:
        if nodes > 1:
            for p in Protocol:
                out[(Algorithm.TREE, p)] = _tree(nbytes, g, hw, p)
        elif hw.nvls:
            out[(Algorithm.NVLS, Protocol.SIMPLE)] = _nvls(nbytes, hw)
    return out


def _check(nbytes: int, ranks: int, nodes: int, hw: Hardware) -> None:
    if nbytes < 0:
        raise UserError(f"byte count {nbytes} is negative; a collective moves at least 0 bytes.")
    if ranks < 1:
        raise UserError(f"ranks {ranks} is less than 1; a group has at least one rank.")
    if nodes < 1 or nodes > ranks:
        raise UserError(f"nodes {nodes} must be between 1 and the number of ranks ({ranks}).")
    if math.ceil(ranks / nodes) > hw.gpus_per_node:
        raise UserError(f"{ranks} ranks do not fit on {nodes} node(s) of {hw.gpus_per_node} devices "
                        f"({hw.name}); pass more nodes.")


@functools.lru_cache(maxsize=65536)
def collective_time(kind: CollectiveKind, nbytes: int, ranks: int, hw: Hardware,
                    nodes: int = 1) -> CollectiveEstimate:
    """Predicted time of one collective of ``nbytes`` (nccl-tests size) over ``ranks`` devices on
    ``nodes`` nodes, with the algorithm and protocol NCCL would pick. One rank or zero bytes: 0."""
    _check(nbytes, ranks, nodes, hw)
    if ranks == 1 or nbytes == 0:
        return CollectiveEstimate(0.0, "none", "none", 0.0, 0.0)
    (algo, proto), t = min(candidates(kind, nbytes, ranks, hw, nodes).items(), key=lambda kv: kv[1])
    algbw = nbytes / t / GB
    return CollectiveEstimate(t, algo.value, proto.value, algbw, algbw * bus_factor(kind, ranks))


def parse_kind(text: str) -> CollectiveKind:
    """``"all_reduce"`` -> ``CollectiveKind.ALL_REDUCE`` (also accepts dashes)."""
    key = text.strip().lower().replace("-", "_")
    for k in CollectiveKind:
        if k.value == key:
            return k
    known = ", ".join(k.value for k in CollectiveKind)
    raise UserError(f"collective {text!r} is unknown; use one of {known}.")
