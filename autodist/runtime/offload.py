"""Offload fragments of optimizer state to host memory between optimizer steps (docs/design.md,
"Vocabulary" and "Runtime"; DeepCompile's adaptive offloading).

For every optimizer-state tensor ``T`` (this rank's local part, flattened) with offloaded ranges
``R`` and kept ranges ``K``, between steps the device holds only ``D`` (the kept elements, packed)
and the host holds ``H`` (the offloaded ones); ``T``'s own storage is released (resized to zero
bytes — the tensor object, which the optimizer's state refers to, stays). Around every step:

* **copy-back** — at the backward unit the plan names (or just before the step): ``T``'s storage is
  re-allocated and refilled from ``H`` and ``D`` on the copy engine, and ``D`` is dropped;
* **sync** — the optimizer's step pre-hook waits for every copy-back: the step runs on the device
  with complete state;
* **copy-out** — after the step (or when the named forward unit starts): ``R`` is copied to ``H``
  and ``K`` to a fresh ``D``; when both copies are done ``T``'s storage is released.

The source of a copy is never freed for reuse before its destination is complete, so an exception or an
interruption mid-copy leaves every value either in ``T`` or in ``H``/``D``: ``state_dict()`` of the
optimizer (and so DCP) always sees complete, correct state (a state-dict hook assembles offloaded
tensors), and ``load_state_dict`` re-applies the offload to the newly loaded state.

[Note: copy engines] On CUDA the copies run on a dedicated stream into pinned host memory, the
FSDP2 way: the copy stream first waits on an event recorded on the compute stream (the optimizer's
kernels that wrote the state, or the allocation a copy-back writes into); each copy records an
event on the copy stream; the compute stream waits on the copy-back's event before the optimizer
step — the host does not block for it. A copy-out's source ``T`` is released as soon as the copy is
issued, marked with ``record_stream`` for the copy stream: the caching allocator counts the bytes
as free at once and hands the block out again only after the copy stream's work has passed that
point. Waiting for the copy's event instead would keep ``T`` allocated for as long as the host runs
ahead of the device — typically the whole next step (the first GPU run measured 27 MiB of
offloaded state resident through it). The host waits for an event only before it reads a host
buffer. (Written for CUDA; ``tools/gpu_check.py`` verifies it on a GPU.) On the CPU there is no "device" memory apart
from the host's; the copies run on one background worker thread so they overlap compute (the GIL is
released during tensor copies), and the runtime keeps two accounts — device pool and host pool — so
that the mechanism and the memory accounting can be exercised and checked against the simulator.
The real gain is on GPUs.
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._log import logger
from ..plan import OffloadFragment
from ..schedule import offload_anchors
from .params import ManagedParam


class FragState(enum.Enum):
    RESIDENT = "resident"  # T holds everything
    OUT = "copying out"
    OFFLOADED = "offloaded"  # D + H hold everything, T released
    BACK = "copying back"


@dataclass
class _Entry:
    """One optimizer-state tensor with offloaded ranges."""

    param: str
    state: str
    ranges: list[tuple[int, int]]  # offloaded, sorted, disjoint, within the local numel
    numel: int
    t: torch.Tensor  # the local state tensor (flattened view of the optimizer's own)
    h: torch.Tensor  # host buffer of the offloaded elements
    d: torch.Tensor | None = None  # device buffer of the kept elements (only while offloaded)
    status: FragState = FragState.RESIDENT
    pending: Any = None  # the copy in flight (a handle of the copy engine: a future or a CUDA event)
    kept: list[tuple[int, int]] = field(default_factory=list)

    def kept_buffer(self) -> torch.Tensor:
        """``D``, which exists from a copy-out's start until its copy-back is done."""
        if self.d is None:
            raise RuntimeError(f"offload of {self.param}/{self.state}: no device buffer of kept elements in state {self.status.value}")
        return self.d

    @property
    def off_numel(self) -> int:
        return sum(b - a for a, b in self.ranges)

    @property
    def kept_numel(self) -> int:
        return self.numel - self.off_numel


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class PoolAccount:
    """Bytes of offload-managed optimizer state on each side, and a log of them at sync points."""

    device_bytes: int = 0
    host_bytes: int = 0
    log: list[tuple[str, int, int]] = field(default_factory=list)  # (event, device, host)

    def mark(self, event: str) -> None:
        self.log.append((event, self.device_bytes, self.host_bytes))


