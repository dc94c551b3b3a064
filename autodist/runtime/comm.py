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
import pickle
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .._log import logger
from ..errors import PeerFailure, RankMismatchError

T = TypeVar("T")

# torch >= 2.14 renamed the flat-tensor collectives (the old names still work but warn).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveSequence:
    """The collectives this rank issued since the last :meth:`reset`, in issue order: per process
    group (gathers; reductions) and interleaved, as running hashes and a short list.

    [Note: checking the collective order across ranks] Collectives pair by issue order. Ranks whose
    sharded units take different control flow can issue gathers of equal sizes for different units;
    they pair silently and compute with the wrong weights. At the end of every backward the runtime
    compares these sequences across ranks with one small all-reduce of integers: each rank contributes
    20-bit slices ``h`` of its hashes and their squares; every slice is equal on all ranks exactly
    when ``world * sum(h*h) == sum(h)**2`` (equality in Cauchy-Schwarz), a verdict every rank reads
    from the same sums. Only on a mismatch are the sequences exchanged, to name the first difference.
    The interleaving of the two groups matters only where the backend needs one launch order across
    communicators (NCCL; see [Note: one issue order for NCCL] in engine.py).
    """

    KEEP = 256  # entries kept for the error message
    STREAMS = ("gather", "reduce", "interleaved")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.hashes = {k: 0 for k in self.STREAMS}
        self.counts = {k: 0 for k in self.STREAMS}
        self.entries: list[str] = []

    def record(self, kind: str, label: str) -> None:
        crc = zlib.crc32(f"{kind}:{label}".encode())
        stream = "gather" if kind == "all_gather" else "reduce"
        for k in (stream, "interleaved"):
            self.hashes[k] = (self.hashes[k] * 1_000_003 + crc) & 0xFFFFFFFFFFFFFFFF
            self.counts[k] += 1
        if len(self.entries) < self.KEEP or kind == "late_gradient":
            self.entries.append(f"{kind}({label})")

    def digest(self, streams: tuple[str, ...]) -> list[int]:
        parts = []
        for k in streams:
            parts += [(self.hashes[k] >> shift) & 0xFFFFF for shift in (0, 20, 40)] + [min(self.counts[k], 0xFFFFF)]
        return parts + [x * x for x in parts]


@dataclass
class CollectiveTiming:
    """When one asynchronous collective was issued and when the backend completed it
    (``time.perf_counter`` seconds; ``done`` is set by the backend's completion callback)."""

    label: str  # "all_gather(<group>)", "reduce_scatter(bucket<i>)", "all_reduce(bucket<i>)"
    nbytes: int  # the message: the largest buffer the collective reads or writes
    issued: float
    done: float | None = None
    # the work, while neither a completion callback (not every gloo collective has one) nor a wait
    # has set ``done``: a measuring tool polls it (``autodist.lab.steptrace``)
    work: dist.Work | None = field(default=None, repr=False)

    def completed(self, at: float) -> None:
        """Completed at ``at`` (a completion callback, a wait that returned, a poll that found it
        done: the earliest counts)."""
        self.done = at if self.done is None else min(self.done, at)
        self.work = None


@dataclass
class CommStats:
    """Counts of what the runtime issued, for observability and tests. ``timeline``: when a list,
    every asynchronous collective issued appends its :class:`CollectiveTiming` (off by default:
    a measuring tool turns it on, ``autodist/lab/steptrace.py``)."""

    all_gathers: int = 0
    on_demand_gathers: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0
    broadcasts: int = 0
    wait_seconds: float = 0.0  # time the compute thread spent blocked on collectives
    gathered_bytes: int = 0
    reduced_bytes: int = 0
    log: list[tuple[str, str]] | None = field(default=None, repr=False)
    timeline: list[CollectiveTiming] | None = field(default=None, repr=False)

    def record(self, kind: str, label: str) -> None:
        if self.log is not None:
            self.log.append((kind, label))


LATE_GRADIENT = (
    "the gradient of {names} arrived {where}after its bucket was reduced in this backward: every module the "
    "runtime hooks that uses it had finished its backward (or none ran: a unit left out), so the bucket went out, "
    "but code outside those modules read the parameter too (a read the source scan cannot name, such as "
    "`sum(e.weight.sum() for e in self.experts)`); the step's gradients are incomplete. Read it only through its "
    "own module's forward, or register it on the module that reads it (as a tied weight is, "
    "`other.weight = module.weight`)."
)


RENDEZVOUS_MAX_S = 300.0  # Comm.rendezvous warns after half the group's timeout, this at most ...
RENDEZVOUS_SHARE = 0.9  # ... and raises at this share of it, before the collectives the others wait in time out
RENDEZVOUS_UNKNOWN_S = 1800.0  # ... or after this long when the group's timeout is unknown (gloo's default)


