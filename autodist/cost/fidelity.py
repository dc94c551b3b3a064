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

# Measured by tools/simcheck.py on the four zoo models (2 CPU ranks, 68 plans: built-in, random and
# searched, each in 8 passes of 4 steps; benchmarks/simcheck-*.json, simulator version 14, comm
# model schema 10 (three passes), torch 2.14.1; the same plan measured twice came out 0.6-2.3%
# apart), predicted at the wait calibration below: the median absolute step-time error over the
# zoo's plans (3.1%, rounded to 3%; per model 1.9% gpt to 5.2% deep-mlp), and the largest measured
# excess of a peak over its prediction (2.7%, wide-mlp's), below the 10% floor the headroom keeps.
# tests/test_fidelity_defaults.py recomputes both from the committed JSON.
DEFAULT_SEED_MARGIN = 0.03
DEFAULT_MEMORY_HEADROOM = 0.10
# The least seed margin a record gives: the smallest median step-time error of one zoo model over
# its 12+ plans in those records (1.9%, gpt's), rounded. A record of fewer plans measured on a
# quiet host reads less (`autodist check` on gpt's 7 plans read 0.4%, while simcheck's 15 plans of
# the same model read 2.7%): a median over a handful of plans does not show an error the zoo's
# models, each measured on many, never went below. tests/test_fidelity_defaults.py recomputes it.
MIN_SEED_MARGIN = 0.02
# [Note: a record that is not used] A record whose median step-time error is above
# ``MAX_SEED_MARGIN`` is not used (the search keeps the defaults, and a warning says why): no zoo
# model's median error was above 13.7% with simulator version 9 or later (deep-mlp, comm model
# schema 9), so an error past 15% says the measurement was disturbed (a busy host: 52.7% was read
# with the same plan measured twice 11.6% apart) or the simulator does not model this machine, and
# either way a margin that large would keep a built-in plan on every later plan="auto" here.
# ``autodist check`` refuses to store such a record, and one whose own repeated measurement
# disagrees (``refusal``). The memory headroom only ever keeps plans further below the budget: it
# is capped, not refused.
MAX_SEED_MARGIN = 0.15
MAX_MEMORY_HEADROOM = 0.5
# The most two measurements of the same plan in one `autodist check` may lie apart (% of their
# mean) for its record to be stored: on the quiet reference host they came out 0.6-2.3% apart
# (simcheck's records) and 2.2% (`autodist check` on gpt); on a loaded one 11.6%. Past 5% the
# measurement's own noise is larger than the errors it would set the margins from (the default
# seed margin is 3%).
MAX_REPEAT_PCT_APART = 5.0
UNDO = "`autodist cache clear --kind fidelity` removes it"
# Raised whenever the simulator's timing or memory model changes: fidelity records and learned
# estimators of another version are stale (``autodist check`` measures again). What each version
# changed is in docs/CHANGELOG.md, what it did to the zoo's predictions in docs/fidelity.md.
SIMULATOR_VERSION = 17

