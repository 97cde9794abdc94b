"""A training step's graph called through OpOverloads against the same graph through PyTorch's
Python bindings (``runtime/bindings.py``), one process, one thread.

For each model: the forward and backward of one step traced by ``make_fx`` into ATen ops, then
run ``--calls`` times each way, interleaved (so a drifting machine touches both), printing the
nodes, how many call a binding, the median ms of a call each way and the saving. The values are
checked to be the same bits first. Then the binding calls as a step runs them (the parameters
plain tensors, autograd recording nothing): under no-grad, and under inference mode
(``runtime/inference.py``).

    python benchmarks/bindings.py [--models llama-tiny,llama-small] [--layers 4] [--batch 4]
                                  [--seq 128] [--calls 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def step_graph(name: str, layers: int, batch: int, seq: int):
    """A built-in model's training step (loss and every parameter's gradient) traced by
    ``make_fx`` with real weights, and the arguments to call it with."""
    from shardwise.models import get_model

    spec = get_model(name, layers=layers, batch=batch, seq=seq)
    torch.manual_seed(0)
    module = spec.build_module()
    params = {k: v.detach().requires_grad_(True) for k, v in module.named_parameters()}
    inputs = spec.example_inputs(True, 0)

    def step(params, *inputs):
        loss = functional_call(module, params, inputs)
        return loss, *torch.autograd.grad(loss, list(params.values()))

    return make_fx(step)(params, *inputs), (params, *inputs)


def _no_grad(fn):
    """``fn`` called under ``torch.no_grad()``, as a step's ``autograd.Function`` runs it."""

    def run(*args):
        with torch.no_grad():
            return fn(*args)

    return run


def main() -> None:
    from shardwise.runtime.bindings import DIRECT_CALLS, direct_calls
    from shardwise.runtime.inference import without_autograd

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama-tiny,llama-small")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--calls", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{args.layers} layers, batch {args.batch} x {args.seq}, fp32, one thread; "
          f"median of {args.calls} calls")
    print(f"{'model':<14} {'nodes':>6} {'direct':>7} {'overload_ms':>12} {'direct_ms':>10} {'saved_ms':>9} "
          f"{'no_grad_ms':>11} {'inference_ms':>13}")
    for name in args.models.split(","):
        gm, call_args = step_graph(name, args.layers, args.batch, args.seq)
        fast = direct_calls(gm)
        got, want = tree_leaves(fast(*call_args)), tree_leaves(gm(*call_args))
        if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
            raise SystemExit(f"{name}: the direct calls changed a value")
        # As a step runs it: plain parameters (a DTensor's local shards), nothing recorded.
        plain = ({k: v.detach() for k, v in call_args[0].items()}, *call_args[1:])
        variants = {"overload": (gm, call_args), "direct": (fast, call_args),
                    "no_grad": (_no_grad(fast), plain),
                    "inference": (_no_grad(without_autograd(fast)), plain)}
        fn, a = variants["inference"]
        if not all(torch.equal(x, y) for x, y in zip(tree_leaves(fn(*a)), want, strict=True)):
            raise SystemExit(f"{name}: inference mode changed a value")
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.calls):
            for key, (fn, a) in variants.items():
                t0 = time.perf_counter()
                fn(*a)
                times[key].append(time.perf_counter() - t0)
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        direct = sum(n.target in DIRECT_CALLS for n in calls)
        slow, quick, ng, inf = (statistics.median(times[k]) * 1e3 for k in variants)
        print(f"{name:<14} {len(calls):>6} {direct:>7} {slow:>12.2f} {quick:>10.2f} {slow - quick:>9.2f} "
              f"{ng:>11.2f} {inf:>13.2f}")


if __name__ == "__main__":
    main()
