"""``AutoDist``: the one line a training loop changes."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parameter import is_lazy

from ._log import announce, logger
from .builtins import BUILTIN_PLANS, builtin_plan
from .cost.budget import format_bytes, parse_memory_limit
from .errors import AutoDistError, InitError, PlanError, RankMismatchError, mark_raised_on_every_rank, reported_once
from .plan import COMPILE_BACKENDS, Plan, validate_plan
from .runtime.comm import Comm, _new_group, group_timeout, init_distributed
from .runtime.engine import Engine
from .runtime.materialize import Materializer, is_meta_model
from .runtime.precision import MixedPrecision
from .runtime.state import agree_on_state_dict, full_state_dict, load_full_state_dict
from .structure import ModelStructure, discover

if TYPE_CHECKING:
    from .planner.online import AutoPlanner

PLAN_CHOICES = ("auto",) + BUILTIN_PLANS


def _reported_once(init: Callable[..., None]) -> Callable[..., None]:
    """An error that every rank of a multi-rank job raises (an AutoDist error, or a bad argument's
    ``ValueError``/``TypeError``) leaves ``__init__`` in the form
    :func:`~autodist.errors.reported_once` gives it: printed by rank 0, without a traceback; the
    other ranks exit quietly with the same status. An unknown keyword argument (Python's own
    ``TypeError``, raised before ``__init__`` runs) is agreed between the ranks the same way."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapped(self: AutoDist, *args: Any, **kwargs: Any) -> None:
        try:
            try:
                signature.bind(self, *args, **kwargs)
            except TypeError as e:
                names = [n for n, p in list(signature.parameters.items())[1:] if p.kind is not p.VAR_POSITIONAL]
                unknown = TypeError(f"AutoDist() {e}; its arguments are {', '.join(names)}")
                if not _in_multi_rank_job():
                    raise unknown from None
                init_distributed()
                _agree_on_arguments(unknown, None)
            init(self, *args, **kwargs)
        except (AutoDistError, ValueError, TypeError) as e:
            if not getattr(e, "raised_on_every_rank", False) or not dist.is_initialized() or dist.get_world_size() == 1:
                raise
            comm = getattr(self, "_comm", None)
            if comm is not None:
                comm.destroy()  # see [Note: object exchanges and interpreter exit]
            raise reported_once(e, rank=dist.get_rank()) from None

    return wrapped


STATE_DICT_ON_EVERY_RANK = (
    "Call it on every rank and save on one: `sd = model.state_dict()` then `if rank == 0: torch.save(sd, path)`; "
    "or save sharded with torch.distributed.checkpoint."
)


