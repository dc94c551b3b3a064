"""One step's schedule: the rules that decide, from a plan and the order units run in, when each gather
group is gathered and freed, what a recomputation needs, and in which order buckets are reduced.
The runtime (``autodist/runtime/engine.py``) carries these rules out at its hooks; the simulator
(``autodist/cost/simulator.py``; its compiler in ``autodist/cost/sim/emit.py``) times the same
rules — each rule is written once, here (DistIR's explicit program). Both also write the actions they take in one vocabulary (:class:`ActionLog`), so
a test can check that what ran is what was simulated.

[Note: prefetch triggers] A gather group with window ``w`` is issued when the gathering unit ``w``
positions before its first use starts (position -1 is the start of the root forward or of the
backward). Positions count *gathering* units only — the units of gather groups that are gathered
each step, not persistent ones — so a replicated or persistent unit that one rank skips (a
rank-dependent branch) moves no other unit's position: every other unit keeps its position on every
rank, and each rank issues the same gathers in the same order. A unit that is not counted carries
the position of the last gathering unit before it, and fires nothing that unit did not. (FSDP2
counts the same way: it prefetches among FSDP modules only.) Forward positions follow the previous
step's observed unit order (the plan's order before the first step; a unit the forward left out
keeps its place: [Note: units a forward left out]). Backward positions follow the reverse of the
order forwards finish in, in that learned order ([Note: nested units]), except that a unit whose
forward is recomputed is first needed where that recomputation happens (its *anchor*: the unit
whose backward is running then — the last unit of a checkpointed block). Triggers fire in position
order, so the issue order is a function of the plan and the learned order, identical on every rank
whose sharded units run in one order. The simulator visits every position and never passes a
trigger over; the runtime issues a group whose first use is already behind when its trigger fires
(its units were left out on this rank), where the other ranks issued it.

[Note: nested units] A unit's module may call other units' modules inside its own forward (a
ConvNeXt block owns its layer scale and calls its convolution and MLP; a ViT's root owns the class
token and position embedding and calls every block). Its forward then starts before theirs and
finishes after them, and its backward begins first (its output's gradient arrives before theirs)
and ends last (its input's gradient after theirs). So the order backward passes *begin* in, which
backward prefetch positions count, is the reverse of the order forwards *finish* in, not of the order
they start in; a group is freed after forward when its units' forwards have finished, and after
backward when their backward passes have ended. The order forwards finish in is derived from the
order they start in and the module names (a unit encloses the units after it whose modules are its
module's descendants), by the runtime and the simulator alike. A parameter of an enclosing unit used
just before it calls another (a ViT's position embedding, added before the first block) gets its
gradient after that unit's backward has ended, not during it. Where a model calls a descendant
from outside its parent's forward, the derived order is wrong only for prefetch timing: nothing
is freed before its forward or backward has finished, whatever the order.

[Note: where a recomputation begins] Non-reentrant checkpointing recomputes a block the first time
backward unpacks a tensor its forward saved. That is in the backward of the first of its units
backward reaches — its last unit in forward order, or the unit that encloses the others — unless
the block's own code saves a tensor after its last unit has finished (a residual block's final
ReLU): that tensor is needed first, before any of its units' backward begins, while the backward
of the unit before it in backward order (the next one in forward order) has just ended. The
profile records which blocks save so (``Profile.block_tail_saves``); the runtime learns each
anchor from the step before (``Engine._anchors``; for the plan's blocks it starts from this rule
without a tail and keeps the rule's form, so that every rank anchors alike: [Note: anchors alike
on every rank] in engine.py) and the simulator takes it from this rule.

[Note: memory windows] A plan may ask for a window of ``"memory"``: prefetch as far ahead as the
budget allows. Before a step runs, each such group gets the longest window (at most
``MAX_MEMORY_WINDOW``) for which it and the groups before it fit in half of what the budget leaves
after the resident state (parameters, gradients and two optimizer-state tensors per parameter, as
held locally, and the full tensors of persistent groups); the other half is for activations. The
rule sees only figures every rank shares (padded shard sizes, the agreed budget), so every rank
issues the same gathers in the same order.

[Note: offload anchors] An offloaded optimizer-state tensor (a ``(param, state)`` key: this
rank's local part, flattened) is copied out at the anchor its fragments name in ``out_after`` —
``"step"`` (right after the optimizer step) or ``"forward:<unit>"`` (when that unit's forward
begins) — and copied back at the one they name in ``back_from``: ``"backward:<unit>"`` (when that
unit's backward begins) or ``"step"`` (just before the step). A tensor with several fragments moves
as one, its offloaded ranges those of all its fragments: at the first of their anchors the step
reaches (an anchor lists it once; a later one finds it already moved). The runtime (``runtime/offload.py``) and the simulator take both from
:func:`offload_anchors`.

[Note: hooks per gather group] A gather group whose units are exactly the units under one module
(the group's *root*: their deepest common ancestor — a transformer block the built-in ``fsdp``
plan groups by) is enacted at that module alone, as FSDP2 enacts a ``fully_shard`` module: one
forward pre/post hook pair, one pre-backward hook and one post-backward signal per group instead of
per unit; the group's parameters are swapped in for the root's whole forward and again for its
backward (so a recomputation inside it, of any kind, reads them). Per-unit hooks cost more host time
per step than a small layer's kernels. A group qualifies when nothing outside the root reads its
parameters (tied or functional uses), nothing inside reads another group's, the plan recomputes no
block inside, at or around the root (its hooks would not see the recomputation of its units), and
no offloaded state is anchored at its units. Such a group's prefetch triggers fire where the root's
forward (backward) begins, at the last position of its units (:func:`group_fire_positions`): the
prefetches planned inside the group start at its beginning. A module inside the root called from
outside the root's forward finds the visible (sharded) parameters, as under FSDP2.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .plan import OffloadFragment, Plan
from .structure import ModelStructure


@dataclass(frozen=True)
class Trigger:
    """Issue gather group ``group`` when position ``at`` is reached; it is first used at ``first``."""

    at: int
    first: int
    group: int


def triggers(
    group_units: Sequence[Sequence[str]], windows: Sequence[int], pos: dict[str, int], *, missing: int | None = None
) -> list[Trigger]:
    """The prefetch triggers of groups whose units have positions ``pos`` (units without one are
    skipped; ``missing``: the position to assume for them instead, e.g. after every known unit)."""
    out = []
    for gi, units in enumerate(group_units):
        firsts = [pos[u] for u in units if u in pos]
        if not firsts:
            if missing is None:
                continue
            firsts = [missing]
        first = min(firsts)
        out.append(Trigger(max(first - windows[gi], -1), first, gi))
    out.sort(key=lambda t: (t.at, t.first, t.group))
    return out


MAX_MEMORY_WINDOW = 8


def memory_windows(group_bytes: Sequence[int], resident_bytes: int, budget_bytes: int | None) -> list[int]:
    """The window a ``"memory"`` prefetch of each gather group gets (see [Note: memory windows]):
    ``group_bytes`` are the groups' full (gathered) sizes in plan order, ``resident_bytes`` what
    stays allocated between steps (:func:`resident_state_bytes`)."""
    headroom = max(0, (budget_bytes or 0) - resident_bytes) // 2
    out = []
    for gi in range(len(group_bytes)):
        w = 1
        while w < MAX_MEMORY_WINDOW and gi - w >= 0 and sum(group_bytes[gi - w : gi + 1]) <= headroom:
            w += 1
        out.append(w)
    return out


def resident_state_bytes(local_param_bytes: Sequence[int], persistent_full_bytes: Sequence[int]) -> int:
    """What the [Note: memory windows] rule counts as resident: each parameter's local storage
    (its padded shard, or the whole tensor when replicated) four times — the parameter, its
    gradient, two optimizer-state tensors — and the full tensors persistent groups keep."""
    return 4 * sum(local_param_bytes) + sum(persistent_full_bytes)


class TriggerCursor:
    """Walks the triggers in position order: ``fire(pos)`` returns the groups to issue now, passing
    over those whose first use ``pos`` has passed (the simulator visits every position: such a
    group was gathered on demand). :meth:`fire_all` returns those too, for the runtime, which
    issues each group once per pass (``done``: the groups issued in this one) to keep the ranks'
    collectives alike ([Note: units a forward left out])."""

    def __init__(self, trig: list[Trigger]) -> None:
        self.trig = trig
        self.next = 0
        self.done: set[int] = set()

    def fire(self, pos: int) -> list[int]:
        return [g for g, passed in self.fire_all(pos) if not passed]

    def fire_all(self, pos: float, before: float | None = None) -> list[tuple[int, bool]]:
        """Every group whose trigger ``pos`` reaches, with whether its first use has passed (lies
        before ``before``, by default ``pos``)."""
        out = []
        limit = pos if before is None else before
        while self.next < len(self.trig) and self.trig[self.next].at <= pos:
            t = self.trig[self.next]
            self.next += 1
            out.append((t.group, t.first < limit))
        return out


def positions(order: Sequence[str], counted: Collection[str]) -> dict[str, int]:
    """Each unit's prefetch position in ``order`` (see [Note: prefetch triggers]): a ``counted``
    (gathering) unit's index among the counted units; any other unit, the position of the last
    counted unit before it (-1 before the first)."""
    out: dict[str, int] = {}
    n = -1
    for u in order:
        if u in counted:
            n += 1
        out.setdefault(u, n)
    return out


def merged_order(previous: Sequence[str], ran: Sequence[str]) -> list[str]:
    """The unit order prefetch follows after a forward that ran ``ran`` (each unit once, in the
    order they started), given the order it followed before.

    [Note: units a forward left out] The units ``ran`` leaves out keep their place: each stays
    right after the unit that preceded it in ``previous`` and ran. A unit some ranks skip (a
    mixture-of-experts layer that routed no token to one expert, a branch taken on some ranks)
    then keeps every rank's positions, triggers and so collectives alike: appended at the end, as
    it was, it moved the positions of the rank that skipped it only, which gathered its groups in
    another order than the other ranks from the next step on (gloo timed out; NCCL hangs).

    The runtime keeps the rest alike too. Its gathers are issued in trigger order, each group once
    per pass (a forward, a backward): before a unit gathers its own groups, the triggers it would
    have passed over are fired (:meth:`TriggerCursor.fire_all`: a rank that skipped a unit gathers
    that unit's group where the others did, in the same order), and at the end of each pass the
    triggers left. A group gathered only to keep the order is freed once its place has passed,
    as is a prefetched group whose units were passed over ([Note: freeing the groups of units left
    out] in engine.py), so a step that leaves units out holds no more than one that runs them all.
    Its bucket is launched at the
    event that settles its missing gradients ([Note: settled parameters] in engine.py), which also
    holds under ``"ready"``. Backward positions come from this order, not from the units this
    rank's forward ran. What remains rank-dependent: a group gathered again for a second use
    (a module called twice) that some ranks make and others do not; the end-of-backward check of
    the collective sequence reports it (comm.py)."""
    seen = set(ran)
    after: dict[str | None, list[str]] = {}
    anchor: str | None = None
    for u in previous:
        if u in seen:
            anchor = u
        else:
            after.setdefault(anchor, []).append(u)
    out = list(after.get(None, ()))
    for u in ran:
        out.append(u)
        out.extend(after.get(u, ()))
    return out


def gathering_units(group_units: Sequence[Sequence[str]], residencies: Sequence[str]) -> set[str]:
    """The units prefetch positions count (see [Note: prefetch triggers]): those of gather groups
    gathered every step (``residencies``: each group's; persistent groups stay gathered)."""
    return {u for units, r in zip(group_units, residencies, strict=True) if r != "persistent" for u in units}


def finish_order(forward_sequence: Sequence[str], module_of: dict[str, str]) -> list[str]:
    """The order in which units finish their forward, given the order they start it (see [Note:
    nested units]); ``module_of``: unit -> its module's name ("" for the root)."""
    out: list[str] = []
    open_: list[str] = []  # started and not finished, each enclosing the next
    for u in forward_sequence:
        m = module_of.get(u, u)
        while open_ and not encloses(module_of.get(open_[-1], open_[-1]), m):
            out.append(open_.pop())
        open_.append(u)
    out.extend(reversed(open_))
    return out


def encloses(parent: str, module: str) -> bool:
    """Whether module ``parent``'s forward encloses the forward of module ``module`` (a descendant)."""
    return parent == "" or module.startswith(parent + ".")


def backward_order(forward_sequence: Sequence[str], module_of: dict[str, str]) -> list[str]:
    """The order units' backward passes begin in (the reverse of the order their forwards finish);
    each ends in the reverse of the order the forwards started (see [Note: nested units])."""
    return list(reversed(finish_order(forward_sequence, module_of)))


def backward_positions(
    forward_sequence: Sequence[str], anchors: Mapping[str, str | None], counted: Collection[str], module_of: dict[str, str],
    *, backward: Sequence[str] | None = None,
) -> dict[str, int]:
    """The position where each unit's parameters are first needed in the backward of a forward
    that ran ``forward_sequence``: where its own backward begins (positions of :func:`positions`
    over the ``counted`` units in :func:`backward_order`), or its anchor's when earlier;
    ``anchors``: recomputed unit -> the unit whose backward runs when it is recomputed (``None``:
    the start of backward). ``backward``: :func:`backward_order` of the sequence, where the caller
    has it already."""
    bpos = positions(backward_order(forward_sequence, module_of) if backward is None else backward, counted)
    need = dict(bpos)
    for u, anchor in anchors.items():
        if u in need:
            a = -1 if anchor is None else bpos.get(anchor, need[u])
            need[u] = min(need[u], a)
    return need


def block_anchor(block_units: Sequence[str], module_of: dict[str, str], backward: Sequence[str] | None = None) -> str:
    """The unit whose backward runs when the plan's recomputation of a block happens (see [Note:
    where a recomputation begins]): ``block_units`` in forward order; ``backward``: the model's
    :func:`backward_order` when the block's own code saves a tensor after its last unit."""
    first = backward_order(block_units, module_of)[0]
    if backward is None or first not in backward:
        return first
    i = backward.index(first)
    return backward[i - 1] if i > 0 else first



def _common_module(names: Sequence[str]) -> str:
    """The deepest module enclosing every module of ``names`` ("" for the root)."""
    parts = [n.split(".") if n else [] for n in names]
    common: list[str] = []
    for level in zip(*parts):
        if any(x != level[0] for x in level):
            break
        common.append(level[0])
    return ".".join(common)


def collapsed_groups(plan: Plan, structure: ModelStructure, *, memo: dict | None = None) -> dict[int, str]:
    """Gather group index -> its root module, for the groups enacted at one module (see [Note:
    hooks per gather group]). ``memo``: where a caller that asks for many plans of one model keeps
    what the structure alone decides for each group, by its units (a pass over every unit and
    parameter); the plan's recomputed blocks are checked against it each time."""
    anchored = {a.split(":", 1)[1] for f in plan.offload for a in (f.out_after, f.back_from) if ":" in a}
    module_of: dict[str, str] | None = None
    out: dict[int, str] = {}
    for gi, g in enumerate(plan.gather_groups):
        units = set(g.units)
        if len(units) < 2 or units & anchored:
            continue
        key = ("collapsed group", tuple(g.units))
        if memo is not None and key in memo:
            root = memo[key]
        else:
            if module_of is None:
                module_of = {u.name: u.module_name for u in structure.units}
            root = _structural_root(g.units, structure, module_of)
            if memo is not None:
                memo[key] = root
        if root is not None and not _recomputed_across(root, plan.recompute):
            out[gi] = root
    return out


def _recomputed_across(root: str, recompute: Sequence[str]) -> bool:
    """Whether a recomputed block encloses the module ``root`` or lies within it (the group is then
    not enacted at ``root``: see [Note: hooks per gather group])."""
    return any(encloses(b, root) or b == root or encloses(root, b) for b in recompute)


def _structural_root(group_units: Sequence[str], structure: ModelStructure, module_of: dict[str, str]) -> str | None:
    """The module a gather group of ``group_units`` (two or more, no offload anchored at them) is
    enacted at as far as the model's structure decides, whatever the plan recomputes, or None (see
    [Note: hooks per gather group])."""
    units = set(group_units)
    if any(u not in module_of for u in units):
        return None
    root = _common_module([module_of[u] for u in group_units])

    def inside(m: str) -> bool:
        return m == root or encloses(root, m)

    if any(inside(m) != (u in units) for u, m in module_of.items()):
        return None  # another group's unit lies under the root, or the root's units are not all here
    unit_of_param = structure.unit_of_param
    for pname, info in structure.params.items():
        ours = unit_of_param[pname] in units
        if any(inside(m) != ours for m, _ in info.sites):
            return None  # read through a module on the other side of the root's boundary
    for m, used in structure.functional_uses.items():
        if any(inside(m) != (u in units) for u in used):
            return None
    return root


def group_fire_positions(pos: Mapping[str, int], groups: Iterable[Sequence[str]]) -> dict[str, int]:
    """``pos`` with every unit of each of ``groups`` (collapsed groups' units) at the group's last
    position: where the group's root fires (see [Note: hooks per gather group])."""
    out = dict(pos)
    for units in groups:
        known = [pos[u] for u in units if u in pos]
        if known:
            top = max(known)
            for u in units:
                if u in out:
                    out[u] = top
    return out

def freed_after_forward(
    group_units: Sequence[str], done: set[str], expected: set[str],
    pos: Mapping[str, int] | None = None, reached: int = -1,
) -> bool:
    """An ``after_forward`` group is freed once every ``expected`` unit of it has finished its
    forward, or (the runtime: ``pos``, the units' forward positions) lies before ``reached``, the
    furthest place the forward has reached: a unit the forward passed over was left out ([Note:
    units a forward left out]). The runtime expects every unit: freed after the units one rank
    ran, a group whose other unit then ran was gathered again on demand, on the ranks that ran it
    only. The simulator, which leaves nothing out, passes no ``pos``."""
    if pos is None:
        return all(u in done for u in group_units if u in expected)
    return all(u in done or pos.get(u, reached) < reached for u in group_units if u in expected)


def launchable(buckets_pending: Sequence[int], next_launch: int) -> int:
    """How many buckets can launch now, from ``next_launch``: buckets launch in index order, each
    once all of its gradients are in (``pending`` 0) — so every rank issues them in the same order."""
    n = 0
    while next_launch + n < len(buckets_pending) and buckets_pending[next_launch + n] == 0:
        n += 1
    return n


@dataclass
class ActionLog:
    """The actions of a step in one vocabulary for the runtime and the simulator: ``("gather",
    group units label)``, ``("free", label)``, ``("recompute", block)``, ``("reduce", bucket index)``,
    ``("refresh", label)``, ``("copy_out", "param/state")``, ``("copy_back", "param/state")`` (an
    offloaded optimizer-state tensor leaving or returning to the device). ``deviations`` counts units that ran other than planned (control flow)."""

    actions: list[tuple[str, str]] = field(default_factory=list)
    deviations: list[str] = field(default_factory=list)

    def add(self, kind: str, what: object) -> None:
        self.actions.append((kind, str(what)))

    def deviation(self, what: str) -> None:
        self.deviations.append(what)


def group_label(units: Sequence[str]) -> str:
    return units[0] if len(units) == 1 else f"{units[0]}..{units[-1]}"


Recorder = Callable[[str, object], None]


StateKey = tuple[str, str]  # (parameter name, optimizer-state name): one offloaded state tensor


@dataclass
class OffloadAnchors:
    """A plan's offload fragments by anchor ([Note: offload anchors]): ``out_at`` and ``back_at``
    map an anchor (``"step"``, ``"forward:<unit>"``, ``"backward:<unit>"``) to the state tensors
    copied out or back there, in plan order, each once; ``ranges`` maps each state tensor to its
    fragments' ``[start, end)`` ranges as the plan gives them (unclipped, unmerged)."""

    out_at: dict[str, list[StateKey]] = field(default_factory=dict)
    back_at: dict[str, list[StateKey]] = field(default_factory=dict)
    ranges: dict[StateKey, list[tuple[int, int]]] = field(default_factory=dict)


def offload_anchors(fragments: Iterable[OffloadFragment]) -> OffloadAnchors:
    """Where each state tensor of ``fragments`` is copied out and back ([Note: offload anchors])."""
    out = OffloadAnchors()
    for f in fragments:
        key = (f.param, f.state)
        out.ranges.setdefault(key, []).append((f.fragment[0], f.fragment[1]))
        leaving = out.out_at.setdefault(f.out_after, [])
        if key not in leaving:
            leaving.append(key)
        returning = out.back_at.setdefault(f.back_from, [])
        if key not in returning:
            returning.append(key)
    return out
