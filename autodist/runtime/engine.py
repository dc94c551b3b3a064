"""The runtime that enacts a plan: hooks on modules, parameters and optimizers.

One :class:`Engine` per wrapped model. It owns the managed parameters, the gather groups and the
reducer, and drives them from these hooks:

* module forward pre/post hooks on every module that uses a parameter which must be swapped
  (sharded, or cast to a compute dtype) — its own, a tied one, or one it reads functionally from a
  descendant (``nn.MultiheadAttention`` reads ``out_proj.weight``): gather (or wait for a prefetched
  gather), swap the full tensors in, issue the next prefetches, route the inputs through the
  post-backward signal; swap back and free per residency after the forward. A forward hook that
  fires *during* backward is a recomputation (activation checkpointing): it gathers what it needs,
  issues backward prefetches, and frees nothing (see [Note: recomputation] in backward.py);
* a multi-grad hook on those modules' outputs: the module's backward is about to run — regather
  what was freed, issue backward prefetches;
* the post-backward signal (backward.py): the module's backward is complete — free its groups;
* a post-accumulate-grad hook on every trainable parameter: its gradient is ready — feed the bucket;
* a final autograd callback at the end of backward: flush buckets, wait for every reduction, hand
  out gradients, release what the plan says to release, check the collective order across ranks,
  and learn the observed orders;
* optimizer step hooks: before a step over this model's parameters, wait for gathers that read the
  shards and bring offloaded state back; after it, mark persistent groups for a refresh at the next
  forward and compute-dtype copies stale, and start offload copy-outs (optimizers.py).

Prefetch follows [Note: prefetch triggers] in ``autodist/schedule.py``: positions count gathering
units only, forward in the previous step's observed order, backward in its reverse with recomputed
units needed at their anchors; units a rank's forward left out are gathered at their places all the
same ([Note: units a forward left out]). A unit whose group was not prefetched gathers on demand;
the deviation is counted and logged once.

[Note: one issue order for NCCL] Gathers and reductions run on two process groups (comm.py). With
gloo they are independent. NCCL, however, requires every rank to launch collectives on concurrently
used communicators in the same order or it may deadlock (certain with ``CUDA_DEVICE_MAX_CONNECTIONS=1``).
Gathers are issued at unit boundaries, identical on every rank when sharded units follow the same
control flow; a reduction launched the moment its last gradient arrives is not (a parameter unused
on one rank delays its bucket there). So when a plan both gathers and reduces on NCCL
(``launch_policy="sampled"``), buckets are launched only at *sharded-unit backward events*
(pre-backward, recomputation, post-backward) and at the end of backward, where every rank sees the
same state when the control flow is the same. The end-of-backward collective-order check
(comm.py) covers the rest: ranks whose interleaving differed are reported.

Under either policy a rank replays the backward events of the units its forwards left out at their
places (their triggers, then a poll of the buckets), so a bucket of theirs is launched where the
ranks that ran them launch it. With the reductions in flight bounded (``max_inflight_buckets``), a
rank launching one more waits for the oldest in the middle of its backward; under ``"ready"`` a rank
that left a unit out (an expert none of its tokens chose) used to launch that unit's bucket only at
the end of its backward, and the waiting rank stopped issuing the gathers the other needed to get
there (gloo hung, 2 ranks and 2 x 2 alike). A unit that gathers nothing has the place of the last
gathering unit before it: passing that place passes it too, and under ``"sampled"`` its bucket,
which the ranks that ran it launch at the next sharded unit's event, settles there as well (a plan
mixing placements failed the interleaving check on gloo with the policy set). Not covered: that
policy with a plan that mixes placements and recomputes blocks (the check still reports it).

[Note: settled parameters] Under ``"sampled"`` a bucket whose gradients have not all arrived is
launched at an event when each missing parameter is *settled*: every module that uses it has
finished the backward of each of its forwards this step (its post-backward signal fired), so no
gradient can come any more and the missing one is a zero. Reentrant activation checkpointing
(``checkpoint(..., use_reentrant=True)``, the default of many model codes and of older Hugging Face
versions) runs a block's first forward *without* gradients: it leaves no signal to wait for, and
the block's gradients come later, from the recomputation in backward. A module's no-grad forwards
inside a training forward are therefore counted, and it is settled only once as many forwards with
gradients (the recomputations) have run and finished. Without that count a block was settled
vacuously before its recomputation, an earlier event launched its bucket with zeros and flagged its
parameters unused, and they trained without gradients. This was seen first on CUDA (plan ``fsdp``
and ``zero2``, a world of one on NCCL); it was not autograd's per-device worker thread, as first
suspected, but the launch policy that only NCCL selects, and gloo reproduces it with the policy set
(tests/test_recompute.py). A no-grad forward that is not recomputed (a frozen branch run under
``torch.no_grad()``) keeps its parameters unsettled until the end of backward, where the flush
launches whatever is left: later, never wrong.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import weakref
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.optim.optimizer as optim_hooks
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from .._log import OnceLogger
from .._tree import output_leaves
from ..plan import Plan
from ..schedule import (
    ActionLog,
    TriggerCursor,
    backward_order,
    backward_positions,
    block_anchor,
    collapsed_groups,
    encloses,
    freed_after_forward,
    gathering_units,
    group_fire_positions,
    memory_windows,
    merged_order,
    positions,
    resident_state_bytes,
    triggers,
)
from ..structure import ModelStructure
from .backward import attach_post_backward, in_backward, outside_dispatch_modes
from .buckets import install_reducer, maybe_rebuild_buckets
from .comm import LATE_GRADIENT, Comm, profiled_range
from .compiled import BlockCompile, merge_block_sites
from .gather import GatherGroupRuntime, GroupState
from .offload import OffloadManager
from .optimizers import adopt_optimizer, weak_optimizer_hook
from .params import ManagedParam, allocate_shard_storage, moved_after_wrapping, refresh_casts, written_casts
from .precision import MixedPrecision, cast_floats
from .recompute import BlockRecompute
from .reducer import Reducer
from .step_state import ModuleSite, RuntimeStats, StepState
from .user_hooks import ParamHooks, carry_hooks

LAUNCH_POLICIES = ("ready", "sampled")
FORWARD_MODE_CHECKS = 8  # the first changes of train()/eval() mode that meet across ranks ([Note: a forward on some ranks only])
FORWARD_ON_EVERY_RANK = (
    "Run the model on every rank: evaluate each rank's part of the data and combine the metrics "
    "(torch.distributed.all_reduce), or take model.state_dict() on every rank and evaluate a plain copy "
    "built from it on one rank."
)


class Engine:
    recompute: BlockRecompute
    compiled: BlockCompile
    offload: OffloadManager

    def __init__(
        self,
        module: nn.Module,
        plan: Plan,
        structure: ModelStructure,
        *,
        comm: Comm,
        mesh: DeviceMesh | None,
        device: torch.device,
        mixed_precision: MixedPrecision | None,
        broadcast_buffers: bool,
        windows: dict[int, tuple[int, int]] | None = None,
        budget_bytes: int | None = None,
        launch_policy: str | None = None,
        check_collectives: bool = True,
        collapse: bool = True,
    ) -> None:
        """``launch_policy``: when buckets are launched — ``"ready"`` (as soon as their last
        gradient arrives) or ``"sampled"`` (only at sharded-unit backward events; see [Note: one
        issue order for NCCL]); default: ``"sampled"`` on NCCL, ``"ready"`` otherwise.
        ``check_collectives``: compare the collective sequence across ranks at the end of every
        backward of a plan that gathers (one small all-reduce). ``collapse``: enact a gather group
        whose units are exactly one module's at that module alone ([Note: hooks per gather group] in
        autodist/schedule.py); ``False`` hooks every unit, issuing the same actions (the overhead
        calibration compares both)."""
        if launch_policy is not None and launch_policy not in LAUNCH_POLICIES:
            raise ValueError(f"launch_policy must be one of {', '.join(LAUNCH_POLICIES)}; got {launch_policy!r}")
        self.module = module
        self.budget_bytes = budget_bytes
        self.plan = plan
        self.structure = structure
        self.comm = comm
        self.mesh = mesh
        self.device = device
        self.mp = mixed_precision
        self.broadcast_buffers = broadcast_buffers
        self.sync_enabled = True
        self._buffers_due = True  # broadcast buffers before the next forward (see [Note: when buffers are broadcast])
        self._last_training: bool | None = None  # the module's training flag at the last forward (_check_forward_mode)
        self._mode_checks = 0  # the changes of that flag met across ranks so far (at most FORWARD_MODE_CHECKS)
        self.grad_forwards = 0  # forwards with gradients since the last optimizer step over these parameters
        self.stats = RuntimeStats()
        self.once = OnceLogger()
        self._launch_policy_arg = launch_policy
        self.check_collectives = check_collectives
        self._collapse = collapse
        self._handles: list[RemovableHandle] = []
        self._module_handles: list[RemovableHandle] = []  # module forward hooks (re-installed once probed)
        self._call_handles: list[RemovableHandle] = []  # direct calls' hooks (_make_root_call_hooks)
        self._opt_global_handles: list[RemovableHandle] = []
        self._gen = 0
        self._step = StepState()
        self._pending: StepState | None = None  # a step set aside by a forward without gradients (_begin_aside)
        self._aside_held: set[int] = set()  # the groups that step held then: the aside leaves them as they are
        self._order_learned = False
        self._anchors: dict[str, str | None] = {}  # learned recomputation anchors (previous step)
        self._module_of_unit = {u.name: u.module_name for u in structure.units}  # [Note: nested units]
        self.observer = None  # plan="auto"'s step recorder while it profiles (autodist/planner/recorder.py)
        # the actions taken, in the schedule's vocabulary (autodist/schedule.py); None: not recorded
        self.actions: ActionLog | None = None
        # optimizers seen stepping: True = over this model's parameters (optimizers.watch)
        self._optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._foreign: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # not ours: optimizers.params_key
        # between an optimizer's pre and post step hooks: its optimizers.StepView
        self._in_step: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._step_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizers.step_view
        # optimizers whose loaded state is yet to be checked at their next step: optimizers.LoadedState
        self._loaded_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._load_hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizers.watch_loads
        self.configured = 0  # how many times _configure ran: a plan's groups and buckets are this one's
        self.step_listeners: list = []  # called with the optimizer after each step over these parameters

        if plan.world_size != comm.world_size or plan.shard_ranks != comm.shard_size:
            raise ValueError(
                f"the plan shards over {plan.shard_ranks} of {plan.world_size} ranks, but the process groups "
                f"shard over {comm.shard_size} of {comm.world_size}; split them with Comm.shard_within first"
            )
        # a sharded parameter is split over this rank's shard group ([Note: hybrid sharding] in comm.py)
        world, rank = comm.shard_size, comm.shard_rank
        placement = plan.placement_of_param
        self.use_dtensor = any(u.placement == "shard" for u in plan.units)
        compute_dtype = self.mp.param_dtype if self.mp else None

        # ---- managed parameters -------------------------------------------------------------
        self.params: dict[str, ManagedParam] = {}
        original = dict(module.named_parameters(remove_duplicate=True))
        shard_storage = allocate_shard_storage(plan, structure, world, device)
        for name, info in structure.params.items():
            mp = ManagedParam(
                info,
                original[name],
                placement=placement[name],
                mesh=mesh,
                rank=rank,
                world_size=world,
                use_dtensor=self.use_dtensor,
                compute_dtype=compute_dtype if original[name].is_floating_point() and not info.keeps_dtype else None,
                device=device,
                shard_storage=shard_storage.get(name),
            )
            mp.sites = [(module.get_submodule(m), attr) for m, attr in info.sites]
            mp.register_visible()
            carry_hooks(original[name], mp.visible)
            self.params[name] = mp
        # the parameter objects the user held before wrapping that are no longer the model's
        self._replaced = {
            id(p): weakref.ref(p) for name, p in original.items() if self.params[name].visible is not p
        }
        self._visible_map = {id(mp.visible): mp for mp in self.params.values()}
        self.param_hooks = ParamHooks(list(self.params.values()))  # [Note: hooks on the visible parameters]
        # the per-step loops touch only the parameters they concern (a loop over every parameter is
        # per-step CPU time on a model of many small layers)
        self._swapping = [mp for mp in self.params.values() if mp.needs_swap and mp.sharded]
        self._cast_copies = [mp for mp in self.params.values() if mp.has_cast_copy]
        # their forward writes are warned about ([Note: compute copies cast at every forward] in params.py)
        self._frozen_casts = [mp for mp in self._cast_copies if not mp.requires_grad]
        # [Note: requires_grad set on the visible parameter] (see _sync_requires_grad)
        self._grad_leaves = [mp for mp in self.params.values() if mp.requires_grad and mp.full is not mp.visible]
        self._grad_visible = [mp.visible for mp in self._grad_leaves]
        self._grad_flags = [True] * len(self._grad_leaves)
        self._frozen_visible = [mp.visible for mp in self.params.values() if not mp.requires_grad]
        # [Note: replicated parameters swap at the root] A replicated parameter whose autograd leaf is
        # not the visible one (a compute-dtype copy under mixed precision, the plain tensor behind a
        # DTensor) is registered at its sites for the whole root forward and for the whole backward
        # (a recomputation reads it there), not around each module's forward: per-module hooks on a
        # model of many small layers cost more CPU per step than the layers. A module called
        # directly, outside the wrapper's forward, reads the visible parameter (the master weights,
        # in their dtype). Sharded parameters still swap per module: their full values exist only
        # while their group is gathered.
        # Each site of each such parameter as (its module's parameter dict, name, leaf, visible): a
        # swap is one dict store per site, no call per parameter (580 a swap, two swaps a step, on
        # gpt-deep in bf16).
        self._root_sites = [(module._parameters, attr, mp.full, mp.visible) for mp in self.params.values()
                            if mp.needs_swap and not mp.sharded for module, attr in mp.sites]
        self._root_swapped = False
        self._in_forward = False  # inside the wrapper's forward
        # a forward begun by a hooked module called outside the wrapper's forward, and how deep in
        # such calls the hooks are ([Note: a submodule called outside the model's forward])
        self._implicit: contextlib.ExitStack | None = None
        self._implicit_depth = 0

        self.unit_order = [u.name for u in plan.units]
        self.reducer = Reducer([])
        self._configure(plan, windows)

    def _configure(self, plan: Plan, windows: dict[int, tuple[int, int]] | None) -> None:
        """Build gather groups, buckets, prefetch triggers and hooks for ``plan`` (placement is
        already fixed by the managed parameters)."""
        self.plan = plan
        self._windows = windows
        self.configured += 1
        unit_plan = {u.name: u for u in plan.units}
        self.groups: list[GatherGroupRuntime] = []
        self.group_of_unit: dict[str, GatherGroupRuntime] = {}
        windows = windows or {}
        for gi, g in enumerate(plan.gather_groups):
            gparams = [self.params[p] for un in g.units for p in unit_plan[un].params]
            fw, bw = windows.get(gi, (g.prefetch.forward, g.prefetch.backward))
            grt = GatherGroupRuntime(
                gi, list(g.units), gparams,
                residency=unit_plan[g.units[0]].residency,
                forward_window=int(fw) if fw != "memory" else 1,
                backward_window=int(bw) if bw != "memory" else 1,
                comm=self.comm, device=self.device,
            )
            self.groups.append(grt)
            for un in g.units:
                self.group_of_unit[un] = grt
        self._resolve_memory_windows(plan, windows)
        self.group_of_param = {id(mp): grt for grt in self.groups for mp in grt.params}
        self.has_persistent = any(g.residency == "persistent" for g in self.groups)
        self._gathering = gathering_units([g.units for g in self.groups], [g.residency for g in self.groups])
        policy = self._launch_policy_arg or ("sampled" if self.comm.backend_for(self.device.type) == "nccl" else "ready")
        self.launch_policy = policy if self.groups else "ready"
        if getattr(self, "recompute", None) is not None:
            self.recompute.remove()
            self.compiled.remove()
        # compiled first: a block both compiled and recomputed recomputes its compiled forward
        self.compiled = BlockCompile(self.module, plan.compile, plan.compile_backend)
        self.recompute = BlockRecompute(self.module, plan.recompute, on_recompute=self._count_recomputed_block)
        previous = getattr(self, "offload", None)
        self.offload = OffloadManager(plan.offload, self.params, self.device)
        if previous is not None:
            previous.close()
            for opt, ours in list(self._optimizers.items()):
                if ours:
                    adopt_optimizer(self, opt)
        install_reducer(self, plan)
        for grt in self.groups:
            grt.record = self._record
        for b in self.reducer.buckets:
            b.record = self._record
        self.offload.record = self._record
        # [Note: probing the group roots] A candidate group's root (autodist/schedule.py [Note: hooks
        # per gather group]) is collapsed only once a step has shown that its forward encloses its
        # units' forwards: a container the model iterates (``for block in self.blocks``) or a
        # module whose units the model calls from elsewhere has no forward of its own around
        # them, and its units would find sharded parameters. Until the first backward ends, every
        # unit is hooked and probes on the roots record what encloses what; the prefetch positions
        # are the candidates' in both states (the simulator's), so what is issued is the same. A
        # root whose units were recomputed inside its backward (the model checkpoints inside it)
        # keeps a light pre-hook on each unit that records the recomputation; without one, a
        # recomputation that appears later is still correct (the root's backward swaps its
        # parameters in) but goes unrecorded.
        # the units of the blocks the plan recomputes, for [Note: anchors alike on every rank]
        recomputed = set(plan.recompute)
        self._plan_block_of = {u.name: u.block for u in self.structure.units if u.block in recomputed}
        for u, first in self._block_anchors().items():
            self._anchors.setdefault(u, first)  # before any is learned: the rule every rank shares
        self._candidates = {m: gi for gi, m in collapsed_groups(plan, self.structure).items()}
        self._candidate_units = [self.groups[gi].units for gi in self._candidates.values()]
        self._collapsed: dict[str, int] = {}
        self._watched: set[str] = set()
        self._probing = bool(self._candidates) and self._collapse
        self._compute_forward_triggers()
        self._install_hooks()

    def _resolve_memory_windows(self, plan: Plan, given: dict[int, tuple[int, int]]) -> None:
        """Windows of ``"memory"`` the caller did not give, by the rule the simulator times
        (``autodist/schedule.py``, [Note: memory windows])."""
        if not any("memory" in (g.prefetch.forward, g.prefetch.backward) for g in plan.gather_groups):
            return
        resident = resident_state_bytes(
            [(mp.shard_numel if mp.sharded else math.prod(mp.shape)) * mp.dtype.itemsize for mp in self.params.values()],
            [g.full_bytes for g in self.groups if g.residency == "persistent"],
        )
        windows = memory_windows([g.full_bytes for g in self.groups], resident, self.budget_bytes)
        for gi, g in enumerate(plan.gather_groups):
            if gi in given:
                continue
            if g.prefetch.forward == "memory":
                self.groups[gi].forward_window = windows[gi]
            if g.prefetch.backward == "memory":
                self.groups[gi].backward_window = windows[gi]

    def _count_recomputed_block(self) -> None:
        self.stats.recomputed_blocks += 1

    def switch_plan(self, plan: Plan, windows: dict[int, tuple[int, int]] | None = None) -> None:
        """Change every knob that can change between steps: residency, gather groups, windows,
        buckets, in-flight bound. Placement must stay as it is. Call between steps."""
        placement = {p: mp.placement for p, mp in self.params.items()}
        changed = [p for p, pl in plan.placement_of_param.items() if placement.get(p) != pl]
        if plan.shard_ranks != self.plan.shard_ranks:
            raise ValueError(
                f"switch_plan cannot change shard_size ({self.plan.shard_size} to {plan.shard_size}); the shard "
                "groups are fixed at wrap time"
            )
        if changed:
            raise ValueError(
                f"switch_plan cannot change placement (e.g. {changed[0]!r}); placement is fixed at wrap time"
            )
        self._reconfigure(plan, windows)
        self.stats.plan_switches += 1

    def _reconfigure(self, plan: Plan, windows: dict[int, tuple[int, int]] | None) -> None:
        if self._step.in_backward:
            raise RuntimeError("the plan or launch policy changed during backward; change it between steps")
        for g in self.groups:
            if g.state is not GroupState.SHARDED:
                g.free()
        self.remove_hooks()
        self._step, self._pending = StepState(gen=self._next_gen()), None
        self._configure(plan, windows)

    def set_launch_policy(self, policy: str | None) -> None:
        """Launch buckets as ``policy`` says from the next step on (``None``: the backend's default,
        see ``__init__``). Tests use it to run NCCL's ``"sampled"`` launches on gloo. Call between steps."""
        if policy is not None and policy not in LAUNCH_POLICIES:
            raise ValueError(f"launch_policy must be one of {', '.join(LAUNCH_POLICIES)}; got {policy!r}")
        self._launch_policy_arg = policy
        self._reconfigure(self.plan, self._windows)

    def _record(self, kind: str, what: object) -> None:
        if self.actions is not None:
            self.actions.add(kind, what)

    def record_actions(self, on: bool = True) -> ActionLog | None:
        """Start (or stop) recording the actions taken, from now on; returns the log (the runtime's
        side of the schedule agreement test)."""
        self.actions = ActionLog() if on else None
        return self.actions

    def remove_hooks(self) -> None:
        for h in self._handles + self._module_handles + self._call_handles + self._opt_global_handles:
            h.remove()
        self.param_hooks.remove()
        self._handles.clear()
        self._module_handles.clear()
        self._call_handles.clear()
        self._opt_global_handles.clear()

    def _next_gen(self) -> int:
        self._gen += 1
        return self._gen

    # ------------------------------------------------------------------------------------------
    # construction helpers
    # ------------------------------------------------------------------------------------------
    def reduce_dtype(self, mp: ManagedParam) -> torch.dtype:
        if self.mp is not None and mp.dtype.is_floating_point:
            return self.mp.reduce_dtype or self.mp.param_dtype or mp.dtype
        return mp.dtype

    def _compute_forward_triggers(self) -> None:
        pos = positions(self.unit_order, self._gathering)
        self.unit_pos = pos
        self._fire_pos = group_fire_positions(pos, self._candidate_units)
        self._fwd_triggers = triggers(
            [g.units for g in self.groups], [g.forward_window for g in self.groups], pos,
            missing=max(pos.values(), default=-1) + 1,
        )
        # [Note: a first use a rank left out]: each unit's index in the order, and each group's
        # first unit's index and place
        self._order_index = {u: i for i, u in enumerate(self.unit_order)}
        end = len(self.unit_order)
        self._first_use = {
            t.group: (min((self._order_index.get(u, end) for u in self.groups[t.group].units), default=end), t.first)
            for t in self._fwd_triggers
        }

    def _fire(
        self, cursor: TriggerCursor, pos: float, *, forward: bool = False, trained: bool = False, before: float | None = None,
    ) -> bool:
        """Issue the groups whose triggers ``pos`` reaches and that this pass has not issued,
        those whose place has passed too ([Note: units a forward left out] in schedule.py; passed:
        first used before ``before``, by default ``pos``); ``trained``: only groups with a trainable
        parameter. Returns whether it issued a passed one."""
        late = False
        step = self._step
        for gi, passed in cursor.fire_all(pos, before):
            g = self.groups[gi]
            if gi in cursor.done or (trained and not g.n_trainable):
                continue
            cursor.done.add(gi)
            issued = g.issue()
            if g.residency == "persistent" and not issued:
                # held from step to step and found current here: read again at its first use, so
                # a write the forward makes before then (a momentum encoder's update) is seen
                g.recheck()
            if forward and not passed:  # see [Note: a first use a rank left out]
                heapq.heappush(step.first_uses, (*self._first_use[gi], gi))
            late |= issued and passed
            if not issued:
                continue
            if forward:
                if g.residency != "after_forward":
                    continue
                if passed and not g.active and not g.fwd_done:
                    g.free()  # gathered only where the other ranks gather it: its place has passed
                else:
                    step.fwd_open.append(g)
            elif not g.used:  # no forward of this step read it: nor will this backward
                if passed:
                    g.free()
                else:
                    step.bwd_open.append(g)
        return late

    def _free_passed(self, at: int) -> None:
        """[Note: freeing the groups of units left out] A forward that leaves a unit out (an expert
        no token chose, a layer LayerDrop skipped) still gathers its group where the other ranks
        do ([Note: units a forward left out] in schedule.py). Such a group, and a group whose other
        units ran, was held to the end of the forward; prefetched a window ahead for each skipped
        unit, a mixture-of-experts model with one group per expert held 12-14 groups where its plan
        holds 2. The forward's place (the position of the unit running) tells where a unit was left
        out: when it jumps past a position, the unit there did not run, so the gathered groups
        whose units have all finished or been passed over are freed there (``at``, the place
        reached); :meth:`_post_forward` frees by the same rule. The places are the learned order's,
        which is the same on every rank, and freeing issues nothing, so every rank still issues the
        same collectives. A unit that runs after its place has passed (the order changed) gathers
        on demand, as any such unit does. In backward, a group gathered for units no forward of
        this step ran is read by nothing: it is freed at the next backward event (its gather,
        queued before that event's own, has finished by then on gloo; on CUDA the free waits on
        the stream, not the host)."""
        keep = []
        pos = self.unit_pos
        for g in self._step.fwd_open:
            if g.state is GroupState.SHARDED:
                continue
            if g.active == 0 and freed_after_forward(g.units, g.fwd_done, g.fwd_expected, pos, at):
                g.free()
            else:
                keep.append(g)
        self._step.fwd_open = keep

    def _first_uses_passed(self, cursor: TriggerCursor, index: float, at: float) -> None:
        """[Note: a first use a rank left out] A group's first use checks it: one found stale there
        (written since its gather was issued, or, persistent, since it was gathered) is gathered
        again at once (:meth:`GatherGroupRuntime.ensure`). A momentum encoder's update at the top
        of the forward writes the shards of groups prefetched at the forward's start: the ranks
        that run the unit gathered it again at its place; a rank that left the unit out did not,
        and the next collective differed (gloo hung: a mixture of experts whose expert groups are
        prefetched 4 places ahead, any residency; persistent per-expert groups at any window).
        Each group a forward trigger reaches before its first place is noted with its first
        unit's index in the learned order (the same on every rank); once a forward reaches a unit
        past it (``index``; ``at``, that unit's place) without having run any of the group's
        units, the triggers before the group's place are fired, as the ranks that run it fire
        them first, and the group is checked there as its first use would check it. Prefetch
        before the first unit starts at the forward's first hooked module, not at the root's
        forward, so the gathers it issues see the writes made before any unit (in the first step
        every group is prefetched there, the order not yet known). The check sees the writes made
        before the unit reached rather than before the group's place: writes to parameters
        between the units of a forward that leaves units out can still make ranks differ (the
        common update, before every unit, is seen alike); so can writes between a forward and its
        backward, and a group whose trigger a rank fires only after passing its place (a
        persistent unit after several left out, under a plan that mixes residencies: its check is
        not noted there). Persistent groups still in flight at a forward's end or a step's are
        waited for there (:meth:`_end_forward`, :meth:`_release_after_step`): a refresh issued at
        a step's start for a unit this rank left out stayed in flight into the next step, where a
        trigger took it for current on that rank only, and the shards were read while the user
        wrote them."""
        step = self._step
        heap = step.first_uses
        while heap and heap[0][0] < index:
            _, place, gi = heapq.heappop(heap)
            g = self.groups[gi]
            if g.state is GroupState.SHARDED or any(u in step.seen_units for u in g.units):
                continue  # freed where the place passed, or checked at its first use
            self._fire(cursor, place - 1, forward=True, before=at)
            g.ensure()

    def _catch_up(self, cursor: TriggerCursor, site: ModuleSite, forward: bool) -> None:
        """Before ``site`` gathers its groups: the triggers of the places before its own, which
        this rank passed over when it left a unit out ([Note: units a forward left out]). A site's
        place is its unit's (a collapsed group's root: the group's first); a site reading a group
        of another unit (a tied weight) gathers it where it is, as it did.

        In a backward under NCCL's launch policy, the buckets are then polled as the left-out
        units' post-backward signals would have polled them on the ranks that ran them, so a
        bucket they settle is launched among the gathers where it is launched there."""
        if cursor.next >= len(cursor.trig) or site.unit is None:
            return
        at = self._place(site, forward)
        if at is not None and self._fire(cursor, at - 1, forward=forward, before=at) and not forward:
            if self.launch_policy == "sampled":
                self.reducer.poll()

    def _place(self, site: ModuleSite, forward: bool) -> int | None:
        """``site``'s position in this pass: its unit's, or a collapsed group root's (or a site
        without a unit of its own), its units' first."""
        pos = self.unit_pos if forward else self._step.bwd_need
        if site.unit is not None and not site.collapsed:
            return pos.get(site.unit)
        return min((pos[u] for u in site.units if u in pos), default=None)

    def _replay_left_out(self, site: ModuleSite) -> None:
        """Before ``site``'s backward, the backward events of the units this step's forwards left
        out, at their places: the triggers there, then a poll of the buckets, as their pre- and
        post-backward events do on the ranks that ran them. A bucket of theirs is settled only once
        its place is reached (see :meth:`_settled`), so it is launched where those ranks launch it:
        under NCCL's launch policy ([Note: one issue order for NCCL]) among the same gathers, and
        under either policy before this rank goes on to gathers a rank waiting for that bucket (its
        bound on reductions in flight) has not issued yet. Under NCCL's policy a replicated unit
        has no event of its own on the ranks that ran it (its bucket waits for the next sharded
        unit's), so only a sharded unit left out polls there."""
        at = self._place(site, False)
        if at is None:
            return
        if self._step.bwd_units_at:
            self._replay_left_out_before(at, any(u in self._gathering for u in site.units))
        else:  # no unit left out (the usual step): only the place advances
            self._step.bwd_reached = max(self._step.bwd_reached, at)

    def _replay_left_out_before(self, at: int, gathers: bool) -> None:
        """:meth:`_replay_left_out` up to backward position ``at``, the place of a unit that
        ``gathers`` or not: one that gathers nothing has the place of the last gathering unit
        before it, whose backward has then passed too."""
        step = self._step
        end = at if gathers else at + 1
        for j in range(step.bwd_reached + 1, end):
            left = step.bwd_units_at.get(j)
            if left:
                self._fire(step.bwd_schedule, j, before=end)
                step.bwd_reached = j
                if self.launch_policy != "sampled" or any(u in self.group_of_unit for u in left):
                    self.reducer.poll()
        step.bwd_reached = max(step.bwd_reached, at)

    def _install_hooks(self) -> None:
        self._install_module_hooks()
        # Gradient-ready hooks.
        for mp in self.params.values():
            if mp.requires_grad:
                self.param_hooks.install(mp, self._make_grad_hook(mp))
        # Optimizer hooks: process-wide while the model is wrapped (see [Note: process-wide
        # optimizer hooks] in optimizers.py).
        self._opt_global_handles.append(optim_hooks.register_optimizer_step_pre_hook(weak_optimizer_hook(self, "pre")))
        self._opt_global_handles.append(optim_hooks.register_optimizer_step_post_hook(weak_optimizer_hook(self, "post")))

    def _install_module_hooks(self, *, warn: bool = True) -> None:
        """Module forward hooks, only where something must happen: at the roots of the collapsed
        groups, and while the candidates are still probed, at their units and probes at their roots
        (see [Note: probing the group roots]).

        [Note: the runtime's pre-forward hooks run first] A forward pre-hook of the model's own
        reads the module's parameters: torch's ``nn.utils.weight_norm`` computes ``weight`` from
        ``weight_g`` and ``weight_v`` in one (audio models keep it). Registered before the runtime's,
        it ran first and read the visible parameters — under a sharded plan this rank's DTensor
        shards, and the forward failed on a DTensor weight. The runtime's pre-forward hooks are
        prepended, as FSDP2's are, so any other pre-hook sees the full parameters; its post-forward
        hooks are appended, after the model's own."""
        for h in self._module_handles + self._call_handles:
            h.remove()
        self._module_handles.clear()
        self._call_handles.clear()
        self._sites_of_param: dict[int, list[ModuleSite]] = {}
        self._probe_depth: dict[str, int] = {}
        self._probe_failed: set[str] = set()
        self._probe_inner: set[str] = set()  # roots whose units were recomputed inside the root's backward
        root_of_unit = {u: r for r, gi in self._candidates.items() for u in self.groups[gi].units} if self._probing else {}
        unit_of_module = {u.module_name: u.name for u in self.structure.units}
        module_of_unit = {u.name: u.module_name for u in self.structure.units}
        functional = self.structure.functional_uses
        unit_params = {u.name: [self.params[p] for p in u.params] for u in self.structure.units}
        roots = self._collapsed
        sites: list[ModuleSite] = []
        probed: list[tuple[str, nn.Module]] = []
        for mname, module in self.module.named_modules():
            if self._probing and mname in self._candidates:
                probed.append((mname, module))
                self._module_handles.append(module.register_forward_hook(self._make_probe(mname, -1), always_call=True))
            if mname in roots:
                self._install_collapsed(module, mname, self.groups[roots[mname]], unit_params)
                continue
            root = next((r for r in roots if encloses(r, mname)), None)
            if root is not None:  # enacted at its group's root
                own = unit_of_module.get(mname)
                if own is not None and root in self._watched:  # checkpointing inside the root
                    self._module_handles.append(module.register_forward_pre_hook(self._make_recompute_watch(own), prepend=True))
                continue
            units: list[str] = []
            own = unit_of_module.get(mname)
            if own is not None:
                units.append(own)
            for p in module._parameters.values():
                mp = self._visible_map.get(id(p)) if p is not None else None
                if mp is not None:
                    u = self.structure.unit_of_param[mp.name]
                    if u not in units:
                        units.append(u)
            for u in functional.get(mname, ()):  # read functionally from a descendant's parameters
                if u not in units and module_of_unit.get(u) is not None:
                    units.append(u)
            params = [mp for u in units for mp in unit_params[u]]
            swaps = [mp for mp in params if mp.needs_swap and mp.sharded]
            groups: list[GatherGroupRuntime] = []
            for mp in params:
                g = self.group_of_param.get(id(mp))
                if g is not None and g not in groups:
                    groups.append(g)
            # Unit modules also carry prefetch triggers (and record the order units run in) as soon
            # as anything is gathered, even when their own parameters are replicated.
            anchor = own is not None and (f"forward:{own}" in self.offload.out_at or f"backward:{own}" in self.offload.back_at)
            if not swaps and not groups and not (own is not None and self.groups) and not anchor:
                continue
            if not groups and self.launch_policy == "sampled" and not params:
                continue
            site = ModuleSite(module=module, name=mname, unit=own, swaps=swaps, groups=groups, units=units, params=params)
            site.probe_root = root_of_unit.get(own) if own is not None else None
            sites.append(site)
        for site in merge_block_sites(sites, self.compiled.blocks, self.module, self.unit_order, warn=warn):
            for mp in site.params:
                self._sites_of_param.setdefault(id(mp), []).append(site)
            self._module_handles.append(site.module.register_forward_pre_hook(self._make_pre_forward(site), with_kwargs=True, prepend=True))
            self._module_handles.append(site.module.register_forward_hook(self._make_post_forward(site), always_call=True))
        for mname, module in probed:  # before the unit's own pre-forward at a root that is a unit too
            self._module_handles.append(module.register_forward_pre_hook(self._make_probe(mname, 1), prepend=True))
        # the root module called directly (`model.module(x)`) is one forward, not one per child;
        # its children too, where no site is (a replicated plan under a policy: their parameters'
        # compute copies and gradient buckets are the forward's, [Note: a submodule called outside
        # the model's forward]). A plan of plain replicated parameters needs none: a module called
        # directly computes with the parameters the buckets reduce, as under DDP
        if sites or self._root_sites:
            enter, leave = self._make_root_call_hooks()
            for module in (self.module, *self.module.children()):
                self._call_handles.append(module.register_forward_pre_hook(enter, prepend=True, with_kwargs=True))
                self._call_handles.append(module.register_forward_hook(leave, always_call=True))

    def _make_probe(self, root: str, delta: int):
        def probe(module: nn.Module, *_: object) -> None:
            self._probe_depth[root] = self._probe_depth.get(root, 0) + delta

        return probe

    def _settle_probes(self) -> None:
        """After the first backward: collapse the candidate groups whose root's forward enclosed
        every forward of their units (see [Note: probing the group roots])."""
        self._probing = False
        self._collapsed = {r: gi for r, gi in self._candidates.items() if r in self._probe_depth and r not in self._probe_failed}
        self._watched = set(self._probe_inner)
        self._install_module_hooks(warn=False)

    def _install_collapsed(
        self, module: nn.Module, mname: str, g: GatherGroupRuntime, unit_params: dict[str, list[ManagedParam]]
    ) -> None:
        """The hooks of gather group ``g`` at its root ``module`` (see [Note: hooks per gather group]
        in autodist/schedule.py)."""
        params = [mp for u in g.units for mp in unit_params[u]]
        site = ModuleSite(
            module=module, name=mname, unit=g.units[0], swaps=[mp for mp in params if mp.needs_swap and mp.sharded],
            groups=[g], units=list(g.units), params=params, collapsed=True,
            bwd_first=backward_order(g.units, self._module_of_unit)[0],
        )
        for mp in params:
            self._sites_of_param.setdefault(id(mp), []).append(site)
        self._module_handles.append(module.register_forward_pre_hook(self._make_pre_forward(site), with_kwargs=True, prepend=True))
        self._module_handles.append(module.register_forward_hook(self._make_post_forward(site), always_call=True))

    def _make_recompute_watch(self, unit: str):
        """A unit inside a collapsed group's root: its forward during backward is a recomputation
        the root's hooks do not see (checkpointing inside the root), recorded as a hooked unit's is;
        the root's pre-backward has gathered and swapped in its parameters."""

        def watch(module: nn.Module, args: tuple) -> None:
            if in_backward():
                step = self._step
                self.stats.recomputations += 1
                if unit not in step.anchors:
                    self._record("recompute", unit)
                step.anchors.setdefault(unit, step.bwd_current)

        return watch

    def close(self) -> None:
        """Remove all hooks; wait for anything in flight; bring offloaded state back. The hooks go
        even when one of the others raises (a peer's failure seen by the sequence check)."""
        try:
            self.comm.finish_sequence_check()
            self._swap_root(False)
            self.recompute.remove()
            self.compiled.remove()
            self.offload.close()
            self.reducer.reset()
            for g in self.groups:
                if g.state is GroupState.GATHERING:
                    g.wait()
        finally:
            self.remove_hooks()
            for handle in list(self._load_hooks.values()):
                handle.remove()
            self._load_hooks.clear()

    # ------------------------------------------------------------------------------------------
    # root forward
    # ------------------------------------------------------------------------------------------
    def forward(self, args: tuple, kwargs: dict) -> object:
        args, kwargs = self._cast_inputs(args, kwargs) or (args, kwargs)
        if in_backward():  # the whole model is checkpointed and recomputed: the module hooks cope
            self.stats.recomputations += 1
            self._on_backward_start()
            return self.module(*args, **kwargs)
        if self._implicit is not None:  # a submodule's call that raised before its end
            self._abandon_implicit()
        self._begin_step()
        # the triggers before the first unit fire at the forward's first hooked module, not here: the
        # model's forward may write its parameters before any unit runs ([Note: a first use a rank
        # left out])
        self._swap_root(True)
        self._in_forward = True
        done = False
        try:
            if self.observer is not None and torch.is_grad_enabled():
                with self.observer.forward_context():
                    out = self.module(*args, **kwargs)
                self.observer.forward_end(out)
            elif self.observer is not None:  # an evaluation, a pseudo-label pass: not the step's
                with self.observer.paused():
                    out = self.module(*args, **kwargs)
            else:
                out = self.module(*args, **kwargs)
            done = True
        finally:
            self._in_forward = False
            self._swap_root(False)
            if not done:
                self._end_aside()
        self._end_forward(out)
        return out

    def _begin_implicit(self) -> None:
        """[Note: a submodule called outside the model's forward] CLIP-style code calls the model's
        parts, not its forward: ``model.encode_image(x)`` for zero-shot evaluation or retrieval,
        ``model.encode_image(x)`` and ``model.encode_text(t)`` as a training step. The runtime's
        per-step work is the wrapper's forward's, so such a call found a persistent group holding
        the weights of before the last optimizer step (0.105 off under a persistent plan,
        silently), a replicated DTensor parameter where its module needed the plain tensor (mixed
        plans failed), and compute copies and buffers as the last forward left them. The first
        hooked module called outside the wrapper's forward (and not in backward) now begins a
        forward as the wrapper's does, and that module's own end ends it: one forward per
        outermost call (the root module called directly, ``model.module(x)``, is one: it and its
        children are hooked for this, where no site is too: under ``plan="ddp"`` with a bf16
        policy, training through ``model.module(x)`` computed with the float32 master weights and
        their gradients were never reduced, the ranks drifting apart silently), its inputs cast
        as the wrapper's are, each joining the step of the one before it as forwards before one
        backward do ([Note: several forwards before one backward]); the units it does not run are the
        units a forward left out (gathered all the same, so every rank's collectives match). The
        root module's own parameters are not in such a forward: code that reads one (a learnt
        temperature) reads the visible parameter, a DTensor under a plan with DTensors, and takes
        its ``.full_tensor()`` as for any term outside the forward. A plan="auto" profile does
        not record such forwards."""
        stack = contextlib.ExitStack()
        self._begin_step()
        self._swap_root(True)
        if self.observer is not None:
            stack.enter_context(self.observer.paused())
        self._implicit = stack

    def _end_implicit(self, out: object) -> None:
        stack, self._implicit = self._implicit, None
        try:
            self._swap_root(False)
            self._end_forward(out)
        finally:
            if stack is not None:
                stack.close()

    def _abandon_implicit(self) -> None:
        """A forward begun by a submodule call whose end never came (it raised): put back what it
        changed; the next forward starts a step of its own."""
        stack, self._implicit, self._implicit_depth = self._implicit, None, 0
        self._swap_root(False)
        self._end_aside()
        if stack is not None:
            stack.close()

    def _swap_root(self, on: bool) -> None:
        """Register the replicated parameters' autograd leaves (``on``) or the visible parameters at
        their sites (see [Note: replicated parameters swap at the root])."""
        if on == self._root_swapped:
            return
        # a site holding another tensor (torch.func.functional_call's) is left as it is ([Note: a
        # tensor put in a parameter's place] in params.py)
        if on:
            for params, attr, leaf, visible in self._root_sites:
                held = params.get(attr)
                if held is visible:
                    params[attr] = leaf
                elif held is None and attr not in params:
                    mp = self._visible_map[id(visible)]
                    moved_after_wrapping(mp.name, next(m for m, a in mp.sites if m._parameters is params), attr)
        else:
            for params, attr, leaf, visible in self._root_sites:
                if params.get(attr) is leaf:
                    params[attr] = visible
        self._root_swapped = on

    def _begin_step(self) -> None:
        self.comm.finish_sequence_check()
        self._check_forward_mode()
        step = self._step
        if self.forward_joins_step():
            self._join_step()
            return
        if (
            not torch.is_grad_enabled() and step.grad and not step.in_backward
            and (step.expects_backward or (step.backwards and self.grad_forwards))
        ):
            self._begin_aside()
            return
        if step.expects_backward and not step.in_backward:
            # The previous forward's backward never ran (or ran without reaching our hooks).
            self._release_after_step(drop_reductions=True)
        self._sync_requires_grad()
        self.param_hooks.scan()
        grad = torch.is_grad_enabled()
        self.grad_forwards += grad  # reset by each optimizer step ([Note: a step no backward reached])
        self._step = StepState(
            gen=self._next_gen(), sync=self.sync_enabled and grad, grad=grad,
            fwd_schedule=TriggerCursor(self._fwd_triggers),
        )
        for mp in self._swapping:
            mp.reset_swaps()
        self._swap_root(False)
        for g in self.groups:
            g.recheck()
        # before the previous step's reduce-scatter outputs are released, as the simulator's
        # preamble has it ([Note: refresh buffers] in autodist/cost/sim/gathers.py)
        self._refresh_persistent()
        self.reducer.begin(sync=self._step.sync)
        for b in self.reducer.buckets:
            b.release_if_unused()
        if self.offload.active:
            # [Note: when offloaded state leaves the device] the copy-outs the optimizer step started
            # are finished here and their device memory released, at a point the simulator knows —
            # not whenever a background copy happens to complete (a starved copy thread would leave
            # the state on the device through the forward's peak). On CUDA the compute stream waits
            # on the copies' events: the host does not block.
            self.offload.finish_out()
        for g in self.groups:
            g.reset_step()  # every unit of a group expected: see [Note: units a forward left out]
        # [Note: when buffers are broadcast] DDP's rule (broadcast_buffers=True): rank 0's buffers are
        # broadcast before the first forward, and before every forward that follows a forward run
        # with gradients enabled and synchronised (outside no_sync) — whatever this forward's own
        # grad mode, so an evaluation under no_grad after a training step uses rank 0's BatchNorm
        # statistics, as under DDP. A forward under no_grad or no_sync makes the next one skip it.
        # Every rank runs the same forwards in the same modes, so every rank agrees on when.
        self._broadcast_buffers_if_due()
        refresh_casts(self._cast_copies)

    def _check_forward_mode(self) -> None:
        """[Note: a forward on some ranks only] DDP code evaluates on rank 0 alone
        (``if rank == 0: model.eval(); validate(model)``). Under a plan that gathers parameters, or
        with buffers to broadcast, that forward's collectives met the other ranks' next training
        step instead: gloo aborted the processes on mismatched sizes ("Is there a distributed
        collective mismatch?"), and NCCL pairs whatever comes or waits until its timeout. A forward
        whose ``model.train()``/``model.eval()`` mode differs from the last forward's first meets
        every rank in the job's store ([Note: a collective called on some ranks only] in comm.py):
        the rank evaluating alone logs a warning naming the ranks that did not and what to do after
        half the group's timeout (at most 5 minutes), and raises it as a :class:`RankMismatchError`
        before the group's timeout. Each meeting costs about 2-3 ms on 2 CPU ranks, and a loop may
        change mode every step (pseudo-labels, rollouts under ``model.eval()``): only the first
        ``FORWARD_MODE_CHECKS`` changes meet — code that evaluates on one rank does so from its
        first evaluation. A forward needing no collective (a replicated plan without buffers to
        broadcast) is not checked, and runs on one rank as under DDP. A forward on some ranks only
        in the same mode (a sample logged on rank 0 under ``no_grad``, without ``model.eval()``),
        or past the first checks, is not seen here."""
        training = self.module.training
        if training == self._last_training or self._mode_checks >= FORWARD_MODE_CHECKS:
            return
        collective = bool(self.groups) or (
            self.broadcast_buffers and self._buffers_due and next(self.module.buffers(), None) is not None
        )
        if collective:  # refused: the same forward on every rank later meets again
            self.comm.rendezvous(
                "a forward in training mode (model.train())" if training else "a forward in evaluation mode (model.eval())",
                FORWARD_ON_EVERY_RANK,
            )
            self._mode_checks += 1
        self._last_training = training

    def _sync_requires_grad(self) -> None:
        """[Note: requires_grad set on the visible parameter] Code freezes and unfreezes parameters
        between steps through the parameters it sees (a GAN's generator step sets its
        discriminator's ``requires_grad`` off), and autograd reads the flag of the tensor the
        forward computes with. Where that is not the visible parameter (a sharded parameter's full
        tensor, a compute-dtype copy, the plain tensor behind a replicated DTensor), the flag is
        carried over at each step's first forward, as FSDP2 does at each unshard: the discriminator
        trained on its generator step's gradients under every sharded plan (0.12 off the reference
        after 4 steps). One list of flags read and compared a step. A parameter frozen when the
        model was wrapped has no gradient bucket: made trainable later, its gradient would never be
        reduced, so that is refused."""
        flags = [p.requires_grad for p in self._grad_visible]
        if flags != self._grad_flags:
            for mp, flag in zip(self._grad_leaves, flags):
                if mp.full.requires_grad != flag:
                    mp.full.requires_grad_(flag)
            self._grad_flags = flags
        if self._frozen_visible and any(p.requires_grad for p in self._frozen_visible):
            names = [mp.name for mp in self.params.values() if not mp.requires_grad and mp.visible.requires_grad]
            raise ValueError(
                f"parameter(s) {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} were frozen (requires_grad=False) "
                "when the model was wrapped and are trainable now: the plan has no gradient bucket for them, so their "
                "gradients would never be reduced across ranks. Set requires_grad as training will need it before "
                "wrapping (freezing a trainable parameter between steps is fine), or wrap the model again."
            )

    def _refresh_persistent(self) -> None:
        """Gather again, in plan order, the persistent groups an optimizer stepped over since the
        last forward ([Note: when persistent groups are refreshed] in optimizers.py)."""
        for g in self.groups:
            if g.refresh_due:
                g.refresh_due = False
                if g.state is not GroupState.SHARDED and g.issue(force=True):
                    self.stats.persistent_refreshes += 1

    def forward_joins_step(self) -> bool:
        """Whether a forward now joins the step of the one before it: gradients are enabled, that
        forward's backward has not begun, and both synchronise or neither does ([Note: several
        forwards before one backward])."""
        step = self._step
        return (step.expects_backward and not step.in_backward and step.grad and torch.is_grad_enabled()
                and step.sync == self.sync_enabled)

    def _join_step(self) -> None:
        """A forward with gradients that follows one whose backward has not begun joins its step.

        [Note: several forwards before one backward] Training code runs a model more than once
        before one backward: two views of a batch through one encoder (contrastive and siamese
        training), a consistency or distillation term, losses summed over chunks. DDP and FSDP2
        both train such steps. The step's state is kept, not started anew: every forward adds its
        uses and post-backward signals to the same counts, so a group is freed, and a parameter's
        gradient counted final, only when the backward of every forward that used it has run
        (starting a step here released the first forward's groups and dropped its signals, and its
        backward then read freed parameters). Prefetch runs again from the forward's first trigger;
        the order learned, the reductions and the gathered groups are the step's. A forward that
        is never backpropagated (its loss dropped) leaves its signals unfired: what it held is
        released and its gradients reduced at the end of the backward that follows, a little later
        than they could have been. A forward under ``no_grad`` after an unfinished one runs beside
        its step ([Note: a forward without gradients before a backward]); one under a different
        ``no_sync`` state still starts a step of its own."""
        self.stats.joined_forwards += 1
        self._step.fwd_schedule = TriggerCursor(self._fwd_triggers)
        # the order is learned, and a group freed, from this forward's own units: the units each
        # rank's earlier forwards ran differ where the ranks leave out different units ([Note:
        # units a forward left out] in autodist/schedule.py)
        self._step.fwd_sequence, self._step.seen_units = [], set()
        self._step.fwd_place, self._step.fwd_open, self._step.first_uses = -1, [], []
        for g in self.groups:
            g.fwd_done = set()
        if self.offload.active:
            self.offload.finish_out()
        self._refresh_persistent()
        self._broadcast_buffers_if_due()
        refresh_casts(self._cast_copies)

    def _begin_aside(self) -> None:
        """A forward without gradients in a step that may still run a backward runs beside it.

        [Note: a forward without gradients before a backward] Training code runs the model under
        ``torch.no_grad()`` between a forward and its backward: a target or teacher output from the
        same network (self-distillation, consistency terms), a metric, a generation logged mid-step;
        or between two backward passes over one forward (``retain_graph``, an input gradient taken
        with ``create_graph``). Such a forward used to start a step of its own, dropping the pending
        one's reductions, so that backward reduced nothing: under ``plan="ddp"`` the ranks drifted
        apart (0.18 and 0.21 off a one-process run after 4 steps of a small GPT), under sharded
        plans each rank stepped its shard with its own gradient (0.92 off), silently; DDP trains
        it. The pending step is now set aside while that forward runs with a step state of its own
        (no gradients, no reductions, its gathers issued by its own schedule, alike on every rank)
        and put back at its end. The groups the pending step held stay as it left them (its
        backward reads them; a backward that built a graph keeps every group gathered), those the
        forward gathered itself are freed by their residency, and the order learned is the pending
        forward's. Buffers are broadcast by DDP's rule, as before any forward. Whether a step may
        still run a backward: its forward's has not begun, or it has run one and no optimizer has
        stepped since (after the step, an evaluation starts a step of its own, which refreshes what
        the step made stale). A forward whose loss is dropped keeps what its step holds through
        such forwards (all of its groups under an ``after_backward`` plan), until the next forward
        with gradients releases it."""
        self._pending = self._step
        self._aside_held = {g.index for g in self.groups if g.state is not GroupState.SHARDED}
        self._step = StepState(gen=self._next_gen(), sync=False, grad=False, fwd_schedule=TriggerCursor(self._fwd_triggers))
        for g in self.groups:
            g.fwd_done = set()
            g.recheck()
        for b in self.reducer.buckets:  # gradients dropped since the backward (zero_grad) free their shards
            b.release_if_unused()
        if self.offload.active:
            self.offload.finish_out()
        self._broadcast_buffers_if_due()
        refresh_casts(self._cast_copies)

    def _end_aside(self) -> None:
        """Put back the step a forward without gradients set aside (:meth:`_begin_aside`)."""
        if self._pending is not None:
            self._step, self._pending, self._aside_held = self._pending, None, set()

    def _broadcast_buffers_if_due(self) -> None:
        """Rank 0's buffers on every rank, when due ([Note: when buffers are broadcast]). Their
        version counters are kept as they were, as DDP keeps them: an earlier forward of this step
        whose backward is still to run (several forwards before one backward) saved BatchNorm's
        running statistics, which its backward does not read in training mode, and autograd would
        otherwise refuse that backward for a tensor modified in place."""
        if self.broadcast_buffers and self._buffers_due and self.comm.world_size > 1:
            bufs = tuple(self.module.buffers())
            if bufs:
                with torch.autograd._unsafe_preserve_version_counter(bufs):
                    self.comm.broadcast_tensors(list(bufs), "buffers")
        self._buffers_due = self._step.sync

    def _end_forward(self, out: object) -> None:
        step = self._step
        if self.offload.active:
            self.offload.finish_out()  # copy-outs started at a forward unit (see [Note: when offloaded state ...])
        tensors = [t for t in output_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        step.expects_backward = bool(tensors) and torch.is_grad_enabled()
        if self._frozen_casts:
            self._warn_written_copies()
        if step.first_uses:
            self._first_uses_passed(step.fwd_schedule, math.inf, math.inf)
        self._fire(step.fwd_schedule, math.inf, forward=True)  # the places a forward left out last
        for g in self.groups:
            if g.active or g.index in self._aside_held:  # a step set aside still reads what it held
                continue
            if g.residency == "after_forward" or (g.residency == "after_backward" and not step.expects_backward):
                g.free()
            elif g.residency == "persistent":
                g.quiesce()  # see [Note: a first use a rank left out]
        step.fwd_open = [g for g in step.fwd_open if g.active]
        if step.expects_backward:
            self.param_hooks.own(register_multi_grad_hook, tensors, self._root_pre_backward)
        if self._pending is None:
            self._learn_forward_order(step.fwd_sequence)
        self._end_aside()

    def _warn_written_copies(self) -> None:
        """A write inside the forward to the compute copy of a parameter no optimizer steps
        ([Note: compute copies cast at every forward] in params.py), said once."""
        written = written_casts(self._frozen_casts)
        if written:
            names = [mp.name for mp in written]
            dtype = str(written[0].compute_dtype).replace("torch.", "")
            self.once.warning(
                "written-copies",
                "autodist: the forward wrote parameter(s) %s (%d in all), which no optimizer steps (a momentum "
                "update inside forward?). Under mixed_precision with param_dtype=%s and a plan that replicates them, "
                "the forward computes with %s copies of these parameters and the write reached the copies only: the "
                "parameters, their state_dict and the next step do not see it. Make the update outside the forward "
                "(after optimizer.step()), shard these parameters' units in the plan (the forward then writes the "
                "parameters themselves), or leave param_dtype unset",
                ", ".join(names[:3]) + (" ..." if len(names) > 3 else ""), len(names), dtype, dtype,
            )
            for mp in written:
                mp._copy_seen = (mp.full._version, mp.full.data_ptr())

    def _learn_forward_order(self, seq: list[str]) -> None:
        """Prefetch for the next forward follows the order units actually ran in this one."""
        if not seq:
            return
        new_order = merged_order(self.unit_order, seq)
        if new_order == self.unit_order:
            self._order_learned = True
            return
        if self._order_learned:
            self.stats.order_deviations += 1
            if self.actions is not None:
                self.actions.deviation(f"forward order changed: {', '.join(seq[:4])}{', ...' if len(seq) > 4 else ''}")
            self.once.info(
                "order",
                "autodist: units ran in a different order than in the previous step (control flow changed); "
                "prefetch follows the latest order and gathers on demand where it guessed wrong",
            )
        self._order_learned = True
        self.unit_order = new_order
        self._compute_forward_triggers()

    # ------------------------------------------------------------------------------------------
    # module hooks
    # ------------------------------------------------------------------------------------------
    def _make_pre_forward(self, site: ModuleSite):
        def pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            with outside_dispatch_modes():
                return self._pre_forward(site, args, kwargs)

        return pre_forward

    def _implicit_enter(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """A hooked module's (or the root module's) call begins: outside the wrapper's forward and
        outside backward, it is in a forward of its own ([Note: a submodule called outside the
        model's forward]). Returns the call's inputs cast as the wrapper's forward casts them (a
        policy's ``cast_forward_inputs``) where this call begins that forward, else None."""
        if self._in_forward or in_backward():
            return None
        if self._implicit is not None:
            self._implicit_depth += 1
            return None
        self._begin_implicit()
        self._implicit_depth = 1
        return self._cast_inputs(args, kwargs)

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """A forward's inputs cast to the policy's compute dtype (``cast_forward_inputs``), or None."""
        if self.mp is not None and self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            return cast_floats(args, self.mp.param_dtype), cast_floats(kwargs, self.mp.param_dtype)
        return None

    def _implicit_exit(self, output: object) -> None:
        if self._implicit is None or in_backward():
            return
        self._implicit_depth -= 1
        if self._implicit_depth == 0:
            self._end_implicit(output)

    def _make_root_call_hooks(self) -> tuple[Callable[..., object], Callable[..., None]]:
        """The pre and post forward hooks of the root module and its children for a direct call
        (functions, not bound methods: ``copy.deepcopy(model.module)`` copies a module's hooks, and
        a bound method would take the engine, process groups and all, with it)."""

        def enter(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if self._in_forward:  # the wrapper's own call: nothing to do, at two hook calls a step
                return None
            with outside_dispatch_modes():
                return self._implicit_enter(args, kwargs)

        def leave(module: nn.Module, args: tuple, output: object) -> None:
            if self._implicit is None:
                return
            with outside_dispatch_modes():
                self._implicit_exit(output)

        return enter, leave

    def _pre_forward(self, site: ModuleSite, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        cast = None if self._in_forward else self._implicit_enter(args, kwargs)
        if cast is None:
            return self._site_pre_forward(site, args, kwargs)
        routed = self._site_pre_forward(site, *cast)
        return cast if routed is None else routed

    def _site_pre_forward(self, site: ModuleSite, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        recompute = in_backward()
        step = self._step
        if recompute:
            self._on_backward_start()
            if site.probe_root is not None and not self._probe_depth.get(site.probe_root):
                self._probe_inner.add(site.probe_root)
            for u in site.units if site.collapsed else [site.unit] if site.unit is not None else []:
                self.stats.recomputations += 1
                if u not in step.anchors:
                    self._record("recompute", u)
            anchor_pos = -1
            for u in site.units:
                step.anchors.setdefault(u, step.bwd_current)
                anchor_pos = max(anchor_pos, step.bwd_need.get(u, -1))
        else:
            if self.offload.active and site.unit is not None:
                self.offload.poll()
                keys = self.offload.out_at.get(f"forward:{site.unit}")
                if keys:
                    self.offload.copy_out(keys)
            if site.probe_root is not None and not self._probe_depth.get(site.probe_root):
                self._probe_failed.add(site.probe_root)  # ran outside its group root's forward
            for u in site.units:
                if u not in step.seen_units:
                    step.seen_units.add(u)
                    step.fwd_sequence.append(u)
                    step.ran_units.add(u)
            if step.grad and torch.is_grad_enabled():
                for mp in site.params:
                    step.uses[id(mp)] = step.uses.get(id(mp), 0) + 1
            elif step.grad:  # a no-grad forward inside a training forward: reentrant checkpointing
                step.site_nograd[id(site)] = step.site_nograd.get(id(site), 0) + 1
                for mp in site.params:
                    step.uses[id(mp)] = step.uses.get(id(mp), 0) + 1
                    step.nograd_uses.add(id(mp))
        # Own groups first, then prefetch: the finished gather's buffers are released before the
        # next one allocates its own (FSDP2 orders them the same way).
        cursor = step.bwd_schedule if recompute else step.fwd_schedule
        unit = None if recompute else site.unit
        at = self._place(site, True) if unit is not None else None
        if not recompute and cursor.next == 0:
            # the forward's first hooked module: the triggers before every unit, before it gathers
            # its own groups (what the root fired before [Note: a first use a rank left out])
            self._fire(cursor, -1, forward=True, before=at)
        if unit is not None and step.first_uses:
            index = min((self._order_index.get(u, math.inf) for u in site.units), default=math.inf) if site.collapsed \
                else self._order_index.get(unit, math.inf)
            if step.first_uses[0][0] < index:
                self._first_uses_passed(cursor, index, math.inf if at is None else at)
        if at is not None and at > step.fwd_place + 1 and step.fwd_open:
            self._free_passed(at)  # a unit was left out ([Note: freeing the groups of units left out])
        if site.groups:
            self._catch_up(cursor, site, not recompute)
        if unit is not None and at is not None:  # a collapsed group's root reaches its last unit's place
            step.fwd_place = max(step.fwd_place, self._fire_pos.get(unit, at) if site.collapsed else at)
        for g in site.groups:
            was_sharded = g.state is GroupState.SHARDED
            if g.ensure() and not g.used:  # gathering again a group used earlier this step is planned
                self._count_on_demand(g, recompute)
            if was_sharded and not recompute and g.residency == "after_forward":
                step.fwd_open.append(g)
            cursor.done.add(g.index)
            g.used = True
            if recompute and was_sharded and g.tokens_fired and not g.tokens_pending:
                g.hold = True  # every signal already fired: nothing tells when this use ends
            g.active += 1
        if site.unit is not None:
            if recompute:
                self._fire(step.bwd_schedule, anchor_pos)
            else:  # a candidate group's units fire at its last position ([Note: hooks per gather group])
                self._fire(step.fwd_schedule, self._fire_pos.get(site.unit, -1), forward=True)
        if recompute and site.sharded:
            self.reducer.poll()
        for mp in site.swaps:
            mp.swap_in()
        if not ((site.groups or self.launch_policy == "sampled") and torch.is_grad_enabled()):
            return None
        # The post-backward signal: from the forward that builds the graph backward will run.
        if recompute and id(site) in step.grad_sites:
            return None  # non-reentrant: the original forward's signal is in the real graph
        step.grad_sites.add(id(site))
        gen = step.gen
        routed = attach_post_backward(args, kwargs, lambda: self._post_backward(site, gen))
        if routed is None:
            step.site_untokened.add(id(site))
        else:
            step.site_calls[id(site)] = step.site_calls.get(id(site), 0) + 1
        for g in site.groups:
            if routed is None:
                g.untokened = True
                step.group_untokened.add(g.index)
            else:
                g.tokens_pending += 1
                step.group_tokens[g.index] = step.group_tokens.get(g.index, 0) + 1
        return routed

    def _count_on_demand(self, g: GatherGroupRuntime, recompute: bool) -> None:
        if recompute or self._step.in_backward:
            self.stats.on_demand_backward += 1
            return
        if g.forward_window > 0 and self._order_learned:
            self.stats.on_demand_forward += 1
            if self.actions is not None:
                self.actions.deviation(f"gathered {g.label} on demand in forward")
            self.once.info(
                f"ondemand{g.index}",
                "autodist: gather group %d (%s) was needed before its planned prefetch (control flow "
                "changed, a parameter is shared with another unit, or the forward wrote its parameters "
                "after they were gathered) and was gathered on demand",
                g.index, g.label,
            )

    def _make_post_forward(self, site: ModuleSite):
        def post_forward(module: nn.Module, args: tuple, output: object) -> None:
            with outside_dispatch_modes():
                self._post_forward(site, output)

        return post_forward

    def _post_forward(self, site: ModuleSite, output: object) -> None:
        recompute = in_backward()
        for mp in site.swaps:
            mp.swap_out()
        for g in site.groups:
            g.active -= 1
            if recompute:
                continue  # its backward follows at once: the post-backward signal frees
            g.fwd_done.update(site.units)
            if g.residency == "after_forward" and g.active == 0 and g.index not in self._aside_held and freed_after_forward(
                g.units, g.fwd_done, g.fwd_expected, self.unit_pos, self._step.fwd_place
            ):
                g.free()
        if (site.groups or site.unit is not None) and torch.is_grad_enabled():
            tensors = [t for t in output_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                self.param_hooks.own(register_multi_grad_hook, tensors, self._make_pre_backward(site))
        if self._implicit is not None:
            self._implicit_exit(output)

    def _make_pre_backward(self, site: ModuleSite):
        def pre_backward(grads: object) -> None:
            self._on_backward_start()
            step = self._step
            if site.unit is not None:
                step.bwd_current = site.bwd_first if site.collapsed else site.unit
            if self.offload.active and site.unit is not None and step.sync:
                # only the synchronising backward brings state back for the step: under no_sync the
                # state stays on the host through every earlier micro-batch (the simulator's rule)
                keys = self.offload.back_at.get(f"backward:{site.unit}")
                if keys:
                    self.offload.copy_back(keys)
            if step.bwd_open:  # gathered for units left out: nothing reads them ([Note: freeing the groups of units left out])
                for g in step.bwd_open:
                    if not g.used:
                        g.free()
                step.bwd_open = [g for g in step.bwd_open if g.used]
            self._replay_left_out(site)
            if site.groups:
                self._catch_up(step.bwd_schedule, site, False)
            for g in site.groups:
                if g.ensure():
                    self._count_on_demand(g, True)
                step.bwd_schedule.done.add(g.index)
            if site.collapsed:
                # a recomputation inside the root, whatever runs it, reads the full parameters
                for mp in site.swaps:
                    mp.swap_in()
                step.bwd_swapped[id(site)] = step.bwd_swapped.get(id(site), 0) + 1
            if site.unit is not None:
                self._fire(step.bwd_schedule, step.bwd_fire.get(site.backward_unit or site.unit, -1))
            if site.sharded:
                self.reducer.poll()

        return pre_backward

    def _post_backward(self, site: ModuleSite, gen: int) -> None:
        """The backward of one forward call of ``site`` is complete (see backward.py)."""
        step = self._step
        if gen != step.gen:
            return  # a graph from an earlier step, backpropagated late: its groups were released
        step.site_done[id(site)] = step.site_done.get(id(site), 0) + 1
        if step.bwd_swapped.get(id(site)):
            step.bwd_swapped[id(site)] -= 1
            for mp in site.swaps:
                mp.swap_out()
        for g in site.groups:
            g.tokens_pending -= 1
            g.tokens_fired += 1
            self._maybe_free_after_backward(g)
        if site.sharded:
            self.reducer.poll()

    def _settled(self, mp: ManagedParam) -> bool:
        """No gradient for ``mp`` will arrive in this backward: every module that uses it has
        finished its backward (see [Note: settled parameters])."""
        step = self._step
        sites = self._sites_of_param.get(id(mp), ())

        # a unit left out settles at its place ([Note: units a forward left out]); under NCCL's
        # policy a unit that gathers nothing at the next place, where the ranks that ran it poll
        # its gradients (see _replay_left_out)
        later = 1 if self.launch_policy == "sampled" else 0

        def passed(site: ModuleSite) -> bool:
            return max((step.bwd_need.get(u, -1) + (0 if u in self._gathering else later) for u in site.units),
                       default=-1) <= step.bwd_reached

        if (self.launch_policy == "sampled" or self.plan.max_inflight_buckets is not None) and sites and not any(
            u in step.ran_units for site in sites for u in site.units
        ):
            # every unit using it was left out of this step's forwards: no signal is needed, only its
            # place (where a bound on the reductions in flight may have another rank wait for it)
            return all(passed(site) for site in sites)
        if self.launch_policy != "sampled" and not (sites and all(site.groups for site in sites)):
            # only sites that gather attach post-backward signals under the other policies: where
            # one does not, nothing says its backward finished
            return False
        for site in sites:
            key = id(site)
            if key in step.site_untokened:
                return False
            calls = step.site_calls.get(key, 0)
            if calls == 0 and not passed(site):
                return False
            if step.site_done.get(key, 0) < calls or calls < step.site_nograd.get(key, 0):
                return False
        return True

    def _maybe_free_after_backward(self, g: GatherGroupRuntime) -> None:
        """Free ``g`` if no backward computation will read its full parameters again this step."""
        if g.residency == "persistent" or g.state is GroupState.SHARDED or g.active or g.hold:
            return
        if self._step.create_graph:  # the graph this backward builds reads the full parameters
            return
        if g.tokens_pending > 0:
            return
        grads_done = g.all_trainable and g.n_trainable > 0 and g.grads_ready >= g.n_trainable
        if g.untokened and not grads_done:
            return  # a forward without a signal: its end is when all its gradients are in
        if g.tokens_fired == 0 and not grads_done:
            return
        g.free()

    def _learned_anchors(self, step: StepState) -> dict[str, str | None]:
        """The recomputation anchors the next backward prefetches by (see [Note: where a
        recomputation begins] in schedule.py), from this step's.

        [Note: anchors alike on every rank] An anchor is learned where the recomputation happened:
        the unit whose backward was running. That depends on which units the rank ran. A block the
        plan recomputes is recomputed when backward reaches the first of its units the rank ran:
        a rank that left the block's last unit out (an expert no token chose) anchored its units
        one unit later than the others, gathered them in another order, and the collective check
        raised (a mixture of experts with one group per expert and ``recompute: all``; under
        NCCL's launch policy with block groups too). So a unit of such a block recomputed at a
        unit of its own block is anchored at the block's first unit in backward order, from the
        learned order, which every rank shares (a rank that recomputes it later than that holds
        the gathered group a little longer; nothing is gathered on demand); one recomputed
        before the block's own backward (the block saved a tensor after its last unit) keeps the
        unit it was recomputed at. A unit the step left out keeps its anchor from before."""
        out = {u: a for u, a in self._anchors.items() if u not in step.ran_units}
        rule: dict[str, str] | None = None
        backward: list[str] | None = None
        for u, a in step.anchors.items():
            block = self._plan_block_of.get(u)
            if block is not None:
                rule = rule or self._block_anchors()
                if a is not None and self._plan_block_of.get(a) == block:
                    a = rule[u]
                else:  # recomputed before the block's own backward: the unit before it in backward order
                    backward = backward or backward_order(self.unit_order, self._module_of_unit)
                    i = backward.index(rule[u])
                    a = backward[i - 1] if i > 0 else None
            out[u] = a
        return out

    def _block_anchors(self) -> dict[str, str]:
        """Each unit of a block the plan recomputes -> the block's first unit in backward order,
        from the learned order (:func:`autodist.schedule.block_anchor`'s rule without a tail)."""
        blocks: dict[str, list[str]] = {}
        for u in self.unit_order:
            block = self._plan_block_of.get(u)
            if block is not None:
                blocks.setdefault(block, []).append(u)
        out = {}
        for units in blocks.values():
            first = block_anchor(units, self._module_of_unit)
            for u in units:
                out[u] = first
        return out

    def _backward_again(self) -> None:
        """[Note: several backward passes over one step's graphs] ``loss1.backward(retain_graph=True)``
        then ``loss2.backward()``; ``torch.autograd.grad(out, inputs, create_graph=True)`` then a
        backward through that gradient (StyleGAN's R1 penalty, input-gradient regularisers). The
        first backward's end released the gathered groups and flushed the reductions; the next one
        runs over the same graphs: each group expects its forwards' post-backward signals again and
        is gathered again on demand by its pre-backward hooks, parameters settle again, and the
        buckets take part again, as at a step's start, so its gradients are reduced and
        accumulated onto the first one's (a reduction is linear: the same as reducing their sum,
        as FSDP2 does). Under a plan that shards, the second backward read parameters the first
        had freed (R1 failed in backward; a second ``backward`` raised on a late gradient)."""
        step = self._step
        for g in self.groups:
            g.tokens_pending = step.group_tokens.get(g.index, 0)
            g.tokens_fired = 0
            g.grads_ready = 0
            g.hold = False
            g.untokened = g.index in step.group_untokened
        step.site_done = {}
        step.ready_set = set()
        step.ready_order = []
        step.bwd_swapped = {}
        self.reducer.begin(sync=step.sync)
        for b in self.reducer.buckets:
            b.release_if_unused()

    def _root_pre_backward(self, grads: object) -> None:
        self._on_backward_start()

    def _on_backward_start(self) -> None:
        step = self._step
        if step.in_backward:
            return
        if step.backwards:
            self._backward_again()
        step.backwards += 1
        step.in_backward = True
        self.param_hooks.scan()  # before autograd reaches a leaf: a hook registered since the forward
        step.create_graph = torch.is_grad_enabled()  # autograd runs a create_graph backward with grad on
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._swap_root(True)
        # Backward order: reverse of the order the forwards finished in; recomputed units are first
        # needed at their anchor (see [Note: prefetch triggers] and [Note: nested units] in
        # autodist/schedule.py). Of the learned order, with the units this rank's forwards left out
        # in their places, so that every rank gathers alike ([Note: units a forward left out]).
        step.bwd_need = backward_positions(self.unit_order, self._anchors, self._gathering, self._module_of_unit)
        step.bwd_fire = group_fire_positions(step.bwd_need, self._candidate_units)
        late = [g for g in self.groups if g.residency == "after_forward"]
        trig = triggers([g.units for g in late], [g.backward_window for g in late], step.bwd_need)
        step.bwd_reached = -1
        step.bwd_open = []
        step.bwd_units_at = {}
        for u, p in step.bwd_need.items():
            if u not in step.ran_units:
                step.bwd_units_at.setdefault(p, []).append(u)
        step.bwd_schedule = TriggerCursor([replace(t, group=late[t.group].index) for t in trig])
        self._fire(step.bwd_schedule, -1)  # the start of backward, whichever hook saw it first
        # Parameters used by several forwards, one of them without gradients (reentrant activation
        # checkpointing), accumulate their gradient once per recomputed region: reduce them at the
        # end of backward, when their gradient is final.
        step.deferred = {i for i in step.nograd_uses if step.uses.get(i, 0) > 1}
        if step.sync:
            self.reducer.attach_views(step.deferred)

    def _make_grad_hook(self, mp: ManagedParam):
        # Runs once per parameter per backward, from C++, on the thread that issues the step's
        # kernels: on a model of many small layers its Python is step time on a GPU. What does not
        # change over the parameter's life is looked up here, once.
        group = self.group_of_param.get(id(mp))
        name, key = mp.name, id(mp)
        reduce_dtype = self.reduce_dtype(mp)
        stash = reduce_dtype if mp.needs_swap and reduce_dtype != mp.compute_dtype else None

        def on_grad_ready(param: torch.Tensor) -> None:
            step = self._step
            if not step.in_backward:
                self._on_backward_start()
            ready = step.ready_set
            first = key not in ready
            if first:
                ready.add(key)
                step.ready_order.append(name)
                if group is not None:
                    group.grads_ready += 1
                    self._maybe_free_after_backward(group)
            else:
                self.stats.late_gradients += 1
            reducer = self.reducer
            entry = reducer.slot.get(key)
            if entry is not None and entry[0].taking:
                reducer.take(entry, mp, first, key in step.deferred)
            elif stash is not None and not step.sync:
                mp.stash_full_grad(stash)  # accumulate over micro-batches in the reduce dtype

        return on_grad_ready

    # ------------------------------------------------------------------------------------------
    # end of backward
    # ------------------------------------------------------------------------------------------
    def _end_backward(self) -> None:
        step = self._step
        self._swap_root(False)
        if self.observer is not None:
            self.observer.backward_end()
        with profiled_range("autodist::end_backward"):
            # a backward that built a graph of its own (create_graph: an input-gradient penalty)
            # keeps the groups gathered: that graph reads the full parameters, and the backward
            # through it is still to come ([Note: several backward passes over one step's graphs])
            keep = step.create_graph and bool(self.groups)
            # the places a backward left out last: of groups with something to train (a frozen
            # backbone that no backward reaches, on any rank, is not gathered for nothing)
            self._fire(step.bwd_schedule, math.inf, trained=True)
            # without sync, only units accumulating sharded gradients reduce (every micro-batch)
            missing = self.reducer.flush() if step.sync or self.reducer.active else []
            late_here = None
            if self.reducer.late:
                # a parameter settled as unused got its gradient after all ([Note: one issue order
                # for NCCL]): every rank raises, from the collective check, before an optimizer step
                late = sorted(set(self.reducer.late))
                if self.comm.world_size == 1 or not (self.groups and self.check_collectives):
                    late_here = LATE_GRADIENT.format(names=", ".join(map(repr, late)), where="")
                else:
                    self.comm.sequence.record("late_gradient", f"{','.join(late)}@{self.comm.rank}")
            hooked = self._user_post_hooked(step) if self.param_hooks.post else []
            if step.sync:
                if missing and step.ready_order:  # a backward to the inputs only computes no parameter's
                    self.stats.unused_param_steps += 1
                    self.once.info(
                        "unused",
                        "autodist: %d parameter(s) got no gradient on this rank (e.g. %s); their buckets "
                        "were flushed at the end of backward and globally unused ones keep grad=None",
                        len(missing), missing[0],
                    )
                if step.ready_order:
                    maybe_rebuild_buckets(self, step.ready_order)
            if not keep:
                self._release_after_step(drop_reductions=False)
            self._anchors = self._learned_anchors(step)
        if self._probing:
            self._settle_probes()
        if step.backwards == 1:  # a further backward over the same forwards is no new micro-batch
            self.stats.steps += 1
            self.stats.micro_batches += 1
        step.expects_backward = keep
        step.in_backward = False
        if self.groups and self.check_collectives:
            # on the CPU the divergent step raises from its own backward; on a GPU the comparison runs
            # on the host beside the optimizer step and the next forward reports it
            self.comm.check_sequence(interleaving=self.launch_policy == "sampled", wait=self.device.type == "cpu")
        if late_here is not None:  # once the runtime is as after any backward
            raise RuntimeError(late_here)
        # last in the backward: an optimizer stepped in a hook finds the runtime as after any backward
        for mp in hooked:
            self.param_hooks.fire(mp)

    def _user_post_hooked(self, step: StepState) -> list[ManagedParam]:
        """The parameters with post-accumulate hooks of the user's whose visible ``.grad`` this
        backward gave a gradient: reduced in it (on every rank alike; in a ``no_sync`` backward, the
        buckets of units accumulating sharded gradients), or accumulated locally into a leaf that is
        the visible parameter (or shown as its ``.grad``) in a ``no_sync`` backward ([Note: hooks on
        the visible parameters] in user_hooks.py). Read once the buckets are finished, before they are rebuilt."""
        slots = self.reducer.slot
        out = []
        for mp in self.param_hooks.post:
            entry = slots.get(id(mp))
            if entry is not None and entry[0].taking:
                got = entry[0].used[entry[1]]
            else:
                # a leaf that is the visible parameter, or a compute copy's accumulator shown as its
                # .grad ([Note: gradients accumulated without sync, shown] in params.py)
                got = (mp.full is mp.visible or mp._accum_shown) and id(mp) in step.ready_set
            if got:
                out.append(mp)
        return out

    def _release_after_step(self, *, drop_reductions: bool) -> None:
        if drop_reductions:
            self.reducer.reset()
        for g in self.groups:
            if g.residency != "persistent":
                g.free()
            else:
                g.quiesce()  # see [Note: a first use a rank left out]
            g.reset_step()
        for mp in self._swapping:
            mp.reset_swaps()

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor the runtime holds between steps (for memory accounting)."""
        out: list[torch.Tensor] = []
        for mp in self.params.values():
            out.append(mp.local)
            if mp.full is not mp.visible:
                out.append(mp.full)
            if mp.shard_flat is not None:
                out.append(mp.shard_flat)
        out += [b.buffer for b in self.reducer.buckets]
        # gathers in flight across the step boundary (persistent refreshes) hold their receive buffers
        out += [t for g in self.groups for f in g.in_flight() for t in f.buffers]
        return out

    def quiesce(self) -> None:
        """Wait for every gather in flight (they read the shards): call before writing shards."""
        for g in self.groups:
            g.quiesce()

    def mark_stale(self) -> None:
        """Parameters were overwritten in place (a state dict was loaded): re-gather (compute copies
        are cast at every forward anyway)."""
        for g in self.groups:
            g.mark_stale()

    def full_param_bytes_gathered(self) -> int:
        return sum(g.full_bytes for g in self.groups if g.state is not GroupState.SHARDED)
