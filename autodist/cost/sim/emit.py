"""Compile a plan into the program of one steady-state step (:class:`StepEmitter`).

The program is what the runtime will execute on the compute thread: compute segments (each unit's
forward and backward, from the profile), collective issues and waits, and memory changes. It does
not depend on timing: the runtime decides what to issue from the plan and the order units run in,
never from how long anything took. Compilation follows the runtime's rules exactly — prefetch
triggers (``autodist/schedule.py``), own group before prefetch, free after the group's last unit
(:mod:`.gathers`), free before reducing, bucket launch in order with ``max_inflight_buckets``,
flush at the end of backward (:mod:`.reductions`), recomputation at its anchor
(:mod:`.recompute`), offload copies at theirs (:mod:`.offload`), persistent refresh at the step's
start. One steady-state step is compiled with a preamble: the persistent refresh the previous
step's optimizer made due and the offload copy-outs it started are in flight at its start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...plan import Plan
from ...schedule import TriggerCursor, backward_order, encloses, finish_order, group_fire_positions
from .gathers import Gathers, Group
from .offload import OffloadCopies
from .program import (
    ACTIVATIONS,
    COMPUTE,
    GATHERED,
    GRADIENTS,
    LIBRARIES,
    MEM,
    N_CATEGORIES,
    OPTIMIZER,
    PARAMETERS,
    Program,
    ProgramBuilder,
)
from .recompute import Recomputation
from .reductions import Reductions

if TYPE_CHECKING:
    from ..simulator import Simulator


@dataclass(frozen=True)
class StepOrders:
    """Backward passes begin in ``bstart`` order and end in ``bend`` order, forwards finish in
    ``finishing`` order ([Note: nested units]). Gradients the profile saw arrive during a unit's
    backward (``ready_at_start``): those of an enclosing unit's parameters arrive when that
    backward has ended (``ready_at_end``). None of it depends on the plan."""

    bstart: list[str]
    bend: list[str]
    finishing: list[str]
    ready_at_start: dict[str, list[str]]
    ready_at_end: dict[str, list[str]]
    fwd_name: dict[str, str]  # unit -> "fwd <unit>" (its forward's section and compute name)
    bwd_name: dict[str, str]  # unit -> "bwd <unit>"

    @classmethod
    def of(cls, sim: Simulator) -> StepOrders:
        ready_at_start: dict[str, list[str]] = {}
        ready_at_end: dict[str, list[str]] = {}
        for u in sim.order:
            up = sim.uprof.get(u)
            for p in up.ready if up is not None else ():
                if p not in sim.trainable:
                    continue
                owner = sim.unit_of_param[p]
                late = owner != u and encloses(sim.module_of.get(owner, owner), sim.module_of.get(u, u))
                (ready_at_end if late else ready_at_start).setdefault(u, []).append(p)
        return cls(backward_order(sim.order, sim.module_of), list(reversed(sim.order)),
                   finish_order(sim.order, sim.module_of), ready_at_start, ready_at_end,
                   {u: f"fwd {u}" for u in sim.order}, {u: f"bwd {u}" for u in sim.order})


class StepEmitter:
    """The program of one step of ``plan``: :meth:`program` emits it once, through the gather
    groups, the buckets, the recomputations and the offload copies, each holding its own state."""

    def __init__(self, sim: Simulator, plan: Plan) -> None:
        self.sim = sim
        self.plan = plan
        self.out = ProgramBuilder()
        self.trainable = sim.trainable
        self.micro_batches = max(1, plan.grad_accum_steps)
        self.gathers = Gathers(sim, plan, self.out)
        self.reductions = Reductions(sim, plan, self.out)
        self.static = [0] * N_CATEGORIES
        self.static[GRADIENTS] += self.reductions.static_bytes  # persistent bucket buffers; gradients are views of them
        self._static_memory()
        self._backward_order()
        self.recompute = Recomputation(sim, plan, self.out, self.gathers, self.bstart)
        self.fwd_trig = self.gathers.forward_triggers()
        self.bwd_trig = self.gathers.backward_triggers(self.recompute.need)
        self._compiled_boundaries()
        self._step_costs()
        self.offload = OffloadCopies(sim, plan, self.out)

    # ---- what the step is made of --------------------------------------------------------------
    def _static_memory(self) -> None:
        """Parameters as each rank holds them, optimizer state, the math libraries' workspaces, and
        the compute-dtype copies of replicated parameters (``cast_copies``): cast in the forward,
        released when the optimizer step makes them stale (runtime/params.py ``release_casts``)."""
        sim, static, parts = self.sim, self.static, self.sim._parts
        param_bytes = cast_copies = local_master = local_tensors = 0
        self.unit_memory: list[tuple[int, int, int, int]] = []  # per unit of the plan: _unit_memory
        for u in self.plan.units:
            sharded = u.placement == "shard"
            key = ("unit memory", u.name, sharded, tuple(u.params))
            m = parts.get(key)
            if m is None:
                m = parts[key] = self._unit_memory(u.params, sharded)
            self.unit_memory.append(m)
            param_bytes += m[0]
            cast_copies += m[1]
            local_master += m[2]
            local_tensors += m[3]
        static[PARAMETERS] += param_bytes
        self.cast_copies = cast_copies
        self.local_master = local_master  # bytes of trainable parameters this rank updates
        self.local_tensors = local_tensors
        static[OPTIMIZER] += int(sim.profile.optimizer.state_factor * self.local_master)
        static[LIBRARIES] += sim.profile.library_bytes  # [Note: what the allocator holds for libraries]

    def _unit_memory(self, params: list[str], sharded: bool) -> tuple[int, int, int, int]:
        """One unit's parameters as this rank holds them: bytes, compute-dtype copies (replicated
        parameters computed with in another dtype), trainable bytes it updates and their tensors
        (kept by the simulator for every plan placing the unit so)."""
        sim = self.sim
        held = cast = master = tensors = 0
        for p in params:
            size = sim.itemsize[p]
            if sharded:
                held += sim._shard_numel(p) * size
                local = sim._local_numel(p) * size
            else:
                held += sim.numel[p] * size
                local = sim.numel[p] * size
                if sim.param_dtype is not None and sim.floating[p] and sim.param_dtype.itemsize != size:
                    cast += sim.numel[p] * sim.param_dtype.itemsize
            if p in sim.trainable:
                master += local
                tensors += 1
        return held, cast, master, tensors

    def _backward_order(self) -> None:
        """The simulator's :class:`StepOrders` (the same for every plan)."""
        orders = self.sim.orders()
        self.bstart = orders.bstart
        self.bend = orders.bend
        self.finishing = orders.finishing
        self.ready_at_start = orders.ready_at_start
        self.ready_at_end = orders.ready_at_end
        self.fwd_name = orders.fwd_name
        self.bwd_name = orders.bwd_name

    def _compiled_boundaries(self) -> None:
        """Where each unit fires prefetch: its own position, or for a unit of a compiled block the
        block's boundary — forward at the position of its last unit, backward at the need of its
        first (the runtime's one site on the block: [Note: hooks at a compiled block's boundary] in
        autodist/runtime/compiled.py)."""
        sim = self.sim
        # collapsed groups fire at their last position (autodist/schedule.py [Note: hooks per gather group])
        self.fwd_fire = self.gathers.fire_pos  # read only
        self.bwd_fire = group_fire_positions(self.recompute.need, [g.units for g in self.gathers.collapsed])
        self.first_of_block: set[str] = set()
        if not sim.compiled_unit_block:
            return
        self.fwd_fire = dict(self.fwd_fire)
        fwd, bwd = dict(self.fwd_fire), dict(self.bwd_fire)
        units: dict[str, list[str]] = {}
        for u in sim.order:
            b = sim.compiled_unit_block.get(u)
            if b is not None:
                units.setdefault(b, []).append(u)
        for us in units.values():
            self.first_of_block.add(us[0])
            for u in us:
                if us[-1] in fwd:
                    self.fwd_fire[u] = fwd[us[-1]]
                if us[0] in bwd:
                    self.bwd_fire[u] = bwd[us[0]]

    def _step_costs(self) -> None:
        """The optimizer step's time and transient memory, and each unit's hook time: module hooks
        run on every unit once anything is gathered (swapping units cost the most)."""
        sim, plan = self.sim, self.plan
        opt = sim.profile.optimizer
        ovh = sim.comm.overhead
        self.opt_s = opt.step_seconds(self.local_tensors, self.local_master)
        self.opt_host_s = 0.0  # of opt_s, the host's alone: DTensor's dispatch of a sharded step
        if any(u.placement == "shard" for u in plan.units):
            self.opt_host_s = ovh.get("dtensor_opt_per_tensor_s", 0.0) * self.local_tensors
            self.opt_s += self.opt_host_s
        self.hook_s: dict[str, float] = {}
        if self.gathers.groups:
            per_unit = ovh.get("per_unit_s", 0.0)
            sharded = {u.name for u in plan.units if u.placement == "shard"}
            compiled = sim.compiled_unit_block
            self.hook_s = {
                u: per_unit / 2 if u in sharded else per_unit / 4
                for u in sim.order
                if u not in compiled or u in self.first_of_block  # a compiled block's hooks run once, at its boundary
            }
            # a group enacted at its root hooks the root once; each of its units costs its
            # parameters' swaps and gradient hooks (a comm model measured before this figure existed
            # has none: every unit is charged as if hooked)
            if "per_grouped_unit_s" in ovh:
                grouped = ovh["per_grouped_unit_s"]
                for grp in self.gathers.collapsed:
                    for u in grp.units:
                        self.hook_s[u] = grouped / 2 + (per_unit / 2 if u == grp.root_unit else 0.0)
        # each replicated parameter's gradient-ready hook runs in its unit's backward (a comm model
        # measured before this figure existed has none: 0)
        per_param = ovh.get("per_param_s", 0.0)
        self.grad_hook_s: dict[str, float] = {}
        if per_param:
            for up, memory in zip(plan.units, self.unit_memory):
                if up.placement != "shard":
                    self.grad_hook_s[up.name] = per_param * memory[3]  # its trainable parameters
        self.opt_transient = int(opt.transient_factor * self.local_master)

    # ---- the step ------------------------------------------------------------------------------
    def program(self) -> Program:
        self._preamble()
        for micro in range(self.micro_batches):
            sync = micro == self.micro_batches - 1
            at = f" @m{micro}" if micro else ""
            self.reductions.start_micro_batch(sync)
            self.gathers.start_micro_batch()
            self._forward(micro, at)
            self._backward(sync, at)
        self._optimizer_step()
        out = self.out
        return Program(out.prog, out.ops, self.static, out.log, self.offload.log, out.sections, self.plan,
                       self.sim.compute_bytes)

    def _preamble(self) -> None:
        """What the previous step leaves behind: persistent groups resident, their refresh (made due
        by the previous optimizer step, issued at this step's forward start) in flight; the previous step's reduce-scatter outputs, held
        while the refreshes are in flight; the copy-out of offloaded state the previous optimizer
        step started; everything else idle."""
        self.static[GATHERED] += self.gathers.refresh_in_flight()
        self.static[GRADIENTS] += sum(bk.out_bytes for bk in self.reductions.carried)
        self.offload.copy_out(self.offload.out_at.get("step", []))
        if self.cast_copies:
            self.out.emit((MEM, self.cast_copies, PARAMETERS))

    def _forward(self, micro: int, at: str) -> None:
        """One micro-batch's forward and loss (the runtime's rules: autodist/runtime/engine.py,
        autodist/schedule.py): the optimizer step's copy-outs are finished and released first."""
        sim, out, gathers, rc = self.sim, self.out, self.gathers, self.recompute
        prof = sim.profile
        emit, prog, section = out.emit, out.prog, out.sections.append
        out.section(f"forward{at}")
        if micro == 0:
            self.reductions.release_carried()
        self.offload.finish_out()
        # the runtime's fixed work per step (a comm model measured before this figure existed has none)
        per_step = self.sim.comm.overhead.get("per_step_s", 0.0)
        emit((COMPUTE, prof.pre_fwd_s + per_step, "forward", 0, per_step, prof.pre_fwd_host_s))
        fcur = TriggerCursor(self.fwd_trig)
        trig, n_trig = fcur.trig, len(fcur.trig)
        gathers.fire(fcur, -1)
        used_by: dict[str, list[Group]] = {}
        started: set[str] = set()
        nfinished = 0
        finishing, n_finishing = self.finishing, len(self.finishing)
        out_at = self.offload.out_at if micro == 0 else {}
        uprof, fwd_name, fwd_fire, hook_s, site_uses = sim.uprof, self.fwd_name, self.fwd_fire, self.hook_s, sim.site_uses
        block_first, in_recomputed = rc.block_first, rc.in_recomputed
        forward_uses, forward_finished = gathers.forward_uses, gathers.forward_finished
        for u in sim.order:
            name = fwd_name[u]
            section((len(prog), name + at if at else name))
            up = uprof.get(u)
            if out_at and f"forward:{u}" in out_at:
                self.offload.copy_out(out_at[f"forward:{u}"])
            if u in block_first:  # a recomputed block keeps only its input until its backward
                emit((MEM, prof.block_input_bytes.get(block_first[u], 0), ACTIVATIONS))
            used = forward_uses(u, up)
            pos = fwd_fire[u]
            if fcur.next < n_trig and trig[fcur.next].at <= pos:
                gathers.fire(fcur, pos)
            if up is not None:
                hook = hook_s.get(u, 0.0)
                emit((COMPUTE, up.fwd_s + hook, name, up.fwd_peak_bytes, hook, up.fwd_host_s))
                if u not in in_recomputed:
                    emit((MEM, up.act_bytes, ACTIVATIONS))
            used_by[u] = used
            started.add(u)
            # the forwards that finish now (this one, and those enclosing it whose last unit it is)
            while nfinished < n_finishing and finishing[nfinished] in started:
                f = finishing[nfinished]
                nfinished += 1
                forward_finished(f, used_by[f])
            # modules that only reuse other units' parameters (tied weights) run after this unit;
            # a group freed after forward is gathered again for them, kept to the end of forward
            if u in site_uses:
                gathers.ensure_owners(site_uses[u])
        out.section(f"loss{at}")
        gathers.free_unless_persistent("after_forward")
        self.offload.finish_out()  # copy-outs started at forward units
        emit((COMPUTE, prof.post_fwd_s, "loss", prof.loss_fwd_peak_bytes, 0.0, prof.post_fwd_host_s))
        emit((MEM, prof.loss_act_bytes, ACTIVATIONS))

    def _backward(self, sync: bool, at: str) -> None:
        """One micro-batch's backward, down to the flush and the collective-order check."""
        sim, out, gathers, rc = self.sim, self.out, self.gathers, self.recompute
        prof = sim.profile
        emit, prog, section = out.emit, out.prog, out.sections.append
        out.section(f"loss backward{at}")
        emit((COMPUTE, prof.pre_bwd_s, "loss backward", prof.loss_bwd_peak_bytes, 0.0, prof.pre_bwd_host_s))
        emit((MEM, -prof.loss_act_bytes, ACTIVATIONS))
        bcur = TriggerCursor(self.bwd_trig)
        trig, n_trig = bcur.trig, len(bcur.trig)
        gathers.fire(bcur, -1)
        begun: set[str] = set()
        nended = 0
        bend, n_bend = self.bend, len(self.bend)
        back_at = self.offload.back_at if sync else {}
        uprof, bwd_name, bwd_fire, site_uses, uses = sim.uprof, self.bwd_name, self.bwd_fire, sim.site_uses, sim.uses
        hook_s, grad_hook_s = self.hook_s, self.grad_hook_s
        held_grads = sim.held_grads  # [Note: a tied parameter's first gradient] in cost/simulator.py
        holding: dict[str, int] = {}
        ready_at_start, ready_at_end = self.ready_at_start, self.ready_at_end
        before, after, block_last_bwd = rc.before, rc.after, rc.block_last_bwd
        group_of_unit, ensure, backward_ended = gathers.group_of_unit, gathers.ensure, gathers.backward_ended
        gathers_ready, reductions_ready = gathers.grad_ready, self.reductions.grad_ready
        for u in self.bstart:
            name = bwd_name[u]
            section((len(prog), name + at if at else name))
            up = uprof.get(u)
            if back_at and f"backward:{u}" in back_at:
                self.offload.copy_back(back_at[f"backward:{u}"])
            if u in site_uses:
                gathers.ensure_owners(site_uses[u])
            for owner, nbytes in held_grads.get(u, ()):
                if owner not in begun and owner != u:  # the owner's backward, and its sum, come later
                    emit((MEM, nbytes, GRADIENTS))
                    holding[owner] = holding.get(owner, 0) + nbytes
            for owner in uses[u]:  # gathered for its backward (a gathered group needs nothing)
                grp = group_of_unit.get(owner)
                if grp is not None and grp.state != "gathered":
                    ensure(grp)
            pos = bwd_fire[u]
            if bcur.next < n_trig and trig[bcur.next].at <= pos:
                gathers.fire(bcur, pos)
            if u in before:
                rc.run(before, u, bcur)
            if up is not None:
                hook = hook_s.get(u, 0.0) + grad_hook_s.get(u, 0.0)
                emit((COMPUTE, max(0.0, up.bwd_s + hook), name, up.bwd_peak_bytes, hook, up.bwd_host_s))
                emit((MEM, -up.act_bytes, ACTIVATIONS))
            if u in holding:
                emit((MEM, -holding.pop(u), GRADIENTS))
            for p in ready_at_start.get(u, ()):
                gathers_ready(p)
                reductions_ready(p, sync)
            begun.add(u)
            # the backward passes that end now (this one, and those enclosing it whose last unit
            # it is): groups no later backward reads are freed
            while nended < n_bend and bend[nended] in begun:
                e = bend[nended]
                nended += 1
                backward_ended(e, uprof.get(e))
                for p in ready_at_end.get(e, ()):
                    gathers_ready(p)
                    reductions_ready(p, sync)
                if e in block_last_bwd:
                    emit((MEM, -prof.block_input_bytes.get(block_last_bwd[e], 0), ACTIVATIONS))
            if u in after:
                rc.run(after, u, bcur)
        out.section(f"backward{at}")
        emit((COMPUTE, prof.post_bwd_s, "backward", 0))
        self.reductions.flush()
        gathers.free_unless_persistent()
        if gathers.groups:  # the collective-order check (runtime/comm.py): a small all-reduce, waited for on the CPU
            check = sim._order_check_s()
            emit((COMPUTE, check, "collective-order check", 0, check, 0.0))

    def _optimizer_step(self) -> None:
        """The sync point (every offloaded fragment is back before the step), the optimizer step,
        and the compute thread's share of the next step's refresh (it and the copy-outs the step
        starts run in the next step's preamble); zero_grad then drops the gradients, the reduce-scatter outputs'
        storage staying until the next forward."""
        out = self.out
        out.section("optimizer")
        self.offload.finish_back()
        if self.cast_copies:
            out.emit((MEM, -self.cast_copies, PARAMETERS))
        out.emit((MEM, self.opt_transient, OPTIMIZER))
        out.emit((COMPUTE, self.opt_s, "optimizer", 0, self.opt_host_s, 0.0))
        out.emit((MEM, -self.opt_transient, OPTIMIZER))
        self.gathers.issue_refresh()
