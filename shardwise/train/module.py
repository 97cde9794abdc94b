"""``parallelize``: a model -> an ``nn.Module`` of DTensor parameters running the planned program.

SPMD: every rank calls ``parallelize`` with the same arguments (under ``torchrun``, or in the
ranks ``shardwise train`` starts). It traces the model on fake tensors (a training step: the
joint forward+backward graph), plans it (rank 0 solves, the others receive its plan, so a time
limit can never give two ranks two plans), lowers the plan on rank 0's real DeviceMesh (under
fake tensors: nothing runs, the graph's collectives name the mesh's real groups), runs the
requested passes on it and sends the program to the other ranks, which point its collectives at
their own groups (``share_program``: the graph is the same on every rank).

The returned ``ParallelModule`` holds the model's own submodules, so ``named_parameters()`` keep
the model's names; each parameter is replaced by an ``nn.Parameter`` wrapping a ``DTensor`` in the
plan's placement. Calling it in training mode runs the whole per-rank step (forward and
backward, as the plan's graph computes them) inside one ``autograd.Function``: it returns the
loss, and ``loss.backward()`` hands each parameter its gradient, already synchronised by the
plan's own collectives and placed as the parameter (nothing is added behind the user's back).
So ``torch.optim``, ``clip_grad_norm_``, LR schedulers and ``torch.distributed.checkpoint``
work on it unchanged; so does gradient accumulation (a step on each micro-batch, each loss
scaled by 1/N before its ``backward()``: the gradients add up in ``.grad``, as in eager
PyTorch; each micro-batch still runs its own gradient collectives). In ``eval()`` mode it runs
the inference program (planned on first use with the parameters fixed where training put them)
and returns DTensor outputs.

Weights: a model with real weights is cut into its shards (each rank keeps only its own); a
model on the meta device gets NaN-filled shards until ``init_weights(seed)``, a checkpoint or
``load_weights(path)`` (safetensors weights, each rank reading only its pieces:
``train/weights.py``) fills them (the first step refuses NaN weights). ``init_weights`` draws
each parameter from a generator keyed by (seed, name, row block), so the weights do not depend
on the mesh or plan and no rank ever materialises more than one block of a tensor it does not
hold.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import os
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from shardwise.errors import UserError
from shardwise.ir.match import draws_random
from shardwise.ir.trace import Traced
from shardwise.lower.spmd import Layout, SPMDProgram, lower_on, rename_groups
from shardwise.mesh import Mesh, destroy_world
from shardwise.passes import COMPILED_RUNTIME_PASSES, RUNTIME_PASSES, remat, run_passes
from shardwise.passes.remat import ACPolicy
from shardwise.plan.plan import Plan
from shardwise.runtime import wire
from shardwise.runtime.bindings import direct_calls
from shardwise.runtime.heap import retain_freed_memory
from shardwise.runtime.inference import without_autograd
from shardwise.runtime.launch import import_graph_ops, real_constants, retarget_device
from shardwise.runtime.wire import WireGraph

# Standard deviation of the normal draw for matrices (embeddings and projections): the usual
# transformer init (GPT-2, LLaMA reference code); vectors are norm scales (ones) or biases (zeros).
INIT_STD = 0.02
# Rows drawn per generator call in ``init_weights``: bounds the memory of a block a rank draws
# but keeps only part of (a Shard along a later dim).
INIT_BLOCK_ELEMENTS = 1 << 22
# The prefix under which ``loss_fn`` wraps the model (stripped from parameter names).
_WRAPPED = "model"


def _check_takes(model: nn.Module, inputs: Sequence[torch.Tensor]) -> None:
    """One sentence, not a TypeError from inside the trace, for a forward that cannot take the
    inputs the step gives it."""
    try:
        signature = inspect.signature(model.forward)
    except ValueError:  # no Python signature to read: the trace will say
        return
    try:
        signature.bind(*inputs)
    except TypeError as e:
        raise UserError(f"{type(model).__name__}.forward cannot take the {len(inputs)} input(s) the step "
                        f"gives it ({e}); without loss_fn it gets every example input, with one all but the "
                        "last (n_eval_inputs sets how many).") from None


class _WithLoss(nn.Module):
    """``loss_fn(model(*inputs[:n]), *inputs)``: a model that returns outputs, made to return the
    loss (``n``: how many leading inputs the model's forward takes)."""

    def __init__(self, model: nn.Module, loss_fn: Callable, n: int) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.n = n

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(*inputs[:self.n]), *inputs)


# ---------------------------------------------------------------------------------------------
# Process groups and meshes.
# ---------------------------------------------------------------------------------------------


