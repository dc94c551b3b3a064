"""Gather groups in a compiled step: issuing a group's all-gather at its prefetch trigger, waiting
for it where a unit needs it (the copy-out of a multi-parameter group), freeing it by the runtime's
rules, and the persistent groups' refresh at the step's start."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...plan import Plan
from ...schedule import (
    Trigger,
    TriggerCursor,
    collapsed_groups,
    freed_after_forward,
    gathering_units,
    group_fire_positions,
    group_label,
    positions,
    triggers,
)
from ..profile import UnitProfile
from .program import COMM, COMPUTE, GATHERED, ISSUE, MEM, WAIT, CommOp, ProgramBuilder

if TYPE_CHECKING:
    from ..simulator import Simulator


@dataclass(frozen=True, slots=True)
class GroupCosts:
    """What a gather group's units fix whatever the plan's other decisions: its sizes (compute
    dtype, padded for the shard group) and what each of its actions costs (kept by the simulator
    for every plan with the group: :meth:`Gathers.costs`)."""

    full_bytes: int
    trainable: int
    all_trainable: bool
    label: str
    landing_s: float  # the backend's cost of writing into freshly allocated memory
    copy_out_fresh_s: float  # the copy-out's cost of writing the freshly allocated full tensors
    issue_s: float  # the compute thread's share of issuing its all-gather
    gather_s: float  # the all-gather, landing in fresh memory
    refresh_s: float  # the all-gather refreshing resident full parameters in place
    staging_bytes: int  # the backend's buffer while the all-gather runs
    copy_out_s: float  # copying the full tensors out of the receive buffer (several parameters)
    gather_label: str
    refresh_label: str


@dataclass(slots=True)
class Group:
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
    costs: GroupCosts  # what its units fix (Gathers.costs)
    label: str  # its units, as the action log names them (schedule.group_label)
    state: str = "sharded"  # "sharded" | "issued" | "gathered"
    refreshing: bool = False  # an in-place refresh of resident full parameters is in flight
    op: int = -1
    grads_ready: int = 0
    pending_bwd: int = 0  # forwards (units) that used it this micro-batch and have not finished backward
    untokened: bool = False  # used by a forward whose inputs need no gradient
    untokened_open: bool = False  # ... whose parameters' gradients are not all in yet
    fwd_done: set[str] = field(default_factory=set)
    # enacted at its root module ([Note: hooks per gather group] in autodist/schedule.py): the unit
    # whose forward is the root's (its first in forward order) carries the post-backward signal
    root_unit: str | None = None


def distinct(groups: Iterable[Group | None]) -> list[Group]:
    """The distinct groups of an iterable (by identity), in order, without ``None``."""
    seen: set[int] = set()
    out = []
    for g in groups:
        if g is not None and id(g) not in seen:
            seen.add(id(g))
            out.append(g)
    return out


class Gathers:
    """The plan's gather groups and what the compute thread does with them ([Note: prefetch
    triggers] in ``autodist/schedule.py``: own group before prefetch, free after the group's last
    unit)."""

    def __init__(self, sim: Simulator, plan: Plan, out: ProgramBuilder) -> None:
        self.sim = sim
        self.out = out
        self.actions = out.log.actions  # ActionLog.add's list, appended to directly on this hot path
        self.per_gather = sim.comm.overhead.get("per_gather_s", 0.0)
        self.t_ag = sim.comm.transient.get("all_gather", 0.0)
        unit_plan = {u.name: u for u in plan.units}
        self.groups: list[Group] = []
        self.group_of_unit: dict[str, Group] = {}
        by_memory = sim._memory_windows(plan)
        parts = sim._parts
        for gi, g in enumerate(plan.gather_groups):
            params = [p for un in g.units for p in unit_plan[un].params]
            key = ("gather group", tuple(g.units), tuple(params))
            c = parts.get(key)
            if c is None:
                c = parts[key] = self.costs(g.units, params)
            fw = g.prefetch.forward if g.prefetch.forward != "memory" else by_memory[gi]
            bw = g.prefetch.backward if g.prefetch.backward != "memory" else by_memory[gi]
            full = c.full_bytes
            grp = Group(gi, list(g.units), params, unit_plan[g.units[0]].residency, int(fw), int(bw), full,
                        full if len(params) > 1 else 0, full, c.trainable, c.all_trainable, c, c.label)
            self.groups.append(grp)
            for un in g.units:
                self.group_of_unit[un] = grp
        self.used: dict[str, list[Group]] = {}  # unit -> groups_used(unit), as asked
        self.group_of_param = {p: grp for grp in self.groups for p in grp.params}
        self.gathering = gathering_units([g.units for g in self.groups], [g.residency for g in self.groups])
        self.pos = positions(sim.order, self.gathering)
        collapsed = collapsed_groups(plan, sim.structure, memo=sim._parts)
        order_index = sim.order_index
        for gi in collapsed:
            grp = self.groups[gi]
            grp.root_unit = min(grp.units, key=lambda u: order_index.get(u, len(order_index)))
        self.collapsed = [self.groups[gi] for gi in collapsed]
        self.fire_pos = group_fire_positions(self.pos, [g.units for g in self.collapsed])

    def costs(self, units: Sequence[str], params: Sequence[str]) -> GroupCosts:
        """A gather group's sizes and costs ([Note: fresh memory] in measure/sweep.py: the receive
        buffer (several parameters) or the full tensor (one) the backend writes, and each full
        tensor the copy-out writes)."""
        sim, trainable = self.sim, self.sim.trainable
        full = sum(sim.full_padded_bytes[p] for p in params)
        landing = sim._first_touch(full)
        fresh = sum(sim._first_touch(sim.full_padded_bytes[p]) for p in params) if len(params) > 1 else 0.0
        return GroupCosts(
            full_bytes=full, trainable=sum(p in trainable for p in params),
            all_trainable=all(p in trainable for p in params), label=group_label(units), landing_s=landing,
            copy_out_fresh_s=fresh, issue_s=self.per_gather + sim._host("all_gather", full),
            gather_s=sim._time_at("all_gather", full, sim.shard_world) + landing,
            refresh_s=sim._time_at("all_gather", full, sim.shard_world), staging_bytes=int(self.t_ag * full),
            copy_out_s=sim._memcpy(full) + fresh, gather_label=f"gather {units[0]}", refresh_label=f"refresh {units[0]}",
        )

    # ---- triggers ----------------------------------------------------------------------------
    def forward_triggers(self) -> list[Trigger]:
        pos = self.pos
        return triggers([g.units for g in self.groups], [g.fw for g in self.groups], pos,
                        missing=max(pos.values(), default=-1) + 1)

    def backward_triggers(self, need: dict[str, int]) -> list[Trigger]:
        """Backward prefetch among the groups freed after forward, at the positions ``need`` gives
        (recomputed units are first needed at their anchor)."""
        late = [g for g in self.groups if g.residency == "after_forward"]
        return [
            Trigger(t.at, t.first, late[t.group].index)
            for t in triggers([g.units for g in late], [g.bw for g in late], need)
        ]

    def fire(self, cursor: TriggerCursor, p: int) -> None:
        """Issue the groups whose triggers position ``p`` reaches."""
        trig, nxt = cursor.trig, cursor.next
        if nxt < len(trig) and trig[nxt].at <= p:  # (most positions fire nothing)
            for gi in cursor.fire(p):
                self.issue(self.groups[gi])

    # ---- one group's states: sharded -> issued -> gathered -> sharded --------------------------
    def issue(self, grp: Group) -> None:
        if grp.state != "sharded":
            return
        out, c = self.out, grp.costs
        emit = out.emit
        if c.issue_s:
            emit((COMPUTE, c.issue_s, "gather bookkeeping", 0, c.issue_s, 0.0))
        # the backend writes the gathered tensor into memory allocated for it now (c.gather_s)
        grp.op = out.add_op(CommOp("all_gather", c.gather_label, grp.msg_bytes, c.gather_s, c.staging_bytes))
        grp.state = "issued"
        self.actions.append(("gather", grp.label))
        emit((MEM, grp.full_bytes if not grp.recv_bytes else grp.recv_bytes, GATHERED))
        emit((ISSUE, grp.op))

    def ensure(self, grp: Group) -> None:
        if grp.state == "sharded":
            self.issue(grp)
        if grp.state == "issued":
            emit = self.out.emit
            emit((WAIT, grp.op))
            if grp.recv_bytes:
                # the full tensors are allocated, filled from the receive buffer, and only then
                # is the buffer dropped: both are held during the copy-out
                emit((MEM, 0 if grp.refreshing else grp.full_bytes, GATHERED))
                emit((COMPUTE, grp.costs.copy_out_s, "copy-out", 0))
                emit((MEM, -grp.recv_bytes, GATHERED))
            grp.state = "gathered"
            grp.refreshing = False

    def ensure_owners(self, owners: Iterable[str]) -> None:
        """Gather (or wait for) the groups of the units ``owners``, in order."""
        for owner in owners:
            grp = self.group_of_unit.get(owner)
            if grp is not None:
                self.ensure(grp)

    def free(self, grp: Group) -> None:
        if grp.state == "issued":
            self.ensure(grp)
        if grp.state == "gathered":
            self.out.emit((MEM, -grp.full_bytes, GATHERED))
            grp.state = "sharded"
            self.actions.append(("free", grp.label))

    def post_backward(self, grp: Group) -> None:
        """Free ``grp`` when no backward computation reads it any more (the runtime's rule:
        every forward that used it has finished its backward)."""
        if grp.residency != "persistent" and grp.pending_bwd <= 0 and not grp.untokened_open:
            self.free(grp)

    def free_unless_persistent(self, residency: str | None = None) -> None:
        """Free every group not persistent (of the given residency only, when given)."""
        for grp in self.groups:
            if grp.residency != "persistent" and residency in (None, grp.residency):
                self.free(grp)

    # ---- a micro-batch -----------------------------------------------------------------------
    def start_micro_batch(self) -> None:
        for grp in self.groups:
            grp.grads_ready = 0
            grp.pending_bwd = 0
            grp.untokened = grp.untokened_open = False
            if grp.fwd_done:
                grp.fwd_done = set()

    def groups_used(self, u: str) -> list[Group]:
        """The distinct groups of the units whose parameters unit ``u`` uses, in order (read only)."""
        used = self.used.get(u)
        if used is None:
            uses = self.sim.uses[u]
            if len(uses) == 1:  # its own alone
                grp = self.group_of_unit.get(uses[0])
                used = [grp] if grp is not None else []
            else:
                used = distinct(self.group_of_unit.get(o) for o in uses)
            self.used[u] = used
        return used

    def forward_uses(self, u: str, up: UnitProfile | None) -> list[Group]:
        """Unit ``u``'s forward: the groups it uses are gathered, and each will wait for this
        forward's backward to end (its post-backward signal, or, when its inputs need no gradient,
        its parameters' gradients). The groups, read only."""
        used = self.used.get(u)
        if used is None:
            used = self.groups_used(u)
        for grp in used:
            self.ensure(grp)
            if grp.root_unit is not None and grp.root_unit != u:
                continue  # the root's forward carries the group's signal
            if up is None or up.input_requires_grad:
                grp.pending_bwd += 1
            else:
                grp.untokened = grp.untokened_open = True
        return used

    def forward_finished(self, f: str, used: Sequence[Group]) -> None:
        """Unit ``f``'s forward has finished: a group freed after forward goes once its units' have."""
        every, uses = self.sim.unit_set, self.sim.uses[f]
        for grp in used:
            grp.fwd_done.update(uses)
            if grp.residency == "after_forward" and freed_after_forward(grp.units, grp.fwd_done, every):
                self.free(grp)

    def backward_ended(self, e: str, ep: UnitProfile | None) -> None:
        """Unit ``e``'s backward has ended: groups no later backward reads are freed."""
        used = self.used.get(e)
        for grp in used if used is not None else self.groups_used(e):
            if grp.root_unit is not None and grp.root_unit != e:
                continue
            if ep is None or ep.input_requires_grad:
                grp.pending_bwd -= 1
                if not grp.untokened:
                    self.post_backward(grp)

    def grad_ready(self, p: str) -> None:
        """Parameter ``p``'s gradient is in. A forward whose inputs need no gradient has no
        post-backward signal: its end is when all of its parameters' gradients are in (see
        runtime/backward.py)."""
        grp = self.group_of_param.get(p)
        if grp is not None:
            grp.grads_ready += 1
            if grp.untokened and grp.all_trainable and grp.grads_ready == grp.trainable:
                grp.untokened_open = False
                self.post_backward(grp)

    # ---- the persistent groups' refresh --------------------------------------------------------
    def refresh_in_flight(self) -> int:
        """The refresh of the persistent groups the previous step's optimizer issued, in flight at
        this step's start; the bytes of their resident full parameters.

        [Note: refresh buffers] The backend's buffer for a refresh (gloo: message-sized) was
        allocated before this step, while the previous step's reduce-scatter outputs were still
        held: gloo takes up the refreshes issued together on its worker threads at once (measured
        on wide-mlp: docs/fidelity.md, "Measurements behind the simulator's rules"). Each is held
        from the step's start until its refresh completes."""
        out = self.out
        persistent_full = 0
        for grp in (g for g in self.groups if g.residency == "persistent"):  # in plan order, as the runtime issues them
            c = grp.costs
            staging = c.staging_bytes
            grp.op = out.add_op(CommOp("all_gather", c.refresh_label, grp.msg_bytes, c.refresh_s, 0,
                                       end_bytes=-staging, end_category=COMM))
            grp.state = "issued"
            grp.refreshing = True
            self.actions.append(("gather", grp.label))
            persistent_full += grp.full_bytes
            if grp.recv_bytes:
                out.emit((MEM, grp.recv_bytes, GATHERED))
            if staging:
                out.emit((MEM, staging, COMM))
            out.emit((ISSUE, grp.op))
        return persistent_full

    def issue_refresh(self) -> None:
        """The compute thread's share of issuing the next step's refresh, charged after the optimizer
        step: the runtime issues it at the next forward's start, the same point of a steady-state
        step (the refresh itself runs in the next step's preamble)."""
        refresh_s = sum(g.costs.issue_s for g in self.groups if g.residency == "persistent")
        if refresh_s:
            self.out.emit((COMPUTE, refresh_s, "gather bookkeeping", 0, refresh_s, 0.0))
