"""The runtime's optimizer hooks: before a step over this model's parameters, wait for gathers that
read the shards and bring offloaded state back; after it, mark persistent groups for a refresh
at the next forward and compute-dtype copies stale, and start offload copy-outs. The hooks are process-wide for the engine's
life (installed by :meth:`~autodist.runtime.engine.Engine._install_hooks`, removed by its
``close``); :func:`watch` tells this model's optimizers from others. An optimizer over offloaded
state is bound to the offload manager and its state dicts kept complete (:func:`adopt_optimizer`).
Each function takes the :class:`~autodist.runtime.engine.Engine` whose parameters the optimizer
updates.

[Note: process-wide optimizer hooks] Nothing tells a library that a user built a new optimizer:
torch has no hook on an optimizer's construction, and a step that writes ``p.data`` (Lion, many
research optimizers) moves no version counter a later forward could see. So the step hooks stay
process-wide as long as the model is wrapped. They were once dropped as soon as the optimizers
seen covered every parameter (hooks bound to those optimizers instead): a second optimizer built
later over the same parameters then stepped unseen, and a persistent group kept computing with the
weights of before its steps (0.007 from the reference after two steps, ``test_hardening``'s
``new-optimizer``). What the process-wide hooks cost is a dictionary lookup per step of this
model's optimizers, the same as a bound hook's, and for another model's optimizer the tuple of its
parameters' ids, built and compared in C (:func:`watch`); a model dropped without ``close()``
takes them with it ([Note: a model dropped without close()] in autodist/wrapper.py)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import AutoDistError, mark_raised_on_every_rank, reported_once
from .gather import GatherGroupRuntime
from .params import ManagedParam, release_casts

if TYPE_CHECKING:
    from .engine import Engine


def watch(engine: Engine, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` updates this model's parameters, worked out the first time it steps.
    One over none of them is looked at again when its parameters change (``add_param_group`` of
    this model's after it stepped)."""
    ours = engine._optimizers.get(optimizer)
    if ours:
        return True
    if ours is not None and engine._foreign.get(optimizer) == params_key(optimizer):
        return False  # over none of this model's parameters, and its parameters are as they were
    held = [p for grp in optimizer.param_groups for p in grp["params"]]
    stale = [p for p in held if (r := engine._replaced.get(id(p))) is not None and r() is p]
    if stale:
        raise RuntimeError(
            f"this optimizer ({type(optimizer).__name__}) holds {len(stale)} parameter tensor(s) that AutoDist "
            "replaced when it wrapped the model, so its step would update tensors the model no longer uses and "
            "training would silently stop. Build the optimizer after wrapping: "
            "`model = AutoDist(model, ...)` first, then `optimizer = Optimizer(model.parameters(), ...)`."
        )
    ours = any(id(p) in engine._visible_map for p in held)
    engine._optimizers[optimizer] = ours
    if not ours:  # looked at again once its parameters change (``add_param_group`` of this model's)
        engine._foreign[optimizer] = params_key(optimizer)
    return ours


def params_of(engine: Engine, optimizer: torch.optim.Optimizer) -> list[ManagedParam]:
    return [mp for grp in optimizer.param_groups for p in grp["params"] if (mp := engine._visible_map.get(id(p))) is not None]


@dataclass(frozen=True)
class StepView:
    """What an optimizer's step touches of one engine, worked out once per optimizer and plan: its
    managed parameters, those with a compute-dtype copy (released before the step, cast again at
    the next forward), the gather groups holding any of them (quiesced before the step) and, of those, the
    persistent ones (refreshed after it), in plan order.

    [Note: optimizer hooks per step] Both step hooks run on the thread that issues the step's
    kernels; walking every parameter of every group twice per step (to find the managed ones, the
    groups they touch, the copies to drop) cost gpt-deep's 580 parameters about 0.5 ms a step on
    the CPU, a third of what its gradient hooks cost, for plans that have no group and no copy. The
    view is kept per optimizer and rebuilt when the engine is configured for another plan or the
    optimizer's parameters change (``add_param_group``, a list replaced or edited in place: the key
    holds every parameter's id, compared in C, not walked in Python)."""

    key: tuple
    params: tuple[ManagedParam, ...]
    casts: tuple[ManagedParam, ...]
    groups: tuple[GatherGroupRuntime, ...]
    persistent: tuple[GatherGroupRuntime, ...]


