"""Time a compiled step (:func:`execute`): the program runs on the compute thread and two
background queues — collectives (one at a time in issue order) and offload copies; on an
asynchronous device the compute thread is two clocks, the host's and the compute stream's
([Note: two clocks on an asynchronous device]).

The compute thread pays its own share of every collective (issuing it and collecting it:
``CommModel.host``), of writing freshly allocated memory where the runtime allocates it each step
(``CommModel.first_touch``), and the collective-order check at the end of backward — all compiled
into the program as compute. While compute and a collective overlap they share the machine: compute
runs slower by the sweep's factor for the collective's kind and size, scaled by the model's own
measured sensitivity (``Profile.contention_sensitivity``), and the collective by its factor; while
the compute thread waits, the collective runs at its own rate for that case (on a CPU host a small
collective stays slowed by the other rank's threads), and a wait on a collective not yet done costs
the step a fixed time besides ([Note: what a blocked wait costs]). On a GPU all of these are near 1
(none measured yet).

Memory: the compute thread's changes in program order, the background operations' (staging buffers,
bytes an operation releases when it completes) merged in by time; the peak and its breakdown by
category.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter

import numpy as np

from ..comm import CommModel
from .program import (
    ACTIVATIONS,
    CATEGORY_NAMES,
    COMM,
    COMPUTE,
    ISSUE,
    MEM,
    WAITED,
    CommOp,
    Event,
    Instruction,
    SimResult,
)

MemoryLog = list[tuple[float, int, int]]  # (time, bytes, category)
Slowdowns = Callable[..., tuple[float, float, float]]  # CommModel.slowdowns(op, nbytes, *, scaled=True)

# [Note: what a blocked wait costs] On a CPU host a training step loses time at every wait on a
# collective that has not completed, beyond the collective's own time: the compute thread sleeps and
# is woken, and the ranks, each of which reached the wait on its own, meet there. The simulator
# charges it in two places, both calibrations of the machine class fitted to measured steps
# (tools/calibrate.py; autodist/cost/fidelity.py [Note: the wait calibration]):
#
# * ``CommModel.blocked_wait_s`` at each such wait: the step stands still, the background queues
#   too. Read as the ranks meeting — the collective waited for, and those queued behind it, go on
#   only when the other rank has caught up — this is the time by which the other rank arrives
#   later. Charged to the compute thread alone, the queues running on through it, the zoo's records
#   fit worse and rank their plans worse;
# * ``CommModel.wait_scale`` on the rate of a collective the comm queue took up on its own (at its
#   issue, the queue idle) while the compute thread waits for it. A collective the queue takes up
#   as the one before it finishes runs at the sweep's figure unscaled: the backend's threads are
#   running, and the ranks met at the previous one.
#
# A wait scale alone, on every collective the compute thread waits for, charges a plan that queues
# its reductions and waits for them once (``max_inflight_buckets`` None) per byte of every one, and
# a plan that waits for each right after its launch (0) too little per wait. The cost of a wait is
# fitted, not measured: a loop of compute and a blocking small all-reduce on 2 CPU ranks shows the
# same order of cost, too noisily to measure the figure by.
#
# It overcharges a plan of many small gathers waited for one by one (deep-mlp's fsdp: 99 blocked
# waits, 33 of them on backward re-gathers queued behind reduce-scatters). Two variants fitted no
# better at any pair: a wait charged more the longer since the previous blocked wait (the ranks
# drifting apart), and gathers in a lane of their own beside the reductions (their process groups
# are apart). So neither is modelled. The figures behind each statement are in docs/fidelity.md
# ("Measurements behind the simulator's rules").

# [Note: collectives taken up at once] Gathers and reductions run on process groups of their own
# (runtime/comm.py [Note: AutoDist's own process groups]), and each group's backend works on up to
# ``workers`` collectives at a time (gloo: one per worker thread, 2 by default); it allocates a
# collective's staging buffer when it takes the collective up: at its issue while it has a free
# worker, otherwise when one of its collectives finishes. The transfers share the link and are timed
# one after another (queue 0). Taken up when the transfer starts instead, a gather's buffer issued
# while a reduction ran was missed at a backward's peak, and another's counted at a later one it had
# finished before (docs/fidelity.md). Not settled by measurement: whether a third collective issued
# at once on one gloo group waits for a worker before its buffer is allocated (three gathers issued
# together held two buffers at their peak in one run, three in another, tests/test_metrics.py);
# where it does not, this under-counts a buffer.


# [Note: two clocks on an asynchronous device] On a CPU the thread that runs the runtime's hooks
# also computes: a step is one clock, and every instruction's seconds are spent on it in turn. On
# a GPU the host thread only issues kernels, and they run later on the device's compute stream; a
# step is as long as the slower of the two, and where the host is slower (small layers, bf16, the
# runtime's Python hooks) the device stands idle between kernels. The simulator then keeps two
# clocks (``Timeline.h``, the host's; ``Timeline.t``, the compute stream's): a compute instruction
# spends its host-only seconds (the runtime's hooks, first) and then its issue time on the host
# clock; its device part starts when the host begins issuing it or when the stream is free,
# whichever is later, and ends no earlier than the host has issued the last of it (an instruction
# without an issue time starts no earlier than the host's clock). A collective is issued at the host's time and starts
# once the stream has done what was issued before it (NCCL's stream waits on the compute stream)
# and its queue is free; a wait holds the compute stream, not the host (``work.wait()`` on NCCL).
# While the stream waits for the host, the background queues run as during a wait. The two clocks
# start together, as after the per-step synchronisation a training loop that logs its loss does;
# the step ends when both have. A GPU profile without host times (one scaled from a described
# device, ``autodist plan --device``; one recorded from the first steps, whose device times are
# the host's pace already) has every unit's issue time 0: only the runtime's own work is on the
# host's clock. Not modelled: the host blocking on the device (the offload's host-side waits, a
# bucket whose gradients did not all arrive, whose used-flags the host reads, a full launch
# queue), and the caching allocator's frees, which happen on the host's clock while memory is
# logged on the stream's. Unverified on a GPU (docs/fidelity.md, "Version 17").


Rates = Callable[[str, int], tuple[float, float, float, float]]  # (kind, nbytes) -> an op's four rates (see op_rates)


def op_rates(slowdowns: Slowdowns, sensitivity: float, kind: str, nbytes: int) -> tuple[float, float, float, float]:
    """A collective's rates on the timeline, from ``slowdowns`` (``CommModel.slowdowns``): how much
    slower compute runs beside it (the comm model's figure scaled by the model's ``sensitivity``),
    how much slower it runs beside compute, how much slower it runs while the compute thread waits
    for it when the queue took it up as the one before it finished (its wait figure unscaled), and
    when it was taken up on its own ([Note: what a blocked wait costs])."""
    rc, rm, rw = slowdowns(kind, nbytes)
    return max(1.0, rc * sensitivity), rm, slowdowns(kind, nbytes, scaled=False)[2], rw


class Timeline:
    """The compute thread's clock and the two background queues (0: communication, 1: offload
    copies; each runs one operation at a time) while a program runs (:meth:`run`)."""

    def __init__(self, ops: list[CommOp], comm: CommModel, sensitivity: float, record: bool,
                 slowdowns: Slowdowns | None = None, rates: Rates | None = None, *, asynchronous: bool = False) -> None:
        self.ops = ops
        self.record = record
        if rates is None:
            slow = slowdowns or comm.slowdowns

            def rates(kind: str, nbytes: int) -> tuple[float, float, float, float]:
                return op_rates(slow, sensitivity, kind, nbytes)

        copy_rates = (comm.compute_slowdown, comm.comm_slowdown, 1.0, 1.0)
        per_op = [rates(op.kind, op.nbytes) if op.stream == 0 else copy_rates for op in ops]
        # per op: how much slower compute runs beside it, how much slower it runs beside compute,
        # and how much slower it runs while the compute thread waits for it (once it has started;
        # a collective the queue takes up as the one before it finishes: its wait figure unscaled)
        rc, rm, rwq, rw = (list(x) for x in zip(*per_op)) if per_op else ([], [], [], [])
        self.op_rc: list[float] = rc
        self.op_rm: list[float] = rm
        self.op_rw_queued: list[float] = rwq
        self.rate_w: list[float] = rw
        # the process group each collective runs on (0: gathers, 1: reductions)
        self.op_group = [0 if op.kind == "all_gather" else 1 for op in ops]
        self.blocked_wait_s = comm.blocked_wait_s
        self.t = 0.0
        self.queue: list[list[int]] = [[], []]
        self.qpos = [0, 0]
        self.cur = [-1, -1]
        self.rem = [0.0, 0.0]
        self.timed: MemoryLog = []  # memory changed by background ops: (time, delta, category)
        # compute-thread memory changes in program order, as columns: time, bytes, category
        self.mem_t: list[float] = []
        self.mem_d: list[int] = []
        self.mem_c: list[int] = []
        self.events: list[Event] = []
        self.compute_total = 0.0
        # [Note: two clocks on an asynchronous device]
        self.asynchronous = asynchronous
        self.h = 0.0  # the host's clock (the issuing thread's)
        self.host_total = 0.0  # the host's own work and issuing, in seconds
        self.host_bound = 0.0  # the compute stream's idle time waiting for the host
        # [Note: collectives taken up at once]
        self.workers = max(1, comm.workers)
        self.taken_up = [0, 0]  # collectives each group's workers hold
        self.waiting: list[deque[int]] = [deque(), deque()]  # issued, not yet taken up

    # ---- the background queues ---------------------------------------------------------------
    def start_next(self, s: int, now: float) -> None:
        queue, qpos = self.queue[s], self.qpos
        if qpos[s] < len(queue):
            i = queue[qpos[s]]
            qpos[s] += 1
            self.cur[s] = i
            op = self.ops[i]
            op.start = now
            self.rem[s] = op.seconds
            if s == 1 and op.staging_bytes:
                self.timed.append((now, op.staging_bytes, COMM))
        else:
            self.cur[s] = -1

    def take_up(self, i: int, now: float) -> None:
        op = self.ops[i]
        self.taken_up[self.op_group[i]] += 1
        if op.staging_bytes:
            self.timed.append((now, op.staging_bytes, COMM))

    def end_current(self, s: int, now: float) -> None:
        i = self.cur[s]
        op = self.ops[i]
        op.end = now
        if op.staging_bytes:
            self.timed.append((now, -op.staging_bytes, COMM))
        if op.end_bytes:
            self.timed.append((now, op.end_bytes, op.end_category))
        if self.record:
            self.events.append(Event(("comm", "copy")[s], f"{op.kind} {op.label}", op.start, now))
        if s == 0:
            g = self.op_group[i]
            self.taken_up[g] -= 1
            if self.waiting[g]:
                self.take_up(self.waiting[g].popleft(), now)
        # the next operation of the queue starts now (start_next), at its queued rate
        queue, qpos = self.queue[s], self.qpos
        if qpos[s] < len(queue):
            nxt = self.cur[s] = queue[qpos[s]]
            qpos[s] += 1
            op = self.ops[nxt]
            op.start = now
            self.rem[s] = op.seconds
            if s == 1 and op.staging_bytes:
                self.timed.append((now, op.staging_bytes, COMM))
            self.rate_w[nxt] = self.op_rw_queued[nxt]
        else:
            self.cur[s] = -1

    # ---- the compute thread's instructions ---------------------------------------------------
    def run(self, prog: list[Instruction]) -> None:
        """Run ``prog`` on the compute thread: a memory change is logged at the time it is reached;
        a compute segment of ``dur`` seconds (with a transient of ``spike`` bytes) runs at the rate
        the most demanding running operation leaves it, each operation at its own, until its work
        is done; an issue queues an operation; a wait runs the background queues, each operation at
        its rate while the compute thread waits (on a CPU host a small collective stays slowed by
        the scheduling of the other rank's threads; a large one runs at nearly full speed), until
        the operation waited for is done."""
        ops, cur, rem = self.ops, self.cur, self.rem
        op_rc, op_rm = self.op_rc, self.op_rm
        timed, record = self.timed, self.record
        mem_t, mem_d, mem_c = self.mem_t.append, self.mem_d.append, self.mem_c.append
        end_current, queues_alone = self.end_current, self.queues_alone
        t, h = self.t, self.h
        asynchronous = self.asynchronous
        compute_total, host_total, host_bound = self.compute_total, self.host_total, self.host_bound
        for ins in prog:
            code = ins[0]
            if code == MEM:
                mem_t(t)
                mem_d(ins[1])
                mem_c(ins[2])
            elif code == COMPUTE:
                dur, spike = ins[1], ins[3]
                if asynchronous:  # [Note: two clocks on an asynchronous device]
                    if len(ins) > 4 and ins[4] + ins[5] > 0:
                        if record:
                            self.events.append(Event("host", ins[2], h, h + ins[4] + ins[5]))
                        h += ins[4]  # the host's own work (the hooks) first, then it issues the rest
                        issue_from = h
                        h += ins[5]
                        host_total += ins[4] + ins[5]
                        dur -= ins[4]
                    else:
                        issue_from = h
                    if dur > 0 and t < issue_from:  # the stream has had nothing more to run since t
                        host_bound += issue_from - t
                        t = queues_alone(t, None, issue_from)
                if dur <= 0:
                    if spike:  # a transient of no measurable duration still counts for the peak
                        self.mem_t.extend((t, t))
                        self.mem_d.extend((spike, -spike))
                        self.mem_c.extend((ACTIVATIONS, ACTIVATIONS))
                    if record and asynchronous and ins[1] > 0:  # (one compute event per timed instruction)
                        self.events.append(Event("compute", ins[2], t, t))
                    continue
                compute_total += dur
                seg_start = t
                if spike:
                    mem_t(t)
                    mem_d(spike)
                    mem_c(ACTIVATIONS)
                remaining = dur
                while remaining > 0:
                    c0, c1 = cur
                    # compute runs at the rate the most demanding running op leaves it; each op at
                    # its own; ``s``: the op that finishes first (the communication queue on a tie)
                    if c0 >= 0 and c1 >= 0:
                        rc = max(op_rc[c0], op_rc[c1])
                        s = 0 if rem[0] * op_rm[c0] <= rem[1] * op_rm[c1] else 1
                    elif c0 >= 0 or c1 >= 0:
                        s = 0 if c0 >= 0 else 1
                        rc = op_rc[cur[s]]
                    else:
                        t += remaining
                        break
                    t_c = t + remaining * rc
                    t_m = t + rem[s] * op_rm[cur[s]]
                    if t_c <= t_m:
                        dt = t_c - t
                        if c0 >= 0:
                            rem[0] -= dt / op_rm[c0]
                        if c1 >= 0:
                            rem[1] -= dt / op_rm[c1]
                        t = t_c
                        break
                    dt = t_m - t
                    remaining -= dt / rc
                    if c0 >= 0:
                        rem[0] -= dt / op_rm[c0]
                    if c1 >= 0:
                        rem[1] -= dt / op_rm[c1]
                    t = t_m
                    rem[s] = 0.0
                    end_current(s, t)
                if t < h:  # the device cannot finish before the host has issued the last of it
                    host_bound += h - t
                    t = queues_alone(t, None, h)
                if spike:
                    mem_t(t)
                    mem_d(-spike)
                    mem_c(ACTIVATIONS)
                if record:
                    self.events.append(Event("compute", ins[2], seg_start, t))
            elif code == ISSUE:
                if t < h:  # the host issues it at h: the device has had nothing more to do since t
                    host_bound += h - t
                    t = queues_alone(t, None, h)
                i = ins[1]
                s = ops[i].stream
                if s == 0:
                    g = self.op_group[i]
                    if self.taken_up[g] < self.workers:
                        self.take_up(i, t)
                    else:
                        self.waiting[g].append(i)
                self.queue[s].append(i)
                if cur[s] < 0:
                    self.start_next(s, t)
            else:  # WAIT (on an asynchronous device the compute stream waits, not the host)
                waited = ops[ins[1]]
                # a wait blocks on a collective not yet done (on a world of one nothing is issued:
                # its collectives take no time, and waiting for one does nothing)
                blocked = waited.end < 0 and waited.stream == 0 and waited.seconds > 0
                if waited.end < 0:
                    t = queues_alone(t, waited)
                if blocked:
                    t += self.blocked_wait_s  # the whole step's, queues included ([Note: what a blocked wait costs])
                if timed:
                    mem_t(t)
                    mem_d(0)
                    mem_c(WAITED)
        self.t, self.h = t, h
        self.compute_total, self.host_total, self.host_bound = compute_total, host_total, host_bound

    def queues_alone(self, t: float, waited: CommOp | None, until: float = math.inf) -> float:
        """Run the background queues from ``t`` while the compute thread (on an asynchronous device:
        the compute stream) does nothing — each operation at its rate while compute waits — until
        ``waited`` is done, or (``waited`` None) until the time ``until``; the time then."""
        cur, rem, rate_w, end_current = self.cur, self.rem, self.rate_w, self.end_current
        while waited is None or waited.end < 0:
            c0, c1 = cur
            if c0 >= 0 and c1 >= 0:
                # the one that finishes first (the communication queue on a tie)
                d0, d1 = rem[0] * rate_w[c0], rem[1] * rate_w[c1]
                s, dt = (0, d0) if d0 <= d1 else (1, d1)
            elif c0 >= 0 or c1 >= 0:
                s = 0 if c0 >= 0 else 1
                dt = rem[s] * rate_w[cur[s]]
            else:
                break
            if t + dt > until:  # the time comes before the next operation ends
                dt = until - t
                if c0 >= 0:
                    rem[0] -= dt / rate_w[c0]
                if c1 >= 0:
                    rem[1] -= dt / rate_w[c1]
                return until
            if c0 >= 0 and c1 >= 0:
                rem[0] -= dt / rate_w[c0]
                rem[1] -= dt / rate_w[c1]
            rem[s] = 0.0
            t += dt
            end_current(s, t)
        return t if waited is not None else max(t, until)


def merged_memory(mem_log: MemoryLog, timed: MemoryLog) -> MemoryLog:
    """The compute thread's memory changes in program order, the background operations' merged in
    by time."""
    if not timed:
        return mem_log
    timed.sort(key=itemgetter(0))
    merged: MemoryLog = []
    append = merged.append
    i, n = 0, len(timed)
    nt = timed[0][0]  # the time of the next background change (inf once all are merged)
    for entry in mem_log:
        t = entry[0]
        if entry[2] == WAITED:
            # [Note: what a wait returns after] the compute thread goes on once the op it
            # waited for is done: what background ops released by then (a finished gather's
            # staging buffer) is gone before its next change, though both fall at one time
            while nt <= t:
                append(timed[i])
                i += 1
                nt = timed[i][0] if i < n else math.inf
            continue
        while nt < t:
            append(timed[i])
            i += 1
            nt = timed[i][0] if i < n else math.inf
        append(entry)
    merged.extend(timed[i:])
    return merged


@dataclass
class MemoryPeak:
    """The memory of a timed step: the bytes before any change (the static memory), the peak, the
    bytes by category when the peak is first reached, and (when asked) the curve: ``(time, bytes)``
    at the start and after each change."""

    start: int
    peak: int
    breakdown: list[int]
    curve: list[tuple[float, int]]


def memory_peak(own: tuple[list[float], list[int], list[int]], timed: MemoryLog, static: list[int],
                record: bool) -> MemoryPeak:
    """The memory of a step from the compute thread's changes (``own``: their times, bytes and
    categories, in program order, its waits among them) and the background operations' (``timed``;
    :func:`merged_memory` merges them), and the ``static`` memory by category.

    The merge and the running sum are done on whole arrays when every change is a whole number of
    bytes that fits int64 (the same sums, exactly); otherwise on the merged list."""
    start = sum(static)
    arrays = _change_arrays(own, timed)
    if arrays is None:
        merged = merged_memory(list(zip(*own)), timed)
        live = list(accumulate([e[1] for e in merged], initial=start))  # after each change
        peak = max(live)
        # the breakdown when the peak is first reached (before any change: the static memory)
        peak_cat = list(static)
        for _, d, cat in merged[:live.index(peak)]:
            peak_cat[cat] += d
        curve = [(0.0, start), *((e[0], b) for e, b in zip(merged, live[1:]))] if record else []
        return MemoryPeak(start, peak, peak_cat, curve)
    times, deltas, cats = arrays
    after = np.cumsum(deltas)
    after += start  # the bytes after each change
    k = int(np.argmax(after)) if len(after) else 0  # the first change that reaches the most
    if len(after) and after[k] > start:
        top, changes = int(after[k]), k + 1
    else:
        top, changes = start, 0  # the static memory, before any change
    # the breakdown when the peak is first reached
    by_cat = list(static)
    if changes:
        upto, cat_upto = deltas[:changes], cats[:changes]
        for cat in range(len(by_cat)):
            by_cat[cat] += int(upto[cat_upto == cat].sum())
    points = [(0.0, start), *zip(times.tolist(), after.tolist())] if record else []
    return MemoryPeak(start, top, by_cat, points)


Columns = tuple[np.ndarray, np.ndarray, np.ndarray]  # times, byte changes (int64), categories


def _change_arrays(own: tuple[list[float], list[int], list[int]], timed: MemoryLog) -> Columns | None:
    """:func:`merged_memory` as arrays (None when a change is not a whole number of bytes that
    fits int64): each background change goes before the first compute-thread change later than
    it, or at the same time as a wait ([Note: what a wait returns after]); the compute thread's
    waits are no change of their own."""
    timed.sort(key=itemgetter(0))
    mine = _columns(*own)
    background = _columns([e[0] for e in timed], [e[1] for e in timed], [e[2] for e in timed])
    if mine is None or background is None:
        return None
    if not len(background[0]):
        return mine  # (no waits are logged without background changes)
    t, d, c = mine
    tt, td, tc = background
    waits = c == WAITED
    # the background changes merged before each compute-thread entry: those earlier than it (at
    # its time too, for a wait), and never fewer than before the entry before it
    before = np.where(waits, np.searchsorted(tt, t, side="right"), np.searchsorted(tt, t, side="left"))
    np.maximum.accumulate(before, out=before)
    keep = ~waits
    before = before[keep]
    n_own, n_bg = len(before), len(tt)
    own_at = np.arange(n_own) + before
    bg_at = np.arange(n_bg) + np.searchsorted(before, np.arange(n_bg), side="right")
    times = np.empty(n_own + n_bg)
    deltas = np.empty(n_own + n_bg, dtype=np.int64)
    cats = np.empty(n_own + n_bg, dtype=np.int64)
    times[own_at], deltas[own_at], cats[own_at] = t[keep], d[keep], c[keep]
    times[bg_at], deltas[bg_at], cats[bg_at] = tt, td, tc
    return times, deltas, cats


def _columns(times: list[float], deltas: list[int], cats: list[int]) -> Columns | None:
    """A memory log's columns as arrays; None when a change is not a whole number that fits int64."""
    d = np.array(deltas, dtype=None if deltas else np.int64)
    if d.dtype.kind != "i":  # a float, or a whole number past int64
        return None
    return np.array(times, dtype=np.float64), d.astype(np.int64, copy=False), np.array(cats, dtype=np.int64)


