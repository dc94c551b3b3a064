"""Process groups and the stateless collective calls the runtime issues.

Every collective is asynchronous (``async_op=True``) and returns an :class:`InFlight`: the work handle
travels together with the buffers it reads and writes, so nobody frees or reads them before
``wait()``. The same code overlaps communication on CPU (gloo runs collectives on its own threads)
and on CUDA (NCCL runs on its own streams and the caching allocator is told about it).

[Note: two process groups] Parameter all-gathers and gradient reductions run on two separate
process groups. Gathers are issued in forward/backward order and reductions in bucket order; both
orders are identical on every rank, but their *interleaving* need not be (a rank where a parameter
got no gradient launches its bucket later). On one group an interleaving difference would pair the
wrong collectives across ranks; on two groups each stream of collectives stays matched, and the two
can also proceed concurrently.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .._log import logger

# torch >= 2.14 renamed the flat-tensor collectives (the old names still work but warn).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Counts of what the runtime issued, for observability and tests."""

    all_gathers: int = 0
    on_demand_gathers: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0
    broadcasts: int = 0
    wait_seconds: float = 0.0  # time the compute thread spent blocked on collectives
    gathered_bytes: int = 0
    reduced_bytes: int = 0
    log: list[tuple[str, str]] | None = field(default=None, repr=False)

    def record(self, kind: str, label: str) -> None:
        if self.log is not None:
            self.log.append((kind, label))


class InFlight:
    """An issued collective and the buffers it owns until someone waits on it."""

    __slots__ = ("work", "buffers", "label", "waited", "stats")

    def __init__(
        self, work: dist.Work | None, buffers: tuple[torch.Tensor, ...], label: str, stats: CommStats | None = None
    ) -> None:
        self.work = work
        self.buffers = buffers
        self.label = label
        self.waited = work is None
        self.stats = stats

    def wait(self) -> None:
        if not self.waited:
            t0 = time.perf_counter()
            with record_function(f"autodist::wait({self.label})"):
                self.work.wait()
            if self.stats is not None:
                self.stats.wait_seconds += time.perf_counter() - t0
            self.waited = True


def _mark(label: str) -> None:
    """A zero-length profiler label where a collective is issued (the wait carries the duration;
    see [Note: collectives issued under the profiler])."""
    with record_function(label):
        pass


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    """Issue an asynchronous collective without a profiler record.

    [Note: collectives issued under the profiler] A collective issued while ``torch.profiler``
    records keeps a record that its backend thread closes when the collective completes. If the
    profiler session ends first (a persistent refresh issued by the last profiled optimizer step,
    a reduction still in flight when the user's ``with profile():`` block exits), closing it
    crashes the process (SIGSEGV with gloo on torch 2.14, reproduced deterministically with an
    all-gather waited after the session). The runtime's own labels — a mark at the issue, a range
    around the wait — say where and how long; only the backend's record is dropped.
    ``_enable_record_function`` is torch-internal: without it, collectives are issued as usual.
    """
    toggle = getattr(torch._C._autograd, "_enable_record_function", None)
    if toggle is None or not torch.autograd._profiler_enabled():
        yield
        return
    toggle(False)
    try:
        yield
    finally:
        toggle(True)


def default_device() -> torch.device:
    """The device this rank computes on: the local accelerator if there is one, else the CPU."""
    if hasattr(torch, "accelerator") and torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        index = local_rank % max(1, torch.accelerator.device_count())
        return torch.device(acc.type, index)
    return torch.device("cpu")


def init_distributed(device: torch.device | None = None, timeout_s: float | None = None) -> torch.device:
    """Make sure a default process group exists; return the device this rank computes on.

    Under torchrun (``RANK``/``WORLD_SIZE`` set) the group is built from the environment, with
    nccl on CUDA and gloo on CPU; a plain single process becomes a world of one.
    """
    device = device or default_device()
    if device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.set_device_index(device.index or 0)
    if dist.is_initialized():
        return device
    backend = "gloo" if device.type == "cpu" else dist.get_default_backend_for_device(device)
    kwargs = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, **kwargs)
        if dist.get_rank() == 0:
            logger.info("autodist: initialised process group (%s, world size %d)", backend, dist.get_world_size())
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        logger.info("autodist: no torchrun environment; running as a world of one (%s)", backend)
    return device


