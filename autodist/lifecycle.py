"""``plan="auto"``: cache lookup, profiling, search and switching (docs/design.md, "Lifecycle").

* **Cache hit** — the plan stored for this model, input signature, world size, device, backend,
  torch version, optimizer kind, budget and mixed precision is used: no profiling, no search.
* **Miss with example inputs** — profile now (a few forward/backward passes of the plain module,
  no optimizer step, nothing left changed), get the comm model (cached per machine, else a sweep of
  about 50 s on 2 CPU ranks, three passes), search on rank 0, broadcast, store.
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
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.optim.optimizer as optim_hooks
from torch.utils._pytree import tree_flatten

from ._log import announce, logger
from ._progress import progress
from .cache import Cache, digest
from .cost.budget import format_bytes
from .cost.comm import CommModel
from .cost.fidelity import FidelityRecord
from .cost.learned import Estimator, estimator_entry
from .cost.profile import PROFILE_SCHEMA_VERSION, OptimizerProfile, Profile, slowest
from .cost.simulator import Simulator
from .errors import AutoDistError, BudgetError, mark_raised_on_every_rank, reported_once
from .measure.sweep import collective_train, sweep
from .measure.trace import (
    UnitTracer,
    _attribute,
    _Clock,
    _Pass,
    _preserved,
    estimate_optimizer,
    float_output_bytes,
    loss_fields,
    model_loss,
    profile_model,
    surrogate_loss,
)
from .plan import SCHEMA_VERSION, Plan, made_for
from .sched.search import SearchConfig, Searcher, SearchResult
from .sched.space import PlanSpace, space_for

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


def profile_cache_key(structure: Any, sig: str, device_name: str, **more: Any) -> str:
    """The key of a model's profile in the cache: the model's structure, the input signature
    (:func:`input_signature`), the device and torch version, and ``more`` (``autodist plan`` keeps
    its single-process profiles apart from a job's, which are merged over ranks)."""
    return digest({"model": structure.fingerprint(), "input": sig, "device": device_name, "torch": torch.__version__, **more})


def input_signature(tree: Any) -> str:
    leaves = tree_flatten(tree)[0]
    parts = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append(f"{tuple(x.shape)}:{str(x.dtype).replace('torch.', '')}")
        else:
            parts.append(type(x).__name__)
    return ";".join(parts)


class _State(enum.Enum):
    START = "start"
    RECORDING = "recording"
    DONE = "done"


class AutoPlanner:
    """Everything ``plan="auto"`` needs, bound to one wrapped model."""

    def __init__(self, wrapper: Any, cache_dir: Any, *, explicit_budget: bool) -> None:
        self.w = wrapper
        self.comm = wrapper._comm
        self.rank = self.comm.rank
        self.world = self.comm.world_size
        self.device = wrapper.device
        self.structure = wrapper._structure
        self.cache = Cache(cache_dir, writer=self.rank == 0)
        self.stats = LifecycleStats()
        self.state = _State.DONE
        self.explicit_budget = explicit_budget
        self.mp = wrapper._mixed_precision
        self._recorded: list[dict] = []
        self._tracer: UnitTracer | None = None
        self._pass: _Pass | None = None
        self._marks: dict[str, Any] = {}
        self._opt_samples: list[tuple[str, float, int, int, int]] = []
        self._opt_handles: list[Any] = []
        self._sig = ""
        self._out_fp32 = 0  # float32 bytes of the outputs of the last recorded forward
        self._wrapped_inputs: tuple | None = None  # a meta-device model's example inputs (profile_wrapped)
        self._search_cfg: SearchConfig | None = None  # rank 0's (search_config)
        self._estimator: tuple[Estimator | None, str | None] | None = None  # rank 0's (estimator)

    # ---- keys ------------------------------------------------------------------------------
    def _machine(self) -> dict[str, Any]:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return {
            "world": self.world, "device": self.device.type, "device_name": name,
            "backend": dist.get_backend(self.comm.group), "torch": torch.__version__,
        }

    def profile_key(self, sig: str) -> str:
        # a profile taken under a mixed-precision policy is another model's ([Note: profiled as it runs])
        dtype = {"compute_dtype": str(self.mp.param_dtype)} if self.mp is not None and self.mp.param_dtype is not None else {}
        return profile_cache_key(self.structure, sig, self._machine()["device_name"], **dtype)

    def comm_key(self) -> str:
        return digest(self._machine())

    def _budget_key(self) -> Any:
        return self.w.budget_bytes if self.explicit_budget else "device default"

    def plan_key(self, sig: str, optimizer_kind: str) -> str:
        return digest(
            {
                "profile": self.profile_key(sig), **self._machine(), "budget": self._budget_key(),
                "optimizer": optimizer_kind, "schema": SCHEMA_VERSION, "grad_accum_steps": self.w.grad_accum_steps,
                # a plan searched with other margins (a machine `autodist check` measured since) is planned again
                "margins": [round(self.search_config().prefer_seed_within, 4), round(self.search_config().memory_headroom, 4)],
                # ... and so is one searched before `autodist check` fitted a wait calibration (without one,
                # the key is what it always was)
                **({"wait_scale": ws} if (ws := self.search_config().wait_scale) is not None else {}),
                **({"blocked_wait_s": bw} if (bw := self.search_config().blocked_wait_s) is not None else {}),
                "mixed_precision": None if self.mp is None else [str(self.mp.param_dtype), str(self.mp.reduce_dtype)],
                # a plan the learned estimator ranked is kept apart from the analytic one (and from
                # another estimator's); without one, the key is what it always was
                **({"estimator": estimator} if (estimator := self.estimator_id()) is not None else {}),
            }
        )

    def placement_key(self) -> str:
        return digest({"model": self.structure.fingerprint(), **self._machine(), "budget": self._budget_key()})

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
            "comm": lambda text: comm_entry(text, self._machine()),
            "placements": lambda text: placement_entry(text, self.structure),
            "fidelity": FidelityRecord.from_json,
            "estimators": lambda text: estimator_entry(text, self._machine()),
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

    def lookup(self, sig: str) -> Plan | None:
        key = text = None
        if self.rank == 0:
            key = self.plan_key(sig, self._optimizer_kind(sig))
            plan = self.read("plans", key)
            peak = plan.predicted.get("peak_bytes") if plan is not None else None
            limit = self.search_config().planning_budget(self.w.budget_bytes)
            if plan is not None and plan.provenance.get("inside_headroom"):
                limit = self.w.budget_bytes  # planned so: nothing fitted below the headroom
            if peak is not None and limit is not None and peak > limit:
                logger.info(
                    "autodist: cached plan %s predicts %s, over this launch's budget %s less its headroom; planning again",
                    key, format_bytes(peak), format_bytes(self.w.budget_bytes),
                )
                plan = None
            text = plan.to_json() if plan is not None else None
        # every rank must agree on hit or miss (their caches may differ): rank 0 decides
        key, text = self.comm.broadcast_object((key, text))
        if text is None:
            return None
        plan = Plan.from_json(text)
        self.stats.cache_hits += 1
        self.stats.plan_key = key
        self.stats.plan_path = str(self.cache.path("plans", key))
        self.stats.source = "cache"
        return plan

    def comm_model(self) -> CommModel:
        key = self.comm_key()
        model = self.read("comm", key)
        text = self.comm.broadcast_object(model.to_json() if model is not None else None)
        if text is not None:
            return CommModel.from_json(text)
        if self.rank == 0:
            logger.info("autodist: measuring the communication cost model (about 50 s on 2 CPU ranks, once per machine)")
        # the sweep draws random tensors (and seeds its own overhead probe): the user's generator is kept
        rng_devices = [self.device] if self.device.type == "cuda" else []
        with progress("measuring the comm model", enabled=self.rank == 0), torch.random.fork_rng(devices=rng_devices):
            model = sweep(self.comm.group, self.device, comm=self.comm)
            if model.meta.get("disturbed"):  # retaken once; a second disturbed sweep is kept, flagged
                if self.rank == 0:
                    logger.info("autodist: the host was busy during the comm sweep (spread %.1fx); measuring again", model.meta["spread"])
                again = sweep(self.comm.group, self.device, comm=self.comm)
                model = again if again.meta.get("spread", 9e9) <= model.meta.get("spread", 9e9) else model
        if model.meta.get("disturbed") and self.rank == 0:
            logger.warning(
                "autodist: the comm model was measured on a busy host (calls took %.1fx their fastest); its predictions "
                "may be off. `autodist cache clear` and a quieter launch measure it again.", model.meta["spread"],
            )
        self.stats.sweeps += 1
        self.cache.put("comm", key, model.to_json())
        return model

    # ---- planning ------------------------------------------------------------------------------
    def safe_plan(self, *, sharded: bool = False, profiled: str = "the first steps are") -> Plan:
        """The plan to start with before a profile exists: the placement stored by the previous launch;
        else everything sharded when ``sharded`` (a model on the meta device: no rank should ever
        hold all its parameters) or when replicating would not fit in half the budget; else DDP's."""
        from .builtins import ddp_plan

        hint = self.comm.broadcast_object(self.read("placements", self.placement_key()))
        space = PlanSpace(self.structure, self.world, [u.name for u in self.structure.units], list(reversed(self.structure.trainable)))
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
            # replicated: parameters + gradients + Adam's two moments
            if 4 * params <= self.w.budget_bytes // 2:
                plan = ddp_plan(self.structure, self.world)
                plan.provenance = {"source": "auto:safe start (replicated)"}
                reason = f"parameters, gradients and optimizer state ({format_bytes(4 * params)}) fit in half the budget"
            else:
                plan = space.to_plan(space.fsdp(), provenance={"source": "auto:safe start (sharded)"})
                reason = f"replicating would need {format_bytes(4 * params)} of a {format_bytes(self.w.budget_bytes)} budget"
        plan.device = self.device.type
        self.stats.source = "safe start"
        if self.rank == 0:
            announce("autodist: plan=auto: starting with a safe plan (%s) while %s profiled", reason, profiled)
        return plan

    def estimator(self) -> Estimator | None:
        """The learned estimator stored for this machine, if ``plan="auto"`` may use it (rank 0,
        read once; see [Note: when plan="auto" uses the learned estimator])."""
        if self._estimator is None:
            self._estimator = self._read_estimator() if self.rank == 0 else (None, None)
        return self._estimator[0]

    def estimator_id(self) -> str | None:
        """What tells the estimator in use (None: none) from another: a digest of its provenance
        (when, on what and how it was trained)."""
        self.estimator()  # read once
        return self._estimator[1] if self._estimator is not None else None

    def _read_estimator(self) -> tuple[Estimator | None, str | None]:
        found = self.read("estimators", self.comm_key())  # checked even where it cannot be used
        if found is None:
            return None, None
        entry, estimator = found
        if not entry.helps:
            self.cache.once.info(
                "estimator-unhelpful",
                "autodist: the learned estimator stored for this machine did not beat the analytic simulator on "
                "held-out models; planning with the analytic simulator",
            )
            return None, None
        if estimator is None:
            self.cache.once.info(
                "estimator-no-gnn",
                "autodist: a learned estimator is stored for this machine; pip install 'autodist[gnn]' to plan with it",
            )
            return None, None
        return estimator, digest(entry.provenance)

    def search(self, profile: Profile, comm: CommModel, *, fixed: dict[str, str] | None) -> SearchResult:
        comm = self.search_config().calibrated(comm)
        kw = {
            "world_size": self.world, "budget_bytes": self.search_config().planning_budget(self.w.budget_bytes),
            "param_dtype": self.mp.param_dtype if self.mp else None, "reduce_dtype": self.mp.reduce_dtype if self.mp else None,
        }
        space = space_for(profile, self.structure, self.world, fixed_placement=fixed, grad_accum_steps=self.w.grad_accum_steps)
        searcher, result = search_within_budget(
            space, lambda budget: Simulator(profile, self.structure, comm, **{**kw, "budget_bytes": budget}),
            self.search_config(), self.w.budget_bytes,
        )
        kw["budget_bytes"] = searcher.sim.budget
        estimator = self.estimator()
        if estimator is not None:
            # [Note: when plan="auto" uses the learned estimator] Only a stored estimator whose
            # held-out validation met HELPS_RULE (autodist/cost/learned.py), and only to rank the
            # search's finalists: the analytic simulator searches (thousands of plans), the
            # corrected one chooses among the best of them and the built-in seeds, under the same
            # budget and margins (the search config's, from this machine's fidelity record).
            result = searcher.refine(result, Simulator(profile, self.structure, comm, estimator=estimator, **kw))
            logger.info(
                "autodist: the learned estimator ranked the search's finalists: predicted step %.2f ms (analytic %.2f ms)",
                result.result.step_s * 1e3, (result.result.analytic_step_s or result.result.step_s) * 1e3,
            )
        self.stats.searches += 1
        self.stats.search_seconds += result.seconds
        self._annotate(result, profile)
        return result

    def _annotate(self, result: SearchResult, profile: Profile) -> None:
        made_for(result.plan, self.structure, optimizer_states=profile.optimizer.state_names)
        r = result.result
        result.plan.device = self.device.type
        result.plan.budget_bytes = self.w.budget_bytes
        result.plan.predicted = {
            "step_seconds": r.step_s,
            "peak_bytes": r.peak_bytes,
            "vs": {name: s.step_s / r.step_s for name, s in result.seeds.items() if s.feasible and r.step_s > 0},
        }
        if r.analytic_step_s is not None:  # the learned estimator corrected the prediction
            result.plan.predicted["analytic_step_seconds"] = r.analytic_step_s
        result.plan.provenance = search_provenance(result, "auto:search")

    def _budget_error(self, result: SearchResult) -> BudgetError:
        return budget_error(self.w.budget_bytes, result, self.structure)

    def plan_now(self, profile: Profile, sig: str, *, fixed: dict[str, str] | None) -> tuple[Plan, Plan | None]:
        """Search (rank 0) and broadcast. Returns (plan to use now, plan for the next launch)."""
        payload = None
        if self.nothing_to_communicate(fixed):
            # [Note: a model with nothing to communicate] No parameter is trained, so no gradient is
            # reduced; with every unit replicated nothing is gathered either, and the comm model
            # would price no collective of the plan: it is not measured (a sweep takes about 50 s
            # a pass). The search runs with the placement fixed to replicate and a comm model that
            # prices nothing it is asked about; if replicating does not fit the budget and the
            # placement may change, units must be sharded, which gathers, and the comm model is
            # measured as for any model.
            replicated = {u.name: "replicate" for u in self.structure.units}
            payload = self.comm.broadcast_object(
                self._search_payload(profile, sig, _silent_comm_model(self.world, self.device), fixed=replicated, free=replicated)
                if self.rank == 0 else None
            )
            if "error" in payload and fixed is None:  # with the placement fixed, the error stands
                if self.rank == 0:
                    logger.info("autodist: replicating this untrained model does not fit the budget; planning sharded units")
                payload = None
        if payload is None:
            comm = self.comm_model()
            payload = self.comm.broadcast_object(self._search_payload(profile, sig, comm, fixed=fixed) if self.rank == 0 else None)
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
        sig = input_signature((example_inputs, example_kwargs))
        plan = self.lookup(sig)
        if plan is not None:
            self._log_chosen(plan)
            return plan
        self._sig = sig
        if meta:
            self._wrapped_inputs = (example_inputs, example_kwargs)
            return self.safe_plan(sharded=True, profiled="the example inputs are")
        if self.rank == 0:
            logger.info("autodist: plan=auto: no cached plan for this model and input; profiling and searching")
        with progress("profiling the model", enabled=self.rank == 0):
            prof = profile_model(
                self.w.module, self.structure, example_inputs, device=self.device, example_kwargs=example_kwargs,
                contention=collective_train(self.comm.group, self.device),
                compute_dtype=self.mp.param_dtype if self.mp is not None else None,
                cast_inputs=self.mp.cast_forward_inputs if self.mp is not None else True,
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
        eng = self.w._engine
        inputs = tuple(x.to(self.device) if isinstance(x, torch.Tensor) else x for x in pending[0])
        kwargs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in pending[1].items()}
        if self.rank == 0:
            logger.info("autodist: plan=auto: no cached plan for this model and input; profiling the wrapped model and searching")
        with _preserved(self.w.module, self.device), progress("profiling the model", enabled=self.rank == 0):
            self._start_recording()
            try:
                for i in range(PROFILE_STEPS):
                    out = eng.forward(inputs, kwargs)
                    loss = model_loss(out)
                    loss = loss if loss is not None else surrogate_loss(out)
                    del out
                    loss.backward()
                    del loss
                    self._finish_pass()
                    for mp in eng.params.values():
                        mp.visible.grad = None
                    if i + 1 < PROFILE_STEPS:
                        self._begin_pass()
            finally:
                self._tracer.close()
                for h in self._opt_handles:
                    h.remove()
                eng.observer = None
                self.state = _State.DONE
        prof = self._profile_from_recording()
        if not prof.optimizer.measured:
            numels = [p.numel for p in self.structure.params.values() if p.requires_grad]
            prof = replace(prof, optimizer=estimate_optimizer(self.device, param_numels=numels))
        self.stats.profiles_measured += 1
        prof = self._merge(prof)
        now, free = self.plan_now(prof, self._sig, fixed={u.name: u.placement for u in eng.plan.units})
        self._switch(now)
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

    def _merge(self, prof: Profile) -> Profile:
        texts = self.comm.all_gather_object(prof.to_json())
        return slowest([Profile.from_json(t) for t in texts])

    def _log_chosen(self, plan: Plan) -> None:
        if self.rank != 0:
            return
        from .describe import describe_prediction

        origin = {"cache": "from the cache", "search": "searched now"}.get(self.stats.source, self.stats.source)
        where = f", {self.stats.plan_path}" if self.stats.plan_path else ""
        announce("autodist: plan chosen: %s (%s%s): %s", plan.label, origin, where, describe_prediction(plan))

    # ---- transparent profiling during the first steps --------------------------------------------
    def before_forward(self, args: tuple, kwargs: dict) -> None:
        if self.state is _State.DONE:
            return
        if self.state is _State.START:
            self._sig = input_signature((args, kwargs))
            plan = self.lookup(self._sig)
            if plan is not None:
                if self._placement_matches(plan):
                    self._switch(plan)
                    self._log_chosen(plan)
                    self.state = _State.DONE
                    return
                if self.rank == 0:
                    logger.info("autodist: the cached plan shards differently than this launch's placement; re-planning the other knobs")
            self._start_recording()
            return
        # RECORDING: the previous step is complete
        self._finish_pass()
        if len(self._recorded) >= PROFILE_STEPS:
            self._finalize()
        else:
            self._begin_pass()

    def _placement_matches(self, plan: Plan) -> bool:
        return all(self.w._engine.params[p].placement == pl for p, pl in plan.placement_of_param.items())

    def _start_recording(self) -> None:
        eng = self.w._engine
        params = [(mp.name, mp.full) for mp in eng.params.values() if mp.requires_grad]
        self._tracer = UnitTracer(self.w.module, self.structure, _Clock(self.device), params=params, free_grads=False)
        self._opt_handles = [
            optim_hooks.register_optimizer_step_pre_hook(self._opt_pre),
            optim_hooks.register_optimizer_step_post_hook(self._opt_post),
        ]
        eng.observer = self
        self.state = _State.RECORDING
        self._begin_pass()

    def _begin_pass(self) -> None:
        self._pass = _Pass()
        self._marks = {"t0": self._tracer.clock.mark()}
        self._tracer.start(self._pass)

    # called by the engine
    def forward_context(self) -> Any:
        return self._tracer.saving()

    def forward_end(self, out: Any) -> None:
        if self._pass is not None:
            self._marks["fwd"] = self._tracer.clock.mark()
            # the loss runs in the user's code, outside what is recorded: it is sized from the outputs
            self._out_fp32 = float_output_bytes(out)

    def backward_end(self) -> None:
        if self._pass is not None and "fwd" in self._marks:
            self._marks["bwd"] = self._tracer.clock.mark()

    def _finish_pass(self) -> None:
        self._tracer.stop()
        if self._pass is not None and "bwd" in self._marks:
            units = [u.name for u in self.structure.units]
            self._recorded.append(
                {"attr": _attribute(self._pass, self._tracer.clock, self._marks["t0"], self._marks["fwd"], self._marks["bwd"], units),
                 "pass": self._pass}
            )
        self._pass = None

    def _opt_pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self._opt_t0 = time.perf_counter()

    def _opt_post(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        ours = {id(mp.visible) for mp in self.w._engine.params.values()}
        params = [p for g in opt.param_groups for p in g["params"] if id(p) in ours]
        if not params:
            return
        from .measure.memory import storage_bytes

        local = storage_bytes(p for p in params)
        tensors = [(k, t) for p in params for k, t in opt.state.get(p, {}).items() if torch.is_tensor(t) and t.dim() > 0]
        state = storage_bytes(t for _, t in tensors)
        self._state_names = sorted({k for k, _ in tensors})
        self._opt_samples.append((type(opt).__name__, time.perf_counter() - self._opt_t0, local, state, len(params)))

    def _finalize(self) -> None:
        eng = self.w._engine
        self._tracer.close()
        for h in self._opt_handles:
            h.remove()
        eng.observer = None
        self.state = _State.DONE
        prof = self._profile_from_recording()
        self.stats.profiles_measured += 1
        prof = self._merge(prof)
        fixed = {u.name: u.placement for u in eng.plan.units}
        try:
            now, free = self.plan_now(prof, self._sig, fixed=fixed)
        except SearchFailed as e:
            if self.rank == 0:
                logger.warning("autodist: %s Keeping the safe plan, which is running.", e)
            return
        except BudgetError:
            # it propagates: the budget is a contract (every rank raises it, from this forward), and
            # the job ends (see [Note: object exchanges and interpreter exit] in runtime/comm.py)
            self.comm.destroy()
            raise
        self._switch(now)
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

    def _profile_from_recording(self) -> Profile:
        import statistics

        measured = self._recorded[1:] or self._recorded  # the first step warms up
        units_order = list(dict.fromkeys(u for _, kind, u in measured[-1]["pass"].fwd if kind == "enter"))
        units_order += [u.name for u in self.structure.units if u.name not in set(units_order)]
        last = measured[-1]
        from .cost.profile import UnitProfile

        units = [
            UnitProfile(
                name=u,
                fwd_s=statistics.median(r["attr"]["fwd"][u] for r in measured),
                bwd_s=statistics.median(r["attr"]["bwd"][u] for r in measured),
                act_bytes=last["pass"].saved.get(u, 0),
                out_bytes=last["pass"].out.get(u, 0),
                fwd_peak_bytes=last["pass"].out.get(u, 0),
                bwd_peak_bytes=sum(self.structure.params[p].nbytes for p in last["attr"]["ready"].get(u, [])),
                ready=last["attr"]["ready"].get(u, []),
                input_requires_grad=last["pass"].input_grad.get(u, True),
            )
            for u in units_order
        ]
        opt = OptimizerProfile()
        if self._opt_samples:
            samples = self._opt_samples[1:] or self._opt_samples
            kind, _, local, state, n = samples[-1]
            step = statistics.median(s[1] for s in samples)
            opt = OptimizerProfile(
                kind=kind, state_factor=state / max(local, 1), state_names=list(getattr(self, "_state_names", [])),
                transient_factor=1.0, per_byte_s=step / max(local, 1), measured=True,
            )
        return Profile(
            units=units,
            ready_order=last["attr"]["order"],
            pre_fwd_s=statistics.median(r["attr"]["pre_fwd"] for r in measured),
            post_fwd_s=statistics.median(r["attr"]["post_fwd"] for r in measured),
            pre_bwd_s=statistics.median(r["attr"]["pre_bwd"] for r in measured),
            batch_signature=self._sig,
            device=self.device.type,
            optimizer=opt,
            site_after=dict(self._tracer.site_after),
            recompute_anchor=dict(last["pass"].recompute),
            block_input_bytes=dict(last["pass"].block_inputs),
            grad_accum_steps=max(1, self.w._engine.stats.grad_accum_steps),
            meta={"source": "first training steps", "steps": len(measured), "torch": torch.__version__},
            **loss_fields(0, (0, 0), self._out_fp32, "estimated"),
        )

    def _switch(self, plan: Plan) -> None:
        self.w._engine.switch_plan(plan)
        self.w._check_rank_agreement(plan)


def _silent_comm_model(world: int, device: torch.device) -> CommModel:
    """The comm model a plan that issues no collective is searched with (see [Note: a model with
    nothing to communicate]): a fast link, never measured, so nothing it prices weighs."""
    model = CommModel.analytic(world, bandwidth_bytes_s=1e12, latency_s=0.0, device=device.type)
    model.meta["silent"] = True
    return model


# ------------------------------------------------------------------------------------------------
# Cache entries.
#
# [Note: cache entries are checked, not trusted] An entry may be truncated, overwritten with other
# bytes, written by another version, or valid JSON of the wrong shape. Each is parsed *and* checked
# against what this launch will do with it before it is used: anything unexpected raises, so
# ``Cache.get`` reports the entry once, removes it, and treats it as a miss; what this launch then
# measures or plans is stored in its place. Only rank 0 reads the cache (``AutoPlanner.read``).
# ------------------------------------------------------------------------------------------------


def plan_entry(text: str, structure: Any, world: int) -> Plan:
    """A cached plan: parsed (which checks every field) and validated against the model."""
    from .plan import validate_plan

    plan = Plan.from_json(text)
    validate_plan(plan, structure, world_size=world)
    return plan


def profile_entry(text: str) -> Profile:
    prof = Profile.from_json(text)
    if prof.schema_version != PROFILE_SCHEMA_VERSION:  # an older one reads, but lacks what is measured now
        raise ValueError(f"profile of schema version {prof.schema_version}, before {PROFILE_SCHEMA_VERSION}: the model is profiled again")
    _check_fields(prof, "profile")
    _check_fields(prof.optimizer, "profile.optimizer")
    for i, u in enumerate(prof.units):
        _check_fields(u, f"profile.units[{i}]")
    for name in ("ready_order", "optimizer.state_names"):
        values = prof.ready_order if name == "ready_order" else prof.optimizer.state_names
        if not all(isinstance(v, str) for v in values):
            raise ValueError(f"profile.{name} holds something other than names")
    return prof


def comm_entry(text: str, machine: dict[str, Any]) -> CommModel:
    """A cached comm model, for this machine, with a finite fit for every operation."""
    from .cost.comm import OPS

    model = CommModel.from_json(text)
    _check_fields(model, "comm model")
    measured_on = (model.backend, model.world_size, model.device)
    here = (machine["backend"], machine["world"], machine["device_name"])
    if measured_on != here:
        raise ValueError(f"comm model measured on (backend, world size, device) {measured_on}, not {here}")
    missing = sorted(set(OPS) - model.ops.keys())
    if missing:
        raise ValueError(f"comm model has no fit for {', '.join(missing)}")
    for name, fits in (("ops", model.ops), ("host", model.host)):
        for op, fit in fits.items():
            _check_fields(fit.small, f"comm model.{name}.{op}.small")
            _check_fields(fit.large, f"comm model.{name}.{op}.large")
            _number(fit.split_bytes, f"comm model.{name}.{op}.split_bytes", finite=False)
    for name in ("compute_slowdown", "comm_slowdown"):
        if getattr(model, name) <= 0:
            raise ValueError(f"comm model.{name} = {getattr(model, name)!r} is not positive")
    for op, rows in model.contention.items():
        sizes = []
        for i, row in enumerate(rows if isinstance(rows, list) else [None]):
            if not isinstance(row, list) or len(row) not in (3, 4):
                raise ValueError(f"comm model.contention.{op}[{i}] is not [bytes, slowdown, slowdown(, slowdown)]")
            for x in row:
                _number(x, f"comm model.contention.{op}[{i}]")
            sizes.append(row[0])
        if any(b <= a for a, b in zip([0] + sizes, sizes)):
            raise ValueError(f"comm model.contention.{op}: message sizes are not positive and increasing")
    for name in ("transient", "overhead"):
        for k, v in getattr(model, name).items():
            _number(v, f"comm model.{name}.{k}")
    return model


def placement_entry(text: str, structure: Any) -> dict[str, str]:
    """A stored placement: every unit of the model, each ``replicate`` or ``shard``."""
    from .plan import PLACEMENTS

    hint = json.loads(text)
    units = {u.name for u in structure.units}
    if not isinstance(hint, dict) or set(hint) != units or not all(v in PLACEMENTS for v in hint.values()):
        raise ValueError(f"expected an object mapping each of the model's {len(units)} units to 'replicate' or 'shard'")
    return hint


def _number(value: Any, where: str, *, finite: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{where} = {value!r} is not a {'finite ' if finite else ''}number")


def _check_fields(obj: Any, where: str) -> None:
    """Every field of dataclass ``obj`` holds the JSON type its annotation names."""
    kinds = {"str": str, "bool": bool, "list": list, "dict": dict}
    for f in fields(obj):
        value, at, kind = getattr(obj, f.name), f"{where}.{f.name}", str(f.type).split("[")[0]
        if kind in ("int", "float"):
            _number(value, at)
        elif kind in kinds and not isinstance(value, kinds[kind]):
            raise ValueError(f"{at} = {value!r:.60} is not a {kind}")


def search_provenance(result: SearchResult, source: str) -> dict[str, Any]:
    """What a searched plan records about how it was found."""
    from . import __version__

    cfg = result.config
    prov = {
        "source": source, "search": "backtracking", "alpha": cfg.alpha, "beta": cfg.beta,
        "evaluated": result.evaluated, "search_seconds": round(result.seconds, 3), "stopped_by": result.stopped_by,
        "autodist_version": __version__, "torch_version": torch.__version__,
    }
    if result.inside_headroom:
        prov["inside_headroom"] = True  # nothing fitted the budget less the headroom; this fits the budget
    if result.refined:
        prov["estimator"] = "learned: the finalists ranked by the simulator with the learned estimator"
    if result.preferred_seed:
        # the plan is the built-in seed, kept over a searched plan predicted less than this much faster
        prov["source"] = f"{source} (kept {result.preferred_seed})"
        prov["preferred_seed"] = result.preferred_seed
        prov["prefer_seed_within"] = round(cfg.prefer_seed_within, 4)
        prov["margin_source"] = cfg.margin_source
    return prov


def search_within_budget(
    space: Any, simulator: Callable[[int | None], Simulator], config: SearchConfig, budget: int | None,
) -> tuple[Searcher, SearchResult]:
    """Search within ``budget`` less the config's memory headroom (the simulator's measured peak
    error). When nothing is predicted to fit there but a plan is predicted to fit the budget itself,
    search again within the budget: that plan is enacted (its provenance says ``inside_headroom``
    and a warning says its measured peak may exceed the budget) rather than refused — the contract
    is that no plan predicted above the budget runs. ``simulator(b)`` builds a simulator for budget ``b``."""
    searcher = Searcher(space, simulator(config.planning_budget(budget)), config)
    result = searcher.run()
    if result.result.feasible or budget is None:
        return searcher, result
    smallest = (result.smallest_peak or (result.result.peak_bytes, None))[0]
    if smallest > budget:
        return searcher, result
    inside = Searcher(space, simulator(budget), config)
    again = inside.run()
    if not again.result.feasible:
        return searcher, result
    again.inside_headroom = True
    logger.warning(
        "autodist: no plan is predicted to fit %s less its %.0f%% headroom (the simulator's measured peak error); "
        "using one predicted at %s, within the budget but inside that margin: its measured peak may exceed the budget",
        format_bytes(budget), 100 * config.memory_headroom, format_bytes(again.result.peak_bytes),
    )
    return inside, again


def budget_error(budget: int, result: SearchResult, structure: Any, plan: Plan | None = None) -> BudgetError:
    """The error when no plan fits: the smallest predicted peak, what it is made of, and what would
    make a plan fit (the levers for the largest part first)."""
    peak, genome = result.smallest_peak or (result.result.peak_bytes, None)
    sim = result.smallest_peak_result or result.result
    parts = sorted(((v, k) for k, v in sim.breakdown.items() if v > 0), reverse=True)
    made_of = ", ".join(f"{k} {format_bytes(v)}" for v, k in parts) or "unknown"
    how = []
    if genome is not None:
        n_units = len(genome.shard)
        how.append(f"{sum(genome.shard)} of {n_units} units sharded")
        if genome.recompute:
            how.append(f"{len(genome.recompute)} block(s) recomputed")
        if genome.offload:
            how.append(f"{len(genome.offload)} optimizer-state tensor(s) offloaded to host memory")
    largest = parts[0][1] if parts else ""
    fixes = []
    if largest.startswith("activations"):
        fixes.append("reduce the batch per rank (activations grow with it)")
    fixes.append("launch more ranks (shards of parameters, gradients and optimizer state shrink with the world size)")
    if not largest.startswith("activations"):
        fixes.append("use mixed precision (MixedPrecision(param_dtype=torch.bfloat16))")
    fixes.append(f"or raise memory_limit above {format_bytes(peak)} if the device has room")
    headroom = result.config.memory_headroom
    return BudgetError(
        f"no plan fits the budget of {format_bytes(budget)} per rank (plans are kept {headroom:.0%} below it, the "
        f"simulator's measured error): the smallest predicted peak is "
        f"{format_bytes(peak)}{' (' + ', '.join(how) + ')' if how else ''}, made of {made_of}. "
        f"To fit: {'; '.join(fixes)}."
    )


def plan_offline(
    module: Any,
    example_inputs: tuple,
    *,
    world_size: int,
    budget_bytes: int,
    comm: CommModel,
    device: torch.device | None = None,
    config: SearchConfig | None = None,
    grad_accum_steps: int | None = None,
    example_kwargs: dict[str, Any] | None = None,
    profile: Profile | None = None,
) -> tuple[Plan, SearchResult, Profile]:
    """Plan for ``world_size`` ranks from one process (``autodist plan``): profile ``module`` here
    (unless given its ``profile``), search with ``comm`` (a cached sweep or an analytic model)
    under ``budget_bytes``."""
    from .structure import discover

    device = device or torch.device("cpu")
    config = config or SearchConfig()
    comm = config.calibrated(comm)
    structure = discover(module)
    prof = profile or profile_model(module, structure, example_inputs, device=device, example_kwargs=example_kwargs)
    space = space_for(prof, structure, world_size, grad_accum_steps=grad_accum_steps)
    _, result = search_within_budget(
        space, lambda budget: Simulator(prof, structure, comm, world_size=world_size, budget_bytes=budget),
        config, budget_bytes,
    )
    if not result.result.feasible:
        raise budget_error(budget_bytes, result, structure)
    plan = result.plan
    made_for(plan, structure, optimizer_states=prof.optimizer.state_names)
    plan.device = device.type
    plan.budget_bytes = budget_bytes
    plan.predicted = {
        "step_seconds": result.result.step_s,
        "peak_bytes": result.result.peak_bytes,
        "vs": {n: r.step_s / result.result.step_s for n, r in result.seeds.items() if r.feasible and result.result.step_s},
    }
    plan.provenance = search_provenance(result, "autodist plan")
    return plan, result, prof
