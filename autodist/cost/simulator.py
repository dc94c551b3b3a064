"""Predict one training step of a plan: a timeline on compute and comm streams, the step time, the
memory curve and its peak (docs/design.md, "Simulator").

:class:`Simulator` is the facade; its parts are in ``autodist/cost/sim/``:

1. **Compile** (:mod:`.sim.emit`, with :mod:`.sim.gathers`, :mod:`.sim.reductions`,
   :mod:`.sim.recompute` and :mod:`.sim.offload`): the plan becomes the *program* the runtime will
   execute on the compute thread (:mod:`.sim.program`), by the runtime's own rules
   (``autodist/schedule.py``). The program does not depend on timing.
2. **Run** (:mod:`.sim.execute`): the program on the compute thread and two background queues —
   collectives and offload copies — with the compute thread's own share of each collective, the
   slowdown of each while they overlap, and the cost of a wait that blocks; on an asynchronous
   device (a GPU) the compute thread is two clocks, the host issuing and the compute stream running.

Memory is tracked per event: static state (shards, replicas, optimizer state, persistent full
parameters, reduction buffers, and the previous step's reduce-scatter outputs until the forward
releases them) plus gathered parameters (issue to free), backend staging buffers (an all-gather's
from when its group's backend takes it up to its completion — the persistent refreshes' from the
step's start, as they were taken up before — and a reduce-scatter's from launch to wait, as its
work object owns it), activations (end of a unit's forward to the end of its backward), gradients
waiting for their bucket, reduction inputs (launch to wait), and each segment's transient peak.

The simulator's ``[Note: ...]`` blocks sit next to the code they explain: [Note: what a blocked
wait costs], [Note: collectives taken up at once] and [Note: what a wait returns after] in
``sim/execute.py``; [Note: gradients are fresh memory] and [Note: reduce-scatter staging] in
``sim/reductions.py``; [Note: refresh buffers] in ``sim/gathers.py``.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from ..plan import Plan
from ..schedule import memory_windows, resident_state_bytes
from ..structure import ModelStructure
from .comm import TRAIN_BYTES, CommModel
from .profile import Profile
from .sim.emit import StepEmitter, StepOrders
from .sim.execute import execute, op_rates
from .sim.program import (
    ACTIVATIONS,
    CATEGORY_NAMES,
    COMM,
    COMPUTE,
    GATHERED,
    GRADIENTS,
    LIBRARIES,
    N_CATEGORIES,
    OPTIMIZER,
    ORDER_CHECK_BYTES,
    PARAMETERS,
    CommOp,
    DurationEstimator,
    Event,
    Instruction,
    Program,
    SimResult,
    scaled,
)

__all__ = [
    "ACTIVATIONS", "CATEGORY_NAMES", "COMM", "GATHERED", "GRADIENTS", "LIBRARIES", "N_CATEGORIES", "OPTIMIZER",
    "ORDER_CHECK_BYTES", "PARAMETERS", "CommOp", "DurationEstimator", "Event", "Program", "SimResult", "Simulator",
    "scaled",
]


# [Note: the cycle collector while simulating] Compiling and timing a plan allocates thousands of
# container objects that live for the whole simulation (gather groups, buckets, operations, the
# plan itself), and the cycle collector promotes each one that outlives a young collection towards
# the oldest generation; every so many promotions it traverses every object the process holds (the
# model, torch's own). On 800 units that full collection came every few simulations and cost about
# a third of each (19 of 56 ms, measured), and it finds nothing: what a simulation allocates holds
# no reference cycles and goes by reference counting when it returns. So a simulation, and a search
# of many, runs with the collector paused, and it is switched back on as it was found
# (``paused_cycle_collection``); a caller that paused it keeps it paused.
@contextmanager
def paused_cycle_collection() -> Iterator[None]:
    """The cycle collector paused for the block ([Note: the cycle collector while simulating])."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


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
        estimator: DurationEstimator | None = None,
    ) -> None:
        """``estimator``: corrects the analytic durations of a compiled step before it is timed
        (``autodist.lab.learned.Estimator``; see :meth:`run`). Default: the analytic model alone."""
        self.profile = profile
        self.structure = structure
        self.comm = comm
        self.world = world_size
        self.shard_world = world_size  # the ranks a sharded parameter is split over (see sharded_over)
        self.budget = budget_bytes
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.estimator = estimator
        # kernels run apart from the host that issues them: two clocks ([Note: two clocks on an
        # asynchronous device] in sim/execute.py)
        self.asynchronous = profile.device != "cpu"
        self.order = [u.name for u in profile.units]
        known = set(self.order)
        self.order += [u.name for u in structure.units if u.name not in known]
        self.unit_set = set(self.order)  # read only
        self.order_index = {u: i for i, u in enumerate(self.order)}  # read only
        self.uprof = {u.name: u for u in profile.units}
        unit_of_param = self.unit_of_param = structure.unit_of_param
        self.trainable = frozenset(n for n, p in structure.params.items() if p.requires_grad)
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
        # modules that read descendants' parameters directly (nn.MultiheadAttention's out_proj): a unit
        # gathers them with its own; a module that owns none gathers them where the first of them runs
        for mname, used in structure.functional_uses.items():
            user = unit_of_module.get(mname)
            if user is None:
                user = min((u for u in used if u in self.uses), key=lambda u: self.order.index(u), default=None)
            if user is None:
                continue
            for owner in used:
                if owner in self.uses and owner not in self.uses[user]:
                    self.uses[user].append(owner)
        self.module_of = module_of_unit  # unit -> its module's name ([Note: nested units])
        self.block_of = {u.name: u.block for u in structure.units}
        # modules that register parameters of other units but own none (a tied output layer)
        self.site_uses: dict[str, list[str]] = {}
        site_params: dict[str, list[str]] = {}  # the unit such a module follows -> the parameters it registers
        for mname, after in profile.site_after.items():
            params = [p for p, info in structure.params.items() if any(m == mname for m, _ in info.sites)]
            site_params.setdefault(after, []).extend(params)
            for owner in dict.fromkeys(unit_of_param[p] for p in params):
                self.site_uses.setdefault(after, []).append(owner)
        # per-parameter sizes
        self.numel = {n: p.numel for n, p in structure.params.items()}
        self.itemsize = {n: p.dtype.itemsize for n, p in structure.params.items()}
        self.rows = {n: (p.shape[0] if p.shape else 1) for n, p in structure.params.items()}
        self.row_numel = {n: (p.numel // p.shape[0] if p.shape and p.shape[0] else 1) for n, p in structure.params.items()}
        self.floating = {n: p.dtype.is_floating_point for n, p in structure.params.items()}
        # computed in param_dtype under the policy ([Note: batch norm keeps its dtype])
        self.casts = {n: p.dtype.is_floating_point and not p.keeps_dtype for n, p in structure.params.items()}
        self.compute_bytes = {n: self.numel[n] * self._compute_itemsize(n) for n in self.numel}
        # [Note: a tied parameter's first gradient] A parameter that a later module registers too (a
        # tied output layer: ``head.weight is wte.weight``) gets two gradient contributions in
        # backward: the later module's, early, and its owner's, last. Autograd holds the first in
        # the owner's AccumulateGrad input until the second arrives and the two are summed: a
        # gradient-sized tensor, in the compute dtype, held through most of the backward, in every
        # plan (DDP's and FSDP2's steps hold it too). The profile measures the owner's backward with
        # it already held (its transient peak is the sum's), so the simulator holds it from the
        # backward of the unit the later module follows (``site_after``) to the end of the owner's
        # backward. Measured on the zoo's gpt (an 8192 x 256 embedding, 8 MiB): a plan whose peak
        # falls late in backward (optimizer state copied back there) measured 104.7 MiB against
        # 96.7 predicted without it, 96.7 + 8 with it (docs/fidelity.md, "Version 16").
        self.held_grads: dict[str, list[tuple[str, int]]] = {  # unit the site follows -> [(owner unit, bytes)]
            after: [(unit_of_param[p], self.compute_bytes[p]) for p in params if structure.params[p].requires_grad]
            for after, params in site_params.items()
        }
        self.shard_numel = {n: self._shard_numel(n) for n in self.numel}
        self.full_padded_bytes = {n: world_size * self.shard_numel[n] * self._compute_itemsize(n) for n in self.numel}
        self._time_cache: dict[tuple[str, int], float] = {}
        self._group_cache: dict[tuple[str, int, int, int], float] = {}
        self._slowdown_cache: dict[tuple[str, int, bool], tuple[float, float, float]] = {}
        self._rates_cache: dict[tuple[str, int], tuple[float, float, float, float]] = {}
        self._orders: StepOrders | None = None
        # what a part of a plan fixes whatever the plan's other decisions (a gather group's sizes
        # and costs, a bucket's messages, a unit's memory), by the part's own decisions: kept for
        # every plan of this simulator (a sharded_over or compiled_for copy keeps its own)
        self._parts: dict[tuple, Any] = {}
        self._block_units: dict[str, list[str]] | None = None  # block -> its units the plan can recompute
        self._sharded_over: dict[int, Simulator] = {world_size: self}
        # the compiled blocks this simulator times as compiled (see compiled_for), each unit's block
        self.compiled_unit_block: dict[str, str] = {}
        self._compiled_for: dict[tuple[int, frozenset[str]], Simulator] = {}

    def orders(self) -> StepOrders:
        """The orders backward passes begin and end in and forwards finish in, and where each
        gradient arrives: the same for every plan of this model, computed once."""
        if self._orders is None:
            self._orders = StepOrders.of(self)
        return self._orders

    def sharded_over(self, ranks: int) -> Simulator:
        """This simulator for plans that shard over groups of ``ranks`` (``Plan.shard_ranks``):
        shard and gathered sizes for that group (hybrid sharding: replicated across the groups)."""
        sim = self._sharded_over.get(ranks)
        if sim is None:
            sim = copy.copy(self)
            sim._parts = {}
            sim.shard_world = ranks
            sim.shard_numel = {n: sim._shard_numel(n) for n in self.numel}
            sim.full_padded_bytes = {n: ranks * sim.shard_numel[n] * self._compute_itemsize(n) for n in self.numel}
            self._sharded_over[ranks] = sim
        return sim

    def compiled_for(self, blocks: list[str]) -> Simulator:
        """This simulator with ``blocks`` (``Plan.compile``) timed as compiled.

        [Note: a compiled block in the simulator] A compiled block's units keep their place in the
        program (gathers, frees, activations and recomputation per unit, as the runtime's one site
        on the block does them at its boundary), with their forward and backward times scaled by the
        block's measured compiled-over-eager ratio (``Profile.compiled_blocks``; 1 where not
        measured), and on an asynchronous device their host times by the ratio of the host's times
        to issue it (fewer, larger kernels: there often the larger gain). Every gradient the block's units produce arrives when the last of them ends its
        backward: the compiled backward is one autograd node, and its gradients reach their
        buckets only when it returns — later than eager, which is what compiling can cost in overlap.
        The emitter fires prefetch at the block's boundary (:class:`~.sim.emit.StepEmitter`)."""
        blocks = [b for b in blocks if any(self.block_of.get(u) == b for u in self.order)]
        key = (self.shard_world, frozenset(blocks))
        if not blocks:
            return self
        sim = self._compiled_for.get(key)
        if sim is not None:
            return sim
        sim = copy.copy(self)
        sim._compiled_for = {}
        sim._parts = {}
        sim.compiled_unit_block = {u: b for u in self.order if (b := self.block_of.get(u)) is not None and b in key[1]}
        sim.uprof = dict(self.uprof)
        for u, b in sim.compiled_unit_block.items():
            measured = self.profile.compiled_blocks.get(b)
            up = self.uprof.get(u)
            if measured is not None and up is not None:
                sim.uprof[u] = replace(up, fwd_s=up.fwd_s * measured.fwd_scale, bwd_s=up.bwd_s * measured.bwd_scale,
                                       fwd_host_s=up.fwd_host_s * measured.host_fwd_scale,
                                       bwd_host_s=up.bwd_host_s * measured.host_bwd_scale)
        orders = self.orders()
        last_bwd: dict[str, str] = {}
        for u in orders.bstart:
            if u in sim.compiled_unit_block:
                last_bwd[sim.compiled_unit_block[u]] = u
        start: dict[str, list[str]] = {u: list(ps) for u, ps in orders.ready_at_start.items()}
        end: dict[str, list[str]] = {u: list(ps) for u, ps in orders.ready_at_end.items()}
        late: dict[str, list[str]] = {}
        for u in orders.bstart:  # in backward order, so each block's gradients keep their order
            block = sim.compiled_unit_block.get(u)
            if block is not None:
                late.setdefault(last_bwd[block], []).extend(start.pop(u, []) + end.pop(u, []))
        for u, ps in late.items():
            start[u] = ps
        sim._orders = replace(orders, ready_at_start=start, ready_at_end=end)
        self._compiled_for[key] = sim
        return sim

    def compile_seconds(self, plan: Plan) -> float:
        """The one-off cost of compiling ``plan``'s blocks, as the profile measured it (a block
        reusing an identical block's compiled code costs what its own first run measured: ~0)."""
        return sum(c.compile_s for b, c in self.profile.compiled_blocks.items() if b in plan.compile)

    def _time_at(self, op: str, nbytes: int, ranks: int, *, stride: int = 1) -> float:
        """``op`` of ``nbytes`` over a group of ``ranks`` ranks ``stride`` apart (a shard group:
        consecutive ranks; the replicas of a hybrid plan's shard: a shard group apart), on the
        link(s) it crosses (``CommModel.group_time``). Nothing on one rank."""
        if ranks == self.world:
            return self._time(op, nbytes)
        if ranks <= 1:
            return 0.0
        key = (op, nbytes, ranks, stride)
        t = self._group_cache.get(key)
        if t is None:
            t = self._group_cache[key] = self.comm.group_time(op, nbytes, ranks, stride=stride)
        return t

    def _time(self, op: str, nbytes: int) -> float:
        key = (op, nbytes)
        t = self._time_cache.get(key)
        if t is None:
            t = self._time_cache[key] = self.comm.time(op, nbytes)
        return t

    def _compute_sensitivity(self) -> float:
        """How much more this model's compute slows under communication than the comm model's
        reference computation: as the profile measured the two under the same train of collectives
        (``Profile.contention_sensitivity``); for a profile of before that, its own slowdown under
        the train against the sweep's figure for the reference under an all-reduce of
        ``TRAIN_BYTES``; 1 when the profile measured neither (see [Note: the model's own
        contention] in autodist/measure/contention.py)."""
        if not self.comm.contention:
            return 1.0
        if self.profile.contention_sensitivity is not None:
            return self.profile.contention_sensitivity
        measured = self.profile.contended_slowdown
        if measured is None:
            return 1.0
        return measured / max(self.comm.slowdowns("all_reduce", TRAIN_BYTES)[0], 1e-9)

    def _order_check_s(self) -> float:
        """The end-of-backward collective-order check: one all-reduce of a few integers, issued and
        (on the CPU) waited for by the compute thread; on an accelerator it completes off the step."""
        n = ORDER_CHECK_BYTES
        return self._host("all_reduce", n) + (self._time("all_reduce", n) if self.comm.device == "cpu" else 0.0)

    def _first_touch(self, nbytes: int) -> float:
        """``comm.first_touch_s``, cached by size."""
        key = ("first touch", nbytes)
        t = self._time_cache.get(key)
        if t is None:
            t = self._time_cache[key] = self.comm.first_touch_s(nbytes)
        return t

    def _memcpy(self, nbytes: int) -> float:
        """``comm.memcpy``, cached by size."""
        key = ("memcpy", nbytes)
        t = self._time_cache.get(key)
        if t is None:
            t = self._time_cache[key] = self.comm.memcpy(nbytes)
        return t

    def _host(self, op: str, nbytes: int) -> float:
        """The compute thread's own time to issue and collect one collective."""
        key = ("host " + op, nbytes)
        t = self._time_cache.get(key)
        if t is None:
            t = self._time_cache[key] = self.comm.host_time(op, nbytes)
        return t

    _SAME: Any = object()

    def variant(self, *, profile: Profile | None = None, comm: CommModel | None = None, budget_bytes: Any = _SAME) -> Simulator:
        """This simulator (model, world, mixed-precision policy, estimator) with another profile,
        comm model or budget."""
        return Simulator(
            profile or self.profile, self.structure, comm or self.comm, world_size=self.world,
            budget_bytes=self.budget if budget_bytes is Simulator._SAME else budget_bytes,
            param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype, estimator=self.estimator,
        )

    # ------------------------------------------------------------------------------------------
    def _compute_itemsize(self, p: str) -> int:
        if self.param_dtype is not None and self.casts[p]:
            return self.param_dtype.itemsize
        return self.itemsize[p]

    def _reduce_itemsize(self, p: str) -> int:
        dtype = self.reduce_dtype or self.param_dtype
        if self.floating[p] and dtype:
            return dtype.itemsize
        return self.itemsize[p]

    def _shard_numel(self, p: str) -> int:
        return -(-self.rows[p] // self.shard_world) * self.row_numel[p]

    def _local_numel(self, p: str, rank: int = 0) -> int:
        c = -(-self.rows[p] // self.shard_world)
        start = min(rank * c, self.rows[p])
        return (min(start + c, self.rows[p]) - start) * self.row_numel[p]

    # ------------------------------------------------------------------------------------------
    def run(self, plan: Plan, *, record: bool = False) -> SimResult:
        """Predict one step of ``plan``. With an estimator, the step is timed twice: analytically,
        then with each compute section's and each operation's duration scaled by the estimator's
        correction of what the first timing predicted (``analytic_step_s`` keeps the first)."""
        with paused_cycle_collection():
            return self._run(plan, record)

    def _run(self, plan: Plan, record: bool) -> SimResult:
        program = self.compile(plan)
        if self.estimator is None:
            result = self._execute(program.prog, program.ops, program.static, record)
        else:
            analytic = self._execute(program.prog, program.ops, program.static, True)
            durations, op_seconds = self.estimator.corrections(program, analytic)
            prog, ops = scaled(program, durations, op_seconds)
            result = self._execute(prog, ops, program.static, record)
            result.analytic_step_s = analytic.step_s
        result.offload_log = program.offload_log
        result.actions = program.actions
        result.compile_s = self.compile_seconds(plan)
        return result

    def phase_seconds(self, plan: Plan) -> dict[str, float]:
        """The compute thread's predicted time in each phase of a step of ``plan`` — ``forward``
        (the loss included), ``backward`` (to the flush), ``optimizer`` — hooks, copies and the
        optimizer as the program charges them, waits for collectives not included: what a step
        timed phase by phase is compared with (``tools/bench.py`` records both). On an asynchronous
        device, where the bench drains the device at each phase's end, each phase is the longer of
        its work on the compute stream and its work on the host ([Note: two clocks on an
        asynchronous device] in sim/execute.py)."""
        program = self.compile(plan)
        bounds = [(0, "forward"), *program.sections, (len(program.prog), "")]  # what precedes the first section is forward's
        device = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        host = dict(device)
        for (start, name), (end, _) in zip(bounds, bounds[1:]):
            head = name.split(" @")[0]
            phase = ("optimizer" if head == "optimizer" else "forward" if head in ("forward", "loss") or head.startswith("fwd ")
                     else "backward")
            for ins in program.prog[start:end]:
                if ins[0] != COMPUTE:
                    continue
                if self.asynchronous and len(ins) > 4:
                    device[phase] += ins[1] - ins[4]
                    host[phase] += ins[4] + ins[5]
                else:
                    device[phase] += ins[1]
        return {k: max(v, host[k]) for k, v in device.items()}

    def compile(self, plan: Plan) -> Program:
        """The program of one steady-state step of ``plan`` (:class:`~autodist.cost.sim.emit.StepEmitter`)."""
        return StepEmitter(self.sharded_over(plan.shard_ranks).compiled_for(plan.compile), plan).program()

    def _execute(self, prog: list[Instruction], ops: list[CommOp], static: list[int], record: bool) -> SimResult:
        """``prog`` timed (:func:`~autodist.cost.sim.execute.execute`) on this simulator's machine."""
        return execute(prog, ops, static, comm=self.comm, sensitivity=self._compute_sensitivity(),
                       budget=self.budget, record=record, slowdowns=self._slowdowns, rates=self._rates,
                       asynchronous=self.asynchronous)

    def _rates(self, op: str, nbytes: int) -> tuple[float, float, float, float]:
        """A collective's rates on the timeline (:func:`~.sim.execute.op_rates`), cached by
        operation and size."""
        key = (op, nbytes)
        r = self._rates_cache.get(key)
        if r is None:
            r = self._rates_cache[key] = op_rates(self._slowdowns, self._compute_sensitivity(), op, nbytes)
        return r

    def _slowdowns(self, op: str, nbytes: int, *, scaled: bool = True) -> tuple[float, float, float]:
        """``comm.slowdowns``, cached by operation and size."""
        key = (op, nbytes, scaled)
        s = self._slowdown_cache.get(key)
        if s is None:
            s = self._slowdown_cache[key] = self.comm.slowdowns(op, nbytes, scaled=scaled)
        return s

    def _memory_windows(self, plan: Plan) -> list[int]:
        """The windows ``"memory"`` prefetches get, by the runtime's rule ([Note: memory windows] in
        ``autodist/schedule.py``) against this simulator's budget."""
        if not any("memory" in (g.prefetch.forward, g.prefetch.backward) for g in plan.gather_groups):
            return [1] * len(plan.gather_groups)
        unit_plan = {u.name: u for u in plan.units}
        sharded = {p for u in plan.units if u.placement == "shard" for p in u.params}
        group_params = [[p for un in g.units for p in unit_plan[un].params] for g in plan.gather_groups]
        group_bytes = [sum(self.compute_bytes[p] for p in ps) for ps in group_params]
        resident = resident_state_bytes(
            [(self.shard_numel[p] if p in sharded else self.numel[p]) * self.itemsize[p] for p in self.numel],
            [b for g, b in zip(plan.gather_groups, group_bytes) if unit_plan[g.units[0]].residency == "persistent"],
        )
        return memory_windows(group_bytes, resident, self.budget)

    def _cast(self, p: str) -> bool:
        """A replicated parameter computed with in another dtype (a compute copy, mixed precision)."""
        return self.param_dtype is not None and self.casts[p] and self.param_dtype.itemsize != self.itemsize[p]

    def _recomputed_blocks(self, plan: Plan) -> dict[str, list[str]]:
        """The plan's recomputed blocks and their units in forward order (blocks the model already
        checkpoints itself are measured as such by the profile and not recomputed twice)."""
        if self._block_units is None:
            self._block_units = {}
            for u in self.order:
                b = self.block_of.get(u)
                if b is not None and u not in self.profile.recompute_anchor:
                    self._block_units.setdefault(b, []).append(u)
        return {b: self._block_units[b] for b in plan.recompute if b in self._block_units}
