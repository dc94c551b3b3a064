"""The same ``autodist plan`` command, run again: do its prediction and its plan hold?

    python tools/plantwice.py --json benchmarks/plantwice.json
    python tools/plantwice.py --runs 4 --memory-limit none --memory-limit 150MiB -- \
        --model autodist.zoo:gpt --input-shape 8,128 --input-dtype int64 --input-high 8192 \
        --world-size 2 --interconnect eth-10g

For each memory limit, the command (the arguments after ``--``) runs ``--runs`` times with
``--reprofile`` (each run measures the model again: the noise of a profile is what moves the
prediction) and once more without it (the profile cached by the last run: the prediction must be
that run's exactly, [Note: planning twice] in autodist/cli.py). Each run is a process of its own,
as a user's would be, in a cache directory of this tool's. Reported per limit: every run's
predicted step and peak, how far apart the predictions are (the largest over the smallest, less
one), whether every run chose the same plan (the plan files equal but for the prediction, the
provenance and a default budget read from the free memory), and, where they differ, how far apart
each run's prediction of its own plan and of the other's are (the plans the search told apart by
less than the noise between runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DEFAULT_COMMAND = [
    "--model", "autodist.zoo:gpt", "--input-shape", "8,128", "--input-dtype", "int64", "--input-high", "8192",
    "--world-size", "2", "--interconnect", "eth-10g",
]
VOLATILE = ("predicted", "provenance", "budget_bytes")  # what may differ between runs of one plan


def _run(command: list[str], out: str, cache: str, *, reprofile: bool) -> dict:
    argv = [sys.executable, "-m", "autodist.cli", "plan", *command, "--cache-dir", cache, "--out", out]
    if reprofile:
        argv.append("--reprofile")
    done = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed:\n{done.stdout}{done.stderr}")
    with open(out) as f:
        plan = json.load(f)
    return {"plan": plan, "said": done.stdout.strip().splitlines()[-1]}


def _decisions(plan: dict) -> dict:
    return {k: v for k, v in plan.items() if k not in VOLATILE}


def _cross(command: list[str], plans: list[str], cache: str) -> list[float]:
    """Each plan's predicted step under the profile cached last (the same measurement for all)."""
    from autodist.cli import _build_model, _comm_model, _example_input, _profile, build_parser
    from autodist.cost.simulator import Simulator
    from autodist.plan import load_plan
    from autodist.structure import discover

    args = build_parser().parse_args(["plan", *command, "--cache-dir", cache, "--out", os.devnull])
    comm, _ = _comm_model(args, args.world_size)
    model = _build_model(args.model)
    x = _example_input(model, args)
    profile, _ = _profile(args, model, x)
    sim = Simulator(profile, discover(model), comm, world_size=args.world_size)
    return [sim.run(load_plan(p)).step_s for p in plans]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs with --reprofile per memory limit (default 3)")
    ap.add_argument("--memory-limit", action="append", default=None,
                    help="a budget to plan under ('none': the command's default); repeatable (default: none, 150MiB)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("command", nargs="*", help="the `autodist plan` arguments (after --; default: the gpt zoo model)")
    return ap.parse_args(argv)


def main() -> None:
    a = parse_args()
    command = a.command or DEFAULT_COMMAND
    limits = a.memory_limit or ["none", "150MiB"]
    report: dict = {"command": command, "runs": a.runs, "limits": {}}
    with tempfile.TemporaryDirectory(prefix="autodist-plantwice-") as tmp:
        cache = os.path.join(tmp, "cache")
        for limit in limits:
            cmd = command + ([] if limit == "none" else ["--memory-limit", limit])
            paths = [os.path.join(tmp, f"{limit}-{i}.json") for i in range(a.runs + 1)]
            try:
                runs = [_run(cmd, p, cache, reprofile=i < a.runs) for i, p in enumerate(paths)]
            except RuntimeError as e:  # a budget nothing fits, say: reported, and the next limit planned
                report["limits"][limit] = {"failed": str(e)}
                print(f"{limit}: {str(e).splitlines()[-1]}")
                continue
            steps = [r["plan"]["predicted"]["step_seconds"] for r in runs]
            distinct: list[int] = []  # the first run of each distinct plan
            for i, r in enumerate(runs):
                if not any(_decisions(runs[j]["plan"]) == _decisions(r["plan"]) for j in distinct):
                    distinct.append(i)
            entry = {
                "predicted_step_s": steps[: a.runs],
                "predicted_peak_bytes": [r["plan"]["predicted"]["peak_bytes"] for r in runs[: a.runs]],
                "spread": max(steps[: a.runs]) / min(steps[: a.runs]) - 1,
                "same_plan": len(distinct) == 1,
                "cached_rerun_step_s": steps[-1],
                "cached_rerun_equals_last": _decisions(runs[-1]["plan"]) == _decisions(runs[-2]["plan"]) and steps[-1] == steps[-2],
                "said": [r["said"] for r in runs],
            }
            if len(distinct) > 1:  # the distinct plans, all predicted with the last run's profile
                entry["distinct_plans_under_one_profile_s"] = _cross(cmd, [paths[i] for i in distinct], cache)
            report["limits"][limit] = entry
            print(f"{limit}: predicted " + ", ".join(f"{s * 1e3:.2f}" for s in steps[: a.runs])
                  + f" ms ({entry['spread']:.1%} apart), {'the same plan' if entry['same_plan'] else f'{len(distinct)} plans'}"
                  + f"; again from the cached profile: {steps[-1] * 1e3:.2f} ms"
                  + (" (the last run's)" if entry["cached_rerun_equals_last"] else " (NOT the last run's)"))
            if len(distinct) > 1:
                print("  the distinct plans under the last profile: "
                      + ", ".join(f"{s * 1e3:.2f} ms" for s in entry["distinct_plans_under_one_profile_s"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
