"""The runtime's state records: what one module's forward hooks do (:class:`ModuleSite`), the state
of one forward/backward (:class:`StepState`) and the counters the engine keeps
(:class:`RuntimeStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..schedule import TriggerCursor
from .gather import GatherGroupRuntime
from .params import ManagedParam


@dataclass
class ModuleSite:
    """What one module's forward hooks do: which parameters to swap and which groups to gather."""

    module: nn.Module
    name: str
    unit: str | None  # the unit this module owns, if any
    swaps: list[ManagedParam]
    groups: list[GatherGroupRuntime]
    units: list[str]  # units whose parameters this module uses (own first)
    params: list[ManagedParam]  # every managed parameter it uses (gradient multiplicity)
    # the root of a gather group enacted at one module ([Note: hooks per gather group] in
    # autodist/schedule.py): ``units`` are the group's, ``bwd_first`` the one whose backward begins first
    collapsed: bool = False
    bwd_first: str | None = None
    probe_root: str | None = None  # a candidate group's root, while probed ([Note: probing the group roots])
    # the unit whose backward position fires backward prefetch, if not ``unit`` (a compiled block:
    # its first unit; see [Note: hooks at a compiled block's boundary] in compiled.py)
    backward_unit: str | None = None

    @property
    def sharded(self) -> bool:
        return bool(self.groups)


@dataclass
class StepState:
    """State of one forward/backward (a micro-batch)."""

    gen: int = 0  # distinguishes this step's post-backward signals from stale ones
    sync: bool = True
    grad: bool = True
    fwd_sequence: list[str] = field(default_factory=list)  # the units the latest forward ran, in order
    seen_units: set[str] = field(default_factory=set)
    fwd_schedule: TriggerCursor = field(default_factory=lambda: TriggerCursor([]))
    in_backward: bool = False
    bwd_schedule: TriggerCursor = field(default_factory=lambda: TriggerCursor([]))
    bwd_need: dict[str, int] = field(default_factory=dict)  # first backward use (recomputation anchors)
    bwd_fire: dict[str, int] = field(default_factory=dict)  # where each unit's backward fires prefetch
    bwd_units_at: dict[int, list[str]] = field(default_factory=dict)  # the units a forward left out, at each backward position
    bwd_reached: int = -1  # the backward position the latest pre-backward event reached
    ran_units: set[str] = field(default_factory=set)  # the units any forward of this step ran
    # [Note: freeing the groups of units left out] in engine.py: the furthest forward place the
    # latest forward reached, the after_forward groups it gathered, and the groups a backward
    # gathered whose units no forward of this step ran
    fwd_place: int = -1
    fwd_open: list[GatherGroupRuntime] = field(default_factory=list)
    bwd_open: list[GatherGroupRuntime] = field(default_factory=list)
    # [Note: a first use a rank left out] in engine.py: (its first unit's index in the order, its
    # place, group) of each group a forward trigger issued or found gathered before its place, a heap
    first_uses: list[tuple[int, int, int]] = field(default_factory=list)
    bwd_current: str | None = None  # the unit whose backward is running
    anchors: dict[str, str | None] = field(default_factory=dict)  # recomputed unit -> anchor, this step
    ready_order: list[str] = field(default_factory=list)
    ready_set: set[int] = field(default_factory=set)  # managed param ids whose gradient arrived
    expects_backward: bool = False
    grad_sites: set[int] = field(default_factory=set)  # sites that ran forward with gradients
    uses: dict[int, int] = field(default_factory=dict)  # managed param id -> forward uses this step
    nograd_uses: set[int] = field(default_factory=set)  # ... used in a no-grad forward (reentrant AC)
    site_calls: dict[int, int] = field(default_factory=dict)  # site id -> forwards with gradients
    site_done: dict[int, int] = field(default_factory=dict)  # site id -> post-backward signals fired
    site_untokened: set[int] = field(default_factory=set)  # sites with a forward that had no signal
    # site id -> no-grad forwards ([Note: settled parameters] in engine.py)
    site_nograd: dict[int, int] = field(default_factory=dict)
    deferred: set[int] = field(default_factory=set)  # managed param ids reduced at the end of backward
    bwd_swapped: dict[int, int] = field(default_factory=dict)  # collapsed site id -> backward swap-ins open
    # backward passes over this step's graphs so far, and what its forwards attached for each:
    # group index -> post-backward signals, groups with a forward that had none ([Note: several
    # backward passes over one step's graphs] in engine.py)
    backwards: int = 0
    create_graph: bool = False  # the backward running (or last run) builds a graph of its own
    group_tokens: dict[int, int] = field(default_factory=dict)
    group_untokened: set[int] = field(default_factory=set)


@dataclass
class RuntimeStats:
    steps: int = 0
    order_deviations: int = 0
    on_demand_forward: int = 0
    on_demand_backward: int = 0
    recomputations: int = 0  # forwards of managed units run again in backward (any checkpointing)
    recomputed_blocks: int = 0  # forwards of blocks the plan recomputes, run again in backward
    plan_switches: int = 0
    unused_param_steps: int = 0
    persistent_refreshes: int = 0
    late_gradients: int = 0  # gradients accumulated again after their first (shared + reentrant AC)
    joined_forwards: int = 0  # forwards that joined a step whose backward had not begun (several before one)
    micro_batches: int = 0  # backward passes since the last optimizer step over these parameters
    grad_accum_steps: int = 0  # backward passes between the last two optimizer steps (0: none yet)