def _device_mesh(mesh: Mesh | DeviceMesh | str, mesh_names: Sequence[str] | None,
                 backend: str) -> tuple[DeviceMesh, Mesh]:
    """This process's real DeviceMesh and the planner's abstract Mesh of the same shape.

    A ``Mesh`` (or ``"2x2"``) joins a process group first when none is running: torchrun's
    (from the environment) or, for a one-device mesh, a group of one.
    """
    if isinstance(mesh, DeviceMesh):
        names = mesh.mesh_dim_names or tuple(mesh_names or ())
        return mesh, Mesh(tuple(mesh.shape), tuple(names))
    if isinstance(mesh, str):
        from shardwise.mesh import parse_mesh

        mesh = parse_mesh(mesh, ",".join(mesh_names) if mesh_names else None)
    if dist.is_initialized() and dist.get_backend() == "fake":
        destroy_world()  # a planning group left over in this process
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        elif mesh.size == 1:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1,
                                    timeout=timedelta(minutes=5))
        else:
            raise UserError(f"mesh {mesh} has {mesh.size} devices but no process group is running; "
                            "start the script with torchrun --nproc-per-node "
                            f"{mesh.size} (or call torch.distributed.init_process_group first).")
    if dist.get_world_size() != mesh.size:
        raise UserError(f"the process group has {dist.get_world_size()} ranks but mesh {mesh} has "
                        f"{mesh.size} devices.")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    dm = DeviceMesh(device, torch.arange(mesh.size).view(mesh.shape), mesh_dim_names=mesh.names)
    return dm, mesh


def _object_group() -> dist.ProcessGroup | None:
    """A group that can move Python objects: the default one on gloo, a gloo twin on NCCL."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def broadcast_plan(plan: Plan | None, make: Callable[[], Plan]) -> Plan:
    """Rank 0's plan on every rank (``make`` runs on rank 0 only when ``plan`` is None)."""
    if dist.get_world_size() == 1:
        return plan if plan is not None else make()
    box: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (plan if plan is not None else make()).to_json()
        except UserError as e:  # every rank must learn it, else they wait forever
            box[0] = e
    dist.broadcast_object_list(box, src=0, group=_object_group())
    if isinstance(box[0], UserError):
        raise box[0]
    return Plan.from_json(box[0])


# The fields of ``SPMDProgram`` that each rank has of its own; ``share_program`` sends the rest.
_RANK_FIELDS = frozenset({"gm", "traced", "plan", "rank", "group_dims", "model"})


def share_program(make: Callable[[], SPMDProgram], traced: Traced, plan: Plan,
                  device_mesh: DeviceMesh) -> SPMDProgram:
    """``make()`` run on rank 0 alone and its program sent to the other ranks. The graph is the
    same on every rank (each reads its mesh coordinate at run time, ``lower_on``) but for the
    names of its process groups, which each rank points at its own. Lowering is most of a rank's
    start: on llama-tiny over 2x2 with fsdp_tp_sp, 2.8 s of CPU a rank, so four ranks on two
    cores spent 5.6 s in it. ``make`` must return the program with every pass that reads node
    metadata done: the graph travels without it (``runtime/wire.py``)."""
    if dist.get_world_size() == 1:
        return make()
    box: list[object] = [None]
    rank0 = dist.get_rank() == 0
    if rank0:
        try:
            program: SPMDProgram | Exception = make()
            shared = {f.name: getattr(program, f.name) for f in fields(SPMDProgram)
                      if f.name not in _RANK_FIELDS}
            # The graph without node metadata; group names by mesh dim, for the others to rename.
            sent: object = (WireGraph.of(program.gm), dict(program.group_dims), shared)
        except Exception as e:  # every rank must learn it, else they wait forever
            program = e
            sent = e if isinstance(e, UserError) else RuntimeError(f"rank 0 failed to lower the plan: {e}")
        box[0] = wire.dumps(sent)  # op overloads travel by name
    dist.broadcast_object_list(box, src=0, group=_object_group())
    if rank0:
        if isinstance(program, Exception):
            raise program
        return program
    import_graph_ops()
    sent = pickle.loads(box[0])
    if isinstance(sent, BaseException):
        raise sent
    graph, dims, shared = sent
    gm = graph.module()
    rename_groups(gm, {name: device_mesh.get_group(d).group_name for name, d in dims.items()})
    return SPMDProgram(gm=gm, traced=traced, plan=plan, rank=dist.get_rank(),
                       group_dims={device_mesh.get_group(d).group_name: d for d in dims.values()}, **shared)