class AutoDist(nn.Module):
    """Data-parallel training of ``module`` following a plan.

    Args (all but ``module`` keyword-only):
        module: the model, on the CPU or on this rank's device (it is moved to the device), or built on
            the meta device (``with torch.device("meta"): model = Net()``): it is then materialised and
            initialised module by module, each rank keeping only what the plan places on it (see
            ``param_init_fn``).
        plan: ``"auto"`` (profile, search, cache), a built-in baseline (``"ddp"``, ``"fsdp"``,
            ``"zero2"``), a :class:`Plan`, or the path of a plan JSON file (it must exist on rank 0;
            ranks where it does not exist use rank 0's copy).
        mesh: the ``DeviceMesh`` to run on (default: every rank of the default process group): 1-D,
            or 2-D of shape (replicas, shard group) for hybrid sharding as FSDP2's HSDP (sharded units
            are sharded within each row and replicated across rows; the parameters are DTensors on
            this mesh, ``(Replicate(), Shard(0))``).
        memory_limit: budget per rank — bytes, ``"24GiB"`` or ``"80%"``. Default: what the device has
            free, minus a margin.
        example_inputs: a tuple of positional inputs for one forward call; lets ``plan="auto"``
            profile and search before the first step.
        example_kwargs: keyword inputs of that forward call (``{"labels": ids}`` for a Hugging Face
            model, which then returns its own loss: the profile measures it). Either or both.
        grad_accum_steps: micro-batches per optimizer step (forward/backward passes, the first ones
            under ``no_sync()``), for ``plan="auto"`` to plan for; default: as observed while
            profiling the first steps (1 with ``example_inputs``). A loop that uses another count
            stays correct, only the plan may be slower than it could be.
        cache_dir: where ``plan="auto"`` keeps profiles and plans (default ``$AUTODIST_CACHE_DIR``,
            ``$XDG_CACHE_HOME/autodist`` or ``~/.cache/autodist``).
        mixed_precision: :class:`MixedPrecision` (or torch's ``MixedPrecisionPolicy``).
        broadcast_buffers: broadcast buffers (BatchNorm statistics) from rank 0 before the first
            forward and before every forward that follows one run with gradients enabled outside
            ``no_sync()`` — whatever its own grad mode, so an evaluation after a training step uses
            rank 0's statistics — as DDP does (default ``True``).
        log_every: log step time, throughput, peak tensor memory against the budget, resident memory
            and exposed communication on rank 0 every this many steps (default ``None``: never;
            ``metrics()`` works regardless). On CUDA it also lets AutoDist reset the allocator's
            peak counter at each step, for per-step peaks (see ``autodist/metrics.py``).
        param_init_fn: for a model on the meta device, ``fn(module)`` initialises ``module``'s own
            parameters and buffers in place; called with every module, children first. Default: each
            module's ``reset_parameters()``. Every rank initialises on the host and keeps rank 0's
            values, so the result after ``torch.manual_seed(s)`` is that of building the model on the
            CPU after the same seed (see ``autodist/runtime/materialize.py`` for when that cannot hold).
        compile: whether ``plan="auto"`` may run blocks under ``torch.compile`` (their operators
            fused): ``False`` (default) never compiles — compiling costs minutes at the first launch
            and changes results in the last bits; ``True`` (inductor) or a backend name
            (``"inductor"``, ``"aot_eager"``, ``"eager"``) lets the planner time every block compiled
            and eager and choose per block, weighing the fusion gain against the later readiness of
            the block's gradients; the plan records the backend. Needs ``example_inputs`` (or
            ``example_kwargs``). Blocks the model compiled itself are left as they are. Another
            ``plan`` compiles what its ``compile`` field lists.
        shard_size: shard within groups of this many consecutive ranks and replicate across them
            (hybrid sharding, FSDP2's HSDP): an integer dividing the world size, or ``"node"`` for the
            ranks of one node (torchrun's ``LOCAL_WORLD_SIZE``). Default: a 2-D mesh's last
            dimension, else the plan's ``shard_size`` (``null``: the whole world). Built-in plans
            and plans without a ``shard_size`` take it; a plan with another one is refused.

    The wrapper behaves like the wrapped module: ``named_parameters()`` and ``state_dict()`` use the
    wrapped module's names (no ``module.`` prefix). ``state_dict()`` returns full tensors;
    ``model.module.state_dict()`` returns the parameters as they are held (DTensor shards when the
    plan shards anything), which is what ``torch.distributed.checkpoint`` should save.
    """

    @_reported_once
    def __init__(
        self,
        module: nn.Module,
        *misplaced: Any,
        plan: str | os.PathLike[str] | Plan = "auto",
        mesh: DeviceMesh | None = None,
        memory_limit: int | str | None = None,
        example_inputs: tuple[Any, ...] | None = None,
        example_kwargs: dict[str, Any] | None = None,
        grad_accum_steps: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        mixed_precision: MixedPrecision | Any | None = None,
        broadcast_buffers: bool = True,
        log_every: int | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        shard_size: int | str | None = None,
        compile: bool | str = False,
        # DDP's keywords, so that `DDP(model, device_ids=[local_rank], ...)` becomes AutoDist(...) as it is
        device_ids: Any = None,
        output_device: Any = None,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        self._closed = False
        self._failed: BaseException | None = None
        self._auto: AutoPlanner | None = None
        # Every argument is checked before anything is modified; in a multi-rank job the ranks then
        # agree on the outcome, so a bad argument is one error raised on every rank (reported once).
        compile_backend: str | None = None
        try:
            if misplaced:
                raise TypeError(_positional_message(misplaced))
            mesh, self._bucket_cap_bytes = _ddp_keywords(
                device_ids=device_ids, output_device=output_device, process_group=process_group, mesh=mesh,
                bucket_cap_mb=bucket_cap_mb, plan=plan, find_unused_parameters=find_unused_parameters,
                gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
            )
            meta, mixed_precision = _check_arguments(
                module, plan, mesh=mesh, example_inputs=example_inputs, example_kwargs=example_kwargs,
                grad_accum_steps=grad_accum_steps, cache_dir=cache_dir, mixed_precision=mixed_precision,
                log_every=log_every, param_init_fn=param_init_fn, shard_size=shard_size,
            )
            compile_backend = _check_compile_argument(
                compile, plan, meta=meta, example_inputs=example_inputs, example_kwargs=example_kwargs,
            )
            refused: BaseException | None = None
        except (AutoDistError, ValueError, TypeError) as e:
            refused = e
        if refused is not None and not _in_multi_rank_job():
            raise refused  # a plain process: no process group is created for an error
        device = init_distributed(torch.device(mesh.device_type) if refused is None and mesh is not None and mesh.device_type == "cpu" else None)
        group = _mesh_group(mesh) if refused is None and mesh is not None else None
        _agree_on_arguments(refused, group)
        self.grad_accum_steps = grad_accum_steps
        self._mixed_precision = mixed_precision
        self._compile_backend = compile_backend
        self._explicit_budget = memory_limit is not None
        if mesh is None:
            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        devices = {p.device for p in module.parameters()} | {b.device for b in module.buffers()}
        self.module = module
        self.device = device
        self.mesh = mesh
        self._comm = Comm(group if group is not None else mesh.get_group())
        # shard groups asked for by the mesh or shard_size (None: whatever the plan says)
        requested = self._agree(lambda: _requested_shard_size(mesh, shard_size, self._comm.world_size),
                                "choose its shard groups", "every rank must shard over groups of one size")
        sizes = self._comm.all_gather_object(requested)
        if len(set(sizes)) > 1:  # e.g. nodes of different sizes under shard_size="node"
            raise mark_raised_on_every_rank(ValueError(
                f"ranks asked for shard groups of different sizes ({', '.join(f'rank {r}: {s}' for r, s in enumerate(sizes))}); "
                "shard groups must be of one size: pass one shard_size (or mesh) on every rank, or launch the same "
                "number of ranks on every node"
            ))
        self._requested_shard_size = requested
        # One budget for every rank: the tightest one's. The default (what each device has free)
        # differs between ranks, and every rank must derive the same plan and prefetch windows.
        self.budget_bytes = min(self._comm.all_gather_object(self._agree(lambda: parse_memory_limit(memory_limit, device))))
        self._structure = discover(module)
        self._meta = meta
        # A meta-device model's initialisers are tried on fake tensors first: a tensor none of them
        # writes is refused here, before anything is allocated.
        materializer = self._agree(lambda: Materializer(module, param_init_fn)) if meta else None
        # A plan that can be resolved without running the model is checked before anything changes.
        resolved = None
        if not (isinstance(plan, str) and plan == "auto"):
            resolved = self._agree(lambda: self._resolve_plan(plan, example_inputs=None, example_kwargs=None, cache_dir=None))
        if not meta:  # a meta-device model is materialised unit by unit once the engine has placed it
            if devices and next(iter(devices)) != device:
                logger.info("autodist: moving the model from %s to %s", next(iter(devices)), device)
                module.to(device)
            self._sync_initial_state()
        if resolved is None:
            resolved = self._agree(
                lambda: self._resolve_plan(plan, example_inputs=example_inputs, example_kwargs=example_kwargs, cache_dir=cache_dir)
            )
        resolved = self._agree(lambda: self._apply_shard_size(resolved, requested, mesh.ndim == 2))
        self._check_rank_agreement(resolved)
        self.mesh = mesh = self._shard_groups(resolved, mesh)
        if self._explicit_budget and self._auto is None:
            self._warn_if_over_budget(resolved)
        if not resolved.param_shapes:  # so that a saved copy of the plan in force is checked when loaded
            resolved = replace(resolved, param_shapes={n: list(p.shape) for n, p in self._structure.params.items()})
        self._engine = Engine(
            module,
            resolved,
            self._structure,
            comm=self._comm,
            mesh=mesh,
            device=device,
            mixed_precision=mixed_precision,
            broadcast_buffers=broadcast_buffers,
            budget_bytes=self.budget_bytes,
        )
        if materializer is not None:
            try:  # an initialiser that fails on one rank fails on every rank ([Note: a failure on one rank])
                self._agree(lambda: self._materialize(materializer), "initialise the model",
                            "no rank keeps a model another could not initialise", fail=InitError)
            except AutoDistError:
                self._engine.close()
                raise
            if self._auto is not None:
                self._agree(self._auto.profile_wrapped)
        from .metrics import StepMeter

        # The meter reaches this wrapper weakly: the finalizer below keeps the meter alive, and a
        # meter holding the wrapper would keep a model the user dropped without close() (its
        # runtime, its process-wide optimizer hooks) alive until the process ends.
        me = weakref.ref(self)
        self._meter = StepMeter(
            self._comm.stats, device, self.budget_bytes, self._comm.world_size, self._comm.rank, log_every,
            live=lambda: w._held_tensors() if (w := me()) is not None else [],
            host_state=lambda: w._host_state() if (w := me()) is not None else [],
            predicted_peak=lambda: w._engine.plan.predicted.get("peak_bytes") if (w := me()) is not None else None,
        )
        self._engine.step_listeners.append(self._meter.on_optimizer_step)
        # the last step is logged even if close() is never called
        self._meter_done = weakref.finalize(self, self._meter.close)
        # [Note: a model dropped without close()] The runtime's gradient hooks sit on the
        # parameters' gradient accumulators, which autograd holds in C++ where the garbage
        # collector cannot see them: a model the user drops without close() stayed alive with its
        # runtime, its parameters and its process-wide optimizer hooks until the process ended.
        # When this wrapper goes, its hooks go too (nothing collective: a collector may run at any
        # time on any rank), and the rest is ordinary garbage.
        self._unhook = weakref.finalize(self, self._engine.remove_hooks)
        if self._comm.rank == 0:
            source = "file" if isinstance(plan, (str, os.PathLike)) and plan not in PLAN_CHOICES else (
                "built-in" if plan in BUILTIN_PLANS else "object" if isinstance(plan, Plan) else "auto"
            )
            compiled = f", {len(resolved.compile)} blocks compiled ({resolved.compile_backend})" if resolved.compile else ""
            groups = (f" within groups of {resolved.shard_ranks} ranks, replicated across them"
                      if resolved.hybrid and resolved.sharded_units else "")
            announce(
                "autodist: plan %s in force (source: %s; %d units, %d sharded%s, %d gather groups, %d buckets, "
                "%d offload fragments, %d blocks recomputed%s; world size %d, budget %s)",
                resolved.label, source, len(resolved.units), len(resolved.sharded_units), groups,
                len(resolved.gather_groups), len(resolved.buckets), len(resolved.offload), len(resolved.recompute),
                compiled, self._comm.world_size, format_bytes(self.budget_bytes),
            )
        module.__dict__[_MANAGED] = True  # see _check_module_argument; removed by close()

    # ---------------------------------------------------------------------------------------------
    # plan resolution
    # ---------------------------------------------------------------------------------------------
    def _resolve_plan(self, plan: Any, *, example_inputs: Any, example_kwargs: Any, cache_dir: Any) -> Plan:
        world = self._comm.world_size
        if isinstance(plan, Plan):
            validate_plan(plan, self._structure, world_size=world, source="(Plan object)")
            return plan
        if isinstance(plan, str) and plan in BUILTIN_PLANS:
            p = builtin_plan(plan, self._structure, world, bucket_cap_bytes=self._bucket_cap_bytes)
            p.device = self.device.type
            return p
        if isinstance(plan, str) and plan == "auto":
            from .planner.online import AutoPlanner

            self._auto = AutoPlanner(_AutoRuntime(self), cache_dir, explicit_budget=self._explicit_budget)
            return self._auto.resolve(example_inputs, example_kwargs, meta=self._meta)
        return self._load_plan_file(os.fspath(plan))

    def _apply_shard_size(self, plan: Plan, requested: int | None, from_mesh: bool) -> Plan:
        """``plan`` sharding over the groups asked for: a plan without a ``shard_size`` (built-in
        ones included) takes it; one with another is refused."""
        world = self._comm.world_size
        if requested is None or plan.shard_ranks == requested:
            return plan
        if plan.shard_size is not None and plan.shard_size != world:
            asked = f"the 2-D mesh's shard dimension has {requested}" if from_mesh else f"shard_size={requested} was asked for"
            raise PlanError(
                f"shard_size: the plan shards over groups of {plan.shard_size} ranks but {asked}; pass a mesh and "
                "shard_size matching the plan, or regenerate the plan for these shard groups",
                source=None,
            )
        hybrid = replace(plan, shard_size=requested if requested < world else None)
        validate_plan(hybrid, self._structure, world_size=world, source="(plan with the mesh's shard_size)")
        return hybrid

    def _shard_groups(self, plan: Plan, mesh: DeviceMesh) -> DeviceMesh:
        """Split the process groups for a hybrid plan ([Note: hybrid sharding] in runtime/comm.py)
        and return the mesh the parameters live on: the user's 2-D mesh, or one made of the shard
        groups (rows) and replica groups (columns), consecutive ranks of ``mesh`` to a row."""
        if mesh.ndim == 2:
            rows = [[int(r) for r in row] for row in mesh.mesh.tolist()]
        elif plan.hybrid:
            ranks = [int(r) for r in mesh.mesh.tolist()]
            s = plan.shard_ranks
            rows = [ranks[i : i + s] for i in range(0, len(ranks), s)]
        else:
            return mesh
        self._comm.shard_within(rows)
        if mesh.ndim == 2:
            return mesh
        return _hybrid_mesh(rows, self.device.type)

    def _load_plan_file(self, path: str) -> Plan:
        """Read, parse and validate a plan file (a collective: see [Note: plan files]).

        [Note: plan files] A rank that has the file uses its own copy; a rank where the path does not
        exist (a file on rank 0's local disk, not on a shared filesystem) uses rank 0's, which rank
        0 sends. Every rank then validates the plan it holds, and the ranks compare plan hashes, so
        copies that differ are refused rather than silently replaced. The file must exist on rank 0.
        Whether the file exists is exchanged before anyone raises, so an error is raised on every
        rank and none is left waiting in a collective.
        """
        text, status = _read_plan_file(path)
        statuses = self._comm.all_gather_object(status)  # identical on every rank from here on
        missing = [r for r, s in enumerate(statuses) if s == _MISSING]
        if statuses[0] == _MISSING:
            if len(missing) == len(statuses):
                raise PlanError(_not_a_plan_message(path))
            have = [r for r in range(len(statuses)) if r not in missing]
            raise PlanError(
                f"plan file {path!r} does not exist on rank 0 (it does on rank(s) {have}); rank 0 sends the "
                "plan to ranks that lack the file, so it must exist on rank 0: copy it there or pass a path "
                "rank 0 can read",
                source=path,
            )
        if statuses[0] is not None:
            raise PlanError(f"cannot read plan file {path!r} on rank 0 ({statuses[0]})", source=path)
        source = path
        if missing:
            rank0_text = self._comm.broadcast_object(text)
            if self._comm.rank == 0:
                logger.info("autodist: plan file %s does not exist on rank(s) %s; they use rank 0's copy", path, missing)
            if status == _MISSING:
                text, source = rank0_text, f"{path} (rank 0's copy)"
        if text is None:
            raise PlanError(f"cannot read plan file {path!r} on rank {self._comm.rank} ({status})", source=path)
        plan = Plan.from_json(text, source=source)
        validate_plan(plan, self._structure, world_size=self._comm.world_size, source=source)
        return plan

    def _warn_if_over_budget(self, plan: Plan) -> None:
        """A plan given explicitly (built-in, file, object) is checked against an explicit budget
        before the first step, as far as the model alone allows: what it holds without activations
        (parameters, gathered copies, gradients, optimizer state as Adam's). Activations come on top
        and are checked when the first steps measure the peak (see metrics.py)."""
        from .cost.comm import CommModel
        from .cost.profile import static_profile
        from .cost.simulator import Simulator

        comm = CommModel.analytic(self._comm.world_size, bandwidth_bytes_s=1e12, latency_s=0.0)
        mp = self._mixed_precision
        sim = Simulator(
            static_profile(self._structure), self._structure, comm, world_size=self._comm.world_size,
            budget_bytes=self.budget_bytes, param_dtype=mp.param_dtype if mp else None,
            reduce_dtype=mp.reduce_dtype if mp else None,
        )
        r = sim.run(plan)
        if r.peak_bytes > self.budget_bytes and self._comm.rank == 0:
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in r.breakdown.items() if v > 0)
            logger.warning(
                "autodist: plan %s is predicted to need %s per rank before any activation (%s), over the budget of %s; "
                "training will likely run out of memory. Use plan='auto' (it plans within the budget), a plan that "
                "shards more, or a larger memory_limit.",
                plan.label, format_bytes(r.peak_bytes), parts, format_bytes(self.budget_bytes),
            )

    def _agree(self, fn: Any, what: str = "resolve the plan", why: str = "every rank must see the same plan",
               fail: Callable[[str], AutoDistError] = lambda m: PlanError(m, source=None)) -> Any:
        """Run ``fn`` on every rank; if it raises on any rank, raise on every rank (never hang): its
        own error where it raised, ``fail``'s saying that rank could not do ``what`` elsewhere."""
        error: BaseException | None = None
        try:
            result = fn()
        except (AutoDistError, OSError, ValueError, TypeError) as e:
            error, result = e, None
        statuses = self._comm.all_gather_object(_status(error))
        _raise_agreed(statuses, error, lambda r, m: fail(f"rank {r} could not {what} ({m}); {why}"))
        return result

    def _check_rank_agreement(self, plan: Plan) -> None:
        # Which units a module's own code reads is found in its class's source (structure.py
        # find_functional_uses), read by each rank from its own files: the gathers it adds must be
        # the same on every rank, like the plan's.
        uses = sorted((m, list(u)) for m, u in self._structure.functional_uses.items())
        seen = self._comm.all_gather_object((plan.hash(), uses))
        hashes = [h for h, _ in seen]
        differ = next((r for r, (_, u) in enumerate(seen) if u != uses), None)
        if differ is not None:
            theirs = dict(seen[differ][1])
            m = next(m for m in sorted(set(dict(uses)) | set(theirs)) if dict(uses).get(m) != theirs.get(m))
            raise mark_raised_on_every_rank(RankMismatchError(
                f"ranks read different model code: module {m or '(root)'!r}'s own forward reads the parameters "
                f"of {dict(uses).get(m, [])} on rank {self._comm.rank} but {theirs.get(m, [])} on rank {differ}. "
                "Every rank must run the same version of the model's source files."
            ))
        if len(set(hashes)) > 1:
            differing = [r for r, h in enumerate(hashes) if h != hashes[0]]
            raise mark_raised_on_every_rank(RankMismatchError(
                f"ranks disagree on the plan (hash on rank 0: {hashes[0]}; ranks {differing} differ). Every rank "
                "must load the same plan file and wrap the same model."
            ))

    def _materialize(self, materializer: Materializer) -> None:
        """Initialise a meta-device model into the engine's managed parameters (see materialize.py)."""
        report = materializer.run(
            params=self._engine.params,
            broadcast=lambda tensors: self._comm.broadcast_tensors(tensors, "materialize"),
            device=self.device,
        )
        for mp in self._engine.params.values():
            mp.register_visible()
        self._engine.mark_stale()
        if self._comm.rank == 0:
            logger.info(
                "autodist: materialised the model from the meta device on %s: %d tensors (%s) initialised by %d "
                "initialiser calls, at most %s of them held in full at once (at %s)",
                self.device, report.tensors, format_bytes(report.total_bytes), report.calls,
                format_bytes(report.largest_live_bytes), report.largest_live_at,
            )

    @torch.no_grad()
    def _sync_initial_state(self) -> None:
        """Every rank starts from rank 0's parameters and buffers."""
        tensors = [p.detach() for p in self.module.parameters()] + list(self.module.buffers())
        self._comm.broadcast_tensors(tensors, "init")

    # ---------------------------------------------------------------------------------------------
    # nn.Module interface
    # ---------------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError(
                "this AutoDist instance was closed: close() removed its hooks and released its process groups. "
                "Wrap the model again (AutoDist(model.module, ...)) to train it; state_dict() still gives its parameters."
            )
        if self._failed is not None:
            raise RuntimeError(
                f"this AutoDist instance stopped at a fatal error ({type(self._failed).__name__}: "
                f"{str(self._failed).splitlines()[0]}); nothing more trains on it. Fix what the error says "
                "and wrap the model again."
            )
        if torch.is_grad_enabled():
            # a forward that joins the step of the one before it (several forwards before one
            # backward) neither begins a recorded pass nor ends a logged step
            joins = self._engine.forward_joins_step()
            if self._auto is not None and not joins:  # first: its planning (which may profile) is outside the step's memory window
                try:
                    self._auto.before_forward(args, kwargs)
                except AutoDistError as e:
                    self._stop_at(e)
                    raise
            self._meter.on_forward(args, kwargs, sync=self._engine.sync_enabled, joins=joins)
        return self._engine.forward(args, kwargs)

    def _stop_at(self, error: BaseException) -> None:
        """A fatal error ended training: no later forward runs, and no step is logged after it (the
        steps before it were logged as they ended)."""
        self._failed = error
        self._meter_done.detach()
        self._meter.abandon()

    def _held_tensors(self) -> list[torch.Tensor]:
        """The tensors this model holds between steps, for the CPU's tensor-memory baseline (the
        meter adds the optimizers' state): the runtime's, the buffers, the gradients, offload buffers."""
        eng = self._engine
        grads = [mp.visible.grad for mp in eng.params.values() if mp.visible.grad is not None]
        offload = [t for e in eng.offload.entries.values() for t in (e.h, e.d) if t is not None]
        return [*eng.held_tensors(), *self.module.buffers(), *grads, *offload]

    def _host_state(self) -> list[torch.Tensor]:
        """The host buffers of offloaded optimizer state (the tensors that hold it)."""
        return [e.h for e in self._engine.offload.entries.values() if e.h is not None]

    def metrics(self) -> dict[str, Any]:
        """The last completed step's metrics as a dict (empty before the first step ends), for your own
        logger. A step ends with the optimizer step over this model's parameters (see
        ``autodist.metrics``)."""
        return self._meter.as_dict()

    @property
    def plan(self) -> Plan:
        """The plan in force (after any switch or bucket rebuild)."""
        return self._engine.plan

    @property
    def structure(self) -> ModelStructure:
        return self._structure

    @property
    def runtime(self) -> Engine:
        return self._engine

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """Full (unsharded) tensors under the wrapped module's keys. Under a plan that shards, a
        collective: call on every rank ([Note: a collective called on some ranks only] in
        autodist/runtime/comm.py)."""
        if args:
            raise TypeError("state_dict() takes keyword arguments only (destination=, prefix=, keep_vars=)")
        if any(mp.sharded for mp in self._engine.params.values()):
            self._comm.rendezvous("state_dict()", STATE_DICT_ON_EVERY_RANK)
        sd = full_state_dict(self.module, prefix=prefix, keep_vars=keep_vars)
        if destination is not None:
            destination.update(sd)
            return destination
        return sd

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load full tensors (or DTensors) saved under any plan or world size. A collective."""
        if assign:
            raise ValueError("AutoDist.load_state_dict does not support assign=True: parameters are managed in place")
        self._comm.rendezvous("load_state_dict()", "Load the state dict on every rank (each rank may read the same file).")
        self._agree(lambda: agree_on_state_dict(self.module, state_dict, self._comm.all_gather_object))
        self._engine.quiesce()  # no gather may read a shard while it is written
        result = load_full_state_dict(self.module, self._engine.params, state_dict, strict=strict)
        self._engine.mark_stale()
        return result

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> AutoDist:
        """What ``.to()``, ``.half()``, ``.cuda()``, ``.to_empty()`` run on the wrapper.

        [Note: converting a wrapped model] AutoDist holds each parameter in storage of its own: a
        sharded one's local shard is a view into the plan's flat shard buffer, which the gathers
        read, and a replicated one's gradient is a view into its bucket, laid out like the
        parameter. A conversion replaces the parameter's tensor (``param.data = ...``, or a swap
        for DTensors), so the optimizer would update a tensor the gathers never read:
        ``model.to(memory_format=torch.channels_last)`` after wrapping trained 3e-2 off the
        reference under ``fsdp``, without an error. So a conversion that would change any parameter
        is refused before anything is touched, naming the parameter and the fix (convert before
        wrapping, as DDP and FSDP2 expect); one that changes none (``model.to(device)`` to the
        device it is on, the usual line of a training script) goes through, buffers included.
        ``fn`` returns its argument itself when nothing changes, so the check costs nothing then.
        Only the wrapper is guarded: the user's module keeps its class's ``_apply`` (nothing of
        AutoDist's is put in its instance dict, which ``torch.save(model.module)`` pickles), so
        ``model.module.half()`` is not seen."""
        if not self._closed:
            for name, p in self.module.named_parameters():
                out = fn(p)
                if out is p:
                    continue
                raise ValueError(
                    f"converting parameter {name!r} of a model AutoDist manages ({_tensor_format(p)} -> "
                    f"{_tensor_format(out)}) is not supported: AutoDist holds the parameters in storage of its own "
                    "(shards, gradient buckets) that the converted tensors would leave behind. Convert the model "
                    "before wrapping it (model.to(device, dtype, memory_format=...), then AutoDist(model, ...)); "
                    "nothing was changed"
                )
        return super()._apply(fn, recurse)

    def _fqn_modifiers(self) -> dict[str, str]:
        # torch.distributed.checkpoint.state_dict: our keys omit the 'module.' level.
        return {name: "module" for name, _ in self.module.named_children()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, and the gradients ``no_sync`` backward passes accumulated out
        of sight are dropped too ([Note: gradients accumulated without sync, shown] in
        autodist/runtime/params.py): a sharded parameter shows none until the synchronising
        backward, so an optimizer's ``zero_grad()`` cannot reach them, as under FSDP2."""
        super().zero_grad(set_to_none)
        if not self._closed:
            for mp in self._engine.params.values():
                mp.drop_held_grad()

    # ---------------------------------------------------------------------------------------------
    # gradient synchronisation control
    # ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, in forwards run inside (DDP's API)."""
        old = self._engine.sync_enabled
        self._engine.sync_enabled = False
        try:
            yield
        finally:
            self._engine.sync_enabled = old

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's flag behind ``no_sync()``: loops that set it themselves (nanoGPT sets it off for
        every micro-batch but the last) accumulate without communication as under DDP; before,
        the assignment made a plain attribute and every micro-batch was reduced."""
        return self._engine.sync_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._engine.sync_enabled = bool(value)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """DDP's communication hooks: refused with what to do instead ([Note: DDP's keywords])."""
        raise NotImplementedError(
            "AutoDist issues its own gradient reductions (the plan's all-reduces and reduce-scatters), so DDP's "
            "communication hooks have nothing to attach to. For gradients reduced in fp16/bf16 (fp16_compress_hook, "
            "bf16_compress_hook) pass mixed_precision=MixedPrecision(reduce_dtype=torch.bfloat16); other hooks "
            "(PowerSGD) are not supported."
        )

    def join(self, *args: Any, **kwargs: Any) -> Any:
        """DDP's uneven-inputs context: refused with what to do instead."""
        raise NotImplementedError(
            "uneven inputs (DDP's join()) are not supported: every rank must run as many forward and backward "
            "passes as the others. Give each rank the same number of batches (DistributedSampler(..., "
            "drop_last=True), or a sampler that pads the last batch)."
        )

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's API: whether the next forward/backward reduces gradients."""
        self._engine.sync_enabled = bool(requires_gradient_sync)

    def close(self) -> None:
        """Remove every hook and release this instance's process groups; calling the instance
        afterwards raises. ``module`` keeps its current parameters as the plan placed them: a module
        whose parameters are all replicated runs as a plain module, and sharded ones stay this rank's
        DTensor shards, which ``state_dict()`` still gathers. Logs the last step when ``log_every`` is
        set and it was not logged yet. Call on every rank; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._meter_done()
        self._unhook.detach()
        self._engine.close()
        self._comm.destroy()
        self.module.__dict__.pop(_MANAGED, None)

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        """A Hugging Face model's ``save_pretrained``, with the model's full tensors; call it on
        every rank (rank 0 writes, as ``is_main_process`` defaults to it here).

        [Note: save_pretrained under a plan that shards] The wrapped model's own
        ``save_pretrained`` finds the parameters' storages to tell tied weights from others, and
        AutoDist's shards are views into one flat buffer per dtype: every sharded parameter looked
        tied to every other of its size, and the save failed inside transformers ("Attempted to
        access the data pointer on an invalid python storage"; a rank 0 alone calling it waited
        for the others). Here ``state_dict`` defaults to :meth:`state_dict` (full tensors, a
        collective under a plan that shards), as Accelerate passes its gathered state dict, and
        only rank 0 writes the files. A module without ``save_pretrained`` raises AttributeError."""
        save = getattr(self.module, "save_pretrained", None)
        if save is None:
            raise AttributeError(f"{type(self.module).__name__} has no save_pretrained (not a Hugging Face model)")
        if "state_dict" not in kwargs and any(isinstance(p, torch.distributed.tensor.DTensor) for p in self.module.parameters()):
            kwargs["state_dict"] = self.state_dict()
        kwargs.setdefault("is_main_process", self._comm.rank == 0)
        return save(save_directory, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """An attribute this object lacks is the wrapped module's (``model.generate(...)``,
        ``model.config`` of a Hugging Face model), as under FSDP2, whose ``fully_shard`` keeps the
        model's own class; DDP code reaching them through ``model.module`` works as it does."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            return getattr(module, name)

    def __deepcopy__(self, memo: dict) -> nn.Module:
        """A copy of the model as a plain module (``copy.deepcopy(model)``; torch's ``AveragedModel``
        and EMA helpers make one), when every parameter is a plain replicated tensor (DDP's plans).

        [Note: copies of a wrapped model] DDP's copy is another DDP; an AutoDist instance holds
        process groups, an engine and hooks on the module's submodules, and a copy of those would
        train nothing (before, the copy failed on pickling a process group, or on a storage).
        What averaging code needs is the model's modules with their own parameters: the copy is
        ``module`` deep-copied without AutoDist's hooks, which runs on its own and whose
        ``parameters()`` line up with this model's (plain tensors, so ``update_parameters(model)``
        works). Under a plan with DTensors the parameters are this rank's shards, and a copy of
        them cannot run a forward; that is refused, naming what works (FSDP2 refuses every copy)."""
        if any(isinstance(p, torch.distributed.tensor.DTensor) for p in self.module.parameters()):
            raise AutoDistError(
                "copy.deepcopy of an AutoDist model whose plan uses DTensors (sharded parameters, or a mesh plan) is "
                "not supported: its parameters are this rank's shards (FSDP2 refuses copies too). For a weight average "
                "or EMA, keep one updated from model.state_dict(), which holds full tensors (timm's ModelEmaV3 made "
                "from the model before wrapping it does), or copy the model before wrapping it and load "
                "model.state_dict() into the copy."
            )
        engine_hooks = {h.id for h in self._engine._module_handles + self._engine._handles}
        copied = copy.deepcopy(self.module, memo)
        for m in copied.modules():
            m.__dict__.pop(_MANAGED, None)
            for hooks in (m._forward_pre_hooks, m._forward_hooks, m._forward_pre_hooks_with_kwargs,
                          m._forward_hooks_with_kwargs, m._forward_hooks_always_called):
                for hid in [k for k in hooks if k in engine_hooks]:
                    hooks.pop(hid)
        return copied

    def extra_repr(self) -> str:
        p = self.plan
        return f"plan={p.label}, world_size={p.world_size}, sharded_units={len(p.sharded_units)}, buckets={len(p.buckets)}"