def params_key(optimizer: torch.optim.Optimizer) -> tuple:
    """Every parameter's id, by parameter group: changes when the optimizer's parameters do."""
    return tuple(tuple(map(id, g["params"])) for g in optimizer.param_groups)


@dataclass(frozen=True)
class DTensorLimit:
    """What an optimizer cannot step under a plan with DTensor parameters ([Note: optimizers
    DTensor cannot step]): ``scope`` ``"dtensor"``, any DTensor parameter (a plan may shard
    nothing it steps: one sharded unit makes every parameter a DTensor); ``"shard"``, a sharded
    parameter. ``why`` and ``fix`` complete the error."""

    scope: str
    why: str
    fix: str

    def refuses(self, mp: ManagedParam) -> bool:
        return mp.is_dtensor if self.scope == "dtensor" else mp.placement == "shard"


FUSED_ON_DTENSOR = ("Adam", "AdamW")  # the fused kernels DTensor implements (torch 2.11-2.14)
REPLICATE_FIX = "replicate the units it steps (plan='ddp', or a plan whose units holding them are replicated)"


def dtensor_limit(optimizer: torch.optim.Optimizer) -> DTensorLimit | None:
    """What ``optimizer`` cannot step under a plan with DTensors, if anything (torch's optimizers;
    any other is assumed to step DTensors, as FSDP2 assumes).

    [Note: optimizers DTensor cannot step] Under a plan that shards, the parameters an optimizer
    steps are DTensors, as under FSDP2, and every update the optimizer makes runs through DTensor's
    sharding rules. Most of torch's optimizers are elementwise and step shards exactly (Adam and
    AdamW fused or not, SGD, RMSprop, Adagrad, Adamax, NAdam, RAdam, Adadelta, ASGD: 2 CPU ranks,
    gpt, fsdp and zero2 equal to ddp after 5 steps). Some are not. Fused SGD and Adagrad
    (``aten._fused_sgd_`` has no DTensor rule, for a replicated DTensor too),
    ZeroRedundancyOptimizer (``c10d.broadcast_`` has none), Rprop (``index_put_`` in place on a
    shard), LBFGS (it flattens every parameter into one vector: refused for a shard of uneven
    rows) failed at the first step in DTensor's words, after the state of the parameters before
    the failing one had moved. Adafactor failed on a sharded matrix (its column statistics reduce
    across the sharded dimension, then are updated in place) and, worse, stepped a sharded vector
    wrongly: its step is relative to the parameter's RMS (``norm().item()``), and on a shard it
    was 1.7e-2 off a plain tensor's after 3 steps, silently (FSDP2 the same). Here the step's
    pre-hook refuses such an optimizer before it changes anything, on every rank, naming the
    parameters and the fix; and ``plan="auto"``, once the first steps have shown it the optimizer,
    keeps the units it cannot step sharded replicated in the plans it searches
    (``OptimizerProfile.dtensor_refused``/``shard_refused``). ``test_optimizers.py`` checks each
    limit against the torch installed (the DTensor step fails or differs from a plain tensor's),
    so a torch that lifts one fails there."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    name = type(optimizer).__name__
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return DTensorLimit(
            "dtensor", "it broadcasts each parameter from the rank that stepped it, and torch has no DTensor "
            "rule for c10d.broadcast_",
            "a plan that shards already shards optimizer state (plan='zero2' is ZeRO-2): step the inner optimizer "
            "directly; or keep ZeroRedundancyOptimizer with plan='ddp'",
        )
    fused = any(g.get("fused") for g in optimizer.param_groups)
    if fused and not any(c.__name__ in FUSED_ON_DTENSOR for c in type(optimizer).__mro__):
        return DTensorLimit(
            "dtensor", f"its fused kernel (fused=True) has no DTensor rule in torch {torch.__version__}",
            f"build it with fused=False: {name}'s default (foreach) implementation makes the same update",
        )
    if isinstance(optimizer, torch.optim.Rprop):
        return DTensorLimit(
            "shard", "it updates through boolean masks in place (index_put_), which DTensor refuses on a shard",
            REPLICATE_FIX,
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        return DTensorLimit(
            "shard", "it steps every parameter as one flat vector, and DTensor cannot flatten a shard of "
            "uneven rows", REPLICATE_FIX,
        )
    adafactor = getattr(torch.optim, "Adafactor", None)
    if adafactor is not None and isinstance(optimizer, adafactor):
        return DTensorLimit(
            "shard", "its step is relative to each parameter's RMS, which on a shard comes out wrong (a sharded "
            "vector steps silently off a plain one's), and DTensor refuses the in-place update of a matrix's "
            "column statistics", REPLICATE_FIX,
        )
    return None


def refuse_unsteppable(engine: Engine, optimizer: torch.optim.Optimizer, mps: list[ManagedParam]) -> None:
    """Raise, on every rank and before the step changes anything, if ``optimizer`` cannot step the
    DTensors of ``mps`` under the plan in force ([Note: optimizers DTensor cannot step])."""
    limit = dtensor_limit(optimizer)
    refused = [mp.name for mp in mps if limit is not None and limit.refuses(mp)]
    if limit is None or not refused:
        return
    what = "holds as DTensors" if limit.scope == "dtensor" else "shards"
    shown = ", ".join(refused[:4]) + (f" and {len(refused) - 4} more" if len(refused) > 4 else "")
    source, auto = engine.plan.label, ""
    if source.startswith("auto:safe start (sharded)"):
        auto = ("; plan='auto' starts sharded when replicating does not fit half the budget (or the model is on the "
                "meta device): raise memory_limit, or use an optimizer that steps shards")
    elif source.startswith("auto"):
        auto = ("; plan='auto' chose this plan before it saw the optimizer (from example_inputs, or stored by a launch "
                "with another optimizer): wrap without example_inputs, with a fresh cache_dir, and the plans it "
                "searches after the first steps keep these replicated")
    err = AutoDistError(
        f"{type(optimizer).__name__} cannot step the parameters plan {source} {what} ({shown}): "
        f"{limit.why}. Nothing was stepped. Fix: {limit.fix}{auto}"
    )
    if engine.comm.world_size > 1:  # every rank holds the same plan and builds the same optimizer
        mark_raised_on_every_rank(err)
        raise reported_once(err, rank=engine.comm.rank)
    raise err


@dataclass
class LoadedState:
    """What a look at an optimizer's loaded state found ([Note: optimizer state loaded from a
    file]): ``problems`` (one line each), and ``adopted`` (state key, the value in place now, the
    value it becomes) to apply when there are none, and ``sharded`` (the figures of sharded DTensor
    values as loaded, read as they load: a plan that offloads the state frees their device storage
    before the next step) for the check across ranks."""

    problems: list[str]
    adopted: list[tuple[dict, str, torch.Tensor]]
    sharded: list[tuple]


def look_at_loaded_state(engine: Engine, optimizer: torch.optim.Optimizer) -> LoadedState:
    """[Note: optimizer state loaded from a file] DDP code checkpoints its optimizer with
    ``torch.save(optimizer.state_dict())`` on rank 0 and resumes with
    ``optimizer.load_state_dict(torch.load(path))`` on every rank (nanoGPT's loop does). Saved under
    a replicated plan, that state is full tensors; and ``plan="auto"`` first trains on a
    replicated plan and takes a sharded one at the next launch, where the same file then met
    DTensor parameters and the first step failed in DTensor's words ("got mixed torch.Tensor and
    DTensor"). Saved under a plan that shards, the file holds rank 0's shards, which loaded on
    every rank trained every rank with rank 0's moments, silently, or, with shards of uneven rows,
    failed on some ranks only, which left the others waiting in the next collective.

    So the first step of an optimizer over this model's parameters, and the first step after each
    ``load_state_dict`` (a hook on the optimizer, whose conversions run as it loads), looks at the
    state of every parameter: a plain tensor of a DTensor parameter's whole shape becomes this
    rank's part of it (a DTensor as the parameter's, the rank's rows copied out), and a DTensor of
    a plain parameter, if it is whole (replicated), its local tensor. What cannot be taken is
    refused before the step changes anything, on every rank, naming it: a DTensor of the
    parameter's shape in another layout (saved under another plan), a sharded DTensor of a plain
    parameter. State of another shape than the parameter's is the optimizer's own business
    (Adafactor's factored statistics, a per-parameter scale) and is left alone. Sharded DTensors on a mesh of their own (unpickled; the
    state a step makes, and what DCP's ``set_optimizer_state_dict`` loads, is on the parameter's
    mesh) are then checked across ranks for being another rank's parts ([Note: one rank's shards
    loaded on every rank] in ``autodist/runtime/state.py``): a collective, met first in the job's
    store so that a load on some ranks only is reported rather than left to hang. A step counter or other scalar is left
    as it is. Saving under a plan that shards takes the DCP helpers (``get_optimizer_state_dict``
    with ``full_state_dict=True`` on every rank), as under FSDP2."""
    from torch.distributed.tensor import DTensor, Shard

    from .state import shard_figures

    problems: list[str] = []
    adopted: list[tuple[dict, str, torch.Tensor]] = []
    sharded: dict[str, DTensor] = {}
    for mp in params_of(engine, optimizer):
        p = mp.visible
        st = optimizer.state.get(p)
        if not st:
            continue
        for name, value in st.items():
            if not isinstance(value, torch.Tensor) or (value.dim() == 0 and not isinstance(value, DTensor)):
                continue
            what = f"{mp.name}'s {name!r}"
            if isinstance(p, DTensor):
                if isinstance(value, DTensor):
                    if value.shape == p.shape and tuple(value.placements) != tuple(p.placements):
                        problems.append(f"{what} is a DTensor placed {value.placements}, the parameter is placed "
                                        f"{p.placements}")
                    elif value.device_mesh is not p.device_mesh and any(isinstance(pl, Shard) for pl in value.placements):
                        sharded[f"{mp.name}:{name}"] = value  # unpickled (state the step made is on p's mesh)
                elif value.shape == p.shape:
                    part = p._part_of(value).clone() if hasattr(p, "_part_of") else value
                    adopted.append((st, name, DTensor.from_local(
                        part, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())))
                # a tensor of another shape is the optimizer's own (factored statistics, a scale): left alone
            elif isinstance(value, DTensor):
                if any(isinstance(pl, Shard) for pl in value.placements):
                    problems.append(f"{what} is a sharded DTensor (one rank's part, saved under a plan that shards), "
                                    "the parameter is a whole tensor under this plan")
                else:
                    adopted.append((st, name, value.to_local()))
    return LoadedState(problems, adopted, shard_figures(sharded) if sharded else [])


LOADED_STATE_FIX = (
    "Save the optimizer's state as full tensors with torch.distributed.checkpoint.state_dict's "
    "`get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))` on every rank (rank "
    "0 writes the file) and load it with `optimizer.load_state_dict(...)` or `set_optimizer_state_dict(...)`; or "
    "save and load sharded checkpoints with torch.distributed.checkpoint"
)


def adopt_loaded_state(engine: Engine, optimizer: torch.optim.Optimizer, found: LoadedState) -> None:
    """Apply ``found``'s conversions (none if it found a problem) and keep what is left to check at
    the next step (:func:`settle_loaded_state`)."""
    if not found.problems:
        for st, name, value in found.adopted:
            st[name] = value
    engine._loaded_states[optimizer] = found


def settle_loaded_state(engine: Engine, optimizer: torch.optim.Optimizer) -> None:
    """Raise on every rank, before the step, if the state loaded into ``optimizer`` cannot be this
    rank's ([Note: optimizer state loaded from a file])."""
    from .state import foreign_among

    found = engine._loaded_states.pop(optimizer, None)
    if found is None:
        return
    problem = "; ".join(found.problems[:3]) + (f" and {len(found.problems) - 3} more" if len(found.problems) > 3 else "")
    if not problem and found.sharded:
        engine.comm.rendezvous("optimizer.load_state_dict()", "Load the optimizer's state on every rank.")
        problem = foreign_among(found.sharded, engine.comm.all_gather_object) or ""
    if not problem:
        return
    err = AutoDistError(
        f"the state {type(optimizer).__name__} holds (loaded, or there before its first step) does not fit the "
        f"parameters plan {engine.plan.label} holds: "
        f"{problem}. Nothing was stepped. {LOADED_STATE_FIX} ([Note: optimizer state loaded from a file] in "
        "autodist/runtime/optimizers.py)"
    )
    if engine.comm.world_size > 1:  # every rank loaded the same file and holds the same plan
        mark_raised_on_every_rank(err)
        raise reported_once(err, rank=engine.comm.rank)
    raise err


