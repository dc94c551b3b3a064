"""How reproducible is the comm model on this host? Several sweeps, and how far they move predictions.

    python tools/sweepcheck.py --sweeps 4 --json benchmarks/sweepcheck.json
    python tools/sweepcheck.py --sweeps 4 --against ../other-checkout        # two versions, alternating

Measures the comm model ``--sweeps`` times on 2 CPU ranks, one launch of torchrun per sweep (as a
first ``plan="auto"`` on a machine measures it), then predicts every plan of the given simcheck
records (``benchmarks/simcheck-*.json`` by default: each holds its model's profile and plans) from
each sweep with this checkout's simulator and reports, per model, how far each plan's predictions
lie apart (their range as a % of their median; the median and the largest over the plans). The
profile and the plans are fixed, so what moves is only the comm model: its own reproducibility, apart
from the simulator's error and from the profile's. It also reports each sweep's own figures (the
``fit`` table): how long it took, and how far each collective's fit lies from the furthest of its
samples (the test suite checks only that a sweep is the fit of its samples: both figures move with
the host's load).

``--against PATH`` also sweeps with the ``autodist`` package of another checkout, alternating
launches (this one, the other, this one, ...), so that a host whose speed drifts over minutes
touches both sets alike; its comm models are read with this checkout's fields whatever schema
version they carry (the tool's business: a comparison of how two versions measure). Every comm
model, this checkout's and the other's, is predicted at this checkout's wait calibration
(``DEFAULT_CPU_WAIT_SCALE`` and ``DEFAULT_CPU_BLOCKED_WAIT_S``), not the one it carries.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HERE = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def worker(repo: str, out: str) -> None:
    """One sweep on the default process group with ``repo``'s package; rank 0 writes it to ``out``."""
    sys.path.insert(0, repo)
    import torch
    import torch.distributed as dist

    import autodist
    from autodist.measure.sweep import sweep

    if not os.path.abspath(autodist.__file__).startswith(os.path.join(os.path.abspath(repo), "")):
        raise SystemExit(f"sweepcheck: {repo} has no autodist package of its own (imported {autodist.__file__})")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = sweep(dist.group.WORLD, torch.device("cpu"))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            f.write(model.to_json())
    dist.destroy_process_group()


def measure(repo: str, out: str, nproc: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.abspath(__file__), "--worker", "--repo", repo, "--out", out]
    rc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL).returncode
    if rc != 0:
        raise SystemExit(f"sweepcheck: the sweep with {repo} failed (exit code {rc})")


def spreads(records: list[str], comm_texts: list[str]) -> dict[str, dict]:
    """Per simcheck record: each plan's predictions from every comm model, and their spread."""
    import torch

    from autodist.cost.comm import comm_model_of_another_checkout
    from autodist.cost.fidelity import DEFAULT_CPU_BLOCKED_WAIT_S, DEFAULT_CPU_WAIT_SCALE
    from autodist.cost.profile import Profile
    from autodist.lab.fidelity import sweep_spread
    from autodist.measure.fidelity import pct_apart, predictions_by_comm
    from autodist.plan import Plan
    from autodist.structure import discover
    from autodist.zoo import zoo

    models = []
    for text in comm_texts:
        # see the module docstring (--against): every sweep is compared at this checkout's
        # calibration, not the one it carries (an older sweep's was fitted to another simulator, or
        # it has none), so that what differs is what the sweeps measured
        try:
            models.append(comm_model_of_another_checkout(dict(json.loads(text), wait_scale=DEFAULT_CPU_WAIT_SCALE,
                                                              blocked_wait_s=DEFAULT_CPU_BLOCKED_WAIT_S)))
        except ValueError as e:
            raise SystemExit(f"sweepcheck: {e}") from None
    out = {}
    for path in records:
        with open(path) as f:
            rec = json.load(f)
        torch.manual_seed(0)
        structure = discover(zoo(rec.get("size", "default"))[rec["model"]].build())
        prof = Profile.from_json(json.dumps(rec["profile"]))
        plans = [Plan.from_json(json.dumps(p["plan_json"])) for p in rec["plans"]]
        by_plan = predictions_by_comm(prof, structure, models, plans, rec["world_size"])
        rows = [{"plan": p["plan"], "predicted_step_s_by_sweep": preds} for p, preds in zip(rec["plans"], by_plan)]
        spread = sweep_spread(rows) if len(models) > 1 else {"median_pct": 0.0, "max_pct": 0.0}
        name = rec["model"] + (f"-accum{rec['accum']}" if rec.get("accum", 1) > 1 else "")
        out[name] = {
            "median_pct_apart": spread["median_pct"], "max_pct_apart": spread["max_pct"],
            "plans": [{"plan": r["plan"], "predicted_step_s": r["predicted_step_s_by_sweep"],
                       "pct_apart": pct_apart(r["predicted_step_s_by_sweep"])} for r in rows],
        }
    return out


