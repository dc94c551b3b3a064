"""How well does the simulator predict real steps? Predicted vs measured for many plans.

    python tools/simcheck.py --model gpt --plans 12 --json simcheck-gpt.json

On 2 CPU ranks (re-launched under torchrun), for the model: profile it, sweep the comm model, then
for each plan — the built-in ddp/fsdp/zero2 plans, random valid plans (seeded; they include
recomputed blocks and, with ``--accum N``, accumulation choices), and the plans the search picks
under no budget and under two tighter ones (``--searched``) — predict step time and peak memory with
the simulator and measure them (``--accum N``: steps of N micro-batches, the first N-1 under
``no_sync``): the median step time over ``--steps``
steps (the slowest rank's time per step) and the peak tensor memory of one more step (the slowest
rank's). Reports each plan, Spearman's rank correlation of predicted and measured step times, and
the median absolute percentage error of time and of peak memory, as a table and (``--json``) as JSON
with keys ``spearman``, ``median_abs_pct_error_time``, ``median_abs_pct_error_peak``, ``plans``.
``--trace-dir`` also writes, per plan, the simulated and the measured step as Chrome traces and PNGs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _launch import max_over_ranks, run_tool  # noqa: E402

from autodist import AutoDist  # noqa: E402
from autodist.cost.budget import format_bytes  # noqa: E402
from autodist.cost.profile import Profile, slowest  # noqa: E402
from autodist.cost.simulator import Simulator  # noqa: E402
from autodist.measure.memory import measure_step_peak  # noqa: E402
from autodist.measure.sweep import sweep  # noqa: E402
from autodist.measure.trace import profile_model  # noqa: E402
from autodist.sched.search import SearchConfig, Searcher  # noqa: E402
from autodist.sched.space import space_for  # noqa: E402
from autodist.structure import discover  # noqa: E402
from autodist.zoo import zoo  # noqa: E402


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def worker(args: argparse.Namespace) -> None:
    import faulthandler

    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    wl = zoo(args.size)[args.model]
    per_rank = (args.batch or wl.default_batch) * args.accum  # --accum N: N micro-batches of --batch
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [wl.batch(per_rank, gen) for _ in range(args.warmup + args.steps + 1)]

    torch.manual_seed(0)
    plain = wl.build()
    structure = discover(plain)
    x0, y0 = (t.chunk(args.accum)[0] for t in batches[0])
    prof = profile_model(plain, structure, (x0,), device=device, loss_fn=lambda out: wl.loss(out, y0))
    del plain
    profiles: list[str | None] = [None] * world
    dist.all_gather_object(profiles, prof.to_json())
    prof = slowest([Profile.from_json(p) for p in profiles])
    comm = sweep(dist.group.WORLD, device)

    space = space_for(prof, structure, world, grad_accum_steps=args.accum)
    genomes = [("ddp", space.ddp()), ("fsdp", space.fsdp()), ("zero2", space.zero2())]
    rng = random.Random(args.seed)
    seen = {g for _, g in genomes}
    tries = 0
    while len(genomes) < args.plans and tries < 1000:
        tries += 1
        g = space.random(rng)
        if g not in seen:
            seen.add(g)
            genomes.append((f"random{len(genomes) - 2}", g))
    sim = Simulator(prof, structure, comm, world_size=world)
    if args.searched:
        # the plans the search picks: without a budget, and under two tighter ones (between the
        # smallest peak the plan space reaches and the fastest plan's peak)
        free = Searcher(space, sim, SearchConfig()).run()
        floor = min(sim.run(space.to_plan(g)).peak_bytes for _, g in genomes)
        budgets = [None] + [int(floor + f * (free.result.peak_bytes - floor)) for f in (0.6, 0.2)]
        for b in budgets:
            tight = Simulator(prof, structure, comm, world_size=world, budget_bytes=b)
            found = free if b is None else Searcher(space, tight, SearchConfig()).run()
            if found.result.feasible and found.genome not in seen:
                seen.add(found.genome)
                genomes.append((f"searched@{'none' if b is None else format_bytes(b).replace(' ', '')}", found.genome))
    plans, preds, sim_ms = [], [], []
    for name, genome in genomes:
        plans.append(space.to_plan(genome, provenance={"source": f"simcheck:{name}"}))
        t0 = time.perf_counter()
        preds.append(sim.run(plans[-1], record=bool(args.trace_dir)))
        sim_ms.append((time.perf_counter() - t0) * 1e3)
    times: list[list[float]] = [[] for _ in genomes]
    peaks: list[int] = [0] * len(genomes)

    def measure(i: int, first: bool) -> None:
        """Time ``args.steps`` steps of plan ``i``; on the first pass also its peak (and trace)."""
        name, plan, pred = genomes[i][0], plans[i], preds[i]
        gc.collect()
        torch.manual_seed(0)
        model = AutoDist(wl.build(), plan=plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            n = args.accum
            for k, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n))):
                if k < n - 1:
                    with model.no_sync():
                        wl.loss(model(xm), ym).div(n).backward()
                else:
                    wl.loss(model(xm), ym).div(n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for x, y in batches[: args.warmup]:
            step(x, y)
        for x, y in batches[args.warmup : args.warmup + args.steps]:
            dist.barrier()
            t0 = time.perf_counter()
            step(x, y)
            times[i].append(max_over_ranks(time.perf_counter() - t0))
        xm, ym = batches[-1]
        if first and args.trace_dir:
            os.makedirs(args.trace_dir, exist_ok=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as p:
                step(xm, ym)
            if rank == 0:
                from autodist import timeline as tl

                p.export_chrome_trace(os.path.join(args.trace_dir, f"{name}.measured.trace.json"))
                measured_tl = tl.from_profiler_trace(os.path.join(args.trace_dir, f"{name}.measured.trace.json"), f"{name}: measured")
                sim_tl = tl.from_simulation(pred, f"{name}: simulated")
                tl.to_chrome_trace(sim_tl, os.path.join(args.trace_dir, f"{name}.simulated.trace.json"))
                tl.to_png(sim_tl, os.path.join(args.trace_dir, f"{name}.simulated.png"))
                tl.to_png(measured_tl, os.path.join(args.trace_dir, f"{name}.measured.png"))
        if first:

            def live() -> list[torch.Tensor]:
                held = list(model.runtime.held_tensors()) + [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
                return held + [p.grad for p in model.parameters() if p.grad is not None] + [xm, ym]

            peaks[i] = int(max_over_ranks(measure_step_peak(lambda: step(xm, ym), device, live)))
        model.close()

    # Passes alternate the order of the plans, so a slow drift of the host touches every plan alike.
    for p in range(args.passes):
        for i in range(len(genomes)) if p % 2 == 0 else reversed(range(len(genomes))):
            measure(i, first=p == 0)
            if rank == 0 and p == args.passes - 1:
                print(f"[simcheck] {args.model} {genomes[i][0]}: predicted {preds[i].step_s * 1e3:.1f} ms, measured "
                      f"{statistics.median(times[i]) * 1e3:.1f} ms", file=sys.stderr, flush=True)
    rows = [
        {
            "plan": name,
            "predicted_step_s": preds[i].step_s,
            "measured_step_s": statistics.median(times[i]),
            "predicted_peak_bytes": preds[i].peak_bytes,
            "measured_peak_bytes": peaks[i],
            "simulate_ms": sim_ms[i],
            "sharded_units": len(plans[i].sharded_units),
            "recomputed_blocks": len(plans[i].recompute),
            "searched": name.startswith("searched"),
            "gather_groups": len(plans[i].gather_groups),
            "buckets": len(plans[i].buckets),
        }
        for i, (name, _) in enumerate(genomes)
    ]
    if rank == 0:
        pt = [r["predicted_step_s"] for r in rows]
        mt = [r["measured_step_s"] for r in rows]
        def fidelity(sel: list[dict]) -> dict:
            if not sel:
                return {}
            p_, m_ = [r["predicted_step_s"] for r in sel], [r["measured_step_s"] for r in sel]
            return {
                "plans": len(sel),
                "spearman": spearman(p_, m_) if len(sel) > 2 else float("nan"),
                "median_abs_pct_error_time": 100 * statistics.median(abs(p - m) / m for p, m in zip(p_, m_)),
                "median_abs_pct_error_peak": 100 * statistics.median(
                    abs(r["predicted_peak_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"] for r in sel
                ),
            }

        payload = {
            "model": args.model,
            "world_size": world,
            "accum": args.accum,
            "spearman": spearman(pt, mt),
            "median_abs_pct_error_time": 100 * statistics.median(abs(p - m) / m for p, m in zip(pt, mt)),
            "median_abs_pct_error_peak": 100 * statistics.median(
                abs(r["predicted_peak_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"] for r in rows
            ),
            "random_and_builtin": fidelity([r for r in rows if not r["searched"]]),
            "searched": fidelity([r for r in rows if r["searched"]]),
            "plans": rows,
            "comm_model": json.loads(comm.to_json()),
            "profile_compute_s": prof.compute_s,
        }
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
    dist.destroy_process_group()


def table(payload: dict) -> str:
    accum = f", {payload['accum']} micro-batches per step" if payload.get("accum", 1) > 1 else ""
    lines = [f"{payload['model']}: {len(payload['plans'])} plans on {payload['world_size']} ranks{accum}"]
    lines.append(f"  {'plan':<18}{'pred ms':>10}{'meas ms':>10}{'err':>8}{'pred MiB':>11}{'meas MiB':>11}{'err':>8}")
    for r in payload["plans"]:
        et = (r["predicted_step_s"] - r["measured_step_s"]) / r["measured_step_s"]
        ep = (r["predicted_peak_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
        lines.append(
            f"  {r['plan']:<18}{r['predicted_step_s'] * 1e3:>10.1f}{r['measured_step_s'] * 1e3:>10.1f}{et:>+8.0%}"
            f"{r['predicted_peak_bytes'] / 2**20:>11.1f}{r['measured_peak_bytes'] / 2**20:>11.1f}{ep:>+8.0%}"
        )
    lines.append(
        f"  all plans: Spearman {payload['spearman']:.3f}   median |error| time {payload['median_abs_pct_error_time']:.1f}%"
        f"   peak {payload['median_abs_pct_error_peak']:.1f}%"
    )
    for key, what in (("random_and_builtin", "built-in and random"), ("searched", "searched")):
        f = payload.get(key) or {}
        if f:
            lines.append(
                f"  {what} ({f['plans']}): Spearman {f['spearman']:.3f}   median |error| time "
                f"{f['median_abs_pct_error_time']:.1f}%   peak {f['median_abs_pct_error_peak']:.1f}%"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, choices=list(zoo()))
    ap.add_argument("--plans", type=int, default=12, help="plans to run: 3 built-in + random (default 12)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--passes", type=int, default=2, help="passes over the plans, alternating order (default 2)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--size", default="default", choices=["default", "tiny"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches (of --batch each) per step (default 1)")
    ap.add_argument("--searched", action="store_true", help="also measure the plans the search picks (3 budgets)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    wargs = ["--model", args.model, "--plans", str(args.plans), "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--passes", str(args.passes), "--size", args.size, "--seed", str(args.seed),
             "--accum", str(args.accum)]
    if args.searched:
        wargs.append("--searched")
    if args.batch is not None:
        wargs += ["--batch", str(args.batch)]
    if args.trace_dir:
        wargs += ["--trace-dir", os.path.abspath(args.trace_dir)]
    return run_tool(__file__, args.nproc, wargs, table, args.json)


if __name__ == "__main__":
    sys.exit(main())
