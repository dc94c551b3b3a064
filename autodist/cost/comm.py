"""The comm model: what each collective and host copy costs on this process group, by size.

``autodist.measure.sweep.sweep()`` times ``all_reduce``, ``all_gather``, ``reduce_scatter`` and host<->device copies over
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
from dataclasses import asdict, dataclass, field
from typing import Any

OPS = ("all_reduce", "all_gather", "reduce_scatter", "h2d", "d2h")
# the message size of the all-reduce train a profile's contended passes run under
# (autodist.measure.sweep.collective_train; Profile.contended_slowdown)
TRAIN_BYTES = 4 << 20
# Raised whenever what the sweep measures or how it is fitted changes: a cached comm model of another
# schema is measured again. What each schema changed: docs/CHANGELOG.md.
COMM_SCHEMA_VERSION = 10


@dataclass
class Piece:
    c: float  # seconds per byte
    d: float  # seconds

    def __call__(self, nbytes: float) -> float:
        return self.c * nbytes + self.d


@dataclass
class OpModel:
    """Time by message size: the ``small`` piece up to the last sample it was fitted to, the
    ``large`` piece from the first sample it was fitted to, and between those two samples the
    straight line joining the pieces' values there (see [Note: joining the pieces]).

    [Note: joining the pieces] The large-message piece is fitted for its own samples only and may
    run below zero towards 0 bytes (bandwidth that improves with size), so evaluated below its first
    sample it undershoots: in 50 of 70 two-piece fits of sweeps on a 2-core CPU host it read
    20-65% less just above the midpoint between the pieces' samples than the small piece just below,
    and a 3 MiB reduce-scatter was predicted faster than a 2 MiB one — a gap the search could only
    misjudge, and where gpt's bucket messages lie. Nothing was measured between the two samples, so
    the model joins them by a straight line, and no larger message is ever predicted to take less
    time than a smaller one. ``split_bytes`` keeps the stored pieces' meaning (below it the small
    piece applies); the join is derived from the samples, so stored models need no new field."""

    small: Piece
    large: Piece
    split_bytes: float
    samples: list[tuple[float, float]] = field(default_factory=list)  # (bytes, seconds) as measured

    def __post_init__(self) -> None:
        below = [x for x, _ in self.samples if x <= self.split_bytes]
        above = [x for x, _ in self.samples if x > self.split_bytes]
        # (last small sample, its time; first large sample, its time): the join, when there are pieces
        self._join: tuple[float, float, float, float] | None = None
        if below and above and self.split_bytes != float("inf"):
            lo, hi = max(below), min(above)
            t_lo = max(0.0, self.small(lo))
            self._join = (lo, t_lo, hi, max(t_lo, self.large(hi)))

    def __call__(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        if self._join is None:
            return max(0.0, (self.small if nbytes <= self.split_bytes else self.large)(nbytes))
        lo, t_lo, hi, t_hi = self._join
        if nbytes <= lo:
            return max(0.0, self.small(nbytes))
        if nbytes < hi:
            return t_lo + (t_hi - t_lo) * (nbytes - lo) / (hi - lo)
        return max(t_hi, self.large(nbytes))


# the wait calibration scales the wait figure of messages below this size; from it up a collective
# the compute thread waits on runs at the sweep's own figure. The sweep measures at 4 and 16 MiB, so
# the scale applies in full up to the 4 MiB row and fades out by 16 MiB (interpolated in log size);
# a row's size may fall short of its nominal size by the padding to the world size
# (autodist/measure/sweep.py ``_contention``), which ``_scaled_wait`` allows for (autodist/cost/
# fidelity.py [Note: the wait calibration])
WAIT_SCALED_BELOW_BYTES = 16 << 20


def _scaled_wait(nbytes: float | None) -> bool:
    """Whether the wait calibration applies to a message (or measured row) of ``nbytes``: below
    ``WAIT_SCALED_BELOW_BYTES``, less a part in a thousand for the padding; None (the largest
    message) is not."""
    return nbytes is not None and nbytes < WAIT_SCALED_BELOW_BYTES * 0.999


@dataclass
class CommModel:
    backend: str
    world_size: int
    device: str
    ops: dict[str, OpModel]
    compute_slowdown: float = 1.0  # compute runs this many times longer while a collective runs
    comm_slowdown: float = 1.0  # a collective runs this many times longer while compute runs
    # per collective kind, by message size: [[bytes, compute slowdown while it runs, its slowdown
    # while compute runs, its slowdown while the compute thread waits], ...] in increasing size
    # (autodist/measure/sweep.py _contention)
    contention: dict[str, list[list[float]]] = field(default_factory=dict)
    transient: dict[str, float] = field(default_factory=dict)  # extra bytes per message byte
    overhead: dict[str, float] = field(default_factory=dict)  # the runtime's own costs (measure/overhead.py)
    # per collective kind: the compute thread's own time for one collective of a message size —
    # issuing it and collecting it once done (see [Note: the caller's share of a collective] in
    # autodist/measure/sweep.py); the operation's own time (``ops``) excludes it
    host: dict[str, OpModel] = field(default_factory=dict)
    # [[bytes, seconds], ...] in increasing size: writing a freshly allocated tensor of that size
    # costs this much more than writing one that exists (see [Note: fresh memory] in
    # autodist/measure/sweep.py); empty: nothing measured, no cost
    first_touch: list[list[float]] = field(default_factory=list)
    # multiplies the slowdown of a collective the compute thread waits on (the third contention
    # figure) for messages below ``WAIT_SCALED_BELOW_BYTES``: the calibration of this machine class
    # against measured steps, which the sweep sets (autodist/cost/fidelity.py [Note: the wait
    # calibration])
    wait_scale: float = 1.0
    # seconds a step loses to each wait on a collective that has not completed, beyond the
    # collective's own time: the calibration of this machine class against measured steps, which
    # the sweep sets (autodist/cost/sim/execute.py [Note: what a blocked wait costs])
    blocked_wait_s: float = 0.0
    # collectives each of the runtime's process groups works on at once (gloo: its worker threads;
    # see [Note: collectives taken up at once] in autodist/cost/sim/execute.py): when their staging
    # buffers are allocated
    workers: int = 1
    meta: dict[str, Any] = field(default_factory=dict)
    schema_version: int = COMM_SCHEMA_VERSION

    def slowdowns(self, op: str, nbytes: float | None = None, *, scaled: bool = True) -> tuple[float, float, float]:
        """(compute slowdown while ``op`` of ``nbytes`` runs, ``op``'s slowdown while compute runs,
        ``op``'s slowdown while the compute thread waits, times ``wait_scale`` below
        ``WAIT_SCALED_BELOW_BYTES`` unless not ``scaled``, and at least 1): interpolated in log size
        between the measured sizes, the nearest outside them; the largest measured size when
        ``nbytes`` is None. Rows without the third figure (it was not measured) give 1 before the
        scale: full speed while compute waits."""
        ws = self.wait_scale if scaled else 1.0
        rows = self.contention.get(op)
        if not rows:
            return self.compute_slowdown, self.comm_slowdown, max(1.0, ws if _scaled_wait(nbytes) else 1.0)

        def figures(row: list[float]) -> tuple[float, float, float]:
            scale = ws if _scaled_wait(row[0]) else 1.0
            return row[1], row[2], max(1.0, (row[3] if len(row) > 3 else 1.0) * scale)

        if nbytes is None or nbytes >= rows[-1][0]:
            return figures(rows[-1])
        if nbytes <= rows[0][0]:
            return figures(rows[0])
        for lo, hi in zip(rows, rows[1:]):
            if nbytes <= hi[0]:
                f = (math.log(nbytes) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
                a, b = figures(lo), figures(hi)
                return tuple(x + f * (y - x) for x, y in zip(a, b))  # type: ignore[return-value]
        return figures(rows[-1])  # pragma: no cover - the loop always returns

    def memcpy(self, nbytes: float) -> float:
        """A copy of ``nbytes`` within device memory (on the CPU: host memory bandwidth)."""
        if self.device == "cpu" and "h2d" in self.ops:
            return self.ops["h2d"](nbytes)
        return nbytes / 1e12  # device memory: ~1 TB/s, negligible next to everything else

    def time(self, op: str, nbytes: float) -> float:
        if self.world_size == 1 and op in ("all_reduce", "all_gather", "reduce_scatter"):
            return 0.0
        return self.ops[op](nbytes)

    def host_time(self, op: str, nbytes: float) -> float:
        """The compute thread's time to issue one ``op`` of ``nbytes`` and to collect it when done
        (0 where not measured, and on a world of one, where nothing is issued)."""
        fit = self.host.get(op)
        if fit is None or self.world_size == 1:
            return 0.0
        return fit(nbytes)

    def first_touch_s(self, nbytes: float) -> float:
        """The extra time to write ``nbytes`` into a tensor allocated just before (the pages the
        allocator maps afresh): linear between the measured sizes, proportional beyond the largest,
        none below the smallest measured size that had any."""
        rows = self.first_touch
        if not rows or nbytes <= 0:
            return 0.0
        lo_b, lo_s = 0.0, 0.0
        for b, sec in rows:
            if nbytes <= b:
                return lo_s + (sec - lo_s) * (nbytes - lo_b) / max(b - lo_b, 1.0)
            lo_b, lo_s = b, sec
        return lo_s * nbytes / max(lo_b, 1.0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CommModel:
        if d.get("schema_version") != COMM_SCHEMA_VERSION:
            raise ValueError(f"comm model schema_version {d.get('schema_version')!r} is not {COMM_SCHEMA_VERSION}")
        ws = d.get("wait_scale", 1.0)
        if isinstance(ws, bool) or not isinstance(ws, (int, float)) or not 0 < ws < math.inf:
            raise ValueError(f"comm model wait_scale {ws!r} is not a positive number")
        bw = d.get("blocked_wait_s", 0.0)
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not 0 <= bw < math.inf:
            raise ValueError(f"comm model blocked_wait_s {bw!r} is not a non-negative number")
        workers = d.get("workers", 1)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"comm model workers {workers!r} is not a positive integer")
        d = dict(d)

        def fits(entries: dict[str, Any]) -> dict[str, OpModel]:
            return {
                k: OpModel(Piece(**v["small"]), Piece(**v["large"]), v["split_bytes"], [tuple(s) for s in v.get("samples", [])])
                for k, v in entries.items()
            }

        d["ops"] = fits(d["ops"])
        d["host"] = fits(d.get("host", {}))
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


# Comm model schema versions whose fields this checkout reads, for the tools that re-predict records
# measured by other checkouts (tools/calibrate.py, tools/sweepcheck.py): 3 -> 4, 5 -> 6, 6 -> 7 and 8 -> 9
# changed how a figure is measured, not the fields; 5 added ``wait_scale``, 8 ``workers`` (1 when
# absent, which moves the predicted memory only) and 10 ``blocked_wait_s``.
READABLE_COMM_SCHEMAS = frozenset({3, 4, 5, 6, 7, 8, 9, 10})


def comm_model_of_another_checkout(d: dict[str, Any], *, wait_scale: float = 1.0, blocked_wait_s: float = 0.0) -> CommModel:
    """The comm model ``d`` (a dict from its JSON) read with this checkout's fields, whichever of
    :data:`READABLE_COMM_SCHEMAS` it was written with; ``wait_scale`` and ``blocked_wait_s`` where
    it has none."""
    if d.get("schema_version") not in READABLE_COMM_SCHEMAS:
        raise ValueError(f"a comm model of schema version {d.get('schema_version')!r}; this checkout reads "
                         f"{sorted(READABLE_COMM_SCHEMAS)} (versions with the same fields)")
    d = dict(d, schema_version=COMM_SCHEMA_VERSION)
    d.setdefault("wait_scale", wait_scale)
    d.setdefault("blocked_wait_s", blocked_wait_s)
    return CommModel.from_dict(d)


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