class _ThreadCopies:
    """CPU: copies on one background worker thread; a handle is a future. A copy-out's source is
    released when the copy is done (the worker reads it)."""

    release_at_issue = False

    def keep_for_copy(self, t: torch.Tensor) -> None:
        pass

    def __init__(self) -> None:
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="autodist-offload")

    def start(self, fn: Callable[[], None]) -> concurrent.futures.Future:
        return self._worker.submit(fn)

    def done(self, handle: concurrent.futures.Future) -> bool:
        return handle.done()

    def wait(self, handle: concurrent.futures.Future, *, host: bool) -> None:
        handle.result()  # raises what the copy raised

    def close(self) -> None:
        self._worker.shutdown(wait=True)


class _StreamCopies:  # pragma: no cover - CUDA only, not exercised on this machine
    """CUDA: copies on a dedicated stream, ordered after the compute stream's work so far; a handle
    is the event recorded after the copy (see [Note: copy engines]). A copy-out's source is released
    as soon as the copy is issued: the allocator keeps the block from reuse until the copy stream's
    work issued so far has completed (``record_stream``)."""

    release_at_issue = True

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)

    def keep_for_copy(self, t: torch.Tensor) -> None:
        t.record_stream(self.stream)

    def start(self, fn: Callable[[], None]) -> Any:
        ready = torch.cuda.current_stream().record_event()  # the optimizer's writes / the allocation
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            fn()
            return self.stream.record_event()

    def done(self, handle: Any) -> bool:
        return bool(handle.query())

    def wait(self, handle: Any, *, host: bool) -> None:
        if host:
            handle.synchronize()  # the host is about to release or read memory the copy used
        else:
            torch.cuda.current_stream().wait_event(handle)  # the compute stream reads what it wrote

    def close(self) -> None:
        self.stream.synchronize()


