"""Built-in plans: the DDP, FSDP and ZeRO-2 conventions written as plans, and the plan-construction
rules they use (bucketing by size, grouping by block).

They are user-selectable baselines (``plan="ddp"``), seeds for the search (``sched/space.py`` turns
them into genomes), and the runtime's bucket rebuild — the one place these rules are written.
"""

from __future__ import annotations

from collections.abc import Sequence

from .plan import Bucket, BucketRebuild, GatherGroup, Plan, Prefetch, UnitPlan
from .structure import ModelStructure

# torch DDP's defaults (torch/nn/parallel/distributed.py: bucket_cap_mb=25, first bucket 1 MiB).
DDP_BUCKET_CAP_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_CAP_BYTES = 1024 * 1024

BUILTIN_PLANS = ("ddp", "fsdp", "zero2")


def bucket_by_size(
    order: Sequence[str],
    structure: ModelStructure,
    *,
    cap_bytes: int = DDP_BUCKET_CAP_BYTES,
    first_cap_bytes: int = DDP_FIRST_BUCKET_CAP_BYTES,
    op: str = "all_reduce",
) -> list[Bucket]:
    """DDP's bucket assignment: walk ``order`` and close a bucket once it reaches its cap.

    The first bucket closes at ``first_cap_bytes`` so communication starts early; later ones at
    ``cap_bytes``. Parameters of different dtypes never share a bucket.
    """
    open_: dict[object, tuple[list[str], int]] = {}
    closed: list[list[str]] = []
    n_closed = 0
    for name in order:
        info = structure.params[name]
        key = info.dtype
        members, size = open_.get(key, ([], 0))
        members.append(name)
        size += info.nbytes
        cap = first_cap_bytes if n_closed == 0 else cap_bytes
        if size >= cap:
            closed.append(members)
            n_closed += 1
            open_.pop(key, None)
        else:
            open_[key] = (members, size)
    closed.extend(m for m, _ in open_.values())
    # Launch order: a bucket goes as soon as its earliest-ready gradient's bucket is due.
    position = {n: i for i, n in enumerate(order)}
    closed.sort(key=lambda ms: min(position[m] for m in ms))
    return [Bucket(params=ms, op=op, nbytes=sum(structure.params[m].nbytes for m in ms)) for ms in closed]


def _units(structure: ModelStructure, placement: str, residency: str) -> list[UnitPlan]:
    out = []
    for u in structure.units:
        pl = placement
        if pl == "shard" and any(len(structure.params[p].shape) == 0 for p in u.params):
            pl = "replicate"  # 0-d parameters cannot be sharded on dim 0
        out.append(UnitPlan(name=u.name, params=list(u.params), placement=pl, residency=residency))
    return out


def ddp_plan(
    structure: ModelStructure, world_size: int, *, ready_order: Sequence[str] | None = None,
    cap_bytes: int = DDP_BUCKET_CAP_BYTES,
) -> Plan:
    """Everything replicated; DDP's bucketing (``cap_bytes``: DDP's ``bucket_cap_mb``).

    Without ``ready_order`` buckets follow reverse registration order (DDP's initial guess) and the
    plan asks the runtime to rebuild them once from the observed gradient-ready order, as DDP does
    after its first iteration.
    """
    trainable = structure.trainable
    order = list(ready_order) if ready_order is not None else list(reversed(trainable))
    return Plan(
        world_size=world_size,
        units=_units(structure, "replicate", "after_forward"),
        buckets=bucket_by_size(order, structure, cap_bytes=cap_bytes),
        rebuild_buckets=None if ready_order is not None else BucketRebuild(cap_bytes=cap_bytes),
        fingerprint=structure.fingerprint(),
        provenance={"source": "builtin:ddp"},
    )


