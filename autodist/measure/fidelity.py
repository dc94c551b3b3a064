"""Measuring the simulator against real steps: for a set of plans on a model, the predicted step time
and peak against the measured ones. ``autodist check`` runs it on a user's model and
``tools/simcheck.py`` on the zoo's; both call the functions here, on every rank of a process group.

A plan's step time is the median over its timed steps of the slowest rank's wall clock (a barrier
before each step); its peak is the slowest rank's tensor peak over one more step
(:func:`~autodist.measure.memory.measure_step_peak`). The plans are measured in passes of alternating
order, so that a slow drift of the host touches every plan alike.
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..cost.budget import format_bytes
from ..cost.fidelity import WAIT_SCALES
from ..cost.profile import Profile, slowest, typical
from ..cost.simulator import SimResult, Simulator
from ..plan import Plan
from ..sched.search import SearchConfig, Searcher
from ..sched.space import Genome, PlanSpace
from .memory import measure_step_peak
from .robust import lower_quartile

Batch = tuple[Any, Any]  # (input, target); the target may be None when the loss needs none


@dataclass
class Checked:
    """One plan: its prediction and what was measured."""

    name: str
    plan: Plan
    predicted: SimResult
    searched: bool = False
    times: list[float] = field(default_factory=list)  # seconds per step, the slowest rank's
    peak_bytes: int = 0

    @property
    def measured_step_s(self) -> float:
        """The lower quartile of the step times, as the profile behind the prediction summarises
        its passes (see [Note: the lower quartile])."""
        return lower_quartile(self.times)

    def row(self) -> dict[str, Any]:
        return {
            "plan": self.name, "predicted_step_s": self.predicted.step_s, "measured_step_s": self.measured_step_s,
            "predicted_peak_bytes": self.predicted.peak_bytes, "measured_peak_bytes": self.peak_bytes,
            "searched": self.searched, "sharded_units": len(self.plan.sharded_units),
            "recomputed_blocks": len(self.plan.recompute), "offload_fragments": len(self.plan.offload),
            "gather_groups": len(self.plan.gather_groups), "buckets": len(self.plan.buckets),
        }


def optimizer_for(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer the measured steps train with (the profile measures its step too)."""
    return torch.optim.AdamW(params, lr=1e-4)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (ties share their mean rank); nan when either side is constant."""

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def summarize(rows: Sequence[dict[str, Any]], steps: int | None = None) -> dict[str, Any]:
    """Fidelity over ``rows`` (as :meth:`Checked.row` writes them): rank correlation of step times,
    median absolute percentage errors of time and peak, and the largest percentage by which a
    measured peak exceeded its prediction (what the memory headroom must cover). With ``steps``
    (timed steps per pass) and each row's ``measured_times_s``, also the measurement's own
    ranking of the plans from one half of its passes to the other (:func:`split_half_spearman`)."""
    if not rows:
        return {}
    pt, mt = [r["predicted_step_s"] for r in rows], [r["measured_step_s"] for r in rows]
    pp, mp = [r["predicted_peak_bytes"] for r in rows], [r["measured_peak_bytes"] for r in rows]
    out = {
        "plans": len(rows),
        "spearman": spearman(pt, mt) if len(rows) > 2 else float("nan"),
        "median_abs_pct_error_time": median_pct_error(pt, mt),
        "median_abs_pct_error_peak": median_pct_error(pp, mp),
        "max_pct_peak_excess": 100 * max((m - p) / p for p, m in zip(pp, mp)),
    }
    if steps and len(rows) > 2 and all(r.get("measured_times_s") for r in rows):
        out["split_half_spearman"] = split_half_spearman([r["measured_times_s"] for r in rows], steps)
    return out


def summaries(rows: Sequence[dict[str, Any]], steps: int | None = None) -> dict[str, dict[str, Any]]:
    """:func:`summarize` over all ``rows``, over the built-in and random plans, and over the
    searched ones (``"all"``, ``"random_and_builtin"``, ``"searched"``)."""
    return {
        "all": summarize(rows, steps),
        "random_and_builtin": summarize([r for r in rows if not r["searched"]], steps),
        "searched": summarize([r for r in rows if r["searched"]], steps),
    }


def split_half_spearman(times: Sequence[Sequence[float]], steps: int) -> float:
    """How well the measurement ranks its own plans: the rank correlation, over plans, of each
    plan's step time (the lower quartile, as :attr:`Checked.measured_step_s`) from its even passes
    against that from its odd passes. ``times`` holds each plan's step times pass by pass,
    ``steps`` a pass, as :func:`measure_plans` appends them; nan with fewer than two passes.

    [Note: the measurement's own ranking] On a shared host plans a few % apart trade places from
    one measurement to the next, so a prediction's Spearman against the measured times is limited
    by how reproducibly the measurement ranks the plans at all. This is that reproducibility, from
    the same run. Each half holds half the steps, so it understates the whole measurement's (which
    averages twice as many passes): a perfect predictor would be expected to score above it, though
    not at 1. A prediction that ranks the plans far below it is the simulator's error; near it, the
    host's noise, which more passes reduce.
    """
    halves = [[lower_quartile([t for j, t in enumerate(ts) if (j // steps) % 2 == h] or [math.nan])
               for ts in times] for h in (0, 1)]
    if any(math.isnan(x) for half in halves for x in half):
        return float("nan")
    return spearman(*halves)


def median_pct_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """The median absolute error of ``predicted`` against ``measured``, in % of the measured."""
    return 100 * statistics.median(abs(p - m) / m for p, m in zip(predicted, measured))


def predictions_by_wait_scale(profile: Profile, structure: Any, comm: Any, plans: Sequence[Plan], world: int,
                              scales: Sequence[float] = WAIT_SCALES) -> dict[float, list[float]]:
    """Per wait scale (``CommModel.wait_scale``), every plan's step time predicted with ``comm`` at
    that scale, its blocked-wait time held (see [Note: the wait calibration] in
    autodist/cost/fidelity.py)."""
    held = comm.blocked_wait_s
    by = predictions_by_calibration(profile, structure, comm, plans, world, [(s, held) for s in scales])
    return {s: by[(s, held)] for s in scales}


def predictions_by_calibration(profile: Profile, structure: Any, comm: Any, plans: Sequence[Plan], world: int,
                               calibrations: Sequence[tuple[float, float]]) -> dict[tuple[float, float], list[float]]:
    """Per calibration (``CommModel.wait_scale``, ``CommModel.blocked_wait_s``), every plan's step
    time predicted with ``comm`` calibrated so (tools/calibrate.py; see [Note: what a blocked wait
    costs] in autodist/cost/simulator.py)."""
    comms = [replace(comm, wait_scale=ws, blocked_wait_s=bw) for ws, bw in calibrations]
    by_plan = predictions_by_comm(profile, structure, comms, plans, world)
    return {c: [p[i] for p in by_plan] for i, c in enumerate(calibrations)}


def errors_by_wait_scale(profile: Profile, structure: Any, comm: Any, plans: Sequence[Plan], measured: Sequence[float],
                         world: int, scales: Sequence[float] = WAIT_SCALES) -> dict[float, float]:
    """Per wait scale, the median % step-time error of ``plans`` predicted at that scale against
    their ``measured`` step times."""
    predicted = predictions_by_wait_scale(profile, structure, comm, plans, world, scales)
    return {s: median_pct_error(predicted[s], measured) for s in scales}


def best_wait_scale(errors: dict[Any, dict[str, float]], names: Sequence[str], *, prior: Any = 1.0,
                    within: float = 0.0, ranking: dict[Any, dict[str, float]] | None = None) -> Any:
    """The scale (a key of ``errors``: scale -> record -> median % error; a key may also be a
    tuple of calibrations, ``prior`` then a tuple too, nearness taken in order) at which no record of
    ``names`` is far from the smallest error it reaches at any scale: the one whose largest such
    excess is smallest — or, of those within ``within`` percentage points of it (a median a point
    from the best does not tell two scales apart on a noisy host), the one whose records rank best
    (``ranking``: scale -> record -> Spearman; the largest shortfall of a record's from the best it
    reaches at any scale), then the one nearest ``prior`` (``autodist check``, whose handful of
    plans rank too coarsely to tell: the sweep's scale). Each record is measured against its own
    best, in error and in rank, not by its figures themselves: a record the scale hardly moves
    (wide-mlp, whose collectives are mostly larger than the scale applies to) would otherwise be
    every scale's worst and leave the choice to the tie-breaks."""
    own_best = {n: min(errors[s][n] for s in errors) for n in names}
    worst = {s: round(max(errors[s][n] - own_best[n] for n in names), 9) for s in errors}
    least = min(worst.values())

    ranks = ranking or {}
    best_rank = {n: max((r[n] for r in ranks.values() if not math.isnan(r[n])), default=math.nan) for n in names}

    def short(s: Any, n: str) -> float:
        # a record no key ranks (its plans predicted alike everywhere) does not decide; a key that
        # ranks nothing of a record others rank (nan) falls as short as a Spearman can
        if math.isnan(best_rank[n]):
            return 0.0
        return 2.0 if math.isnan(ranks[s][n]) else best_rank[n] - ranks[s][n]

    def rank(s: Any) -> float:
        return round(max(short(s, n) for n in names), 9) if ranking is not None else 0.0

    def far(s: Any) -> Any:
        return tuple(abs(a - b) for a, b in zip(s, prior)) if isinstance(s, tuple) else abs(s - prior)

    return min((s for s in errors if worst[s] <= least + within), key=lambda s: (rank(s), far(s), worst[s]))


def repeatability(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The plans measured twice in one run — a searched pick equal to a plan listed before it,
    ``searched@…=ddp`` beside ``ddp`` — with how far apart their two measured step times are (% of
    their mean): the measurement's own noise, below which no prediction can be checked."""
    by_name = {r["plan"]: r for r in rows}
    out = []
    for r in rows:
        _, eq, other = r["plan"].partition("=")
        if eq and other in by_name:
            a, b = by_name[other]["measured_step_s"], r["measured_step_s"]
            out.append({"plans": [other, r["plan"]], "pct_apart": 200 * abs(a - b) / (a + b)})
    return out


def pct_apart(values: Sequence[float]) -> float:
    """How far apart ``values`` (predictions of one plan) lie: their range as a % of their median."""
    return 100 * (max(values) - min(values)) / statistics.median(values)


def predictions_by_comm(profile: Profile, structure: Any, comms: Sequence[Any], plans: Sequence[Plan],
                        world: int, **policy: Any) -> list[list[float]]:
    """Per plan, its predicted step time from each of ``comms`` (comm models; the profile held
    fixed): what :func:`sweep_spread` reads as ``predicted_step_s_by_sweep``. ``policy``: the
    simulator's ``param_dtype`` and ``reduce_dtype``."""
    sims = [Simulator(profile, structure, c, world_size=world, **policy) for c in comms]
    return [[sim.run(plan).step_s for sim in sims] for plan in plans]


def budget_fractions(budgets: int) -> list[float]:
    """Where :func:`plans_to_check`'s ``budgets`` tighter budgets lie, from the loosest: evenly
    spaced fractions of the way from the smallest peak among the other plans to the unbudgeted
    pick's (2: 2/3 and 1/3; 4: 0.8, 0.6, 0.4 and 0.2)."""
    if budgets < 0:
        raise ValueError(f"budgets must be 0 or more, not {budgets}")
    return [k / (budgets + 1) for k in range(budgets, 0, -1)]


def plans_to_check(
    space: PlanSpace, sim: Simulator, n: int, *, seed: int = 0, searched: bool = True, budgets: int = 2,
) -> list[tuple[str, Genome, bool]]:
    """``(name, genome, searched)``: the built-in plans (ddp, fsdp, zero2), random valid plans up to
    ``n`` in all, then (``searched``) the plans the search picks without a budget and under
    ``budgets`` tighter ones (:func:`budget_fractions`: by default two, 2/3 and 1/3 of the way from
    the smallest peak among the others to the unbudgeted pick's peak, each simulated as ``sim``
    under that budget); a pick equal to a plan listed before it
    is named ``searched@…=that plan`` and measured again. Over three searched plans one swapped
    pair reads Spearman 0.5; more budgets make their ranking a measurement.

    A collective when a process group exists: rank 0 chooses and every rank gets its list, as
    ``plan="auto"`` broadcasts rank 0's plan — the search stops on a time budget, so ranks that
    searched by themselves could pick different plans (and then fail the plan-hash check)."""
    budget_fractions(budgets)  # a bad count raises here, on every rank, not on rank 0 alone mid-broadcast
    if dist.is_initialized() and dist.get_world_size() > 1:
        box: list[object] = [None]
        if dist.get_rank() == 0:
            box[0] = _choose_plans(space, sim, n, seed, searched, budgets)
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]
    return _choose_plans(space, sim, n, seed, searched, budgets)


def _choose_plans(space: PlanSpace, sim: Simulator, n: int, seed: int, searched: bool, budgets: int) -> list[tuple[str, Genome, bool]]:
    out: list[tuple[str, Genome, bool]] = [("ddp", space.ddp(), False), ("fsdp", space.fsdp(), False), ("zero2", space.zero2(), False)]
    seen = {g for _, g, _ in out}
    rng = random.Random(seed)
    tries = 0
    while len(out) < n and tries < 1000:
        tries += 1
        g = space.random(rng)
        if g not in seen:
            seen.add(g)
            out.append((f"random{len(out) - 2}", g, False))
    if searched:
        free = Searcher(space, sim, SearchConfig()).run()
        floor = min(sim.run(space.to_plan(g)).peak_bytes for _, g, _ in out)
        limits = [None] + [int(floor + f * (free.result.peak_bytes - floor)) for f in budget_fractions(budgets)]
        for b in limits:
            if b is None:
                found = free
            else:
                found = Searcher(space, sim.variant(budget_bytes=b), SearchConfig()).run()
            if not found.result.feasible:
                continue
            # A pick equal to a plan already listed is measured again under its own name: the
            # searched plans' fidelity is reported apart, and the search often keeps a built-in.
            same = next((name for name, g, _ in out if g == found.genome), None)
            label = f"searched@{'none' if b is None else format_bytes(b).replace(' ', '')}"
            out.append((label + (f"={same}" if same else ""), found.genome, True))
    return out


def slowest_over_ranks(profile: Profile) -> Profile:
    """Every rank's profile of the same model, merged into the slowest (every rank gets it): what
    a measured step is compared with, since the slowest rank sets a step's pace."""
    profiles: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(profiles, profile.to_json())
    return slowest([Profile.from_json(p) for p in profiles if p is not None])


def max_over_ranks(x: float) -> float:
    """The largest ``x`` over the ranks of the default group (every rank gets it), reduced on the
    device its backend works on (NCCL takes no host tensors)."""
    from ..runtime.comm import default_device, device_backend
    from .sweep import _max_over_ranks

    group = dist.distributed_c10d._get_default_group()
    device = default_device() if device_backend(group, "cuda") == "nccl" else torch.device("cpu")
    return _max_over_ranks([x], group, device)[0]


class Reprofile:
    """The profiles behind the predictions of a measurement in passes: the first, and one taken after
    every pass by ``again`` (each the slowest rank's), so that the profile the plans are finally
    predicted from covers the minutes they were measured in (see [Note: a host whose speed
    drifts]). Give :meth:`after_pass` to :func:`measure_plans`, then call :meth:`predict`."""

    def __init__(self, first: Profile, again: Callable[[], Profile]) -> None:
        self.profiles = [first]
        self._again = again

    def after_pass(self, _: int) -> None:
        self.profiles.append(slowest_over_ranks(self._again()))

    def predict(self, checks: Sequence[Checked], like: Simulator, *, record: bool = False) -> Profile:
        """Predict every plan again from the typical profile (returned), simulated as ``like``."""
        prof = typical(self.profiles)
        sim = like.variant(profile=prof)
        for c in checks:
            c.predicted = sim.run(c.plan, record=record)
        return prof


def measure_plans(
    checks: list[Checked],
    wrap: Callable[[Plan], nn.Module],
    batches: Sequence[Batch],
    loss: Callable[[Any, Any], torch.Tensor],
    *,
    device: torch.device,
    accum: int = 1,
    steps: int = 6,
    warmup: int = 2,
    passes: int = 2,
    close: Callable[[nn.Module], None] = lambda m: m.close(),  # type: ignore[operator]  # nn.Module.__getattr__'s stub
    after_warmup: Callable[[int, Callable[[], None]], None] | None = None,
    progress: Callable[[Checked], None] | None = None,
    forward: Callable[[nn.Module, Any], Any] = lambda model, x: model(x),
    after_pass: Callable[[int], None] | None = None,
) -> None:
    """Measure each of ``checks`` in place: ``wrap(plan)`` builds the wrapped model (same seed each
    time), :func:`optimizer_for` (AdamW) trains it on ``batches`` (``warmup`` + ``steps`` + 1 of them), a step being
    ``accum`` micro-batches, all but the last under ``no_sync``. ``after_warmup(i, one_step)`` runs
    on the first pass after warm-up (simcheck draws traces there); ``progress`` after each plan's
    last pass. ``forward(model, x)`` runs the model on a micro-batch (keyword inputs, if any).
    ``after_pass(p)`` runs after pass ``p`` (simcheck profiles the model again there: see [Note:
    a host whose speed drifts]).

    [Note: a host whose speed drifts] On a host of 2 shared vCPUs the same computation
    takes from 27 to 45 ms from one second to the next, and a whole minute can run 20-30% slower
    than the next: one plan measured at the end of one pass and the start of the next read 35%
    slower than the same plan measured elsewhere in the run. Plans are therefore measured in several
    short passes in alternating order, each plan's time the median of all its steps, and the tools
    profile the model again after every pass so that the profile behind the predictions covers the
    same minutes as the measurements (:func:`~autodist.cost.profile.typical`)."""

    def measure(i: int, first: bool) -> None:
        c = checks[i]
        gc.collect()
        model = wrap(c.plan)
        opt = optimizer_for(list(model.parameters()))

        def step(x: Any, y: Any) -> None:
            xs = x.chunk(accum) if accum > 1 else (x,)
            ys = y.chunk(accum) if accum > 1 and y is not None else (y,) * len(xs)
            for k, (xm, ym) in enumerate(zip(xs, ys)):
                if k < len(xs) - 1:
                    with model.no_sync():  # type: ignore[operator]  # nn.Module.__getattr__'s stub
                        loss(forward(model, xm), ym).div(len(xs)).backward()
                else:
                    loss(forward(model, xm), ym).div(len(xs)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        try:
            for x, y in batches[:warmup]:
                step(x, y)
            for x, y in batches[warmup : warmup + steps]:
                dist.barrier()
                t0 = time.perf_counter()
                step(x, y)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                c.times.append(max_over_ranks(time.perf_counter() - t0))
            xl, yl = batches[-1]
            if first and after_warmup is not None:
                after_warmup(i, lambda: step(xl, yl))
            if first:

                def live() -> list[torch.Tensor]:
                    held = list(model.runtime.held_tensors())  # type: ignore[union-attr, operator]  # nn.Module.__getattr__'s stub
                    held += [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
                    inputs = [t for t in (xl, yl) if isinstance(t, torch.Tensor)]
                    return held + [p.grad for p in model.parameters() if p.grad is not None] + inputs

                c.peak_bytes = int(max_over_ranks(measure_step_peak(lambda: step(xl, yl), device, live)))
        finally:
            close(model)

    for p in range(passes):
        for i in range(len(checks)) if p % 2 == 0 else reversed(range(len(checks))):
            c = checks[i]
            if p == 0:
                c.times.clear()
            measure(i, first=p == 0)
            if p == passes - 1 and progress is not None:
                progress(c)
        if after_pass is not None:
            after_pass(p)
