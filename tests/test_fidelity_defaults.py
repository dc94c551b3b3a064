"""The search's default margins are the errors tools/simcheck.py measured, as committed in
benchmarks/simcheck-*.json (see [Note: margins from measured error] in autodist/cost/fidelity.py):
re-measuring the zoo and committing the JSON without updating the defaults fails here."""

import json
import math
import statistics
from pathlib import Path

from autodist.cost.fidelity import DEFAULT_MEMORY_HEADROOM, DEFAULT_SEED_MARGIN, SIMULATOR_VERSION

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
ZOO = ("gpt", "wide-mlp", "deep-mlp", "resnet18")


def _plans() -> list[dict]:
    rows = []
    for name in ZOO:
        data = json.loads((BENCH / f"simcheck-{name}.json").read_text())
        assert data.get("simulator") == SIMULATOR_VERSION, f"simcheck-{name}.json was measured with another simulator"
        rows += data["plans"]
    return rows


def test_the_seed_margin_is_the_median_step_time_error_over_the_zoo():
    errors = [abs(r["predicted_step_s"] - r["measured_step_s"]) / r["measured_step_s"] for r in _plans()]
    assert len(errors) >= 48
    assert DEFAULT_SEED_MARGIN == round(statistics.median(errors), 2)


def test_the_memory_headroom_covers_the_largest_peak_excess_over_the_zoo():
    excess = max((r["measured_peak_bytes"] - r["predicted_peak_bytes"]) / r["predicted_peak_bytes"] for r in _plans())
    # the smallest whole percent at or above the largest excess, and never below 10%
    assert DEFAULT_MEMORY_HEADROOM == max(0.10, math.ceil(excess * 100 - 1e-9) / 100)
