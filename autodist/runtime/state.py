"""Full-tensor state dicts for a wrapped model, valid under any plan and world size.

``AutoDist.state_dict()`` returns plain, unsharded tensors keyed exactly like the wrapped module's
own ``state_dict()``; ``load_state_dict`` accepts such a dict (or one with DTensor values, or with
DDP's ``module.`` prefix) and writes each rank's part into its shard (the caller then marks gathered and cast copies stale). Both are collectives when the
plan shards anything: call them on every rank.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from .params import ManagedParam


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


@torch.no_grad()
def load_full_state_dict(
    module: nn.Module,
    params: dict[str, ManagedParam],
    state_dict: dict[str, object],
    *,
    strict: bool = True,
) -> _IncompatibleKeys:
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
    for key, target in targets.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DTensor):
            value = value.full_tensor()
        mp = by_visible.get(id(target))
        if mp is not None:
            if tuple(value.shape) != mp.shape:
                raise RuntimeError(
                    f"size mismatch for {key}: checkpoint has shape {tuple(value.shape)}, the model has {mp.shape}"
                )
            mp.load_full_(value)
        else:
            target = target.to_local() if isinstance(target, DTensor) else target
            if tuple(value.shape) != tuple(target.shape):
                raise RuntimeError(
                    f"size mismatch for {key}: checkpoint has shape {tuple(value.shape)}, the model has "
                    f"{tuple(target.shape)}"
                )
            target.copy_(value.to(device=target.device, dtype=target.dtype))
    return _IncompatibleKeys(missing, unexpected)
