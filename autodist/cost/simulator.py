"""Predict one training step of a plan: a timeline on compute and comm streams, the step time, the
memory curve and its peak (DESIGN.md section 6).

Two stages:

1. **Compile** the plan into the *program* the runtime will execute on the compute thread: compute
   segments (each unit's forward and backward, from the profile), collective issues and waits, and
   memory changes. The program does not depend on timing: the runtime decides what to issue from
   the plan and the order units run in, never from how long anything took. Compilation follows the
   runtime's rules exactly — prefetch triggers (``runtime/engine.py``'s ``PrefetchSchedule``), own
   group before prefetch, free after the group's last unit, free before reducing, bucket launch in
   order with ``max_inflight_buckets``, flush at the end of backward, persistent refresh after the
   optimizer step.
2. **Run** the program on two resources: the compute thread and one communication queue (collectives
   run one at a time in issue order). While both are busy they share the machine: compute runs
   ``compute_slowdown`` times slower and communication ``comm_slowdown`` times slower, as measured by
   the comm sweep (on a GPU both are ~1). Two steps are simulated; the second is reported, so the
   persistent refresh issued after the first step's optimizer overlaps the second step's forward.

Memory is tracked per event: static state (shards, replicas, optimizer state, persistent full
parameters, reduction buffers) plus gathered parameters (issue to free), backend staging buffers
while a collective runs, activations (end of a unit's forward to the end of its backward), gradients
waiting for their bucket, reduction inputs (launch to wait), and each segment's transient peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..plan import Plan
from ..structure import ModelStructure
from .comm import CommModel
from .profile import Profile

# program opcodes
_C, _ISSUE, _WAIT, _MEM = 0, 1, 2, 3


@dataclass(slots=True)
class CommOp:
    kind: str  # "all_gather" | "all_reduce" | "reduce_scatter" | "copy_out" | "copy_back"
    label: str
    nbytes: int
    seconds: float
    staging_bytes: int  # allocated by the backend while the op runs
    end_bytes: int = 0  # memory released (negative) or taken when the op completes
    stream: int = 0  # 0: the communication queue, 1: the copy queue (offload)
    start: float = -1.0
    end: float = -1.0


@dataclass
class Event:
    stream: str  # "compute" | "comm"
    name: str
    start: float
    end: float


@dataclass
class SimResult:
    step_s: float
    peak_bytes: int
    static_bytes: int
    feasible: bool
    budget_bytes: int | None
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    events: list[Event] = field(default_factory=list)
    memory: list[tuple[float, int]] = field(default_factory=list)  # (time, bytes) over the step
    gathers: int = 0
    reductions: int = 0
    copy_s: float = 0.0
    offload_log: list[tuple[str, int]] = field(default_factory=list)  # (sync point, managed state bytes)

    def summary(self) -> str:
        return (
            f"step {self.step_s * 1e3:.1f} ms (compute {self.compute_s * 1e3:.1f}, comm {self.comm_s * 1e3:.1f}, "
            f"exposed {self.exposed_comm_s * 1e3:.1f}), peak {self.peak_bytes / 2**20:.1f} MiB"
            + ("" if self.feasible else " — over budget")
        )


@dataclass(slots=True)
class _Group:
    index: int
    units: list[str]
    params: list[str]
    residency: str
    fw: int
    bw: int
    full_bytes: int  # all full parameters, compute dtype, padded
    recv_bytes: int  # extra receive buffer (multi-parameter groups copy out of it)
    msg_bytes: int
    trainable: int
    all_trainable: bool
    state: str = "sharded"  # "sharded" | "issued" | "gathered"
    refreshing: bool = False  # an in-place refresh of resident full parameters is in flight
    op: int = -1
    grads_ready: int = 0
    active_last: str = ""


@dataclass(slots=True)
class _Bucket:
    index: int
    op: str
    params: list[str]
    msg_bytes: int
    in_bytes: int  # reduce-scatter input allocated per step
    out_bytes: int  # reduce-scatter output (the local gradients): from launch until zero_grad
    pending: int = 0
    deferred: int = 0  # bytes of gradients held before the input buffer exists
    allocated: bool = False
    opi: int = -1


class Simulator:
    """Predicts plans for one model (profile + structure) on one machine (comm model)."""

    def __init__(
        self,
        profile: Profile,
        structure: ModelStructure,
        comm: CommModel,
        *,
        world_size: int,
        budget_bytes: int | None = None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.profile = profile
        self.structure = structure
        self.comm = comm
        self.world = world_size
        self.budget = budget_bytes
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.order = [u.name for u in profile.units]
        known = set(self.order)
        self.order += [u.name for u in structure.units if u.name not in known]
        self.uprof = {u.name: u for u in profile.units}
        unit_of_param = structure.unit_of_param
        # which units' parameters each unit's module uses (tied weights: extra sites)
        module_of_unit = {u.name: u.module_name for u in structure.units}
        unit_of_module = {u.module_name: u.name for u in structure.units}
        self.uses: dict[str, list[str]] = {u: [u] for u in self.order}
        for pname, info in structure.params.items():
            owner = unit_of_param[pname]
            for mname, _ in info.sites:
                user = unit_of_module.get(mname)
                if user is not None and owner not in self.uses[user]:
                    self.uses[user].append(owner)
        del module_of_unit
        # modules that register parameters of other units but own none (a tied output layer)
        self.site_uses: dict[str, list[str]] = {}
        for mname, after in profile.site_after.items():
            owners = [
                unit_of_param[p] for p, info in structure.params.items() for m, _ in info.sites if m == mname
            ]
            for owner in dict.fromkeys(owners):
                self.site_uses.setdefault(after, []).append(owner)
        # per-parameter sizes
        self.numel = {n: p.numel for n, p in structure.params.items()}
        self.itemsize = {n: p.dtype.itemsize for n, p in structure.params.items()}
        self.rows = {n: (p.shape[0] if p.shape else 1) for n, p in structure.params.items()}
        self.row_numel = {n: (p.numel // p.shape[0] if p.shape and p.shape[0] else 1) for n, p in structure.params.items()}
        self.floating = {n: p.dtype.is_floating_point for n, p in structure.params.items()}
        self.compute_bytes = {n: self.numel[n] * self._compute_itemsize(n) for n in self.numel}
        self.shard_numel = {n: self._shard_numel(n) for n in self.numel}
        self.full_padded_bytes = {n: world_size * self.shard_numel[n] * self._compute_itemsize(n) for n in self.numel}
        self._time_cache: dict[tuple[str, int], float] = {}

    def _time(self, op: str, nbytes: int) -> float:
        key = (op, nbytes)
        t = self._time_cache.get(key)
        if t is None:
            t = self._time_cache[key] = self.comm.time(op, nbytes)
        return t

    # ------------------------------------------------------------------------------------------
    def _compute_itemsize(self, p: str) -> int:
        if self.param_dtype is not None and self.floating[p]:
            return self.param_dtype.itemsize
        return self.itemsize[p]

    def _reduce_itemsize(self, p: str) -> int:
        if self.floating[p] and (self.reduce_dtype or self.param_dtype):
            return (self.reduce_dtype or self.param_dtype).itemsize
        return self.itemsize[p]

    def _shard_numel(self, p: str) -> int:
        return -(-self.rows[p] // self.world) * self.row_numel[p]

    def _local_numel(self, p: str, rank: int = 0) -> int:
        c = -(-self.rows[p] // self.world)
        start = min(rank * c, self.rows[p])
        return (min(start + c, self.rows[p]) - start) * self.row_numel[p]

    # ------------------------------------------------------------------------------------------
    def run(self, plan: Plan, *, record: bool = False) -> SimResult:
        prof = self.profile
        st = self.structure
        world = self.world
        unit_plan = {u.name: u for u in plan.units}
        placement = {p: u.placement for u in plan.units for p in u.params}
        placement_of_unit = {u.name: u.placement for u in plan.units}
        trainable = {n for n, p in st.params.items() if p.requires_grad}
        t_ag = self.comm.transient.get("all_gather", 0.0)
        t_rs = self.comm.transient.get("reduce_scatter", 0.0)
        t_ar = self.comm.transient.get("all_reduce", 0.0)

        # ---- groups ------------------------------------------------------------------------
        groups: list[_Group] = []
        group_of_unit: dict[str, _Group] = {}
        for gi, g in enumerate(plan.gather_groups):
            params = [p for un in g.units for p in unit_plan[un].params]
            full = sum(self.full_padded_bytes[p] for p in params)
            fw = g.prefetch.forward if g.prefetch.forward != "memory" else 1
            bw = g.prefetch.backward if g.prefetch.backward != "memory" else 1
            grp = _Group(
                gi, list(g.units), params, unit_plan[g.units[0]].residency, int(fw), int(bw),
                full_bytes=full, recv_bytes=full if len(params) > 1 else 0, msg_bytes=full,
                trainable=sum(p in trainable for p in params), all_trainable=all(p in trainable for p in params),
            )
            groups.append(grp)
            for un in g.units:
                group_of_unit[un] = grp
        group_of_param = {p: grp for grp in groups for p in grp.params}
        pos = {u: i for i, u in enumerate(self.order)}
        for grp in groups:
            grp.active_last = max(grp.units, key=lambda u: pos.get(u, -1))

        # ---- buckets -------------------------------------------------------------------------
        buckets: list[_Bucket] = []
        bucket_of: dict[str, _Bucket] = {}
        static = 0
        for bi, b in enumerate(plan.buckets):
            n = len(b.params)
            if b.op == "all_reduce":
                msg = sum(self.numel[p] * self._reduce_itemsize(p) for p in b.params) + 4 * n
                bk = _Bucket(bi, b.op, list(b.params), msg, 0, 0)
                static += msg  # persistent bucket buffer; gradients are views of it
            else:
                s = sum(self._shard_numel(p) * self._reduce_itemsize(p) for p in b.params) + 4 * n
                bk = _Bucket(bi, b.op, list(b.params), world * s, world * s, s)
            buckets.append(bk)
            for p in b.params:
                bucket_of[p] = bk

        # ---- static memory -------------------------------------------------------------------
        opt = prof.optimizer
        local_master = 0
        local_tensors = 0
        for u in plan.units:
            for p in u.params:
                size = self.itemsize[p]
                if u.placement == "shard":
                    static += self._shard_numel(p) * size
                    local = self._local_numel(p) * size
                else:
                    static += self.numel[p] * size
                    local = self.numel[p] * size
                    if self.param_dtype is not None and self.floating[p] and self.param_dtype.itemsize != size:
                        static += self.numel[p] * self.param_dtype.itemsize
                if p in trainable:
                    local_master += local
                    local_tensors += 1
        static += int(opt.state_factor * local_master)

        # ---- compile the program -------------------------------------------------------------
        ops: list[CommOp] = []
        prog: list[tuple] = []
        emit = prog.append
        comm = self.comm

        ovh = comm.overhead
        per_gather = ovh.get("per_gather_s", 0.0)
        per_bucket = ovh.get("per_bucket_s", 0.0)

        def issue_gather(grp: _Group) -> None:
            if grp.state != "sharded":
                return
            if per_gather:
                emit((_C, per_gather, "gather bookkeeping", 0))
            secs = self._time("all_gather", grp.msg_bytes)
            ops.append(CommOp("all_gather", f"gather {grp.units[0]}", grp.msg_bytes, secs, int(t_ag * grp.msg_bytes)))
            grp.op = len(ops) - 1
            grp.state = "issued"
            emit((_MEM, grp.full_bytes if not grp.recv_bytes else grp.recv_bytes))
            emit((_ISSUE, grp.op))

        def ensure(grp: _Group) -> None:
            if grp.state == "sharded":
                issue_gather(grp)
            if grp.state == "issued":
                emit((_WAIT, grp.op))
                if grp.recv_bytes:  # copy out of the receive buffer, which is then dropped
                    emit((_C, comm.memcpy(grp.full_bytes), "copy-out", 0))
                    emit((_MEM, (0 if grp.refreshing else grp.full_bytes) - grp.recv_bytes))
                grp.state = "gathered"
                grp.refreshing = False

        def free(grp: _Group) -> None:
            if grp.state == "issued":
                ensure(grp)
            if grp.state == "gathered":
                emit((_MEM, -grp.full_bytes))
                grp.state = "sharded"

        launched = [0]
        finished = [0]

        def finish(bk: _Bucket) -> None:
            emit((_WAIT, bk.opi))
            if bk.op == "reduce_scatter":
                emit((_MEM, -bk.in_bytes))

        def launch(bk: _Bucket) -> None:
            # copy-in of the gradients and the pre-division, both a pass over the message
            emit((_C, per_bucket + 2 * comm.memcpy(bk.msg_bytes), "bucket copy-in", 0))
            if bk.op == "reduce_scatter":
                if not bk.allocated:
                    emit((_MEM, bk.in_bytes - bk.deferred))
                    bk.allocated = True
                    bk.deferred = 0
                emit((_MEM, bk.out_bytes))
                secs = self._time("reduce_scatter", bk.msg_bytes)
                ops.append(CommOp("reduce_scatter", f"bucket{bk.index}", bk.msg_bytes, secs, int(t_rs * bk.msg_bytes)))
            else:
                secs = self._time("all_reduce", bk.msg_bytes)
                ops.append(CommOp("all_reduce", f"bucket{bk.index}", bk.msg_bytes, secs, int(t_ar * bk.msg_bytes)))
            bk.opi = len(ops) - 1
            emit((_ISSUE, bk.opi))

        def launch_ready(sync_limit: int | None) -> None:
            while launched[0] < len(buckets) and buckets[launched[0]].pending == 0:
                launch(buckets[launched[0]])
                launched[0] += 1
                if sync_limit is not None:
                    while launched[0] - finished[0] > sync_limit:
                        finish(buckets[finished[0]])
                        finished[0] += 1

        def grad_ready(p: str) -> None:
            grp = group_of_param.get(p)
            if grp is not None:
                grp.grads_ready += 1
                if grp.all_trainable and grp.grads_ready == grp.trainable and grp.residency != "persistent":
                    free(grp)
            bk = bucket_of.get(p)
            if bk is None:
                return
            bk.pending -= 1
            if bk.op == "reduce_scatter":
                g = self.compute_bytes[p]
                if not bk.allocated:
                    bk.deferred += g
                    emit((_MEM, g))
                    if bk.deferred * 4 >= bk.in_bytes:
                        emit((_MEM, bk.in_bytes - bk.deferred))
                        bk.allocated = True
                        bk.deferred = 0
            if bk.index == launched[0] and bk.pending == 0:
                launch_ready(plan.max_inflight_buckets)

        def entries(positions: dict[str, int], window_of, only_after_forward: bool) -> list[tuple[int, int, _Group]]:
            out = []
            for grp in groups:
                if only_after_forward and grp.residency != "after_forward":
                    continue
                firsts = [positions[u] for u in grp.units if u in positions]
                if not firsts:
                    continue
                first = min(firsts)
                out.append((max(first - window_of(grp), -1), first, grp))
            out.sort(key=lambda e: (e[0], e[1], e[2].index))
            return out

        def fire(sched: list[tuple[int, int, _Group]], cursor: list[int], p: int) -> None:
            while cursor[0] < len(sched) and sched[cursor[0]][0] <= p:
                _, first, grp = sched[cursor[0]]
                cursor[0] += 1
                if first >= p:
                    issue_gather(grp)

        fwd_sched = entries(pos, lambda g: g.fw, False)
        rev = list(reversed(self.order))
        bpos = {u: i for i, u in enumerate(rev)}
        bwd_sched = entries(bpos, lambda g: g.bw, True)
        opt_s = opt.step_seconds(local_tensors, local_master)
        uses_dtensor = any(u.placement == "shard" for u in plan.units)
        if uses_dtensor:
            opt_s += ovh.get("dtensor_opt_per_tensor_s", 0.0) * local_tensors
        # module hooks run on every unit once anything is gathered (swapping units cost the most)
        hook_s = {}
        if groups:
            per_unit = ovh.get("per_unit_s", 0.0)
            for u in self.order:
                hook_s[u] = per_unit / 2 if placement_of_unit.get(u) == "shard" else per_unit / 4
        opt_transient = int(opt.transient_factor * local_master)
        persistent_full = 0
        # ---- offload fragments (autodist/runtime/offload.py) -------------------------------------
        entries = self._offload_entries(plan, placement)
        managed = [0]
        offload_log: list[tuple[str, int]] = []
        state = {k: "resident" for k in entries}
        copy_ops: dict[tuple[str, str], int] = {}

        def copy_out(keys: list[tuple[str, str]]) -> None:
            started = False
            for k in keys:
                if state.get(k) != "resident":
                    continue
                n, r = entries[k]
                kept = n - r
                emit((_MEM, kept))
                managed[0] += kept
                secs = comm.time("d2h", r) + comm.memcpy(kept)
                ops.append(CommOp("copy_out", f"{k[0]}/{k[1]}", r, secs, 0, end_bytes=-n, stream=1))
                copy_ops[k] = len(ops) - 1
                emit((_ISSUE, len(ops) - 1))
                state[k] = "out"
                started = True
            if started:
                offload_log.append(("copy-out start", managed[0]))

        def finish_out() -> None:
            released = False
            for k, st in state.items():
                if st == "out":
                    emit((_WAIT, copy_ops[k]))
                    managed[0] -= entries[k][0]
                    state[k] = "offloaded"
                    released = True
            if released:
                offload_log.append(("copy-out done", managed[0]))

        def copy_back(keys: list[tuple[str, str]]) -> None:
            finish_out()
            started = False
            for k in keys:
                if state.get(k) != "offloaded":
                    continue
                n, r = entries[k]
                emit((_MEM, n))
                managed[0] += n
                secs = comm.time("h2d", r) + comm.memcpy(n - r)
                ops.append(CommOp("copy_back", f"{k[0]}/{k[1]}", r, secs, 0, end_bytes=0, stream=1))
                copy_ops[k] = len(ops) - 1
                emit((_ISSUE, len(ops) - 1))
                state[k] = "back"
                started = True
            if started:
                offload_log.append(("copy-back start", managed[0]))

        def finish_back() -> None:
            late = [k for k, st in state.items() if st in ("out", "offloaded")]
            if late:
                copy_back(late)
            done = False
            for k, st in state.items():
                if st == "back":
                    emit((_WAIT, copy_ops[k]))
                    kept = entries[k][0] - entries[k][1]
                    emit((_MEM, -kept))
                    managed[0] -= kept
                    state[k] = "resident"
                    done = True
            if done:
                offload_log.append(("copy-back done", managed[0]))

        out_at: dict[str, list[tuple[str, str]]] = {}
        back_at: dict[str, list[tuple[str, str]]] = {}
        for o in plan.offload:
            key = (o.param, o.state)
            if key in entries:
                out_at.setdefault(o.out_after, []).append(key) if key not in out_at.get(o.out_after, []) else None
                back_at.setdefault(o.back_from, []).append(key) if key not in back_at.get(o.back_from, []) else None
        managed[0] = sum(n for n, _ in entries.values())

        # The steady-state step. What the previous step leaves behind: persistent groups resident,
        # their refresh (issued by the previous optimizer step) in flight; everything else idle.
        for grp in sorted((g for g in groups if g.residency == "persistent"), key=lambda g: pos.get(g.units[0], 0)):
            secs = self._time("all_gather", grp.msg_bytes)
            ops.append(CommOp("all_gather", f"refresh {grp.units[0]}", grp.msg_bytes, secs, int(t_ag * grp.msg_bytes)))
            grp.op = len(ops) - 1
            grp.state = "issued"
            grp.refreshing = True
            persistent_full += grp.full_bytes
            if grp.recv_bytes:
                emit((_MEM, grp.recv_bytes))
            emit((_ISSUE, grp.op))
        # ... and the copy-out of offloaded state the previous optimizer step started
        copy_out(out_at.get("step", []))
        for bk in buckets:
            bk.pending = sum(p in trainable for p in bk.params)
        # forward
        emit((_C, prof.pre_fwd_s, "forward", 0))
        cursor = [0]
        fire(fwd_sched, cursor, -1)
        for u in self.order:
            up = self.uprof.get(u)
            if f"forward:{u}" in out_at:
                copy_out(out_at[f"forward:{u}"])
            for owner in self.uses[u]:
                grp = group_of_unit.get(owner)
                if grp is not None:
                    ensure(grp)
            fire(fwd_sched, cursor, pos[u])
            if up is not None:
                emit((_C, up.fwd_s + hook_s.get(u, 0.0), f"fwd {u}", up.fwd_peak_bytes))
                emit((_MEM, up.act_bytes))
            grp = group_of_unit.get(u)
            if grp is not None and grp.residency == "after_forward" and grp.active_last == u:
                free(grp)
            # modules that only reuse other units' parameters (tied weights) run after this unit;
            # a group freed after forward is gathered again for them, kept to the end of forward
            for owner in self.site_uses.get(u, ()):
                og = group_of_unit.get(owner)
                if og is not None:
                    ensure(og)
        for grp in groups:
            if grp.residency == "after_forward":
                free(grp)
        emit((_C, prof.post_fwd_s, "loss", prof.loss_fwd_peak_bytes))
        emit((_MEM, prof.loss_act_bytes))
        # backward
        emit((_C, prof.pre_bwd_s, "loss backward", prof.loss_bwd_peak_bytes))
        emit((_MEM, -prof.loss_act_bytes))
        bcursor = [0]
        fire(bwd_sched, bcursor, -1)
        for u in rev:
            up = self.uprof.get(u)
            if f"backward:{u}" in back_at:
                copy_back(back_at[f"backward:{u}"])
            for owner in self.site_uses.get(u, ()):
                og = group_of_unit.get(owner)
                if og is not None:
                    ensure(og)
            for owner in self.uses[u]:
                grp = group_of_unit.get(owner)
                if grp is not None:
                    ensure(grp)
            fire(bwd_sched, bcursor, bpos[u])
            if up is not None:
                emit((_C, up.bwd_s + hook_s.get(u, 0.0), f"bwd {u}", up.bwd_peak_bytes))
                emit((_MEM, -up.act_bytes))
                for p in up.ready:
                    if p in trainable:
                        grad_ready(p)
        emit((_C, prof.post_bwd_s, "backward", 0))
        # flush: launch what is left in order (gradients that never arrived count as zeros), wait all
        while launched[0] < len(buckets):
            launch(buckets[launched[0]])
            launched[0] += 1
        while finished[0] < launched[0]:
            finish(buckets[finished[0]])
            finished[0] += 1
        for grp in groups:
            if grp.residency != "persistent":
                free(grp)
        # the sync point: every offloaded fragment is back before the step
        finish_back()
        # optimizer step (the next step's refresh and copy-out are issued after it), then zero_grad
        emit((_MEM, opt_transient))
        emit((_C, opt_s, "optimizer", 0))
        emit((_MEM, -opt_transient))
        emit((_MEM, -sum(bk.out_bytes for bk in buckets if bk.op == "reduce_scatter")))
        result = self._execute(prog, ops, static + persistent_full, record)
        result.offload_log = offload_log
        return result

    def _offload_entries(self, plan: Plan, placement: dict[str, str]) -> dict[tuple[str, str], tuple[int, int]]:
        """(param, state) -> (bytes of the local state tensor on rank 0, bytes offloaded)."""
        out: dict[tuple[str, str], list] = {}
        for o in plan.offload:
            p = o.param
            if p not in self.numel:
                continue
            numel = self._local_numel(p) if placement.get(p) == "shard" else self.numel[p]
            entry = out.setdefault((p, o.state), [numel, []])
            a, b = max(0, o.fragment[0]), min(o.fragment[1], numel)
            if a < b:
                entry[1].append((a, b))
        result = {}
        for key, (numel, ranges) in out.items():
            merged: list[list[int]] = []
            for a, b in sorted(ranges):
                if merged and a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            item = self.itemsize[key[0]]
            result[key] = (numel * item, sum(b - a for a, b in merged) * item)
        return result

    # ------------------------------------------------------------------------------------------
    def _execute(self, prog: list[tuple], ops: list[CommOp], start_bytes: int, record: bool) -> SimResult:
        copy_slow = (self.comm.compute_slowdown, self.comm.comm_slowdown)
        slow = [self.comm.slowdowns(op.kind, op.nbytes) if op.stream == 0 else copy_slow for op in ops]
        op_rc = [s[0] for s in slow]
        op_rm = [s[1] for s in slow]
        t = 0.0
        # two background queues: 0 communication, 1 offload copies; each runs one op at a time
        queue: list[list[int]] = [[], []]
        qpos = [0, 0]
        cur = [-1, -1]
        rem = [0.0, 0.0]
        live = start_bytes
        peak = live
        curve: list[tuple[float, int]] = [(0.0, live)] if record else []
        timed: list[tuple[float, int]] = []  # memory changed by background ops: (time, delta)
        events: list[Event] = []
        compute_total = 0.0
        names = ("comm", "copy")

        def start_next(s: int, now: float) -> None:
            if qpos[s] < len(queue[s]):
                i = queue[s][qpos[s]]
                qpos[s] += 1
                cur[s] = i
                op = ops[i]
                op.start = now
                rem[s] = op.seconds
                if op.staging_bytes:
                    timed.append((now, op.staging_bytes))
            else:
                cur[s] = -1

        def end_current(s: int, now: float) -> None:
            op = ops[cur[s]]
            op.end = now
            if op.staging_bytes:
                timed.append((now, -op.staging_bytes))
            if op.end_bytes:
                timed.append((now, op.end_bytes))
            if record:
                events.append(Event(names[s], f"{op.kind} {op.label}", op.start, now))
            start_next(s, now)

        def advance_idle(until_op: CommOp) -> None:
            """Compute waits: background queues run at full speed until ``until_op`` is done."""
            nonlocal t
            while until_op.end < 0:
                active = [s for s in (0, 1) if cur[s] >= 0]
                if not active:
                    break
                s = min(active, key=lambda k: rem[k])
                dt = rem[s]
                for k in active:
                    rem[k] -= dt
                t += dt
                end_current(s, t)

        mem_log: list[tuple[float, int]] = []  # compute-thread allocations, in program order
        for ins in prog:
            code = ins[0]
            if code == _MEM:
                mem_log.append((t, ins[1]))
            elif code == _C:
                dur = ins[1]
                if dur <= 0:
                    if ins[3]:  # a transient of no measurable duration still counts for the peak
                        mem_log.extend(((t, ins[3]), (t, -ins[3])))
                    continue
                compute_total += dur
                seg_start = t
                spike = ins[3]
                if spike:
                    mem_log.append((t, spike))
                remaining = dur
                while remaining > 0:
                    active = [s for s in (0, 1) if cur[s] >= 0]
                    if not active:
                        t += remaining
                        break
                    # compute runs at the rate the most demanding running op leaves it; each op at its own
                    rc = max(op_rc[cur[k]] for k in active)
                    t_c = t + remaining * rc
                    s = min(active, key=lambda k: rem[k] * op_rm[cur[k]])
                    t_m = t + rem[s] * op_rm[cur[s]]
                    if t_c <= t_m:
                        dt = t_c - t
                        for k in active:
                            rem[k] -= dt / op_rm[cur[k]]
                        t = t_c
                        break
                    dt = t_m - t
                    remaining -= dt / rc
                    for k in active:
                        rem[k] -= dt / op_rm[cur[k]]
                    t = t_m
                    rem[s] = 0.0
                    end_current(s, t)
                if spike:
                    mem_log.append((t, -spike))
                if record:
                    events.append(Event("compute", ins[2], seg_start, t))
            elif code == _ISSUE:
                s = ops[ins[1]].stream
                queue[s].append(ins[1])
                if cur[s] < 0:
                    start_next(s, t)
            else:  # _WAIT
                advance_idle(ops[ins[1]])
        step_s = t
        # memory: compute-thread changes in program order, background changes merged by time
        if timed:
            timed.sort(key=lambda e: e[0])
            merged: list[tuple[float, int]] = []
            i = 0
            for tt, d in mem_log:
                while i < len(timed) and timed[i][0] < tt:
                    merged.append(timed[i])
                    i += 1
                merged.append((tt, d))
            merged.extend(timed[i:])
            mem_log = merged
        for tt, d in mem_log:
            live += d
            if live > peak:
                peak = live
            if record:
                curve.append((tt, live))
        comm_s = sum(op.seconds for op in ops if op.stream == 0)
        return SimResult(
            step_s=step_s,
            peak_bytes=int(peak),
            static_bytes=int(start_bytes),
            feasible=self.budget is None or peak <= self.budget,
            budget_bytes=self.budget,
            compute_s=compute_total,
            comm_s=comm_s,
            exposed_comm_s=max(0.0, step_s - compute_total),
            events=events,
            memory=curve,
            gathers=sum(1 for op in ops if op.kind == "all_gather"),
            reductions=sum(1 for op in ops if op.kind in ("all_reduce", "reduce_scatter")),
            copy_s=sum(op.seconds for op in ops if op.stream == 1),
        )