class Comm:
    """The collectives of one AutoDist instance, on its own gather and reduce process groups."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group or dist.group.WORLD
        self.backend = dist.get_backend(self.group)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        ranks = dist.get_process_group_ranks(self.group)
        if self.world_size > 1:
            self.gather_pg = dist.new_group(ranks)
            self.reduce_pg = dist.new_group(ranks)
        else:
            self.gather_pg = self.reduce_pg = self.group
        self.stats = CommStats()

    # -- parameter all-gather -----------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, label: str, *, on_demand: bool = False) -> InFlight:
        self.stats.all_gathers += 1
        self.stats.on_demand_gathers += int(on_demand)
        self.stats.gathered_bytes += out.numel() * out.element_size()
        self.stats.record("all_gather", label)
        _mark(f"autodist::all_gather({label})")
        if self.world_size == 1:
            out.copy_(inp)
            return InFlight(None, (out, inp), label)
        with _untraced():
            work = _all_gather_flat(out, inp, group=self.gather_pg, async_op=True)
        return InFlight(work, (out, inp), label, self.stats)

    # -- gradient reductions ------------------------------------------------------------------
    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, label: str) -> InFlight:
        self.stats.reduce_scatters += 1
        self.stats.reduced_bytes += inp.numel() * inp.element_size()
        self.stats.record("reduce_scatter", label)
        _mark(f"autodist::reduce_scatter({label})")
        if self.world_size == 1:
            out.copy_(inp.view(-1)[: out.numel()])
            return InFlight(None, (out, inp), label)
        if self.backend == "gloo":
            # [Note: gloo reduce-scatter] gloo's flat reduce-scatter clones its whole input first;
            # the list form reduces in place from views (measured: half the transient memory and
            # ~30% faster for 16 MiB shards on 2 ranks).
            chunks = list(inp.view(self.world_size, -1).unbind(0))
            with _untraced():
                work = dist.reduce_scatter(out, chunks, group=self.reduce_pg, async_op=True)
        else:
            with _untraced():
                work = _reduce_scatter_flat(out, inp, group=self.reduce_pg, async_op=True)
        return InFlight(work, (out, inp), label, self.stats)

    def all_reduce(self, buf: torch.Tensor, label: str) -> InFlight:
        self.stats.all_reduces += 1
        self.stats.reduced_bytes += buf.numel() * buf.element_size()
        self.stats.record("all_reduce", label)
        _mark(f"autodist::all_reduce({label})")
        if self.world_size == 1:
            return InFlight(None, (buf,), label)
        with _untraced():
            work = dist.all_reduce(buf, group=self.reduce_pg, async_op=True)
        return InFlight(work, (buf,), label, self.stats)

    # -- synchronous helpers ------------------------------------------------------------------
    def broadcast_tensors(self, tensors: list[torch.Tensor], label: str, src: int = 0) -> None:
        """Broadcast ``tensors`` from ``src`` in place, one flat message per dtype."""
        if self.world_size == 1 or not tensors:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        src_global = dist.get_global_rank(self.reduce_pg, src) if self.reduce_pg is not dist.group.WORLD else src
        with record_function(f"autodist::broadcast({label})"):
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                self.stats.broadcasts += 1
                self.stats.record("broadcast", label)
                dist.broadcast(flat, src=src_global, group=self.reduce_pg)
                offset = 0
                with torch.no_grad():
                    for t in group:
                        n = t.numel()
                        t.copy_(flat[offset : offset + n].view_as(t))
                        offset += n

    def all_gather_object(self, obj: object) -> list[object]:
        if self.world_size == 1:
            return [obj]
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src), group=self.group)
        return box[0]

    def destroy(self) -> None:
        if self.world_size > 1:
            for pg in (self.gather_pg, self.reduce_pg):
                try:
                    dist.destroy_process_group(pg)
                except (ValueError, RuntimeError):  # already destroyed with the default group
                    pass