def watch_loads(engine: Engine, optimizer: torch.optim.Optimizer) -> None:
    """Look at the state each ``optimizer.load_state_dict`` loads, as it loads it."""
    if optimizer in engine._load_hooks:
        return
    ref = weakref.ref(engine)

    def load_post(opt: torch.optim.Optimizer) -> None:
        eng = ref()
        if eng is not None:
            adopt_loaded_state(eng, opt, look_at_loaded_state(eng, opt))
            eng._step_views.pop(opt, None)  # the next step looks again (step_view)

    engine._load_hooks[optimizer] = optimizer.register_load_state_dict_post_hook(load_post)


def step_view(engine: Engine, optimizer: torch.optim.Optimizer) -> StepView:
    key = (engine.configured, params_key(optimizer))
    view = engine._step_views.get(optimizer)
    if view is not None and view.key == key:
        return view
    if view is None:  # its first step, or the first after a load (the load's hook drops the view)
        if optimizer not in engine._load_hooks:
            watch_loads(engine, optimizer)
            adopt_loaded_state(engine, optimizer, look_at_loaded_state(engine, optimizer))
        settle_loaded_state(engine, optimizer)
    mps = params_of(engine, optimizer)
    refuse_unsteppable(engine, optimizer, mps)
    touched = {id(mp) for mp in mps}
    groups = tuple(g for g in engine.groups if any(id(mp) in touched for mp in g.params))
    view = StepView(
        key, tuple(mps), tuple(mp for mp in mps if mp.has_cast_copy), groups,
        tuple(g for g in groups if g.residency == "persistent"),
    )
    engine._step_views[optimizer] = view
    return view


