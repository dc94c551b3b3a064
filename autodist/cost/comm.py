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

A model has one level (every collective runs on the link ``ops`` describe: what a sweep measures
over the ranks of one machine) or two: ``ops`` for the ranks within one node and ``cross_node``, a
model of its own, for collectives between nodes, ``ranks_per_node`` consecutive ranks to a node
(``autodist plan --nodes``; :func:`CommModel.two_level`). :meth:`CommModel.group_time` prices a
collective over any group of ranks on the link(s) it crosses ([Note: collectives across nodes]).
What is measured and what is assumed: a sweep measures one level, the ranks it runs on (on one
machine: its cores or GPUs); the two levels of ``autodist plan --nodes`` are the analytic models
of named interconnects (``cost/interconnect.py``: line rates and round latencies, not
measurements), and the tests emulate a slow network on one machine with :meth:`CommModel.slowed`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

OPS = ("all_reduce", "all_gather", "reduce_scatter", "h2d", "d2h")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
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


# a collective on a level that costs nothing (CommModel.with_free_level)
_FREE = OpModel(Piece(0.0, 0.0), Piece(0.0, 0.0), float("inf"))


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
    # Two levels ([Note: collectives across nodes]): the ranks of one node (consecutive ranks), whose
    # collectives ``ops`` then describe for a group of ``ranks_per_node`` ranks, and the model of the
    # link between nodes, whose ``ops`` describe a group of its own ``world_size`` ranks, one per
    # node. None: one level, ``ops`` fitted over the whole world (a sweep on one machine).
    ranks_per_node: int | None = None
    cross_node: CommModel | None = None

    def __post_init__(self) -> None:
        if (self.ranks_per_node is None) != (self.cross_node is None):
            raise ValueError("a two-level comm model needs both ranks_per_node and cross_node")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"comm model ranks_per_node {self.ranks_per_node!r} is not a positive integer")

    @property
    def levels(self) -> int:
        """1, or 2 when collectives between nodes are priced on their own link."""
        return 1 if self.cross_node is None else 2

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
        """``op`` of ``nbytes`` over the whole world (a copy: on one rank)."""
        if self.world_size == 1 and op in ("all_reduce", "all_gather", "reduce_scatter"):
            return 0.0
        if self.cross_node is None or op not in COLLECTIVES:
            return self.ops[op](nbytes)
        return self.group_time(op, nbytes, self.world_size)

    def group_time(self, op: str, nbytes: float, ranks: int, *, stride: int = 1) -> float:
        """The collective ``op`` of ``nbytes`` over a group of ``ranks`` ranks ``stride`` apart (a
        shard group: consecutive ranks; the replicas of a shard: ``shard_size`` apart); nothing on
        one rank.

        One level: the model's own fit over the whole world, else the bytes each rank sends in a
        ring of ``ranks``: the message scaled by ``(ranks-1)/ranks`` against
        ``(world-1)/world`` (twice both for an all-reduce, which cancels). Two levels: on the
        link(s) the group crosses ([Note: collectives across nodes])."""
        if ranks <= 1:
            return 0.0
        if self.cross_node is None or self.ranks_per_node is None:
            if ranks == self.world_size:
                return self.time(op, nbytes)
            return self._ring(self.ops, self.world_size, op, nbytes, ranks)
        # [Note: collectives across nodes] A group of r ranks with m of them on each of k nodes (the
        # runtime's groups are aligned to nodes: consecutive ranks, or ranks a shard group apart)
        # is priced hierarchically, as NCCL's multi-channel rings and trees on rail-optimised nodes
        # move bytes: each node's share of the message crosses the network once, split over its m
        # ranks' NICs, and the rest stays on the link within the node. A reduce-scatter is a
        # reduce-scatter within the node, then one across nodes of the 1/m the rank now holds; an
        # all-gather the reverse; an all-reduce a reduce-scatter within the node, an all-reduce
        # across nodes of the 1/m, and an all-gather within the node. A group within one node (k = 1)
        # is on the node's link alone, one rank per node (m = 1) on the network alone. Pricing a
        # multi-node collective as a flat ring at the slower link's speed would charge every byte
        # to the network, m times what crosses it. The levels run one after the other: no overlap
        # between the phases is assumed.
        m = min(ranks, max(1, self.ranks_per_node // stride)) if stride < self.ranks_per_node else 1
        k = max(1, ranks // m)
        rpn, cross = self.ranks_per_node, self.cross_node
        if k == 1:
            return self._ring(self.ops, rpn, op, nbytes, m)
        if m == 1:
            return cross._ring(cross.ops, cross.world_size, op, nbytes, k)
        part = nbytes / m
        if op == "all_reduce":
            return (self._ring(self.ops, rpn, "reduce_scatter", nbytes, m) + cross._ring(cross.ops, cross.world_size, op, part, k)
                    + self._ring(self.ops, rpn, "all_gather", nbytes, m))
        return self._ring(self.ops, rpn, op, nbytes, m) + cross._ring(cross.ops, cross.world_size, op, part, k)

    @staticmethod
    def _ring(ops: dict[str, OpModel], fitted: int, op: str, nbytes: float, ranks: int) -> float:
        """``op`` over ``ranks`` ranks from ``ops`` fitted over ``fitted`` ranks (see :meth:`group_time`)."""
        if ranks <= 1:
            return 0.0
        if ranks == fitted or fitted <= 1:
            return ops[op](nbytes)
        share = (ranks - 1) / ranks / ((fitted - 1) / fitted)
        return ops[op](round(nbytes * share))

    def level_time(self, op: str, nbytes: float, ranks: int, *, stride: int = 1) -> dict[str, float]:
        """:meth:`group_time` split by level: ``{"within node": s, "across nodes": s}`` (one level: all
        of it ``"within node"`` — one machine's link)."""
        if self.cross_node is None:
            return {"within node": self.group_time(op, nbytes, ranks, stride=stride), "across nodes": 0.0}
        inside = self.with_free_level("across nodes").group_time(op, nbytes, ranks, stride=stride)
        across = self.with_free_level("within node").group_time(op, nbytes, ranks, stride=stride)
        return {"within node": inside, "across nodes": across}

    def with_free_level(self, level: str) -> CommModel:
        """This two-level model with the collectives of one level (``"within node"`` or
        ``"across nodes"``) free: what the step would be without that link's time (``autodist plan``
        reports what each level adds to the step)."""
        if self.cross_node is None:
            raise ValueError("a one-level comm model has no level to free")
        if level == "within node":
            return replace(self, ops={**self.ops, **{op: _FREE for op in COLLECTIVES if op in self.ops}})
        if level == "across nodes":
            cross = self.cross_node
            return replace(self, cross_node=replace(cross, ops={**cross.ops, **{op: _FREE for op in COLLECTIVES if op in cross.ops}}))
        raise ValueError(f"level {level!r}: expected 'within node' or 'across nodes'")

    @classmethod
    def two_level(cls, within: CommModel, across: CommModel, *, ranks_per_node: int, world_size: int) -> CommModel:
        """A model of ``world_size`` ranks, ``ranks_per_node`` to a node: collectives within a node
        on ``within`` (its ``ops`` fitted for a group of ``ranks_per_node`` ranks: its
        ``world_size``), between nodes on ``across``. ``within`` keeps its own figures for
        everything else (contention, host times, copies)."""
        if world_size % ranks_per_node:
            raise ValueError(f"{world_size} ranks do not fill nodes of {ranks_per_node}")
        if within.world_size != ranks_per_node:
            raise ValueError(f"the within-node model is fitted over {within.world_size} ranks, not the {ranks_per_node} of a node")
        return replace(within, world_size=world_size, ranks_per_node=ranks_per_node, cross_node=across)

    def slowed(self, factor: float) -> CommModel:
        """This model with every collective ``factor`` times slower (latency and bandwidth): an
        emulated slower link, e.g. the level between nodes of a test on one machine."""
        def slow(m: OpModel) -> OpModel:
            return OpModel(Piece(m.small.c * factor, m.small.d * factor), Piece(m.large.c * factor, m.large.d * factor),
                           m.split_bytes, [(b, t * factor) for b, t in m.samples])
        return replace(self, ops={k: slow(v) if k in COLLECTIVES else v for k, v in self.ops.items()},
                       meta=dict(self.meta, slowed=factor))

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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.cross_node is None:  # one level: written as before two-level models (same file)
            del d["ranks_per_node"], d["cross_node"]
        else:
            d["cross_node"] = self.cross_node.to_dict()
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

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
        rpn = d.get("ranks_per_node")
        if rpn is not None and (isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1):
            raise ValueError(f"comm model ranks_per_node {rpn!r} is not a positive integer")
        if d.get("cross_node") is not None:
            d["cross_node"] = cls.from_dict(d["cross_node"])
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

