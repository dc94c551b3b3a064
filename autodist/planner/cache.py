"""The on-disk cache of profiles, comm models, plans, fidelity records and learned estimators.

Location: ``cache_dir`` if given, else ``$AUTODIST_CACHE_DIR``, else ``$XDG_CACHE_HOME/autodist``,
else ``~/.cache/autodist``. The kinds of entry live apart, so that a new budget re-plans without
re-profiling and a new model reuses the machine's comm model:

* ``profiles/<key>.json`` — a :class:`~autodist.cost.profile.Profile`, keyed by model structure,
  input signature, device and torch version;
* ``comm/<key>.json`` — a :class:`~autodist.cost.comm.CommModel`, keyed by backend, world size,
  device name and torch version;
* ``plans/<key>.json`` — a plan, keyed by everything that decides it (the profile key, world size,
  backend, budget, optimizer kind, mixed precision, plan schema version);
* ``placements/<key>.json`` — the placement of the last plan stored for a model, world size and
  budget, which a launch without example inputs uses at wrap time (placement cannot change later);
* ``fidelity/<key>.json`` — the simulator's error measured by ``autodist check`` on this machine,
  keyed like the comm model; the search takes its margins from it (``cost/fidelity.py``);
* ``estimators/<key>.json`` — the learned estimator trained on this machine's measured timelines
  (``tools/train_estimator.py``), with its provenance and validation, keyed like the comm model.

Writes are atomic (temporary file + rename) under an exclusive ``fcntl`` lock; only rank 0 writes.
A corrupt, truncated or stale entry is reported once, removed and treated as a miss — it never
crashes training or changes results.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from .._log import OnceLogger, logger
from ..cost.comm import OPS, CommModel
from ..cost.profile import PROFILE_SCHEMA_VERSION, Profile
from ..plan import PLACEMENTS, Plan, validate_plan

KINDS = ("profiles", "comm", "plans", "placements", "fidelity", "estimators")
T = TypeVar("T")


def default_cache_dir() -> Path:
    env = os.environ.get("AUTODIST_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "autodist"
    return Path.home() / ".cache" / "autodist"


@dataclass
class Entry:
    kind: str
    key: str
    path: Path
    bytes: int
    modified: float


class Cache:
    def __init__(self, directory: str | os.PathLike[str] | None = None, *, writer: bool = True) -> None:
        self.dir = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self.writer = writer
        self.once = OnceLogger()
        self.counters = {"hits": 0, "misses": 0, "writes": 0, "corrupt": 0}

    # -- paths ----------------------------------------------------------------------------------
    def path(self, kind: str, key: str) -> Path:
        if kind not in KINDS:
            raise ValueError(f"unknown cache kind {kind!r}; one of {', '.join(KINDS)}")
        return self.dir / kind / f"{key}.json"

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "a+") as f:
            try:
                import fcntl

                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            except ImportError:  # pragma: no cover - non-POSIX
                pass
            try:
                yield
            finally:
                try:
                    import fcntl

                    fcntl.flock(f.fileno(), fcntl.LOCK_UN)
                except ImportError:  # pragma: no cover
                    pass

    # -- read / write -----------------------------------------------------------------------------
    def get(self, kind: str, key: str, parse: Callable[[str], T]) -> T | None:
        """The parsed entry, or ``None`` on a miss. An entry that cannot be read, decoded or parsed
        (``parse`` raising anything) is reported once, removed, and is a miss."""
        p = self.path(kind, key)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            self.counters["misses"] += 1
            return None
        except OSError as e:
            self.once.warning(f"read{p}", "autodist: cannot read cache entry %s (%s); ignoring it", p, e)
            self.counters["misses"] += 1
            return None
        try:
            value = parse(data.decode("utf-8"))
        except Exception as e:  # any failure means the entry is unusable: never crash training
            self.counters["corrupt"] += 1
            self.counters["misses"] += 1
            why = " ".join(str(e).split())
            self.once.warning(
                f"corrupt{p}",
                "autodist: cache entry %s is corrupt or stale (%s%s); it will be replaced",
                p, type(e).__name__, f": {why[:200]}" if why else "",
            )
            if self.writer:
                with contextlib.suppress(OSError):
                    p.unlink()
            return None
        self.counters["hits"] += 1
        return value

    def put(self, kind: str, key: str, text: str) -> Path | None:
        """Write atomically under the lock (rank 0 only; others return None)."""
        if not self.writer:
            return None
        p = self.path(kind, key)
        try:
            with self._lock():
                p.parent.mkdir(parents=True, exist_ok=True)
                tmp = p.with_name(f".{p.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
                with open(tmp, "w") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, p)
        except OSError as e:
            self.once.warning(f"write{p}", "autodist: cannot write cache entry %s (%s); continuing without it", p, e)
            return None
        self.counters["writes"] += 1
        return p

    # -- maintenance (the CLI) ----------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        out = []
        for kind in KINDS:
            d = self.dir / kind
            if not d.is_dir():
                continue
            for p in sorted(d.glob("*.json")):
                st = p.stat()
                out.append(Entry(kind, p.stem, p, st.st_size, st.st_mtime))
        return out

    def clear(self, kind: str | None = None) -> int:
        removed = 0
        with self._lock():
            for e in self.entries():
                if kind is None or e.kind == kind:
                    with contextlib.suppress(OSError):
                        e.path.unlink()
                        removed += 1
        logger.info("autodist: removed %d cache entries from %s", removed, self.dir)
        return removed


# ------------------------------------------------------------------------------------------------
# Cache entries.
#
# [Note: cache entries are checked, not trusted] An entry may be truncated, overwritten with other
# bytes, written by another version, or valid JSON of the wrong shape. Each is parsed *and* checked
# against what this launch will do with it before it is used: anything unexpected raises, so
# ``Cache.get`` reports the entry once, removes it, and treats it as a miss; what this launch then
# measures or plans is stored in its place. Only rank 0 reads the cache (``AutoPlanner.read``).
# ------------------------------------------------------------------------------------------------


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
