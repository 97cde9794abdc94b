"""Run lowered programs on real process groups: one process per rank, or the ranks torchrun started.

Local launch (``run`` / ``run_many``): the parent holds a ``TCPStore`` on a port the OS picked
(port 0, so two runs at once never collide), cuts each rank's pieces of the parameters and
inputs, and starts one worker per rank from a forkserver (a clean process that imported torch
once; forking the caller, with its solver and OpenMP threads, can deadlock a child). Each worker
joins the real group (gloo on CPU, NCCL on GPUs), builds the mesh, points the program's
collectives at its groups (``rename_groups``), runs the step under a ``CollectiveCounter`` and
sends back its local outputs and counts. The parent reassembles loss, gradients and outputs
from the pieces (each output's placements), and with ``check=True`` compares them with a
single-process fp32 reference that it computes while the workers run.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) this process is one rank: it joins the
group from the environment, runs its piece, and rank 0 gathers the rest over the group.

Faults: a worker that raises reports its error; the parent then gives the others a moment and
kills every child. A worker that never reports by ``timeout_s`` is named as hung, and the error
names the file where it wrote every thread's Python stack shortly before (``HANG_DUMP_SHARE``).
Either way ``run`` raises ``RunError`` naming the rank, and no child outlives it.
"""

from __future__ import annotations

import contextlib
import enum
import faulthandler
import importlib
import io
import math
import multiprocessing as mp
import multiprocessing.forkserver
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.errors import UserError, first_line
from shardwise.ir.ops.attention import make_portable
from shardwise.ir.trace import Traced, graph_constants
from shardwise.lower.spmd import SPMDProgram, rename_groups
from shardwise.mesh import destroy_world
from shardwise.passes import all_gather_out
from shardwise.plan.plan import CollectiveCount
from shardwise.runtime import wire
from shardwise.runtime.activations import backward_start_name, run_measured
from shardwise.runtime.counter import CollectiveCounter, count_graph
from shardwise.runtime.wire import WireGraph

LOCALHOST = "127.0.0.1"
# After the first rank fails, how long the others get to report their own errors before all
# are killed (their errors help say what happened; waiting longer tells nothing new).
FAILURE_GRACE_S = 2.0
# Process-group timeout as a share of the run's: ranks blocked on a hung peer give up (and say
# so) well before the parent's deadline, so the one that never reports stands out as the hang.
PG_TIMEOUT_SHARE = 0.8
# Seconds the ranks get to exit on their own once the run is over, before those left are killed:
# their exit handlers release what their libraries hold, such as the named semaphore tqdm makes
# inside fx.Interpreter, which the resource tracker they share with this process otherwise
# reports as leaked when it exits. A rank that reported exits in well under a second; a hung
# one costs the whole grace.
EXIT_GRACE_S = 5.0
# A rank still running at this share of the run's timeout (its peers gave up at PG_TIMEOUT_SHARE)
# writes every thread's Python stack to its file, which the hang's error names.
HANG_DUMP_SHARE = 0.9
# Modules a rank imports before it unpickles its tasks (the forkserver imports them once, so each
# rank starts with them loaded): they register the op namespaces lowered graphs call (c10d
# functional collectives, DeviceMesh's runtime coordinate, shardwise's ops). The order matters:
# DeviceMesh's ops module can only be imported after torch.distributed.tensor. torch._dynamo is
# imported by every rank of ``run`` and ``train`` (~0.5 s of CPU each, four ranks on two cores).
WORKER_IMPORTS = ("torch", "torch._dynamo", "torch.distributed._functional_collectives",
                  "torch.distributed.tensor", "torch.distributed._ops.device_mesh",
                  "shardwise.runtime.launch", "shardwise.ir.ops")
# A planted hang sleeps this long: far past any run's timeout.
HANG_S = 3600.0
# Errors that say "a peer went away / did not answer", not what went wrong first.
_PEER_ERROR_MARKERS = ("Connection closed by peer", "Timed out", "timed out", "Connection reset",
                       "DistNetworkError", "DistBackendError", "Broken pipe")


