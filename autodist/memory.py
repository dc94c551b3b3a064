"""Measuring memory on the device this rank computes on.

On CUDA the caching allocator's counters are exact. On the CPU there is no allocator with
statistics, so the meter reads the process's resident set: ``VmHWM`` (the high-water mark) after
resetting it through ``/proc/self/clear_refs``. Resident memory counts everything the process
touches, so differences between two readings — not absolute values — are what a measurement
reports. Linux only; elsewhere the CPU meter reports the current RSS from psutil and no peak.

[Note: glibc and freed tensors] glibc serves large allocations with ``mmap`` and returns them on
``free`` — but raises its threshold dynamically after the first large free, after which freed tensor
memory may stay resident. Processes that measure peaks (``tools/bench.py``, ``tools/simcheck.py``)
set ``MALLOC_MMAP_THRESHOLD_`` to fix the threshold, so resident memory follows live tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import psutil
import torch

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class MemoryMeter:
    """``reset_peak()`` then ``peak()``: the most memory in use since the reset, in bytes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._proc_ok = os.path.exists("/proc/self/clear_refs")

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        rss = _status_bytes("VmRSS")
        return rss if rss is not None else psutil.Process().memory_info().rss

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._proc_ok:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self._proc_ok = False

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        hwm = _status_bytes("VmHWM") if self._proc_ok else None
        return hwm if hwm is not None else self.current()


def trace_cpu_memory(fn: Callable[[], None], mark_prefix: str = "autodist::mark(") -> tuple[list[tuple[float, int]], dict[str, float]]:
    """Run ``fn`` under the torch profiler's memory tracking (host tensors allocated by this thread
    and by the threads torch runs its work on).

    Returns the bytes allocated since ``fn`` started after every allocation or free, as
    ``(time_us, bytes)``, and the time of every ``record_function`` whose name starts with
    ``mark_prefix``. The CPU allocator keeps no statistics of its own; this is how transient
    peaks are measured there (the profile pass and the comm sweep use it once, not per step).

    [Note: memory tracking without Kineto] ``torch.profiler`` always runs Kineto, which writes its
    own lines to stderr at every session — ``USDT ... profiler_start`` / ``profiler_stop``, and on a
    CUDA build without a GPU ``ERROR ... gpuGetDeviceCount failed with code 35`` — whatever the
    activities or ``experimental_config``. Its only switch, ``KINETO_LOG_LEVEL``, is read when Kineto
    first starts in the process, so it cannot be scoped to AutoDist's sessions. The events needed
    here (allocations, ``record_function`` ranges) are recorded just the same by torch's
    non-Kineto profiler (``ProfilerState.CPU``, what ``torch.autograd.profiler_legacy`` runs), which
    never starts Kineto: it is used while torch has it, ``torch.profiler`` otherwise.
    """
    legacy = all(hasattr(torch.autograd, n) for n in ("_enable_profiler_legacy", "_disable_profiler_legacy"))
    return (_trace_without_kineto if legacy else _trace_with_kineto)(fn, mark_prefix)


def _trace_without_kineto(fn: Callable[[], None], mark_prefix: str) -> tuple[list[tuple[float, int]], dict[str, float]]:
    from torch._C._profiler import _ExperimentalConfig
    from torch.autograd import ProfilerConfig, ProfilerState

    config = ProfilerConfig(ProfilerState.CPU, False, True, False, False, False, _ExperimentalConfig())
    torch.autograd._enable_profiler_legacy(config)
    try:
        fn()
    finally:
        records = torch.autograd._disable_profiler_legacy()
    events = [e for thread in records for e in thread]
    start = next((e for e in events if e.kind() == "mark" and e.name() == "__start_profile"), None)
    if start is None:
        return [], {}
    deltas = sorted(
        ((start.cpu_elapsed_us(e), e.cpu_memory_usage()) for e in events if e.kind() == "memory_alloc"),
        key=lambda d: d[0],
    )
    mem, total = [], 0
    for ts, delta in deltas:
        total += delta
        mem.append((ts, total))
    marks = {e.name(): start.cpu_elapsed_us(e) for e in events if e.kind() == "push" and e.name().startswith(mark_prefix)}
    return mem, marks


def _trace_with_kineto(fn: Callable[[], None], mark_prefix: str) -> tuple[list[tuple[float, int]], dict[str, float]]:
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    raw = sorted(
        (e["ts"], int(e["args"].get("Total Allocated", 0)), int(e["args"].get("Bytes", 0)))
        for e in events
        if e.get("name") == "[memory]"
    )
    # [Note: profiler totals] "Total Allocated" counts from the first profiling session of the
    # process and misses frees made while no profiler ran, so it drifts upwards from session to
    # session. Only differences within one session are meaningful: report totals relative to the
    # value just before this session's first event.
    base = raw[0][1] - raw[0][2] if raw else 0
    mem = [(ts, total - base) for ts, total, _ in raw]
    marks = {e["name"]: e["ts"] for e in events if e.get("ph") == "X" and e.get("name", "").startswith(mark_prefix)}
    return mem, marks


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and aliases counted once; a DTensor
    by its local tensor)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        st = t.untyped_storage()
        key = st.data_ptr()
        if key and key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def measure_step_peak(step: Callable[[], None], device: torch.device, live: Callable[[], Iterable[torch.Tensor]]) -> int:
    """Peak tensor bytes during a training step. CUDA: the allocator's peak over one ``step()``.
    CPU (the allocator keeps no statistics): ``step()`` runs twice under the profiler's memory
    tracking, and the second is measured — the bytes of the ``live()`` tensors held when it starts
    plus the running total of what it allocates and frees. The first step is there because the
    profiler cannot see the free of a block allocated before it started (a gradient buffer or an
    offloaded state released early in the step would otherwise look still held)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    label = "autodist::mark(measured step)"
    start = [0]

    def two_steps() -> None:
        step()
        start[0] = storage_bytes(live())
        with torch.profiler.record_function(label):
            pass
        step()

    mem, marks = trace_cpu_memory(two_steps)
    t = marks[label]
    before = [m for ts, m in mem if ts <= t]
    base = before[-1] if before else 0
    return start[0] + max((m - base for ts, m in mem if ts > t), default=0)
