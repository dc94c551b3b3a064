"""Measuring the comm model on the real process group (the models themselves, their fit and their use
are in ``autodist/cost/comm.py``; measuring is kept apart from modelling, so ``cost/`` never needs the
runtime). See that module for what is measured and how it is fitted.
"""

from __future__ import annotations

import math
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from ..cost.comm import TRAIN_BYTES, CommModel, OpModel, Piece, fit_op
from ..cost.fidelity import DEFAULT_CPU_BLOCKED_WAIT_S, DEFAULT_CPU_WAIT_SCALE
from .robust import lower_quartile, relative_se, trimmed_mean


@dataclass
class SweepConfig:
    """Sizes and repetitions of the operations' timings (30 samples a pass, about 1.7 s on 2 idle
    CPU ranks): 16 KiB to 16 MiB in 4x steps; each sample times as many calls as fill
    ``min_run_s`` (10 to 50), spread over ``rounds`` interleaved rounds, and keeps their 10th
    percentile ([Note: which statistic]). The timings are measured in up to ``passes`` passes and
    each keeps its median ([Note: a sweep in passes]); the contention figures in the first pass only
    ([Note: contention in the first pass]).

    [Note: a sweep in passes] Within a pass, rounds interleave the measurements so that a
    disturbance touches a few calls of many samples; but the host's state also moves from one
    twenty-second window to the next, and a whole pass can read high or low. Six sweeps taken back
    to back on a host of 2 shared vCPUs (2 ranks) read the 16 MiB all-gather at
    8.3-10.5 ms and the wait figure of a 4 MiB all-gather at 1.37-2.77; in a simcheck run of gpt
    (8 passes, 9 sweeps) the first sweep ranked the built-in and random plans at Spearman 0.664
    and predicted five of them 11-14% slow, where each later sweep ranked them at 0.88-0.97, and
    the median of the first three sweeps' predictions at 0.965 (1.5% median error). The median of
    three passes leaves out one pass read high or low. ``meta["pass_spread"]`` says how far the
    passes disagreed (a figure's range over its median, the median over the figures)."""

    sizes: tuple[int, ...] = tuple(16 * 1024 * 4**i for i in range(6))
    warmup: int = 2
    min_calls: int = 10
    max_calls: int = 50
    min_run_s: float = 0.05
    rounds: int = 5
    passes: int | None = None  # None: sweep_passes() (the environment); agreed over the ranks either way


SWEEP_PASSES = 3  # see [Note: a sweep in passes]; AUTODIST_SWEEP_PASSES overrides it


def sweep_passes() -> int:
    """How many passes a sweep takes: ``AUTODIST_SWEEP_PASSES`` if set (1 trades the comm model's
    reproducibility for a third of the time: the test suite does), else ``SWEEP_PASSES``."""
    text = os.environ.get("AUTODIST_SWEEP_PASSES")
    if text is None:
        return SWEEP_PASSES
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"AUTODIST_SWEEP_PASSES={text!r}: the comm sweep's passes must be a whole number of at least 1 "
                         f"(default {SWEEP_PASSES}); unset it for the default")
    return n


def agreed_passes(passes: int | None, group: dist.ProcessGroup, device: torch.device) -> int:
    """The passes every rank of ``group`` takes (a collective): ``passes``, else :func:`sweep_passes`.
    Each rank reads its own environment, and a rank that took more passes than another would wait in
    collectives the other never issues; so the ranks compare first and all raise the same error when
    any value is bad or they differ (a variable set on one node only)."""
    try:
        n, problem = (passes if passes is not None else sweep_passes()), ""
    except ValueError as e:
        n, problem = 0, str(e)
    neg_lo, hi = _max_over_ranks([float(-n), float(n)], group, device)
    lo = int(-neg_lo)
    if lo < 1:
        raise ValueError(problem or "AUTODIST_SWEEP_PASSES is not a whole number of at least 1 on another rank: set it "
                         "to one on every rank, or unset it everywhere")
    if lo != int(hi):
        raise ValueError(f"the ranks would take {lo} to {int(hi)} comm sweep passes (AUTODIST_SWEEP_PASSES differs "
                         "between them): set it the same on every node, or unset it everywhere")
    return n


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
COPIES = ("d2h", "h2d")


@dataclass(frozen=True)
class CommNeeds:
    """What a model's plans can communicate: for each operation they can issue (a collective, a
    host copy), its largest message (bytes; ``math.inf``: any size). An operation not named is never
    issued, and nothing is measured for it (see [Note: measuring what the model can use])."""

    largest: dict[str, float]

    @classmethod
    def everything(cls) -> CommNeeds:
        """Every operation at every size: the full sweep (``autodist check``, the tools)."""
        return cls({op: math.inf for op in (*COLLECTIVES, *COPIES)})


def _up_to(grid: tuple[int, ...], largest: float, at_least: int) -> list[int]:
    """The sizes of ``grid`` (increasing) up to the first one at or above ``largest`` (so that
    ``largest`` lies within what is measured), and at least the ``at_least`` smallest."""
    out: list[int] = []
    for size in grid:
        out.append(size)
        if size >= largest:
            break
    return out if len(out) >= at_least else list(grid[:at_least])


