"""Fidelity analyses only the tools run (``tools/simcheck.py``, ``tools/calibrate.py``,
``tools/sweepcheck.py``): the figures a simcheck record holds, and how far a plan's prediction moves
with the comm sweep it is made from. What ``autodist check`` measures and fits lives in
``autodist/measure/fidelity.py``; this builds on it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ..measure.fidelity import pct_apart, summaries

RECORD_FIELDS = ("spearman", "median_abs_pct_error_time", "median_abs_pct_error_peak", "max_pct_peak_excess",
                 "split_half_spearman")  # of all the plans, at a record's top level


def record_fidelity(rows: Sequence[dict[str, Any]], steps: int | None = None) -> dict[str, Any]:
    """The fidelity figures a simcheck record holds beside its plans (``rows``): those of all the
    plans at its top level (``RECORD_FIELDS``), and the built-in and random plans' and the searched
    ones' under ``random_and_builtin`` and ``searched`` (:func:`summaries`)."""
    fidelity = summaries(rows, steps)
    return {**{k: fidelity["all"].get(k) for k in RECORD_FIELDS},
            "random_and_builtin": fidelity["random_and_builtin"], "searched": fidelity["searched"]}



def sweep_spread(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How far each plan's prediction moves with the comm model it is made from: rows carry
    ``predicted_step_s_by_sweep`` (the same profile, one comm model per sweep taken in the run);
    per plan, the range of its predictions as a % of their median. Returns the number of sweeps,
    the median and the largest range over the plans, and the plan with the largest (empty when no
    row has two sweeps)."""
    spreads = []
    for r in rows:
        preds = r.get("predicted_step_s_by_sweep") or []
        if len(preds) > 1:
            spreads.append((pct_apart(preds), r["plan"], len(preds)))
    if not spreads:
        return {}
    worst = max(spreads)
    return {"sweeps": max(n for _, _, n in spreads), "median_pct": statistics.median(s for s, _, _ in spreads),
            "max_pct": worst[0], "max_plan": worst[1]}
