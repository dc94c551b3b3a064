"""Measuring memory: tensor memory (what the budget is about) and resident memory (its own thing).

[Note: what peak memory means] AutoDist reports **tensor memory** against the budget everywhere — step
logs, ``metrics()``, plans, ``tools/bench.py`` — and resident memory (the process's RSS, about 0.5 GiB
of which is torch itself) only under its own name:

* **CUDA**: the caching allocator's allocated bytes, ``torch.cuda.max_memory_allocated``. Its peak
  counter is process-wide, and resetting it (``reset_peak_memory_stats``) clobbers a peak the user
  reads with the same call, so :class:`TensorPeakProbe` resets it only when asked for per-step
  figures (``AutoDist(..., log_every=N)``, as torchtitan's memory monitor does). Otherwise it reads
  it without resetting: the figure is the process's peak so far (scope ``"process"``), and a step
  that raised it is known to have reached it (``new_high``).
* **CPU**: the host allocator keeps no statistics, so the peak of a step is measured with the torch
  profiler's memory tracking (:func:`trace_cpu_memory`; its cost is an event per operation, 10-70%
  of a step for small models): the bytes of the tensors the model holds when the step starts
  (parameters and shards, gradients, optimizer state, buffers, gathered and bucket buffers: what
  ``live`` returns) plus the running total of what the step allocates and frees on this thread.
  The profiler sees the free of a block only if the block was allocated while it was recording, so
  the step before a measured one is recorded too (in a session of its own: no session spans the
  gap between steps, where the user may start a profiler): what that step allocates and the
  measured step frees (gradient buckets, optimizer state copied to the host) is then subtracted.
  Buffers a collective backend's own threads held when the step started (a refresh issued at the
  optimizer step) are counted from their frees (see [Note: buffers a backend holds across a step
  boundary]). The figure misses tensors the training loop holds outside the model that the step
  does not allocate, and still counts what the step frees that was allocated two or more steps
  earlier.
  A profiler session is process-visible (torch refuses to start another one on the thread while it
  runs: a user's ``torch.profiler.profile()`` entered mid-step would fail), so the CPU figure is
  measured only when per-step figures were asked for (``AutoDist(..., log_every=N)``), on steps 1,
  2, 4, 8, ... (each with the step before): every plan in force gets a figure and a budget check,
  at a cost that vanishes with the number of steps; other steps report the last measured one. No
  session starts while another profiler runs.

Resident memory is read from ``/proc/self/status`` (``VmRSS``; Linux, else psutil).
:class:`ResidentMeter` (the benchmark's) resets the high-water mark ``VmHWM`` through
``/proc/self/clear_refs``, which is process-wide: the library itself never does.

[Note: glibc and freed tensors] glibc serves large allocations with ``mmap`` and returns them on
``free`` — but raises its threshold dynamically after the first large free, after which freed tensor
memory may stay resident. Processes that measure resident peaks (``tools/bench.py``) set
``MALLOC_MMAP_THRESHOLD_`` to fix the threshold, so resident memory
follows live tensors. Tools that time steps against the simulator (``tools/simcheck.py``,
``autodist check``) do not: a fixed threshold faults every large allocation's pages in afresh,
which a user's training process does not pay.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
import torch

if TYPE_CHECKING:
    from torch.profiler import profile

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


def resident_bytes() -> int:
    """The process's resident set now."""
    rss = _status_bytes("VmRSS")
    return rss if rss is not None else psutil.Process().memory_info().rss


class ResidentMeter:
    """Resident memory (RSS) for tools: ``reset_peak()`` then ``peak()``, the most resident since the
    reset (``VmHWM`` after writing ``/proc/self/clear_refs``: process-wide, never done by the library).
    Linux only; elsewhere ``peak()`` is the current RSS."""

    def __init__(self) -> None:
        self._proc_ok = os.path.exists("/proc/self/clear_refs")

    def current(self) -> int:
        return resident_bytes()

    def reset_peak(self) -> None:
        if self._proc_ok:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self._proc_ok = False

    def peak(self) -> int:
        hwm = _status_bytes("VmHWM") if self._proc_ok else None
        return hwm if hwm is not None else self.current()