def message_bytes(nbytes: int, world: int) -> int:
    """The bytes of the float32 message of about ``nbytes`` the sweep measures on ``world`` ranks
    (a whole number of elements per rank): the size its samples and contention rows carry."""
    return max(world, nbytes // 4 // world * world) * 4


@dataclass
class SweepPlan:
    """What a sweep will measure: each operation's timed sizes (message bytes before the world's
    padding), each collective's contention sizes, and whether the first-touch figures and the
    runtime's overhead are measured. Empty: the comm model at hand already holds everything."""

    timings: dict[str, list[int]]
    contention: dict[str, list[int]]
    first_touch: bool
    overhead: bool

    def empty(self) -> bool:
        return not any(self.timings.values()) and not any(self.contention.values()) and not self.first_touch and not self.overhead

    def estimate_seconds(self, passes: int, rates: dict[str, float] | None = None, *, fewest: bool = False) -> float:
        """About how long measuring this takes with ``passes`` passes, at ``rates`` (seconds per
        timed sample and pass, per contention round of one collective and size, and the fixed
        cost of the runtime's overhead; a previous sweep's own, else ``SWEEP_RATES``): at most
        (every pass times everything, every contention figure takes its most rounds), or with
        ``fewest`` at least (two passes time everything and agree, every figure takes its fewest
        rounds: a quiet host; see [Note: passes that agree] and [Note: contention rounds until the
        figures are known])."""
        r = dict(SWEEP_RATES, **(rates or {}))
        cases = sum(len(v) for v in self.timings.values())
        sizes = [size for sizes in self.contention.values() for size in sizes]
        if fewest:
            timed, rounds = min(passes, 2), sum(min(CONTENTION_MIN_ROUNDS, contention_rounds(size)) for size in sizes)
        else:
            timed, rounds = passes, sum(contention_rounds(size) for size in sizes)
        return timed * cases * r["timing_s"] + rounds * r["contention_round_s"] + (r["overhead_s"] if self.overhead else 0.0)

    def describe(self) -> str:
        """What is measured, in a few words (the up-front message)."""
        names = [op.replace("_", "-") for op in sorted(COLLECTIVES) if self.timings.get(op) or self.contention.get(op)]
        names += ["host copies"] if any(self.timings.get(op) for op in COPIES) else []
        sizes = [s for v in (*self.timings.values(), *self.contention.values()) for s in v]
        if not sizes:
            return "the runtime's own costs" if self.overhead else "the fresh-memory cost" if self.first_touch else "nothing"
        what = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        lo, hi = _size_text(min(sizes)), _size_text(max(sizes))
        return f"{what}, {lo}" if lo == hi else f"{what}, {lo} to {hi}"


def _size_text(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


# Seconds per timed sample and pass, per contention round of one (collective, size), and for the
# runtime's overhead, measured on 2 CPU ranks of an idle 2-core host (gpt's first launch, load
# average 1.2: 30 samples a pass and 252 contention rounds in 50.2 s, the rounds 44 s of it). An
# estimate only where no sweep of this machine left its own (``meta["rates"]``).
SWEEP_RATES = {"timing_s": 0.057, "contention_round_s": 0.176, "overhead_s": 1.0}


def contention_sizes(largest: float) -> list[int]:
    """The sizes of ``CONTENTION_SIZES`` a model whose largest message is ``largest`` bytes has its
    contention figures measured at: those below it, and the next one unless ``largest`` lies within
    ``CONTENTION_REACH`` times the largest of those (the smallest size at least).

    [Note: contention up to what the model sends] The simulator takes a message's contention
    figures interpolated in log size between the measured sizes, and the largest measured size's
    beyond them. Those figures change slowly with size: from 16 to 64 MiB by 7.8% (the median of
    the 72 figures of ``benchmarks/sweepcheck-passes.json``'s eight comm models; a quarter of
    them by 13-40%) over the 4x step, so over the factor of 2 or less (half that step in log size)
    between the largest size measured and a message this reach allows, by about half that: less
    than the sweeps' own 8-11% from one sweep to the next. The next size up would cost the most
    expensive rounds of the sweep (a 64 MiB round takes about 0.4 s on 2 CPU ranks, the smallest
    ones 0.1 s) to price messages the model never sends."""
    below = [s for s in CONTENTION_SIZES if s < largest]
    above = [s for s in CONTENTION_SIZES if s >= largest][:1]
    if not below:
        return above or [CONTENTION_SIZES[0]]
    return below + above if above and largest > CONTENTION_REACH * below[-1] else below


def plan_sweep(needs: CommNeeds, base: CommModel | None, world: int, cfg: SweepConfig | None = None) -> SweepPlan:
    """What a sweep must measure so that the comm model prices every message ``needs`` names: the
    grid's sizes up to the first at or above each collective's largest message (two at least, for
    a fit; host copies at every size), its contention figures up to that message
    (:func:`contention_sizes`), less what ``base`` (a stored comm model of this machine,
    possibly partial) already holds.

    [Note: measuring what the model can use] A comm model is priced at the messages a plan issues:
    a model's gradients are reduced in buckets of at most its trainable bytes, and its units are
    gathered in groups of at most its parameter bytes; a model that trains nothing reduces nothing.
    Measuring larger messages, or a collective the model never issues, costs the first launch
    time and tells the search nothing (the simulator prices a message between measured sizes, or
    at the nearest one). So ``plan="auto"`` measures only those (:class:`CommNeeds`), stores what
    it measured, and a later model that needs more measures only what is missing and adds it; a
    stored model missing a part (or holding a part it cannot read) is completed the same way. A
    stored model without a single sample was described, not measured (``CommModel.analytic``, put
    there by a user or a test): it is used as it is."""
    cfg = cfg or SweepConfig()
    if base is not None and not any(fit.samples for fit in base.ops.values()):
        return SweepPlan({}, {}, first_touch=False, overhead=False)  # given, not measured (an analytic model): used as it is
    have_times = {op: {x for x, _ in fit.samples} for op, fit in (base.ops.items() if base else ())}
    have_host = {op: {x for x, _ in fit.samples} for op, fit in (base.host.items() if base else ())}
    have_rows = {op: {row[0] for row in rows} for op, rows in (base.contention.items() if base else ())}
    timings: dict[str, list[int]] = {}
    contention: dict[str, list[int]] = {}
    for op, largest in needs.largest.items():
        if op in COPIES:
            timings[op] = [s for s in _up_to(cfg.sizes, largest, 2) if message_bytes(s, world) not in have_times.get(op, set())]
        elif world > 1:
            timings[op] = [s for s in _up_to(cfg.sizes, largest, 2)
                           if not {message_bytes(s, world)} <= have_times.get(op, set()) & have_host.get(op, set())]
            contention[op] = [s for s in contention_sizes(largest)
                              if float(message_bytes(s, world)) not in have_rows.get(op, set())]
    # fresh memory costs nothing below glibc's mmap threshold: measured once a message reaches it
    fresh = max(needs.largest.values(), default=0) >= FIRST_TOUCH_MIB[0] << 20
    from .overhead import RuntimeOverhead

    # a stored model measured before a figure existed has the runtime's overhead measured again
    figures = {f.name for f in fields(RuntimeOverhead)}
    return SweepPlan(
        timings={op: v for op, v in timings.items() if v}, contention={op: v for op, v in contention.items() if v},
        first_touch=fresh and (base is None or not base.first_touch),
        overhead=base is None or not figures <= set(base.overhead),
    )


def _collectives(comm: Any, buf: torch.Tensor, shard: torch.Tensor, out: torch.Tensor) -> list[tuple[str, Any]]:
    """``(op, issue)`` for each collective kind on these buffers, issued as the runtime issues them."""
    return [
        ("all_reduce", lambda: comm.all_reduce(buf, "sweep")),
        ("all_gather", lambda: comm.all_gather(out, shard, "sweep")),
        ("reduce_scatter", lambda: comm.reduce_scatter(shard, buf, "sweep")),
    ]


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """A host<->device copy (no work handle: a CUDA copy is waited for by synchronising)."""
    dst.copy_(src, non_blocking=non_blocking)


def _once(issue: Any) -> None:
    work = issue()
    if work is not None:
        work.wait()


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the lower one of two neighbours)."""
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def _calls_for(issue: Any, group: dist.ProcessGroup, device: torch.device, cfg: SweepConfig) -> int:
    """How many timed calls a sample gets: enough to fill ``min_run_s``, the same on every rank."""
    for _ in range(cfg.warmup):
        _once(issue)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    _once(issue)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(cfg.min_calls, min(cfg.max_calls, int(cfg.min_run_s / once)))
    n = torch.tensor([calls], dtype=torch.int64, device=device if device.type != "cpu" else None)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=group)
    return int(n.item())


def _time_calls(issue: Any, calls: int, device: torch.device, group: dist.ProcessGroup) -> tuple[list[float], list[float]]:
    """``(issue times, total times)`` of ``calls`` calls, each started together on all ranks:
    the time the caller spends in ``issue()`` (which returns the work), and until its ``wait()``
    returns.

    [Note: which statistic] On a shared 2-core host a collective's time has a long tail (a tenth of
    small all-reduces take ~10x the median: the scheduler, not the wire) and even its median moves
    2-3x between runs at some sizes. The sweep keeps the 10th percentile — the cost of the operation
    itself, reproducible run to run — and measures interference separately (``compute_slowdown``,
    ``comm_slowdown``), which the simulator applies where compute and communication overlap.
    """
    issued, total = [], []
    for _ in range(calls):
        dist.barrier(group=group)  # both ranks start together: no skew from the previous call
        t0 = time.perf_counter()
        work = issue()
        t1 = time.perf_counter()
        if work is not None:
            work.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        issued.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    return issued, total


def _wait_when_done(issue: Any, calls: int, group: dist.ProcessGroup, settle_s: float = 0.01) -> list[float]:
    """How long ``wait()`` takes on a collective that has already completed (the caller's own work
    to collect it; ``calls`` samples of a small message, given ``settle_s`` to complete — gloo's
    list reduce-scatter reports completion only to ``wait()``, so it cannot be polled)."""
    out = []
    for _ in range(calls):
        dist.barrier(group=group)
        work = issue()
        time.sleep(settle_s)
        t0 = time.perf_counter()
        work.wait()
        out.append(time.perf_counter() - t0)
    return out


def _max_over_ranks(values: list[float], group: dist.ProcessGroup, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device if device.type != "cpu" else None)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


DISTURBED_SPREAD = 2.0  # a sweep whose typical call takes twice its 10th percentile ran on a busy host


@dataclass
class _Pass:
    """One pass of the sweep: every operation's samples ``{op: [(bytes, seconds)]}`` (the slowest
    rank's), the caller's share of each collective's, the contention figures, and how disturbed
    the host was."""

    samples: dict[str, list[tuple[float, float]]]
    host_samples: dict[str, list[tuple[float, float]]]
    contention: dict[str, list[list[float]]]
    spread: float
    # [[bytes, seconds], ...] at FIRST_TOUCH_MIB: the extra cost of writing fresh memory (the slowest
    # rank's lower quartile of the pass's tries; see [Note: fresh memory, measured across the sweep])
    first_touch: list[list[float]]
    contention_rounds: int = 0  # the contention rounds the pass took ([Note: contention rounds until the figures are known])
    timed: int = 0  # the samples it timed ...
    timing_s: float = 0.0  # ... in this many seconds (from its first timed call to its last figure agreed)
    contention_s: float = 0.0  # its contention rounds' seconds


def _measure_pass(
    comm: Any, group: dist.ProcessGroup, device: torch.device, cfg: SweepConfig, cases: list[tuple[str, int, Any]],
    calls: list[int], cells: list[tuple[str, int, Any]], probes: dict[str, Any],
    base_samples: dict[str, list[tuple[float, float]]], first_touch_wanted: bool,
) -> _Pass:
    """One pass: the timings of ``cases`` (``calls`` calls each), the contention figures of
    ``cells`` (against base times fitted to this pass's samples, and ``base_samples`` for the sizes
    it does not time), and the first-touch figures when ``first_touch_wanted``. ``probes``: a small
    message of each collective the pass measures, to time collecting one that is done."""
    world = dist.get_world_size(group)
    # Samples are collected in interleaved rounds, so a disturbance of the host (another process,
    # the scheduler) touches a few calls of many samples instead of all calls of one; the median
    # of each sample's calls then ignores it.
    per_round = [max(1, -(-c // cfg.rounds)) for c in calls]
    issued: list[list[float]] = [[] for _ in cases]
    durations: list[list[float]] = [[] for _ in cases]
    fresh = _FreshMemory(device) if first_touch_wanted else None
    fresh_tries: list[list[float]] = [[] for _ in FIRST_TOUCH_MIB] if first_touch_wanted else []
    t_timing = time.perf_counter()
    for _ in range(cfg.rounds):
        dist.barrier(group=group)
        for _, _, issue in cases[:3]:  # wake the backend's threads before the first timed call
            _once(issue)
        for i, (_, _, issue) in enumerate(cases):
            a, b = _time_calls(issue, per_round[i], device, group)
            issued[i] += a
            durations[i] += b
        for tries, t in zip(fresh_tries, fresh.tries() if fresh is not None else []):
            tries.append(t)
    del fresh
    first_touch = [max(0.0, lower_quartile(tries)) for tries in fresh_tries]
    names = [(op, nb) for op, nb, _ in cases]
    # [Note: the caller's share of a collective] The compute thread itself spends time on every
    # collective: issuing it (gloo's list reduce-scatter copies its input there; every backend
    # enqueues work and wakes a thread) and collecting it when it is done. The simulator charges
    # that to the compute thread (CommModel.host) and times the rest, issue to completion, on the
    # communication queue — so an operation's samples are its calls' times less their issue time.
    # A copy has no work handle: on the CPU it runs inside the call (and a CUDA copy's issue takes
    # microseconds), so it is timed whole — less its issue, the CPU's copies read as free (comm
    # model schema 6 timed a 16 MiB copy at 8 us, and offloading plans were predicted 12-15% fast).
    times = [
        _quantile([t - i for t, i in zip(d, iss)] if op in COLLECTIVES else d, 0.1)
        for (op, _, _), d, iss in zip(cases, durations, issued)
    ]
    issue_times = [_quantile(iss, 0.25) for iss in issued]
    # how disturbed the host was: the median call against the 10th percentile, over the samples
    spreads = sorted(_quantile(d, 0.5) / max(_quantile(d, 0.1), 1e-9) for d in durations)
    spread = spreads[len(spreads) // 2] if spreads else 1.0
    # waiting for a collective that is already done (sizes do not matter)
    collected = {op: _quantile(_wait_when_done(issue, 10, group), 0.25) for op, issue in probes.items()} if world > 1 else {}
    n = len(cases)
    times = _max_over_ranks(times + issue_times + [collected.get(op, 0.0) for op in COLLECTIVES] + first_touch, group, device)
    times, issue_times, collected_times, first_touch = (
        times[:n], times[n : 2 * n], times[2 * n : 2 * n + len(COLLECTIVES)], times[2 * n + len(COLLECTIVES) :])
    collected = dict(zip(COLLECTIVES, collected_times))
    samples: dict[str, list[tuple[float, float]]] = {}
    host_samples: dict[str, list[tuple[float, float]]] = {}
    for (op, nb), t, issue_t in zip(names, times, issue_times):
        samples.setdefault(op, []).append((float(nb), t))
        if op in COLLECTIVES:
            host_samples.setdefault(op, []).append((float(nb), issue_t + collected[op]))
    # the contention figures are relative to this pass's own base times (what the pass measured,
    # and the stored samples of the sizes it did not time)
    # an operation with no sample at all (a world of one measures no collective) has no fit
    ops = {op: fit_op(_monotone(pts)) for op, pts in _merged(base_samples, samples).items() if pts}
    t_contention = time.perf_counter()
    contention, rounds = _contention(group, device, ops, collected, cells) if world > 1 and cells else ({}, 0)
    return _Pass(samples, host_samples, contention, spread,
                 [[float(mib << 20), s] for mib, s in zip(FIRST_TOUCH_MIB, first_touch)], rounds,
                 timed=len(cases), timing_s=t_contention - t_timing, contention_s=time.perf_counter() - t_contention)


def _merged(base: dict[str, list[tuple[float, float]]], new: dict[str, list[tuple[float, float]]]) -> dict[str, list[tuple[float, float]]]:
    """Each operation's samples: ``new``'s, and ``base``'s at the sizes ``new`` did not measure, by size."""
    out = {}
    for op in {*base, *new}:
        fresh = dict(new.get(op, []))
        out[op] = sorted([(x, t) for x, t in base.get(op, []) if x not in fresh] + list(fresh.items()))
    return out