class _AutoRuntime:
    """The view of a wrapper ``plan="auto"`` plans through (``autodist/planner/online.py``
    ``Runtime``): what it profiles, the plan in force, and the switch to another."""

    def __init__(self, w: AutoDist) -> None:
        self._w = w
        self.module = w.module
        self.device = w.device
        self.structure = w._structure
        self.comm = w._comm
        self.mixed_precision = w._mixed_precision
        self.budget_bytes = w.budget_bytes
        self.grad_accum_steps = w.grad_accum_steps
        self.shard_size = w._requested_shard_size
        self.compile_backend = w._compile_backend

    def plan(self) -> Plan:
        return self._w._engine.plan

    def placements(self) -> dict[str, str]:
        return {name: mp.placement for name, mp in self._w._engine.params.items()}

    def trained_params(self) -> list[tuple[str, torch.Tensor]]:
        return [(mp.name, mp.full) for mp in self._w._engine.params.values() if mp.requires_grad]

    def visible_ids(self) -> set[int]:
        return {id(mp.visible) for mp in self._w._engine.params.values()}

    def observed_accum_steps(self) -> int:
        return self._w._engine.stats.grad_accum_steps

    def forward(self, args: tuple, kwargs: dict) -> Any:
        return self._w._engine.forward(args, kwargs)

    def clear_grads(self) -> None:
        for mp in self._w._engine.params.values():
            mp.visible.grad = None

    def observe(self, recorder: Any) -> None:
        self._w._engine.observer = recorder

    def switch(self, plan: Plan) -> None:
        self._w._engine.switch_plan(plan)
        self._w._check_rank_agreement(plan)


