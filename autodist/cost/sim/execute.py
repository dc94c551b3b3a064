"""Time a compiled step (:func:`execute`): the program runs on the compute thread and two
background queues — collectives (one at a time in issue order) and offload copies.

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
from collections.abc import Callable
from itertools import accumulate
from operator import itemgetter

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


def _group_of(op: CommOp) -> str:
    """The process group an operation of the comm queue runs on."""
    return "gather" if op.kind == "all_gather" else "reduce"


class Timeline:
    """The compute thread's clock and the two background queues (0: communication, 1: offload
    copies; each runs one operation at a time) while a program runs."""

    def __init__(self, ops: list[CommOp], comm: CommModel, sensitivity: float, record: bool,
                 slowdowns: Slowdowns | None = None) -> None:
        self.ops = ops
        self.record = record
        slowdowns = slowdowns or comm.slowdowns
        copy_slow = (comm.compute_slowdown, comm.comm_slowdown, 1.0)
        slow = [slowdowns(op.kind, op.nbytes) if op.stream == 0 else copy_slow for op in ops]
        # per op: how much slower compute runs beside it, how much slower it runs beside compute,
        # and how much slower it runs while the compute thread waits for it
        self.op_rc = [max(1.0, s[0] * sensitivity) if op.stream == 0 else s[0] for s, op in zip(slow, ops)]
        self.op_rm = [s[1] for s in slow]
        # a collective the queue takes up as the one before it finishes: its wait figure unscaled
        # ([Note: what a blocked wait costs])
        self.op_rw_queued = [slowdowns(op.kind, op.nbytes, scaled=False)[2] if op.stream == 0 else s[2]
                             for s, op in zip(slow, ops)]
        self.rate_w = [s[2] for s in slow]  # each op's rate while the compute thread waits, once it has started
        self.blocked_wait_s = comm.blocked_wait_s
        self.t = 0.0
        self.queue: list[list[int]] = [[], []]
        self.qpos = [0, 0]
        self.cur = [-1, -1]
        self.rem = [0.0, 0.0]
        self.timed: MemoryLog = []  # memory changed by background ops: (time, delta, category)
        self.mem_log: MemoryLog = []  # compute-thread allocations, in program order
        self.events: list[Event] = []
        self.compute_total = 0.0
        # [Note: collectives taken up at once]
        self.workers = max(1, comm.workers)
        self.taken_up = {"gather": 0, "reduce": 0}  # collectives each group's workers hold
        self.waiting: dict[str, list[int]] = {"gather": [], "reduce": []}  # issued, not yet taken up

    # ---- the background queues ---------------------------------------------------------------
    def start_next(self, s: int, now: float) -> None:
        if self.qpos[s] < len(self.queue[s]):
            i = self.queue[s][self.qpos[s]]
            self.qpos[s] += 1
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
        self.taken_up[_group_of(op)] += 1
        if op.staging_bytes:
            self.timed.append((now, op.staging_bytes, COMM))

    def end_current(self, s: int, now: float) -> None:
        op = self.ops[self.cur[s]]
        op.end = now
        if op.staging_bytes:
            self.timed.append((now, -op.staging_bytes, COMM))
        if op.end_bytes:
            self.timed.append((now, op.end_bytes, op.end_category))
        if self.record:
            self.events.append(Event(("comm", "copy")[s], f"{op.kind} {op.label}", op.start, now))
        if s == 0:
            g = _group_of(op)
            self.taken_up[g] -= 1
            if self.waiting[g]:
                self.take_up(self.waiting[g].pop(0), now)
        self.start_next(s, now)
        if self.cur[s] >= 0:
            self.rate_w[self.cur[s]] = self.op_rw_queued[self.cur[s]]

    def advance_idle(self, until_op: CommOp) -> None:
        """Compute waits: background queues run until ``until_op`` is done, each operation at its
        rate while the compute thread waits (on a CPU host a small collective stays slowed by
        the scheduling of the other rank's threads; a large one runs at nearly full speed)."""
        cur, rem, rate_w = self.cur, self.rem, self.rate_w
        while until_op.end < 0:
            c0, c1 = cur
            if c0 >= 0 and c1 >= 0:
                # the one that finishes first (the communication queue on a tie)
                d0, d1 = rem[0] * rate_w[c0], rem[1] * rate_w[c1]
                s, dt = (0, d0) if d0 <= d1 else (1, d1)
                rem[0] -= dt / rate_w[c0]
                rem[1] -= dt / rate_w[c1]
            elif c0 >= 0 or c1 >= 0:
                s = 0 if c0 >= 0 else 1
                dt = rem[s] * rate_w[cur[s]]
            else:
                break
            rem[s] = 0.0
            self.t += dt
            self.end_current(s, self.t)

    # ---- the compute thread's instructions ---------------------------------------------------
    def compute(self, dur: float, name: str, spike: int) -> None:
        """A compute segment of ``dur`` seconds alone, with a transient of ``spike`` bytes."""
        mem_log = self.mem_log
        if dur <= 0:
            if spike:  # a transient of no measurable duration still counts for the peak
                mem_log.extend(((self.t, spike, ACTIVATIONS), (self.t, -spike, ACTIVATIONS)))
            return
        self.compute_total += dur
        cur, rem, op_rc, op_rm = self.cur, self.rem, self.op_rc, self.op_rm
        t = seg_start = self.t
        if spike:
            mem_log.append((t, spike, ACTIVATIONS))
        remaining = dur
        while remaining > 0:
            c0, c1 = cur
            # compute runs at the rate the most demanding running op leaves it; each op at its own;
            # ``s``: the op that finishes first (the communication queue on a tie)
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
            self.end_current(s, t)
        self.t = t
        if spike:
            mem_log.append((t, -spike, ACTIVATIONS))
        if self.record:
            self.events.append(Event("compute", name, seg_start, t))

    def issue(self, i: int) -> None:
        s = self.ops[i].stream
        if s == 0:
            g = _group_of(self.ops[i])
            if self.taken_up[g] < self.workers:
                self.take_up(i, self.t)
            else:
                self.waiting[g].append(i)
        self.queue[s].append(i)
        if self.cur[s] < 0:
            self.start_next(s, self.t)

    def wait(self, i: int) -> None:
        waited = self.ops[i]
        # a wait blocks on a collective not yet done (on a world of one nothing is issued: its
        # collectives take no time, and waiting for one does nothing)
        blocked = waited.end < 0 and waited.stream == 0 and waited.seconds > 0
        self.advance_idle(waited)
        if blocked:
            self.t += self.blocked_wait_s  # the whole step's, queues included ([Note: what a blocked wait costs])
        if self.timed:
            self.mem_log.append((self.t, 0, WAITED))

    def run(self, prog: list[Instruction]) -> None:
        mem_append = self.mem_log.append
        compute, issue, wait = self.compute, self.issue, self.wait
        for ins in prog:
            code = ins[0]
            if code == MEM:
                mem_append((self.t, ins[1], ins[2]))
            elif code == COMPUTE:
                compute(ins[1], ins[2], ins[3])
            elif code == ISSUE:
                issue(ins[1])
            else:  # WAIT
                wait(ins[1])


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


def execute(prog: list[Instruction], ops: list[CommOp], static: list[int], *, comm: CommModel,
            sensitivity: float, budget: int | None, record: bool, slowdowns: Slowdowns | None = None) -> SimResult:
    """Time ``prog`` (issuing ``ops``) from the ``static`` memory by category (``sensitivity``: the
    model's compute slowdown under communication relative to the comm model's reference;
    ``slowdowns``: ``comm.slowdowns``, or a cache of it)."""
    tl = Timeline(ops, comm, sensitivity, record, slowdowns)
    tl.run(prog)
    step_s = tl.t
    start_bytes = sum(static)
    merged = merged_memory(tl.mem_log, tl.timed)
    live = list(accumulate([e[1] for e in merged], initial=start_bytes))  # after each change
    peak = max(live)
    # the breakdown when the peak is first reached (before any change: the static memory)
    peak_cat = list(static)
    for _, d, cat in merged[:live.index(peak)]:
        peak_cat[cat] += d
    curve = [(0.0, start_bytes), *((e[0], b) for e, b in zip(merged, live[1:]))] if record else []
    return SimResult(
        step_s=step_s,
        peak_bytes=int(peak),
        static_bytes=int(start_bytes),
        feasible=budget is None or peak <= budget,
        budget_bytes=budget,
        compute_s=tl.compute_total,
        comm_s=sum(op.seconds for op in ops if op.stream == 0),
        exposed_comm_s=max(0.0, step_s - tl.compute_total),
        events=tl.events,
        memory=curve,
        gathers=sum(1 for op in ops if op.kind == "all_gather"),
        reductions=sum(1 for op in ops if op.kind in ("all_reduce", "reduce_scatter")),
        copy_s=sum(op.seconds for op in ops if op.stream == 1),
        breakdown={name: int(v) for name, v in zip(CATEGORY_NAMES, peak_cat)},
    )
