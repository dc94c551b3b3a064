"""Timelines of one training step — simulated or measured — as Chrome traces and PNG plots.

A :class:`Timeline` is a list of intervals on named streams (``compute``, ``comm``, ``copy``, and
``host`` for an asynchronous device) plus a memory curve. ``from_simulation`` converts a simulator result; ``from_profiler_trace`` converts a
``torch.profiler`` Chrome trace of a real step (the runtime labels its collectives and hooks
``autodist::…``; gloo runs collectives on its own threads, recorded as ``gloo:…``), so a simulated
and a measured step of the same plan can be laid side by side. ``to_chrome_trace`` writes JSON that
chrome://tracing and Perfetto open (one track per stream and a memory counter track); ``to_png``
draws a Gantt chart over the memory curve (needs matplotlib: the ``plot`` extra): one lane each for
the forward and the backward of the compute stream, the collectives and the offload copies, a
colour per kind of work (forward, backward, loss, optimizer, AutoDist's own copies, each kind of
collective), the largest events labelled, every event at least a few pixels wide so short
collectives stay visible, a legend with each kind's count and total time, and the peak and the
budget marked on the memory curve.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

STREAMS = ("compute", "comm", "copy", "host")


@dataclass
class Interval:
    stream: str
    name: str
    start: float  # seconds from the start of the step
    end: float


@dataclass
class Timeline:
    intervals: list[Interval] = field(default_factory=list)
    memory: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes)
    title: str = ""
    budget_bytes: int | None = None

    @property
    def duration(self) -> float:
        ends = [i.end for i in self.intervals] + [t for t, _ in self.memory]
        return max(ends, default=0.0)


def from_simulation(result: Any, title: str = "simulated step", *, budget_bytes: int | None = None) -> Timeline:
    """A :class:`~autodist.cost.simulator.SimResult` simulated with ``record=True``; ``budget_bytes``
    (the plan's budget) is marked on the memory curve."""
    if not result.events:
        raise ValueError("the simulation was run without record=True; there are no events to draw")
    return Timeline(
        intervals=[Interval(e.stream, e.name, e.start, e.end) for e in result.events],
        memory=list(result.memory),
        title=title,
        budget_bytes=budget_bytes,
    )


def from_profiler_trace(trace: str | os.PathLike[str] | dict[str, Any], title: str = "measured step") -> Timeline:
    """A ``torch.profiler`` Chrome trace (path or loaded JSON) of one step."""
    data: dict[str, Any]
    if isinstance(trace, (str, os.PathLike)):
        with open(trace) as f:
            data = json.load(f)
    else:
        data = trace
    events = [e for e in data["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    if not events:
        return Timeline(title=title)
    # the main thread is the one that issued autodist's labels (else the busiest)
    by_tid: dict[Any, list[dict]] = {}
    for e in events:
        by_tid.setdefault(e.get("tid"), []).append(e)
    main = max(by_tid, key=lambda t: (sum(e["name"].startswith("autodist::") for e in by_tid[t]), len(by_tid[t])))
    t0 = min(e["ts"] for e in events)
    intervals: list[Interval] = []
    # compute: the outermost events of the main thread
    last_end = -1.0
    for e in sorted(by_tid[main], key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= last_end:
            if e["name"].startswith("ProfilerStep") or e["name"].startswith("PyTorch Profiler"):
                continue
            intervals.append(Interval("compute", e["name"], (e["ts"] - t0) / 1e6, (e["ts"] + e["dur"] - t0) / 1e6))
            last_end = e["ts"] + e["dur"]
    for tid, evs in by_tid.items():
        if tid == main:
            continue
        for e in evs:
            name = e["name"]
            if name.startswith("gloo:") or name.startswith("nccl:") or "ncclKernel" in name:
                intervals.append(Interval("comm", name, (e["ts"] - t0) / 1e6, (e["ts"] + e["dur"] - t0) / 1e6))
    memory = sorted(
        ((e["ts"] - t0) / 1e6, int(e["args"].get("Total Allocated", 0)))
        for e in data["traceEvents"]
        if e.get("name") == "[memory]"
    )
    intervals.sort(key=lambda i: (i.start, i.stream))
    return Timeline(intervals=intervals, memory=memory, title=title)


def to_chrome_trace(timeline: Timeline, path: str | os.PathLike[str], *, pid: int = 0) -> None:
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": timeline.title or "autodist"}}
    ]
    for tid, stream in enumerate(STREAMS):
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": stream}})
    for iv in timeline.intervals:
        events.append(
            {
                "name": iv.name, "cat": iv.stream, "ph": "X", "pid": pid, "tid": STREAMS.index(iv.stream),
                "ts": iv.start * 1e6, "dur": max(0.0, iv.end - iv.start) * 1e6,
            }
        )
    budget = {} if timeline.budget_bytes is None else {"budget MiB": timeline.budget_bytes / 2**20}
    for t, b in timeline.memory:
        events.append({"name": "memory", "ph": "C", "pid": pid, "ts": t * 1e6, "args": {"MiB": b / 2**20, **budget}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


# ------------------------------------------------------------------------------------------------
# PNG
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PngStyle:
    """How ``to_png`` draws. ``min_bar_px``: the narrowest bar (a 50 us collective in a 500 ms step
    would be a tenth of a pixel wide); ``labels_per_lane``: how many of a lane's longest events get
    their name written on them, where it fits."""

    min_bar_px: float = 3.0
    labels_per_lane: int = 8
    label_px_per_char: float = 5.0
    dpi: int = 100


# kind of work -> (colour, legend text); legend order
KINDS: dict[str, tuple[str, str]] = {
    "forward": ("#4C72B0", "forward (per unit)"),
    "backward": ("#2A3F73", "backward (per unit)"),
    "loss": ("#8C8C8C", "loss"),
    "optimizer": ("#55A868", "optimizer step"),
    "runtime": ("#C9B27C", "AutoDist copies and hooks"),
    "compute": ("#4C72B0", "compute"),
    "all_gather": ("#DD8452", "all-gather (parameters)"),
    "refresh": ("#F2B880", "all-gather (persistent refresh)"),
    "reduce_scatter": ("#C44E52", "reduce-scatter (gradients)"),
    "all_reduce": ("#8172B3", "all-reduce (gradients)"),
    "collective": ("#937860", "other collective"),
    "copy_out": ("#64B5CD", "offload: copy out"),
    "copy_back": ("#1F7A8C", "offload: copy back"),
    "copy": ("#64B5CD", "copy"),
}
_SHORT = {"all_gather": "AG", "refresh": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "copy_out": "out", "copy_back": "in"}


def kind_of(iv: Interval) -> str:
    """The kind of work an interval is (a key of :data:`KINDS`)."""
    name = iv.name
    low = name.lower()
    if iv.stream == "comm":
        if "refresh" in low:
            return "refresh"
        for k in ("reduce_scatter", "all_gather", "all_reduce"):
            if k in low or k.replace("_", "") in low:
                return k
        return "collective"
    if iv.stream == "copy":
        return name.split(" ")[0] if name.split(" ")[0] in ("copy_out", "copy_back") else "copy"
    if name.startswith("fwd "):
        return "forward"
    if name.startswith("bwd "):
        return "backward"
    if name.startswith("loss"):
        return "loss"
    if name == "optimizer":
        return "optimizer"
    if name in ("forward", "copy-out", "bucket copy-in"):
        return "runtime"
    return "compute"


def _short_name(iv: Interval, kind: str) -> str:
    if iv.stream == "compute":
        return iv.name.split(" ", 1)[1] if iv.name.startswith(("fwd ", "bwd ")) else iv.name
    label = iv.name.split(" ")[-1]
    return f"{_SHORT.get(kind, '')} {label}".strip()


def lanes(timeline: Timeline) -> list[tuple[str, list[Interval]]]:
    """Rows of the picture, top to bottom: the compute stream split at the start of backward into
    ``compute: forward`` and ``compute: backward`` (the optimizer step is in the second), then
    ``comm``, ``copy`` and, on an asynchronous device, ``host`` (what the host thread spent issuing
    each segment); rows with nothing in them are left out."""
    compute = [i for i in timeline.intervals if i.stream == "compute"]
    starts = [i.start for i in compute if i.name == "loss backward" or i.name.startswith("bwd ")]
    rows: list[tuple[str, list[Interval]]] = []
    if starts:
        t_bwd = min(starts)
        rows += [("compute: forward", [i for i in compute if i.start < t_bwd]),
                 ("compute: backward", [i for i in compute if i.start >= t_bwd])]
    else:
        rows.append(("compute", compute))
    rows += [(s, [i for i in timeline.intervals if i.stream == s]) for s in STREAMS if s != "compute"]
    return [(name, ivs) for name, ivs in rows if ivs] or [("compute", [])]


def _fit(text: str, chars: int) -> str:
    """``text`` in at most ``chars`` characters: leading dotted components dropped first
    (``blocks.0.attn.qkv`` → ``0.attn.qkv`` → ``attn.qkv``), then cut with an ellipsis; empty when
    fewer than four characters fit."""
    if chars < 4:
        return ""
    while len(text) > chars and "." in text:
        text = text.split(".", 1)[1]
    return text if len(text) <= chars else text[: chars - 1] + "…"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 0.1 else f"{seconds * 1e3:.1f} ms"


def _draw_memory(axm: Any, timeline: Timeline) -> None:
    """The memory curve and its peak; the budget as a line when it is near the curve, else a note."""
    from .cost.budget import format_bytes

    ts = [t * 1e3 for t, _ in timeline.memory]
    ms = [b / 2**20 for _, b in timeline.memory]
    axm.step(ts, ms, where="post", color="#404040", label="memory in use")
    axm.fill_between(ts, ms, step="post", alpha=0.15, color="#404040")
    i_peak = max(range(len(ms)), key=ms.__getitem__)
    axm.plot([ts[i_peak]], [ms[i_peak]], "o", color="#404040", markersize=4)
    axm.annotate(
        f"peak {format_bytes(timeline.memory[i_peak][1])}", (ts[i_peak], ms[i_peak]), textcoords="offset points",
        xytext=(4, 4), fontsize=7,
    )
    top = max(ms) * 1.25 if max(ms) > 0 else 1.0
    if timeline.budget_bytes is not None:
        budget_mib = timeline.budget_bytes / 2**20
        if budget_mib <= top * 1.6:
            top = max(top, budget_mib * 1.1)
            axm.axhline(budget_mib, color="black", linestyle="--", linewidth=1, label=f"budget {format_bytes(timeline.budget_bytes)}")
        else:
            axm.annotate(
                f"budget {format_bytes(timeline.budget_bytes)} per rank, above the plot (the peak is "
                f"{100 * max(ms) / budget_mib:.1f}% of it)",
                (0.995, 0.95), xycoords="axes fraction", ha="right", va="top", fontsize=7,
            )
    axm.set_ylim(0, top)
    axm.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)


def to_png(
    timeline: Timeline, path: str | os.PathLike[str], *, width_px: int = 1400, height_px: int = 700,
    style: PngStyle = PngStyle(),
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("PNG timelines need matplotlib: pip install 'autodist[plot]'") from e

    dpi = style.dpi
    fig, (ax, axm) = plt.subplots(
        2, 1, figsize=(width_px / dpi, height_px / dpi), dpi=dpi, sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    end_ms = max(timeline.duration * 1e3, 1e-6) * 1.01
    rows = list(reversed(lanes(timeline)))  # bottom to top
    totals: dict[str, list[float]] = {}
    for iv in timeline.intervals:
        t = totals.setdefault(kind_of(iv), [0, 0.0])
        t[0] += 1
        t[1] += iv.end - iv.start
    # what takes room (ticks, titles, legends) first, then the layout, then the bars and labels at the
    # pixel scale the layout leaves
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([name for name, _ in rows])
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(0, end_ms)
    ax.set_title(timeline.title)
    handles = [
        Patch(color=KINDS[k][0], label=f"{KINDS[k][1]}: {totals[k][0]}, {_ms(totals[k][1])}") for k in KINDS if k in totals
    ]
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False,
        title=f"kind: count, total time\n(bars at least {style.min_bar_px:g} px wide)", title_fontsize=7,
    )
    if timeline.memory:
        _draw_memory(axm, timeline)
    axm.set_ylabel("memory (MiB)")
    axm.set_xlabel("time (ms)")
    fig.tight_layout()
    ms_per_px = end_ms / max(ax.get_window_extent().width, 1.0)
    min_w = style.min_bar_px * ms_per_px
    for row, (_, ivs) in enumerate(rows):
        spans = [(iv.start * 1e3, max((iv.end - iv.start) * 1e3, min_w)) for iv in ivs]
        colors = [KINDS[kind_of(iv)][0] for iv in ivs]
        # a thin white edge separates neighbours; narrow bars keep all their pixels
        edges = [0.3 if w / ms_per_px > 4 * style.min_bar_px else 0.0 for _, w in spans]
        ax.broken_barh(spans, (row - 0.38, 0.76), facecolors=colors, edgecolor="white", linewidths=edges)
        for iv in sorted(ivs, key=lambda i: i.end - i.start, reverse=True)[: style.labels_per_lane]:
            chars = int((iv.end - iv.start) * 1e3 / ms_per_px / style.label_px_per_char)
            text = _fit(_short_name(iv, kind_of(iv)), chars)
            if text:
                ax.text((iv.start + iv.end) / 2 * 1e3, row, text, ha="center", va="center", fontsize=7, color="white", clip_on=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
