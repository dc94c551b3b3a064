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

from ..cost.comm import COMM_SCHEMA_VERSION, OPS, CommModel, fit_op
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
    # an operation the model has no fit for was not measured (see [Note: measuring what the model
    # can use] in autodist/measure/sweep.py): plan="auto" measures it when a model needs it
    for name, fits in (("ops", model.ops), ("host", model.host)):
        for op, fit in fits.items():
            _check_fields(fit.small, f"comm model.{name}.{op}.small")
            _check_fields(fit.large, f"comm model.{name}.{op}.large")
            _number(fit.split_bytes, f"comm model.{name}.{op}.split_bytes", finite=False)
            # the samples are what a later sweep extends and fits again: each must be a number
            for i, sample in enumerate(fit.samples):
                row = list(sample) if isinstance(sample, (list, tuple)) else sample
                if not _finite_row(row, 2) or row[0] <= 0 or row[1] < 0:
                    raise ValueError(f"comm model.{name}.{op}.samples[{i}] = {sample!r} is not [bytes, seconds]")
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


def comm_parts(text: str, machine: dict[str, Any]) -> tuple[CommModel, str | None]:
    """A cached comm model for this machine, and ``None``; or, where :func:`comm_entry` refuses it
    but its JSON is this machine's and of this schema, the parts of it that are usable (each
    operation's valid samples, fitted again; each collective's valid contention rows; the
    first-touch figures, transient bytes and runtime overhead where valid) and why the rest is not.
    ``plan="auto"`` measures only what is then missing (``autodist/measure/sweep.py``
    :func:`plan_sweep`). Raises ``ValueError`` when nothing is usable."""
    try:
        return comm_entry(text, machine), None
    except Exception as e:  # any failure: what can be kept is sought below
        problem = " ".join(f"{type(e).__name__}: {e}".split())[:200]
    d = json.loads(text)
    if not isinstance(d, dict) or d.get("schema_version") != COMM_SCHEMA_VERSION:
        raise ValueError(f"not a comm model of schema {COMM_SCHEMA_VERSION}")
    here = (machine["backend"], machine["world"], machine["device_name"])
    if (d.get("backend"), d.get("world_size"), d.get("device")) != here:
        raise ValueError(f"not a comm model measured on (backend, world size, device) {here}")
    ops = _salvaged_fits(d.get("ops"))
    host = _salvaged_fits(d.get("host"))
    meta: dict[str, Any] = d["meta"] if isinstance(d.get("meta"), dict) else {}
    raw = meta.get("contention_measured")
    rows_of = raw if isinstance(raw, dict) and isinstance(d.get("contention"), dict) and set(raw) == set(d["contention"]) else d.get("contention")
    contention = {}
    for op, rows in (rows_of.items() if isinstance(rows_of, dict) else ()):
        good = sorted({row[0]: row for row in rows if _finite_row(row, 4) and row[0] > 0}.values()) if isinstance(rows, list) else []
        if op in OPS and good:
            contention[op] = [list(map(float, row)) for row in good]
    first_touch = d.get("first_touch")
    first_touch = [list(map(float, r)) for r in first_touch] if isinstance(first_touch, list) and all(
        _finite_row(r, 2) for r in first_touch) else []
    transient = {k: float(v) for k, v in (d.get("transient") or {}).items() if k in OPS and _finite_row([v], 1)} if isinstance(
        d.get("transient"), dict) else {}
    overhead = d.get("overhead")
    overhead = {k: float(v) for k, v in overhead.items()} if isinstance(overhead, dict) and overhead and all(
        isinstance(k, str) and _finite_row([v], 1) for k, v in overhead.items()) else {}
    if not (ops or contention or first_touch or overhead):
        raise ValueError(f"{problem}; nothing in it is usable")
    rates = meta.get("rates")
    kept_meta: dict[str, Any] = {"contention_measured": contention}
    if isinstance(rates, dict) and all(isinstance(k, str) and _finite_row([v], 1) and v > 0 for k, v in rates.items()):
        kept_meta["rates"] = rates
    return CommModel(
        here[0], here[1], here[2], ops, contention={k: [list(r) for r in v] for k, v in contention.items()},
        transient=transient, overhead=overhead, host=host, first_touch=first_touch, meta=kept_meta,
    ), problem


def _finite_row(row: Any, n: int) -> bool:
    """``row`` is a list of ``n`` finite numbers (``[x]`` for a number alone)."""
    return isinstance(row, list) and len(row) == n and all(
        not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) for x in row)


def _salvaged_fits(entries: Any) -> dict[str, Any]:
    """Each operation's valid samples (positive sizes, non-negative finite times) fitted again; an
    operation none of whose samples is valid is left out."""
    out = {}
    for op, fit in (entries.items() if isinstance(entries, dict) else ()):
        samples = fit.get("samples") if isinstance(fit, dict) else None
        pts = sorted({float(x): float(t) for x, t in (s for s in samples if _finite_row(s, 2)) if x > 0 and t >= 0}.items()) if (
            isinstance(samples, list)) else []
        if op in OPS and pts:
            out[op] = fit_op(pts)
    return out


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
