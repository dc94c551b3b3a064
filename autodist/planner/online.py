"""``plan="auto"``: cache lookup, profiling, search and switching (docs/design.md, "Lifecycle").

* **Cache hit** — the plan stored for this model, input signature, world size, device, backend,
  torch version, optimizer kind, budget and mixed precision is used: no profiling, no search.
* **Miss with example inputs** — profile now (a few forward/backward passes of the plain module,
  no optimizer step, nothing left changed), get the comm model (cached per machine, else a sweep of
  what the model's plans can issue, :func:`comm_needs`; the up-front message says what and for about
  how long), search on rank 0, broadcast, store.
* **Miss without example inputs** — wrap with a safe plan (the placement stored for this model if
  any; else replicate everything when parameters, gradients and optimizer state fit in half the
  budget, shard everything otherwise). At the first forward, look the full plan up by the input
  signature now known; on a miss, record the first training steps (``PROFILE_STEPS``) with profiling
  hooks, then profile → comm model → search twice on rank 0 (placement fixed, as it now is; and
  placement free, for the next launch) → switch every knob that can change between steps → store
  the free-placement plan for the next launch and log what it adds and the predicted gain.
* **A model on the meta device** — it cannot run before it is materialised, and no rank should hold
  it whole: the safe plan shards every unit (unless a placement is stored); with example inputs
  (and no cached plan) the wrapper materialises it under that plan and :meth:`AutoPlanner.profile_wrapped`
  profiles the wrapped model (gathering each unit as it runs) instead of the plain module, then
  plans as transparent profiling does.

Rank 0 searches and broadcasts; every rank checks the plan hash afterwards (``AutoDist``).
"""

from __future__ import annotations

import enum
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from .._log import announce, logger
from .._progress import progress
from ..cost.budget import format_bytes
from ..cost.comm import CommModel
from ..cost.fidelity import FidelityRecord
from ..cost.profile import Profile, slowest
from ..cost.simulator import DurationEstimator, Simulator
from ..errors import AutoDistError, BudgetError, mark_raised_on_every_rank, reported_once
from ..measure.sweep import COLLECTIVES, COPIES, CommNeeds, SweepPlan, collective_train, plan_sweep, sweep, sweep_passes
from ..measure.trace import _preserved, estimate_optimizer, model_loss, profile_model, surrogate_loss
from ..plan import SCHEMA_VERSION, Plan
from ..runtime.comm import Comm, group_timeout
from ..sched.search import SearchConfig, SearchResult
from ..sched.space import PlanSpace, hybrid_shard_sizes, space_for
from ..structure import ModelStructure
from . import keys
from .cache import Cache
from .entries import comm_entry, comm_parts, placement_entry, plan_entry, profile_entry
from .estimator import entry_parser, stored_estimator
from .offline import annotate, budget_error, search_within_budget
from .recorder import StepRecorder

PROFILE_STEPS = 3  # transparent profiling: the first step warms up, the next ones are measured


class SearchFailed(AutoDistError):
    """Rank 0 could not finish the search (every rank raises this instead of waiting)."""


@dataclass
class LifecycleStats:
    source: str = ""  # "cache" | "search" | "safe start"
    cache_hits: int = 0
    profiles_measured: int = 0
    sweeps: int = 0
    searches: int = 0
    plan_key: str = ""
    plan_path: str | None = None
    search_seconds: float = 0.0


class Runtime(Protocol):
    """What :class:`AutoPlanner` needs of the model it plans for: the wrapper hands it one
    (``autodist/wrapper.py`` ``_AutoRuntime``). The fields hold from wrap time; the methods reach
    the engine, which exists once the wrapper has enacted the first plan."""

    module: nn.Module
    device: torch.device
    structure: ModelStructure
    comm: Comm
    mixed_precision: Any  # MixedPrecision | None
    budget_bytes: int
    grad_accum_steps: int | None  # the user's; None: as observed
    shard_size: int | None  # the shard groups the user asked for (2-D mesh, shard_size), if smaller than the world
    compile_backend: str | None  # the backend blocks may be compiled with (None: never compile)

    def plan(self) -> Plan:
        """The plan in force."""
        ...

    def placements(self) -> dict[str, str]:
        """Each parameter's placement as the engine holds it."""
        ...

    def trained_params(self) -> list[tuple[str, torch.Tensor]]:
        """(name, full tensor) of every parameter that requires a gradient."""
        ...

    def visible_ids(self) -> set[int]:
        """The ids of the parameters the optimizer sees."""
        ...

    def observed_accum_steps(self) -> int:
        """Backward passes between the last two optimizer steps (0: none yet)."""
        ...

    def forward(self, args: tuple, kwargs: dict) -> Any:
        """The wrapped model's forward."""
        ...

    def clear_grads(self) -> None:
        """Drop every parameter's gradient."""
        ...

    def observe(self, recorder: StepRecorder | None) -> None:
        """Have the engine call ``recorder`` around each step (``None``: stop)."""
        ...

    def switch(self, plan: Plan) -> None:
        """Switch to ``plan`` between steps, and check that every rank did."""
        ...


class _State(enum.Enum):
    START = "start"
    RECORDING = "recording"
    DONE = "done"


def _silent_comm_model(world: int, device: torch.device) -> CommModel:
    """The comm model a plan that issues no collective is searched with (see [Note: a model with
    nothing to communicate]): a fast link, never measured, so nothing it prices weighs."""
    model = CommModel.analytic(world, bandwidth_bytes_s=1e12, latency_s=0.0, device=device.type)
    model.meta["silent"] = True
    return model


