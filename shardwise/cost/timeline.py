"""A step schedule as a picture: Chrome trace JSON (Perfetto opens it) and a PNG Gantt chart.

Chrome trace: one process, one thread (track) per stream — ``compute`` first, then one per mesh
dim's communication stream — and one complete event (``"ph": "X"``) per kernel or collective,
named after its node, with microsecond timestamps as the format wants.

PNG: the whole step, then one decoder layer (the middle one, the steady state): its forward, and
its backward with its recomputation; a row per stream.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardwise.cost.schedule import COMPUTE_STREAM, EventKind, StepSchedule
from shardwise.errors import UserError
from shardwise.plan.cluster import TAIL

US = 1e6  # Chrome traces count microseconds
COLORS = {EventKind.COMPUTE: "tab:blue", EventKind.RECOMPUTE: "tab:orange",
          EventKind.OPTIMIZER: "tab:purple", EventKind.COLLECTIVE: "tab:green"}


def streams(sched: StepSchedule) -> list[str]:
    """The schedule's streams, compute first."""
    others = sorted({e.stream for e in sched.events} - {COMPUTE_STREAM})
    return [COMPUTE_STREAM, *others]


def chrome_trace(sched: StepSchedule) -> dict:
    tids = {s: i for i, s in enumerate(streams(sched))}
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "shardwise step"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": s}}
               for s, t in tids.items()]
    events += [{"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": t, "args": {"sort_index": t}}
               for t in tids.values()]
    for e in sched.events:
        events.append({"name": e.name, "cat": e.kind, "ph": "X", "pid": 0, "tid": tids[e.stream],
                       "ts": e.start * US, "dur": e.dur * US,
                       "args": {"phase": e.phase, "layer": e.region if 0 <= e.region < TAIL else None}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(sched: StepSchedule, path: str | Path) -> None:
    try:
        Path(path).write_text(json.dumps(chrome_trace(sched)))
    except OSError as e:
        raise UserError(f"cannot write the timeline to {str(path)!r} ({e.strerror}).") from None


def middle_layer(sched: StepSchedule) -> int | None:
    layers = sorted({e.region for e in sched.events if 0 <= e.region < TAIL})
    return layers[len(layers) // 2] if layers else None


def write_png(sched: StepSchedule, path: str | Path, title: str = "") -> None:
    """Gantt chart of the whole step and of one layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = streams(sched)
    layer = middle_layer(sched)
    panels = [("whole step", sched.events)]
    for phase in ("forward", "backward") if layer is not None else ():
        mine = [e for e in sched.events
                if e.region == layer and e.phase == phase and e.stream == COMPUTE_STREAM]
        if not mine:
            continue
        lo, hi = min(e.start for e in mine), max(e.end for e in mine)
        # The layer's kernels and every collective that runs meanwhile.
        panels.append((f"layer {layer} {phase}", [e for e in sched.events if e.end > lo and e.start < hi]))
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 2.2 + 1.2 * len(rows) * len(panels)), squeeze=False)
    for ax, (name, evs) in zip(axes[:, 0], panels, strict=True):
        for k, stream in enumerate(rows):
            for kind, color in COLORS.items():
                bars = [(e.start * 1e3, e.dur * 1e3) for e in evs if e.stream == stream and e.kind == kind]
                if bars:
                    # thin white edges: back-to-back kernels stay apart
                    ax.broken_barh(bars, (k - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.4,
                                   label=kind if k == 0 or kind == EventKind.COLLECTIVE else None)
        ax.set_yticks(range(len(rows)), rows)
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        ax.set_title(f"{title} {name}".strip())
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles, strict=True))
        ax.legend(uniq.values(), uniq.keys(), loc="upper right", fontsize=7)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise UserError(f"cannot write the timeline image to {str(path)!r} ({e.strerror}).") from None
    finally:
        plt.close(fig)