def failed_peers(group: dist.ProcessGroup | None, rank: int, world: int, timeout_s: float = 3.0) -> list[int] | None:
    """After a collective failed: the ranks of ``group`` that are gone, found through the job's
    store (every surviving rank writes its name and waits briefly for the others'). ``None`` when
    the store cannot be reached (e.g. it lived in the failed process)."""
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_store is None:
        return None
    try:
        store = dist.PrefixStore("autodist/survivors", get_store())
        store.set(str(rank), "1")
        deadline = time.monotonic() + timeout_s
        alive: set[int] = set()
        while time.monotonic() < deadline:
            alive = {r for r in range(world) if store.check([str(r)])}
            if len(alive) == world:
                break
            time.sleep(0.1)
        return sorted(set(range(world)) - alive)
    except Exception:  # the store is gone too
        return None


def release(*tensors: torch.Tensor) -> None:
    """Free the storage of scratch buffers a waited-for collective used, now and on this thread: the
    backend's own reference may otherwise keep them until its thread drops it, later than they are
    dead and where memory tracking cannot see the free (see ``autodist.measure.memory``)."""
    for t in tensors:
        t.untyped_storage().resize_(0)


class InFlight:
    """An issued collective and the buffers it owns until someone waits on it."""

    __slots__ = ("work", "buffers", "label", "waited", "stats", "comm", "timing")

    def __init__(
        self, work: dist.Work | None, buffers: tuple[torch.Tensor, ...], label: str, stats: CommStats | None = None,
        comm: Comm | None = None,
    ) -> None:
        self.work = work
        self.buffers = buffers
        self.label = label
        self.waited = work is None
        self.stats = stats
        self.comm = comm
        self.timing: CollectiveTiming | None = None
        if stats is not None and stats.timeline is not None and work is not None:
            self.timing = timing = CollectiveTiming(label, max(t.numel() * t.element_size() for t in buffers), time.perf_counter())
            stats.timeline.append(timing)
            try:
                work.get_future().add_done_callback(lambda _: timing.completed(time.perf_counter()))
            except RuntimeError:  # "getFuture not implemented" (gloo's list reduce-scatter)
                timing.work = work

    def wait(self) -> None:
        """Wait for the collective; the work handle is dropped here, inside the wait's profiler range
        (see [Note: a backend's buffer freed out of sight] in ``autodist/measure/memory.py``)."""
        work = self.work
        if self.waited or work is None:  # waited for already, or nothing was issued
            return
        t0 = time.perf_counter()
        with profiled_range(f"autodist::wait({self.label})"):
            try:
                work.wait()
            except RuntimeError as e:  # a peer died or the group timed out (DistBackendError too)
                self.waited = True
                raise self._peer_failure(e) from e
            if self.timing is not None:  # a wait that blocked returns at completion
                self.timing.completed(time.perf_counter())
            self.work = None
            del work  # the last reference, dropped inside the range
        if self.stats is not None:
            self.stats.wait_seconds += time.perf_counter() - t0
        self.waited = True

    def _peer_failure(self, error: BaseException) -> PeerFailure:
        comm = self.comm
        gone = failed_peers(comm.group, comm.rank, comm.world_size) if comm is not None else None
        who = (
            f"rank(s) {', '.join(map(str, gone))} failed or exited" if gone
            else "another rank failed, exited or stalled past the process group's timeout"
        )
        return PeerFailure(
            f"{who} while this rank waited for {self.label}; this rank stops too (see the failed rank's own "
            f"error for the cause). Backend error: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
        )


_NO_RANGE = contextlib.nullcontext()


def profiled_range(label: str) -> contextlib.AbstractContextManager:
    """A ``record_function`` range while a profiler records, else nothing: entering a range costs a
    dispatcher call even with no profiler, and the runtime opens a few hundred a step on a model of
    many small layers."""
    return record_function(label) if torch.autograd._profiler_enabled() else _NO_RANGE


def _issuing(label: str) -> contextlib.AbstractContextManager:
    """A profiler range around the backend call that issues a collective, and nothing else: what is
    allocated on this thread inside it is the backend's, owned by the work handle (see [Note: a
    backend's buffer freed out of sight] in ``autodist/measure/memory.py``). The wait carries the
    duration; see [Note: collectives issued under the profiler]. The work handle keeps no Python
    object alive; see [Note: a collective issued in backward outliving the interpreter]."""
    if torch.autograd._profiler_enabled():
        return _profiled_issuing(label)
    return _WithoutPythonTLS()


@contextlib.contextmanager
def _profiled_issuing(label: str) -> Iterator[None]:
    with record_function(label), _untraced(), _WithoutPythonTLS():
        yield


_TLS_KEYS = ("context",)
_in_tls = getattr(torch._C, "_is_key_in_tls", None)


