"""Measuring the comm model on the real process group (the models themselves, their fit and their use
are in ``autodist/cost/comm.py``; measuring is kept apart from modelling, so ``cost/`` never needs the
runtime). See that module for what is measured and how it is fitted.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..cost.comm import CommModel, OpModel, Piece, fit_op


@dataclass
class SweepConfig:
    """Sizes and repetitions of the sweep. Defaults keep it to a few seconds on 2 CPU ranks:
    16 KiB to 16 MiB in 4x steps; each sample times as many calls as fill ``min_run_s`` (10 to 50),
    spread over ``rounds`` interleaved passes, and keeps their median."""

    sizes: tuple[int, ...] = tuple(16 * 1024 * 4**i for i in range(6))
    warmup: int = 2
    min_calls: int = 10
    max_calls: int = 50
    min_run_s: float = 0.05
    rounds: int = 5


def _calls_for(fn: Any, group: dist.ProcessGroup, device: torch.device, cfg: SweepConfig) -> int:
    """How many timed calls a sample gets: enough to fill ``min_run_s``, the same on every rank."""
    for _ in range(cfg.warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(cfg.min_calls, min(cfg.max_calls, int(cfg.min_run_s / once)))
    n = torch.tensor([calls], dtype=torch.int64, device=device if device.type != "cpu" else None)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=group)
    return int(n.item())


def _time_calls(fn: Any, calls: int, device: torch.device, group: dist.ProcessGroup) -> list[float]:
    """Times of ``calls`` calls, each started together on all ranks.

    [Note: which statistic] On a shared 2-core host a collective's time has a long tail (a tenth of
    small all-reduces take ~10x the median: the scheduler, not the wire) and even its median moves
    2-3x between runs at some sizes. The sweep keeps the 10th percentile — the cost of the operation
    itself, reproducible run to run — and measures interference separately (``compute_slowdown``,
    ``comm_slowdown``), which the simulator applies where compute and communication overlap.
    """
    out = []
    for _ in range(calls):
        dist.barrier(group=group)  # both ranks start together: no skew from the previous call
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def _max_over_ranks(values: list[float], group: dist.ProcessGroup, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device if device.type != "cpu" else None)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


DISTURBED_SPREAD = 2.0  # a sweep whose typical call takes twice its 10th percentile ran on a busy host


def sweep(group: dist.ProcessGroup, device: torch.device, cfg: SweepConfig | None = None) -> CommModel:
    """Measure and fit the comm model on ``group`` (a collective: call on every rank); ``cfg``
    defaults to ``SweepConfig()``."""
    cfg = cfg or SweepConfig()
    from ..runtime.comm import Comm  # the same collective calls the runtime issues

    world = dist.get_world_size(group)
    comm = Comm(group)
    t_start = time.perf_counter()
    fdt = torch.float32
    cases: list[tuple[str, int, Any]] = []
    keep: list[torch.Tensor] = []
    for nbytes in cfg.sizes:
        n = max(world, nbytes // 4 // world * world)
        buf = torch.zeros(n, dtype=fdt, device=device)
        shard = torch.zeros(n // world, dtype=fdt, device=device)
        out = torch.empty(n, dtype=fdt, device=device)
        host = torch.empty(n, dtype=fdt, pin_memory=device.type == "cuda")
        keep += [buf, shard, out, host]
        nb = n * 4
        if world > 1:
            cases.append(("all_reduce", nb, lambda buf=buf: comm.all_reduce(buf, "sweep").wait()))
            cases.append(("all_gather", nb, lambda out=out, shard=shard: comm.all_gather(out, shard, "sweep").wait()))
            cases.append(("reduce_scatter", nb, lambda buf=buf, shard=shard: comm.reduce_scatter(shard, buf, "sweep").wait()))
        nonblock = device.type == "cuda"
        cases.append(("d2h", nb, lambda host=host, buf=buf, nonblock=nonblock: host.copy_(buf, non_blocking=nonblock)))
        cases.append(("h2d", nb, lambda host=host, buf=buf, nonblock=nonblock: buf.copy_(host, non_blocking=nonblock)))
    # Samples are collected in interleaved rounds, so a disturbance of the host (another process,
    # the scheduler) touches a few calls of many samples instead of all calls of one; the median
    # of each sample's calls then ignores it.
    calls = [_calls_for(fn, group, device, cfg) for _, _, fn in cases]
    per_round = [max(1, -(-c // cfg.rounds)) for c in calls]
    durations: list[list[float]] = [[] for _ in cases]
    for _ in range(cfg.rounds):
        dist.barrier(group=group)
        for _, _, fn in cases[:3]:  # wake the backend's threads before the first timed call
            fn()
        for i, (_, _, fn) in enumerate(cases):
            durations[i] += _time_calls(fn, per_round[i], device, group)
    names = [(op, nb) for op, nb, _ in cases]
    times = [sorted(d)[len(d) // 10] for d in durations]  # the 10th percentile: see _time_calls
    # how disturbed the host was: the median call against the 10th percentile, over the samples
    spreads = sorted(sorted(d)[len(d) // 2] / max(t, 1e-9) for d, t in zip(durations, times))
    spread = spreads[len(spreads) // 2] if spreads else 1.0
    times = _max_over_ranks(times, group, device)
    samples: dict[str, list[tuple[float, float]]] = {}
    for (op, nb), t in zip(names, times):
        samples.setdefault(op, []).append((float(nb), t))
    for pts in samples.values():
        # A message is never cheaper than a smaller one of the same kind: a sample slower than a
        # larger message's was disturbed (seen on 2 cores: a 16 KiB reduce-scatter at 1.5x the
        # 64 KiB one), and is capped at the larger one's time before fitting.
        pts.sort()
        for i in range(len(pts) - 2, -1, -1):
            pts[i] = (pts[i][0], min(pts[i][1], pts[i + 1][1]))
    ops = {op: fit_op(pts) for op, pts in samples.items()}
    if world == 1:
        zero = OpModel(Piece(0.0, 0.0), Piece(0.0, 0.0), float("inf"))
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            ops[op] = zero
    contention = _contention(comm, group, device, ops) if world > 1 else {}
    slow_compute, slow_comm = contention["all_reduce"][-1][1:] if contention else (1.0, 1.0)
    transient = _transient_bytes(comm, device) if world > 1 else {}
    from .overhead import measure_runtime_overhead

    overhead = asdict(measure_runtime_overhead(device))
    model = CommModel(
        backend=dist.get_backend(group),
        world_size=world,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        ops=ops,
        compute_slowdown=slow_compute,
        comm_slowdown=slow_comm,
        contention=contention,
        transient=transient,
        overhead=overhead,
        meta={
            "sweep_seconds": time.perf_counter() - t_start, "torch": torch.__version__,
            # median over samples of (median call / 10th percentile): ~1 on a quiet host
            "spread": round(spread, 3), "disturbed": spread > DISTURBED_SPREAD,
        },
    )
    comm.destroy()
    box = [model]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


CONTENTION_SIZES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)  # message bytes the contention is measured at


def _contention(
    comm: Any, group: dist.ProcessGroup, device: torch.device, ops: dict[str, OpModel]
) -> dict[str, list[list[float]]]:
    """Per collective kind and message size: [bytes, compute slowdown while it runs, its slowdown
    while compute runs].

    Each is measured under full overlap: a train of collectives runs, one at a time as the
    runtime's queue runs them, while the compute thread keeps computing until every one of them
    has completed; compared with the fitted time of one alone (``ops``: the simulator's base time,
    so that base x slowdown reproduces what was measured). Kinds differ (gloo runs a reduce-scatter as several
    concurrent all-reduces on its worker threads, which contend harder with compute on a small
    host), and so do sizes: a small message waits for the backend's threads to be scheduled at
    every round trip, so it is slowed more, and a large one competes with compute for memory
    bandwidth (on 2 cores: ~2-3x at 1-4 MiB, ~1.5x at 16 MiB, 3-5x at 64 MiB).
    """
    a = torch.randn(384, 384, device=device)
    b = torch.randn(384, 384, device=device)

    def one() -> None:
        torch.tanh(a @ b, out=b)

    def rate(seconds: float) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            one()
            n += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return n / (time.perf_counter() - t0)

    world = comm.world_size
    dist.barrier(group=group)
    alone = rate(0.05)
    values: list[float] = []
    keys: list[tuple[str, int]] = []
    for size in CONTENTION_SIZES:
        n_el = size // 4 // world * world
        buf = torch.zeros(n_el, device=device)
        shard = torch.zeros(n_el // world, device=device)
        out = torch.empty(n_el, device=device)
        kinds = {
            "all_reduce": lambda buf=buf: comm.all_reduce(buf, "sweep"),
            "all_gather": lambda out=out, shard=shard: comm.all_gather(out, shard, "sweep"),
            "reduce_scatter": lambda buf=buf, shard=shard: comm.reduce_scatter(shard, buf, "sweep"),
        }
        k = max(3, (96 << 20) // size // 4)  # more of the small ones
        for kind, issue in kinds.items():
            t_op = ops[kind](n_el * 4)
            issue().wait()  # wake the backend's threads
            dist.barrier(group=group)
            t0 = time.perf_counter()
            n = 0
            for _ in range(k):
                w = issue()
                done = threading.Event()  # gloo's reduce-scatter reports completion only to wait()
                waiter = threading.Thread(target=lambda w=w, done=done: (w.wait(), done.set()), daemon=True)
                waiter.start()
                while not done.is_set():
                    one()
                    n += 1
                waiter.join()
            t_busy = time.perf_counter() - t0
            values += [max(1.0, alone / max(n / t_busy, 1e-9)) if n else 1.0, max(1.0, t_busy / (k * t_op))]
            keys.append((kind, n_el * 4))
    values = _max_over_ranks(values, group, device)
    out_rows: dict[str, list[list[float]]] = {}
    for i, (kind, nbytes) in enumerate(keys):
        out_rows.setdefault(kind, []).append([float(nbytes), values[2 * i], values[2 * i + 1]])
    return out_rows


def _transient_bytes(comm: Any, device: torch.device) -> dict[str, float]:
    """Extra bytes the backend allocates per message byte while a collective runs (measured on one
    4 MiB message of each kind: the CUDA allocator's peak, or the CPU profiler's allocations)."""
    world = comm.world_size
    n = (1 << 20) // world * world
    buf = torch.zeros(n, device=device)
    shard = torch.zeros(n // world, device=device)
    out = torch.empty(n, device=device)
    calls = {
        "all_reduce": lambda: comm.all_reduce(buf, "sweep").wait(),
        "all_gather": lambda: comm.all_gather(out, shard, "sweep").wait(),
        "reduce_scatter": lambda: comm.reduce_scatter(shard, buf, "sweep").wait(),
    }
    result = {}
    for op, fn in calls.items():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            fn()
            torch.cuda.synchronize(device)
            extra = torch.cuda.max_memory_allocated(device) - base
        else:
            from .memory import trace_cpu_memory

            mem, _ = trace_cpu_memory(fn)
            extra = max((m for _, m in mem), default=0)
        result[op] = extra / (n * 4)
    return result