_MANAGED = "_autodist_managed"  # set on a module while an AutoDist instance manages it


def _tensor_format(t: torch.Tensor) -> str:
    return f"{t.dtype}, {t.device}, strides {tuple(t.stride())}"


def _check_arguments(
    module: Any, plan: Any, *, mesh: Any, example_inputs: Any, example_kwargs: Any, grad_accum_steps: Any,
    cache_dir: Any, mixed_precision: Any, log_every: Any, param_init_fn: Any, shard_size: Any = None,
) -> tuple[bool, MixedPrecision | None]:
    """Every check of ``AutoDist``'s arguments that needs no other rank (what the memory limit and a
    plan file resolve to is agreed later): raises the first problem as a ``ValueError`` or
    ``TypeError`` (a ``PlanError`` for the plan) naming the argument and the fix. Returns whether
    the model is on the meta device and the mixed-precision policy."""
    _check_module_argument(module)
    meta = is_meta_model(module)
    if param_init_fn is not None and not meta:
        raise ValueError(
            "param_init_fn initialises a model built on the meta device; this model's tensors are already "
            "materialised: drop param_init_fn, or build the model under `with torch.device('meta'):`"
        )
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(f"param_init_fn must be callable with a module, got {type(param_init_fn).__name__}")
    mixed_precision = MixedPrecision.coerce(mixed_precision, module)
    _check_plan_argument(plan)
    auto = isinstance(plan, str) and plan == "auto"
    if (example_inputs is not None or example_kwargs is not None) and not auto:
        raise ValueError("example_inputs/example_kwargs are only used by plan='auto'; drop them or pass plan='auto'")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"example_kwargs must be a dict of keyword inputs, got {type(example_kwargs).__name__}")
    if grad_accum_steps is not None and (isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) or grad_accum_steps < 1):
        raise ValueError(f"grad_accum_steps must be a positive number of micro-batches per optimizer step, got {grad_accum_steps!r}")
    if cache_dir is not None and not auto:
        raise ValueError("cache_dir is only used by plan='auto'; drop it or pass plan='auto'")
    if log_every is not None and (isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1):
        raise ValueError(f"log_every must be a positive number of steps or None, got {log_every!r}")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a 1-D or 2-D DeviceMesh or None, got {type(mesh).__name__}")
    if mesh is not None and mesh.ndim not in (1, 2):
        raise ValueError(
            f"AutoDist runs on a 1-D DeviceMesh, or a 2-D one of shape (replicas, shard group) for hybrid "
            f"sharding; got a {mesh.ndim}-D mesh {mesh}"
        )
    _check_shard_size_argument(shard_size, mesh)
    devices = {p.device for p in module.parameters()} | {b.device for b in module.buffers()}
    if len(devices) > 1:
        hint = " (a model built on the meta device must be built there whole)" if meta else ""
        raise ValueError(
            f"all parameters and buffers must be on one device before wrapping{hint}; found {sorted(map(str, devices))}"
        )
    return meta, mixed_precision