class _WithoutPythonTLS:
    """Issue an asynchronous collective without the Python objects torch stashes in thread-local
    state.

    [Note: a collective issued in backward outliving the interpreter] An asynchronous work handle
    captures the issuing thread's ``at::ThreadLocalState``, and inside ``loss.backward()`` that
    holds a Python object (torch 2.14's ``_engine_run_backward`` stashes the ``contextvars``
    context under the key ``"context"``). The backend's thread usually drops the last reference
    to a completed work, after the waiter has returned, and then must take the GIL to release that
    object. If the script is finishing, the interpreter is finalising by then, ``take_gil``
    ends the backend's thread with ``pthread_exit``, the unwind crosses a ``noexcept`` frame and
    the process aborts ("terminate called without an active exception", exit -6) after training
    succeeded: measured 3 of 15 two-rank launches of ``examples/mlp.py`` with gloo; the backtrace
    is the gloo run loop in ``~AsyncWork`` -> ``~ThreadLocalState`` -> ``decref`` -> ``take_gil``
    (the same holds for any collective issued in backward, DDP's included). The issue call reads
    nothing from that object, so it is removed for the call and put back. Where these torch
    internals are absent, collectives are issued as they are.
    """

    __slots__ = ("held",)

    def __enter__(self) -> None:
        self.held = [(k, torch._C._get_obj_in_tls(k)) for k in _TLS_KEYS if _in_tls is not None and _in_tls(k)]
        for k, _ in self.held:
            torch._C._remove_obj_from_tls(k)

    def __exit__(self, *exc: object) -> None:
        for k, obj in self.held:
            torch._C._stash_obj_in_tls(k, obj)


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    """Issue an asynchronous collective without a profiler record.

    [Note: collectives issued under the profiler] A collective issued while ``torch.profiler``
    records keeps a record that its backend thread closes when the collective completes. If the
    profiler session ends first (a reduction or a gather still in flight when the user's
    ``with profile():`` block exits; a persistent refresh once, when an optimizer step issued it), closing it
    crashes the process (SIGSEGV with gloo on torch 2.14, reproduced deterministically with an
    all-gather waited after the session). The runtime's own labels — a range around the issue, a
    range around the wait — say where and how long; only the backend's record is dropped.
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


def _accelerator() -> torch.device | None:
    """The kind of local accelerator (``torch.accelerator``), or ``None`` where there is none."""
    if hasattr(torch, "accelerator") and torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return None


def default_device() -> torch.device:
    """The device this rank computes on: the local accelerator if there is one, else the CPU."""
    acc = _accelerator()
    if acc is not None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        index = local_rank % max(1, torch.accelerator.device_count())
        return torch.device(acc.type, index)
    return torch.device("cpu")


def device_backend(group: dist.ProcessGroup, device_type: str) -> str:
    """The backend that runs ``group``'s collectives on tensors of ``device_type``. A group made
    for one backend has its name (``dist.get_backend``), but one made for several devices has one
    per device type: ``init_process_group()`` without a backend reads ``"undefined"`` (gloo for CPU
    tensors, NCCL for CUDA ones on a GPU host), ``backend="cpu:gloo,cuda:nccl"`` reads that whole
    string. Both are NCCL for CUDA tensors, and the runtime's choices that depend on NCCL (one
    launch order on every rank: [Note: one issue order for NCCL] in engine.py) must see it."""
    return backend_in_config(dist.get_backend_config(group), dist.get_backend(group), device_type)


def backend_in_config(config: str, name: str, device_type: str) -> str:
    """The backend a process group's configuration (``dist.get_backend_config``: ``"cpu:gloo,cuda:nccl"``)
    names for ``device_type``; ``name`` (``dist.get_backend``) where it names none per device; the
    first it names where it names none for ``device_type``."""
    pairs = dict(item.split(":", 1) for item in config.split(",") if ":" in item)
    if not pairs:
        return name
    return pairs.get(device_type, next(iter(pairs.values())))


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
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None  # None: torch's default
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)
        if dist.get_rank() == 0:
            logger.info("autodist: initialised process group (%s, world size %d)", backend, dist.get_world_size())
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        logger.info("autodist: no torchrun environment; running as a world of one (%s)", backend)
    return device


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout ``group``'s collectives run under, or ``None`` where torch does not expose it.

    [Note: inherited timeout] ``dist.new_group`` defaults to the backend's default timeout (30 min
    for gloo, 10 min for NCCL), not to the one given to ``init_process_group``. The groups a
    :class:`Comm` creates take the timeout of the group they are made from, so a stalled rank makes
    the others fail after the user's timeout, as under DDP, instead of hanging until the launcher
    kills them. torch keeps the timeout in the backend's options (``_get_backend(device).options
    ._timeout`` on gloo and NCCL, checked on torch 2.14); where a backend does not expose it the
    groups get torch's default, as ``new_group`` would give them.
    """
    timeout = _backend_option(group, "_timeout", datetime.timedelta)
    if timeout is None:
        logger.debug("autodist: the timeout of process group %s is not exposed; new groups get torch's default", group)
    return timeout