@dataclass(frozen=True)
class PeakReading:
    """A measured tensor-memory peak. ``scope``: ``"step"`` (this window's own peak) or ``"process"``
    (CUDA without a reset: the process's peak so far, at least this window's). ``new_high``: the
    window reached the figure (always true for ``"step"``)."""

    nbytes: int
    scope: str
    new_high: bool


class TensorPeakProbe:
    """Peak tensor memory over a window (a training step): ``start(live)`` … ``stop()``. See
    [Note: what peak memory means]. ``reset``: CUDA may reset the allocator's peak counter at
    ``start`` (per-step figures were asked for)."""

    def __init__(self, device: torch.device, *, reset: bool) -> None:
        self.device = device
        self.reset = reset
        self._trace: _CpuTrace | None = None
        self._base = 0
        self._before = 0
        self.running = False

    def start(self, live: Callable[[], Iterable[torch.Tensor]]) -> bool:
        """Open a window; False when it cannot be measured (CPU: another profiler is running)."""
        if self.running:
            return True
        if self.device.type == "cuda":
            if self.reset:
                torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.max_memory_allocated(self.device)
            self.running = True
            return True
        if torch.autograd._profiler_enabled():
            return False  # the user's profiler: measuring would fail to start, or stop theirs
        self._base = storage_bytes(live())
        self._trace = _CpuTrace()
        self._trace.start()
        self.running = True
        return True

    def stop(self) -> PeakReading | None:
        if not self.running:
            return None
        self.running = False
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            if self.reset:
                return PeakReading(peak, "step", True)
            return PeakReading(peak, "process", peak > self._before)
        trace, self._trace = self._trace, None
        if trace is None:
            raise RuntimeError("TensorPeakProbe.stop(): a CPU window was open without a profiler session")
        events = trace.stop()
        peak = self._base + events.held_elsewhere() + max((m for _, m in events.mem), default=0)
        return PeakReading(peak, "step", True)


C10_ERROR = 2  # c10's log severities: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL


def _c10_log_level() -> ctypes.c_int32 | None:
    """c10's minimum severity of the lines it logs (``FLAGS_caffe2_log_level``, which
    ``TORCH_CPP_LOG_LEVEL`` sets when torch loads), or ``None`` where the library does not export it."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libc10.so", "libc10.dylib", "c10.dll"):
        path = os.path.join(lib_dir, name)
        if os.path.exists(path):
            try:
                return ctypes.c_int32.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_log_level")
            except (OSError, ValueError):
                return None
    return None


class _CpuTrace:
    """One session of the profiler's memory tracking on this thread, started and stopped by hand
    (see :func:`trace_cpu_memory`).

    [Note: the allocator's warning about blocks allocated before profiling] While the profiler
    tracks memory, torch's CPU allocator logs ``[W ... CPUAllocator.cpp] Memory block of unknown
    size was allocated before the profiling started, profiler results will not include the
    deallocation event`` when a block allocated before the session is freed in it (the first two
    times in a process): every profile pass frees such blocks (the model's earlier activations,
    gradients), and the figures account for them (``held_elsewhere``, the ``live`` bytes a window
    starts from), so the line tells a user nothing. It is c10's C++ log, not a Python warning: no
    ``warnings`` filter reaches it, and ``TORCH_CPP_LOG_LEVEL`` is read once, when torch loads. So
    a session raises c10's minimum severity to ERROR while it runs and puts it back as it was when
    it stops: only c10's WARNING lines logged during AutoDist's own profiler sessions are dropped
    (Python warnings, ``TORCH_WARN``, are untouched)."""

    def __init__(self, mark_prefix: str = "autodist::mark(") -> None:
        self.mark_prefix = mark_prefix
        self._legacy = all(hasattr(torch.autograd, n) for n in ("_enable_profiler_legacy", "_disable_profiler_legacy"))
        self._prof: profile | None = None
        self._log_level: tuple[ctypes.c_int32, int] | None = None  # c10's level and its value before the session

    def start(self) -> None:
        level = _c10_log_level()
        if level is not None:
            self._log_level = (level, level.value)
            level.value = max(level.value, C10_ERROR)
        try:
            self._start()
        except BaseException:
            self._restore_log_level()
            raise

    def _restore_log_level(self) -> None:
        if self._log_level is not None:
            level, before = self._log_level
            level.value = before
            self._log_level = None

    def stop(self) -> _Events:
        try:
            return self._stop()
        finally:
            self._restore_log_level()

    def _start(self) -> None:
        if self._legacy:
            from torch._C._profiler import _ExperimentalConfig
            from torch.autograd import ProfilerConfig, ProfilerState

            config = ProfilerConfig(ProfilerState.CPU, False, True, False, False, False, _ExperimentalConfig())
            torch.autograd._enable_profiler_legacy(config)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()

    def _stop(self) -> _Events:
        if self._legacy:
            return _legacy_events(torch.autograd._disable_profiler_legacy(), self.mark_prefix)
        prof = self._prof
        if prof is None:
            raise RuntimeError("_CpuTrace.stop() called before start()")
        prof.__exit__(None, None, None)
        return _kineto_events(prof, self.mark_prefix)


@dataclass
class _Events:
    """One session's memory events: the running total after each allocation or free (all threads),
    the times of the marks, and each change made on another thread than the session's own, as
    ``(time, bytes, thread)``."""

    mem: list[tuple[float, int]]
    marks: dict[str, float]
    elsewhere: list[tuple[float, int, int]]

    def held_elsewhere(self, since: float = float("-inf")) -> int:
        """Bytes that other threads held at ``since`` and freed later in the session.

        [Note: buffers a backend holds across a step boundary] A collective backend allocates its
        own buffers on its worker threads (gloo's all-gather: a message-sized buffer until the
        collective completes), and a collective issued before a step — a persistent group's refresh,
        issued at the optimizer step — still holds them when the step starts. They are no tensor the
        model or the optimizer holds, so the ``live`` bytes a window starts from miss them, while
        their free is in the window's running total: without this figure the peak reads low by the
        whole buffer (9.6 MB of 138 MB on the gpt zoo model with a persistent embedding group).
        Per thread, the lowest point of its running total since ``since`` is what it freed of blocks
        it held before (at least that much); frees on the session's own thread are not counted here,
        as the caller's ``live`` tensors are among them."""
        net: dict[int, int] = {}
        low: dict[int, int] = {}
        for ts, delta, thread in self.elsewhere:
            if ts <= since:
                continue
            net[thread] = net.get(thread, 0) + delta
            low[thread] = min(low.get(thread, 0), net[thread])
        return -sum(low.values())


def trace_cpu_memory(fn: Callable[[], None], mark_prefix: str = "autodist::mark(") -> tuple[list[tuple[float, int]], dict[str, float]]:
    """Run ``fn`` under the torch profiler's memory tracking (host tensors allocated by this thread
    and by the threads torch runs its work on).

    Frees made on other threads outside a collective they run (a collective backend dropping its
    last reference to a message) are not seen: free such buffers explicitly
    (``untyped_storage().resize_(0)``) where it matters; the runtime's own collectives are accounted
    for (see [Note: a backend's buffer freed out of sight]).

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
    events = _trace_events(fn, mark_prefix)
    return events.mem, events.marks


def _trace_events(fn: Callable[[], None], mark_prefix: str = "autodist::mark(") -> _Events:
    trace = _CpuTrace(mark_prefix)
    trace.start()
    try:
        fn()
    finally:
        events = trace.stop()
    return events


def _legacy_events(records: list, mark_prefix: str) -> _Events:
    events = [e for thread in records for e in thread]
    start = next((e for e in events if e.kind() == "mark" and e.name() == "__start_profile"), None)
    if start is None:
        return _Events([], {}, [])
    own = start.thread_id()
    deltas = sorted(
        ((start.cpu_elapsed_us(e), e.cpu_memory_usage(), e.thread_id()) for e in events if e.kind() == "memory_alloc"),
        key=lambda d: d[0],
    )
    marks = {e.name(): start.cpu_elapsed_us(e) for e in events if e.kind() == "push" and e.name().startswith(mark_prefix)}
    ranges, stack = [], []
    for e in next((thread for thread in records if thread and thread[0].thread_id() == own), []):
        if e.kind() == "push":
            stack.append(e)
        elif e.kind() == "pop" and stack:
            opened = stack.pop()
            if opened.name().startswith(_COLLECTIVE_PREFIX):
                ranges.append((opened.name(), start.cpu_elapsed_us(opened), start.cpu_elapsed_us(e)))
    return _from_deltas(deltas, own, marks, ranges)


_COLLECTIVE_PREFIX = "autodist::"
_ISSUE_NAMES = tuple(f"autodist::{op}(" for op in ("all_gather", "reduce_scatter", "all_reduce"))
_WAIT_NAME = "autodist::wait("


def _from_deltas(
    deltas: list[tuple[float, int, int]], own: int, marks: dict[str, float], ranges: Sequence[tuple[str, float, float]] = ()
) -> _Events:
    deltas = sorted(deltas + _unseen_backend_frees(deltas, own, ranges), key=lambda d: d[0])
    mem, total = [], 0
    for ts, delta, _ in deltas:
        total += delta
        mem.append((ts, total))
    return _Events(mem, marks, [d for d in deltas if d[2] != own])


def _unseen_backend_frees(
    deltas: list[tuple[float, int, int]], own: int, ranges: Sequence[tuple[str, float, float]]
) -> list[tuple[float, int, int]]:
    """The frees of backend buffers the session did not see, as deltas at the end of the wait that
    released them (``ranges``: the runtime's collective ranges on the session's thread, ``(name,
    start, end)``).

    [Note: a backend's buffer freed out of sight] A collective backend may allocate a buffer of its
    own on the issuing thread, owned by the work handle (gloo's reduce-scatter: one output-sized
    buffer, allocated when the collective is issued). It is freed when the handle's last reference
    goes: the runtime drops its own inside the wait's range, but the backend's worker thread holds
    another until just after the collective completes, and whichever thread lets go last frees the
    buffer. The profiler records frees only on threads that run with its state, which a worker
    thread has while it runs a collective, not after: when the runtime let go first, the free is
    never recorded, and the buffer would count as held to the end of the window (on the deep-mlp zoo
    model, a plan's measured peak moved between +0.5% and +7.4% of its prediction from one run to
    the next). So: what a collective's issue range allocated on this thread, net, is the backend's;
    what of it the matching wait range (same label, issue order) did not free on this thread was
    freed by the worker at completion, which the wait returned at — a free at the wait's end."""
    if not ranges:
        return []
    own_deltas = sorted((ts, delta) for ts, delta, thread in deltas if thread == own)
    times = [ts for ts, _ in own_deltas]

    def within(t0: float, t1: float) -> list[int]:
        return [delta for _, delta in own_deltas[bisect.bisect_left(times, t0) : bisect.bisect_right(times, t1)]]

    issued: dict[str, collections.deque[int]] = {}
    out = []
    for name, t0, t1 in sorted(ranges, key=lambda r: r[1]):
        if name.startswith(_ISSUE_NAMES):
            key = name[len(_COLLECTIVE_PREFIX) :]
            issued.setdefault(key, collections.deque()).append(max(0, sum(within(t0, t1))))
        elif name.startswith(_WAIT_NAME):
            pending = issued.get(name[len(_WAIT_NAME) : -1])
            if not pending:
                continue  # issued before the window: its buffer's allocation is not in it either
            staged = pending.popleft()
            freed = -sum(d for d in within(t0, t1) if d < 0)
            if staged > freed:
                out.append((t1, freed - staged, own))
    return out


def _kineto_events(prof: profile, mark_prefix: str) -> _Events:
    import json
    import tempfile
    import threading

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    # [Note: profiler totals] Kineto's "Total Allocated" counts from the first profiling session of
    # the process and misses frees made while no profiler ran, so it drifts upwards from session to
    # session: the running total is summed from this session's own allocations and frees instead.
    deltas = sorted(
        (e["ts"], int(e["args"].get("Bytes", 0)), int(e.get("tid", 0))) for e in events if e.get("name") == "[memory]"
    )
    marks = {e["name"]: e["ts"] for e in events if e.get("ph") == "X" and e.get("name", "").startswith(mark_prefix)}
    own = threading.get_native_id()
    ranges = [
        (e["name"], e["ts"], e["ts"] + e.get("dur", 0)) for e in events
        if e.get("ph") == "X" and int(e.get("tid", 0)) == own and e.get("name", "").startswith(_COLLECTIVE_PREFIX)
    ]
    return _from_deltas(deltas, own, marks, ranges)


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

    events = _trace_events(two_steps)
    t = events.marks[label]
    before = [m for ts, m in events.mem if ts <= t]
    base = before[-1] if before else 0
    return start[0] + events.held_elsewhere(since=t) + max((m - base for ts, m in events.mem if ts > t), default=0)
