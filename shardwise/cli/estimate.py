"""``shardwise estimate``: one plan's training step laid out on streams, as a GPU would run it.

    shardwise estimate --model llama3-8b --mesh 8 --plan fsdp --ac selective --compile \
        [--async-tp] [--hardware h100-96gb] [--batch 16 --seq 8192 --layers N --dtype bf16]
        [--memory 80GiB] [--timeline trace.json] [--timeline-png step.png] [--json]

Prints step time, tokens per second per device, MFU, peak memory per device and whether it
fits, and the breakdown of compute, recomputation and (exposed) communication. Peak memory is
the caching allocator's reserved peak (``cost/allocator.py``: what OOMs, and what torchtitan
reports), next to the allocated peak and what is alive there (``memory_breakdown``: static
state, gradients, gathered parameters, saved activations, transients, the largest buffers).
"""

from __future__ import annotations

import argparse

from shardwise.cli import add_model_options, add_step_options, check_output_file, step_options
from shardwise.cli.plan import add_mesh_options
from shardwise.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate",
                       help="lay a plan's training step out on streams: step time, memory, timeline")
    add_model_options(p)
    add_mesh_options(p)
    p.add_argument("--plan", default="auto", help="auto, ddp, fsdp, fsdp_tp, fsdp_tp_sp or a saved plan.json")
    add_step_options(p)
    p.add_argument("--memory", default=None, help="memory per device to check the peak against (default: the "
                   "hardware's)")
    p.add_argument("--no-expandable-segments", action="store_true",
                   help="model PyTorch's default caching allocator rather than expandable segments "
                   "(torchtitan launches with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")
    p.add_argument("--extrapolate-from", type=int, default=None, metavar="K",
                   help="trace K and K+2 layers and extrapolate to the model's depth (identical layers)")
    p.add_argument("--time-limit", type=float, default=60.0,
                   help="solver time limit for --plan auto (seconds)")
    p.add_argument("--timeline", default=None, help="write a Chrome trace (Perfetto) of the step here")
    p.add_argument("--timeline-png", default=None,
                   help="write a Gantt chart (PNG) of the step and of one layer here")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> dict:
    from shardwise.cost.hardware import get_hardware
    from shardwise.cost.step import estimate_step
    from shardwise.cost.units import parse_bytes
    from shardwise.mesh import parse_mesh

    if args.inference:
        raise UserError("estimate prices a training step; drop --inference.")
    mesh = parse_mesh(args.mesh, args.mesh_names, args.hardware)
    opts = step_options(args, mesh.names)
    hw = get_hardware(args.hardware)
    if (args.timeline or args.timeline_png) and args.extrapolate_from is not None:
        raise UserError("--timeline needs the whole step traced; drop --extrapolate-from.")
    check_output_file(args.timeline, "--timeline")
    check_output_file(args.timeline_png, "--timeline-png")
    budget = parse_bytes(args.memory) if args.memory else None
    if args.no_expandable_segments:
        opts["expandable_segments"] = False
    est = estimate_step(args.model, mesh, args.plan, opts, batch=args.batch, seq=args.seq,
                        layers=args.layers, dtype=args.dtype, memory_budget=budget,
                        extrapolate_from=args.extrapolate_from, time_limit_s=args.time_limit)
    if est.schedule is not None:
        from shardwise.cost.timeline import write_chrome_trace, write_png

        if args.timeline:
            write_chrome_trace(est.schedule, args.timeline)
        if args.timeline_png:
            write_png(est.schedule, args.timeline_png, title=f"{args.model} {mesh} {args.plan}")
    out = {"model": args.model, "mesh": list(mesh.shape), "mesh_names": list(mesh.names), "plan": args.plan,
           "hardware": hw.name, "ac": est.ac, "compile": args.compile, "async_tp": args.async_tp,
           **est.to_json()}
    if est.schedule is not None:
        out["recomputed_nodes"] = len(est.schedule.recomputed)
    if not args.json:
        _print(out)
    return out


def _print(out: dict) -> None:
    from rich.console import Console

    from shardwise.cost.units import format_bytes

    b = out["breakdown"]
    Console().print(
        f"[bold]{out['model']}[/] on {'x'.join(map(str, out['mesh']))} {out['hardware']}, "
        f"plan {out['plan']}, "
        f"AC {out['ac']}{', compiled' if out['compile'] else ''}{', async TP' if out['async_tp'] else ''}\n"
        f"step {out['step_s'] * 1e3:.1f} ms, {out['tokens_per_s_per_device']:,.0f} tokens/s per device, "
        f"MFU {out['mfu']:.1%}, peak memory {format_bytes(out['memory_per_device_bytes'])} per device "
        f"({'fits' if out['fits'] else 'does not fit'}; reserved by the caching allocator, "
        f"{format_bytes(out['memory_allocated_peak_bytes'])} allocated)\n"
        f"{_memory_line(out['memory_breakdown'])}"
        f"compute {b['compute_s'] * 1e3:.1f} ms, recompute {b['recompute_s'] * 1e3:.1f} ms, communication "
        f"{b['comm_s'] * 1e3:.1f} ms of which exposed {b['exposed_comm_s'] * 1e3:.1f} ms")



def _memory_line(m: dict | None) -> str:
    """Where the allocated peak is and what is alive there."""
    from shardwise.cost.units import format_bytes

    if not m:
        return ""
    parts = ", ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {format_bytes(m[k])}"
                      for k in ("static_bytes", "grads_bytes", "gathered_params_bytes",
                                "saved_activations_bytes", "transients_bytes"))
    return f"allocated peak at {m['at']} ({m['phase']}): {parts}\n"
