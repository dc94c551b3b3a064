"""How long planning takes: the search on models of many units, and what a cache hit adds to start-up.

    python tools/plantime.py            # 2 CPU ranks

1. Search time: profile an MLP of N layers (N = 50, 100, 200 units) on one rank, time one
   simulation of each seed plan (median of 20), then run the same search ``plan="auto"`` runs
   (seeds, greedy passes, backtracking) against the measured comm model; reports seconds, plans
   evaluated and why the search stopped.
2. Start-up: wrapping the GPT workload with ``plan="ddp"`` vs ``plan="auto"`` when the cache already
   holds its plan (median of 3 wraps each); the difference is what a cache hit costs.
"""

from __future__ import annotations

import argparse
import json
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


def worker(json_path: str | None = None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    comm = sweep(dist.group.WORLD, torch.device("cpu"))
    lines = []
    figures: dict[str, object] = {"world_size": dist.get_world_size(), "torch": torch.__version__, "units": {}}
    for n in (50, 100, 200):
        model = MLP([64] * (n + 1))
        structure = discover(model)
        prof = profile_model(model, structure, (torch.randn(16, 64),), device=torch.device("cpu"), repeats=1, memory=False)
        if rank == 0:
            sim = Simulator(prof, structure, comm, world_size=dist.get_world_size())
            space = PlanSpace(structure, dist.get_world_size(), [u.name for u in prof.units], prof.ready_order,
                              state_names=prof.optimizer.state_names)
            sim_ms = {}
            for seed in ("ddp", "fsdp", "zero2"):
                plan = space.to_plan(getattr(space, seed)())
                runs = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    sim.run(plan)
                    runs.append(time.perf_counter() - t0)
                sim_ms[seed] = 1e3 * statistics.median(runs)
            lines.append(f"simulate one plan, {n} units: " + ", ".join(f"{k} {v:.2f} ms" for k, v in sim_ms.items()))
            t0 = time.perf_counter()
            res = Searcher(space, sim, SearchConfig()).run()
            figures["units"][n] = {"simulate_ms": sim_ms, "search_s": time.perf_counter() - t0,
                                   "evaluated": res.evaluated, "stopped_by": res.stopped_by}
            lines.append(
                f"search, {n} units: {time.perf_counter() - t0:.2f} s, {res.evaluated} plans evaluated, "
                f"stopped by {res.stopped_by}"
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
            with open(json_path, "w") as f:
                json.dump(figures, f, indent=1)
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--json", help="also write the figures as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args.json)
        return 0
    return relaunch(os.path.abspath(__file__), args.nproc, ["--worker", *(["--json", os.path.abspath(args.json)] if args.json else [])])


if __name__ == "__main__":
    sys.exit(main())