def backend_workers(group: dist.ProcessGroup) -> int:
    """How many collectives ``group``'s backend works on at once: gloo's worker threads (its options'
    ``_threads``, 2 by default; checked on torch 2.14), else 1 (NCCL runs a group's collectives in
    order on one stream). The simulator allocates staging buffers by it (autodist/cost/simulator.py
    [Note: collectives taken up at once])."""
    threads = _backend_option(group, "_threads", int)
    return threads if threads is not None and not isinstance(threads, bool) and threads >= 1 else 1


def _backend_option(group: dist.ProcessGroup, name: str, kind: type) -> Any:
    """The option ``name`` of ``group``'s backend (the CPU's, then the accelerator's) if it is a
    ``kind``, else ``None``: torch keeps a backend's options in ``_get_backend(device).options``."""
    device_types = ["cpu"]
    acc = _accelerator()
    if acc is not None:
        device_types.append(acc.type)
    for device_type in device_types:
        try:
            backend = group._get_backend(torch.device(device_type))
        except (RuntimeError, ValueError, AttributeError):  # no backend for this device type
            continue
        value = getattr(getattr(backend, "options", None), name, None)
        if isinstance(value, kind):
            return value
    return None


def _new_group(ranks: list[int], timeout: datetime.timedelta | None, backend: str | None = None) -> dist.ProcessGroup:
    """A process group of ``ranks`` (this rank among them), made by them alone
    (see [Note: AutoDist's own process groups])."""
    pg = dist.new_group(ranks, timeout=timeout, backend=backend, use_local_synchronization=True)
    if not isinstance(pg, dist.ProcessGroup):  # torch's marker for a rank outside ``ranks``
        raise ValueError(
            f"autodist: rank {dist.get_rank()} made a process group of ranks {ranks}, which it is not one of; "
            "make the group this rank wraps its model on one it belongs to"
        )
    return pg


def _pickled(obj: object) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _unpickled(data: torch.Tensor, size: int) -> Any:
    return pickle.loads(data[:size].numpy().tobytes())


