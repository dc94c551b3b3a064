"""Train the learned estimator on collected timelines, evaluate it on models held out of training,
and (``--store``) save it in the AutoDist cache beside this machine's comm model.

    python tools/collect_timelines.py --out timelines.jsonl
    python tools/train_estimator.py --data timelines.jsonl --store --json estimator-eval.json

Evaluation is leave-one-model-out: for each model in the data, a network trained on the other
models predicts the held-out model's plans (every size of it: a ``--size tiny`` and a default
collection are one model). Reported per held-out model and size: the per-event relative
error of the durations (analytic vs. corrected; median, 90th percentile, share within 14% —
DisCo's figure is 90% of events within 14%), split into compute sections and collectives; and the
simulator's step-time median absolute error and Spearman rank correlation against the measured
step times, without and with the estimator. Two references frame them: the measurement against
itself (``repeat``: each event's mean over the first half of the measured steps against the
last half's — no per-event prediction can be expected to agree with a measurement more closely
than it agrees with itself), and the *replay* (the simulator timing each plan with every event's
measured duration: the step-time error that remains with perfect per-event durations, from the
simulator's rules of order and overlap). The estimator trained for a held-out model applies the
share of its correction chosen on its own training models (``autodist.lab.learned.fit``).
``--store`` then trains on every model and stores the network with its provenance and this
validation; ``plan="auto"`` uses it only when the validation meets
``autodist.lab.learned.HELPS_RULE``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _launch import report  # noqa: E402

from autodist.cost.comm import CommModel  # noqa: E402
from autodist.cost.profile import Profile  # noqa: E402
from autodist.cost.simulator import Simulator  # noqa: E402
from autodist.lab import learned  # noqa: E402
from autodist.lab.graph import ScheduleGraph, graph_of, targets  # noqa: E402
from autodist.measure.fidelity import spearman  # noqa: E402
from autodist.plan import Plan  # noqa: E402
from autodist.planner.cache import Cache  # noqa: E402
from autodist.planner.keys import comm_cache_key  # noqa: E402
from autodist.structure import discover  # noqa: E402
from autodist.zoo import zoo  # noqa: E402


def load(paths: list[str], *, keep_disturbed: bool = False) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    """Model records (the last per model and size, keyed ``"<model>:<size>"``) and their plan
    records, from JSON-lines files; plans measured on a busy host are left out unless
    ``keep_disturbed``."""
    models: dict[str, dict] = {}
    plans: dict[str, list[dict]] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                r = json.loads(line)
                key = f"{r['model']}:{r['size']}"
                if r["record"] == "model":
                    models[key] = r
                    plans[key] = []  # a later collection of the model replaces an earlier one
                elif r["record"] == "plan" and key in plans and (keep_disturbed or not r.get("disturbed")):
                    plans[key].append(r)
    return models, plans


def simulator_for(record: dict, estimator: learned.Estimator | None = None) -> Simulator:
    wl = zoo(record["size"])[record["model"]]
    with torch.device("meta"):
        structure = discover(wl.build())
    return Simulator(
        Profile.from_json(json.dumps(record["profile"])), structure, CommModel.from_dict(record["comm"]),
        world_size=record["world_size"], estimator=estimator,
    )


def samples_for(record: dict, plans: list[dict]) -> list[learned.Sample]:
    sim = simulator_for(record)
    out = []
    for p in plans:
        program, _, graph = graph_of(sim, Plan.from_json(json.dumps(p["plan"])))
        measured = {e["name"]: e["measured_s"] for e in p["events"] if "measured_s" in e}
        y, mask = targets(graph, measured)
        step = learned.MeasuredStep(sim, program, p["measured_step_s"])
        out.append(learned.Sample(graph, y, mask, record["model"], p["plan_name"], step))
    return out


def evaluate(trained: learned.Trained, record: dict, plans: list[dict], samples: list[learned.Sample]) -> dict:
    """The held-out figures for one model (see the module docstring)."""
    errs: dict[str, dict[str, list[float]]] = {
        w: {"analytic": [], "estimator": [], "repeat": []} for w in ("all", "compute", "collectives")
    }
    for s, p in zip(samples, plans):
        pred = trained.predict(s.graph)
        idx = torch.nonzero(s.mask).flatten().tolist()
        for which, log_ratio in (("analytic", None), ("estimator", pred)):
            for err, i in zip(learned.event_errors(s.graph, s.y, s.mask, log_ratio), idx):
                errs["all"][which].append(err)
                errs["compute" if s.graph.op[i] < 0 else "collectives"][which].append(err)
        # the measurement against itself: the mean of its first steps against that of its last
        for i, err in repeat_errors(s.graph, p["events"]).items():
            errs["all"]["repeat"].append(err)
            errs["compute" if s.graph.op[i] < 0 else "collectives"]["repeat"].append(err)
    analytic_sim = simulator_for(record)
    corrected_sim = simulator_for(record, learned.Estimator(trained))
    measured, analytic, corrected, replayed, rows = [], [], [], [], []
    for p, s in zip(plans, samples):
        plan = Plan.from_json(json.dumps(p["plan"]))
        a = analytic_sim.run(plan).step_s
        c = corrected_sim.run(plan).step_s
        # the replay: every measured event's duration as measured, the rest analytic — what a
        # perfect per-event estimator would give; its error is the simulator's rules of order,
        # overlap and waiting against the runtime's, which per-event durations cannot remove
        r = s.step.timed(s.graph, s.y, learned.KINDS, nodes=s.mask)
        measured.append(p["measured_step_s"])
        analytic.append(a)
        corrected.append(c)
        replayed.append(r)
        rows.append({"plan": p["plan_name"], "source": p["source"], "measured_s": p["measured_step_s"], "analytic_s": a,
                     "estimator_s": c, "replay_s": r})

    def fidelity(pred: list[float]) -> dict[str, float]:
        return {
            "median_abs_pct_error_time": 100 * statistics.median(abs(x - m) / m for x, m in zip(pred, measured)),
            "spearman": spearman(pred, measured) if len(pred) > 2 else float("nan"),
        }

    return {
        "plans": len(plans),
        "events": {w: {k: learned.error_summary(v) for k, v in d.items()} for w, d in errs.items()},
        "analytic": fidelity(analytic),
        "estimator": fidelity(corrected),
        "replay": fidelity(replayed),
        "rows": rows,
    }


def repeat_errors(graph: ScheduleGraph, events: list[dict]) -> dict[int, float]:
    """Per measured node of ``graph`` whose record has ``halves_s`` (the means of the first and
    the last half of the measured steps): how far apart the two are, relative to the measured
    duration as :func:`autodist.lab.learned.event_errors` judges a prediction — the error a
    prediction that equalled one half would have against the other."""
    by_name = {e["name"]: e for e in events}
    out = {}
    for i, name in enumerate(graph.names):
        e = by_name.get(name)
        if e is None or "halves_s" not in e or "measured_s" not in e:
            continue
        a, b = e["halves_s"]
        out[i] = abs(a - b) / max(e["measured_s"], learned.FLOOR_S)
    return out


def table(payload: dict) -> str:
    lines = [f"learned estimator, leave-one-model-out ({payload['train']['epochs']} epochs, seed {payload['train']['seed']})"]
    for model, r in payload["held_out"].items():
        lines.append(f"held out: {model} ({r['plans']} plans; trained on {', '.join(r['trained_on'])}, {r['train_seconds']:.0f} s; "
                     f"correction applied at {r['shrink']:g}, chosen on those models)")
        lines.append(f"  {'events':<22}{'n':>6}{'median':>9}{'p90':>9}{'<=14%':>8}   (relative error of each event's duration)")
        for which in ("all", "compute", "collectives"):
            for k in ("analytic", "estimator", "repeat"):
                e = r["events"][which][k]
                if e["events"]:
                    lines.append(f"  {which + ' ' + k:<22}{e['events']:>6}{e['median_pct']:>8.1f}%{e['p90_pct']:>8.1f}%{e['within_14pct']:>8.0%}")
        a, e, p = r["analytic"], r["estimator"], r["replay"]
        lines.append(f"  step time: analytic median |error| {a['median_abs_pct_error_time']:.1f}%, Spearman {a['spearman']:.3f}; "
                     f"with estimator {e['median_abs_pct_error_time']:.1f}%, Spearman {e['spearman']:.3f}; "
                     f"replaying the measured events {p['median_abs_pct_error_time']:.1f}%, Spearman {p['spearman']:.3f}")
    lines.append(f"helps (rule: {learned.HELPS_RULE}): {payload['helps']}")
    if payload.get("stored"):
        lines.append(f"stored: {payload['stored']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="+", required=True, help="JSON-lines files from tools/collect_timelines.py")
    ap.add_argument("--epochs", type=int, default=learned.TrainConfig.epochs,
                    help=f"full-batch training epochs (default {learned.TrainConfig.epochs})")
    ap.add_argument("--seed", type=int, default=0, help="seeds initialisation (default 0)")
    ap.add_argument("--keep-disturbed", action="store_true", help="also use plans measured on a busy host")
    ap.add_argument("--store", action="store_true", help="train on every model and store the estimator in the cache")
    ap.add_argument("--cache-dir", default=None, help="the AutoDist cache to store in (default: AutoDist's)")
    ap.add_argument("--json", default=None, help="also save the evaluation here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not learned.gnn_available():
        print("the learned estimator needs torch_geometric: pip install 'autodist[gnn]'", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # the shared two cores: one thread each is faster than two contending
    models, plans = load(args.data, keep_disturbed=args.keep_disturbed)
    empty = sorted(k for k in models if not plans[k])
    if empty:
        print(f"no usable plans for {', '.join(empty)}: left out", file=sys.stderr)
        models = {k: r for k, r in models.items() if plans[k]}
    if len({r["model"] for r in models.values()}) < 2:
        print(f"need timelines of at least two models to hold one out; found {sorted(models)}", file=sys.stderr)
        return 2
    cfg = learned.TrainConfig(epochs=args.epochs, seed=args.seed)
    samples = {k: samples_for(models[k], plans[k]) for k in models}
    architectures = sorted({models[k]["model"] for k in models})
    held_out = {}
    for arch in architectures:
        train_on = [s for k, v in samples.items() if models[k]["model"] != arch for s in v]
        t0 = time.perf_counter()
        trained = learned.fit(train_on, cfg)
        seconds = time.perf_counter() - t0
        for k in (k for k in models if models[k]["model"] == arch):
            r = evaluate(trained, models[k], plans[k], samples[k])
            r["trained_on"] = sorted(j for j in models if models[j]["model"] != arch)
            r["train_seconds"] = seconds
            r["shrink"] = trained.shrink
            r["shrink_scores"] = trained.shrink_scores
            held_out[k] = r
    validation = {k: {"analytic": r["analytic"], "estimator": r["estimator"],
                      "events_p90_pct": {w: r["events"]["all"][w]["p90_pct"] for w in ("analytic", "estimator")}}
                  for k, r in held_out.items()}
    payload = {
        # the analytic model it is compared with and would correct
        "train": {"epochs": cfg.epochs, "seed": cfg.seed, "weighting": cfg.weighting, "simulator": learned.SIMULATOR_VERSION},
        "held_out": held_out,
        "helps": learned.helps(validation),
    }
    if args.store:
        import torch_geometric

        trained = learned.fit([s for v in samples.values() for s in v], cfg)
        first = next(iter(models.values()))
        machine = {"world": first["world_size"], "device": "cpu", "device_name": "cpu", "backend": first["comm"]["backend"]}
        entry = learned.EstimatorEntry.of(
            trained, machine=machine, validation=validation,
            provenance={
                "models": sorted(models), "plans": sum(len(v) for v in plans.values()),
                "events": int(sum(int(s.mask.sum()) for v in samples.values() for s in v)),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "torch": torch.__version__, "torch_geometric": torch_geometric.__version__,
                "feature_schema": learned.FEATURE_SCHEMA, "epochs": cfg.epochs, "seed": cfg.seed, "weighting": cfg.weighting,
                "shrink_scores": trained.shrink_scores,
                "data": [os.path.abspath(p) for p in args.data],
            },
        )
        key = comm_cache_key(machine["world"], machine["device"], machine["device_name"], machine["backend"])
        path = Cache(args.cache_dir).put("estimators", key, entry.to_json())
        payload["stored"] = str(path)
    report(table(payload), payload, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