def block_groups(structure: ModelStructure, units: Sequence[str] | None = None) -> list[list[str]]:
    """Units grouped by block, in the given (forward) order; runs of units outside blocks form
    their own groups (FSDP2's root group, split where blocks interrupt it)."""
    order = list(units) if units is not None else [u.name for u in structure.units]
    block_of = {u.name: u.block for u in structure.units}
    groups: list[list[str]] = []
    current_key: object = object()
    for un in order:
        key = block_of.get(un)
        if groups and key == current_key:
            groups[-1].append(un)
        else:
            groups.append([un])
            current_key = key
    return groups


def _sharded_plan(
    structure: ModelStructure,
    world_size: int,
    *,
    residency: str,
    source: str,
    unit_order: Sequence[str] | None,
) -> Plan:
    units = _units(structure, "shard", residency)
    by_name = {u.name: u for u in units}
    order = list(unit_order) if unit_order is not None else [u.name for u in structure.units]
    block_of = {u.name: u.block for u in structure.units}
    groups: list[GatherGroup] = []
    for members in block_groups(structure, order):
        sharded = [m for m in members if by_name[m].placement == "shard"]
        if not sharded:
            continue
        if block_of[members[0]] is None:
            # FSDP2's root group is not resharded after forward: it is needed again right away.
            for m in sharded:
                by_name[m].residency = "after_backward"
        groups.append(GatherGroup(units=sharded, prefetch=Prefetch(forward=1, backward=1)))
    # FSDP2 reduce-scatters each group's gradients together, in backward (reverse) order.
    buckets: list[Bucket] = []
    for g in reversed(groups):
        params = [p for un in reversed(g.units) for p in by_name[un].params if structure.params[p].requires_grad]
        by_dtype: dict[object, list[str]] = {}
        for p in params:
            by_dtype.setdefault(structure.params[p].dtype, []).append(p)
        buckets.extend(
            Bucket(params=ps, op="reduce_scatter", nbytes=sum(structure.params[p].nbytes for p in ps))
            for ps in by_dtype.values()
        )
    replicated = [
        p for u in reversed(units) if u.placement == "replicate" for p in u.params if structure.params[p].requires_grad
    ]
    if replicated:
        buckets.extend(bucket_by_size(replicated, structure))
    return Plan(
        world_size=world_size,
        units=units,
        gather_groups=groups,
        # FSDP2 keeps one reduce-scatter in flight: the next group's post-backward waits for it.
        max_inflight_buckets=1,
        buckets=buckets,
        fingerprint=structure.fingerprint(),
        provenance={"source": source},
    )


def fsdp_plan(structure: ModelStructure, world_size: int, *, unit_order: Sequence[str] | None = None) -> Plan:
    """FSDP2 full sharding: one gather group per block, freed after forward, prefetch window 1."""
    return _sharded_plan(structure, world_size, residency="after_forward", source="builtin:fsdp", unit_order=unit_order)


def zero2_plan(structure: ModelStructure, world_size: int, *, unit_order: Sequence[str] | None = None) -> Plan:
    """FSDP2 ``reshard_after_forward=False`` (ZeRO-2 style): gathered once per step, freed after backward."""
    return _sharded_plan(structure, world_size, residency="after_backward", source="builtin:zero2", unit_order=unit_order)


def builtin_plan(name: str, structure: ModelStructure, world_size: int, *, bucket_cap_bytes: int | None = None) -> Plan:
    """Built-in plan ``name``; ``bucket_cap_bytes``: DDP's bucket cap for ``"ddp"`` (its default
    otherwise; the sharded plans bucket by gather group)."""
    if name == "ddp":
        return ddp_plan(structure, world_size, cap_bytes=bucket_cap_bytes or DDP_BUCKET_CAP_BYTES)
    if name == "fsdp":
        return fsdp_plan(structure, world_size)
    if name == "zero2":
        return zero2_plan(structure, world_size)
    raise ValueError(f"unknown built-in plan {name!r}; choose one of {', '.join(BUILTIN_PLANS)}")
