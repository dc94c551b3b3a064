"""The comm model: what each collective and host copy costs on this process group, by size.

``sweep()`` times ``all_reduce``, ``all_gather``, ``reduce_scatter`` and host<->device copies over
log-spaced sizes on the real process group, and fits each operation with two linear pieces — small
and large messages — ``T = C * bytes + D`` (DisCo's form), each the line with the smallest worst-case
relative error, split where the fit is best. It also
measures how much compute slows down while a collective runs and how much a collective slows down
while compute runs (on CPU they share cores), and how many extra bytes the backend allocates per
message byte while a collective runs (gloo's all-gather stages its output in a temporary).

Every rank takes the slowest rank's time for each sample, fits the same data, and rank 0's model is
broadcast, so all ranks hold the identical model.

Sizes are *message* bytes: the full (gathered / pre-scatter) buffer for all-gather and
reduce-scatter, the buffer for all-reduce, the copied bytes for copies.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter", "h2d", "d2h")
COMM_SCHEMA_VERSION = 2


@dataclass
class Piece:
    c: float  # seconds per byte
    d: float  # seconds

    def __call__(self, nbytes: float) -> float:
        return self.c * nbytes + self.d


@dataclass
class OpModel:
    small: Piece
    large: Piece
    split_bytes: float
    samples: list[tuple[float, float]] = field(default_factory=list)  # (bytes, seconds) as measured

    def __call__(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return max(0.0, (self.small if nbytes <= self.split_bytes else self.large)(nbytes))


@dataclass
class CommModel:
    backend: str
    world_size: int
    device: str
    ops: dict[str, OpModel]
    compute_slowdown: float = 1.0  # compute runs this many times longer while a collective runs
    comm_slowdown: float = 1.0  # a collective runs this many times longer while compute runs
    # per collective kind, by message size: [[bytes, compute slowdown while it runs, its slowdown
    # while compute runs], ...] in increasing size (see _contention)
    contention: dict[str, list[list[float]]] = field(default_factory=dict)
    transient: dict[str, float] = field(default_factory=dict)  # extra bytes per message byte
    overhead: dict[str, float] = field(default_factory=dict)  # the runtime's own costs (cost/overhead.py)
    meta: dict[str, Any] = field(default_factory=dict)
    schema_version: int = COMM_SCHEMA_VERSION

    def slowdowns(self, op: str, nbytes: float | None = None) -> tuple[float, float]:
        """(compute slowdown while ``op`` of ``nbytes`` runs, ``op``'s slowdown while compute runs):
        interpolated in log size between the measured sizes, the nearest outside them; the
        largest measured size when ``nbytes`` is None."""
        rows = self.contention.get(op)
        if not rows:
            return self.compute_slowdown, self.comm_slowdown
        if nbytes is None or nbytes >= rows[-1][0]:
            return rows[-1][1], rows[-1][2]
        if nbytes <= rows[0][0]:
            return rows[0][1], rows[0][2]
        for lo, hi in zip(rows, rows[1:]):
            if nbytes <= hi[0]:
                f = (math.log(nbytes) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
                return lo[1] + f * (hi[1] - lo[1]), lo[2] + f * (hi[2] - lo[2])
        return rows[-1][1], rows[-1][2]  # pragma: no cover - the loop always returns

    def memcpy(self, nbytes: float) -> float:
        """A copy of ``nbytes`` within device memory (on the CPU: host memory bandwidth)."""
        if self.device == "cpu" and "h2d" in self.ops:
            return self.ops["h2d"](nbytes)
        return nbytes / 1e12  # device memory: ~1 TB/s, negligible next to everything else

    def time(self, op: str, nbytes: float) -> float:
        if self.world_size == 1 and op in ("all_reduce", "all_gather", "reduce_scatter"):
            return 0.0
        return self.ops[op](nbytes)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CommModel:
        if d.get("schema_version") != COMM_SCHEMA_VERSION:
            raise ValueError(f"comm model schema_version {d.get('schema_version')!r} is not {COMM_SCHEMA_VERSION}")
        d = dict(d)
        d["ops"] = {
            k: OpModel(Piece(**v["small"]), Piece(**v["large"]), v["split_bytes"], [tuple(s) for s in v.get("samples", [])])
            for k, v in d["ops"].items()
        }
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> CommModel:
        return cls.from_dict(json.loads(text))

    @classmethod
    def analytic(
        cls,
        world_size: int,
        *,
        bandwidth_bytes_s: float,
        latency_s: float,
        copy_bandwidth_bytes_s: float | None = None,
        backend: str = "analytic",
        device: str = "cpu",
    ) -> CommModel:
        """A model from a bandwidth and latency (ring algorithms), for planning without a sweep."""
        w = world_size
        f_ar = 2 * (w - 1) / w if w > 1 else 0.0
        f_ag = (w - 1) / w if w > 1 else 0.0
        copy_bw = copy_bandwidth_bytes_s or bandwidth_bytes_s

        def lin(c: float, d: float) -> OpModel:
            return OpModel(Piece(c, d), Piece(c, d), float("inf"))

        ops = {
            "all_reduce": lin(f_ar / bandwidth_bytes_s, latency_s),
            "all_gather": lin(f_ag / bandwidth_bytes_s, latency_s),
            "reduce_scatter": lin(f_ag / bandwidth_bytes_s, latency_s),
            "h2d": lin(1 / copy_bw, 1e-5),
            "d2h": lin(1 / copy_bw, 1e-5),
        }
        return cls(backend, w, device, ops, meta={"source": "analytic", "bandwidth": bandwidth_bytes_s, "latency": latency_s})


# ----------------------------------------------------------------------------------------------
# fitting
# ----------------------------------------------------------------------------------------------
def _max_rel_err(piece: Piece, points: list[tuple[float, float]]) -> float:
    return max(abs(piece(x) - t) / t for x, t in points)


def _fit_line(points: list[tuple[float, float]], *, negative_intercept: bool = False) -> Piece:
    """The line ``T = C*x + D`` (C >= 0; D >= 0 unless ``negative_intercept``) with the smallest
    worst-case relative error. The large-message piece may extrapolate below zero towards 0 bytes
    (bandwidth that improves with size, e.g. once a copy leaves the cache); it is only used from the
    split upwards, where it stays positive.

    By Chebyshev's alternation theorem the best line's error reaches its maximum at three points
    with alternating signs, so it is found by solving every triple (few points: a sweep has ~6-14).
    """
    pts = [(x, max(t, 1e-12)) for x, t in points]
    if len(pts) == 1:
        return Piece(0.0, pts[0][1])
    # the best constant (C = 0) and the best proportional line (D = 0): where the bounds bind
    ts = [t for _, t in pts]
    qs = [x / t for x, t in pts]
    candidates: list[Piece] = [Piece(0.0, 2 * min(ts) * max(ts) / (min(ts) + max(ts)))]
    if max(qs) > 0:
        candidates.append(Piece(2 / (min(qs) + max(qs)), 0.0))
    for i in range(len(pts)):
        for j in range(i + 1, len(pts)):
            (x1, t1), (x2, t2) = pts[i], pts[j]
            if x2 != x1:
                c = (t2 - t1) / (x2 - x1)
                candidates.append(Piece(c, t1 - c * x1))
            for k in range(j + 1, len(pts)):
                x3, t3 = pts[k]
                for sign in (1.0, -1.0):
                    # c*x + d - t = s_i * e * t  for s = (+,-,+)*sign, unknowns c, d, e
                    rows = [(x1, 1.0, -sign * t1, t1), (x2, 1.0, sign * t2, t2), (x3, 1.0, -sign * t3, t3)]
                    sol = _solve3(rows)
                    if sol is not None:
                        candidates.append(Piece(sol[0], sol[1]))
    best = None
    lowest = min(x for x, _ in pts)
    for cand in candidates:
        if cand.c < 0 or (cand.d < 0 and not negative_intercept) or cand(lowest) <= 0:
            continue
        err = _max_rel_err(cand, pts)
        if best is None or err < best[0]:
            best = (err, cand)
    return best[1] if best is not None else Piece(0.0, sum(t for _, t in pts) / len(pts))


def _solve3(rows: list[tuple[float, float, float, float]]) -> tuple[float, float, float] | None:
    """Solve a 3x3 system given as rows (a, b, c | rhs) by Cramer's rule."""
    (a1, b1, c1, r1), (a2, b2, c2, r2), (a3, b3, c3, r3) = rows

    def det(m: tuple[tuple[float, ...], ...]) -> float:
        return (
            m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
        )

    base = ((a1, b1, c1), (a2, b2, c2), (a3, b3, c3))
    dd = det(base)
    if abs(dd) < 1e-30:
        return None
    x = det(((r1, b1, c1), (r2, b2, c2), (r3, b3, c3))) / dd
    y = det(((a1, r1, c1), (a2, r2, c2), (a3, r3, c3))) / dd
    z = det(((a1, b1, r1), (a2, b2, r2), (a3, b3, r3))) / dd
    return x, y, z


def fit_op(samples: list[tuple[float, float]]) -> OpModel:
    """Two linear pieces (small and large messages), split where the worse of the two pieces'
    worst-case relative errors is smallest; one line if that is as good."""
    pts = sorted(samples)
    one = _fit_line(pts)
    one_err = _max_rel_err(one, pts)
    best: tuple[float, OpModel] = (one_err, OpModel(one, one, float("inf"), pts))
    for k in range(2, len(pts) - 1):
        lo, hi = pts[:k], pts[k:]
        a, b = _fit_line(lo), _fit_line(hi, negative_intercept=True)
        err = max(_max_rel_err(a, lo), _max_rel_err(b, hi))
        if err < best[0] * 0.95:  # two pieces only when clearly better than one line
            best = (err, OpModel(a, b, (lo[-1][0] + hi[0][0]) / 2, pts))
    return best[1]


# ----------------------------------------------------------------------------------------------
# sweep
# ----------------------------------------------------------------------------------------------
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
            from ..memory import trace_cpu_memory

            mem, _ = trace_cpu_memory(fn)
            extra = max((m for _, m in mem), default=0)
        result[op] = extra / (n * 4)
    return result
