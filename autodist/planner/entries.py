"""The checks a cache entry passes before it is used (``cache.py`` reads it, a parser here checks it).

[Note: cache entries are checked, not trusted] An entry may be truncated, overwritten with other
bytes, written by another version, or valid JSON of the wrong shape. Each is parsed *and* checked
against what this launch will do with it before it is used: anything unexpected raises, so
``Cache.get`` reports the entry once, removes it, and treats it as a miss; what this launch then
measures or plans is stored in its place. Only rank 0 reads the cache (``AutoPlanner.read``).
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from typing import Any

from ..cost.comm import OPS, CommModel
from ..cost.profile import PROFILE_SCHEMA_VERSION, Profile
from ..plan import PLACEMENTS, Plan, validate_plan


def plan_entry(text: str, structure: Any, world: int) -> Plan:
    """A cached plan: parsed (which checks every field) and validated against the model."""
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