def execute(prog: list[Instruction], ops: list[CommOp], static: list[int], *, comm: CommModel,
            sensitivity: float, budget: int | None, record: bool, slowdowns: Slowdowns | None = None,
            rates: Rates | None = None, asynchronous: bool = False) -> SimResult:
    """Time ``prog`` (issuing ``ops``) from the ``static`` memory by category (``sensitivity``: the
    model's compute slowdown under communication relative to the comm model's reference;
    ``slowdowns``: ``comm.slowdowns``, or a cache of it; ``rates``: :func:`op_rates` of them, or a
    cache of it; ``asynchronous``: a device whose kernels run apart from the host that issues them,
    [Note: two clocks on an asynchronous device])."""
    tl = Timeline(ops, comm, sensitivity, record, slowdowns, rates, asynchronous=asynchronous)
    tl.run(prog)
    step_s = max(tl.t, tl.h)
    host_bound = tl.host_bound + max(0.0, tl.h - tl.t)  # (the host's work after the stream's last)
    mem = memory_peak((tl.mem_t, tl.mem_d, tl.mem_c), tl.timed, static, record)
    return SimResult(
        step_s=step_s,
        peak_bytes=int(mem.peak),
        static_bytes=int(mem.start),
        feasible=budget is None or mem.peak <= budget,
        budget_bytes=budget,
        compute_s=tl.compute_total,
        comm_s=sum(op.seconds for op in ops if op.stream == 0),
        exposed_comm_s=max(0.0, step_s - tl.compute_total - host_bound),
        host_s=tl.host_total,
        host_bound_s=host_bound,
        events=tl.events,
        memory=mem.curve,
        gathers=sum(1 for op in ops if op.kind == "all_gather"),
        reductions=sum(1 for op in ops if op.kind in ("all_reduce", "reduce_scatter")),
        copy_s=sum(op.seconds for op in ops if op.stream == 1),
        breakdown={name: int(v) for name, v in zip(CATEGORY_NAMES, mem.breakdown)},
    )
