"""Full-tensor state dicts for a wrapped model, valid under any plan and world size.

``AutoDist.state_dict()`` returns plain, unsharded tensors keyed exactly like the wrapped module's
own ``state_dict()``; ``load_state_dict`` accepts such a dict (or one with DTensor values, or with
DDP's ``module.`` prefix) and writes each rank's part into its shard (the caller then marks gathered and cast copies stale). Both are collectives when the
plan shards anything: call them on every rank.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Protocol, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from ..errors import RankMismatchError
from .params import ManagedParam, coordinates

T = TypeVar("T")


class AllGatherObject(Protocol):
    """Every rank's object, indexed by rank (``Comm.all_gather_object``)."""

    def __call__(self, obj: T, /) -> list[T]: ...


def full_state_dict(module: nn.Module, *, prefix: str = "", keep_vars: bool = False) -> dict[str, torch.Tensor]:
    sd = module.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = OrderedDict()
    done: dict[int, torch.Tensor] = {}
    for key, value in sd.items():
        if isinstance(value, torch.Tensor):
            cached = done.get(id(value))
            if cached is None:
                t = value.full_tensor() if isinstance(value, DTensor) else value
                cached = t if keep_vars and not isinstance(value, DTensor) else t.detach()
                done[id(value)] = cached
            value = cached
        out[prefix + key] = value
    return out


def _strip_prefix(state_dict: dict[str, object], own_keys: set[str]) -> dict[str, object]:
    keys = list(state_dict)
    if keys and all(k.startswith("module.") for k in keys) and not any(k in own_keys for k in keys):
        return {k[len("module.") :]: v for k, v in state_dict.items()}
    return dict(state_dict)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        kind = "DTensor" if isinstance(value, DTensor) else "tensor"
        return f"{kind} of shape {tuple(value.shape)}, {value.dtype}"
    return type(value).__name__


