"""Fit the comm model's wait calibration (``CommModel.wait_scale``) to measured steps.

    python tools/calibrate.py benchmarks/simcheck-*.json --json benchmarks/calibration.json

(records may be given as patterns; none: ``benchmarks/simcheck-*.json``).

Reads ``tools/simcheck.py`` records — each holds the profile, the comm model and every plan with
its measured step — and predicts every plan again with the slowdown of a collective the compute
thread waits on (of messages below 16 MiB: ``WAIT_SCALED_BELOW_BYTES`` in autodist/cost/comm.py)
scaled by each of ``WAIT_SCALES`` (0.5 to 3.0; autodist/cost/fidelity.py). The
fitted scale is, of those whose worst record (the largest median absolute step-time error of one
record's plans) is within ``SCALE_TOLERANCE`` (a point) of the smallest, the one whose worst record
ranks its plans best (Spearman), then the one nearest 1. Each record is also held out in turn — the scale fitted on the others
(records of the same model, such as ``gpt`` and ``gpt`` with accumulation, held out together) and
its error on the held-out one — so the report says how the fit does on a model it was not fitted
to. No ranks, no measurement: it re-simulates what the records measured (seconds for the zoo).

``--apply`` also rewrites the records' predictions at the fit, keeping what they were first predicted
with under ``out_of_sample``: records measured with one default and fitted to another then hold the
predictions the new default makes, as the search's margins and the tests read them.

See [Note: the wait calibration] in autodist/cost/fidelity.py for what the scale is and where the
sweep applies it.
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

DEFAULT_RECORDS = os.path.join("benchmarks", "simcheck-*.json")


def family(name: str) -> str:
    """The model a record is of (``gpt-accum4`` is ``gpt``'s): held out together."""
    return name.split("-accum")[0]


def predictions_of(record: dict, scales: Sequence[float]) -> dict[float, list[float]]:
    """Per scale, the record's plans predicted again with its own profile and comm model at that
    wait scale."""
    import torch

    from autodist.cost.comm import comm_model_of_another_checkout
    from autodist.cost.profile import Profile
    from autodist.measure.fidelity import predictions_by_wait_scale
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
    return predictions_by_wait_scale(Profile.from_json(json.dumps(record["profile"])), structure, comm,
                                     plans, record["world_size"], scales)


def record_name(record: dict) -> str:
    accum = record.get("accum", 1)
    return record["model"] + (f"-accum{accum}" if accum > 1 else "")


def calibrate(paths: Sequence[str]) -> dict:
    from autodist.cost.fidelity import SCALE_TOLERANCE
    from autodist.cost.fidelity import WAIT_SCALES as scales
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
    predicted: dict[str, dict[float, list[float]]] = {}
    errors: dict[float, dict[str, float]] = {s: {} for s in scales}
    for name, rec in zip(names, records):
        predicted[name] = predictions_of(rec, scales)
        measured = [p["measured_step_s"] for p in rec["plans"]]
        for s in scales:
            errors[s][name] = median_pct_error(predicted[name][s], measured)
    ranking = {s: {n: spearman(predicted[n][s], [p["measured_step_s"] for p in rec["plans"]])
                   for n, rec in zip(names, records)} for s in scales}
    best = fit(errors, names, within=SCALE_TOLERANCE, ranking=ranking)
    held_out = {}
    for name in names:
        others = [n for n in names if family(n) != family(name)]
        if not others:
            continue
        s = fit(errors, others, within=SCALE_TOLERANCE, ranking=ranking)
        held_out[name] = {"scale": s, "median_abs_pct_error_time": errors[s][name],
                          "uncalibrated": errors[1.0][name] if 1.0 in errors else None}
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
        "simulator": versions.pop() if versions else None,
        "wait_scale": best,
        "median_abs_pct_error_time": errors[best],
        "uncalibrated": errors.get(1.0),
        "held_out": held_out,
        "at_fit": at_fit,  # every plan predicted at the fitted scale: what the default margins are taken from
        "by_scale": {str(s): errors[s] for s in scales},
    }


def table(payload: dict) -> str:
    lines = [f"fitted wait scale {payload['wait_scale']:.2f} (records of simulator version {payload['simulator']})",
             f"{'record':<12} {'uncalibrated':>13} {'fitted':>8} {'held out (its scale)':>22}"]
    for name, err in payload["median_abs_pct_error_time"].items():
        h = payload["held_out"].get(name)
        unc = payload["uncalibrated"][name] if payload["uncalibrated"] else float("nan")
        ho = f"{h['median_abs_pct_error_time']:6.1f}% ({h['scale']:.2f})" if h else "-"
        lines.append(f"{name:<12} {unc:12.1f}% {err:7.1f}% {ho:>22}")
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
    """Rewrite each record's predictions at the fitted scale (``--apply``): its plans'
    ``predicted_step_s``, its comm model's ``wait_scale`` and its summaries. What it was measured
    with first stays, once, under ``out_of_sample`` (the scale and the summaries then: a record
    predicted at a scale fitted before it was measured); ``predicted_step_s_by_sweep`` and
    ``sweep_spread`` stay at that scale (the other sweeps are not stored)."""
    from autodist.measure.fidelity import record_fidelity, summaries

    fitted = payload["wait_scale"]
    for path in payload["records"]:
        with open(path) as f:
            record = json.load(f)
        rows, steps = record["plans"], record.get("steps")
        if "out_of_sample" not in record:
            record["out_of_sample"] = {"wait_scale": record["comm_model"].get("wait_scale", 1.0), **summaries(rows, steps)}
        for row, again in zip(rows, payload["at_fit"][record_name(record)]["plans"]):
            row["predicted_step_s"] = again["predicted_step_s"]
        record["comm_model"]["wait_scale"] = fitted
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
