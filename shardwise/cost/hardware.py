"""Hardware specs: what one device computes and moves, and how devices are wired.

Specs are data, not code: one TOML file per named spec in ``cost/hardware/`` (``h100``, ``h200``,
``a100``, ``b200``, ``cpu``), each citing where its numbers come from, and any user file with the
same fields (``--hardware path.toml``). Sections only group the keys; ``[peak_flops]`` maps a
dtype name (``bf16``, ``fp16``, ``fp32``) to dense FLOP/s. Units: bytes, bytes/s, seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from shardwise.errors import UserError

BUILTIN_DIR = "hardware"
DTYPE_KEYS: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
}
# Dtypes without their own peak (integers, bools, fp64 when the spec lacks it) run at the fp32 rate.
FALLBACK_DTYPE = "fp32"
HALF_DTYPES = (torch.bfloat16, torch.float16)
REQUIRED_DTYPES = ("bf16", "fp16", "fp32")
DEVICE_TYPES = ("cuda", "cpu")


@dataclass(frozen=True)
class Hardware:
    """One device kind and its node. Hashable (``peak_flops`` is left out of the hash) so cost
    functions can be cached on it."""

    name: str
    peak_flops: dict[str, float] = field(hash=False)
    mem_bw: float            # HBM bytes/s (peak)
    mem_capacity: float      # bytes
    compute_eff: float       # achievable fraction of peak FLOP/s
    mem_eff: float           # achievable fraction of peak memory bandwidth
    launch_s: float          # per-kernel launch floor
    gpus_per_node: int
    intra_bw: float          # per device, per direction, intra-node link (NVLink through NVSwitch)
    intra_eff: float         # achievable fraction of intra_bw for ring collectives
    intra_latency_s: float   # per hop, LL protocol
    inter_bw: float          # per device NIC, per direction
    inter_eff: float         # achievable fraction of inter_bw
    inter_latency_s: float   # per inter-node hop, LL protocol
    nvls: bool               # NVSwitch with in-switch reduction (NVLink SHARP)
    nvls_bw: float = 0.0     # NVLS all_reduce algorithm bandwidth (bytes/s); needed when nvls
    attention_eff: float | None = None  # achievable fraction of peak in flash attention (bf16/fp16)
    device_type: str = "cuda"  # the torch device type its processes use ("cuda" or "cpu")
    description: str = ""

    def peak(self, dtype: torch.dtype | str) -> float:
        """Dense peak FLOP/s for ``dtype`` (a torch dtype or a key such as ``"bf16"``)."""
        key = dtype if isinstance(dtype, str) else DTYPE_KEYS.get(dtype, FALLBACK_DTYPE)
        if key not in self.peak_flops:
            if isinstance(dtype, str) and key not in DTYPE_KEYS.values():
                raise UserError(f"dtype {dtype!r} is unknown; use one of {', '.join(REQUIRED_DTYPES)}.")
            key = FALLBACK_DTYPE
        return self.peak_flops[key]

    def flops_time(self, flops: int, dtype: torch.dtype | str) -> float:
        """Seconds to do ``flops`` at the achievable rate (no launch floor)."""
        return flops / (self.peak(dtype) * self.compute_eff)

    def memory_time(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` through device memory at the achievable rate (no launch)."""
        return nbytes / (self.mem_bw * self.mem_eff)

    def attention_slowdown(self, dtype: torch.dtype) -> float:
        """How much longer an attention kernel in ``dtype`` takes than a GEMM of its FLOPs:
        ``attention_eff`` is flash attention's, which runs in half precision only (fp32
        attention is another kernel, priced at the GEMM rate)."""
        if self.attention_eff is None or dtype not in HALF_DTYPES:
            return 1.0
        return self.compute_eff / self.attention_eff

    @property
    def intra_bus_bw(self) -> float:
        """Achievable per-device intra-node bandwidth of a ring (bytes/s)."""
        return self.intra_bw * self.intra_eff

    @property
    def nic_bw(self) -> float:
        """Achievable per-device NIC bandwidth (bytes/s)."""
        return self.inter_bw * self.inter_eff


# Fields a spec file must give, with their type; everything numeric must be > 0.
_FLOAT_FIELDS = ("mem_bw", "mem_capacity", "compute_eff", "mem_eff", "launch_s", "intra_bw", "intra_eff",
                 "intra_latency_s", "inter_bw", "inter_eff", "inter_latency_s")
