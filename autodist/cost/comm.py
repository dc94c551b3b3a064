"""The comm model: what each collective and host copy costs on this process group, by size.

``sweep()`` times ``all_reduce``, ``all_gather``, ``reduce_scatter`` and host<->device copies over
log-spaced sizes on the real process group, and fits each operation with two linear pieces — small
and large messages — ``T = C * bytes + D`` (DisCo's form), split where the fit is best. It also
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
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter", "h2d", "d2h")
COMM_SCHEMA_VERSION = 1


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
    transient: dict[str, float] = field(default_factory=dict)  # extra bytes per message byte
    meta: dict[str, Any] = field(default_factory=dict)
    schema_version: int = COMM_SCHEMA_VERSION

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
def _fit_line(points: list[tuple[float, float]]) -> Piece:
    """Least squares on relative error (weights 1/t^2), clamped to non-negative coefficients."""
    if len(points) == 1:
        x, t = points[0]
        return Piece(t / x if x else 0.0, 0.0)
    sw = sx = sy = sxx = sxy = 0.0
    for x, t in points:
        w = 1.0 / max(t, 1e-9) ** 2
        sw += w
        sx += w * x
        sy += w * t
        sxx += w * x * x
        sxy += w * x * t
    det = sw * sxx - sx * sx
    if det <= 0:
        return Piece(0.0, sy / sw)
    c = (sw * sxy - sx * sy) / det
    d = (sy - c * sx) / sw
    if c < 0:
        return Piece(0.0, sy / sw)
    if d < 0:
        c = sxy / sxx if sxx else 0.0
        d = 0.0
    return Piece(c, d)


def _rel_sse(piece: Piece, points: list[tuple[float, float]]) -> float:
    return sum(((piece(x) - t) / max(t, 1e-9)) ** 2 for x, t in points)


def fit_op(samples: list[tuple[float, float]]) -> OpModel:
    """Two linear pieces split at the sample that minimises total relative squared error."""
    pts = sorted(samples)
    best: tuple[float, OpModel] | None = None
    for k in range(2, len(pts) - 1):
        lo, hi = pts[:k], pts[k:]
        a, b = _fit_line(lo), _fit_line(hi)
        err = _rel_sse(a, lo) + _rel_sse(b, hi)
        if best is None or err < best[0]:
            best = (err, OpModel(a, b, (lo[-1][0] + hi[0][0]) / 2, pts))
    if best is None:
        line = _fit_line(pts)
        return OpModel(line, line, float("inf"), pts)
    one = _fit_line(pts)
    if _rel_sse(one, pts) <= best[0] * 1.05:  # one line is as good: keep it simple
        return OpModel(one, one, float("inf"), pts)
    return best[1]


# ----------------------------------------------------------------------------------------------
# sweep
# ----------------------------------------------------------------------------------------------
@dataclass
class SweepConfig:
    """Sizes and repetitions of the sweep. Defaults keep it to a few seconds on 2 CPU ranks:
    16 KiB to 16 MiB in 4x steps, the median of 3 timed runs after 1 warm-up."""

    sizes: tuple[int, ...] = tuple(16 * 1024 * 4**i for i in range(6))
    repeats: int = 3
    warmup: int = 1


def _timed(fn: Any, group: dist.ProcessGroup, device: torch.device, cfg: SweepConfig) -> float:
    for _ in range(cfg.warmup):
        fn()
    times = []
    for _ in range(cfg.repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _max_over_ranks(values: list[float], group: dist.ProcessGroup, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device if device.type != "cpu" else None)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def sweep(group: dist.ProcessGroup, device: torch.device, cfg: SweepConfig = SweepConfig()) -> CommModel:
    """Measure and fit the comm model on ``group`` (a collective: call on every rank)."""
    from ..runtime.comm import Comm  # the same collective calls the runtime issues

    world = dist.get_world_size(group)
    comm = Comm(group)
    t_start = time.perf_counter()
    names: list[tuple[str, int]] = []
    times: list[float] = []
    fdt = torch.float32
    for nbytes in cfg.sizes:
        n = max(world, nbytes // 4 // world * world)
        buf = torch.zeros(n, dtype=fdt, device=device)
        shard = torch.zeros(n // world, dtype=fdt, device=device)
        out = torch.empty(n, dtype=fdt, device=device)
        if world > 1:
            names.append(("all_reduce", n * 4))
            times.append(_timed(lambda: comm.all_reduce(buf, "sweep").wait(), group, device, cfg))
            names.append(("all_gather", n * 4))
            times.append(_timed(lambda: comm.all_gather(out, shard, "sweep").wait(), group, device, cfg))
            names.append(("reduce_scatter", n * 4))
            times.append(_timed(lambda: comm.reduce_scatter(shard, buf, "sweep").wait(), group, device, cfg))
        host = torch.empty(n, dtype=fdt, pin_memory=device.type == "cuda")
        names.append(("d2h", n * 4))
        times.append(_timed(lambda: host.copy_(buf, non_blocking=device.type == "cuda"), group, device, cfg))
        names.append(("h2d", n * 4))
        times.append(_timed(lambda: buf.copy_(host, non_blocking=device.type == "cuda"), group, device, cfg))
    times = _max_over_ranks(times, group, device)
    samples: dict[str, list[tuple[float, float]]] = {}
    for (op, nb), t in zip(names, times):
        samples.setdefault(op, []).append((float(nb), t))
    ops = {op: fit_op(pts) for op, pts in samples.items()}
    if world == 1:
        zero = OpModel(Piece(0.0, 0.0), Piece(0.0, 0.0), float("inf"))
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            ops[op] = zero
    slow_compute, slow_comm = _contention(comm, group, device) if world > 1 else (1.0, 1.0)
    transient = _transient_bytes(comm, device) if world > 1 else {}
    model = CommModel(
        backend=dist.get_backend(group),
        world_size=world,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        ops=ops,
        compute_slowdown=slow_compute,
        comm_slowdown=slow_comm,
        transient=transient,
        meta={"sweep_seconds": time.perf_counter() - t_start, "torch": torch.__version__},
    )
    comm.destroy()
    box = [model]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _contention(comm: Any, group: dist.ProcessGroup, device: torch.device) -> tuple[float, float]:
    """(compute slowdown while communicating, communication slowdown while computing)."""
    a = torch.randn(192, 192, device=device)

    def compute(iters: int) -> float:
        t0 = time.perf_counter()
        x = a
        for _ in range(iters):
            x = torch.tanh(x @ a)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    iters = 1
    while compute(iters) < 0.02 and iters < 1 << 16:  # about 20 ms of compute
        iters *= 2
    buf = torch.zeros(4 << 20, device=device)  # 16 MiB all-reduces
    dist.barrier(group=group)
    t_compute = statistics.median(compute(iters) for _ in range(3))
    dist.barrier(group=group)
    t0 = time.perf_counter()
    comm.all_reduce(buf, "sweep").wait()
    t_comm = time.perf_counter() - t0
    k = max(1, math.ceil(t_compute / max(t_comm, 1e-6)))
    dist.barrier(group=group)
    t0 = time.perf_counter()
    works = [comm.all_reduce(buf, "sweep") for _ in range(k)]
    t_compute_busy = compute(iters)
    for w in works:
        w.wait()
    t_comm_busy = time.perf_counter() - t0
    slow_compute = max(1.0, t_compute_busy / t_compute)
    slow_comm = max(1.0, t_comm_busy / (k * t_comm))
    vals = _max_over_ranks([slow_compute, slow_comm], group, device)
    return vals[0], vals[1]


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
            extra = max((m for _, m in mem), default=0) - (mem[0][1] if mem and mem[0][1] < 0 else 0)
        result[op] = extra / (n * 4)
    return result