def _monotone(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``pts`` (bytes, seconds) in order of size, each capped at the next larger one's time.

    A message is never cheaper than a smaller one of the same kind: a sample slower than a larger
    message's was disturbed (seen on 2 cores: a 16 KiB reduce-scatter at 1.5x the 64 KiB one), and
    is capped at the larger one's time before fitting."""
    out = sorted(pts)
    for i in range(len(out) - 2, -1, -1):
        out[i] = (out[i][0], min(out[i][1], out[i + 1][1]))
    return out


def _by_figure(passes: list[_Pass]) -> dict[tuple[str, str, float, int], list[float]]:
    """Every figure the passes measured, by (part, operation, bytes, column), with its value in each
    pass that measured it, in pass order: the times (``time``), the caller's shares (``host``), the
    contention figures (``contention``, columns 1-3) and the first-touch costs (``first_touch``)."""
    out: dict[tuple[str, str, float, int], list[float]] = {}
    for p in passes:
        for part, table in (("time", p.samples), ("host", p.host_samples)):
            for op, pts in table.items():
                for nb, t in pts:
                    out.setdefault((part, op, nb, 0), []).append(t)
        for kind, rows in p.contention.items():
            for row in rows:
                for j in (1, 2, 3):
                    out.setdefault(("contention", kind, row[0], j), []).append(row[j])
        for nb, sec in p.first_touch:
            out.setdefault(("first_touch", "", nb, 0), []).append(sec)
    return out


def _combine(passes: list[_Pass]) -> _Pass:
    """The passes as one ([Note: a sweep in passes]): each (operation, size)'s time, each
    contention figure and the host's spread, the median over the passes that measured it."""
    figures = {key: statistics.median(values) for key, values in _by_figure(passes).items()}
    samples: dict[str, list[tuple[float, float]]] = {}
    host: dict[str, list[tuple[float, float]]] = {}
    contention: dict[str, dict[float, list[float]]] = {}
    first_touch: list[list[float]] = []
    for (part, op, nb, j), value in sorted(figures.items()):
        if part == "time":
            samples.setdefault(op, []).append((nb, value))
        elif part == "host":
            host.setdefault(op, []).append((nb, value))
        elif part == "contention":
            contention.setdefault(op, {}).setdefault(nb, [nb, 0.0, 0.0, 0.0])[j] = value
        else:
            first_touch.append([nb, value])
    rows = {kind: [by_size[nb] for nb in sorted(by_size)] for kind, by_size in contention.items()}
    return _Pass(samples, host, rows, statistics.median(p.spread for p in passes), first_touch)


def _pass_spread(passes: list[_Pass]) -> float:
    """How far the passes disagreed: over every collective's time and contention figure measured
    more than once, the median of its range over the passes as a fraction of its median (0 with one
    pass)."""
    figures = [values for (part, op, _, _), values in _by_figure(passes).items()
               if len(values) > 1 and (part == "contention" or part == "time" and op in COLLECTIVES)]
    if not figures:
        return 0.0
    return statistics.median((max(f) - min(f)) / max(statistics.median(f), 1e-12) for f in figures)


def _unsettled(passes: list[_Pass]) -> set[tuple[str, float]]:
    """The (operation, bytes) whose figures the passes so far disagree on by more than
    ``PASSES_AGREE`` (a time, the caller's share, or a contention figure: range over median), and
    ("first_touch", 0) when a first-touch figure does: what the next pass measures again
    ([Note: passes that agree])."""
    out = set()
    for (part, op, nb, _), values in _by_figure(passes).items():
        if len(values) > 1 and (max(values) - min(values)) / max(statistics.median(values), 1e-12) > PASSES_AGREE:
            out.add(("first_touch", 0.0) if part == "first_touch" else (op, nb))
    return out


PASSES_AGREE = 0.1  # figures two passes agree on this closely are not measured in a third (_unsettled)


def sweep(
    group: dist.ProcessGroup, device: torch.device, cfg: SweepConfig | None = None, *, comm: Any = None,
    needs: CommNeeds | None = None, base: CommModel | None = None,
) -> CommModel:
    """Measure and fit the comm model on ``group`` (a collective: call on every rank); ``cfg``
    defaults to ``SweepConfig()``. Given ``comm`` (an AutoDist instance's :class:`Comm` on
    ``group``), the sweep measures on its process groups and makes none (see [Note: AutoDist's own
    process groups]); else it makes its own and destroys them at the end. ``needs``: what to
    measure (default: every collective at every size); ``base``: a comm model of this machine
    whose parts are kept, only what it lacks being measured and added (:func:`plan_sweep`; every
    rank must pass the same one).

    [Note: passes that agree] A sweep takes up to ``passes`` passes and keeps each figure's median
    over the passes that measured it. The first two measure everything; each later pass measures
    again only the operations and sizes whose figures the passes so far disagree on by more than
    ``PASSES_AGREE`` (their range over their median; :func:`_unsettled`). The median of three values
    lies within the range of any two of them, so where two passes agree within 10%, a third could
    move the figure kept by 10% of it at most: it is not measured. The figures are the slowest
    rank's, the same on every rank, so every rank measures the same again.

    [Note: contention in the first pass] The contention figures are measured once, in the first
    pass, against its base times, each in rounds until it is known within ``CONTENTION_REL_SE``
    ([Note: contention rounds until the figures are known]); the later passes time the operations
    only. Measured in every pass, five rounds each, they took 44 s of a 50 s sweep of gpt's
    messages on 2 idle CPU ranks (252 rounds: load average 1.2), the most of a first launch, and
    the passes disagreed on them by 36% (``pass_spread``): the spread of rounds a single pass took
    within itself. What three passes' median bought, a figure less moved by a pass read high or
    low, the rounds' trimmed mean buys within the pass, and a pass whose rounds spread takes more
    of them. A timing, cheap and far steadier (the 10th percentile of tens of calls), still gets
    its passes."""
    cfg = cfg or SweepConfig()
    from ..runtime.comm import Comm, backend_workers, device_backend  # the same collective calls the runtime issues

    world = dist.get_world_size(group)
    n_passes = agreed_passes(cfg.passes, group, device)
    todo = plan_sweep(needs if needs is not None else CommNeeds.everything(), base, world, cfg)
    comm = Comm(group) if comm is None else comm.sharing_groups(whole_world=True)
    t_start = time.perf_counter()
    buffers: dict[int, tuple[torch.Tensor, ...]] = {}

    def buffers_of(nbytes: int) -> tuple[torch.Tensor, ...]:
        """(buf, shard, out, host) of a message of about ``nbytes``, made once per size."""
        if nbytes not in buffers:
            n = message_bytes(nbytes, world) // 4
            buffers[nbytes] = (torch.zeros(n, device=device), torch.zeros(n // world, device=device),
                               torch.empty(n, device=device), torch.empty(n, pin_memory=device.type == "cuda"))
        return buffers[nbytes]

    def issues(nbytes: int) -> dict[str, Any]:
        buf, shard, out, host = buffers_of(nbytes)
        nonblock = device.type == "cuda"
        return {
            **(dict(_collectives(comm, buf, shard, out)) if world > 1 else {}),
            "d2h": lambda: _copy(host, buf, nonblock),
            "h2d": lambda: _copy(buf, host, nonblock),
        }

    order = (*COLLECTIVES, *COPIES)
    cases = [(op, message_bytes(nb, world), issues(nb)[op]) for nb in cfg.sizes for op in order if nb in todo.timings.get(op, ())]
    cells = [(op, message_bytes(nb, world), issues(nb)[op]) for nb in CONTENTION_SIZES for op in COLLECTIVES
             if nb in todo.contention.get(op, ())]
    probes = {op: issues(min(cfg.sizes))[op] for op in COLLECTIVES if todo.timings.get(op) or todo.contention.get(op)}
    base_samples = {op: list(fit.samples) for op, fit in base.ops.items()} if base is not None else {}
    t0 = time.perf_counter()
    calls = [_calls_for(issue, group, device, cfg) for _, _, issue in cases]
    passes: list[_Pass] = []
    again = {(op, float(nb)) for op, nb, _ in cases + cells} | ({("first_touch", 0.0)} if todo.first_touch else set())
    while len(passes) < n_passes and again:
        keep = [i for i, (op, nb, _) in enumerate(cases) if (op, float(nb)) in again]
        # a pass after the first two measures again only what they disagree on ([Note: passes that agree]);
        # the first one measures the contention figures too ([Note: contention in the first pass])
        known = _merged(base_samples, _combine(passes).samples) if passes else base_samples
        passes.append(_measure_pass(
            comm, group, device, cfg, [cases[i] for i in keep], [calls[i] for i in keep],
            [] if passes else cells, probes, known, ("first_touch", 0.0) in again,
        ))
        if len(passes) >= 2:
            again = _unsettled(passes)
    measuring = time.perf_counter() - t0
    combined = _combine(passes)
    samples = _merged(base_samples, combined.samples)
    host_samples = _merged({op: list(fit.samples) for op, fit in base.host.items()} if base is not None else {},
                           combined.host_samples)
    ops = {op: fit_op(_monotone(pts)) for op, pts in samples.items() if pts}
    host_ops = {op: fit_op(pts) for op, pts in host_samples.items() if pts}
    if world == 1:
        zero = OpModel(Piece(0.0, 0.0), Piece(0.0, 0.0), float("inf"))
        for op in COLLECTIVES:
            ops[op] = zero
    # the contention rows as measured, this sweep's and the stored ones at other sizes, then smoothed
    measured_rows = _stored_rows(base)
    for kind, rows in combined.contention.items():
        fresh = {row[0] for row in rows}
        measured_rows[kind] = sorted([r for r in measured_rows.get(kind, []) if r[0] not in fresh] + rows)
    contention = _smoothed(measured_rows)
    largest_rows = [contention[k][-1] for k in COLLECTIVES if contention.get(k)]
    if largest_rows:
        slow_compute, slow_comm = largest_rows[0][1:3]
    elif base is not None:
        slow_compute, slow_comm = base.compute_slowdown, base.comm_slowdown
    else:
        slow_compute, slow_comm = 1.0, 1.0
    measured_ops = sorted({op for op, _, _ in cells} | set(probes))
    transient = dict(base.transient) if base is not None else {}
    transient.update(_transient_bytes(comm, device, measured_ops) if world > 1 and measured_ops else {})
    if todo.overhead or base is None:
        from .overhead import measure_runtime_overhead

        overhead = asdict(measure_runtime_overhead(device, comm))
    else:
        overhead = dict(base.overhead)
    first_touch = combined.first_touch if todo.first_touch else list(base.first_touch if base is not None else [])
    n_rounds = sum(contention_rounds(nb) for _, nb, _ in cells)
    rates = _rates(passes, base)
    model = CommModel(
        # the wait figures' calibration for the machine class (see [Note: the wait calibration])
        wait_scale=DEFAULT_CPU_WAIT_SCALE if device.type == "cpu" else 1.0,
        blocked_wait_s=DEFAULT_CPU_BLOCKED_WAIT_S if device.type == "cpu" and world > 1 else 0.0,
        workers=backend_workers(comm.gather_pg),
        backend=device_backend(group, device.type),
        world_size=world,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        ops=ops,
        compute_slowdown=slow_compute,
        comm_slowdown=slow_comm,
        contention=contention,
        transient=transient,
        overhead=overhead,
        host=host_ops,
        first_touch=first_touch,
        meta={
            "sweep_seconds": time.perf_counter() - t_start, "torch": torch.__version__,
            # median over samples of (median call / 10th percentile): ~1 on a quiet host (the median pass)
            "spread": round(combined.spread, 3), "disturbed": combined.spread > DISTURBED_SPREAD, "passes": len(passes),
            # how far the passes disagreed: a figure's range over its median, the median over the figures
            "pass_spread": round(_pass_spread(passes), 3),
            # the contention rounds each pass took (the first: [Note: contention in the first pass]), of
            # the fewest and the most it may ([Note: contention rounds until the figures are known])
            "contention_rounds": [p.contention_rounds for p in passes], "contention_rounds_most": n_rounds,
            "contention_rounds_fewest": sum(min(CONTENTION_MIN_ROUNDS, contention_rounds(nb)) for _, nb, _ in cells),
            # where the measuring time went: every pass's timed samples and the contention rounds
            "phases_s": {"timings": round(sum(p.timing_s for p in passes), 3),
                         "contention": round(sum(p.contention_s for p in passes), 3),
                         "passes": round(measuring, 3)},
            # what this sweep measured (the rest came from ``base``), and how fast, for the next estimate
            "measured": {"timings": {op: sorted(v) for op, v in todo.timings.items()},
                         "contention": {op: sorted(v) for op, v in todo.contention.items()}},
            "contention_measured": measured_rows, "rates": rates,
        },
    )
    comm.destroy()
    box = [model]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _stored_rows(base: CommModel | None) -> dict[str, list[list[float]]]:
    """The contention rows ``base`` was smoothed from (its own where it has no record of them)."""
    if base is None:
        return {}
    stored = base.meta.get("contention_measured")
    rows = stored if isinstance(stored, dict) and set(stored) == set(base.contention) else base.contention
    return {kind: [list(r) for r in rs] for kind, rs in rows.items()}


def _rates(passes: list[_Pass], base: CommModel | None) -> dict[str, float]:
    """``SweepPlan.estimate_seconds``'s rates as this sweep measured them: the seconds its passes
    spent per timed sample and per contention round (a rate this sweep did not measure: ``base``'s,
    else ``SWEEP_RATES``'s)."""
    old = base.meta.get("rates") if base is not None else None
    rates = dict(SWEEP_RATES, **(old if isinstance(old, dict) else {}))
    timed = sum(p.timed for p in passes)
    rounds = sum(p.contention_rounds for p in passes)
    if timed:
        rates["timing_s"] = sum(p.timing_s for p in passes) / timed
    if rounds:
        rates["contention_round_s"] = sum(p.contention_s for p in passes) / rounds
    return rates


CONTENTION_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)  # message bytes measured at
CONTENTION_REACH = 2.0  # a model's largest message up to this many times the largest size below it takes its figures
CONTENTION_MIN_ROUNDS = 3  # each (kind, size) is measured in at least this many interleaved rounds (trimmed_mean) ...
CONTENTION_MAX_ROUNDS = 8  # ... and at most this many, while a figure's standard error ...
CONTENTION_REL_SE = 0.12  # ... exceeds this fraction of it ([Note: repeating until the estimate is known] in robust.py)
CONTENTION_MAX_SECONDS = 8.0  # ... and no round begins past the fewest once the rounds have taken this long
CONTENTION_LONG_BYTES = 64 << 20  # messages of this size and more ...
CONTENTION_LONG_ROUNDS = 3  # ... take this many rounds at most (their median; see [Note: stable contention figures])
CONTENTION_BUSY_S = 0.01  # each full-overlap measurement runs collectives of at least this much base time ...
CONTENTION_MAX_CALLS = 24  # ... in at most this many calls (small ones are slowed ~10x) ...
CONTENTION_TRAIN_S = 0.25  # ... and after the first round, in no more than fill this long at its slowdown (3 at least)
CONTENTION_WAIT_S = 0.02  # each wait measurement runs collectives of at least this much base time ...
CONTENTION_MAX_WAIT_CALLS = 48  # ... in at most this many calls (see [Note: the wait figure])


def reference_product(device: torch.device) -> Callable[[], None]:
    """One step of the reference computation the contention figures are measured with: a product
    of two 128x128 matrices and a tanh, written in place (~0.15 ms on a CPU core). A profile
    measures the model's slowdown under communication against this one's under the same
    (autodist/measure/contention.py [Note: the model's own contention])."""
    a = torch.randn(128, 128, device=device)
    b = torch.randn(128, 128, device=device)

    def one() -> None:
        torch.tanh(a @ b, out=b)

    return one


def contention_rounds(nbytes: int) -> int:
    """The most rounds a contention figure of a message of ``nbytes`` is measured in (the same on
    every rank: it depends on the size alone); it takes fewer once its figures are known
    (:func:`settled_cells`)."""
    return CONTENTION_LONG_ROUNDS if nbytes >= CONTENTION_LONG_BYTES else CONTENTION_MAX_ROUNDS


def product_rate(one: Callable[[], None], seconds: float, device: torch.device) -> float:
    """Calls of ``one`` per second, over about ``seconds``: positive whatever the host does. At least
    one call is timed, so a rank descheduled for the whole window (a busy host) reads a slow rate,
    never zero — the contention figures divide by it."""
    n, t0 = 0, time.perf_counter()
    while True:
        one()
        n += 1
        if time.perf_counter() - t0 >= seconds:
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return n / max(time.perf_counter() - t0, 1e-9)


def _contention(
    group: dist.ProcessGroup, device: torch.device, ops: dict[str, OpModel], collect: dict[str, float],
    cells: list[tuple[str, int, Any]], clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict[str, list[list[float]]], int]:
    """Per collective kind and message size of ``cells`` ((kind, message bytes, issue)): [bytes,
    compute slowdown while it runs, its slowdown while compute runs, its wait figure], as measured
    (:func:`_smoothed` smooths them over sizes once every size is at hand); and the rounds taken
    (:func:`settled_cells`).

    Each is measured under full overlap, as the runtime overlaps: the compute thread issues a
    collective, computes (small matrix products, ~0.15 ms each on a CPU core) until it has completed,
    then issues the next — a train of at least ``CONTENTION_BUSY_S`` of base time. The compute rate
    is compared with the rate alone measured just before (both ranks computing), the train's time
    less its issue time with the operations' fitted times (``ops``: the simulator's base time, so
    that base x slowdown reproduces what was measured). Kinds differ (gloo runs a reduce-scatter as
    several concurrent all-reduces on its worker threads, which contend harder with compute on a
    small host), and so do sizes: a small message waits for the backend's threads to be scheduled
    at every round trip, so it is slowed more, and a large one competes with compute for memory
    bandwidth.

    [Note: stable contention figures] A single measurement of a slowdown on a shared 2-core host
    moves 2-3x between runs (the "alone" rate and the train are each taken over tens of
    milliseconds). Every (kind, size) is measured in interleaved rounds, each with its own "alone"
    rate taken just before, until its figures are known ([Note: contention rounds until the figures
    are known]), and the mean of its middle rounds is kept (:func:`trimmed_mean`: a step pays the
    mean over its collectives, not a typical one); then the slowest rank's. Three rounds at least,
    so that one disturbed round either way is left out; messages of ``CONTENTION_LONG_BYTES`` and
    more (64 MiB) take three at most, whose trimmed mean is their median: each of their rounds costs
    about 0.4 s (:func:`contention_rounds`). What
    remains is the host's state from minute to minute, which no statistic within a sweep removes:
    over four sweeps taken one after another the full-overlap figure of a 256 KiB all-gather read
    5.9-11.1, and ``tools/sweepcheck.py`` measures how far that moves predictions. Completion is
    seen by a waiter thread (gloo's list reduce-scatter cannot be polled), so the compute thread
    notices it within one product.

    [Note: contention rounds within a time] Past the fewest rounds, no round begins once the
    rounds have taken ``CONTENTION_MAX_SECONDS`` (by ``clock``, the longest of the ranks'): on a
    disturbed host, whose cells never settle, the most rounds of every cell took 15-18 s of a 37 s
    first launch on 2 CPU ranks, to narrow figures that move 8-11% from one sweep to the next anyway
    ([Note: contention rounds until the figures are known]). A cell cut so keeps the trimmed mean of
    the rounds it has, as one that reached its most rounds unsettled does; the comm model's meta
    has the rounds taken beside the fewest and the most there could be. A steady host's cells
    settle before the time is up.
    """
    one = reference_product(device)
    start = clock()
    ratios: list[list[tuple[float, float, float]]] = [[] for _ in cells]
    # ops, hence each train's calls, agree across ranks; after the first round, the slowest rank's
    # slowdowns of that round do too (see [Note: a train of bounded length])
    t_ops = [max(ops[kind](nbytes), 1e-6) for kind, nbytes, _ in cells]  # a fit may read 0: the calls divide by it
    calls = [train_calls(t_op) for t_op in t_ops]
    settled = [False for _ in cells]
    with _completion_waiter() as work_q:
        for r in range(max((contention_rounds(nbytes) for _, nbytes, _ in cells), default=0)):
            if r == 1:
                first = _max_over_ranks([rs[0][1] for rs in ratios], group, device)
                calls = [train_calls(t_op, slow) for t_op, slow in zip(t_ops, first)]
            if r >= CONTENTION_MIN_ROUNDS:
                agreed = _max_over_ranks([*(rounds_uncertainty(rs) for rs in ratios), clock() - start], group, device)
                settled = settled_cells(ratios, agreed[:-1])
                if agreed[-1] >= CONTENTION_MAX_SECONDS:  # every rank alike ([Note: contention rounds within a time])
                    break
            todo = [i for i, (_, nbytes, _) in enumerate(cells) if r < contention_rounds(nbytes) and not settled[i]]
            if not todo:
                break  # the same on every rank: the figures are agreed, the counts depend on the sizes
            for i in todo if r % 2 == 0 else reversed(todo):
                kind, _, issue = cells[i]
                ratios[i].append(_contention_round(issue, t_ops[i], calls[i], one, work_q, group, device, collect.get(kind, 0.0)))
    values = [trimmed_mean([x[j] for x in rs]) for rs in ratios for j in (0, 1, 2)]
    values = _max_over_ranks(values, group, device)
    out_rows: dict[str, list[list[float]]] = {}
    for i, (kind, nbytes, _) in enumerate(cells):
        out_rows.setdefault(kind, []).append([float(nbytes), *values[3 * i : 3 * i + 3]])
    return {kind: sorted(rows) for kind, rows in out_rows.items()}, sum(len(rs) for rs in ratios)


def rounds_uncertainty(rounds: list[tuple[float, float, float]]) -> float:
    """How uncertain a cell's figures still are: over its three figures, the largest standard error
    of their rounds' mean relative to it (:func:`~autodist.measure.robust.relative_se`; ``math.inf``
    before two rounds)."""
    return max((relative_se(col) for col in zip(*rounds)), default=math.inf)


def settled_cells(ratios: list[list[tuple[float, float, float]]], uncertainties: list[float]) -> list[bool]:
    """Which cells need no more contention rounds: those measured ``CONTENTION_MIN_ROUNDS`` times or
    more whose figures are known within ``CONTENTION_REL_SE`` on every rank (``uncertainties``: each
    cell's :func:`rounds_uncertainty`, the largest over the ranks, so that every rank measures the
    same cells again).

    [Note: contention rounds until the figures are known] A cell's figure is the trimmed mean of
    its rounds, so that one round disturbed either way is left out ([Note: stable contention
    figures]); it is measured until the standard error of each of its three figures is within
    ``CONTENTION_REL_SE`` of the figure, at least ``CONTENTION_MIN_ROUNDS`` and at most
    :func:`contention_rounds` times ([Note: repeating until the estimate is known] in
    measure/robust.py). The bound is what the figures' use can resolve: the same figures move by
    8-11% (median coefficient of variation; a quarter of them by 12-20%) from one sweep to the next
    taken minutes apart, each of fifteen rounds (``benchmarks/sweepcheck-passes.json``'s four comm
    models per checkout), and the host's state from minute to minute, which no round within a sweep
    averages out, sets that. A quiet host, whose rounds agree, stops at the fewest rounds; a
    disturbed one takes the most."""
    return [len(rs) >= CONTENTION_MIN_ROUNDS and u <= CONTENTION_REL_SE for rs, u in zip(ratios, uncertainties)]


@contextmanager
def _completion_waiter() -> Iterator[queue.Queue]:
    """A queue of (work, event): a waiter thread waits on each work and sets its event once it has
    completed (gloo's list reduce-scatter cannot be polled); the thread ends with the block."""
    work_q: queue.Queue = queue.Queue()

    def waiter() -> None:
        while True:
            item = work_q.get()
            if item is None:
                return
            work, done = item
            work.wait()
            done.set()

    thread = threading.Thread(target=waiter, name="autodist-sweep-waiter", daemon=True)
    thread.start()
    try:
        yield work_q
    finally:
        work_q.put(None)
        thread.join()


def train_calls(t_op: float, slowdown: float | None = None) -> int:
    """How many collectives of base time ``t_op`` a full-overlap train runs: enough for
    ``CONTENTION_BUSY_S`` of base time, at most ``CONTENTION_MAX_CALLS``; given the ``slowdown``
    the first round measured, no more than fill ``CONTENTION_TRAIN_S`` at it, and 3 at least.

    [Note: a train of bounded length] A train's calls run at the collective's contended speed: a
    64 KiB all-reduce of 0.33 ms base time read slowdowns of 18-270 on a busy 2-core host, and its
    train of 24 calls took 0.2-2.3 s a round, most of a sweep's time. A quarter of a second spans
    dozens of the scheduler's slices, which is what the train's length is for; so after the first
    round a train runs no longer than that at the slowdown the first round measured. The bound is
    reached only at slowdowns over about 30 (24 calls of 0.33 ms); below, the train is as before."""
    k = min(CONTENTION_MAX_CALLS, max(1, math.ceil(CONTENTION_BUSY_S / t_op)))
    if slowdown is None:
        return k
    return min(k, max(3, math.ceil(CONTENTION_TRAIN_S / (t_op * max(slowdown, 1.0)))))


def _contention_round(
    issue: Any,
    t_op: float,
    k: int,
    one: Callable[[], None],
    work_q: queue.Queue,
    group: dist.ProcessGroup,
    device: torch.device,
    collect_s: float,
) -> tuple[float, float, float]:
    """One round of one (kind, size) of base time ``t_op``, its full-overlap train ``k`` calls long
    (:func:`train_calls`): [compute slowdown while it runs, its slowdown while compute runs, its wait
    figure]."""
    _once(issue)  # wake the backend's threads
    dist.barrier(group=group)
    alone = product_rate(one, 0.015, device)
    slow_compute, slow_comm = _full_overlap(issue, k, t_op, one, alone, work_q, group)
    return slow_compute, slow_comm, _wait_ratio(issue, t_op, one, slow_comm, collect_s, group)


def _full_overlap(
    issue: Any,
    k: int,
    t_op: float,
    one: Callable[[], None],
    alone: float,
    work_q: queue.Queue,
    group: dist.ProcessGroup,
) -> tuple[float, float]:
    """Full overlap: compute until each of ``k`` collectives is done; the compute's slowdown (its
    rate against ``alone``) and the collectives' (the train's time less its issue time against their
    base time)."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    n, issuing = 0, 0.0
    for _ in range(k):
        ti = time.perf_counter()
        work = issue()
        issuing += time.perf_counter() - ti
        done = threading.Event()
        work_q.put((work, done))
        while not done.is_set():
            one()
            n += 1
    busy = time.perf_counter() - t0 - issuing
    computing = max(n / alone, 1e-9)  # what the products would take alone
    slow_compute = max(1.0, busy / computing) if n else 1.0
    slow_comm = max(1.0, busy / (k * t_op))
    return slow_compute, slow_comm


def _wait_ratio(
    issue: Any, t_op: float, one: Callable[[], None], slow_comm: float, collect_s: float, group: dist.ProcessGroup
) -> float:
    """The wait: compute for half the base time, then wait; the wait over the base time left.

    [Note: the wait figure] The third figure is how fast a collective the compute thread waits on
    runs: the wait divided by the base time it had left. It is measured right after the issue —
    the thread computes for half the operation's base time (at least one product, ~0.15 ms: about
    the whole base time of a 64 KiB collective; ``left`` counts what it computed), then waits — so
    that nearly all of
    the operation is left (``1 - 1/(2 x slow_comm)`` of it, 0.83-0.97 for the measured slowdowns)
    whatever the noisy ``slow_comm`` is. It used to be measured after computing for half the
    *contended* time: then half the operation was nominally left, but whether it had in fact
    finished during the compute was a coin flip on a 2-core host (a 256 KiB all-gather's wait
    after 1 ms of compute: 0.05-0.46 ms from one round to the next), and the ratio's denominator
    moved with ``slow_comm``. Nine sweeps taken one after another in two batches on a 2-core CPU
    host gave 1.44-4.93 for the 256 KiB all-gather, 1.25-4.97 for the reduce-scatter and 2.67-6.66
    for the all-reduce, and deep-mlp's sharded plans — whose units wait on a 256 KiB gather each —
    were predicted anywhere from 9% above to 36% below the same measured steps. Measured after
    the issue, the same figures read 1.53-2.23, 2.19-2.87 and 1.71-3.06 over eight sweeps in two
    batches; the wait is nearly independent of how long the thread computed first (0.40-0.55 ms
    for that all-gather after 0.05 to 1 ms of compute: while both ranks compute, a small collective
    hardly progresses). In a training step collectives are waited on more slowly still than this
    lockstep measurement shows; the simulator scales the figure of messages below 16 MiB by the
    machine class's calibration (``CommModel.wait_scale``, which :func:`sweep` sets; see [Note: the
    wait calibration] in autodist/cost/fidelity.py).
    """
    kw = min(CONTENTION_MAX_WAIT_CALLS, max(1, math.ceil(CONTENTION_WAIT_S / t_op)))
    dist.barrier(group=group)
    left, waited = 0.0, 0.0
    for _ in range(kw):
        work = issue()
        tc = time.perf_counter()
        while time.perf_counter() - tc < t_op / 2:
            one()
        computed = time.perf_counter() - tc
        tw = time.perf_counter()
        work.wait()
        waited += max(0.0, time.perf_counter() - tw - collect_s)
        left += max(t_op - computed / slow_comm, t_op / 10)
    return max(1.0, waited / left)


def _smoothed(measured: dict[str, list[list[float]]]) -> dict[str, list[list[float]]]:
    """The figures per kind, one row per size ([bytes, slow_compute, slow_comm, wait]): neighbouring
    sizes differ little, so each figure is the running median of three over the measured sizes."""
    out_rows: dict[str, list[list[float]]] = {}
    for kind, measured_rows in measured.items():
        rows = [list(row) for row in sorted(measured_rows)]
        for j in (1, 2, 3):
            column = [row[j] for row in rows]
            for i, row in enumerate(rows):
                row[j] = statistics.median(column[max(0, i - 1) : i + 2])
        out_rows[kind] = rows
    return out_rows


TRAIN_COVER = 1.5  # a profile's train of collectives lasts this many times the pass it runs beside


def train_length(seconds: float, once: float, rate: tuple[float, float] | None = None) -> int:
    """How many all-reduces a :class:`CollectiveTrain` for a pass of ``seconds`` (alone) queues:
    ``TRAIN_COVER`` times the pass at ``once`` seconds each (their time alone) — or, given ``rate``
    (seconds per all-reduce while a pass ran beside an earlier train, and the longest such a pass
    took over its seconds alone), ``TRAIN_COVER`` times the pass as slowed at that rate.

    [Note: a train as long as its pass] A train only needs to outlast the pass it contends with;
    what it holds beyond that, the pass's caller waits out before the next pass. Sized at the
    all-reduces' time alone it ran about three times that long beside a pass on 2 CPU ranks (the
    pass slows them 3x): 4.5 times the pass where 1.5 were asked, and about half of a contended
    round's time was that wait. So after a train that outlasted its pass (its rate is known: the
    all-reduces completed while the pass ran, over the pass's time) the next ones are sized at that
    rate, for the longest pass seen; one that ran out before its pass ended sizes the next one
    alone-rate again (:meth:`CollectiveTrain.__call__`)."""
    if rate is None:
        return max(1, math.ceil(TRAIN_COVER * seconds / max(once, 1e-6)))
    per_call, stretch = rate
    return max(1, math.ceil(TRAIN_COVER * seconds * max(stretch, 1.0) / max(per_call, 1e-6)))


class CollectiveTrain:
    """What :func:`~autodist.measure.trace.profile_model` computes against to measure the model's
    own slowdown while communication runs. Calling it with ``seconds`` issues, on every rank of
    ``group`` (a collective: every rank calls it at the same point), enough asynchronous
    all-reduces of ``TRAIN_BYTES``, queued at once, to keep the backend busy for longer than a pass
    of ``seconds`` alone takes beside them (:func:`train_length`, the slowest rank's), and returns
    the function that waits for them all. :meth:`largest` gives a figure's largest value over the
    ranks, so that a decision to measure more (another round) is the same on every rank: one rank
    measuring on alone would wait for collectives the others never issue."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.buf = torch.zeros(TRAIN_BYTES // 4, device=device)
        dist.all_reduce(self.buf, group=group)  # wake the backend's threads
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(3):
            dist.all_reduce(self.buf, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.once = (time.perf_counter() - t0) / 3
        # (seconds per all-reduce beside a pass, the longest pass over its time alone): this rank's,
        # from the trains that outlasted their pass ([Note: a train as long as its pass])
        self.rate: tuple[float, float] | None = None

    def __call__(self, seconds: float) -> Callable[[], None]:
        n = torch.tensor([train_length(seconds, self.once, self.rate)], dtype=torch.int64, device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        t0 = time.perf_counter()
        works = [dist.all_reduce(self.buf, group=self.group, async_op=True) for _ in range(int(n.item()))]

        def stop() -> None:
            ran = time.perf_counter() - t0
            done = sum(1 for w in works if w.is_completed())
            for w in works:
                w.wait()
            if 0 < done < len(works):  # it outlasted the pass: its rate beside the pass is known
                stretch = max(ran / max(seconds, 1e-9), self.rate[1] if self.rate is not None else 1.0)
                self.rate = (ran / done, stretch)
            else:  # it ran out before the pass ended, or nothing completed to tell the rate
                self.rate = None

        return stop

    def largest(self, value: float) -> float:
        return _max_over_ranks([value], self.group, self.device)[0]


def collective_train(group: dist.ProcessGroup, device: torch.device) -> CollectiveTrain | None:
    """The :class:`CollectiveTrain` of ``group``; ``None`` on a world of one (nothing to contend with)."""
    if dist.get_world_size(group) == 1:
        return None
    return CollectiveTrain(group, device)


FIRST_TOUCH_MIB = (4, 16, 24, 32, 40, 48, 64)  # sizes the cost of fresh memory is measured at


class _FreshMemory:
    """How much longer writing a tensor allocated just before takes than writing one that exists,
    at ``FIRST_TOUCH_MIB``: one try per size at a time (:meth:`tries`), which a sweep pass takes
    once per round, between its timings (see [Note: fresh memory, measured across the sweep]).

    [Note: fresh memory] glibc serves an allocation at or above its mmap threshold with fresh
    pages, which the kernel faults in and zeroes as they are first written — and its threshold
    rises with the sizes freed, but not far: on a 2-core CPU host writing a new 64 MiB tensor
    took 23-50 ms more than writing an existing one, a new 24 MiB tensor nothing more. The runtime
    allocates every step what a gather lands in and copies out to, and each reduce-scatter's input,
    so a model with large parameters pays this on the CPU where a GPU's caching allocator pays
    nothing (this measures ~0 there).

    [Note: fresh memory, measured across the sweep] The cost moves with the host's state from one
    second to the next, not from one try to the next: on a 2-core CPU host (2 ranks measuring
    at once) five tries taken together read 28.0-29.9 ms for a new 64 MiB tensor, and five taken
    three seconds later 39.0-41.0; eight sweeps' figures taken ten seconds apart read 23.8-36.6 ms.
    Comm model schema 8 took its five tries together, once per sweep, and the zoo's sweeps read
    20.6-35.3 ms: wide-mlp's fsdp and random3, which write ten such tensors a step, were predicted
    19% and 17% slow from a sweep that read 32.6 ms, and 7.0% and 8.7% slow with the figures of one
    that read 23.1 (the rest of the comm model unchanged). So each round of every pass takes one
    try per size, spread over the pass's timings; a pass keeps the lower quartile of its tries
    ([Note: the lower quartile] in measure/robust.py), the slowest rank's, and the sweep the median
    over its passes: three sweeps in a row read 22.3, 28.8 and 22.3 ms, and the zoo measured with
    them has those two and wide-mlp's tightest searched plan within -4.3% to +1.9%."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        largest = (max(FIRST_TOUCH_MIB) << 20) // 4
        self.src = torch.ones(largest, device=device)
        self.dst = torch.empty(largest, device=device)
        self.dst.copy_(self.src)
        self.tries()  # let the allocator's threshold settle on these sizes (see [Note: fresh memory])

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def tries(self) -> list[float]:
        """One try per size: seconds of writing a new tensor less those of writing an existing one."""
        out = []
        for mib in FIRST_TOUCH_MIB:
            n = (mib << 20) // 4
            src, dst = self.src[:n], self.dst[:n]
            self._sync()
            t0 = time.perf_counter()
            dst.copy_(src)
            self._sync()
            t1 = time.perf_counter()
            new = torch.empty(n, device=self.device)
            new.copy_(src)
            self._sync()
            t2 = time.perf_counter()
            del new
            out.append((t2 - t1) - (t1 - t0))
        return out


def _transient_bytes(comm: Any, device: torch.device, ops: list[str]) -> dict[str, float]:
    """Extra bytes the backend allocates per message byte while a collective runs (measured on one
    4 MiB message of each kind: the CUDA allocator's peak, or the CPU profiler's allocations)."""
    world = comm.world_size
    n = (1 << 20) // world * world
    buf = torch.zeros(n, device=device)
    shard = torch.zeros(n // world, device=device)
    out = torch.empty(n, device=device)
    calls = {
        "all_reduce": lambda: comm.all_reduce(buf, "sweep").wait(),
        "all_gather": lambda: comm.all_gather(out, shard, "sweep").wait(),
        "reduce_scatter": lambda: comm.reduce_scatter(shard, buf, "sweep").wait(),
    }
    result = {}
    for op, fn in calls.items():
        if op not in ops:
            continue
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            fn()
            torch.cuda.synchronize(device)
            extra = torch.cuda.max_memory_allocated(device) - base
        else:
            from .memory import trace_cpu_memory

            mem, _ = trace_cpu_memory(fn)
            extra = max((m for _, m in mem), default=0)
        result[op] = extra / (n * 4)
    return result