def before_optimizer_step(engine: Engine, optimizer: torch.optim.Optimizer) -> None:
    if not watch(engine, optimizer):
        return
    if engine.grad_forwards and not engine.stats.micro_batches:
        # [Note: a step no backward reached] Forwards with gradients since the last step, and no
        # backward reached the model: `loss.backward(inputs=list(model.parameters()))` (GAN code
        # keeping the other model's gradients out) names the visible parameters, which under a plan
        # that shards are not the tensors the forward computed with (as under FSDP2): autograd
        # computes nothing for them, silently, and the step changes nothing (mlp under fsdp: 0.041
        # off the reference after 3 steps). Said once; a loop that steps without a backward on
        # purpose can ignore it.
        engine.once.warning(
            "no-backward",
            "autodist: optimizer.step() over this model's parameters, but no backward reached the model since the last "
            "step (%d forward(s) with gradients): its parameters got no gradient. Under a plan that shards, "
            "loss.backward(inputs=list(model.parameters())) names tensors the forward did not compute with (as under "
            "FSDP2) and computes nothing for them: drop inputs=, and keep another model's gradients out with "
            "requires_grad_(False)",
            engine.grad_forwards,
        )
    view = engine._in_step[optimizer] = step_view(engine, optimizer)  # the post hook's too
    for g in view.groups:  # the step writes the shards: gathers still reading them finish first
        g.quiesce()
    if engine.offload.active:
        engine.offload.finish_back()  # the sync point: every offloaded fragment is back
    release_casts(view.casts)


