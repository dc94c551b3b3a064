"""The on-disk cache of profiles, comm models, plans, fidelity records and learned estimators.

Location: ``cache_dir`` if given, else ``$AUTODIST_CACHE_DIR``, else ``$XDG_CACHE_HOME/autodist``,
else ``~/.cache/autodist``. The kinds of entry live apart, so that a new budget re-plans without
re-profiling and a new model reuses the machine's comm model (the keys: ``keys.py``):

* ``profiles/<key>.json`` — a :class:`~autodist.cost.profile.Profile`, keyed by model structure,
  input signature, device and torch version;
* ``comm/<key>.json`` — a :class:`~autodist.cost.comm.CommModel`, keyed by the machine (backend,
  world size, device type and name, torch version: :func:`~autodist.planner.keys.machine_key`);
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
crashes training or changes results (the checks: ``entries.py``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .._log import OnceLogger, logger

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
    def get(self, kind: str, key: str, parse: Callable[[str], T], replaced_by: Callable[[], str] | None = None) -> T | None:
        """The parsed entry, or ``None`` on a miss. An entry that cannot be read, decoded or parsed
        (``parse`` raising anything) is reported once, removed, and is a miss; ``replaced_by`` says
        in that report what replaces it (e.g. a measurement and how long it takes)."""
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
                "autodist: cache entry %s is corrupt or stale (%s%s); it will be replaced%s",
                p, type(e).__name__, f": {why[:200]}" if why else "", f": {replaced_by()}" if replaced_by is not None else "",
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
