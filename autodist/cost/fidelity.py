"""How far the simulator's predictions were from measured steps on this machine: the record that
``autodist check`` leaves in the cache, and from which the search takes its two margins.

[Note: margins from measured error] The search keeps two safety margins, and both are the
simulator's error, measured:

* **seed margin** (``SearchConfig.prefer_seed_within``): a searched plan replaces the fastest
  built-in plan (ddp, fsdp, zero2) only when it is predicted faster by more than the simulator's
  median step-time error — a smaller predicted gain is within the model's error, and the built-in
  plan's behaviour is known.
* **memory headroom** (``SearchConfig.memory_headroom``): plans are searched within the budget less
  the largest share by which a measured peak exceeded its prediction.

Without a record for the machine, the defaults are the errors ``tools/simcheck.py`` measured on the
zoo models on the reference CPU machine (``benchmarks/simcheck-*.json``; see ``DEFAULT_*`` below).
``autodist check`` measures them on the user's model and machine and stores a
:class:`FidelityRecord` under the machine's key (world size, device, backend, torch version); every
later search on that machine uses it. The headroom taken from a record never goes below the
default: one model's small peak error does not vouch for another's.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

# Measured by tools/simcheck.py on the four zoo models (2 CPU ranks, 60 plans: built-in, random and
# searched; benchmarks/simcheck-*.json, simulator version 6; the same plan measured twice came out
# 0.5-8.5% apart): the median absolute step-time error over all 60 plans (10.7%; per model 8.3% gpt
# and wide-mlp to 16.6% deep-mlp, nearly all plans slower than predicted), and the largest measured
# excess of a peak over its prediction (3.0%, resnet18's fsdp), below the 10% floor the headroom
# keeps. tests/test_fidelity_defaults.py recomputes both from the committed JSON.
DEFAULT_SEED_MARGIN = 0.11
DEFAULT_MEMORY_HEADROOM = 0.10
# A record cannot push the margins beyond these: past them the simulator is not worth searching with,
# and the record says so louder than a margin would (``autodist check`` prints the figures).
MAX_SEED_MARGIN = 0.5
MAX_MEMORY_HEADROOM = 0.5
# Raised whenever the simulator's timing or memory model changes: fidelity records of another
# version are stale (``autodist check`` measures again). 2: the caller's share of collectives, the
# slowdown while compute waits, the model's own contention, fresh memory, the order check. 3: a
# gather's full tensors and its receive buffer both held during the copy-out. 4: a reduce-scatter's
# backend buffer held from launch to wait; the previous step's reduce-scatter outputs held until the
# forward and the first persistent refresh's backend buffer from the step's start. 5: a collective's
# time between the two fitted pieces' samples joins them (it dropped by up to 65% at the split);
# the backend buffers of all the refreshes a step starts with are held from its start. 6: the comm
# model's slowdown of a collective the compute thread waits on, measured right after the issue
# (comm model schema 4), and its contention figures the trimmed mean of five rounds (the median of
# three at 64 MiB).
SIMULATOR_VERSION = 6


@dataclass(frozen=True)
class FidelityRecord:
    """The simulator's measured error on one machine (what ``autodist check`` stores)."""

    median_abs_error_time: float  # fraction: median over plans of |predicted - measured| / measured
    spearman: float  # rank correlation of predicted and measured step times (nan with < 3 plans)
    max_peak_excess: float  # fraction: the largest (measured - predicted) / predicted peak, >= 0
    plans: int
    model: str
    measured_at: float  # seconds since the epoch
    source: str = "autodist check"
    # the simulator whose error was measured: a record of an earlier one says nothing of this one's
    simulator: int = SIMULATOR_VERSION

    @property
    def seed_margin(self) -> float:
        return min(MAX_SEED_MARGIN, self.median_abs_error_time)

    @property
    def memory_headroom(self) -> float:
        return min(MAX_MEMORY_HEADROOM, max(DEFAULT_MEMORY_HEADROOM, self.max_peak_excess))

    def to_json(self) -> str:
        d = asdict(self)
        d["spearman"] = None if math.isnan(self.spearman) else self.spearman
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FidelityRecord:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("a fidelity record is a JSON object")
        missing = {"median_abs_error_time", "spearman", "max_peak_excess", "plans", "model", "measured_at"} - set(d)
        if missing:
            raise ValueError(f"fidelity record lacks {', '.join(sorted(missing))}")
        for k in ("median_abs_error_time", "max_peak_excess", "measured_at"):
            v = d[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"fidelity record {k} = {v!r} is not a finite non-negative number")
        sp = d["spearman"]
        if sp is not None and (isinstance(sp, bool) or not isinstance(sp, (int, float)) or not -1 <= sp <= 1):
            raise ValueError(f"fidelity record spearman = {sp!r} is not in [-1, 1]")
        if isinstance(d["plans"], bool) or not isinstance(d["plans"], int) or d["plans"] < 1:
            raise ValueError(f"fidelity record plans = {d['plans']!r} is not a positive integer")
        if not isinstance(d["model"], str) or not isinstance(d.get("source", ""), str):
            raise ValueError("fidelity record model and source are strings")
        if d.get("simulator", 1) != SIMULATOR_VERSION:
            raise ValueError(
                f"fidelity record measured simulator version {d.get('simulator', 1)!r}, not {SIMULATOR_VERSION}: "
                "run `autodist check` again"
            )
        return cls(
            median_abs_error_time=float(d["median_abs_error_time"]), spearman=float("nan") if sp is None else float(sp),
            max_peak_excess=float(d["max_peak_excess"]), plans=d["plans"], model=d["model"],
            measured_at=float(d["measured_at"]), source=d.get("source", "autodist check"),
        )

    @classmethod
    def from_summary(cls, summary: dict[str, Any], model: str, source: str = "autodist check") -> FidelityRecord:
        """From :func:`autodist.measure.fidelity.summarize`'s figures (percentages)."""
        return cls(
            median_abs_error_time=summary["median_abs_pct_error_time"] / 100, spearman=summary["spearman"],
            max_peak_excess=max(0.0, summary["max_pct_peak_excess"] / 100), plans=summary["plans"], model=model,
            measured_at=time.time(), source=source,
        )