def _check_shard_size_argument(shard_size: Any, mesh: DeviceMesh | None) -> None:
    """``shard_size``: ``None``, a positive integer or ``"node"`` (with torchrun's environment), and
    the 2-D mesh's shard dimension when both are given."""
    if shard_size is None:
        return
    if shard_size == "node":
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None or not local.isdigit() or int(local) < 1:
            raise ValueError(
                "shard_size='node' shards within the ranks of one node, which torchrun gives as LOCAL_WORLD_SIZE; "
                f"it is {'not set' if local is None else repr(local)} here: launch with torchrun, or pass the "
                "number of ranks per shard group"
            )
        shard_size = int(local)
    elif isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be a positive number of ranks, 'node' or None; got {shard_size!r}")
    if mesh is not None and mesh.ndim == 2 and mesh.shape[1] != shard_size:
        raise ValueError(
            f"shard_size={shard_size} but the 2-D mesh {tuple(mesh.shape)} shards over its last dimension, of "
            f"{mesh.shape[1]} ranks; drop shard_size (the mesh decides) or pass a mesh of shape "
            f"(replicas, {shard_size})"
        )


def _requested_shard_size(mesh: DeviceMesh, shard_size: int | str | None, world: int) -> int | None:
    """The shard group size the mesh or ``shard_size`` asks for (checked by ``_check_arguments``),
    ``None`` when neither does; it must divide the world."""
    if mesh.ndim == 2:
        return int(mesh.shape[1])
    if shard_size is None:
        return None
    size = int(os.environ["LOCAL_WORLD_SIZE"]) if shard_size == "node" else int(shard_size)
    if world % size:
        what = f"shard_size='node' (LOCAL_WORLD_SIZE={size})" if shard_size == "node" else f"shard_size={size}"
        raise ValueError(
            f"{what} does not divide the world size {world}: shard groups must tile the ranks; pass a divisor "
            f"of {world}, or a 2-D mesh"
        )
    return size


