"""Fit the comm model's wait calibration (``CommModel.wait_scale`` and ``CommModel.blocked_wait_s``)
to measured steps.

    python tools/calibrate.py benchmarks/simcheck-*.json --json benchmarks/calibration.json

(records may be given as patterns; none: ``benchmarks/simcheck-*.json``).

Reads ``tools/simcheck.py`` records — each holds the profile, the comm model and every plan with
its measured step — and predicts every plan again at each pair of a wait scale (``WAIT_SCALES``,
0.5 to 3.0: the slowdown of a collective the compute thread waits on, of messages below 16 MiB,
``WAIT_SCALED_BELOW_BYTES`` in autodist/cost/comm.py) and a blocked-wait time (``BLOCKED_WAITS``, 0
to 1.2 ms; both in autodist/cost/fidelity.py). The fitted pair is, of those whose worst record (the
largest excess of one record's median absolute step-time error over the least it reaches at any
pair) is within ``SCALE_TOLERANCE`` (a point) of the smallest, the one at which no record's Spearman
falls far short of the best it reaches at any pair (the largest such shortfall the least), then the
one nearest (1, 0). Each record is also held out in turn — the pair
fitted on the others (records of the same model, such as ``gpt`` and ``gpt`` with accumulation,
held out together) and its error on the held-out one — so the report says how the fit does on a
model it was not fitted to. No ranks, no measurement: it re-simulates what the records measured
(about 40 s for the zoo on 2 cores: every pair, each record in a process of its own).

``--apply`` also rewrites the records' predictions at the fit, keeping what they were first predicted
with under ``out_of_sample``: records measured with one default and fitted to another then hold the
predictions the new default makes, as the search's margins and the tests read them.

See [Note: the wait calibration] in autodist/cost/fidelity.py and [Note: what a blocked wait costs]
in autodist/cost/sim/execute.py for what the two are and where the simulator applies them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _launch import report  # noqa: E402

from autodist.cost.fidelity import SIMULATOR_VERSION  # noqa: E402

DEFAULT_RECORDS = os.path.join("benchmarks", "simcheck-*.json")


def family(name: str) -> str:
    """The model a record is of (``gpt-accum4`` is ``gpt``'s): held out together."""
    return name.split("-accum")[0]


def predictions_of(record: dict, calibrations: Sequence[tuple[float, float]]) -> dict[tuple[float, float], list[float]]:
    """Per calibration (wait scale, blocked-wait seconds), the record's plans predicted again with
    its own profile and comm model calibrated so."""
    import torch

    from autodist.cost.comm import comm_model_of_another_checkout
    from autodist.cost.profile import Profile
    from autodist.measure.fidelity import predictions_by_calibration
    from autodist.plan import Plan
    from autodist.structure import discover
    from autodist.zoo import zoo

    try:
        comm = comm_model_of_another_checkout(record["comm_model"])
    except ValueError as e:
        raise SystemExit(f"calibrate: {e}") from None
    torch.manual_seed(0)
    structure = discover(zoo(record.get("size", "default"))[record["model"]].build())
    plans = [Plan.from_json(json.dumps(p["plan_json"])) for p in record["plans"]]
    return predictions_by_calibration(Profile.from_json(json.dumps(record["profile"])), structure, comm,
                                      plans, record["world_size"], calibrations)


def _predictions_of_path(path: str, calibrations: Sequence[tuple[float, float]]) -> dict[tuple[float, float], list[float]]:
    with open(path) as f:
        return predictions_of(json.load(f), calibrations)


def key(calibration: tuple[float, float]) -> str:
    """A calibration as the JSON's key: ``"<wait scale>,<blocked-wait seconds>"``."""
    return f"{calibration[0]:g},{calibration[1]:g}"


def record_name(record: dict) -> str:
    accum = record.get("accum", 1)
    return record["model"] + (f"-accum{accum}" if accum > 1 else "")


def calibrate(paths: Sequence[str]) -> dict:
    from concurrent.futures import ProcessPoolExecutor

    from autodist.cost.fidelity import BLOCKED_WAITS, SCALE_TOLERANCE, WAIT_SCALES
    from autodist.measure.fidelity import best_wait_scale as fit
    from autodist.measure.fidelity import median_pct_error, spearman

    records = []
    for path in paths:
        with open(path) as f:
            records.append(json.load(f))
    names = [record_name(r) for r in records]
    if len(set(names)) != len(names):
        raise SystemExit(f"calibrate: two records of the same model: {sorted(names)}")
    versions = {r.get("simulator") for r in records}
    if len(versions) > 1:
        raise SystemExit(f"calibrate: records of simulator versions {sorted(map(str, versions))}: fit one version's")
    pairs = [(ws, bw) for ws in WAIT_SCALES for bw in BLOCKED_WAITS]
    with ProcessPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        predicted = dict(zip(names, pool.map(_predictions_of_path, paths, [pairs] * len(paths))))
    errors: dict[tuple[float, float], dict[str, float]] = {c: {} for c in pairs}
    for name, rec in zip(names, records):
        measured = [p["measured_step_s"] for p in rec["plans"]]
        for c in pairs:
            errors[c][name] = median_pct_error(predicted[name][c], measured)
    ranking = {c: {n: spearman(predicted[n][c], [p["measured_step_s"] for p in rec["plans"]])
                   for n, rec in zip(names, records)} for c in pairs}
    unfitted = (1.0, 0.0)
    best = fit(errors, names, prior=unfitted, within=SCALE_TOLERANCE, ranking=ranking)
    held_out = {}
    for name in names:
        others = [n for n in names if family(n) != family(name)]
        if not others:
            continue
        c = fit(errors, others, prior=unfitted, within=SCALE_TOLERANCE, ranking=ranking)
        held_out[name] = {"scale": c[0], "blocked_wait_s": c[1], "median_abs_pct_error_time": errors[c][name],
                          "spearman": ranking[c][name], "uncalibrated": errors[unfitted][name]}
    at_fit = {}
    for name, rec in zip(names, records):
        measured = [p["measured_step_s"] for p in rec["plans"]]
        at_fit[name] = {
            "spearman": spearman(predicted[name][best], measured),
            "plans": [{"plan": p["plan"], "predicted_step_s": q, "measured_step_s": p["measured_step_s"]}
                      for p, q in zip(rec["plans"], predicted[name][best])],
        }
    return {
        "records": list(paths),
        "simulator": SIMULATOR_VERSION,  # every prediction here is made again, by this simulator
        "wait_scale": best[0],
        "blocked_wait_s": best[1],
        "median_abs_pct_error_time": errors[best],
        "uncalibrated": errors[unfitted],
        "held_out": held_out,
        "at_fit": at_fit,  # every plan predicted at the fitted pair: what the default margins are taken from
        "by_calibration": {key(c): errors[c] for c in pairs},
        "spearman_by_calibration": {key(c): ranking[c] for c in pairs},
    }


def table(payload: dict) -> str:
    lines = [f"fitted wait scale {payload['wait_scale']:.2f}, blocked wait {1000 * payload['blocked_wait_s']:.2f} ms "
             f"(records of simulator version {payload['simulator']})",
             f"{'record':<12} {'uncalibrated':>13} {'fitted':>8} {'held out (its scale, blocked wait)':>36}"]
    for name, err in payload["median_abs_pct_error_time"].items():
        h = payload["held_out"].get(name)
        unc = payload["uncalibrated"][name] if payload["uncalibrated"] else float("nan")
        ho = f"{h['median_abs_pct_error_time']:6.1f}% ({h['scale']:.2f}, {1000 * h['blocked_wait_s']:.1f} ms)" if h else "-"
        lines.append(f"{name:<12} {unc:12.1f}% {err:7.1f}% {ho:>36}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="*", help="tools/simcheck.py --json records, or patterns of them "
                    "(default: benchmarks/simcheck-*.json)")
    ap.add_argument("--json", default=None, help="also save the fit and the held-out figures here")
    ap.add_argument("--apply", action="store_true",
                    help="rewrite the records' predictions at the fit (what they were measured with stays under out_of_sample)")
    return ap.parse_args(argv)


def record_paths(patterns: Sequence[str]) -> list[str]:
    """The records named (a pattern is expanded; none: the committed ones), each once, sorted."""
    import glob

    found = sorted({p for pat in (patterns or [DEFAULT_RECORDS]) for p in (glob.glob(pat) or [pat])})
    missing = [p for p in found if not os.path.exists(p)]
    if missing:
        raise SystemExit(f"calibrate: no such record: {', '.join(missing)}")
    return found


def apply(payload: dict) -> None:
    """Rewrite each record's predictions at the fitted pair (``--apply``): its plans'
    ``predicted_step_s``, its comm model's ``wait_scale`` and ``blocked_wait_s`` and its summaries.
    What it was measured with first stays, once, under ``out_of_sample`` (the pair and the
    summaries then: a record predicted at a pair fitted before it was measured);
    ``predicted_step_s_by_sweep`` and ``sweep_spread`` stay at that pair (the other sweeps are not
    stored)."""
    from autodist.lab.fidelity import record_fidelity
    from autodist.measure.fidelity import summaries

    fitted = payload["wait_scale"]
    for path in payload["records"]:
        with open(path) as f:
            record = json.load(f)
        rows, steps = record["plans"], record.get("steps")
        if "out_of_sample" not in record:
            record["out_of_sample"] = {"wait_scale": record["comm_model"].get("wait_scale", 1.0),
                                       "blocked_wait_s": record["comm_model"].get("blocked_wait_s", 0.0),
                                       "simulator": record.get("simulator"), **summaries(rows, steps)}
        # the predictions are this simulator's now; the measurements stay what the record measured
        record["simulator"] = SIMULATOR_VERSION
        for row, again in zip(rows, payload["at_fit"][record_name(record)]["plans"]):
            row["predicted_step_s"] = again["predicted_step_s"]
        record["comm_model"]["wait_scale"] = fitted
        record["comm_model"]["blocked_wait_s"] = payload["blocked_wait_s"]
        record.update(record_fidelity(rows, steps))
        with open(path, "w") as f:
            json.dump(record, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    payload = calibrate(record_paths(args.records))
    if args.apply:
        apply(payload)
    report(table(payload), payload, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
