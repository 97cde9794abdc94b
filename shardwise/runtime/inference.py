"""Run an eager per-rank program under inference mode where autograd would record nothing.

A training step's program computes its gradients itself (the joint graph), so autograd has
nothing to record while it runs: ``parallelize``'s step runs it inside an ``autograd.Function``,
under no-grad. But no-grad still gives every tensor an op makes a version counter and tracks its
views; inference mode skips both. ``benchmarks/bindings.py`` (one thread, 4 layers, 4 x 128):
llama-tiny's traced step 17.63 -> 16.97 and 18.89 -> 18.10 ms a call (two runs), llama-small's,
whose time is arithmetic, the same within noise (150.62 -> 149.87, 152.70 -> 152.44 ms).
Inside llama-tiny's ddp step on two gloo ranks, switching mode from step to step within one run,
0.55-1.07 ms less CPU of 18.7-19.9 ms (the forward-and-backward phase, the median of 95 steps
each way, three runs).

Safety: the values are the same (the same kernels run). Inference tensors refuse in-place updates
outside inference mode. ``clip_grad_norm_`` and ``zero_grad`` reach a gradient's shard through
DTensor's dispatch, below that check, but an optimizer writing ``p.grad.to_local()`` or a caller
scaling a returned value in place would meet it. So each output tensor is handed back as an
ordinary tensor over the same storage (a view made by ``set_``: no copy); nothing else keeps the
inference tensor, so nothing writes the storage behind the new one's version counter. Where grad
mode is on (an eval forward run outside ``no_grad``, whose outputs autograd may differentiate),
the program runs as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def ordinary(t: torch.Tensor) -> torch.Tensor:
    """An ordinary (not inference) tensor over ``t``'s storage, with its sizes and strides."""
    if not t.is_inference():
        return t
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def without_autograd(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run under inference mode when grad mode is off, its outputs (a tensor, or a tuple or
    list of them and other values) handed back as ordinary tensors."""

    def run(*args: Any) -> Any:
        if torch.is_grad_enabled():
            return fn(*args)
        with torch.inference_mode():
            outs = fn(*args)
        if isinstance(outs, torch.Tensor):
            return ordinary(outs)
        return type(outs)(ordinary(o) if isinstance(o, torch.Tensor) else o for o in outs)

    return run