def on_optimizer_step(engine: Engine, optimizer: torch.optim.Optimizer) -> None:
    view = engine._in_step.pop(optimizer, None)  # the pre hook's (the step changes no parameter list)
    if view is None:
        return
    # In the sequence the end-of-backward check compares: a rank that skipped this step (a
    # GradScaler that found inf/NaN in its own gradient shards) is reported, not left to diverge.
    engine.comm.sequence.record("optimizer_step", str(len(view.params)))
    engine.grad_forwards = 0
    if engine.stats.micro_batches:
        engine.stats.grad_accum_steps, engine.stats.micro_batches = engine.stats.micro_batches, 0
    # [Note: when persistent groups are refreshed] A persistent group keeps its full parameters
    # between steps; after an optimizer step over its shards it is gathered again, whatever the
    # version counters say (an optimizer, or the user, may write p.data, which moves none). The
    # gather is issued at the next forward (Engine._refresh_persistent), not here: code between the
    # step and the next forward writes parameters too (WGAN's `p.data.clamp_`, max-norm
    # constraints, weights averaged in), and a gather issued here read the shards before it —
    # through `.data`, with nothing to show the full parameters stale (a persistent plan trained
    # 0.28 off after 4 steps of clamped weights), and on a GPU, racing the compute stream's write
    # even under no_grad. Issued at the forward's start, before the previous step's reduce-scatter
    # outputs are released, it overlaps the forward's first units as it overlapped the gap before,
    # and the simulator's preamble is unchanged: the refresh in flight at the step's start beside
    # those outputs ([Note: refresh buffers] in autodist/cost/sim/gathers.py; the gap between an
    # optimizer step and the next forward is not simulated). In plan order, which every rank shares: not in the
    # order units ran here — a persistent unit one rank skipped would move to the end of that
    # rank's observed order, and its refresh with it (gloo pairs gathers of different units, or
    # aborts when their sizes differ).
    for g in view.persistent:
        g.refresh_due = True
    if engine.offload.active:
        if optimizer not in engine.offload.bound:
            adopt_optimizer(engine, optimizer)
        engine.offload.copy_out(engine.offload.out_at.get("step", []))
    for listener in engine.step_listeners:
        listener(optimizer)