def _about(todo: SweepPlan, stored: CommModel | None) -> str:
    """How long measuring ``todo`` takes, in words: from the fewest to the most seconds it may take
    (a quiet host to a disturbed one; :meth:`SweepPlan.estimate_seconds`), at the rates the stored
    model's sweep measured on this machine, else the default ones, over the passes a sweep takes."""
    try:
        passes = sweep_passes()
    except ValueError:  # the sweep itself reports it, on every rank
        passes = 1
    rates = stored.meta.get("rates") if stored is not None else None
    rates = rates if isinstance(rates, dict) else None
    lo, hi = (max(1, round(todo.estimate_seconds(passes, rates, fewest=f))) for f in (True, False))
    where = "at this machine's last measured rates" if rates is not None else "on 2 idle CPU ranks"
    return f"about {lo} s {where}" if lo == hi else f"about {lo}-{hi} s {where}"


def comm_needs(structure: ModelStructure) -> CommNeeds:
    """What a plan for this model can communicate ([Note: measuring what the model can use] in
    autodist/measure/sweep.py): gradients reduced (all-reduce, reduce-scatter) in buckets of at most
    the trained parameters' bytes, none when nothing is trained; units gathered in groups of at most
    every parameter's bytes (a frozen unit may be sharded too); host and in-memory copies (offloaded
    state, bucket copy-in, gather copy-out) of at most every parameter's bytes. Bytes at 4 per
    element at least: gradients are reduced, and optimizer state kept, in float32 whatever the
    parameters' dtype."""

    def nbytes(names: Any) -> float:
        return float(sum(p.numel * max(4, p.nbytes // max(p.numel, 1)) for p in (structure.params[n] for n in names)))

    trained, every = nbytes(structure.trainable), nbytes(structure.params)
    largest = {op: every for op in COPIES}
    if every > 0:
        largest["all_gather"] = every
    if trained > 0:
        largest.update(all_reduce=trained, reduce_scatter=trained)
    return CommNeeds({op: largest[op] for op in (*COLLECTIVES, *COPIES) if op in largest})


COMM_SOURCES = {
    "stored": "the one stored for this machine",
    "seed": "the one the seed of comm models (AUTODIST_COMM_SEED) holds for this machine",
    "completed": "the one stored for this machine, with what it lacked measured now",
    "measured": "measured now (none was stored for this machine)",
}  # what machine_comm_model's source says, in words


def machine_comm_model(
    cache: Cache, machine: dict[str, Any], needs: CommNeeds, *, rank: int, world: int, device: torch.device,
    broadcast: Callable[[Any], Any], measure: Callable[[CommNeeds, CommModel | None], CommModel],
    tell: Callable[[str], None] | None = None,
) -> tuple[CommModel, str]:
    """This machine's comm model (``machine``: :func:`~autodist.planner.keys.machine`), holding at
    least what ``needs`` names, on every rank (a collective: ``broadcast`` gives rank 0's object on
    every rank), and where it came from (a key of ``COMM_SOURCES``): the one ``cache`` stores; else
    the seed's ([Note: a seed of comm models]); else measured (``measure(needs, base)``, a sweep on
    every rank), only what the stored one lacks or holds unreadably (see [Note: measuring what the
    model can use] in autodist/measure/sweep.py), and stored with what it had. ``plan="auto"`` and
    ``autodist check`` both take it from here, so that the check measures the fidelity of the comm
    model the search then uses, and neither sweeps when the machine has one. (On a launch over
    several nodes ``plan="auto"`` joins two such models, one per level: [Note: the two levels
    measured online]; ``autodist check`` measures one over the world, and its record, stored under
    other facts, is not applied there.)"""
    key = keys.machine_key(machine)
    payload: tuple[str | None, bool, bool] | None = None  # (JSON, complete, from the seed): rank 0's
    seed = _comm_seed(rank)
    said = [False]  # rank 0 reported a stored entry it measures again, with the estimate
    if rank == 0:
        payload = (*_stored_comm_model(cache, key, needs, machine, world, said), False)
        if payload[0] is None and seed is not None:  # [Note: a seed of comm models]
            payload = (*_stored_comm_model(seed, key, needs, machine, world, said), True)
            if payload[0] is not None and payload[1]:
                cache.put("comm", key, str(payload[0]))
    got = broadcast(payload)
    text, complete, from_seed = got if got is not None else (None, False, False)
    from_seed = from_seed and text is not None
    stored = CommModel.from_json(text) if text is not None else None
    if stored is not None and complete:
        return stored, "seed" if from_seed else "stored"
    todo = plan_sweep(needs, stored, world)
    if rank == 0 and not said[0]:
        (tell or logger.info)(f"autodist: measuring the communication cost model: {todo.describe()} "
                              f"({_about(todo, stored)}, once per machine)")
    # the sweep draws random tensors (and seeds its own overhead probe): the user's generator is kept
    rng_devices = [device] if device.type == "cuda" else []
    with progress("measuring the comm model", enabled=rank == 0), torch.random.fork_rng(devices=rng_devices):
        model = measure(needs, stored)
        if model.meta.get("disturbed"):  # retaken once; a second disturbed sweep is kept, flagged
            if rank == 0:
                logger.info("autodist: the host was busy during the comm sweep (spread %.1fx); measuring again", model.meta["spread"])
            again = measure(needs, stored)
            model = again if again.meta.get("spread", 9e9) <= model.meta.get("spread", 9e9) else model
    if model.meta.get("disturbed") and rank == 0:
        logger.warning(
            "autodist: the comm model was measured on a busy host (calls took %.1fx their fastest); its predictions "
            "may be off. `autodist cache clear` and a quieter launch measure it again.", model.meta["spread"],
        )
    cache.put("comm", key, model.to_json())
    if seed is not None and (stored is None or from_seed):  # what the seed lacked, added to it
        seed.put("comm", key, model.to_json())
    return model, "measured" if stored is None else "completed"


def _ranks_per_node(comm: Comm) -> int | None:
    """The ranks of one node when this launch spans several (torchrun's ``LOCAL_WORLD_SIZE``, the
    same on every rank and tiling the ranks), else None: one node, or nodes not known (a
    collective)."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "")
    local = int(text) if text.isdigit() else None
    sizes = set(comm.all_gather_object(local)) if comm.world_size > 1 else {local}
    if len(sizes) != 1 or local is None or not 1 < local < comm.world_size or comm.world_size % local:
        return None
    if comm.world_size != dist.get_world_size():  # the nodes are the job's, and this mesh is not all of it
        return None
    return local


def _comm_seed(rank: int) -> Cache | None:
    """The cache of comm models ``AUTODIST_COMM_SEED`` names, if any.

    [Note: a seed of comm models] A comm model belongs to the machine, not to a cache: a cache
    directory that holds none for this machine (a fresh one: a test's, a container's) can start
    from the comm models another directory holds (``AUTODIST_COMM_SEED``, a cache directory).
    ``plan="auto"`` and ``autodist check`` read their own cache first; on a miss, the seed's entry
    for this machine, copied into their own cache when it holds what the model needs; what they
    then measure (what the seed's entry lacked, or all) is stored in both. An entry of their own
    cache (one a user or a test put there) is never written to the seed. The test suite measures
    into one seed per session (tests/conftest.py), so that only tests whose subject is the sweep
    sweep."""
    where = os.environ.get("AUTODIST_COMM_SEED")
    return Cache(where, writer=rank == 0) if where else None


def _stored_comm_model(
    cache: Cache, key: str, needs: CommNeeds, machine: dict[str, Any], world: int, said: list[bool],
) -> tuple[str | None, bool]:
    """Rank 0: (the stored comm model's JSON or None, whether it holds everything ``needs``
    names). A stored entry partly unreadable gives its usable parts, and the report of it says
    what will be measured again and for about how long (``said[0]`` then set); one wholly
    unreadable is reported with the full measurement's estimate, removed, and is a miss."""
    def replaced_by() -> str:
        said[0] = True
        todo = plan_sweep(needs, None, world)
        return f"measuring {todo.describe()} ({_about(todo, None)})"

    parts = cache.get("comm", key, lambda text: comm_parts(text, machine), replaced_by=replaced_by)
    if parts is None:
        return None, False
    model, problem = parts
    todo = plan_sweep(needs, model, world)
    if problem is not None:
        said[0] = True
        cache.once.warning(
            f"partial{key}",
            "autodist: cache entry %s is partly corrupt (%s); it will be replaced: its readable parts are kept and "
            "only %s measured again (%s)",
            cache.path("comm", key), problem, todo.describe() if not todo.empty() else "nothing", _about(todo, model),
        )
    # a stored model with an unreadable part is measured again even when this model needs no
    # more of it: the sweep keeps every readable part and derives the rest
    return model.to_json(), todo.empty() and problem is None


class AutoPlanner:
    """Everything ``plan="auto"`` needs, bound to one wrapped model (through ``runtime``)."""

    def __init__(self, runtime: Runtime, cache_dir: Any, *, explicit_budget: bool) -> None:
        self.rt = runtime
        self.comm = runtime.comm
        self.rank = self.comm.rank
        self.world = self.comm.world_size
        self.device = runtime.device
        self.structure = runtime.structure
        self.mp = runtime.mixed_precision
        self.compile_backend = runtime.compile_backend
        self.cache = Cache(cache_dir, writer=self.rank == 0)
        self.stats = LifecycleStats()
        self.state = _State.DONE
        self.explicit_budget = explicit_budget
        # the backend that runs the device's collectives: "nccl" for a group made without one
        # ("undefined") on a GPU host, as `autodist check` names it, so both find one comm model
        self.machine = keys.machine(self.world, self.device, self.comm.backend_for(self.device.type))
        self.ranks_per_node = _ranks_per_node(self.comm)
        if self.ranks_per_node is not None:  # plans and comm models of a multi-node launch are its own
            self.machine["ranks_per_node"] = self.ranks_per_node
        self._free_shard_size = False  # whether the plan being searched may choose its shard groups
        # [Note: plan="auto" on shard groups the user chose] A 2-D mesh or a shard_size fixes the
        # groups sharded units are split over (the process groups and the parameters' mesh are made
        # for them at wrap time): every plan the search considers shards over them (PlanSpace's
        # required_shard_size), the safe start too, and the plan cache keeps such plans apart.
        self.shard_size = runtime.shard_size if runtime.shard_size is not None and runtime.shard_size < self.world else None
        self.shard_asked = runtime.shard_size is not None  # the user chose the groups (the whole world included)
        self._recorder: StepRecorder | None = None
        self._sig = ""
        self._wrapped_inputs: tuple | None = None  # a meta-device model's example inputs (profile_wrapped)
        self._search_cfg: SearchConfig | None = None  # rank 0's (search_config)
        self._estimator: tuple[DurationEstimator | None, str | None] | None = None  # rank 0's (estimator)

    # ---- keys ------------------------------------------------------------------------------
    def profile_key(self, sig: str) -> str:
        # a profile taken under a mixed-precision policy is another model's ([Note: profiled as it runs])
        dtype = {"compute_dtype": str(self.mp.param_dtype)} if self.mp is not None and self.mp.param_dtype is not None else {}
        # ... and one with its blocks timed compiled holds more than one without
        compiled = {"compile": self.compile_backend} if self.compile_backend is not None else {}
        return keys.profile_cache_key(self.structure, sig, self.machine["device_name"], **dtype, **compiled)

    def comm_key(self) -> str:
        return keys.machine_key(self.machine)

    def _budget_key(self) -> Any:
        return self.rt.budget_bytes if self.explicit_budget else "device default"

    def plan_key(self, sig: str, optimizer_kind: str) -> str:
        cfg = self.search_config()
        return keys.plan_cache_key(
            self.profile_key(sig), self.machine, budget=self._budget_key(), optimizer=optimizer_kind,
            schema=SCHEMA_VERSION, grad_accum_steps=self.rt.grad_accum_steps,
            # a plan searched with other margins (a machine `autodist check` measured since) is planned again
            margins=[round(cfg.prefer_seed_within, 4), round(cfg.memory_headroom, 4)],
            # ... and so is one searched before `autodist check` fitted a wait calibration
            **({"wait_scale": cfg.wait_scale} if cfg.wait_scale is not None else {}),
            **({"blocked_wait_s": cfg.blocked_wait_s} if cfg.blocked_wait_s is not None else {}),
            mixed_precision=None if self.mp is None else [str(self.mp.param_dtype), str(self.mp.reduce_dtype)],
            **self._shard_key(),
            # a plan searched with compiled blocks allowed (and their backend) is kept apart from one
            # searched without; with compile off, the key holds nothing of it (as before the switch)
            **({"compile": self.compile_backend} if self.compile_backend is not None else {}),
            # a plan the learned estimator ranked is kept apart from the analytic one (and from
            # another estimator's); with the switch off, the key holds no estimator
            **({"estimator": estimator} if (estimator := self.estimator_id()) is not None else {}),
        )

    def placement_key(self) -> str:
        shard = self._shard_key()
        return keys.placement_key(self.structure, {**self.machine, **shard} if shard else self.machine, self._budget_key())

    def _hybrid_choices(self) -> tuple[int, ...]:
        """The shard groups the search may choose beside the whole world: on several nodes, when
        neither the user nor a runtime already built fixed them (a plan chosen before the runtime
        exists, from example inputs), a node or several ([Note: the two levels measured online])."""
        if self.shard_asked or not self._free_shard_size:
            return ()
        return hybrid_shard_sizes(self.world, self.ranks_per_node)

    def _shard_key(self) -> dict[str, Any]:
        """What decides a plan's shard groups, for the keys of plans and placements: the groups the
        user asked for; else, where the search may choose them, that it may (a plan chosen so is not
        one a runtime already built on the whole world can switch to, nor the reverse); else
        nothing (the whole world, as before hybrid sharding)."""
        if self.shard_asked:
            return {"shard_size": self.shard_size or self.world}
        return {"shard_groups": "searched"} if self._hybrid_choices() else {}

    # ---- cache access ---------------------------------------------------------------------------
    def read(self, kind: str, key: str) -> Any:
        """On rank 0, cache entry ``kind``/``key`` checked for this model and machine (see [Note: cache
        entries are checked, not trusted]), or ``None``; ``None`` on the other ranks, which use what
        rank 0 broadcasts, so every rank agrees on hit or miss and an entry is reported once."""
        if self.rank != 0:
            return None
        parsers = {
            "plans": lambda text: plan_entry(text, self.structure, self.world),
            "profiles": profile_entry,
            "comm": lambda text: comm_entry(text, self.machine),
            "placements": lambda text: placement_entry(text, self.structure),
            "fidelity": FidelityRecord.from_json,
            "estimators": entry_parser(self.machine),
        }
        return self.cache.get(kind, key, parsers[kind])

    def _optimizer_kind(self, sig: str) -> str:
        prof = self.read("profiles", self.profile_key(sig))
        return prof.optimizer.kind if prof is not None and prof.optimizer.measured else "Adam"

    def search_config(self) -> SearchConfig:
        """The search's margins (rank 0, which searches): from this machine's fidelity record when
        ``autodist check`` left one, else the defaults (see [Note: margins from measured error])."""
        if self._search_cfg is None:
            self._search_cfg = SearchConfig.for_machine(self.read("fidelity", self.comm_key()))
        return self._search_cfg

    def estimator(self) -> DurationEstimator | None:
        """The learned estimator stored for this machine, if ``plan="auto"`` may use it (rank 0,
        read once; see [Note: when plan="auto" uses the learned estimator])."""
        if self._estimator is None:
            self._estimator = stored_estimator(self.cache, self.comm_key(), self.machine) if self.rank == 0 else (None, None)
        return self._estimator[0]

    def estimator_id(self) -> str | None:
        """What tells the estimator in use (None: none) from another: a digest of its provenance
        (when, on what and how it was trained)."""
        self.estimator()  # read once
        return self._estimator[1] if self._estimator is not None else None

    def lookup(self, sig: str) -> Plan | None:
        key: str | None = None
        text: str | None = None
        if self.rank == 0:
            key = self.plan_key(sig, self._optimizer_kind(sig))
            plan = self.read("plans", key)
            budget = self.rt.budget_bytes
            peak = plan.predicted.get("peak_bytes") if plan is not None else None
            limit = self.search_config().planning_budget(budget)
            if plan is not None and plan.provenance.get("inside_headroom"):
                limit = budget  # planned so: nothing fitted below the headroom
            if peak is not None and limit is not None and peak > limit:
                logger.info(
                    "autodist: cached plan %s predicts %s, over this launch's budget %s less its headroom; planning again",
                    key, format_bytes(peak), format_bytes(budget),
                )
                plan = None
            text = plan.to_json() if plan is not None else None
        # every rank must agree on hit or miss (their caches may differ): rank 0 decides
        key, text = self.comm.broadcast_object((key, text))
        if text is None or key is None:
            return None
        plan = Plan.from_json(text)
        self.stats.cache_hits += 1
        self.stats.plan_key = key
        self.stats.plan_path = str(self.cache.path("plans", key))
        self.stats.source = "cache"
        return plan

    def comm_model(self) -> CommModel:
        """This machine's comm model, holding at least what this model's plans can issue
        (:func:`machine_comm_model`); on a launch over several nodes, its two levels
        (:meth:`_two_level_comm_model`)."""
        if self.ranks_per_node is not None:
            return self._two_level_comm_model(self.ranks_per_node)
        group, device, comm = self.comm.group, self.device, self.comm

        def measure(needs: CommNeeds, base: CommModel | None) -> CommModel:
            return sweep(group, device, comm=comm, needs=needs, base=base)

        model, source = machine_comm_model(
            self.cache, self.machine, comm_needs(self.structure), rank=self.rank, world=self.world, device=device,
            broadcast=comm.broadcast_object, measure=measure,
        )
        if source in ("measured", "completed"):
            self.stats.sweeps += 1
        return model

    def _two_level_comm_model(self, rpn: int) -> CommModel:
        """[Note: the two levels measured online] On ``world`` ranks over nodes of ``rpn`` (torchrun
        numbers a node's ranks consecutively), collectives within a node are measured on node 0's
        ranks and collectives between nodes on one rank per node (local rank 0 of each), each by
        :func:`machine_comm_model` on a group of its own, then joined (``CommModel.two_level``) and
        given to every rank by rank 0, which is in both groups. Each level is stored as the
        machine's model for its own group: the within-node one under the facts of ``rpn`` ranks of
        this device (a one-node launch of that size shares it), the across-nodes one under those
        of ``world // rpn`` ranks marked as crossing nodes. The other ranks wait; a level already
        stored is not measured again. Measured on one rank per node, the link between nodes is
        priced per rank's NIC, as [Note: collectives across nodes] in cost/comm.py prices it."""
        nodes = self.world // rpn
        me = dist.get_rank()
        ranks = dist.get_process_group_ranks(self.comm.group)
        rows = [ranks[i : i + rpn] for i in range(0, self.world, rpn)]
        columns = [ranks[j::rpn] for j in range(rpn)]
        needs = comm_needs(self.structure)
        device = self.device
        models: dict[str, CommModel] = {}
        # Every rank makes the groups of every row and column, then a Comm on its own row and its
        # own column, in this order: group names are salted with a count of the groups each rank
        # has made, so the ranks must make the same number in the same order (a group made by some
        # ranks only would name every later group differently on them, and its creation would wait
        # forever). Only node 0's row and column 0 measure.
        timeout = group_timeout(self.comm.group)
        row_pg, _ = dist.new_subgroups_by_enumeration(rows, timeout=timeout)
        column_pg, _ = dist.new_subgroups_by_enumeration(columns, timeout=timeout)
        if not isinstance(row_pg, dist.ProcessGroup) or not isinstance(column_pg, dist.ProcessGroup):
            raise RuntimeError(f"torch made no node or cross-node group for rank {me}")
        comms = {"within node": Comm(row_pg), "across nodes": Comm(column_pg)}
        levels = [
            ("within node", rows[0], rpn, {}),
            ("across nodes", columns[0], nodes, {"level": "across nodes"}),
        ]
        try:
            for level, measured_by, size, marker in levels:
                if me not in measured_by:
                    continue
                comm = comms[level]
                facts = {**keys.machine(size, device, self.machine["backend"]), **marker}

                def measure(needs: CommNeeds, base: CommModel | None, comm: Comm = comm) -> CommModel:
                    return sweep(comm.group, device, comm=comm, needs=needs, base=base)

                if comm.rank == 0:
                    logger.info("autodist: the comm model of this %d-node launch, %s (%d ranks)", nodes, level, size)
                model, source = machine_comm_model(
                    self.cache, facts, needs, rank=comm.rank, world=size, device=device,
                    broadcast=comm.broadcast_object, measure=measure,
                )
                if source in ("measured", "completed"):
                    self.stats.sweeps += 1
                models[level] = model
        finally:
            for comm in comms.values():
                comm.destroy()
            for pg in (row_pg, column_pg):
                dist.destroy_process_group(pg)
        text = None
        if self.rank == 0:
            text = CommModel.two_level(
                models["within node"], models["across nodes"], ranks_per_node=rpn, world_size=self.world,
            ).to_json()
        got = self.comm.broadcast_object(text)
        if got is None:
            raise SearchFailed("rank 0 sent no comm model")
        return CommModel.from_json(got)

    # ---- planning ------------------------------------------------------------------------------
    def safe_plan(self, *, sharded: bool = False, profiled: str = "the first steps are") -> Plan:
        """The plan to start with before a profile exists: the placement stored by the previous launch;
        else everything sharded when ``sharded`` (a model on the meta device: no rank should ever
        hold all its parameters) or when replicating would not fit in half the budget; else DDP's."""
        from ..builtins import ddp_plan

        hint = self.comm.broadcast_object(self.read("placements", self.placement_key()))
        space = PlanSpace(self.structure, self.world, [u.name for u in self.structure.units], list(reversed(self.structure.trainable)),
                          required_shard_size=self.shard_size or 0)
        if hint is not None:
            g = space.fsdp()
            g = space.normalize(replace(g, shard=tuple(hint[u] == "shard" for u in space.units)))
            plan = space.to_plan(g, provenance={"source": "auto:safe start (stored placement)"})
            reason = "the placement stored by the previous launch"
        elif sharded:
            plan = space.to_plan(space.fsdp(), provenance={"source": "auto:safe start (sharded)"})
            reason = "the model is on the meta device: its units are sharded, so no rank holds all its parameters"
        else:
            params = sum(p.nbytes for p in self.structure.params.values())
            trained = sum(self.structure.params[n].nbytes for n in self.structure.trainable)
            # replicated: parameters + the trained ones' gradients and Adam's two moments (a frozen
            # base under adapters has neither: counting them made a LoRA model start sharded)
            need = params + 3 * trained
            if need <= self.rt.budget_bytes // 2:
                plan = ddp_plan(self.structure, self.world)
                plan.provenance = {"source": "auto:safe start (replicated)"}
                reason = f"parameters, gradients and optimizer state ({format_bytes(need)}) fit in half the budget"
            else:
                plan = space.to_plan(space.fsdp(), provenance={"source": "auto:safe start (sharded)"})
                reason = f"replicating would need {format_bytes(need)} of a {format_bytes(self.rt.budget_bytes)} budget"
        plan.device = self.device.type
        if self.shard_size is not None:
            plan = replace(plan, shard_size=self.shard_size)
        self.stats.source = "safe start"
        if self.rank == 0:
            announce("autodist: plan=auto: starting with a safe plan (%s) while %s profiled", reason, profiled)
        return plan

    def search(self, profile: Profile, comm: CommModel, *, fixed: dict[str, str] | None) -> SearchResult:
        comm = self.search_config().calibrated(comm)
        mp = self.mp

        def simulator(budget: int | None, estimator: DurationEstimator | None = None) -> Simulator:
            return Simulator(
                profile, self.structure, comm, world_size=self.world, budget_bytes=budget, estimator=estimator,
                param_dtype=mp.param_dtype if mp else None, reduce_dtype=mp.reduce_dtype if mp else None,
            )

        # on several nodes, a plan chosen before the runtime exists (example inputs) may shard within
        # nodes (hybrid sharding, [Note: the two levels measured online]); one switched to later
        # keeps the shard groups the runtime was built with
        space = space_for(profile, self.structure, self.world, fixed_placement=fixed, grad_accum_steps=self.rt.grad_accum_steps,
                          required_shard_size=self.shard_size or 0, shard_sizes=self._hybrid_choices())
        searcher, result = search_within_budget(space, simulator, self.search_config(), self.rt.budget_bytes)
        estimator = self.estimator()
        if estimator is not None:
            # the corrected simulator ranks the finalists (see [Note: when plan="auto" uses the learned estimator])
            result = searcher.refine(result, simulator(searcher.sim.budget, estimator))
            logger.info(
                "autodist: the learned estimator ranked the search's finalists: predicted step %.2f ms (analytic %.2f ms)",
                result.result.step_s * 1e3, (result.result.analytic_step_s or result.result.step_s) * 1e3,
            )
        self.stats.searches += 1
        self.stats.search_seconds += result.seconds
        annotate(result, self.structure, profile, device=self.device, budget_bytes=self.rt.budget_bytes, source="auto:search",
                 sim=searcher.sim)
        return result

    def _budget_error(self, result: SearchResult) -> BudgetError:
        return budget_error(self.rt.budget_bytes, result, self.structure)

    def plan_now(self, profile: Profile, sig: str, *, fixed: dict[str, str] | None) -> tuple[Plan, Plan]:
        """Search (rank 0) and broadcast. Returns (plan to use now, plan for the next launch)."""
        payload = self._agreed_search(profile, sig, fixed)
        if "failure" in payload or "error" in payload:
            # every rank raises it (they all got the payload): reported once, as at wrap time
            err: AutoDistError = (
                SearchFailed(f"the search on rank 0 failed: {payload['failure']}") if "failure" in payload else BudgetError(payload["error"])
            )
            if self.world > 1:
                raise reported_once(mark_raised_on_every_rank(err), rank=self.rank)  # type: ignore[arg-type]
            raise err
        now_plan = Plan.from_json(payload["now"])
        free_plan = Plan.from_json(payload["free"])
        key = payload["key"]  # rank 0's: the key holds rank 0's margins
        path = self.cache.put("plans", key, free_plan.to_json())
        self.cache.put("profiles", self.profile_key(sig), profile.to_json())
        self.cache.put(
            "placements", self.placement_key(), json.dumps({u.name: u.placement for u in free_plan.units}, sort_keys=True)
        )
        self.stats.plan_key = key
        self.stats.plan_path = str(path) if path else str(self.cache.path("plans", key))
        self.stats.source = "search"
        return now_plan, free_plan

    def _agreed_search(self, profile: Profile, sig: str, fixed: dict[str, str] | None) -> dict[str, Any]:
        """Rank 0's search payload (:meth:`_search_payload`), on every rank."""
        payload: dict[str, Any] | None = None
        if self.nothing_to_communicate(fixed):
            # [Note: a model with nothing to communicate] No parameter is trained, so no gradient is
            # reduced; with every unit replicated nothing is gathered either, and the comm model
            # would price no collective of the plan: it is not measured. The search runs with the
            # placement fixed to replicate and a comm model that prices nothing it is asked about;
            # if replicating does not fit the budget and the placement may change, units must be
            # sharded, which gathers, and the comm model is measured for the gathers alone
            # (comm_needs: nothing is reduced).
            replicated = {u.name: "replicate" for u in self.structure.units}
            payload = self.comm.broadcast_object(
                self._search_payload(profile, sig, _silent_comm_model(self.world, self.device), fixed=replicated, free=replicated)
                if self.rank == 0 else None
            )
            if payload is not None and "error" in payload and fixed is None:  # with the placement fixed, the error stands
                if self.rank == 0:
                    logger.info("autodist: replicating this untrained model does not fit the budget; planning sharded units")
                payload = None
        if payload is None:
            comm = self.comm_model()
            payload = self.comm.broadcast_object(self._search_payload(profile, sig, comm, fixed=fixed) if self.rank == 0 else None)
        if payload is None:  # rank 0 always sends one; a broadcast that lost it is a failure, not a hang
            return {"failure": "rank 0 sent no search result"}
        return payload

    def nothing_to_communicate(self, fixed: dict[str, str] | None) -> bool:
        """Whether a plan for this model issues no collective: no parameter is trained (no gradient
        to reduce) and no unit is held sharded (nothing to gather). ``fixed``: the placement in force,
        if it cannot change."""
        return not self.structure.trainable and (fixed is None or all(v == "replicate" for v in fixed.values()))

    def _search_payload(
        self, profile: Profile, sig: str, comm: CommModel, *, fixed: dict[str, str] | None, free: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Rank 0's search, as the payload :meth:`plan_now` broadcasts: the plan to use now (placement
        ``fixed``) and the one for the next launch (placement ``free``), or the error every rank
        raises. Any exception is sent as a failure: the other ranks never wait for a broadcast."""
        t0 = time.perf_counter()
        try:
            with progress("searching for a plan"):
                nxt = self.search(profile, comm, fixed=free)
                now = nxt if fixed == free else self.search(profile, comm, fixed=fixed)
            if not now.result.feasible:
                return {"error": str(self._budget_error(now))}
            if comm.meta.get("silent"):
                for plan in (now.plan, nxt.plan):
                    plan.provenance["comm_model"] = "not measured: the model trains no parameter and replicates every unit"
            key = self.plan_key(sig, profile.optimizer.kind if profile.optimizer.measured else "Adam")
            return {"now": now.plan.to_json(), "free": nxt.plan.to_json(), "seconds": time.perf_counter() - t0, "key": key}
        except Exception as e:  # never leave the other ranks waiting for a broadcast
            return {"failure": f"{type(e).__name__}: {e}"}

    # ---- the two entry points ----------------------------------------------------------------
    def resolve(self, example_inputs: Any, example_kwargs: dict[str, Any] | None = None, *, meta: bool = False) -> Plan:
        """The plan to wrap with. ``meta``: the model is on the meta device, so it cannot run before it
        is placed and materialised: on a miss with example inputs the safe sharded plan is returned
        and :meth:`profile_wrapped` profiles and plans once the wrapper has materialised it."""
        if example_inputs is None and example_kwargs is None:
            self.state = _State.START
            return self.safe_plan(sharded=meta)
        if example_inputs is None:
            example_inputs = ()
        if not isinstance(example_inputs, tuple):
            example_inputs = (example_inputs,)
        example_kwargs = dict(example_kwargs or {})
        # the signature of the forward the training loop runs (AutoDist.forward sees (args, kwargs))
        sig = keys.input_signature((example_inputs, example_kwargs))
        # chosen before the runtime exists, the plan may choose its shard groups (until it returns); a
        # meta-device model is planned once wrapped, on the groups its runtime was built with
        self._free_shard_size = not meta
        try:
            return self._resolve_free(sig, example_inputs, example_kwargs, meta)
        finally:
            self._free_shard_size = False

    def _resolve_free(self, sig: str, example_inputs: tuple, example_kwargs: dict[str, Any], meta: bool) -> Plan:
        plan = self.lookup(sig)
        if plan is not None:
            self._log_chosen(plan)
            return plan
        self._sig = sig
        if meta:
            self._wrapped_inputs = (example_inputs, example_kwargs)
            return self.safe_plan(sharded=True, profiled="the example inputs are")
        if self.rank == 0:
            profiling = "profiling it" + (
                f", every block also timed compiled with {self.compile_backend} (compile=: each distinct block is "
                "compiled once, which can take minutes)" if self.compile_backend is not None else ""
            )
            logger.info("autodist: plan=auto: no cached plan for this model and input: %s", self._first_run_steps(profiling))
        with progress("profiling the model", enabled=self.rank == 0):
            prof = profile_model(
                self.rt.module, self.structure, example_inputs, device=self.device, example_kwargs=example_kwargs,
                contention=collective_train(self.comm.group, self.device),
                compute_dtype=self.mp.param_dtype if self.mp is not None else None,
                cast_inputs=self.mp.cast_forward_inputs if self.mp is not None else True,
                compile_backend=self.compile_backend,
            )
        self.stats.profiles_measured += 1
        prof = self._merge(prof)
        plan, _ = self.plan_now(prof, sig, fixed=None)
        self._log_chosen(plan)
        return plan

    def profile_wrapped(self) -> None:
        """A meta-device model wrapped with example inputs and no cached plan: profile the wrapped model
        (under the sharded safe plan, gathering each unit on demand: no rank holds the whole model),
        then search with the placement fixed, switch, and store the plan with the best placement for
        the next launch, as transparent profiling does. A few forward/backward passes, no optimizer
        step; parameters, gradients, buffers and the random generator are left as found."""
        pending, self._wrapped_inputs = self._wrapped_inputs, None
        if pending is None:
            return
        inputs = tuple(x.to(self.device) if isinstance(x, torch.Tensor) else x for x in pending[0])
        kwargs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in pending[1].items()}
        if self.rank == 0:
            logger.info("autodist: plan=auto: no cached plan for this model and input: %s",
                        self._first_run_steps("profiling the wrapped model"))
        with _preserved(self.rt.module, self.device), progress("profiling the model", enabled=self.rank == 0):
            recorder = self._start_recording()
            try:
                for i in range(PROFILE_STEPS):
                    out = self.rt.forward(inputs, kwargs)
                    loss = model_loss(out)
                    loss = loss if loss is not None else surrogate_loss(out)
                    del out
                    if loss is not None:  # None: nothing requires grad (a frozen model has no backward)
                        loss.backward()
                    del loss
                    recorder.finish_pass()
                    self.rt.clear_grads()
                    if i + 1 < PROFILE_STEPS:
                        recorder.begin_pass()
            finally:
                self._stop_recording()
        prof = recorder.profile(self._sig, self.rt.observed_accum_steps())
        if not prof.optimizer.measured:
            numels = [p.numel for p in self.structure.params.values() if p.requires_grad]
            prof = replace(prof, optimizer=estimate_optimizer(self.device, param_numels=numels))
        self.stats.profiles_measured += 1
        prof = self._merge(prof)
        now, free = self.plan_now(prof, self._sig, fixed=self._placement_in_force())
        self.rt.switch(now)
        if self.rank == 0:
            self._log_chosen(now)
            more = [u.name for u, v in zip(free.units, now.units) if u.placement != v.placement]
            if more:
                logger.info(
                    "autodist: the next launch will place %d unit(s) differently (e.g. %s) for a predicted %.1f ms "
                    "step instead of %.1f ms; the plan is stored at %s",
                    len(more), more[0], 1e3 * free.predicted.get("step_seconds", 0),
                    1e3 * now.predicted.get("step_seconds", 0), self.stats.plan_path,
                )

    def _first_run_steps(self, profiling: str) -> str:
        """What a launch without a cached plan does, up front (rank 0): what it measures and the
        bound of the search; the comm model's measurement, if any, says its own estimate when it starts."""
        return (f"{profiling} (a few forward and backward passes, then the same under communication), taking this "
                f"machine's comm model (measured once per machine), then searching (at most "
                f"{self.search_config().time_budget_s:.0f} s)")

    def _merge(self, prof: Profile) -> Profile:
        texts = self.comm.all_gather_object(prof.to_json())
        return slowest([Profile.from_json(t) for t in texts])

    def _placement_in_force(self) -> dict[str, str]:
        return {u.name: u.placement for u in self.rt.plan().units}

    def _log_chosen(self, plan: Plan) -> None:
        if self.rank != 0:
            return
        from ..describe import describe_prediction

        origin = {"cache": "from the cache", "search": "searched now"}.get(self.stats.source, self.stats.source)
        where = f", {self.stats.plan_path}" if self.stats.plan_path else ""
        announce("autodist: plan chosen: %s (%s%s): %s", plan.label, origin, where, describe_prediction(plan))

    # ---- transparent profiling during the first steps --------------------------------------------
    def before_forward(self, args: tuple, kwargs: dict) -> None:
        if self.state is _State.DONE:
            return
        if self.state is _State.START:
            self._sig = keys.input_signature((args, kwargs))
            plan = self.lookup(self._sig)
            if plan is not None:
                if self._placement_matches(plan):
                    self.rt.switch(plan)
                    self._log_chosen(plan)
                    self.state = _State.DONE
                    return
                if self.rank == 0:
                    logger.info("autodist: the cached plan shards differently than this launch's placement; re-planning the other knobs")
            self._start_recording()
            return
        # RECORDING: the previous step is complete
        recorder = self._recorder
        assert recorder is not None  # RECORDING holds one
        recorder.finish_pass()
        if len(recorder.recorded) >= PROFILE_STEPS:
            self._finalize()
        else:
            recorder.begin_pass()

    def _placement_matches(self, plan: Plan) -> bool:
        held = self.rt.placements()
        return all(held[p] == pl for p, pl in plan.placement_of_param.items())

    def _start_recording(self) -> StepRecorder:
        recorder = StepRecorder(self.rt.module, self.structure, self.device, self.rt.trained_params(), self.rt.visible_ids)
        self._recorder = recorder
        self.rt.observe(recorder)
        self.state = _State.RECORDING
        recorder.begin_pass()
        return recorder

    def _stop_recording(self) -> StepRecorder:
        recorder = self._recorder
        assert recorder is not None  # called only while recording
        recorder.close()
        self.rt.observe(None)
        self.state = _State.DONE
        return recorder

    def _finalize(self) -> None:
        recorder = self._stop_recording()
        prof = recorder.profile(self._sig, self.rt.observed_accum_steps())
        self.stats.profiles_measured += 1
        prof = self._merge(prof)
        try:
            now, free = self.plan_now(prof, self._sig, fixed=self._placement_in_force())
        except SearchFailed as e:
            if self.rank == 0:
                logger.warning("autodist: %s Keeping the safe plan, which is running.", e)
            return
        except BudgetError:
            # it propagates: the budget is a contract (every rank raises it, from this forward), and
            # the job ends (see [Note: object exchanges and interpreter exit] in runtime/comm.py)
            self.comm.destroy()
            raise
        self.rt.switch(now)
        if self.rank == 0:
            more = [u.name for u, v in zip(free.units, now.units) if u.placement != v.placement]
            gain = now.predicted.get("step_seconds", 0) / max(free.predicted.get("step_seconds", 1e-12), 1e-12)
            self._log_chosen(now)
            if more:
                logger.info(
                    "autodist: the next launch will change the placement of %d unit(s) (e.g. %s) for a predicted "
                    "%.2fx faster step (%.1f ms vs %.1f ms); the plan is stored at %s",
                    len(more), more[0], gain, 1e3 * free.predicted.get("step_seconds", 0),
                    1e3 * now.predicted.get("step_seconds", 0), self.stats.plan_path,
                )