def fit_figures(text: str) -> dict:
    """One sweep's own figures: its seconds, and per op the largest relative distance of a sample
    from the op's fit, in %."""
    from autodist.cost.comm import comm_model_of_another_checkout

    model = comm_model_of_another_checkout(json.loads(text))
    worst = {op: 100 * max(abs(om(x) - t) / t for x, t in om.samples) for op, om in model.ops.items()}
    return {"sweep_seconds": model.meta.get("sweep_seconds"), "worst_fit_pct": worst}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="*", help="simcheck JSONs (default: benchmarks/simcheck-*.json)")
    ap.add_argument("--sweeps", type=int, default=4, help="sweeps per checkout (default 4)")
    ap.add_argument("--against", default=None, help="another checkout whose sweep is compared, alternating")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--repo", default=HERE, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.repo, args.out)
        return 0
    records = args.records or sorted(glob.glob(os.path.join(HERE, "benchmarks", "simcheck-*.json")))
    repos = {"this": HERE, **({"against": os.path.abspath(args.against)} if args.against else {})}
    texts: dict[str, list[str]] = {k: [] for k in repos}
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.sweeps):
            for name, repo in repos.items():
                path = os.path.join(d, f"{name}{i}.json")
                measure(repo, path, args.nproc)
                with open(path) as f:
                    texts[name].append(f.read())
                print(f"[sweepcheck] sweep {i + 1}/{args.sweeps} ({name}) done", file=sys.stderr, flush=True)
    payload = {"sweeps": args.sweeps, "checkouts": repos,
               "by_checkout": {name: spreads(records, t) for name, t in texts.items()},
               "fit": {name: [fit_figures(t) for t in ts] for name, ts in texts.items()},
               "comm_models": {name: [json.loads(t) for t in ts] for name, ts in texts.items()}}
    print(table(payload))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


def table(payload: dict) -> str:
    result = payload["by_checkout"]
    lines = [f"each plan's predictions from {payload['sweeps']} sweeps: % apart, median / largest over the model's plans",
             f"  {'model':<16}" + "".join(f"{name:>19}" for name in result)]
    for model in result["this"]:
        cells = "".join(f"{result[n][model]['median_pct_apart']:>11.1f} / {result[n][model]['max_pct_apart']:>5.1f}" for n in result)
        lines.append(f"  {model:<16}{cells}")
    fits = payload.get("fit", {})
    if fits:
        ops = sorted({op for figures in fits.values() for f in figures for op in f["worst_fit_pct"]})
        lines.append("each sweep: seconds, and the furthest sample from its op's fit (%)")
        lines.append(f"  {'sweep':<16}{'seconds':>9}" + "".join(f"{op:>16}" for op in ops))
        for name, figures in fits.items():
            for i, f in enumerate(figures):
                seconds = "-" if f["sweep_seconds"] is None else f"{f['sweep_seconds']:.1f}"
                cells = "".join(f"{f['worst_fit_pct'].get(op, float('nan')):>16.1f}" for op in ops)
                lines.append(f"  {name + ' ' + str(i + 1):<16}{seconds:>9}{cells}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