def import_graph_ops() -> None:
    """Register every op namespace a lowered graph may call (``WORKER_IMPORTS``), before one
    is unpickled (``runtime/wire.py`` looks its ops up by name)."""
    for module in WORKER_IMPORTS:
        importlib.import_module(module)


class FaultKind(enum.Enum):
    RAISE = "raise"
    HANG = "hang"


@dataclass(frozen=True)
class Fault:
    """Test-only fault injection: ``rank`` raises or hangs just before running its step."""

    rank: int
    kind: FaultKind | str = FaultKind.RAISE

    @property
    def fault_kind(self) -> FaultKind:
        return FaultKind(self.kind)


class RunError(RuntimeError):
    """A rank failed or hung; the message names it."""

    def __init__(self, message: str, rank: int | None = None, details: str = "",
                 stacks: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.details = details  # the failing rank's traceback, when it sent one
        # The file where a hung rank wrote its threads' stacks, or a failed one's traceback went.
        self.stacks = stacks


@dataclass
class RunResult:
    """What a distributed step computed (reassembled global tensors) and what it communicated."""

    world_size: int
    backend: str
    train: bool
    loss: float | None
    outputs: list[torch.Tensor | None]
    grads: dict[str, torch.Tensor]
    measured: dict[str, CollectiveCount]
    lowered: dict[str, CollectiveCount]
    predicted: dict[str, CollectiveCount]
    wall_s: float
    loss_ref: float | None = None
    max_rel_err: float | None = None
    worst: str | None = None  # the tensor with the largest relative error
    rank_measured: list[dict[str, CollectiveCount]] = field(default_factory=list)
    # Bytes of forward activations alive when the backward started (largest over ranks), when
    # the run measured them (``measure_activations``; see runtime/activations.py).
    saved_activation_bytes: int | None = None

    @property
    def comm_matches(self) -> bool:
        from shardwise.runtime.counter import same_counts

        return same_counts(self.measured, self.predicted)


# ---------------------------------------------------------------------------------------------
# Weights, inputs and the reference.
# ---------------------------------------------------------------------------------------------

# Scale of random weights when no model is known (a typical init std for transformer layers).
RANDOM_INIT_STD = 0.02
# Token ids drawn for integer inputs when no model says the vocabulary: 0 and 1 are valid ids
# and class labels for every model.
RANDOM_INT_HIGH = 2


@dataclass
class StepData:
    """Global parameters (by name) and inputs for one step, and the module that made them."""

    params: dict[str, torch.Tensor]
    inputs: tuple[torch.Tensor, ...]
    module: torch.nn.Module | None = None
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # real values of fake graph constants


# The generator state every rank and the reference draw a step's random numbers (dropout masks)
# from: the same masks everywhere.
DRAW_SEED = 0


def make_step_data(program: SPMDProgram, seed: int = 0, model=None) -> StepData:
    """Real weights and inputs from ``seed``: the model's own init when ``model`` (a ``ModelSpec``)
    is given, else random values of the traced shapes."""
    traced = program.traced
    spec = model if model is not None else program.model
    if spec is not None:
        torch.manual_seed(seed)
        module = spec.build_module()
        if not traced.train:
            module.eval()
        named = dict(module.named_parameters())
        params = {k: named[k].detach() for k in traced.params}
        return StepData(params, tuple(spec.example_inputs(traced.train, seed)), module,
                        real_constants(program.gm, module, traced))
    if fake_constants(program.gm):
        raise UserError("the program holds constants traced from fake buffers; pass the model "
                        "(a ModelSpec) so that they get real values.")
    g = torch.Generator().manual_seed(seed)
    lay = program.param_layouts()
    params = {k: (torch.randn(lay[k].shape, generator=g) * RANDOM_INIT_STD).to(lay[k].dtype)
              for k in traced.params}
    by_name = {x.name: x for x in program.placeholders}
    inputs = []
    for name in traced.inputs:
        x = by_name[name]
        if x.dtype.is_floating_point:
            inputs.append(torch.randn(x.shape, generator=g).to(x.dtype))
        else:
            inputs.append(torch.randint(0, RANDOM_INT_HIGH, x.shape, generator=g).to(x.dtype))
    return StepData(params, tuple(inputs))


def fake_constants(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """Tensor attributes of ``gm`` that are fake: buffers the model was traced with (rotary
    frequencies...) captured as graph constants, with no data behind them."""
    from torch._subclasses.fake_tensor import FakeTensor

    return {k: v for k, v in graph_constants(gm).items() if isinstance(v, FakeTensor)}


def real_constants(gm: torch.fx.GraphModule, module: torch.nn.Module,
                   traced: Traced | None = None) -> dict[str, torch.Tensor]:
    """The real value of each fake constant of ``gm`` (a program lowered from ``traced``, whose
    constants are the traced ones): the module's buffer it was traced from
    (``Traced.constant_buffers``), else the module's buffer of its shape and dtype, where all
    such candidates agree (else the graph is refused)."""
    named = {}
    if traced is not None:
        buffers = dict(module.named_buffers())
        named = {id(v): buffers[traced.constant_buffers[k]] for k, v in fake_constants(traced.gm).items()
                 if traced.constant_buffers.get(k) in buffers}
    out = {}
    for name, fake in fake_constants(gm).items():
        if id(fake) in named:
            out[name] = named[id(fake)].detach().clone()
            continue
        cands = [b for b in module.buffers() if b.shape == fake.shape and b.dtype == fake.dtype]
        if not cands or any(not torch.equal(c, cands[0]) for c in cands[1:]):
            raise UserError(f"the graph constant {name} of shape {list(fake.shape)} matches "
                            f"{len(cands)} different buffers of the model; it cannot be given a value.")
        out[name] = cands[0].detach().clone()
    return out


def reference(program: SPMDProgram,
              data: StepData) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor]]:
    """The single-process result in fp32: ``(outputs, grads)`` (training: ``outputs[0]`` is the
    loss). The eager module when there is one, else the unsharded canonical graph."""
    torch.manual_seed(DRAW_SEED)  # its dropout masks: the ones every rank draws
    traced = program.traced
    params = {k: v.float() for k, v in data.params.items()}
    inputs = tuple(x.float() if x.dtype.is_floating_point else x for x in data.inputs)
    if data.module is not None:
        from torch.func import functional_call

        module = data.module.float()
        if traced.train:
            leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
            loss = functional_call(module, leaves, inputs)
            names = list(leaves)
            grads = torch.autograd.grad(loss, [leaves[k] for k in names], allow_unused=True)
            return [loss.detach()], {k: g for k, g in zip(names, grads, strict=True) if g is not None}
        with torch.no_grad():
            out = functional_call(module, params, inputs)
        return (list(out) if isinstance(out, (tuple, list)) else [out]), {}
    outs = traced.gm(*[params[k] for k in traced.params], *inputs)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    if traced.train:
        return [outs[0]], {k: outs[1 + i] for i, k in enumerate(traced.params)
                           if isinstance(outs[1 + i], torch.Tensor)}
    return outs, {}


