"""How repeated timings are summarised wherever something is measured (the profile's passes, the
optimizer's steps, the runtime-overhead calibration, the comm sweep's first-touch figures, and a
plan's measured steps in ``autodist check`` and ``tools/simcheck.py``; the contention figures: trimmed_mean),
and when repeating a measurement can stop (:func:`relative_se`).

[Note: the lower quartile] On a shared host, interference only ever adds time, so a timing's
typical value is not its mean; the very fastest sample can be a fluke (a timer tick, a warm cache
the real workload never sees). The lower quartile is both robust and what the host gives when
undisturbed. Predictions and measurements are summarised by the same statistic, so that comparing
them measures the simulator and not the host's noise: on the development VM a plan's 16 measured
steps spread by 35% (gpt under ddp: fastest 361 ms, median 494 ms), while the profile it is
predicted from is already a lower quartile; the noise is reported on its own (a plan measured
twice, ``repeatability``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def lower_quartile(values: Sequence[float]) -> float:
    """The lower quartile of ``values`` (not empty): the sample a quarter of the way up, no interpolation."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def trimmed_mean(values: Sequence[float]) -> float:
    """The mean of ``values`` (not empty) without their lowest and highest, when there are at least
    three: the typical cost of something a step repeats many times (its total is the mean times the
    count), where one round disturbed either way does not move it. The comm sweep's contention
    figures use it (see [Note: stable contention figures] in autodist/measure/sweep.py)."""
    ordered = sorted(values)
    middle = ordered[1:-1] if len(ordered) >= 3 else ordered
    return sum(middle) / len(middle)


MEDIAN_SE_FACTOR = math.sqrt(math.pi / 2)  # a median's standard error over a mean's, for normal noise


def relative_se(values: Sequence[float], *, median: bool = False) -> float:
    """How uncertain an estimate taken from ``values`` is: the standard error of their mean (sample
    standard deviation over the square root of their count), times ``MEDIAN_SE_FACTOR`` for their
    median (``median``), over the estimate's magnitude; ``math.inf`` with fewer than two values.

    [Note: repeating until the estimate is known] Where a measurement is repeated in rounds (the
    comm sweep's contention figures, the profile's contended passes), the rounds stop once the
    estimate's standard error is within a fraction of it, and not after a fixed count: on a quiet
    host a few rounds agree and more would not move the estimate, on a disturbed one they spread
    and the measurement goes on to its most rounds. A trimmed mean of rounds (``trimmed_mean``) is
    given the mean's standard error, which it approximates for noise without outliers."""
    n = len(values)
    if n < 2:
        return math.inf
    center = statistics.median(values) if median else statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(n) * (MEDIAN_SE_FACTOR if median else 1.0)
    return se / max(abs(center), 1e-12)