def adopt_optimizer(engine: Engine, optimizer: torch.optim.Optimizer) -> None:
    """Bind offload to the optimizer's state and keep its state dicts complete."""
    engine.offload.bind(optimizer)
    if getattr(optimizer, "_autodist_offload_hooks", None) is None:
        ref = weakref.ref(engine)

        def sd_post(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
            eng = ref()
            return state_dict if eng is None else complete_state_dict(eng, opt, state_dict)

        def load_pre(opt: torch.optim.Optimizer, state_dict: dict) -> None:
            eng = ref()
            if eng is not None:
                eng.offload.materialize_all()

        def load_post(opt: torch.optim.Optimizer) -> None:
            eng = ref()
            if eng is not None and eng.offload.active:
                eng.offload.unbind(opt)
                eng.offload.bind(opt)
                eng.offload.copy_out([k for keys in eng.offload.out_at.values() for k in keys])
                eng.offload.finish_out()

        setattr(optimizer, "_autodist_offload_hooks", [  # noqa: B010 (an attribute of the user's object)
            optimizer.register_state_dict_post_hook(sd_post),
            optimizer.register_load_state_dict_pre_hook(load_pre),
            optimizer.register_load_state_dict_post_hook(load_post),
        ])


def complete_state_dict(engine: Engine, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Offloaded state tensors appear in ``optimizer.state_dict()`` with their full values."""
    if not engine.offload.entries:
        return state_dict
    index = {}
    i = 0
    for grp in optimizer.param_groups:
        for p in grp["params"]:
            index[i] = p
            i += 1
    by_visible = {id(mp.visible): mp for mp in engine.params.values()}
    from torch.distributed.tensor import DTensor

    states = state_dict.get("state", {})
    for idx, st in list(states.items()):
        p = index.get(idx)
        mp = by_visible.get(id(p)) if p is not None else None
        if mp is None:
            continue
        mine = False
        for name, value in list(st.items()):
            full = engine.offload.assembled((mp.name, name))
            if full is None:
                continue
            if not mine:
                # torch's state dict holds the optimizer's own per-parameter dicts, not copies:
                # written into, the optimizer would step a tensor the offload no longer moves and
                # a later read return stale values
                st = states[idx] = dict(st)
                mine = True
            local_shape = value.to_local().shape if isinstance(value, DTensor) else value.shape
            full = full.view(local_shape)
            if isinstance(value, DTensor):
                full = DTensor.from_local(
                    full, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
                )
            st[name] = full
    return state_dict


def weak_optimizer_hook(engine: Engine, phase: str) -> Callable[[torch.optim.Optimizer, tuple, dict], None]:
    ref = weakref.ref(engine)

    def hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        eng = ref()
        if eng is None:
            return
        if phase == "pre":
            before_optimizer_step(eng, optimizer)
        else:
            on_optimizer_step(eng, optimizer)

    return hook