# What ``--check`` accepts between a run in a dtype and the one-process fp32 reference (``rel_err``
# of the loss and every gradient, or of the loss curves in training). fp32 differs only in the
# order of its sums (llama-tiny, every plan on 2x2 and 4 ranks: <= 6e-7; the 1e-4). In
# bf16 and fp16 the error is the dtype's own rounding, alike for every plan: llama-tiny over 2x2
# 1.3e-2 (bf16) and 1.6e-3 (fp16) for one step, 1.1e-2 over 20 bf16 training steps.
CHECK_TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def check_tolerance(dtype: torch.dtype, given: float | None = None) -> float:
    """``given`` (``--tolerance``, positive), else the tolerance of a run in ``dtype``."""
    if given is not None:
        return given
    return CHECK_TOLERANCE.get(dtype, CHECK_TOLERANCE[torch.float32])


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are zero)."""
    got, want = got.double(), want.double()
    scale = want.abs().max().item() if want.numel() else 0.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    return diff / scale if scale > 0 else diff


# ---------------------------------------------------------------------------------------------
# One rank's work.
# ---------------------------------------------------------------------------------------------


@dataclass
class _RankOutput:
    rank: int
    outputs: list[list[torch.Tensor | None]]  # per program: local pieces of its outputs
    counts: list[dict[str, CollectiveCount]]  # per program: what ran
    saved_bytes: list[int | None] = field(default_factory=list)  # per program, when measured


def _device_for(backend: str, rank: int) -> torch.device:
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def retarget_device(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """Make factory ops and constants of a CPU-lowered graph create their tensors on ``device``,
    and its CPU-only kernels run as their portable twins (``ir/ops/attention.make_portable``)."""
    if device.type == "cpu":
        return
    make_portable(gm)
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.kwargs.get("device"), torch.device):
            n.kwargs = {**n.kwargs, "device": device}
    consts = [(k, v) for k, v in vars(gm).items() if isinstance(v, torch.Tensor)]
    for name, buf in list(gm.named_buffers()) + consts:
        setattr(gm, name, buf.to(device))
    gm.recompile()


@dataclass
class _RankTask:
    """What one rank needs to run one program, picklable by ``wire.dumps`` (the worker is a
    fresh process): the program's graph with real constants, its group names by mesh dim, the
    mesh and the rank's local arguments."""

    graph: WireGraph
    group_dims: dict[str, int]
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...] | None
    args: list[torch.Tensor]
    measure: bool = False  # run under the saved-activation meter
    backward_start: str | None = None  # the node the meter measures before