class OffloadManager:
    """Carries out a plan's offload fragments for the optimizers that own the managed parameters."""

    def __init__(self, fragments: list[OffloadFragment], params: dict[str, ManagedParam], device: torch.device) -> None:
        self.device = device
        self.params = params
        self.fragments = fragments
        self.account = PoolAccount()
        self.record: Callable[[str, object], None] | None = None  # the engine's action log, when on
        self.entries: dict[tuple[str, str], _Entry] = {}
        # the optimizers whose state is bound: each optimizer over the model's parameters holds the
        # state of its own (a Muon + AdamW split, one optimizer per parameter stepped in backward)
        self.bound: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        anchors = offload_anchors(fragments)  # [Note: offload anchors] in autodist/schedule.py
        self._spec: dict[tuple[str, str], list[tuple[int, int]]] = anchors.ranges
        self.out_at: dict[str, list[tuple[str, str]]] = anchors.out_at  # anchor ("step" | "forward:u") -> keys
        self.back_at: dict[str, list[tuple[str, str]]] = anchors.back_at  # anchor ("step" | "backward:u") -> keys
        self._lock = threading.Lock()
        self._copies = _StreamCopies(device) if device.type == "cuda" else _ThreadCopies()
        self.errors: list[BaseException] = []

    @property
    def active(self) -> bool:
        return bool(self.fragments)

    # ---- binding to the optimizer's state ---------------------------------------------------------
    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """(Re)find the state tensors the fragments refer to (after the first step creates them, or
        after ``load_state_dict`` replaces them)."""
        self.bound.add(optimizer)
        by_visible = {id(mp.visible): mp for mp in self.params.values()}
        found = 0
        for p, st in optimizer.state.items():
            mp = by_visible.get(id(p))
            if mp is None:
                continue
            for name, value in st.items():
                key = (mp.name, name)
                if key not in self._spec or not torch.is_tensor(value):
                    continue
                local = _local(value)
                if local.dim() == 0:
                    continue
                if not local.is_contiguous() or not local.untyped_storage().resizable():
                    # e.g. state loaded from a checkpoint file: give the optimizer its own copy
                    fresh = torch.empty(local.shape, dtype=local.dtype, device=local.device)
                    fresh.copy_(local)
                    if isinstance(value, DTensor):
                        value = DTensor.from_local(
                            fresh, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                            stride=value.stride(),
                        )
                    else:
                        value = fresh
                    st[name] = value
                    local = fresh
                numel = local.numel()
                ranges = _normalize(self._spec[key], numel)
                old = self.entries.get(key)
                if old is not None and old.t is not None and old.t.data_ptr() == local.data_ptr() and old.status is not FragState.RESIDENT:
                    continue  # already managed
                pin = self.device.type == "cuda"
                off_numel = sum(b - a for a, b in ranges)
                e = _Entry(mp.name, name, ranges, numel, t=local.view(-1),
                           h=torch.empty(off_numel, dtype=local.dtype, pin_memory=pin))
                e.kept = _complement(ranges, numel)
                self.entries[key] = e
                self.account.device_bytes += numel * local.element_size()
                found += 1
        mine = self._names_in(optimizer)
        missing = [k for k in self._spec if k[0] in mine and k not in self.entries]
        if missing:
            logger.warning(
                "autodist: %d offload fragment(s) name state %s does not hold (e.g. %s/%s); they stay on the "
                "device", len(missing), type(optimizer).__name__, *missing[0],
            )

    def unbind(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget the state tensors of ``optimizer``'s parameters (its state is being replaced)."""
        mine = self._names_in(optimizer)
        for key in [k for k in self.entries if k[0] in mine]:
            del self.entries[key]

    def _names_in(self, optimizer: torch.optim.Optimizer) -> set[str]:
        """The names of the managed parameters ``optimizer`` steps."""
        by_visible = {id(mp.visible): mp.name for mp in self.params.values()}
        return {by_visible[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in by_visible}

    # ---- copies ---------------------------------------------------------------------------------
    def copy_out(self, keys: Iterable[tuple[str, str]]) -> None:
        started = False
        for key in keys:
            e = self.entries.get(key)
            if e is None or e.status is not FragState.RESIDENT:
                continue
            e.status = FragState.OUT
            started = True
            if self.record is not None:
                self.record("copy_out", f"{e.param}/{e.state}")
            itemsize = e.t.element_size()
            e.d = torch.empty(e.kept_numel, dtype=e.t.dtype, device=e.t.device)
            self.account.device_bytes += e.kept_numel * itemsize

            def work(e: _Entry = e) -> None:
                off = 0
                for a, b in e.ranges:
                    e.h[off : off + b - a].copy_(e.t[a:b], non_blocking=True)
                    off += b - a
                off = 0
                d = e.kept_buffer()
                for a, b in e.kept:
                    d[off : off + b - a].copy_(e.t[a:b])
                    off += b - a

            e.pending = self._copies.start(work)
            if self._copies.release_at_issue:
                self._release(e)
        if started:
            self.account.mark("copy-out start")

    def poll(self) -> None:
        """Release the device storage of copy-outs that already completed (never blocks)."""
        if any(e.status is FragState.OUT and e.pending is not None and self._copies.done(e.pending) for e in self.entries.values()):
            self.finish_out(only_done=True)

    def finish_out(self, *, only_done: bool = False) -> None:
        """Release the device storage of every state whose copy-out completed (waiting for the
        rest unless ``only_done``)."""
        changed = False
        for e in self.entries.values():
            if e.status is not FragState.OUT:
                continue
            if only_done and e.pending is not None and not self._copies.done(e.pending):
                continue
            changed = True
            # T's storage goes next, so the copy reading it must be done: the host waits on the CPU;
            # on CUDA the compute stream waits on the copy's event, and the caching allocator hands
            # T's block only to later work of the compute stream (see [Note: copy engines])
            self._wait(e, host=self.device.type != "cuda")
            if e.status is not FragState.OUT:
                continue
            self._release(e)
        if changed:
            self.account.mark("copy-out done")

    def _release(self, e: _Entry) -> None:
        """Drop ``T``'s storage once its copy-out is issued (CUDA) or done (CPU)."""
        self._copies.keep_for_copy(e.t)
        storage = e.t.untyped_storage()
        freed = storage.nbytes()
        storage.resize_(0)
        self.account.device_bytes -= freed
        self.account.host_bytes += e.off_numel * e.t.element_size()
        e.status = FragState.OFFLOADED

    def copy_back(self, keys: Iterable[tuple[str, str]]) -> None:
        self.finish_out()
        started = False
        for key in keys:
            e = self.entries.get(key)
            if e is None or e.status is not FragState.OFFLOADED:
                continue
            e.status = FragState.BACK
            started = True
            if self.record is not None:
                self.record("copy_back", f"{e.param}/{e.state}")
            itemsize = e.t.element_size()
            e.t.untyped_storage().resize_(e.numel * itemsize)
            self.account.device_bytes += e.numel * itemsize

            def work(e: _Entry = e) -> None:
                off = 0
                for a, b in e.ranges:
                    e.t[a:b].copy_(e.h[off : off + b - a], non_blocking=True)
                    off += b - a
                off = 0
                d = e.kept_buffer()
                for a, b in e.kept:
                    e.t[a:b].copy_(d[off : off + b - a])
                    off += b - a

            e.pending = self._copies.start(work)
        if started:
            self.account.mark("copy-back start")

    def finish_back(self) -> None:
        """The sync point before the optimizer step: every state is complete on the device."""
        late = [(e.param, e.state) for e in self.entries.values() if e.status in (FragState.OFFLOADED, FragState.OUT)]
        if late:
            self.copy_back(late)
        changed = False
        for e in self.entries.values():
            if e.status is not FragState.BACK:
                continue
            changed = True
            self._wait(e, host=False)  # the step (compute stream) waits for the copy, not the host
            if e.status is not FragState.BACK:
                continue
            self.account.device_bytes -= e.kept_numel * e.t.element_size()
            self.account.host_bytes -= e.off_numel * e.t.element_size()
            e.d = None
            e.status = FragState.RESIDENT
        if changed:
            self.account.mark("copy-back done")

    def _wait(self, e: _Entry, *, host: bool = True) -> None:
        if e.pending is None:
            return
        try:
            self._copies.wait(e.pending, host=host)
        except BaseException as exc:  # the source is intact: undo and keep training correct
            self.errors.append(exc)
            logger.warning("autodist: an offload copy of %s/%s failed (%s); the state stays on the device", e.param, e.state, exc)
            if e.status is FragState.OUT:
                self.account.device_bytes -= e.kept_numel * e.t.element_size()
                e.d = None
                e.status = FragState.RESIDENT
            elif e.status is FragState.BACK:
                raise
        finally:
            e.pending = None

    def materialize_all(self) -> None:
        """Everything back on the device (before a state dict is loaded, or when closing)."""
        self.finish_out()
        self.finish_back()

    def assembled(self, key: tuple[str, str]) -> torch.Tensor | None:
        """A complete copy of an offloaded state's local values, or None if ``T`` holds them."""
        e = self.entries.get(key)
        if e is None:
            return None
        if e.status is FragState.OFFLOADED and e.pending is not None:
            self._wait(e, host=True)  # CUDA: released at issue; the host buffer may still be filling
        if e.status in (FragState.OUT, FragState.BACK):
            self._wait(e, host=True)
            if e.status is FragState.OUT:
                self.finish_out()
            else:
                self.finish_back()
        if e.status is not FragState.OFFLOADED:
            return None
        d = e.kept_buffer()
        out = torch.empty(e.numel, dtype=e.h.dtype, device=d.device)
        off = 0
        for a, b in e.ranges:
            out[a:b].copy_(e.h[off : off + b - a])
            off += b - a
        off = 0
        for a, b in e.kept:
            out[a:b].copy_(d[off : off + b - a])
            off += b - a
        return out

    def close(self) -> None:
        self.materialize_all()
        self._copies.close()


def _normalize(ranges: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted((max(0, a), min(b, numel)) for a, b in ranges):
        if a >= b:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _complement(ranges: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    out, pos = [], 0
    for a, b in ranges:
        if a > pos:
            out.append((pos, a))
        pos = b
    if pos < numel:
        out.append((pos, numel))
    return out