def _mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """A process group of every rank of ``mesh``: its own for a 1-D mesh; for a 2-D mesh the default
    group when the mesh spans it, else a group of the mesh's ranks (made by them alone)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    world = dist.group.WORLD
    if world is not None and ranks == list(range(dist.get_world_size())):
        return world
    return _new_group(ranks, _default_timeout())


def _default_timeout() -> Any:
    """The default group's timeout, for the groups made here (see [Note: inherited timeout])."""
    world = dist.group.WORLD
    return group_timeout(world) if world is not None else None


def _hybrid_mesh(rows: list[list[int]], device_type: str) -> DeviceMesh:
    """A 2-D mesh (replicas, shard group) of ``rows``, on process groups of its own: the parameters
    keep it after ``close()`` releases AutoDist's groups."""
    me = dist.get_rank()
    row = next(r for r in rows if me in r)
    column = [r[row.index(me)] for r in rows]
    groups = [_new_group(column, _default_timeout()), _new_group(row, _default_timeout())]
    return DeviceMesh.from_group(groups, device_type, mesh=torch.tensor(rows), mesh_dim_names=("replicate", "shard"))


def _ddp_device(value: Any, what: str) -> torch.device:
    if isinstance(value, bool) or not isinstance(value, (int, str, torch.device)):
        raise TypeError(f"{what} must be a device index, name or torch.device (as under DDP), got {value!r}")
    if isinstance(value, int):
        acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        return torch.device(acc.type if acc is not None else "cuda", value)
    return torch.device(value)


