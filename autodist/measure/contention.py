"""The model's own contention: how much its forward and backward slow down while a train of
collectives runs, against how much a reference computation slows under the same train
(:func:`contended_slowdown`; see [Note: the model's own contention])."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .robust import relative_se

CONTENDED_MIN_ROUNDS = 3  # rounds of the model's and the reference's passes alone and under the train: at least ...
CONTENDED_MAX_ROUNDS = 15  # ... and at most this many, while the sensitivity's (their median's) standard error ...
CONTENDED_REL_SE = 0.1  # ... exceeds this fraction of it ([Note: repeating until the estimate is known] in robust.py)
CONTENDED_MAX_SECONDS = 6.0  # ... and no more rounds begin once the rounds have taken this long (past the fewest)
BEST_CASE_GRID = 32  # steps across the rounds' range best_case_se tries as the further rounds' one value


@dataclass(frozen=True)
class Contention:
    """What :func:`contended_slowdown` measured: the model's slowdown under the train, its
    sensitivity (that slowdown against the reference computation's under the same train), the
    rounds they took and the spread of the rounds' sensitivities (their quartiles' distance over the
    median)."""

    slowdown: float
    sensitivity: float
    rounds: int
    spread: float
    settled: bool = True  # the sensitivity's standard error came within CONTENDED_REL_SE of it
    # why the rounds stopped: "settled", "hopeless" (they could not settle in the rounds left; see
    # [Note: stopping rounds that cannot settle]), "time" (max_seconds) or "rounds" (max_rounds)
    stopped_by: str = "settled"


def _quartile_spread(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    lo, hi = ordered[(n - 1) // 4], ordered[n - 1 - (n - 1) // 4]
    return (hi - lo) / max(statistics.median(ordered), 1e-9)


def contended_slowdown(train_backward: Callable[[], None], contention: Callable[[float], Callable[[], None]],
                       device: torch.device, *, min_rounds: int = CONTENDED_MIN_ROUNDS,
                       max_rounds: int = CONTENDED_MAX_ROUNDS, max_seconds: float = CONTENDED_MAX_SECONDS,
                       reference: Callable[[], None] | None = None,
                       agree: Callable[[float], float] | None = None,
                       clock: Callable[[], float] = time.perf_counter) -> Contention:
    """How many times longer the model's forward and backward (``train_backward``) take in
    wall-clock time while a train of collectives runs (``contention``), at least 1; and how many
    times more that is than the reference computation's slowdown under the same train, the model's
    *sensitivity*. Each round times the model and the reference alone and under a train of their
    own, the two in turn (which goes first alternates); the slowdown is the median over rounds, the
    sensitivity the median of each round's ratio. Rounds go on from ``min_rounds`` to ``max_rounds``
    while the sensitivity's standard error exceeds ``CONTENDED_REL_SE`` of it on any rank
    (:func:`~autodist.measure.robust.relative_se` of the rounds' ratios, as a median): a steady host
    stops at the fewest, a disturbed one takes the most, or as many as begin within
    ``max_seconds`` (by ``clock``, the longest of the ranks'); then ``settled`` is False. Rounds
    that could not settle in the rounds still to come stop at once, unsettled ([Note: stopping
    rounds that cannot settle]). ``agree``
    gives a figure's largest value over the ranks (``CollectiveTrain.largest``), so every rank runs as many rounds, and so issues
    as many trains, as every other; without it the figure is this process's own (one rank, or
    no collectives). ``reference``: one pass of the reference computation, by default
    :func:`~autodist.measure.sweep.reference_product` repeated for about as long as the model's
    pass. ``clock``: the seconds every pass is timed with (a test's own clock, advanced by the
    passes it fakes, makes the rounds' figures exact).

    [Note: the model's own contention] While a collective runs, the compute it overlaps slows down:
    on an accelerator a little (the collective's kernels take SMs and memory bandwidth), on a CPU
    host a lot (the backend's threads take the cores the ranks compute on, and the memory
    bandwidth). The comm sweep measures it per collective and size with a reference computation
    (small matrix products); the simulator scales those figures by how much more this model slows
    than the reference does. That ratio is taken here, the model and the reference each under a
    train of their own in the same round — not the model's slowdown here against the sweep's figure
    for the reference, which was measured minutes apart and under one collective at a time rather
    than a queued train: that ratio read resnet18 1.48, wide-mlp 1.30, deep-mlp 1.13 and gpt 1.10 in
    the zoo's simcheck records (slowdowns 1.71-1.98 against the sweep's 1.34-1.57), where both
    under the same train read 1.16, 1.13, 0.91 and 1.03 (slowdowns 1.44-1.78 against the
    reference's 1.44-1.72). resnet18's plans that overlap their reductions with backward were
    predicted 8-15% slow relative to those that wait at once, because its compute was taken to
    slow 1.48x more than the reference does under every collective. On a shared 2-core CPU host one
    round's ratio can read anything from 0.6 to 3 (five rounds per zoo model gave medians of
    0.80-1.39 under 4 MiB all-reduces and 0.98-1.35 under 64 MiB ones, no model consistently above
    or below 1): hence the median, and more rounds while they spread (fewer where they agree)."""
    from .sweep import reference_product  # measurement beside measurement: no cycle at import

    def timed(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return clock() - t0

    typical = timed(train_backward)
    if reference is None:
        product = reference_product(device)
        product()
        per = timed(lambda: [product() for _ in range(16)]) / 16
        n = max(1, round(typical / max(per, 1e-9)))

        def reference() -> None:
            for _ in range(n):
                product()

    def under_train(fn: Callable[[], None]) -> float:
        alone = timed(fn)
        stop = contention(typical)
        try:
            return timed(fn) / max(alone, 1e-9)
        finally:
            stop()

    def agreed(spread: float) -> float:
        return agree(spread) if agree is not None else spread

    model: list[float] = []
    ratios: list[float] = []
    settled, stopped_by = False, "rounds"
    start = clock()
    for i in range(max(1, max_rounds)):
        if i % 2 == 0:
            m = under_train(train_backward)
            ref = under_train(reference)
        else:
            ref = under_train(reference)
            m = under_train(train_backward)
        model.append(m)
        ratios.append(max(m, 1.0) / max(ref, 1.0))
        if i + 1 < min_rounds:
            continue
        if agreed(relative_se(ratios, median=True)) <= CONTENDED_REL_SE:
            settled, stopped_by = True, "settled"
            break  # the sensitivity is known (see the docstring)
        elapsed = agreed(clock() - start)
        if elapsed >= max_seconds:
            stopped_by = "time"
            break  # every rank stops together: the figure is agreed like the spread
        if i + 1 < max_rounds:
            last = rounds_within(i + 1, elapsed, max_seconds, max_rounds)
            if agreed(best_case_se(ratios, last)) > CONTENDED_REL_SE:
                stopped_by = "hopeless"
                break  # every rank alike: the rounds left are agreed, and the figure is
    return Contention(max(1.0, statistics.median(model)), statistics.median(ratios), len(ratios), _quartile_spread(ratios),
                      settled, stopped_by)


def rounds_within(done: int, elapsed: float, max_seconds: float, max_rounds: int) -> int:
    """How many rounds there will have been at most: ``done`` so far, in ``elapsed`` seconds, and as
    many more as can begin before ``max_seconds`` at their mean duration, ``max_rounds`` at most."""
    if done <= 0:
        return max_rounds
    mean = elapsed / done
    more = math.ceil((max_seconds - elapsed) / mean) if mean > 0 else max_rounds
    return max(done, min(max_rounds, done + max(0, more)))


def best_case_se(ratios: Sequence[float], rounds: int) -> float:
    """The least relative standard error of the median :func:`contended_slowdown` could reach after
    ``rounds`` rounds if every further round read the same value, the best such value within the
    rounds' range (their median, their mean, each of them and ``BEST_CASE_GRID`` steps across it).

    [Note: stopping rounds that cannot settle] A sensitivity whose rounds do not settle is not used
    ([Note: an unsettled sensitivity] in autodist/measure/trace.py): the rounds run past the point
    where settling has become impossible are time spent for nothing. After each round past the
    fewest, the rounds still to come (those that can begin within ``max_seconds`` at the rounds'
    mean duration, within ``max_rounds``) are supposed to agree on one value, the one that settles
    them best (not necessarily the median: ratios 2.0, 2.78, 1.81 settle in five rounds if the next
    two read 2.2, not if they read 2.0); if even that leaves the standard error above
    ``CONTENDED_REL_SE``, the rounds stop. On a
    disturbed 2-CPU host the first launch's profile ran five rounds in 7.5 s for gpt (spread 0.47)
    and discarded them; rounds that spread once but can still be outvoted by agreeing ones go on
    (``test_comm_model``: ratios 2, 4, 2, 2, ... settle after thirteen)."""
    have = list(ratios)
    if len(have) >= rounds or not have:
        return relative_se(have, median=True)
    lo, hi = min(have), max(have)
    readings = {statistics.median(have), statistics.fmean(have), *have,
                *(lo + (hi - lo) * k / BEST_CASE_GRID for k in range(BEST_CASE_GRID + 1))}
    return min(relative_se(have + [c] * (rounds - len(have)), median=True) for c in readings)
