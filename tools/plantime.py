"""How long planning takes: the search on models of many units, and what a cache hit adds to start-up.

    python tools/plantime.py            # 2 CPU ranks

1. Search time: profile an MLP of N layers (N = 50, 100, 200, 400, 800 units; ``--units``) on one
   rank, time one simulation of each seed plan (median of 20; 5 from 400 units; wall clock and the
   process's CPU time), then run the same
   search ``plan="auto"`` runs (seeds, greedy passes, backtracking) against the measured comm model
   on one core; reports seconds (wall clock, which the search's 10 s budget counts, and the
   process's CPU time, which a loaded machine does not inflate), plans evaluated, simulations per
   second, why the search stopped and whether it converged (``converged``: no time limit cut it,
   neither the budget nor the greedy passes' shares of it). The host's load average is recorded
   beside the figures.
2. Start-up: wrapping the GPT workload with ``plan="ddp"`` vs ``plan="auto"`` when the cache already
   holds its plan (median of 3 wraps each); the difference is what a cache hit costs.
3. ``--cold-start``: instead of 1 and 2, the first launch on a machine with an empty cache (and no
   seed of comm models): the seconds from ``AutoDist(gpt, plan="auto", example_inputs=...)`` to the
   end of its first training step, and rank 0's ``autodist`` log lines with the seconds at which
   each appeared; then where the time went, from the profile's and the comm model's records of
   their own measurement (profile passes and contended rounds, the sweep's timings, contention
   rounds and the rest, the search) with the rounds each took (load-independent evidence). With ``--json`` the
   figures go under ``"cold_start"`` in that file, whose other figures (from an earlier run of 1
   and 2) are kept, as a run of 1 and 2 keeps its ``"cold_start"``.
   ``--no-example-inputs``: the same first launch as most scripts make it, without example inputs:
   training starts at once on the safe plan while its first steps are profiled, then the comm model
   and the search run between two steps and the searched plan takes over. Reports when the first
   step was done, how many steps the safe plan trained, and when the first step under the searched
   plan was done; the figures go under ``"cold_start_no_example_inputs"``.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _launch import relaunch  # noqa: E402

from autodist import AutoDist  # noqa: E402
from autodist.cost.simulator import Simulator  # noqa: E402
from autodist.measure.sweep import sweep  # noqa: E402
from autodist.measure.trace import profile_model  # noqa: E402
from autodist.sched.search import SearchConfig, Searcher  # noqa: E402
from autodist.sched.space import PlanSpace  # noqa: E402
from autodist.structure import discover  # noqa: E402
from autodist.zoo import MLP, zoo  # noqa: E402

UNITS = (50, 100, 200, 400, 800)


def worker(json_path: str | None = None, units: tuple[int, ...] = UNITS) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    comm = sweep(dist.group.WORLD, torch.device("cpu"))
    lines = []
    figures: dict[str, object] = {"world_size": dist.get_world_size(), "torch": torch.__version__,
                                  "load_average_1min_at_start": os.getloadavg()[0], "units": {}}
    for n in units:
        model = MLP([64] * (n + 1))
        structure = discover(model)
        prof = profile_model(model, structure, (torch.randn(16, 64),), device=torch.device("cpu"), repeats=1, memory=False)
        if rank == 0:
            sim = Simulator(prof, structure, comm, world_size=dist.get_world_size())
            space = PlanSpace(structure, dist.get_world_size(), [u.name for u in prof.units], prof.ready_order,
                              state_names=prof.optimizer.state_names)
            sim_ms, sim_cpu_ms = {}, {}
            for seed in ("ddp", "fsdp", "zero2"):
                plan = space.to_plan(getattr(space, seed)())
                runs, cpu_runs = [], []
                for _ in range(20 if n < 400 else 5):
                    t0, c0 = time.perf_counter(), time.process_time()
                    sim.run(plan)
                    runs.append(time.perf_counter() - t0)
                    cpu_runs.append(time.process_time() - c0)
                sim_ms[seed] = 1e3 * statistics.median(runs)
                sim_cpu_ms[seed] = 1e3 * statistics.median(cpu_runs)
            lines.append(f"simulate one plan, {n} units: " + ", ".join(f"{k} {v:.2f} ms ({sim_cpu_ms[k]:.2f} CPU)" for k, v in sim_ms.items()))
            searcher = Searcher(space, sim, SearchConfig())
            t0, c0 = time.perf_counter(), time.process_time()
            res = searcher.run()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            converged = not searcher.time_limited
            figures["units"][n] = {"simulate_ms": sim_ms, "simulate_cpu_ms": sim_cpu_ms, "search_s": wall, "search_cpu_s": cpu,
                                   "evaluated": res.evaluated, "simulations_per_s": res.evaluated / wall,
                                   "stopped_by": res.stopped_by, "converged": converged}
            lines.append(
                f"search, {n} units: {wall:.2f} s ({cpu:.2f} s CPU), {res.evaluated} plans evaluated "
                f"({res.evaluated / wall:.0f}/s), stopped by {res.stopped_by}: "
                + ("converged" if converged else "cut by the time budget")
            )
    wl = zoo()["gpt"]
    x, _ = wl.batch(wl.default_batch, torch.Generator().manual_seed(rank))
    with tempfile.TemporaryDirectory() as d:
        d = [d]
        dist.broadcast_object_list(d)
        torch.manual_seed(0)
        AutoDist(wl.build(), plan="auto", example_inputs=(x,), cache_dir=d[0]).close()  # fills the cache
        timings = {"ddp": [], "auto (cache hit)": []}
        for _ in range(3):
            for name in timings:
                model = wl.build()
                dist.barrier()
                t0 = time.perf_counter()
                if name == "ddp":
                    m = AutoDist(model, plan="ddp")
                else:
                    m = AutoDist(model, plan="auto", example_inputs=(x,), cache_dir=d[0])
                timings[name].append(time.perf_counter() - t0)
                m.close()
    if rank == 0:
        med = {k: statistics.median(v) for k, v in timings.items()}
        lines.append(
            f"wrap gpt: plan='ddp' {med['ddp']:.3f} s, plan='auto' with a cache hit {med['auto (cache hit)']:.3f} s; "
            f"a cache hit adds {med['auto (cache hit)'] - med['ddp']:.3f} s"
        )
        print("\n".join(lines), flush=True)
        if json_path:
            figures["wrap_gpt_s"] = med
            if os.path.exists(json_path):  # cold starts measured before (--cold-start) are kept
                with open(json_path) as f:
                    before = json.load(f)
                for kind in ("cold_start", "cold_start_no_example_inputs"):
                    if kind in before:
                        figures[kind] = before[kind]
            with open(json_path, "w") as f:
                json.dump(figures, f, indent=1)
    dist.destroy_process_group()


COLD_START_MAX_STEPS = 40  # without example inputs: steps trained at the most, waiting for the searched plan


def cold_start(json_path: str | None = None, example_inputs: bool = True) -> None:
    """One cold start of the zoo's gpt under ``plan="auto"`` (see the module's docstring, 3)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    wl = zoo()["gpt"]
    x, y = wl.batch(wl.default_batch, torch.Generator().manual_seed(rank))
    lines: list[tuple[float, str]] = []
    t0 = [0.0]

    class Timeline(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append((time.perf_counter() - t0[0], record.getMessage()))

    log = logging.getLogger("autodist")
    log.setLevel(logging.INFO)
    log.addHandler(Timeline())
    with tempfile.TemporaryDirectory() as d:
        box = [d]
        dist.broadcast_object_list(box)
        torch.manual_seed(0)
        model = wl.build()
        load = os.getloadavg()[0]
        dist.barrier()
        t0[0], cpu0 = time.perf_counter(), time.process_time()
        m = AutoDist(model, plan="auto", cache_dir=box[0], **({"example_inputs": (x,)} if example_inputs else {}))
        wrapped = time.perf_counter() - t0[0]
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        step_done: list[float] = []  # the seconds at which each step was done
        searched_at = None  # the step (from 0) that first ran under the searched plan
        while len(step_done) < (1 if example_inputs else COLD_START_MAX_STEPS):
            wl.loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
            step_done.append(time.perf_counter() - t0[0])
            if m._auto is not None and m._auto.stats.source == "search":
                searched_at = len(step_done) - 1
                break
        first_step, cpu_s = step_done[0], time.process_time() - cpu0
        search_s = m._auto.stats.search_seconds if m._auto is not None else 0.0
        m.close()
        stored = {}  # what the profile and the sweep took: their own records of it
        for kind in ("profiles", "comm"):
            for path in sorted(glob.glob(os.path.join(box[0], kind, "*.json"))):
                with open(path) as f:
                    meta = json.load(f).get("meta", {})
                stored[kind] = {k: v for k, v in meta.items() if k not in ("contention_measured", "measured")}
    dist.barrier()
    if rank == 0:
        for t, msg in lines:
            print(f"{t:7.1f} s  {msg}", flush=True)
        for kind, meta in stored.items():
            print(f"{kind}: {json.dumps(meta)}", flush=True)
        parts = breakdown(stored.get("profiles", {}), stored.get("comm", {}), search_s)
        print("where the time went: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items() if isinstance(v, float))
              + f"; contention rounds: profile {parts['profile_contention_rounds']}, sweep "
              f"{parts['sweep_contention_rounds']} (of {parts['sweep_contention_rounds_range']})", flush=True)
        searched = ("" if example_inputs else
                    f"; {searched_at} steps on the safe plan, the first step under the searched plan done at "
                    f"{step_done[searched_at]:.1f} s" if searched_at is not None else
                    f"; no searched plan in force after {len(step_done)} steps")
        print(f"cold start of gpt on {dist.get_world_size()} ranks{'' if example_inputs else ' without example inputs'}: "
              f"wrapped in {wrapped:.1f} s, first step done at {first_step:.1f} s{searched} (load average {load:.2f} at "
              f"the start, {os.getloadavg()[0]:.2f} at the end); rank 0's process took {cpu_s:.1f} s of CPU time (its "
              "threads together: what a loaded host does not inflate)", flush=True)
        if json_path:
            figures: dict[str, object] = {}
            if os.path.exists(json_path):
                with open(json_path) as f:
                    figures = json.load(f)
            figures["cold_start" if example_inputs else "cold_start_no_example_inputs"] = {
                "model": "gpt", "world_size": dist.get_world_size(), "torch": torch.__version__,
                "load_average_1min_at_start": load, "wrap_s": wrapped, "first_step_s": first_step,
                **({} if example_inputs else {
                    "steps_done_s": [round(t, 3) for t in step_done], "safe_plan_steps": searched_at,
                    "searched_first_step_s": step_done[searched_at] if searched_at is not None else None}),
                "load_average_1min_at_end": os.getloadavg()[0], "rank0_cpu_s": cpu_s,
                "log": [[round(t, 2), msg] for t, msg in lines], "profile_meta": stored.get("profiles"),
                "comm_meta": stored.get("comm"), "breakdown": parts,
            }
            with open(json_path, "w") as f:
                json.dump(figures, f, indent=1)
    dist.destroy_process_group()


def breakdown(profile: dict, comm: dict, search_s: float) -> dict[str, object]:
    """Where a cold start's seconds went, from the profile's and the comm model's own records of
    their measurement (their ``meta``) and the search's seconds: the profile's passes and contended
    rounds, the sweep's timed samples, contention rounds and the rest (its first-touch, transient
    and runtime-overhead figures), the search; and the rounds each took."""
    phases = comm.get("phases_s", {})
    sweep_s = float(comm.get("sweep_seconds", 0.0))
    rounds = comm.get("contention_rounds", [])
    return {
        "profile_passes": float(profile.get("passes_seconds", 0.0)),
        "profile_contention": float(profile.get("contention_seconds", 0.0)),
        "sweep_timings": float(phases.get("timings", 0.0)),
        "sweep_contention": float(phases.get("contention", 0.0)),
        "sweep_other": max(0.0, sweep_s - float(phases.get("timings", 0.0)) - float(phases.get("contention", 0.0))),
        "search": float(search_s),
        "profile_contention_rounds": profile.get("contention_rounds"),
        "sweep_contention_rounds": sum(rounds) if isinstance(rounds, list) else rounds,
        "sweep_contention_rounds_range": f"{comm.get('contention_rounds_fewest')}-{comm.get('contention_rounds_most')}",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--json", help="also write the figures as JSON here")
    ap.add_argument("--units", default=",".join(map(str, UNITS)), help="model sizes (units), comma-separated")
    ap.add_argument("--cold-start", action="store_true",
                    help="time the first plan='auto' launch of gpt on an empty cache instead (see the docstring, 3)")
    ap.add_argument("--no-example-inputs", action="store_true",
                    help="with --cold-start: wrap without example inputs (the safe plan trains while the first steps "
                         "are profiled) and train until the searched plan is in force")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.no_example_inputs and not args.cold_start:
        ap.error("--no-example-inputs is an option of --cold-start: add --cold-start, or drop it")
    return args


def main() -> int:
    args = parse_args()
    units = tuple(int(u) for u in args.units.split(","))
    if args.worker:
        if args.cold_start:
            cold_start(args.json, example_inputs=not args.no_example_inputs)
        else:
            worker(args.json, units)
        return 0
    if args.cold_start:
        os.environ.pop("AUTODIST_COMM_SEED", None)  # an empty cache and nothing to start from
    return relaunch(os.path.abspath(__file__), args.nproc,
                    ["--worker", "--units", args.units, *(["--cold-start"] if args.cold_start else []),
                     *(["--no-example-inputs"] if args.no_example_inputs else []),
                     *(["--json", os.path.abspath(args.json)] if args.json else [])])


if __name__ == "__main__":
    sys.exit(main())