# [Note: the wait calibration] The sweep measures how much slower a collective runs while the
# compute thread waits for it (the third contention figure) with a single collective, both ranks in
# lockstep (autodist/measure/sweep.py [Note: the wait figure]). In a training step the ranks reach
# each wait on their own, gathers and reductions run on their own process groups, and on a CPU host
# the compute thread takes the core while it computes: in measured steps the collectives take
# longer, and the compute is slowed less, than the isolated figures say. Of the three figures, scaling the wait
# figure is what moves the error without losing the ranking, so the simulator scales it
# (``CommModel.wait_scale``) for collectives the comm queue took up on its own, of messages up to
# ``WAIT_SCALED_BELOW_BYTES`` (autodist/cost/comm.py: a large collective streams and runs at about
# the sweep's figure), and charges a fixed time at every wait on a collective not yet done
# (``CommModel.blocked_wait_s``; autodist/cost/sim/execute.py [Note: what a blocked wait costs]).
#
# ``tools/calibrate.py`` fits the two together to the committed simcheck records
# (``benchmarks/calibration.json``): every record is predicted again at each pair of
# ``WAIT_SCALES`` and ``BLOCKED_WAITS``, and each record's median error there is compared with the
# smallest it reaches at any pair; of the pairs whose largest such excess is within
# ``SCALE_TOLERANCE`` of the least, the one whose worst record's Spearman falls least short of its
# own best is kept. A synthetic step run in the sweep
# itself does not show the effect, so the pair is fitted to real models' steps, not measured.
#
# ``DEFAULT_CPU_WAIT_SCALE`` and ``DEFAULT_CPU_BLOCKED_WAIT_S`` are that fit, for CPU hosts, the
# machine class it was measured on; the sweep sets them on every comm model it measures on a CPU,
# and 1 and 0 on an accelerator, where nothing has been measured yet. ``autodist check`` fits the
# scale alone to the plans it measures, holding the blocked-wait time (a handful of plans does not
# tell the two apart), and stores both in the machine's record, which the search then uses
# (``SearchConfig.calibrated``). tests/test_fidelity_defaults.py checks the defaults against the
# records. The figures behind the fit and its history: docs/fidelity.md.
DEFAULT_CPU_WAIT_SCALE = 1.35
DEFAULT_CPU_BLOCKED_WAIT_S = 0.0004
# the scales a calibration chooses from (tools/calibrate.py, ``autodist check``): 0.5 to 3.0
WAIT_SCALES = tuple(round(0.5 + 0.05 * i, 2) for i in range(51))
# the blocked-wait times tools/calibrate.py chooses from: 0 to 1.2 ms
BLOCKED_WAITS = tuple(round(0.0001 * i, 4) for i in range(13))
# ... keeping, of those whose (worst) median step-time error is within this many percentage points
# of the best, the one that ranks best, each record against its own best (the zoo's records), or
# the one nearest the sweep's (autodist check's handful of plans): a point is the noise of a median
# on a 2-core CPU host (docs/fidelity.md, "autodist check on the example GPT")
SCALE_TOLERANCE = 1.0


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
    # the comm model's wait calibration fitted to the plans measured (one of WAIT_SCALES; None: not
    # fitted): the search on this machine simulates with it (SearchConfig.calibrated). The errors
    # above are the simulator's before it, at the sweep's scale: the margins stay what was measured.
    wait_scale: float | None = None
    # the blocked-wait time the scale was fitted with (the sweep's, held; None: a record of before
    # it was kept): the search simulates with the two together, as fitted, whatever a later sweep
    # carries
    blocked_wait_s: float | None = None

    def unusable(self) -> str | None:
        """Why the search must not take its margins from this record (see [Note: a record that is
        not used]), or ``None``."""
        if self.median_abs_error_time > MAX_SEED_MARGIN:
            return (
                f"its median step-time error {self.median_abs_error_time:.1%} is above the {MAX_SEED_MARGIN:.0%} a "
                "record may set as the seed margin (a busy host, or a machine the simulator does not model)"
            )
        return None

    @property
    def seed_margin(self) -> float:
        return min(MAX_SEED_MARGIN, max(MIN_SEED_MARGIN, self.median_abs_error_time))

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
        ws = d.get("wait_scale")
        if ws is not None and (isinstance(ws, bool) or not isinstance(ws, (int, float)) or not WAIT_SCALES[0] <= ws <= WAIT_SCALES[-1]):
            raise ValueError(f"fidelity record wait_scale = {ws!r} is not a number in [{WAIT_SCALES[0]}, {WAIT_SCALES[-1]}]")
        bw = d.get("blocked_wait_s")
        if bw is not None and (isinstance(bw, bool) or not isinstance(bw, (int, float)) or not 0 <= bw < math.inf):
            raise ValueError(f"fidelity record blocked_wait_s = {bw!r} is not a finite non-negative number")
        if d.get("simulator", 1) != SIMULATOR_VERSION:
            raise ValueError(
                f"fidelity record measured simulator version {d.get('simulator', 1)!r}, not {SIMULATOR_VERSION}: "
                "run `autodist check` again"
            )
        return cls(
            median_abs_error_time=float(d["median_abs_error_time"]), spearman=float("nan") if sp is None else float(sp),
            max_peak_excess=float(d["max_peak_excess"]), plans=d["plans"], model=d["model"],
            measured_at=float(d["measured_at"]), source=d.get("source", "autodist check"),
            wait_scale=None if ws is None else float(ws), blocked_wait_s=None if bw is None else float(bw),
        )

    @classmethod
    def from_summary(cls, summary: dict[str, Any], model: str, source: str = "autodist check") -> FidelityRecord:
        """From :func:`autodist.measure.fidelity.summarize`'s figures (percentages)."""
        return cls(
            median_abs_error_time=summary["median_abs_pct_error_time"] / 100, spearman=summary["spearman"],
            max_peak_excess=max(0.0, summary["max_pct_peak_excess"] / 100), plans=summary["plans"], model=model,
            measured_at=time.time(), source=source,
        )


def refusal(record: FidelityRecord, repeated: list[dict[str, Any]]) -> str | None:
    """Why ``autodist check`` must not store ``record``, or ``None``. ``repeated``: the plans it
    measured twice (``autodist.measure.fidelity.repeatability``), each ``{"plans": [a, b],
    "pct_apart": x}``."""
    if not repeated:
        return "no plan was measured twice, so the measurement's own noise is unknown"
    worst = max(repeated, key=lambda r: r["pct_apart"])
    if worst["pct_apart"] > MAX_REPEAT_PCT_APART:
        a, b = worst["plans"]
        return (
            f"the same plan, measured twice ({a} and {b}), came out {worst['pct_apart']:.1f}% apart, more than "
            f"the {MAX_REPEAT_PCT_APART:.0f}% a stored measurement may be: the host was too busy or unsteady for the "
            "errors to be the simulator's; run `autodist check` again on a quiet host"
        )
    return record.unusable()
