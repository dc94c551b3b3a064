"""Collect measured timelines of many plans, aligned with the simulator's events: the learned
estimator's training data (``autodist/lab/learned.py``; train and evaluate it with
``tools/train_estimator.py``).

    python tools/collect_timelines.py --out timelines.jsonl                       # every zoo model
    python tools/collect_timelines.py --models gpt,deep-mlp --plans 20 --size tiny --out t.jsonl

On 2 CPU ranks (re-launched under torchrun), per zoo model: profile it (the slowest rank's
profile), sweep the comm model once, then for each plan — the built-in ddp/fsdp/zero2 plans,
random valid plans (``PlanSpace.random``, seeded) and, unless ``--no-searched``, the plans the
search picks without a budget and under two tighter ones — wrap the model under the plan, run
``--warmup`` steps and ``--steps`` measured steps with ``autodist.lab.steptrace.StepTracer``
(every section of the compute thread in wall-clock time minus collective waits, every collective
from when it could start to its completion), and write one JSON line per plan: the simulator's
events for the plan (same names as the simulator's program: ``"fwd <unit>"``, ``"all_gather
<unit>"``, ``"reduce_scatter bucket3"``, ...), each with its analytic start, end and duration and
its measured duration (the mean over steps and ranks: [Note: an event's duration is its mean]),
and the measured step time (the median over steps of the slowest rank's, as ``tools/simcheck.py``
measures it). A line per model first holds what recompiles the plans: the profile, the comm
model and the workload's name and size. Lines are appended as plans finish, so an interrupted run
keeps what it measured.

``--breakdown`` reads a collected dataset instead of collecting (no ranks): per plan, the simulated,
measured and thread-CPU seconds of each kind of event added up (compute sections by kind, the
collectives by kind), the compute thread's busy time and the collectives' beside the measured
step — where the simulator's time goes wrong, and whether compute and communication overlapped
(a step near the sum of the two did not):

    python tools/collect_timelines.py --breakdown --out timelines.jsonl --json breakdown.json

A busy host stretches every event of a plan (the cores are shared): a fixed computation is timed
before and after each plan (``host_probe``); a plan measured while it ran more than 25% slower than
its fastest is measured again after waiting for quiet (at most ``--quiet-wait`` seconds), and
flagged ``disturbed`` if it still was.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from typing import TextIO

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _launch import report, run_tool  # noqa: E402

from autodist import AutoDist  # noqa: E402
from autodist.cost.comm import CommModel  # noqa: E402
from autodist.cost.simulator import Simulator  # noqa: E402
from autodist.lab.graph import collective_name, graph_of  # noqa: E402
from autodist.lab.steptrace import StepTracer  # noqa: E402
from autodist.measure.fidelity import max_over_ranks, optimizer_for, plans_to_check, slowest_over_ranks  # noqa: E402
from autodist.measure.sweep import collective_train, sweep  # noqa: E402
from autodist.measure.trace import profile_model  # noqa: E402
from autodist.plan import Plan  # noqa: E402
from autodist.sched.space import Genome, space_for  # noqa: E402
from autodist.structure import discover  # noqa: E402
from autodist.zoo import zoo  # noqa: E402


def plans_for(space, sim: Simulator, n_random: int, seed: int, searched: bool) -> list[tuple[str, str, Genome]]:
    """(name, source, genome): the plans ``autodist check`` measures
    (:func:`autodist.measure.fidelity.plans_to_check`): the built-in plans, ``n_random`` random
    ones, the searched ones."""
    checks = plans_to_check(space, sim, 3 + n_random, seed=seed, searched=searched)
    return [
        (name, "searched" if was_searched else "builtin" if name in ("ddp", "fsdp", "zero2") else "random", g)
        for name, g, was_searched in checks
    ]


def probe() -> float:
    """How long a fixed computation takes on the slowest rank now (a busy host makes it slower)."""
    x = torch.full((256, 256), 0.5)
    t0 = time.perf_counter()
    for _ in range(60):  # ~30 ms on one core here
        x = (x @ x).clamp_(-1, 1)
    return max_over_ranks(time.perf_counter() - t0)


def quiet(baseline: float, *, max_wait_s: float, tolerance: float = 1.25, wait_s: float = 10.0) -> float:
    """Wait (up to ``max_wait_s``, probing every ``wait_s``) until the probe is within
    ``tolerance`` of ``baseline``; return the last probe. Every rank decides alike (the probe is
    the slowest rank's)."""
    p = probe()
    for _ in range(int(max_wait_s // wait_s)):
        if p <= tolerance * baseline:
            break
        time.sleep(wait_s)
        p = probe()
    return p


def measure_plan(wl, plan, structure, batches, warmup: int) -> tuple[list[dict], list[float]]:
    """Run ``plan``: per measured step this rank's sections and collectives (by event name), and
    the steps' times (the slowest rank's)."""
    gc.collect()
    torch.manual_seed(0)
    model = AutoDist(wl.build(), plan=plan)
    opt = optimizer_for(list(model.parameters()))
    tracer = StepTracer(model.module, structure, model.runtime.comm.stats)
    steps: list[dict] = []
    times: list[float] = []
    try:
        for k, (x, y) in enumerate(batches):
            dist.barrier()
            t0 = time.perf_counter()
            tracer.begin()
            loss = wl.loss(model(x), y)
            tracer.forward_end(loss)
            loss.backward()
            tracer.optimizer_start()
            opt.step()
            tracer.optimizer_end()
            opt.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - t0
            m = tracer.finish()
            slowest_step = max_over_ranks(elapsed)
            if k < warmup:
                continue
            times.append(slowest_step)
            durations = dict(m.sections)
            durations.update({collective_name(*key): v for key, v in m.collectives.items()})
            steps.append({"durations": durations, "thread": m.thread, "waits_s": m.waits_s})
    finally:
        tracer.close()
        model.close()
    return steps, times


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    comm = sweep(dist.group.WORLD, torch.device("cpu"))
    models = collect(args, comm, args.dataset)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"out": args.dataset, "models": models, "world_size": dist.get_world_size()}, f, indent=1)
    dist.destroy_process_group()


def collect(args: argparse.Namespace, comm: CommModel, dataset: str) -> dict[str, dict]:
    """On every rank of the default (gloo, CPU) process group: measure ``args.models``' plans and
    append their records to ``dataset`` (rank 0 writes), timing them with ``comm``. Returns per
    model the plans measured, those that failed and the seconds it took."""
    summary: dict[str, dict] = {}
    out = open(dataset, "a") if dist.get_rank() == 0 else None
    try:
        for name in args.models.split(","):
            t_model = time.perf_counter()
            plans, errors = collect_model(name, args, comm, out)
            summary[name] = {"plans": plans, "errors": errors, "seconds": time.perf_counter() - t_model}
    finally:
        if out is not None:
            out.close()
    return summary


def collect_model(name: str, args: argparse.Namespace, comm: CommModel, out: TextIO | None) -> tuple[int, list[str]]:
    """One zoo model: its model record, then a record per plan written to ``out`` (rank 0's; None
    on the others). Returns the number of plans measured and the failures."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    wl = zoo(args.size)[name]
    per_rank = args.batch or wl.default_batch
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [wl.batch(per_rank, gen) for _ in range(args.warmup + args.steps)]
    torch.manual_seed(0)
    plain = wl.build()
    structure = discover(plain)
    x0, y0 = batches[0]
    prof = profile_model(
        plain, structure, (x0,), device=device, loss_fn=lambda out, y0=y0, wl=wl: wl.loss(out, y0), optimizer=optimizer_for,
        contention=collective_train(dist.group.WORLD, device),
    )
    del plain
    prof = slowest_over_ranks(prof)
    sim = Simulator(prof, structure, comm, world_size=world)
    space = space_for(prof, structure, world)
    genomes = plans_for(space, sim, args.plans, args.seed, not args.no_searched)
    if out is not None:
        out.write(json.dumps({
            "record": "model", "model": name, "size": args.size, "batch": per_rank, "world_size": world,
            "profile": json.loads(prof.to_json()), "comm": json.loads(comm.to_json()),
            "collected": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
        }) + "\n")
        out.flush()
    errors = []
    baseline = min(probe() for _ in range(3))
    for plan_name, source, genome in genomes:
        t_plan = time.perf_counter()
        plan = space.to_plan(genome, provenance={"source": f"collect_timelines:{plan_name}"})
        # [Note: a busy host] another job on the cores stretches every event of a plan; a probe
        # before and after each plan detects it: wait for quiet, measure again once
        attempts = 0
        try:
            for _ in range(2):
                attempts += 1
                before = quiet(baseline, max_wait_s=args.quiet_wait)
                steps, times = measure_plan(wl, plan, structure, batches, args.warmup)
                after = probe()
                baseline = min(baseline, before, after)
                if max(before, after) <= 1.25 * baseline:
                    break
        except Exception as e:  # one plan failing must not lose the others
            errors.append(f"{plan_name}: {type(e).__name__}: {e}")
            continue
        everyone: list[object] = [None] * world
        dist.all_gather_object(everyone, steps)
        if out is None:
            continue
        record = plan_record(sim, plan, everyone, times)
        record.update({
            "model": name, "size": args.size, "plan_name": plan_name, "source": source,
            "seconds": time.perf_counter() - t_plan,
            "host_probe": {"baseline_s": baseline, "before_s": before, "after_s": after, "attempts": attempts},
            "disturbed": max(before, after) > 1.25 * baseline,
        })
        out.write(json.dumps(record) + "\n")
        out.flush()
        events = record["events"]
        print(f"[collect] {name} {plan_name}: measured {record['measured_step_s'] * 1e3:.1f} ms, predicted "
              f"{record['predicted_step_s'] * 1e3:.1f} ms, {sum('measured_s' in e for e in events)}/{len(events)} events measured, "
              f"{len(record['unmatched_measured'])} unmatched ({record['seconds']:.1f} s)"
              + (" [busy host]" if record["disturbed"] else ""), file=sys.stderr, flush=True)
    return len(genomes) - len(errors), errors


def plan_record(sim: Simulator, plan: Plan, everyone: list, times: list[float]) -> dict:
    """The record of one measured plan: the simulator's events for it, each with its analytic
    start, end and duration and its measured duration (the mean over ``everyone``'s steps: per
    rank, the steps ``measure_plan`` returned) with the means of the first and the second half of
    the steps apart (``halves_s``: how well the measurement repeats) and every rank's every step
    (``per_rank_s``), and the measured step time (median of ``times``, each kept in ``step_times_s``).

    [Note: an event's duration is its mean] A step on a shared host has a few slow events, and they
    are other events in each step. The median of each event leaves them all out, so the medians add
    up to a step shorter than those measured: the simulator timing each plan's medians gave steps
    3.6-16.9% shorter than the measured median step (the median per zoo model, 24-30 plans each);
    timing the means, it was within 1.8-4.0% of it (median absolute error per model). The means
    add up to the mean step, slow events included, and that is what a per-event estimator must
    predict for the step it times to be right."""
    program, analytic, graph = graph_of(sim, plan)
    samples: dict[str, list[float]] = {}
    halves: dict[str, tuple[list[float], list[float]]] = {}
    thread: dict[str, list[float]] = {}
    for rank_steps in everyone:
        for j, s in enumerate(rank_steps):
            for k, v in s["durations"].items():
                samples.setdefault(k, []).append(v)
                halves.setdefault(k, ([], []))[0 if j < len(rank_steps) // 2 else 1].append(v)
            for k, v in s["thread"].items():
                thread.setdefault(k, []).append(v)
    events = []
    for i, n in enumerate(graph.names):
        stream = "compute" if graph.op[i] < 0 else ("comm" if program.ops[graph.op[i]].stream == 0 else "copy")
        ev = {"name": n, "kind": graph.kinds[i], "stream": stream, "sim_start": graph.start_s[i],
              "sim_end": graph.end_s[i], "analytic_s": float(graph.analytic_s[i])}
        if n in samples:
            ev["measured_s"] = statistics.fmean(samples[n])
            ev["samples"] = len(samples[n])
            first, second = halves[n]
            if first and second:  # the measurement against itself: its first steps' mean and its last steps'
                ev["halves_s"] = [statistics.fmean(first), statistics.fmean(second)]
            # every rank's every step, as measured (None where a step did not have the event)
            ev["per_rank_s"] = [[s["durations"].get(n) for s in rank_steps] for rank_steps in everyone]
        if n in thread:
            ev["thread_s"] = statistics.fmean(thread[n])
        events.append(ev)
    return {
        "record": "plan", "plan": json.loads(plan.to_json()), "measured_step_s": statistics.median(times), "step_times_s": times,
        "predicted_step_s": analytic.step_s, "events": events,
        "unmatched_measured": sorted(set(samples) - set(graph.names)),
        "unmeasured": sorted(n for i, n in enumerate(graph.names) if n not in samples and graph.op[i] >= 0),
    }


def breakdown(path: str) -> dict:
    """Per model (``"<model>:<size>"``), per plan of the dataset at ``path`` (the last collection of
    each model, as ``tools/train_estimator.py`` reads it, busy-host plans too): seconds per kind of
    event, simulated (``analytic``), measured and thread CPU (compute sections), each added up over
    the step's events; the compute thread's measured busy time (its sections) and the collectives'
    (``comm``); the measured and predicted step."""
    from train_estimator import load

    _, collected = load([path], keep_disturbed=True)
    models: dict[str, dict] = {}
    for model, records in collected.items():
        models[model] = {}
        for r in records:
            kinds: dict[str, dict[str, float]] = {}
            busy = {"compute": 0.0, "comm": 0.0, "copy": 0.0}
            for e in r["events"]:
                key = e["kind"] if e["stream"] == "compute" else f"{e['stream']}:{e['kind']}"
                k = kinds.setdefault(key, {"events": 0, "analytic_s": 0.0, "measured_s": 0.0, "thread_s": 0.0})
                k["events"] += 1
                k["analytic_s"] += e["analytic_s"]
                k["measured_s"] += e.get("measured_s", 0.0)
                k["thread_s"] += e.get("thread_s", 0.0)
                busy[e["stream"]] += e.get("measured_s", 0.0)
            models[model][r["plan_name"]] = {
                "measured_step_s": r["measured_step_s"], "predicted_step_s": r["predicted_step_s"],
                "compute_busy_s": busy["compute"], "comm_busy_s": busy["comm"], "copy_busy_s": busy["copy"],
                "disturbed": bool(r.get("disturbed")), "kinds": kinds,
            }
    return {"out": path, "breakdown": models}


def breakdown_table(payload: dict) -> str:
    lines = []
    for model, plans in payload["breakdown"].items():
        for name, b in plans.items():
            lines.append(
                f"{model} {name}: measured {b['measured_step_s'] * 1e3:.1f} ms, predicted {b['predicted_step_s'] * 1e3:.1f} ms; "
                f"busy: compute {b['compute_busy_s'] * 1e3:.1f} ms + collectives {b['comm_busy_s'] * 1e3:.1f} ms"
                + (" [busy host]" if b["disturbed"] else "")
            )
            lines.append(f"    {'events':<22}{'n':>4}{'simulated':>11}{'measured':>10}{'thread':>9}  (ms)")
            for kind, k in sorted(b["kinds"].items()):
                thread = f"{k['thread_s'] * 1e3:>9.1f}" if not kind.startswith(("comm:", "copy:")) else f"{'':>9}"
                lines.append(f"    {kind:<22}{k['events']:>4}{k['analytic_s'] * 1e3:>11.1f}{k['measured_s'] * 1e3:>10.1f}{thread}")
    return "\n".join(lines)


def table(payload: dict) -> str:
    lines = [f"timelines appended to {payload['out']} ({payload['world_size']} ranks)"]
    for name, m in payload["models"].items():
        lines.append(f"  {name:<10} {m['plans']:>3} plans  {m['seconds']:>7.1f} s" + (f"  {len(m['errors'])} failed" if m["errors"] else ""))
        lines += [f"    failed: {e}" for e in m["errors"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="wide-mlp,deep-mlp,resnet18,gpt", help="comma-separated zoo models (default: %(default)s)")
    ap.add_argument("--plans", type=int, default=20, help="random plans per model, besides built-in and searched (default 20)")
    ap.add_argument("--no-searched", action="store_true", help="skip the plans the search picks")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per plan (default 3)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps per plan first (default 2)")
    ap.add_argument("--batch", type=int, default=None, help="samples per rank (default: the model's)")
    ap.add_argument("--size", default="default", choices=["default", "tiny"], help="the zoo's size (tiny: for tests)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the random plans (default 0)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="seconds to wait at most for a busy host to quiet down before each plan (default 60)")
    ap.add_argument("--out", default=None, help="the dataset (JSON lines, appended to; required)")
    ap.add_argument("--json", default=None, help="also save the run's summary (with --breakdown: the breakdown) here")
    ap.add_argument("--breakdown", action="store_true",
                    help="collect nothing: add up each plan's events of the dataset --out by kind, simulated and measured")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dataset", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:  # --out: where the parent reads the summary; --dataset: the JSON lines
        worker(args)
        return 0
    if not args.out:
        print("--out is required: the dataset to append to (with --breakdown: to read)", file=sys.stderr)
        return 2
    if args.breakdown:
        if not os.path.exists(args.out):
            print(f"--breakdown reads a collected dataset: {args.out} does not exist", file=sys.stderr)
            return 2
        payload = breakdown(args.out)
        report(breakdown_table(payload), payload, args.json)
        return 0
    unknown = set(args.models.split(",")) - set(zoo())
    if unknown:
        print(f"unknown model(s) {', '.join(sorted(unknown))}; choose from {', '.join(zoo())}", file=sys.stderr)
        return 2
    wargs = ["--models", args.models, "--plans", str(args.plans), "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--size", args.size, "--seed", str(args.seed), "--quiet-wait", str(args.quiet_wait),
             "--dataset", os.path.abspath(args.out)]
    if args.no_searched:
        wargs.append("--no-searched")
    if args.batch is not None:
        wargs += ["--batch", str(args.batch)]
    return run_tool(__file__, args.nproc, wargs, table, args.json)


if __name__ == "__main__":
    sys.exit(main())