class Comm:
    """The collectives of one AutoDist instance, on its own gather and reduce process groups.

    [Note: AutoDist's own process groups] Gathers and reductions run on two groups of the mesh's
    ranks made here, so that they can proceed concurrently, and a third (gloo on every backend)
    carries the collective-order check and the exchange of objects. They are made with
    ``use_local_synchronization``: only the mesh's ranks take part, and torch names such a group by
    a hash of its ranks. Made the default way, a group's name is c10d's group counter alone, and a
    collective over the whole job: two meshes of disjoint ranks wrapping at once
    (``new_subgroups``, a pipeline's stages) made groups of the same name, whose rendezvous keys in
    the store collided, and a rank could connect to another mesh's peer and hang (seen on 4 CPU
    ranks, one run in three). Every rank that makes a group still
    advances torch's group counter, so a job that later makes a group over every rank needs every
    rank to have wrapped the same number of AutoDist instances. The comm sweep makes no group of the
    mesh's ranks (it measures through :meth:`sharing_groups`), and none at all on a mesh smaller
    than the job (autodist/measure/overhead.py [Note: a one-rank world of its own])."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        group = group if group is not None else dist.group.WORLD
        if group is None:
            raise ValueError(
                "autodist: no default process group; call autodist.init_distributed() or "
                "torch.distributed.init_process_group() before wrapping a model"
            )
        self.group: dist.ProcessGroup = group
        self.backend = dist.get_backend(self.group)  # its name; what runs a device's tensors: backend_for
        self._backend_of: dict[str, str] = {}
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        ranks = dist.get_process_group_ranks(self.group)
        self._group_timeout: datetime.timedelta | None = None
        if self.world_size > 1:
            timeout = self._group_timeout = group_timeout(self.group)  # see [Note: inherited timeout]
            self.gather_pg = _new_group(ranks, timeout)
            self.reduce_pg = _new_group(ranks, timeout)
            # the collective-order check and the exchange of objects run on the host (gloo), on a
            # group of their own: on NCCL they neither synchronise the device nor wait on the step's
            # critical path (see check_sequence), and :meth:`destroy` can end its threads (see
            # [Note: object exchanges and interpreter exit])
            self.check_pg = _new_group(ranks, timeout, backend="gloo")
        else:
            self.gather_pg = self.reduce_pg = self.check_pg = self.group
        # sharding over the whole group until shard_within() splits it (see [Note: hybrid sharding])
        self.shard_size, self.shard_rank, self.replicas = self.world_size, self.rank, 1
        self.scatter_pg: dist.ProcessGroup = self.reduce_pg
        self.replicate_pg: dist.ProcessGroup | None = None
        self._world_gather_pg = self.gather_pg  # kept when shard_within splits the gathers
        self._hybrid_pgs: list[dist.ProcessGroup] = []
        self._owns_groups = True
        self.stats = CommStats()
        self.sequence = CollectiveSequence()
        # a sequence check in flight: (work, tensor, entries, interleaving)
        self._check: tuple[dist.Work, torch.Tensor, list[str], bool] | None = None
        self._calls: dict[str, int] = {}  # calls of each kind that every rank must make (rendezvous)

    def sharing_groups(self, *, whole_world: bool = False) -> Comm:
        """A ``Comm`` on this one's process groups with statistics and a collective sequence of its
        own: it makes no group, and its :meth:`destroy` leaves the groups to this one.
        ``whole_world``: sharding over the whole group even where :meth:`shard_within` split this
        one (the comm sweep measures collectives over the world)."""
        twin = object.__new__(Comm)
        for name in (
            "group", "backend", "_backend_of", "_calls", "_group_timeout", "rank", "world_size", "gather_pg", "reduce_pg", "check_pg",
            "shard_size", "shard_rank", "replicas", "scatter_pg", "replicate_pg", "_world_gather_pg",
        ):
            setattr(twin, name, getattr(self, name))
        if whole_world:
            twin.gather_pg, twin.scatter_pg, twin.replicate_pg = self._world_gather_pg, self.reduce_pg, None
            twin.shard_size, twin.shard_rank, twin.replicas = self.world_size, self.rank, 1
        twin._hybrid_pgs = []
        twin._owns_groups = False
        twin.stats = CommStats()
        twin.sequence = CollectiveSequence()
        twin._check = None
        return twin

    def shard_within(self, rows: list[list[int]]) -> None:
        """Shard within groups of ranks and replicate across them (FSDP2's HSDP).

        [Note: hybrid sharding] ``rows`` are the shard groups, global ranks, every one of the same
        size and together the ranks of this ``Comm``'s group: row ``i``, column ``j`` of a 2-D
        mesh of shape (replicas, shard_size). A sharded parameter is split over the ranks of this
        rank's row only (its position in the row is its shard index, as DTensor's ``Shard(0)`` on
        the mesh's last dimension has it). Gathers run over the row (``gather_pg``), gradients are
        reduce-scattered over the row (``scatter_pg``, a group of its own so that the two streams
        stay matched, see [Note: two process groups]) and the reduced shard is then all-reduced
        over this rank's column (``replicate_pg``): every rank of a column holds the same shard.
        Each gradient is divided by the whole world once, before the reduce-scatter, so the
        result is the mean over every rank. Replicated buckets and everything else still run on
        the whole group. A collective: every rank of the group calls it with the same rows."""
        size = len(rows[0]) if rows else 0
        members = sorted(r for row in rows for r in row)
        if not rows or any(len(row) != size for row in rows) or members != sorted(dist.get_process_group_ranks(self.group)):
            raise ValueError(
                f"autodist: shard groups {rows} do not tile the ranks of the process group "
                f"({dist.get_process_group_ranks(self.group)}) into groups of one size"
            )
        if size == self.world_size:
            return
        me = dist.get_rank()
        row = next(r for r in rows if me in r)
        j = row.index(me)
        column = [r[j] for r in rows]
        timeout = group_timeout(self.group)
        if size > 1:
            self.gather_pg = _new_group(row, timeout)
            self.scatter_pg = _new_group(row, timeout)
            self._hybrid_pgs += [self.gather_pg, self.scatter_pg]
        else:
            # a shard group of one rank gathers and scatters by a copy (no group needed)
            self.gather_pg = self.scatter_pg = self.check_pg
        self.replicate_pg = _new_group(column, timeout)
        self._hybrid_pgs.append(self.replicate_pg)
        self.shard_size, self.shard_rank, self.replicas = size, j, len(rows)

    def _record(self, kind: str, label: str) -> None:
        self.stats.record(kind, label)
        self.sequence.record(kind, label)

    # -- parameter all-gather -----------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, label: str, *, on_demand: bool = False) -> InFlight:
        self.stats.all_gathers += 1
        self.stats.on_demand_gathers += int(on_demand)
        self.stats.gathered_bytes += out.numel() * out.element_size()
        self._record("all_gather", label)
        if self.shard_size == 1:
            with _issuing(f"autodist::all_gather({label})"):
                out.copy_(inp)
            return InFlight(None, (out, inp), label)
        with _issuing(f"autodist::all_gather({label})"):
            work = _all_gather_flat(out, inp, group=self.gather_pg, async_op=True)
        return InFlight(work, (out, inp), f"all_gather({label})", self.stats, self)

    # -- gradient reductions ------------------------------------------------------------------
    def rendezvous(self, call: str, fix: str, timeout_s: float | None = None) -> None:
        """Wait until every rank of the group has made its call of ``call`` with this one (the n-th
        on each), through the job's store. Past half the group's timeout (at most
        ``RENDEZVOUS_MAX_S``) log a warning naming the ranks that have not and ``fix``; past
        ``timeout_s`` (default: ``RENDEZVOUS_SHARE`` of the group's timeout, so before the
        collectives the others wait in time out) raise it as a :class:`RankMismatchError`.

        [Note: a collective called on some ranks only] ``model.state_dict()`` under a plan that
        shards gathers every sharded parameter: a collective. DDP's state dict is local, and DDP
        code saves it with ``if rank == 0: torch.save(model.state_dict(), path)``; here that left
        rank 0 waiting in a gather no other rank joined, while the others went on into the next
        step's collectives, until the process group's timeout (30 minutes on gloo), then a
        transport error. The ranks meet in the store first, which no training collective uses, so
        the caller gets an error that says what to do while the others still wait for it in the
        next step's collectives (when its process ends they stop with a :class:`PeerFailure`
        naming it). A rank may also just be late — rank 0 alone saving a large checkpoint before
        every rank calls — so nothing is raised before the collective itself would have timed out:
        the warning comes early, the error at ``RENDEZVOUS_SHARE`` of the timeout (the collective
        waited the whole of it). The meeting's keys are deleted once every rank has met."""
        if self.world_size == 1:
            return
        get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
        if get_store is None:
            return
        n = self._calls[call] = self._calls.get(call, 0) + 1
        group_s = self._group_timeout.total_seconds() if self._group_timeout is not None else None
        warn_s = min(RENDEZVOUS_MAX_S, group_s / 2) if group_s is not None else RENDEZVOUS_MAX_S
        if timeout_s is None:
            timeout_s = RENDEZVOUS_SHARE * group_s if group_s is not None else RENDEZVOUS_UNKNOWN_S
        try:
            store = dist.PrefixStore(f"autodist/rendezvous/{self.check_pg.group_name}/{call}/{n}", get_store())
            store.set(str(self.rank), "1")
            store.add("arrived", 1)
        except Exception:  # no store to meet in (a launcher without one): the collective itself follows
            return
        start = time.monotonic()
        delay, warned = 0.001, False

        def absent() -> str:
            return ", ".join(str(r) for r in range(self.world_size) if not store.check([str(r)]))

        while store.add("arrived", 0) < self.world_size:
            waited = time.monotonic() - start
            if waited > timeout_s:
                missing = absent()
                # withdrawn, so that a later call on every rank meets at this count again
                store.add("arrived", -1)
                store.delete_key(str(self.rank))
                self._calls[call] = n - 1
                raise RankMismatchError(
                    f"{call} was called on rank {self.rank} but not on rank(s) {missing} within {timeout_s:.0f} s: "
                    f"under this plan it is a collective, which every rank must call. {fix}"
                )
            if not warned and waited > warn_s:
                warned = True
                logger.warning(
                    "autodist: rank %d has waited %.0f s for rank(s) %s to call %s; under this plan it is a collective, "
                    "which every rank must call (still waiting, until %.0f s). %s",
                    self.rank, waited, absent(), call, timeout_s, fix,
                )
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        try:
            if store.add("left", 1) == self.world_size:  # every rank has seen the meeting: its keys go
                for key in ("arrived", "left", *map(str, range(self.world_size))):
                    store.delete_key(key)
        except Exception:  # a store that cannot delete keeps them: a few bytes a meeting
            pass

    def backend_for(self, device_type: str) -> str:
        """The backend that runs this group's collectives on tensors of ``device_type``
        (:func:`device_backend`), looked up once per device type."""
        name = self._backend_of.get(device_type)
        if name is None:
            name = self._backend_of[device_type] = device_backend(self.group, device_type)
        return name

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, label: str) -> InFlight:
        self.stats.reduce_scatters += 1
        self.stats.reduced_bytes += inp.numel() * inp.element_size()
        self._record("reduce_scatter", label)
        if self.shard_size == 1:
            with _issuing(f"autodist::reduce_scatter({label})"):
                out.copy_(inp.view(-1)[: out.numel()])
            return InFlight(None, (out, inp), label)
        if self.backend_for(inp.device.type) == "gloo":
            # [Note: gloo reduce-scatter] gloo's flat reduce-scatter clones its whole input first;
            # the list form reduces in place from views (measured: half the transient memory and
            # ~30% faster for 16 MiB shards on 2 ranks). It still allocates one output-sized buffer
            # of its own when issued, freed with the work handle.
            chunks = list(inp.view(self.shard_size, -1).unbind(0))
            with _issuing(f"autodist::reduce_scatter({label})"):
                work: dist.Work | None = dist.reduce_scatter(out, chunks, group=self.scatter_pg, async_op=True)
        else:
            with _issuing(f"autodist::reduce_scatter({label})"):
                work = _reduce_scatter_flat(out, inp, group=self.scatter_pg, async_op=True)
        return InFlight(work, (out, inp), f"reduce_scatter({label})", self.stats, self)

    def all_reduce_replicas(self, buf: torch.Tensor, label: str) -> InFlight:
        """All-reduce a reduce-scattered shard over the ranks holding the same shard (see [Note:
        hybrid sharding]); nothing to do when there is one replica."""
        if self.replicate_pg is None or self.replicas == 1:
            return InFlight(None, (buf,), label)
        self.stats.all_reduces += 1
        self.stats.reduced_bytes += buf.numel() * buf.element_size()
        self._record("all_reduce", f"{label}:replicas")
        with _issuing(f"autodist::all_reduce({label}:replicas)"):
            work = dist.all_reduce(buf, group=self.replicate_pg, async_op=True)
        return InFlight(work, (buf,), f"all_reduce({label}:replicas)", self.stats, self)

    def all_reduce(self, buf: torch.Tensor, label: str) -> InFlight:
        self.stats.all_reduces += 1
        self.stats.reduced_bytes += buf.numel() * buf.element_size()
        self._record("all_reduce", label)
        if self.world_size == 1:
            with _issuing(f"autodist::all_reduce({label})"):
                pass
            return InFlight(None, (buf,), label)
        with _issuing(f"autodist::all_reduce({label})"):
            work = dist.all_reduce(buf, group=self.reduce_pg, async_op=True)
        return InFlight(work, (buf,), f"all_reduce({label})", self.stats, self)

    # -- synchronous helpers ------------------------------------------------------------------
    def broadcast_tensors(self, tensors: list[torch.Tensor], label: str, src: int = 0) -> None:
        """Broadcast ``tensors`` from ``src`` in place, one flat message per dtype."""
        if self.world_size == 1 or not tensors:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        src_global = dist.get_global_rank(self.reduce_pg, src) if self.reduce_pg is not dist.group.WORLD else src
        with profiled_range(f"autodist::broadcast({label})"):
            for group in by_dtype.values():
                if len(group) == 1 and group[0].is_contiguous():  # no flat copy of a lone tensor
                    self.stats.broadcasts += 1
                    self._record("broadcast", label)
                    dist.broadcast(group[0].detach(), src=src_global, group=self.reduce_pg)
                    continue
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                self.stats.broadcasts += 1
                self._record("broadcast", label)
                dist.broadcast(flat, src=src_global, group=self.reduce_pg)
                offset = 0
                with torch.no_grad():
                    for t in group:
                        n = t.numel()
                        t.copy_(flat[offset : offset + n].view_as(t))
                        offset += n
                # freed now, not whenever the backend's thread drops its reference to the message
                flat.untyped_storage().resize_(0)

    def check_sequence(self, *, interleaving: bool = False, wait: bool = True) -> None:
        """Compare this step's collective sequences across ranks (per process group; and their
        interleaving if ``interleaving``); raise on every rank if they differ (see [Note: checking
        the collective order across ranks]). ``wait=False``: start the comparison (a host-side
        all-reduce on ``check_pg``) and finish it at the next :meth:`finish_sequence_check`, so the
        step does not wait for it (on NCCL: the next forward reports a divergence)."""
        self.finish_sequence_check()
        seq = self.sequence
        if self.world_size == 1:
            seq.reset()
            return
        streams = CollectiveSequence.STREAMS if interleaving else CollectiveSequence.STREAMS[:2]
        t = torch.tensor(seq.digest(streams), dtype=torch.int64)
        with _WithoutPythonTLS():
            work = dist.all_reduce(t, group=self.check_pg, async_op=True)
        self._check = (work, t, list(seq.entries), interleaving)
        seq.reset()
        if wait:
            self.finish_sequence_check()

    def finish_sequence_check(self) -> None:
        """Wait for a sequence check in flight and raise if the ranks diverged."""
        if self._check is None:
            return
        work, t, entries, interleaving = self._check
        self._check = None
        work.wait()
        sums = t.tolist()
        n, half = self.world_size, len(sums) // 2
        bad = [i // 4 for i in range(half) if n * sums[half + i] != sums[i] ** 2]
        if not bad:
            return
        everyone = self.all_gather_object(entries)
        first = next((r for r in range(n) if everyone[r] != everyone[0]), 1)
        a, b = everyone[0], everyone[first]
        i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        late = sorted({e[len("late_gradient(") : -1] for r in everyone for e in r if e.startswith("late_gradient(")})
        if late:
            names = sorted({n for e in late for n in e.rsplit("@", 1)[0].split(",")})
            ranks = sorted({int(e.rsplit("@", 1)[1]) for e in late})
            raise RankMismatchError(LATE_GRADIENT.format(
                names=", ".join(map(repr, names)), where=f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "))
        what0 = a[i] if i < len(a) else "nothing more"
        what1 = b[i] if i < len(b) else "nothing more"
        if "optimizer_step" in what0 + what1:
            stepped, skipped = (0, first) if what0.startswith("optimizer_step") else (first, 0)
            raise RankMismatchError(
                f"the optimizer stepped on rank {stepped} but not on rank {skipped} after the same backward, so "
                "their parameters now differ. A torch.amp.GradScaler skips the step on a rank that finds inf/NaN "
                "in its gradients; with a plan that shards some units and replicates others, each rank holds only "
                "its shard of a sharded gradient, and torch combines that finding across ranks only when the first "
                "gradient it checks is sharded. Use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler, "
                "which combines it over the ranks, and skip or take every step on every rank alike."
            )
        if set(bad) == {2}:
            raise RankMismatchError(
                f"ranks interleaved gathers and reductions differently in a step (collective #{i + 1} was {what0} "
                f"on rank 0 but {what1} on rank {first}); NCCL needs one launch order on every rank or it "
                "can deadlock. A parameter got its gradient on some ranks only: make every unit's control flow the "
                "same on every rank, or use a plan that replicates everything."
            )
        raise RankMismatchError(
            f"ranks issued different collectives in a step: collective #{i + 1} was {what0} on rank 0 but "
            f"{what1} on rank {first}. Sharded units must run in the same order on every rank (units some ranks "
            "leave out are gathered there all the same; a unit run again, or in another order, on some ranks is "
            "not): a unit whose control flow depends on the rank must be replicated (make its placement "
            "'replicate' in the plan), or make the control flow the same on every rank."
        )

    # -- objects ------------------------------------------------------------------------------
    # [Note: object exchanges and interpreter exit]
    # Plans, profiles, statuses and errors are exchanged as pickles in host tensors on ``check_pg``,
    # a gloo group of AutoDist's own. A gloo collective runs on one of its group's worker threads,
    # and that thread drops its reference to the work after the caller has been woken; when it is
    # the last reference, the thread frees the work's tensors, which were made in Python, and takes
    # the GIL to do so. When every rank refuses a plan, the job exits right after the exchange that
    # found the error, and the thread could still be waiting for the GIL when the interpreter
    # finalised: it was then torn down inside the destructor, and the process aborted ("terminate
    # called without an active exception"; a core dump shows ~AsyncAllgatherWork under
    # ProcessGroupGloo::runLoop, in take_gil). It aborted in 4 of 12 launches on 2 CPU ranks; a
    # barrier after the exchange did not help (1 of 20, then 3 of 24: a gloo barrier holds the works
    # queued before it). Keeping the works referenced until the next exchange does not either: the
    # worker thread was seen dropping its reference after the caller had started the next one. What does
    # help is ending the threads: :meth:`destroy` destroys the groups this Comm made and lets go of
    # them, so the process groups are freed, which waits for their queued work and joins their
    # threads (torch releases the GIL to free a process group). Every error that ends the job on
    # every rank destroys the Comm before it leaves AutoDist (wrapper.py, planner/online.py): 0 of 30
    # launches aborted.
    def _host_rank(self, rank: int) -> int:
        """The rank in ``check_pg`` of rank ``rank`` of ``group``."""
        return dist.get_group_rank(self.check_pg, dist.get_global_rank(self.group, rank))

    def all_gather_object(self, obj: T) -> list[T]:
        """Every rank's ``obj``, indexed by rank in ``group`` (every rank passes the same type)."""
        if self.world_size == 1:
            return [obj]
        mine = _pickled(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([mine.numel()]), group=self.check_pg)
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: mine.numel()] = mine
        datas = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(datas, padded, group=self.check_pg)
        by_host_rank = [_unpickled(d, int(s)) for d, s in zip(datas, sizes)]
        return [by_host_rank[self._host_rank(r)] for r in range(self.world_size)]

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """Rank ``src``'s ``obj`` (a rank in ``group``) on every rank; rank ``src`` gets ``obj`` itself."""
        if self.world_size == 1:
            return obj
        root = dist.get_global_rank(self.group, src)
        data = _pickled(obj) if self.rank == src else None
        size = torch.tensor([0 if data is None else data.numel()])
        dist.broadcast(size, src=root, group=self.check_pg)
        if data is None:
            data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, src=root, group=self.check_pg)
        return obj if self.rank == src else _unpickled(data, int(size))

    def destroy(self) -> None:
        """Destroy the groups this ``Comm`` made and let go of them, ending their backend threads
        (see [Note: object exchanges and interpreter exit]); the ``Comm`` is not used afterwards."""
        if self.world_size > 1 and self._owns_groups:
            for pg in dict.fromkeys([*self._hybrid_pgs, self.gather_pg, self._world_gather_pg, self.reduce_pg, self.check_pg]):
                try:
                    dist.destroy_process_group(pg)
                except (ValueError, RuntimeError):  # already destroyed with the default group
                    pass
            del self.gather_pg, self._world_gather_pg, self.reduce_pg, self.check_pg, self.scatter_pg, self.replicate_pg
            self._hybrid_pgs = []
            self._owns_groups = False