def _tasks(program: SPMDProgram, data: StepData, measure: bool = False) -> list[_RankTask]:
    """One task per rank: the graph with its fake constants replaced by their real values."""
    graph = WireGraph.of(program.gm)
    start = backward_start_name(program.gm) if measure else None
    graph.attrs.update({k: v for k, v in data.constants.items() if k in graph.attrs})
    mesh = program.mesh
    return [_RankTask(graph, dict(program.group_dims), tuple(mesh.shape), mesh.names,
                      program.local_args(data.params, data.inputs, r), measure, start)
            for r in range(program.world_size)]


def _bind(task: _RankTask, device: torch.device) -> torch.fx.GraphModule:
    """The task's graph on this process's real groups and device."""
    from torch.distributed.device_mesh import DeviceMesh

    shape = task.mesh_shape
    dm = DeviceMesh(device.type, torch.arange(math.prod(shape)).view(shape), mesh_dim_names=task.mesh_names)
    gm = task.graph.module()
    rename_groups(gm, {old: dm.get_group(d).group_name for old, d in task.group_dims.items()})
    retarget_device(gm, device)
    # Gathers into buffers of their own: gloo's allocating gather corrupts the heap when several
    # are in flight (passes/all_gather_out.py; a 2x2 fsdp_tp_sp rank aborted in malloc here).
    all_gather_out.apply(gm)
    return gm


