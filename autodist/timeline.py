"""Timelines of one training step — simulated or measured — as Chrome traces and PNG plots.

A :class:`Timeline` is a list of intervals on named streams (``compute``, ``comm``, ``copy``) plus a
memory curve. ``from_simulation`` converts a simulator result; ``from_profiler_trace`` converts a
``torch.profiler`` Chrome trace of a real step (the runtime labels its collectives and hooks
``autodist::…``; gloo runs collectives on its own threads, recorded as ``gloo:…``), so a simulated
and a measured step of the same plan can be laid side by side. ``to_chrome_trace`` writes JSON that
chrome://tracing and Perfetto open (one track per stream and a memory counter track); ``to_png``
draws a Gantt chart of the streams over the memory curve (needs matplotlib: the ``plot`` extra).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

STREAMS = ("compute", "comm", "copy")


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

    @property
    def duration(self) -> float:
        ends = [i.end for i in self.intervals] + [t for t, _ in self.memory]
        return max(ends, default=0.0)


def from_simulation(result: Any, title: str = "simulated step") -> Timeline:
    """A :class:`~autodist.cost.simulator.SimResult` simulated with ``record=True``."""
    if not result.events:
        raise ValueError("the simulation was run without record=True; there are no events to draw")
    return Timeline(
        intervals=[Interval(e.stream, e.name, e.start, e.end) for e in result.events],
        memory=list(result.memory),
        title=title,
    )


def from_profiler_trace(trace: str | dict, title: str = "measured step") -> Timeline:
    """A ``torch.profiler`` Chrome trace (path or loaded JSON) of one step."""
    if isinstance(trace, (str, os.PathLike)):
        with open(trace) as f:
            trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
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
        for e in trace["traceEvents"]
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
    for t, b in timeline.memory:
        events.append({"name": "memory", "ph": "C", "pid": pid, "ts": t * 1e6, "args": {"MiB": b / 2**20}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def to_png(timeline: Timeline, path: str | os.PathLike[str], *, width_px: int = 1400, height_px: int = 700) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("PNG timelines need matplotlib: pip install 'autodist[plot]'") from e
    dpi = 100
    fig, (ax, axm) = plt.subplots(
        2, 1, figsize=(width_px / dpi, height_px / dpi), dpi=dpi, sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    colors = {"compute": "#4C72B0", "comm": "#DD8452", "copy": "#55A868"}
    streams = [s for s in STREAMS if any(i.stream == s for i in timeline.intervals)] or ["compute"]
    for row, stream in enumerate(streams):
        spans = [(i.start * 1e3, (i.end - i.start) * 1e3) for i in timeline.intervals if i.stream == stream]
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=colors[stream], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(streams)))
    ax.set_yticklabels(streams)
    ax.set_title(timeline.title)
    if timeline.memory:
        ts = [t * 1e3 for t, _ in timeline.memory]
        ms = [b / 2**20 for _, b in timeline.memory]
        axm.step(ts, ms, where="post", color="#C44E52")
        axm.fill_between(ts, ms, step="post", alpha=0.2, color="#C44E52")
    axm.set_ylabel("memory (MiB)")
    axm.set_xlabel("time (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