_OPTIONAL_FIELDS = ("attention_eff",)  # None where absent: compute_eff's rate
_EFF_FIELDS = ("compute_eff", "mem_eff", "intra_eff", "inter_eff", "attention_eff")


def builtin_names() -> tuple[str, ...]:
    files = resources.files("shardwise.cost").joinpath(BUILTIN_DIR).iterdir()
    return tuple(sorted(f.name.removesuffix(".toml") for f in files if f.name.endswith(".toml")))


def _flatten(data: dict) -> dict:
    """Section tables only group keys: lift their keys to the top (``peak_flops`` stays a table)."""
    flat: dict = {}
    for k, v in data.items():
        if isinstance(v, dict) and k != "peak_flops":
            flat.update(v)
        else:
            flat[k] = v
    return flat


def _positive(where: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"hardware {where}: field {key!r} must be a number, not {value!r}.")
    if not value > 0:
        raise UserError(f"hardware {where}: field {key!r} must be positive, got {value!r}.")
    return float(value)


def hardware_from_dict(data: dict, where: str) -> Hardware:
    """Validate a parsed spec; ``where`` names it in errors (a file path or a built-in name)."""
    d = _flatten(data)
    missing = [k for k in ("name", "peak_flops", *_FLOAT_FIELDS, "gpus_per_node", "nvls") if k not in d]
    if missing:
        raise UserError(f"hardware {where} lacks the field {missing[0]!r}"
                        + (f" (and {', '.join(map(repr, missing[1:]))})" if len(missing) > 1 else "") + ".")
    peak = d["peak_flops"]
    if not isinstance(peak, dict):
        raise UserError(f"hardware {where}: 'peak_flops' must be a table of dtype = FLOP/s.")
    for k in REQUIRED_DTYPES:
        if k not in peak:
            raise UserError(f"hardware {where} lacks the field 'peak_flops.{k}'.")
    peak = {k: _positive(where, f"peak_flops.{k}", v) for k, v in peak.items()}
    vals = {k: _positive(where, k, d[k]) for k in (*_FLOAT_FIELDS, *_OPTIONAL_FIELDS) if k in d}
    for k in _EFF_FIELDS:
        if vals.get(k, 0) > 1:
            raise UserError(f"hardware {where}: field {k!r} is a fraction of peak and must be at most 1.")
    gpn = d["gpus_per_node"]
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
        raise UserError(f"hardware {where}: field 'gpus_per_node' must be a positive integer, got {gpn!r}.")
    if not isinstance(d["nvls"], bool):
        raise UserError(f"hardware {where}: field 'nvls' must be true or false.")
    nvls_bw = 0.0
    if d["nvls"]:
        if "nvls_bw" not in d:
            raise UserError(f"hardware {where} sets nvls = true but lacks the field 'nvls_bw'.")
        nvls_bw = _positive(where, "nvls_bw", d["nvls_bw"])
    device_type = d.get("device_type", "cuda")
    if device_type not in DEVICE_TYPES:
        raise UserError(f"hardware {where}: field 'device_type' must be one of {', '.join(DEVICE_TYPES)}.")
    return Hardware(name=str(d["name"]), peak_flops=peak, gpus_per_node=gpn, nvls=d["nvls"], nvls_bw=nvls_bw,
                    device_type=device_type, description=str(d.get("description", "")), **vals)


@functools.cache
def _builtin(name: str) -> Hardware:
    text = resources.files("shardwise.cost").joinpath(BUILTIN_DIR, f"{name}.toml").read_text()
    return hardware_from_dict(tomllib.loads(text), name)


def load_hardware_file(path: str | Path) -> Hardware:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"hardware file {str(p)!r} does not exist.")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"hardware file {str(p)!r} is not valid TOML ({e}).") from None
    return hardware_from_dict(data, f"file {str(p)!r}")


def get_hardware(name_or_path: str | Hardware) -> Hardware:
    """A named spec (``h100``, ``h200``, ``a100``, ``b200``, ``cpu``) or a spec file's path."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    text = str(name_or_path).strip()
    names = builtin_names()
    if text.lower() in names:
        return _builtin(text.lower())
    if text.endswith(".toml") or "/" in text or Path(text).is_file():
        return load_hardware_file(text)
    raise UserError(f"hardware {text!r} is unknown; use one of {', '.join(names)} "
                    "or a path to a .toml spec file.")


def with_overrides(hw: Hardware, **changes: object) -> Hardware:
    """A copy of ``hw`` with some fields changed (what-if studies and tests)."""
    return dataclasses.replace(hw, **changes)