def agree_on_state_dict(
    module: nn.Module, state_dict: dict[str, object], all_gather_object: AllGatherObject
) -> None:
    """Raise on every rank if the ranks were given state dicts with different keys or tensor shapes
    and dtypes (values are not compared): loading is a collective (DTensor values are gathered)
    and each rank would otherwise write a different subset of its parameters."""
    state_dict = _strip_prefix(state_dict, set(module.state_dict(keep_vars=True)))
    mine = sorted((k, _describe(v)) for k, v in state_dict.items())
    digests = all_gather_object(hashlib.sha256(repr(mine).encode()).hexdigest())
    if len(set(digests)) == 1:
        dtensors = {k: v for k, v in state_dict.items() if isinstance(v, DTensor)}
        problem = foreign_shards(dtensors, all_gather_object) if dtensors else None
        if problem is not None:
            raise RankMismatchError(
                f"load_state_dict was given DTensors that are not this rank's own parts: {problem}. A state dict "
                "of DTensors saved with torch.save by one rank (`model.module.state_dict()`, which holds that rank's "
                "shards only) is that rank's part on every rank that loads it. Nothing was loaded. Save "
                "`model.state_dict()` instead (full tensors: every rank calls it, rank 0 writes the file), or "
                "save and load sharded checkpoints with torch.distributed.checkpoint ([Note: one rank's shards "
                "loaded on every rank] in autodist/runtime/state.py)"
            )
        return
    everyone = [dict(d) for d in all_gather_object(mine)]
    other = next(r for r, d in enumerate(digests) if d != digests[0])
    a, b = everyone[0], everyone[other]
    key = next(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
    raise RankMismatchError(
        f"load_state_dict was given different state dicts on different ranks: {key!r} is "
        f"{a.get(key, 'missing')} on rank 0 but {b.get(key, 'missing')} on rank {other}. It is a collective "
        "(as with FSDP2): give every rank the same full state dict, e.g. load the same checkpoint file on each."
    )


def foreign_shards(values: dict[str, DTensor], all_gather_object: AllGatherObject) -> str | None:
    """What shows that sharded DTensor ``values`` (the same keys on every rank) are not each rank's
    own part, or None: a collective (:func:`shard_figures`, then :func:`foreign_among`)."""
    return foreign_among(shard_figures(values), all_gather_object)


ShardFigures = list[tuple]


def shard_figures(values: dict[str, DTensor]) -> ShardFigures:
    """This rank's figures of sharded DTensor ``values`` that :func:`foreign_among` compares across
    ranks: local, read now (the optimizer's loaded state may be offloaded, its device storage
    freed, before the check runs at the next step).

    [Note: one rank's shards loaded on every rank] DDP code saves with ``if rank == 0:
    torch.save(...)`` and every rank loads that file. A DTensor in it is rank 0's shard, and
    loaded on every rank it is rank 0's part everywhere: ``full_tensor()`` then assembles rank 0's
    rows in every place (or, with shards of uneven rows, waits on an all-gather whose sizes differ
    on some ranks only), and an optimizer stepping such state trains every rank with rank 0's
    moments. torch 2.14 pickles a DTensor's mesh with the saving rank's coordinate in it, so on
    every rank the loaded DTensor claims that coordinate: nothing fails, and nothing is right (mlp
    under ``fsdp`` loaded 0.52 off what was saved). Three signs, each checked on every rank and
    shared, so that every rank reaches the same verdict: a DTensor whose mesh places this rank
    elsewhere than the mesh's own rank list does; a part of another shape than this rank's under
    the DTensor's placements; or every sharded value that is not constant identical (its sum, sum
    of squares and range, in float64 on its device) on ranks whose parts start at different
    offsets, which parts of a trained or initialised tensor never are, and a file saved by one rank
    always is (the last holds should a torch recompute coordinates on loading)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mine: list[tuple] = []
    stats = []
    for key, v in values.items():
        if not any(isinstance(pl, Shard) for pl in v.placements):
            continue
        claimed, actual = coordinates(v)
        shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
        local = v.to_local().detach()
        mine.append((key, claimed, actual, tuple(local.shape), tuple(shape), tuple(offset)))
        flat = local.reshape(-1).to(torch.float64)
        stats.append(torch.stack([flat.sum(), (flat * flat).sum(), flat.max() - flat.min()]) if flat.numel()
                     else torch.zeros(3, dtype=torch.float64, device=flat.device))
    if not mine:
        return []
    figures = torch.stack(stats).cpu().tolist()
    return [(*entry, fig) for entry, fig in zip(mine, figures)]


def foreign_among(mine: ShardFigures, all_gather_object: AllGatherObject) -> str | None:
    """The verdict of [Note: one rank's shards loaded on every rank] on every rank's
    :func:`shard_figures` (the same keys on every rank), or None: a collective."""
    if not mine:
        return None
    everyone = all_gather_object(mine)
    for r, entries in enumerate(everyone):
        for key, claimed, actual, held, own, _, _ in entries:
            if claimed != actual:
                return (f"on rank {r}, {key!r} is a DTensor whose mesh gives rank {r} the coordinate {claimed}, where the "
                        f"mesh's ranks put it at {actual}: it was saved by another rank")
            if held != own:
                return (f"rank {r} holds a part of {key!r} of shape {held}, where its part under the DTensor's "
                        f"placements has shape {own}")
    compared = identical = 0
    for i in range(len(mine)):
        by_offset: dict[tuple[int, ...], list[float]] = {}
        for entries in everyone:
            *_, offset, fig = entries[i]
            by_offset.setdefault(offset, fig)
        if len(by_offset) < 2 or not any(f[2] > 0 for f in by_offset.values()):
            continue  # one part, or constant parts (zeros): equal parts prove nothing
        compared += 1
        identical += len({tuple(f) for f in by_offset.values()}) == 1
    if compared and identical == compared:
        return (f"every rank holds the same values for the parts of {compared} sharded tensor(s) that start at "
                f"different rows ({mine[0][0]!r} among them)")
    return None


@torch.no_grad()
def load_full_state_dict(
    module: nn.Module,
    params: dict[str, ManagedParam],
    state_dict: dict[str, object],
    *,
    strict: bool = True,
) -> _IncompatibleKeys:
    """Write ``state_dict``'s full tensors into the module's parameters and buffers: every key and
    shape is checked before anything is written, so a refused state dict changes nothing."""
    targets = module.state_dict(keep_vars=True)
    state_dict = _strip_prefix(state_dict, set(targets))
    by_visible = {id(mp.visible): mp for mp in params.values()}
    missing = [k for k in targets if k not in state_dict]
    unexpected = [k for k in state_dict if k not in targets]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        raise RuntimeError(
            "Error(s) in loading state_dict for AutoDist: " + "; ".join(parts)
            + ". Keys are those of the wrapped module (no 'module.' prefix); pass strict=False to load a subset."
        )
    writes = []
    for key, target in targets.items():
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        mp = by_visible.get(id(target))
        if mp is None:
            target = target.to_local() if isinstance(target, DTensor) else target
        shape = mp.shape if mp is not None else tuple(target.shape)
        if tuple(value.shape) != shape:
            raise RuntimeError(f"size mismatch for {key}: checkpoint has shape {tuple(value.shape)}, the model has {shape}")
        writes.append((value, mp, target))
    for value, mp, target in writes:
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if mp is not None:
            mp.load_full_(value)
        else:
            target.copy_(value.to(device=target.device, dtype=target.dtype))
    return _IncompatibleKeys(missing, unexpected)