# ---------------------------------------------------------------------------------------------
# Weights.
# ---------------------------------------------------------------------------------------------


def init_kind(name: str, ndim: int) -> str:
    """How ``init_weights`` fills a parameter: ``normal`` (matrices), ``zeros`` (biases),
    ``ones`` (other vectors: norm scales)."""
    if ndim >= 2:
        return "normal"
    return "zeros" if name.rsplit(".", 1)[-1] == "bias" else "ones"


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_values(name: str, shape: Sequence[int], dtype: torch.dtype, seed: int,
                index: tuple[slice, ...] | None = None) -> torch.Tensor:
    """The values ``init_weights(seed)`` gives parameter ``name`` at ``index`` (default: all):
    the same numbers whichever rank, mesh or plan asks."""
    shape = tuple(shape)
    index = index or tuple(slice(0, d) for d in shape)
    local = tuple(len(range(*s.indices(d))) for s, d in zip(index, shape, strict=True))
    out = torch.empty(local, dtype=dtype)
    fill_init(out, name, shape, seed, index)
    return out


def fill_init(out: torch.Tensor, name: str, shape: Sequence[int], seed: int,
              index: tuple[slice, ...]) -> None:
    """Write ``init_values(name, shape, out.dtype, seed, index)`` into ``out``, drawing a block of
    rows at a time (only the blocks that overlap ``index``; never more than one in memory)."""
    shape = tuple(shape)
    kind = init_kind(name, len(shape))
    if kind != "normal":
        out.fill_(0.0 if kind == "zeros" else 1.0)
        return
    rows_per_block = max(1, INIT_BLOCK_ELEMENTS // max(math.prod(shape[1:]), 1))
    lo, hi, _ = index[0].indices(shape[0])
    for block in range(lo // rows_per_block, (hi - 1) // rows_per_block + 1 if hi > lo else 0):
        b0 = block * rows_per_block
        b1 = min(shape[0], b0 + rows_per_block)
        g = torch.Generator().manual_seed(_block_seed(seed, name, block))
        vals = torch.randn((b1 - b0, *shape[1:]), generator=g) * INIT_STD
        a, b = max(lo, b0), min(hi, b1)
        out[a - lo:b - lo].copy_(vals[(slice(a - b0, b - b0), *index[1:])])


def init_state_dict(named_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                    seed: int) -> dict[str, torch.Tensor]:
    """Full single-device tensors of ``init_weights(seed)`` (for references and exports)."""
    return {k: init_values(k, shape, dt, seed) for k, (shape, dt) in named_shapes.items()}


# ---------------------------------------------------------------------------------------------
# The step as one autograd function.
# ---------------------------------------------------------------------------------------------


class _Step(torch.autograd.Function):
    """Runs the joint graph in forward, returns the loss; backward hands out the gradients it
    already computed (scaled by the loss's incoming gradient).

    Where ``loss.backward()`` accumulates into a parameter that has no gradient hooks, the
    gradient is put in its ``.grad`` here (added, if one is there), as DDP's reducer and FSDP2's
    post-backward do, instead of going back through autograd: the engine's per-parameter work
    (validating the gradient, DTensor's dispatch of ``detach``, AccumulateGrad) took the
    backward from 0.48 to 0.73 ms a step on llama-tiny's 39 parameters (``benchmarks/train.py
    --phases``). Under ``torch.autograd.grad``, with ``create_graph``, for a parameter
    ``backward(inputs=...)`` leaves out, and for one with tensor or post-accumulate-grad hooks,
    the gradient goes through autograd as before. (Hooks put on a parameter's AccumulateGrad
    node itself are not seen: PyTorch offers no way to ask for them.)"""

    @staticmethod
    def forward(ctx, runner: _Program, inputs: tuple[torch.Tensor, ...], *params: DTensor) -> torch.Tensor:
        # The local shards themselves: to_local()'s autograd node is of no use inside a Function
        # (autograd sees only this Function) and costs a Python call per parameter each step.
        outs = runner.run(*runner.computed(p._local_tensor for p in params), *inputs)
        loss = outs[0]
        ctx.grads = [None if spec is None else (g, spec)
                     for g, spec in zip(outs[1:], runner.grad_specs(outs[1:], params), strict=True)]
        ctx.params = params
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, gout: torch.Tensor):
        scale = None if gout is None or bool((gout == 1).all()) else gout
        # One edge per tensor argument, the parameters last (the program and the inputs' tuple
        # are no tensors): each parameter's AccumulateGrad node, None where it needs no gradient.
        edges = ctx.next_functions
        accumulators = [node for node, _ in edges[len(edges) - len(ctx.params):]]
        direct = _accumulates_into_grad(accumulators)
        grads = []
        for item, p, node in zip(ctx.grads, ctx.params, accumulators, strict=True):
            if item is None:
                grads.append(None)
                continue
            g, spec = item
            g = g if scale is None else g * scale.to(g.dtype)  # in the master weights' dtype (lower_on)
            # DTensor.__new__ alone: its __init__ does nothing but pass through a dynamo guard.
            grad = DTensor.__new__(DTensor, g, spec, requires_grad=False)
            if direct and node is not None and _no_grad_hooks(p) and torch._C._will_engine_execute_node(node):
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad.add_(grad)
                grads.append(None)
            else:
                grads.append(grad)
        ctx.grads = ctx.params = None
        return (None, None, *grads)


def _accumulates_into_grad(accumulators: Sequence[object]) -> bool:
    """Whether this backward is a ``.backward()`` (it accumulates into ``.grad``), not a
    ``torch.autograd.grad``, whose engine refuses the question for a parameter's node."""
    node = next((n for n in accumulators if n is not None), None)
    if node is None or torch.is_grad_enabled():  # create_graph: leave it all to autograd
        return False
    try:
        torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return False
    return True


def _no_grad_hooks(p: torch.Tensor) -> bool:
    """``p`` has no hooks that autograd would run on its gradient."""
    return not p._backward_hooks and not getattr(p, "_post_accumulate_grad_hooks", None)


@dataclass
class _Program:
    """One lowered program bound to this process: its graph, what its inputs and outputs are."""

    program: SPMDProgram  # its graph bound to this process (real constants, device)
    device_mesh: DeviceMesh
    module: nn.Module  # the module traced (its parameter names are the graph's)
    params: list[str]  # traced parameter names, in placeholder order
    inputs: list[Layout]
    grad_layouts: list[Layout | None]  # per parameter (training)
    run: Callable  # runs the program: its graph module, or that module compiled
    _grad_specs: dict[tuple[int, torch.dtype], DTensorSpec] = field(default_factory=dict)
    _owners: list[tuple[nn.Module, str]] | None = None  # (module, attribute) of each parameter
    draws: bool = False  # it draws random numbers (dropout masks)
    # The dtype the program reads each parameter in (its trace's); a master weight kept in
    # another dtype is cast to it every step (``computed``).
    compute_dtypes: list[torch.dtype] = field(default_factory=list)

    def computed(self, locals_: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters' local shards as the program reads them: cast where the master
        weights are kept in another dtype (as FSDP2 casts its shard before gathering it)."""
        return [t if t.dtype == d else t.to(d) for t, d in zip(locals_, self.compute_dtypes, strict=True)]

    def grad_specs(self, grads: Sequence[torch.Tensor | None],
                   params: Sequence[torch.Tensor]) -> list[DTensorSpec | None]:
        """Each gradient's DTensor spec (its layout on the mesh, in its parameter's dtype), built
        once per layout."""
        out: list[DTensorSpec | None] = []
        for i, (g, lay, p) in enumerate(zip(grads, self.grad_layouts, params, strict=True)):
            if g is None or lay is None:
                out.append(None)
                continue
            key = (i, p.dtype)
            if key not in self._grad_specs:
                self._grad_specs[key] = lay.dtensor_spec(self.device_mesh, p.dtype)
            out.append(self._grad_specs[key])
        return out

    def parameters(self) -> list[nn.Parameter]:
        # Each step reads every parameter off its owning module (one getattr each, not a walk of
        # the module tree), so a parameter the user replaced (load_state_dict(assign=True)) is seen.
        if self._owners is None:
            self._owners = [(self.module.get_submodule(owner), attr)
                            for owner, _, attr in (k.rpartition(".") for k in self.params)]
        return [getattr(owner, attr) for owner, attr in self._owners]


# ---------------------------------------------------------------------------------------------
# The module.
# ---------------------------------------------------------------------------------------------


class ParallelModule(nn.Module):
    """The model's submodules with DTensor parameters, running the planned per-rank program."""

    def __init__(self, model: nn.Module, traced_model: nn.Module, device_mesh: DeviceMesh, mesh: Mesh,
                 traced: Traced, plan: Plan, *, passes: Sequence[str], prefix: str, time_limit_s: float,
                 model_name: str, n_eval_inputs: int, ac: ACPolicy = ACPolicy.NONE,
                 compile: bool = False, master_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        # The user's submodules under their own names (no wrapper prefix); top-level parameters
        # of the model itself are registered on this module below.
        for name, child in model.named_children():
            self.add_module(name, child)
        self._state = {"model": model, "traced_model": traced_model, "mesh": mesh, "traced": traced,
                       "prefix": prefix, "passes": tuple(passes), "time_limit_s": time_limit_s,
                       "model_name": model_name, "n_eval_inputs": n_eval_inputs, "ac": ac,
                       "compile": compile, "master_dtype": master_dtype}
        self.device_mesh = device_mesh
        self.plan = plan
        if device_mesh.device_type == "cpu":
            retain_freed_memory()  # steps reuse the heap instead of faulting it back in (runtime/heap.py)
        self._train_prog = self._bind(traced, plan, traced_model)
        self._eval_prog: _Program | None = None
        self._checked_init = False
        self._place_parameters(traced_model)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)

    # -- names -------------------------------------------------------------------------------

    def _user_name(self, traced_name: str) -> str:
        prefix = self._state["prefix"]
        if prefix and traced_name.startswith(prefix + "."):
            return traced_name[len(prefix) + 1:]
        return traced_name

    # -- programs ----------------------------------------------------------------------------

    def _bind(self, traced: Traced, plan: Plan, module: nn.Module) -> _Program:
        compiled = self._state["compile"]

        def lowered() -> SPMDProgram:
            # On the mesh's device: DTensor moves every local piece there, so a factory op or a
            # cast that named another device would mix two.
            # Gradients are reduced in the master weights' dtype (torchtitan's mixed precision
            # reduces in fp32), which is what the step estimate prices.
            program = lower_on(traced, plan, self.device_mesh, rank=dist.get_rank(),
                               device=self.device_mesh.device_type,
                               reduce_dtype=self._state["master_dtype"])
            program.apply_passes(list(self._state["passes"]))
            if traced.train and self._state["ac"] is not ACPolicy.NONE:
                program.rewrites["remat"] = remat.apply(program.gm, self._state["ac"])
            # Buffers (rotary tables...) were traced as fake constants: the module's values.
            for name, value in real_constants(program.gm, module, traced).items():
                setattr(program.gm, name, value)
            retarget_device(program.gm, torch.device(self.device_mesh.device_type))
            run_passes(program.gm, list(COMPILED_RUNTIME_PASSES if compiled else RUNTIME_PASSES))
            return program

        program = share_program(lowered, traced, plan, self.device_mesh)
        gm = program.gm
        # Inductor fuses the program's elementwise chains into kernels; it compiles on the first
        # call (then from its cache on disk). Eagerly, each op is called through PyTorch's own
        # binding, a cheaper call than its OpOverload (runtime/bindings.py), under inference mode
        # where autograd records nothing (runtime/inference.py). Dropout masks are
        # drawn by PyTorch's own kernels when compiled too (Inductor's generator draws other
        # numbers than one process's eager step).
        draws = any(draws_random(n) for n in gm.graph.nodes)
        run = (torch.compile(gm, fullgraph=True, dynamic=False, options={"fallback_random": draws})
               if compiled else without_autograd(direct_calls(gm)))
        lays = program.param_layouts()
        names = list(traced.params)
        for k in names:
            if any(isinstance(p, Partial) for p in lays[k].placements):
                raise UserError(f"the plan holds parameter {k} as a pending sum; plan it again.")
        ph_inputs = {lay.name: lay for lay in program.placeholders}
        inputs = [ph_inputs[n] for n in traced.inputs]
        grad_layouts: list[Layout | None] = []
        if traced.train:
            by_out = {lay.name: lay for lay in program.outputs if lay is not None}
            for k in names:
                g = traced.grads.get(k)
                lay = by_out.get(g) if g is not None else None
                if lay is not None and tuple(lay.placements) != tuple(lays[k].placements):
                    raise UserError(f"the plan delivers the gradient of {k} in another placement than "
                                    "the parameter; plan it again.")
                grad_layouts.append(lay)
        return _Program(program, self.device_mesh, module, names, inputs, grad_layouts, run, draws=draws,
                        compute_dtypes=[lays[k].dtype for k in names])

    def _eval_program(self) -> _Program:
        if self._eval_prog is None:
            from shardwise.plan.placement import placements_str
            from shardwise.plan.planner import Constraints, plan_named

            st = self._state
            traced = _trace(st["model"], self._eval_example_inputs(), train=False,
                            model_name=st["model_name"])
            fixed = {self._user_name(k): tuple(v) for k, v in self.plan.params.items()}
            constraints = Constraints(params=fixed, inputs={})
            plan = broadcast_plan(None, lambda: plan_named(traced, st["mesh"], "auto",
                                                           time_limit_s=st["time_limit_s"],
                                                           constraints=constraints))
            for k, v in fixed.items():
                if placements_str(plan.params.get(k, v)) != placements_str(v):
                    raise UserError(f"the inference plan moved parameter {k}; it must keep training's "
                                    "placement.")
            self._eval_prog = self._bind(traced, plan, st["model"])
        return self._eval_prog

    def _eval_example_inputs(self) -> list[torch.Tensor]:
        """Meta inputs for the inference trace: the training inputs' leading ``n_eval_inputs``
        (the trailing ones are labels)."""
        traced: Traced = self._state["traced"]
        names = traced.inputs[:self._state["n_eval_inputs"]]
        return [torch.empty(v.shape, dtype=v.dtype, device="meta")
                for v in (traced.node(n).meta["val"] for n in names)]

    # -- parameters --------------------------------------------------------------------------

    def _place_parameters(self, model: nn.Module) -> None:
        """Replace each parameter (every place it is shared) by a DTensor in its placement."""
        prog = self._train_prog
        lays = prog.program.param_layouts()
        coord = prog.program.coordinate(dist.get_rank())
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for full_name, p in model.named_parameters(remove_duplicate=False):
            mod_name, _, attr = full_name.rpartition(".")
            owners.setdefault(id(p), []).append((model.get_submodule(mod_name), attr))
        device = torch.device(self.device_mesh.device_type)
        master = self._state["master_dtype"]
        for name, p in list(model.named_parameters()):
            lay = lays[name]
            dtype = master if master is not None and lay.dtype.is_floating_point else lay.dtype
            if p.is_meta:
                local = torch.full(lay.local_shape(), float("nan"), dtype=dtype, device=device)
            else:
                local = lay.shard(p.detach(), coord).to(device, dtype)
            new = nn.Parameter(lay.to_dtensor(local, self.device_mesh), requires_grad=p.requires_grad)
            for mod, attr in owners[id(p)]:
                setattr(mod, attr, new)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Fill every parameter's shard with ``init_values`` (matrices ~ N(0, 0.02), norm
        scales 1, biases 0), the same numbers under any mesh or plan."""
        lays = self._train_prog.program.param_layouts()
        coord = self._train_prog.program.coordinate(dist.get_rank())
        for name, p in self._state["traced_model"].named_parameters():
            lay = lays[name]
            fill_init(p.to_local(), self._user_name(name), lay.shape, seed, lay.index(coord))

    def load_weights(self, path: str | Path) -> None:
        """Fill every parameter's shard from the safetensors weights at ``path``
        (``train/weights.py``: a file, or a ``save_pretrained`` directory), each rank reading
        only its own pieces."""
        from shardwise.train.weights import Pretrained, aliases, stored_prefix

        lays = self._train_prog.program.param_layouts()
        coord = self._train_prog.program.coordinate(dist.get_rank())
        Pretrained(path, stored_prefix(self._state["model"]), aliases(self)).fill(
            [(self._user_name(k), p.to_local(), lays[k].shape, lays[k].index(coord))
             for k, p in self._state["traced_model"].named_parameters()])

    # -- running -----------------------------------------------------------------------------

    def shard_inputs(self, *global_inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's pieces of the global inputs, as the plan places them."""
        prog = self._train_prog if self.training else self._eval_program()
        _check_count(prog, global_inputs, "training" if self.training else "inference")
        coord = prog.program.coordinate(dist.get_rank())
        device = torch.device(self.device_mesh.device_type)
        out = []
        for i, (x, lay) in enumerate(zip(global_inputs, prog.inputs, strict=True)):
            if tuple(x.shape) != lay.shape:
                raise UserError(f"input {i} has shape {list(x.shape)}; the program was traced for "
                                f"{list(lay.shape)} (the example inputs' shapes).")
            out.append(lay.shard(x, coord).to(device))
        return tuple(out)

    def coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate on the mesh."""
        return self._train_prog.program.coordinate(dist.get_rank())

    def input_layouts(self) -> list[Layout]:
        """How the (training or, in eval mode, inference) program places each input."""
        return list((self._train_prog if self.training else self._eval_program()).inputs)

    def _check_initialised(self) -> None:
        if self._checked_init:
            return
        prog = self._train_prog
        bad = [self._user_name(k) for k, p in zip(prog.params, prog.parameters(), strict=True)
               if p.to_local().isnan().any()]
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise UserError(f"parameter {bad[0]}{more} holds no values; call init_weights(seed) or load a "
                            "checkpoint before the first step.")
        if prog.draws:
            _check_generators_alike(self.device_mesh.device_type)
        self._checked_init = True

    def forward(self, *local_inputs: torch.Tensor):
        self._check_initialised()
        if self.training:
            prog = self._train_prog
            _check_local(prog, local_inputs, "training")
            return _Step.apply(prog, tuple(local_inputs), *prog.parameters())
        prog = self._eval_program()
        _check_local(prog, local_inputs, "inference")
        outs = prog.run(*prog.computed(p.to_local() for p in prog.parameters()), *local_inputs)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        res = [lay.to_dtensor(o, self.device_mesh) if lay is not None else o
               for o, lay in zip(outs, prog.program.outputs, strict=True)]
        return pytree.tree_unflatten(res, prog.program.traced.output_tree)  # nested as the forward did


def _check_generators_alike(device_type: str) -> None:
    """The ranks' random generators are in one state: each draws a dropout mask whole and keeps
    its piece (``plan/strategies.py``), so the pieces make one mask only if every rank draws the
    same numbers (with tensor parallelism, replicas that drew different masks would disagree)."""
    if dist.get_world_size() == 1:
        return
    from shardwise.train.checkpoint import generator_states  # DCP's import (~0.1 s): only for draws

    digest = hashlib.sha256()
    for state in generator_states(device_type).values():  # the generators a checkpoint keeps
        digest.update(state.numpy().tobytes())
    states: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(states, digest.hexdigest(), group=_object_group())
    if len(set(states)) > 1:
        raise UserError("the model draws dropout masks, and the ranks' random generators differ; seed "
                        "every rank alike (torch.manual_seed(seed)) before the first step.")


def _check_count(prog: _Program, inputs: Sequence[torch.Tensor], kind: str) -> None:
    if len(inputs) != len(prog.inputs):
        raise UserError(f"the {kind} program takes {len(prog.inputs)} inputs, got {len(inputs)}.")


def _check_local(prog: _Program, local_inputs: Sequence[torch.Tensor], kind: str) -> None:
    """The program's ops are traced for its inputs' local shapes: refuse others (the global
    tensors themselves, say) before they fail deep inside it, or broadcast into a wrong step."""
    _check_count(prog, local_inputs, kind)
    for i, (x, lay) in enumerate(zip(local_inputs, prog.inputs, strict=True)):
        want = lay.local_shape()
        if tuple(x.shape) != want:
            raise UserError(f"input {i} has shape {list(x.shape)}, but this rank's slice of it is "
                            f"{list(want)}; pass the slices shard_inputs(*global_inputs) returns.")


# ---------------------------------------------------------------------------------------------
# Entry point.
# ---------------------------------------------------------------------------------------------


def _trace(model: nn.Module, inputs: Sequence[torch.Tensor], *, train: bool, model_name: str) -> Traced:
    """Trace and canonicalise on fake tensors (a meta model traces as one on the CPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardwise.ir.trace import trace
    from shardwise.passes.pipeline import canonicalize

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [_fake_like(mode, x) if x.is_meta else mode.from_tensor(x, static_shapes=True) for x in inputs]
    was = model.training
    model.train(train)
    try:
        with _params_as_fakes(model, mode):
            traced = trace(model, *fakes, train=train, fake_mode=mode, model_name=model_name)
    finally:
        model.train(was)
    canonicalize(traced)
    return traced


def _fake_like(mode, x: torch.Tensor) -> torch.Tensor:
    with mode:
        return torch.empty(x.shape, dtype=x.dtype, device="cpu")


class _params_as_fakes:
    """While tracing, present meta and DTensor parameters as fake CPU tensors of their global
    shape (a trace needs only shapes). A parameter shared by several modules stays one object."""

    def __init__(self, model: nn.Module, mode) -> None:
        self.model, self.mode, self.saved = model, mode, []

    def __enter__(self) -> None:
        fakes: dict[int, nn.Parameter] = {}
        for mod in self.model.modules():
            for attr, p in list(mod._parameters.items()):
                if p is not None and (p.is_meta or isinstance(p, DTensor)):
                    if id(p) not in fakes:
                        fakes[id(p)] = nn.Parameter(_fake_like(self.mode, p), p.requires_grad)
                    self.saved.append((mod, attr, p))
                    mod._parameters[attr] = fakes[id(p)]
            for attr, b in list(mod._buffers.items()):
                if b is not None and b.is_meta:
                    self.__exit__()
                    raise UserError(f"buffer {attr} of {type(mod).__name__} is on the meta device and has "
                                    "no values; build the model under shardwise.train.params_on_meta() "
                                    "(buffers stay real) or on the CPU.")

    def __exit__(self, *exc: object) -> None:
        for mod, attr, p in reversed(self.saved):
            mod._parameters[attr] = p
        self.saved = []


def parallelize(model: nn.Module, mesh: Mesh | DeviceMesh | str,
                example_inputs: Sequence[torch.Tensor], *, plan: str | Plan | Path = "auto",
                loss_fn: Callable | None = None, passes: Sequence[str] = (), time_limit_s: float = 60.0,
                mesh_names: Sequence[str] | None = None, backend: str = "gloo", hardware: str = "h100",
                n_eval_inputs: int | None = None, ac: ACPolicy | str = "none",
                compile: bool = False, master_dtype: torch.dtype | None = None) -> ParallelModule:
    """Plan, lower and bind ``model`` on ``mesh``; see the module docstring.

    ``model``: an ``nn.Module`` whose forward returns the scalar loss (or whose outputs
    ``loss_fn(outputs, *inputs)`` turns into it; its forward then takes the leading
    ``n_eval_inputs`` inputs), real or on the meta device. ``example_inputs``:
    global inputs of the shapes every step will use (real or meta). ``plan``: ``"auto"``, a
    baseline name (``ddp``, ``fsdp``, ``fsdp_tp``, ``fsdp_tp_sp``), a ``Plan`` or a plan file.
    ``n_eval_inputs``: how many leading inputs the inference program (and, with ``loss_fn``, the
    model's forward) takes; by default all but the last, the labels. ``ac``: activation
    checkpointing of the training program (``none``, ``selective``, ``full``: the remat pass,
    after ``passes``). ``compile``: run each per-rank program through ``torch.compile``
    (Inductor) instead of op by op. ``master_dtype``: keep the floating-point parameters, their
    gradients and so the optimizer's state in this dtype (e.g. ``torch.float32`` for a bf16
    model: torchtitan's mixed precision); each step casts the local shards to the model's dtype
    before the program reads them, and the program reduces its gradients in the master dtype
    (FSDP2's ``reduce_dtype``). None: the model's own dtype.
    """
    from shardwise.passes import parse_passes
    from shardwise.plan.baselines import BASELINES
    from shardwise.plan.planner import plan_named

    if not isinstance(model, nn.Module):
        raise UserError("parallelize takes an nn.Module; build a named model with "
                        "shardwise.train.build_model(name).")
    passes = parse_passes(passes)
    policy = remat.parse_policy(ac)
    device_mesh, abstract = _device_mesh(mesh, mesh_names, backend)
    abstract = Mesh(abstract.shape, abstract.names, hardware)
    model_name = type(model).__name__
    prefix = ""
    traced_model: nn.Module = model
    n_in = len(example_inputs)
    if n_eval_inputs is None:
        n_eval_inputs = n_in - 1 if n_in > 1 else n_in
    _check_takes(model, example_inputs[:n_eval_inputs] if loss_fn is not None else example_inputs)
    if loss_fn is not None:
        traced_model, prefix = _WithLoss(model, loss_fn, n_eval_inputs), _WRAPPED
    traced = _trace(traced_model, example_inputs, train=True, model_name=model_name)
    if isinstance(plan, Plan):
        given: Plan | None = plan
    elif isinstance(plan, (str, Path)) and str(plan) in ("auto", *BASELINES):
        given = None
    elif isinstance(plan, (str, Path)) and Path(plan).exists():
        given = Plan.load(plan)
    else:
        raise UserError(f"plan {str(plan)!r} is neither auto, a baseline ({', '.join(BASELINES)}) nor a "
                        "plan file.")
    chosen = broadcast_plan(given, lambda: plan_named(traced, abstract, str(plan), time_limit_s=time_limit_s))
    if tuple(chosen.mesh_shape) != tuple(abstract.shape):
        raise UserError(f"the plan was made for mesh {'x'.join(map(str, chosen.mesh_shape))}, not "
                        f"{'x'.join(map(str, abstract.shape))}.")
    from shardwise.lower.spmd import check_plan

    check_plan(traced, chosen)
    return ParallelModule(model, traced_model, device_mesh, abstract, traced, chosen, passes=passes,
                          prefix=prefix, time_limit_s=time_limit_s, model_name=model_name,
                          n_eval_inputs=n_eval_inputs, ac=policy, compile=compile, master_dtype=master_dtype)