def _ddp_keywords(
    *, device_ids: Any, output_device: Any, process_group: Any, mesh: Any, bucket_cap_mb: Any, plan: Any,
    find_unused_parameters: Any, gradient_as_bucket_view: Any, static_graph: Any,
) -> tuple[Any, int | None]:
    """DDP's constructor keywords, checked: ``(mesh, bucket cap in bytes)``.

    [Note: DDP's keywords] ``DDP(model, device_ids=[local_rank], find_unused_parameters=True)`` is
    the line a drop-in replacement meets first; with AutoDist in place of DDP it raised Python's
    "unexpected keyword argument". DDP's keywords are taken with DDP's meaning where AutoDist has
    it: ``device_ids`` and ``output_device`` name the device this rank computes on, which AutoDist
    chooses as torchrun's ``LOCAL_RANK`` (they must agree; a CPU module takes none, as under DDP);
    ``process_group`` is the group to run on (a ``mesh`` of it); ``bucket_cap_mb`` caps
    ``plan="ddp"``'s buckets (any other plan buckets as it says). ``find_unused_parameters``,
    ``gradient_as_bucket_view`` and ``static_graph`` change nothing: parameters without a gradient
    are found by each bucket's used flags in every step, gradients are views of the buckets, and the
    graph may change between steps."""
    from .runtime.comm import default_device

    for name, flag in (("find_unused_parameters", find_unused_parameters),
                       ("gradient_as_bucket_view", gradient_as_bucket_view), ("static_graph", static_graph)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False (DDP's flag; AutoDist needs neither), got {flag!r}")
    device = default_device()
    if device_ids is not None:
        ids = list(device_ids) if isinstance(device_ids, (list, tuple)) else None
        if ids is None or len(ids) != 1:
            raise ValueError(f"device_ids must list the one device this rank computes on, as under DDP: got {device_ids!r}")
        given = _ddp_device(ids[0], "device_ids[0]")
        if device.type == "cpu" or given != device:
            where = "a CPU module takes none, as under DDP" if device.type == "cpu" else (
                f"AutoDist computes on {device} here (torchrun's LOCAL_RANK={os.environ.get('LOCAL_RANK', '0')})")
            raise ValueError(f"device_ids={device_ids!r} does not name this rank's device: {where}; drop device_ids")
    if output_device is not None and _ddp_device(output_device, "output_device") != device:
        raise ValueError(
            f"output_device={output_device!r}: outputs stay on the device this rank computes on ({device}); drop output_device"
        )
    if process_group is not None:
        if mesh is not None:
            raise ValueError("pass either mesh or process_group (DDP's), not both")
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup, got {type(process_group).__name__}")
        mesh = DeviceMesh.from_group(process_group, device.type)
    cap = None
    if bucket_cap_mb is not None:
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB (DDP's bucket cap), got {bucket_cap_mb!r}")
        if not (isinstance(plan, str) and plan == "ddp"):
            raise ValueError(
                f"bucket_cap_mb caps the buckets of plan='ddp' (DDP's bucketing); plan={plan!r} sets its own buckets"
                + (" (searched with the rest of the plan)" if plan == "auto" else "") + ": drop bucket_cap_mb or pass plan='ddp'"
            )
        cap = max(1, int(bucket_cap_mb * 1024 * 1024))
    return mesh, cap


def _positional_message(misplaced: tuple[Any, ...]) -> str:
    """The error for arguments after the module given by position: every other argument is
    keyword-only, as FSDP2's ``fully_shard(module, *, mesh=...)``'s are (a DDP habit, ``DDP(model,
    [rank])``, would otherwise pass device ids as the plan)."""
    first = misplaced[0]
    hint = f"AutoDist(model, plan={first!r})" if isinstance(first, (str, os.PathLike, Plan)) else "AutoDist(model, plan='auto')"
    return (
        f"AutoDist takes the module as its only positional argument, got {len(misplaced)} more ({first!r}"
        f"{', ...' if len(misplaced) > 1 else ''}); pass the others by keyword, e.g. {hint}"
    )


def _in_multi_rank_job() -> bool:
    """Whether this process is one rank of several (a process group of more than one, or torchrun's
    environment for one): then an argument error is agreed between the ranks before it is raised."""
    if dist.is_initialized():
        return dist.get_world_size() > 1
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _agree_on_arguments(refused: BaseException | None, group: dist.ProcessGroup | None) -> None:
    """Raise ``refused`` (this rank's argument error) on this rank, and an error naming the first rank
    that refused its arguments on every other: every rank raises, none waits in a collective, and
    the error is reported once (``_reported_once``)."""
    if dist.get_world_size(group) == 1:
        if refused is not None:
            raise refused
        return
    statuses: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(statuses, _status(refused), group=group)
    _raise_agreed(statuses, refused, lambda r, m: ValueError(
        f"rank {r} refused its AutoDist arguments ({m}); every rank must wrap with valid arguments"
    ))


def _status(error: BaseException | None) -> str | None:
    """What a rank tells the others of its outcome: nothing, or its error in one line."""
    return None if error is None else f"{type(error).__name__}: {error}"


def _raise_agreed(statuses: list[str | None], own: BaseException | None, elsewhere: Callable[[int, str], BaseException]) -> None:
    """After every rank shared its ``_status``: raise this rank's own error, or, where another rank
    failed, ``elsewhere(rank, status)`` of the first that did — on every rank, so all stop alike."""
    if own is not None:
        raise mark_raised_on_every_rank(own)
    failed = [(r, m) for r, m in enumerate(statuses) if m is not None]
    if failed:
        raise mark_raised_on_every_rank(elsewhere(*failed[0]))


def _check_module_argument(module: Any) -> None:
    """Refuse a module that is already distributed, before anything is modified. The checks look
    only at the module, so every rank raises the same error."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"AutoDist wraps an nn.Module, got {type(module).__name__}")
    if isinstance(module, AutoDist):
        raise TypeError("this module is already wrapped by AutoDist; wrap the inner module once")
    from torch.distributed import fsdp
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    fsdp_types = tuple(t for t in (getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None)) if t)
    for name, m in module.named_modules():
        what = "the module" if not name else f"submodule {name!r}"
        if isinstance(m, AutoDist):
            raise TypeError(f"{what} is an AutoDist; wrap the whole model once, without AutoDist inside it")
        if m.__dict__.get(_MANAGED):
            raise TypeError(
                f"{what} is already managed by another AutoDist instance (wrapping it twice would run every "
                "collective twice); keep using the first AutoDist, or call its close() before wrapping again"
            )
        if isinstance(m, DistributedDataParallel):
            raise TypeError(
                f"{what} is wrapped by torch's DistributedDataParallel; AutoDist replaces DDP: pass the module "
                "DDP wraps (ddp_model.module) instead"
            )
        if fsdp_types and isinstance(m, fsdp_types):
            raise TypeError(
                f"{what} is sharded by torch's FSDP (fully_shard or FullyShardedDataParallel); AutoDist replaces "
                "FSDP: build the model without it and wrap the plain module"
            )
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        if is_lazy(t):
            raise ValueError(
                f"{'parameter' if isinstance(t, nn.Parameter) else 'buffer'} {name!r} is not initialised yet (a lazy "
                "module such as nn.LazyLinear infers its shapes at its first forward): run one forward with a batch of "
                "your data before wrapping, as DDP requires"
            )
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            raise TypeError(
                f"parameter {name!r} is already a DTensor ({p.placements}): the model is already distributed "
                "(fully_shard, tensor parallelism or another AutoDist); AutoDist wraps a model of plain tensors"
            )


def _check_compile_argument(compile: Any, plan: Any, *, meta: bool, example_inputs: Any, example_kwargs: Any) -> str | None:
    """``compile``: ``False``, ``True`` or a backend of ``COMPILE_BACKENDS``, with ``plan="auto"``
    and example inputs (the planner times every block compiled and eager before the first step).
    Returns the backend ``plan="auto"`` may compile with (``None``: never compiles)."""
    if compile is False:
        return None
    if compile is not True and (not isinstance(compile, str) or compile not in COMPILE_BACKENDS):
        raise ValueError(
            f"compile must be False (never compile), True (let plan='auto' compile blocks with inductor) or a "
            f"torch.compile backend, one of {', '.join(repr(b) for b in COMPILE_BACKENDS)}; got {compile!r}"
        )
    if not (isinstance(plan, str) and plan == "auto"):
        raise ValueError(
            "compile lets plan='auto' decide which blocks to compile; a built-in plan, a Plan or a plan file compiles "
            "the blocks its `compile` field lists (with `compile_backend`): drop compile, or pass plan='auto'"
        )
    if meta:
        raise ValueError(
            "compile: plan='auto' times each block compiled and eager on the materialised model, and this model is "
            "on the meta device (it is profiled wrapped, sharded); drop compile, or build the model on the CPU"
        )
    if example_inputs is None and example_kwargs is None:
        raise ValueError(
            "compile: plan='auto' times each block compiled and eager before the first step, which needs an example "
            "forward: pass example_inputs (and/or example_kwargs), or drop compile"
        )
    return "inductor" if compile is True else compile


def _check_plan_argument(plan: Any) -> None:
    """The type of ``plan``; whether a path exists is agreed between the ranks (``_load_plan_file``)."""
    if isinstance(plan, (Plan, str, os.PathLike)):
        return
    raise TypeError(
        f"plan must be one of {', '.join(repr(c) for c in PLAN_CHOICES)}, a Plan, or a path; got {type(plan).__name__}"
    )


_MISSING = "missing"


def _read_plan_file(path: str) -> tuple[str | None, str | None]:
    """(text, None); (None, ``_MISSING``) when the path does not exist on this rank; (None, why) when
    it cannot be read. Never raises: the ranks exchange the outcome first."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), None
    except FileNotFoundError:
        return None, _MISSING
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{type(e).__name__}: {e}"


def _not_a_plan_message(path: str) -> str:
    text = (
        f"plan={path!r} is neither one of {', '.join(repr(c) for c in PLAN_CHOICES)} nor an existing plan "
        "file; pass one of those names, a Plan, or the path of a plan JSON file"
    )
    if path.lower().endswith(".json") or os.sep in path:  # meant as a file: say how to make one
        text += (
            f". To make {path}: `autodist.save_plan(model.plan, {path!r})` saves the plan a wrapped model runs "
            f"(after plan='auto' has chosen it), and `autodist plan --model MODULE:FACTORY --input-shape D0,D1 "
            f"--world-size N --out {path}` searches one offline (`autodist plan --help`)"
        )
    return text
