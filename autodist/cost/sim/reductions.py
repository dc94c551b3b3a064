"""Gradient buckets in a compiled step: gradients arriving (held over micro-batches, or taken into
a reduce-scatter's input), buckets launched in order with ``max_inflight_buckets``, and the flush
at the end of backward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...plan import Plan
from .program import COMM, COMPUTE, GRADIENTS, ISSUE, MEM, WAIT, CommOp, ProgramBuilder

if TYPE_CHECKING:
    from ..simulator import Simulator


@dataclass(frozen=True, slots=True)
class BucketCosts:
    """What a bucket's parameters and op fix whatever the plan's other decisions: its buffers and
    what launching it costs (kept by the simulator for every plan with the bucket:
    :meth:`Reductions.costs`)."""

    msg_bytes: int
    in_bytes: int  # reduce-scatter input allocated per step
    out_bytes: int  # reduce-scatter output
    copy_in_s: float  # the compute thread's share of launching it: copy-in, pre-division, issue
    seconds: float  # the collective (hybrid sharding: then the all-reduce across the replicas)
    staging_bytes: int  # the backend's buffer for it (an all-reduce: while it runs)
    trainable: int  # its parameters that get gradients
    host_s: float = 0.0  # of copy_in_s, the host's own: the runtime's work per bucket and the issue


@dataclass(slots=True)
class Bucket:
    index: int
    op: str
    params: list[str]
    msg_bytes: int
    in_bytes: int  # reduce-scatter input allocated per step
    out_bytes: int  # reduce-scatter output (the local gradients): from launch until zero_grad
    costs: BucketCosts  # what its parameters and op fix (Reductions.costs)
    pending: int = 0
    deferred: int = 0  # bytes of gradients held before the input buffer exists
    allocated: bool = False
    opi: int = -1
    every: bool = False  # reduce-scattered in every micro-batch (sharded accumulation)
    held: int = 0  # bytes of gradients accumulated outside the bucket over earlier micro-batches
    out_live: bool = False  # the reduce-scatter output (the sharded gradient) is allocated
    restore: bool = False  # a copy of the accumulated sharded gradient is held during the reduction
    staging: int = 0  # the backend's buffer for the reduce-scatter in flight (launch to wait)


class Reductions:
    """The plan's buckets and the compute thread's part in reducing them: buckets launch in index
    order once all their gradients are in, at most ``max_inflight_buckets`` in flight."""

    def __init__(self, sim: Simulator, plan: Plan, out: ProgramBuilder) -> None:
        self.sim = sim
        self.out = out
        self.sync_limit = plan.max_inflight_buckets
        self.per_bucket = sim.comm.overhead.get("per_bucket_s", 0.0)
        self.t_rs = sim.comm.transient.get("reduce_scatter", 0.0)
        self.t_ar = sim.comm.transient.get("all_reduce", 0.0)
        self.placement = {p: u.placement for u in plan.units for p in u.params}
        # replicated parameters whose autograd leaf is not the visible one (a compute-dtype copy, or
        # the plain tensor behind a DTensor when anything is sharded): their gradients are held
        # until their bucket launches (runtime/reducer.py [Note: copy-in at launch])
        dtensors = any(u.placement == "shard" for u in plan.units)
        self.behind = {p for p, pl in self.placement.items() if pl != "shard" and (dtensors or sim._cast(p))}
        sharded_accumulation = {
            p for u in plan.units if u.placement == "shard" and u.accumulate == "sharded" for p in u.params
        }
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[str, Bucket] = {}
        self.static_bytes = 0  # the persistent all-reduce buffers (gradients are views of them)
        parts = sim._parts
        for bi, b in enumerate(plan.buckets):
            key = ("bucket", b.op, tuple(b.params))
            c = parts.get(key)
            if c is None:
                c = parts[key] = self.costs(b.op, b.params)
            bk = Bucket(bi, b.op, list(b.params), c.msg_bytes, c.in_bytes, c.out_bytes, c)
            if b.op == "all_reduce":
                self.static_bytes += c.msg_bytes
            else:
                bk.every = all(p in sharded_accumulation for p in b.params)
            self.buckets.append(bk)
            for p in b.params:
                self.bucket_of[p] = bk
        # the previous step's reduce-scatter outputs: zero_grad dropped their gradients, and their
        # storage goes at the next forward (runtime/reducer.py, ``release_if_unused``)
        self.carried = [bk for bk in self.buckets if bk.op == "reduce_scatter"]
        self.active: list[Bucket] = self.buckets  # the buckets reduced in this micro-batch
        self.launched = 0
        self.finished = 0
        self.held: set[str] = set()  # parameters whose gradients accumulate outside their bucket

    def costs(self, op: str, params: list[str]) -> BucketCosts:
        """A bucket's buffers and launch costs: an all-reduce's message is its gradients (reduce
        dtype) and a flag per parameter; a reduce-scatter spans the shard group, each rank's shard
        of every gradient padded."""
        sim = self.sim
        n = len(params)
        if op == "all_reduce":
            msg = sum(sim.numel[p] * sim._reduce_itemsize(p) for p in params) + 4 * n
            in_bytes = out_bytes = 0
            secs = sim._time("all_reduce", msg)
            staging = int(self.t_ar * msg)
        else:
            world = sim.shard_world  # a reduce-scatter spans the shard group
            out_bytes = sum(sim._shard_numel(p) * sim._reduce_itemsize(p) for p in params) + 4 * n
            msg = in_bytes = world * out_bytes
            secs = sim._time_at("reduce_scatter", msg, world)
            if world < sim.world:  # hybrid sharding: then the shard is all-reduced across the replicas
                secs += sim._time_at("all_reduce", out_bytes, sim.world // world, stride=world)
            # [Note: reduce-scatter staging] (held from launch to wait: see launch)
            staging = int(self.t_rs * msg)
        # copy-in of the gradients and the pre-division, both a pass over the message; a
        # reduce-scatter's input is new each time ([Note: gradients are fresh memory])
        host = sim._host(op, msg)
        fresh = sim._first_touch(in_bytes) if op == "reduce_scatter" else 0.0
        copy_in = self.per_bucket + host + fresh + 2 * sim._memcpy(msg)
        return BucketCosts(msg, in_bytes, out_bytes, copy_in, secs, staging, sum(p in sim.trainable for p in params),
                           self.per_bucket + host)

    def start_micro_batch(self, sync: bool) -> None:
        """A micro-batch reduces every bucket when it synchronises, else only those accumulated sharded."""
        self.active = self.buckets if sync else [bk for bk in self.buckets if bk.every]
        self.launched = self.finished = 0
        for bk in self.buckets:
            bk.pending = bk.costs.trainable
            bk.allocated = False
            bk.deferred = 0

    def release_carried(self) -> None:
        """The first forward releases the previous step's reduce-scatter outputs."""
        for bk in self.carried:
            self.out.emit((MEM, -bk.out_bytes, GRADIENTS))

    def finish(self, bk: Bucket) -> None:
        out = self.out
        out.emit((WAIT, bk.opi))
        if bk.op == "reduce_scatter":
            out.emit((MEM, -bk.in_bytes - bk.staging, COMM))
            if bk.restore:  # the accumulated sharded gradient, saved while the output was overwritten
                out.emit((MEM, -bk.out_bytes, GRADIENTS))
                bk.restore = False

    # [Note: gradients are fresh memory] A gradient autograd produces is a new tensor: the matrix
    # product (or whatever op) writes it into memory allocated then, so on a CPU host a large one
    # is written into fresh pages (measure/sweep.py [Note: fresh memory]) whatever the runtime does
    # with it next. A replicated bucket copies it into its view and frees it (runtime/reducer.py
    # [Note: gradients as bucket views]): the copy is the bucket's copy-in below; the fresh pages
    # are paid as in the profile's backward, which frees its gradients as they arrive.
    def launch(self, bk: Bucket) -> None:
        out, c = self.out, bk.costs
        # copy-in of the gradients and the pre-division, both a pass over the message (its costs)
        out.emit((COMPUTE, c.copy_in_s, "bucket copy-in", 0, c.host_s, 0.0))
        if bk.op == "reduce_scatter" and not bk.allocated:
            # the gradients held so far are copied into the input, then dropped
            out.emit((MEM, bk.in_bytes, COMM))
            out.emit((MEM, -bk.deferred, GRADIENTS))
            bk.allocated = True
            bk.deferred = 0
        elif bk.deferred:  # a replicated bucket's held gradients, copied into their slots
            out.emit((MEM, -bk.deferred, GRADIENTS))
            bk.deferred = 0
        if bk.held:  # gradients accumulated outside the bucket over earlier micro-batches
            out.emit((MEM, -bk.held, GRADIENTS))
            bk.held = 0
        if bk.op == "reduce_scatter":
            if bk.out_live:
                out.emit((MEM, bk.out_bytes, GRADIENTS))  # the sharded gradient so far, added back after
                bk.restore = True
            else:
                out.emit((MEM, bk.out_bytes, GRADIENTS))
                bk.out_live = True
            # [Note: reduce-scatter staging] the backend's own buffer (gloo: one shard-sized
            # message, allocated when the collective is issued) belongs to its work object, which
            # the runtime drops at the wait, not when the collective completes: it is held from
            # the launch to the wait, in program order
            bk.staging = c.staging_bytes
            out.emit((MEM, bk.staging, COMM))
            bk.opi = out.add_op(CommOp("reduce_scatter", f"bucket{bk.index}", bk.msg_bytes, c.seconds, 0))
        else:
            bk.opi = out.add_op(CommOp("all_reduce", f"bucket{bk.index}", bk.msg_bytes, c.seconds, c.staging_bytes))
        out.log.actions.append(("reduce", str(bk.index)))
        out.emit((ISSUE, bk.opi))

    def launch_ready(self) -> None:
        """Launch the buckets whose gradients are all in, in order; past the in-flight limit, wait
        for the oldest."""
        act = self.active
        while self.launched < len(act) and act[self.launched].pending == 0:
            self.launch(act[self.launched])
            self.launched += 1
            if self.sync_limit is not None:
                while self.launched - self.finished > self.sync_limit:
                    self.finish(act[self.finished])
                    self.finished += 1

    def flush(self) -> None:
        """The end of backward: launch what is left in order (gradients that never arrived count as
        zeros), and wait for all."""
        act = self.active
        while self.launched < len(act):
            self.launch(act[self.launched])
            self.launched += 1
        while self.finished < self.launched:
            self.finish(act[self.finished])
            self.finished += 1

    def held_bytes(self, p: str) -> int:
        """A gradient accumulated over micro-batches: in the reduce dtype for sharded or cast parameters."""
        sim = self.sim
        return sim.numel[p] * (sim._reduce_itemsize(p) if self.placement.get(p) == "shard" or sim._cast(p) else sim.itemsize[p])

    def grad_ready(self, p: str, sync: bool) -> None:
        """Parameter ``p``'s gradient is in (``sync``: in the micro-batch that reduces every bucket)."""
        bk = self.bucket_of.get(p)
        if bk is None:
            return
        out, held = self.out, self.held
        if p in held:
            # a gradient accumulated over earlier micro-batches: this micro-batch's gradient is a
            # new tensor until autograd adds it in (the first one is taken as it is)
            out.emit((COMPUTE, 0.0, f"accumulate {p}", self.sim.compute_bytes[p]))
        if not (sync or bk.every):
            # no reduction in this micro-batch: the gradient accumulates locally (in the reduce
            # dtype for sharded or cast parameters) until the synchronising backward
            if p not in held:
                held.add(p)
                g = self.held_bytes(p)
                bk.held += g
                out.emit((MEM, g, GRADIENTS))
            return
        bk.pending -= 1
        if (bk.op == "reduce_scatter" and not bk.allocated) or (bk.op == "all_reduce" and p in self.behind):
            self._take_into_input(bk, p)
        act = self.active
        if self.launched < len(act) and act[self.launched] is bk and bk.pending == 0:
            self.launch_ready()

    def _take_into_input(self, bk: Bucket, p: str) -> None:
        """A bucket holds ``p``'s gradient until it launches: then a reduce-scatter's input is
        allocated, the gradients copied in (into a replicated bucket's slots), and only then dropped
        (runtime/reducer.py [Note: copy-in at launch])."""
        out = self.out
        g = self.sim.compute_bytes[p]
        bk.deferred += g
        if p in self.held:
            # autograd added this micro-batch's gradient into the one held since earlier
            # micro-batches: that tensor is what is taken now, not a second one
            hb = self.held_bytes(p)
            bk.held -= hb
            out.emit((MEM, g - hb, GRADIENTS))
        else:
            out.emit((MEM, g, GRADIENTS))