def _run_rank(tasks: Sequence[_RankTask], backend: str, rank: int, fault: Fault | None) -> _RankOutput:
    outs, counts, saved = [], [], []
    device = _device_for(backend, rank)
    for task in tasks:
        gm = _bind(task, device)
        args = [a.to(device) for a in task.args]
        if fault is not None and fault.rank == rank:
            if fault.fault_kind is FaultKind.HANG:
                time.sleep(HANG_S)
            raise RuntimeError(f"planted fault on rank {rank}")
        torch.manual_seed(DRAW_SEED)  # every rank draws the reference's masks, whole (strategies.py)
        with torch.no_grad(), CollectiveCounter() as counter:
            if task.measure:
                res, nbytes = run_measured(gm, args, task.backward_start)
                saved.append(nbytes)
            else:
                res = gm(*args)
                saved.append(None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        res = list(res) if isinstance(res, (tuple, list)) else [res]
        outs.append([r.detach().cpu() if isinstance(r, torch.Tensor) else None for r in res])
        counts.append(counter.counts)
    return _RankOutput(rank, outs, counts, saved)


def _to_bytes(out: _RankOutput) -> bytes:
    """Tensors go to the parent as bytes: torch's queue pickling shares memory through file
    descriptors that vanish when the worker exits."""
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> _RankOutput:
    return torch.load(io.BytesIO(data), weights_only=False)


def _run_tasks(rank: int, backend: str, payload: bytes, send) -> bytes:
    """A rank of ``run``: the pickled ``(tasks, fault)`` -> its outputs as bytes."""
    tasks, fault = pickle.loads(payload)
    return _to_bytes(_run_rank(tasks, backend, rank, fault))


def _worker(rank: int, world: int, port: int, backend: str, fn, payload: bytes, timeout_s: float,
            results, stacks: str) -> None:
    """One rank in a fresh process: join the real group, run ``fn(rank, backend, payload, send)``,
    report what it returns (never raises). ``payload`` is unpickled by ``fn`` itself, once the
    ops it names are registered; ``send(obj)`` passes a message (progress) to the parent. Still
    running near ``timeout_s``, it writes its threads' stacks to ``_stack_file(stacks, rank)``."""
    pg_timeout_s = timeout_s * PG_TIMEOUT_SHARE
    # A fatal signal (a crash in native code) prints every thread's Python stack on the rank's
    # stderr, which the caller sees, instead of only "exited with code -6".
    faulthandler.enable(file=sys.stderr, all_threads=True)
    stack_file = open(_stack_file(stacks, rank), "w")  # closed below: faulthandler may write it late
    faulthandler.dump_traceback_later(timeout_s * HANG_DUMP_SHARE, file=stack_file)
    try:
        import_graph_ops()
        torch.set_num_threads(1)  # ranks share the machine's cores
        store = dist.TCPStore(LOCALHOST, port, world, is_master=False,
                              timeout=timedelta(seconds=pg_timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout_s))
        out = fn(rank, backend, payload, lambda obj: results.put(("msg", rank, obj)))
        results.put(("ok", rank, out))
    except BaseException as e:  # report everything: the parent names the rank and its error
        results.put(("error", rank, first_line(e), traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        stack_file.close()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # the group may be broken by a failed peer; the process ends anyway
            pass


def _stack_file(stacks: str, rank: int) -> str:
    return os.path.join(stacks, f"rank{rank}-stacks.txt")


# ---------------------------------------------------------------------------------------------
# Launching.
# ---------------------------------------------------------------------------------------------


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _check_backend(backend: str, world: int) -> None:
    if backend not in ("gloo", "nccl"):
        raise UserError(f"backend {backend!r} is not one of gloo, nccl.")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_torchrun() else world
        if gpus < local:
            raise UserError(f"--backend nccl needs {local} GPU(s) on this machine and it has {gpus}; "
                            "use --backend gloo.")


def run(program: SPMDProgram, backend: str = "gloo", *, check: bool = False, seed: int = 0,
        inference: bool | None = None, timeout_s: float = 60.0, fault: Fault | None = None,
        model=None, measure_activations: bool = False) -> RunResult | None:
    """Run ``program`` on ``world_size`` real ranks; see the module docstring. Under torchrun,
    ranks other than 0 return None (rank 0 holds the gathered result)."""
    results = run_many([program], backend, check=check, seed=seed, inference=inference,
                       timeout_s=timeout_s, fault=fault, models=[model],
                       measure_activations=measure_activations)
    return results[0] if results else None


def run_many(programs: Sequence[SPMDProgram], backend: str = "gloo", *, check: bool = False, seed: int = 0,
             inference: bool | None = None, timeout_s: float = 60.0, fault: Fault | None = None,
             models: Sequence | None = None, measure_activations: bool = False) -> list[RunResult]:
    """Run several programs of one world size in one launch (one process per rank for all);
    ``measure_activations`` measures each one's saved activations on every rank."""
    if not programs:
        return []
    world = programs[0].world_size
    if any(p.world_size != world for p in programs):
        raise UserError("programs run together must share a world size.")
    for p in programs:
        if inference is not None and inference == p.traced.train:
            raise UserError(f"the program was lowered for {'training' if p.traced.train else 'inference'}; "
                            "trace it again for the other mode.")
    if fault is not None and not 0 <= fault.rank < world:
        raise UserError(f"fault rank {fault.rank} is outside the world of {world}.")
    _check_backend(backend, world)
    models = list(models) if models is not None else [None] * len(programs)
    datas = [make_step_data(p, seed, m) for p, m in zip(programs, models, strict=True)]
    t0 = time.perf_counter()
    if under_torchrun():
        ranks = _run_torchrun(programs, datas, backend, fault, timeout_s, measure_activations)
        if ranks is None:  # not rank 0: it only contributed its pieces
            return []
        refs = [reference(p, d) for p, d in zip(programs, datas, strict=True)] if check else None
    else:
        ranks, refs = _launch_local(programs, datas, backend, world, fault, timeout_s, check,
                                    measure_activations)
    wall = time.perf_counter() - t0
    return [_result(i, p, ranks, backend, wall, refs[i] if refs else None) for i, p in enumerate(programs)]


def _launch_local(programs, datas, backend: str, world: int, fault: Fault | None, timeout_s: float,
                  check: bool, measure: bool = False):
    tasks = [_tasks(p, d, measure) for p, d in zip(programs, datas, strict=True)]
    payloads = [wire.dumps(([t[r] for t in tasks], fault)) for r in range(world)]
    refs: list = []

    def while_running() -> None:  # the reference runs in this process while the ranks work
        if check:
            refs.extend(reference(p, d) for p, d in zip(programs, datas, strict=True))

    outs = spawn(_run_tasks, payloads, backend, timeout_s, while_running=while_running)
    return [_from_bytes(o) for o in outs], (refs if check else None)


def start_forkserver() -> None:
    """Start the forkserver the ranks come from, if it is not running: a clean single-threaded
    process that has imported ``WORKER_IMPORTS`` once (forking this process instead, with its
    threads of HiGHS, OpenMP, a store server..., can leave a child blocked forever on a lock some
    thread held at the fork). ``shardwise run`` calls it once its plan is made, ``shardwise
    train`` once its plan is known to apply, so that those imports (~2 s of CPU) run on
    another core while it lowers the program or solves the plan, not after: llama-tiny over 2x2,
    ``run`` (fsdp_tp_sp, --check) 10.0 -> 8.0 s, ``train --plan auto --steps 5`` 28.7-33.9 ->
    25.9-26.0 s. Not sooner: the server holds the command's stdout and stderr until its imports
    end, so a caller reading them would wait that long for the error of a plan that does not
    apply."""
    mp.set_forkserver_preload(list(WORKER_IMPORTS))
    multiprocessing.forkserver.ensure_running()


def spawn(fn, payloads: Sequence[bytes], backend: str, timeout_s: float, *,
          while_running=None, on_message=None) -> list:
    """Run ``fn(rank, backend, payload, send)`` on one fresh process per payload, joined in one
    real process group; each rank's return value, in rank order. ``fn`` must be a module-level
    function (it is pickled by name). ``while_running()`` runs here once the ranks started;
    ``on_message(rank, obj)`` receives what ranks ``send``. Raises ``RunError`` naming the
    first rank that failed or hung, and no child outlives the call."""
    start_forkserver()
    ctx = mp.get_context("forkserver")
    world = len(payloads)
    store = dist.TCPStore(LOCALHOST, 0, world + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    results = ctx.Queue()
    stacks = tempfile.mkdtemp(prefix="shardwise-ranks-")
    procs = [ctx.Process(target=_worker, name=f"shardwise-rank{r}", daemon=True,
                         args=(r, world, store.port, backend, fn, payloads[r], timeout_s, results, stacks))
             for r in range(world)]
    deadline = time.monotonic() + timeout_s
    keep_stacks = False
    try:
        with _main_not_rerun():
            for p in procs:
                p.start()
        if while_running is not None:
            while_running()
        return _collect(results, procs, world, deadline, timeout_s, on_message, stacks)
    except RunError as e:
        keep_stacks = e.stacks is not None
        raise
    finally:
        _kill_all(procs, EXIT_GRACE_S)
        del store
        if not keep_stacks:
            shutil.rmtree(stacks, ignore_errors=True)


@contextlib.contextmanager
def _main_not_rerun() -> Iterator[None]:
    """Start processes without re-running the caller's script in them. multiprocessing re-imports
    ``__main__`` from its file in each new process (so that what it defines can be unpickled);
    the tasks hold only torch and shardwise objects, and a script without a ``__main__`` guard
    would run again in every rank."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _collect(results, procs, world: int, deadline: float, timeout_s: float, on_message=None,
             stacks: str | None = None) -> list:
    """Wait for every rank's report; on the first error (or the deadline) raise ``RunError``
    (for a hang, naming the hung rank's stack file in ``stacks`` where it wrote one)."""
    done: dict[int, object] = {}
    errors: dict[int, tuple[str, str]] = {}
    grace_end: float | None = None
    while len(done) + len(errors) < world:
        now = time.monotonic()
        limit = deadline if grace_end is None else min(deadline, grace_end)
        if now >= limit:
            break
        try:
            msg = results.get(timeout=min(0.2, limit - now))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                    and r not in done and r not in errors]
            for r in dead:  # killed without a word (out of memory, a signal)
                errors[r] = (f"exited with code {procs[r].exitcode}", "")
                grace_end = grace_end or time.monotonic() + FAILURE_GRACE_S
            continue
        if msg[0] == "ok":
            done[msg[1]] = msg[2]
        elif msg[0] == "msg":
            if on_message is not None:
                on_message(msg[1], msg[2])
        else:
            errors[msg[1]] = (msg[2], msg[3])
            grace_end = grace_end or time.monotonic() + FAILURE_GRACE_S
    silent = sorted(r for r in range(world) if r not in done and r not in errors)
    own = _own_errors(errors)
    if own:
        rank = min(own)
        tail = f"; rank(s) {', '.join(map(str, silent))} did not finish" if silent else ""
        raise _failed(stacks, rank, errors[rank], tail)
    if silent:
        # Nobody failed on its own: the silent rank hung and the others (if any) gave up on it.
        waiting = (f" while rank(s) {', '.join(map(str, sorted(errors)))} timed out waiting for it"
                   if errors else "")
        path = _stack_file(stacks, silent[0]) if stacks is not None else None
        dumped = path is not None and os.path.exists(path) and os.path.getsize(path) > 0
        where = f"; its threads' stacks are in {path}" if dumped else ""
        raise RunError(f"rank {silent[0]} hung: no report within {timeout_s:g} s{waiting}{where}.", silent[0],
                       stacks=path if dumped else None)
    if errors:
        rank = min(errors)
        raise _failed(stacks, rank, errors[rank])
    return [done[r] for r in range(world)]


def _failed(stacks: str | None, rank: int, error: tuple[str, str], tail: str = "") -> RunError:
    """The error of a rank that failed with ``error`` (its sentence, its traceback): one sentence,
    naming the file in ``stacks`` that now holds the traceback, where the rank sent one."""
    said, details = error
    path = None
    if stacks is not None and details:
        path = os.path.join(stacks, f"rank{rank}-traceback.txt")
        with open(path, "w") as f:
            f.write(details)
    where = f"; its traceback is in {path}" if path else ""
    return RunError(f"rank {rank} failed: {said}{tail}{where}.", rank, details, stacks=path)


def _own_errors(errors: dict[int, tuple[str, str]]) -> list[int]:
    """Ranks that failed on their own (not because a peer went away or stopped answering)."""
    return [r for r, (text, tb) in errors.items()
            if not any(m in text or m in tb for m in _PEER_ERROR_MARKERS)]


def _kill_all(procs, grace_s: float = 0.0) -> None:
    """End every started process: those that exit within ``grace_s`` on their own, the rest killed."""
    started = [p for p in procs if p.pid is not None]
    until = time.monotonic() + grace_s
    for p in started:
        p.join(timeout=max(0.0, until - time.monotonic()))
    for p in started:
        if p.is_alive():
            p.kill()
    for p in started:
        p.join(timeout=5)


def _run_torchrun(programs, datas, backend: str, fault: Fault | None,
                  timeout_s: float, measure: bool = False) -> list[_RankOutput] | None:
    """This process is one rank of a torchrun job: run it; rank 0 gathers every rank's pieces."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != programs[0].world_size:
        raise UserError(f"torchrun started {world} processes but the plan's mesh has "
                        f"{programs[0].world_size} devices.")
    if dist.is_initialized():
        destroy_world()
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        mine = _run_rank([_tasks(p, d, measure)[rank] for p, d in zip(programs, datas, strict=True)],
                         backend, rank, fault)
        gathered: list[_RankOutput | None] = [None] * world if rank == 0 else None
        # Gathered over a CPU (gloo) group so NCCL jobs need no device copies of Python objects.
        cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else None
        dist.gather_object(mine, gathered, dst=0, group=cpu_group)
    finally:
        dist.destroy_process_group()
    return list(gathered) if rank == 0 else None


def _result(i: int, program: SPMDProgram, ranks: list[_RankOutput], backend: str, wall: float,
            ref) -> RunResult:
    world = program.world_size
    coords = [program.coordinate(r) for r in range(world)]
    outputs: list[torch.Tensor | None] = []
    for j, lay in enumerate(program.outputs):
        if lay is None:
            outputs.append(None)
            continue
        outputs.append(lay.assemble({coords[r]: ranks[r].outputs[i][j] for r in range(world)}))
    traced = program.traced
    loss = outputs[0].item() if traced.train and outputs and outputs[0] is not None else None
    grads: dict[str, torch.Tensor] = {}
    if traced.train:
        grad_at = {name: k for k, name in enumerate(program.output_names())}
        grads = {p: outputs[grad_at[g]] for p, g in traced.grads.items() if g in grad_at}
    rank_counts = [r.counts[i] for r in ranks]
    res = RunResult(world_size=world, backend=backend, train=traced.train, loss=loss, outputs=outputs,
                    grads=grads, measured=rank_counts[0], lowered=count_graph(program.gm),
                    predicted=dict(program.plan.collectives), wall_s=wall, rank_measured=rank_counts)
    measured = [r.saved_bytes[i] for r in ranks if r.saved_bytes and r.saved_bytes[i] is not None]
    res.saved_activation_bytes = max(measured) if measured else None
    if ref is not None:
        ref_outs, ref_grads = ref
        pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        if traced.train:
            pairs.append(("loss", outputs[0], ref_outs[0]))
            pairs += [(f"grad {k}", grads[k], ref_grads[k]) for k in ref_grads if k in grads]
            res.loss_ref = ref_outs[0].item()
        else:
            pairs += [(f"output {j}", o, r) for j, (o, r) in enumerate(zip(outputs, ref_outs, strict=False))
                      if o is not None and r is not None]
        errs = [(rel_err(a, b), name) for name, a, b in pairs]
        res.max_rel_err, res.worst = max(errs) if errs else (0.0, None)
    return res


def world_of(mesh_shape: Sequence[int]) -> int:
    return math.prod(mesh_shape)
