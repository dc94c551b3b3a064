"""Gather groups: the fused all-gather of consecutive sharded units, and its state machine.

A group is ``SHARDED`` (full storage released), ``GATHERING`` (an all-gather is in flight; its
buffers travel in the :class:`InFlight`), or ``GATHERED`` (every parameter's ``full`` tensor holds the
current values). All transitions happen in this file.

A persistent group stays ``GATHERED`` across steps. After every optimizer step that updates its
shards it is refreshed by one all-gather, issued at the next forward's start and waited for at the
next use — unconditionally, because an optimizer, or the user's code after it, may write ``p.data``
without bumping any version counter (Lion and many research optimizers do; [Note: when persistent
groups are refreshed] in optimizers.py). Between steps, staleness is also read from the visible
parameters' version counters, so a parameter updated in place through the visible parameter
(``p.clamp_()``) is re-gathered before use, and :meth:`GatherGroupRuntime.ensure` checks again after
waiting: a gather whose shards changed while it was in flight is issued again.

[Note: overwriting gathered parameters] Re-gathering into a group that is already ``GATHERED``
overwrites full tensors that autograd may have saved for a backward that has not run yet (a forward,
then an in-place edit of the parameter, then the backward). Such a re-gather bumps the full tensors'
version counters, so that backward fails with autograd's "modified by an inplace operation" error
instead of silently using weights other than its forward's. Gathering into released storage (after
``free``) does not bump them: that is the normal after-forward/backward cycle, in which autograd's
saved reference must stay valid (see params.py).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .comm import Comm, InFlight, release
from .params import ManagedParam


class GroupState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


@dataclass
class _DtypeLayout:
    """The part of a group gathered in one dtype: one collective, params at column offsets."""

    dtype: torch.dtype
    params: list[ManagedParam]
    sizes: list[int]
    total: int
    contiguous_send: torch.Tensor | None = None
    _outs: list[torch.Tensor] = field(default_factory=list)

    def outs(self) -> list[torch.Tensor]:
        """Each parameter's padded full storage as (ranks, its shard), where the gathered rows go:
        aliases made on the first gather and kept (the storage behind them is resized, never
        replaced), not two views per parameter per gather."""
        if len(self._outs) != len(self.params):
            self._outs = [mp.full_padded_2d() for mp in self.params]
        return self._outs

    def find_contiguous_send(self) -> None:
        """If every shard is already in ``dtype`` and they are adjacent in memory, send in place."""
        shards = [mp.flat_shard() for mp in self.params]
        first = shards[0]
        if any(shard.dtype != self.dtype for shard in shards):
            return
        expect = first.data_ptr()
        for shard in shards:
            if shard.data_ptr() != expect or shard.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
                return
            expect += shard.numel() * shard.element_size()
        base = first.untyped_storage()
        offset = first.storage_offset()
        flat = torch.empty(0, dtype=self.dtype, device=first.device).set_(base, offset, (self.total,), (1,))
        self.contiguous_send = flat


class GatherGroupRuntime:
    def __init__(
        self,
        index: int,
        units: list[str],
        params: list[ManagedParam],
        *,
        residency: str,
        forward_window: int,
        backward_window: int,
        comm: Comm,
        device: torch.device,
    ) -> None:
        self.index = index
        self.units = units
        self.params = params
        self.residency = residency
        self.forward_window = forward_window
        self.backward_window = backward_window
        self.comm = comm
        self.device = device
        self.label = units[0] if len(units) == 1 else f"{units[0]}..{units[-1]}"
        layouts: dict[torch.dtype, _DtypeLayout] = {}
        for mp in params:
            lay = layouts.setdefault(mp.compute_dtype, _DtypeLayout(mp.compute_dtype, [], [], 0))
            lay.params.append(mp)
            lay.sizes.append(mp.shard_numel)
            lay.total += mp.shard_numel
        self.layouts = list(layouts.values())
        for lay in self.layouts:
            lay.find_contiguous_send()
        self.all_trainable = all(mp.requires_grad for mp in params)
        self.n_trainable = sum(mp.requires_grad for mp in params)
        self.full_bytes = sum(mp.full_nbytes for mp in params)
        self.state = GroupState.SHARDED
        self._inflight: list[InFlight] = []
        self._versions: tuple[int, ...] = ()
        self._fresh = False  # see is_stale
        # an optimizer stepped over the shards: gather again at the next forward ([Note: when
        # persistent groups are refreshed] in optimizers.py)
        self.refresh_due = False
        self.record: Callable[[str, object], None] | None = None  # the engine's action log, when on
        self.reset_step()

    def reset_step(self) -> None:
        """Per-step bookkeeping (see [Note: post-backward] in backward.py)."""
        self.active = 0  # modules using this group currently inside their forward
        self.used = False  # a module used it this step (gathering it again later is planned, e.g. tied weights)
        self.fwd_done: set[str] = set()  # units that finished their forward in this forward
        self.fwd_expected: set[str] = set(self.units)  # units whose forward frees the group when all are done
        self.grads_ready = 0  # trainable parameters whose gradient has been accumulated
        self.tokens_pending = 0  # post-backward signals attached and not fired
        self.tokens_fired = 0
        self.untokened = False  # a forward with gradients whose inputs need none (no signal)
        self.hold = False  # gathered again in backward after every signal fired: keep to the end

    # ------------------------------------------------------------------------------------------
    def is_stale(self) -> bool:
        """The shards changed since they were gathered (their version counters moved). Found fresh
        once, a group stays fresh until :meth:`recheck` (every root forward) or a new gather: every
        module using it in a step asked again, a version read per parameter each time (on a
        48-layer model, ~14,000 reads a step)."""
        if self._fresh:
            return False
        stale = tuple(mp.version() for mp in self.params) != self._versions
        self._fresh = not stale
        return stale

    def recheck(self) -> None:
        """The next :meth:`is_stale` reads the version counters (a step begins: the optimizer or
        the user may have written the shards since the last one)."""
        self._fresh = False

    def mark_stale(self) -> None:
        """The shards were written behind the version counters' back (``load_state_dict``)."""
        self._versions = ()
        self._fresh = False

    def needs_gather(self) -> bool:
        if self.state is GroupState.SHARDED:
            return True
        return self.state is GroupState.GATHERED and self.is_stale()

    def issue(self, *, on_demand: bool = False, force: bool = False) -> bool:
        """Start the all-gather if the group is not gathered, is stale, or ``force`` (the shards were
        written where no version counter shows it). Returns whether it did."""
        if self.state is GroupState.GATHERING:
            if not force:
                return False
            self.wait()
        if not force and not self.needs_gather():
            return False
        world = self.comm.shard_size  # the ranks a parameter is sharded over
        overwrite = self.state is GroupState.GATHERED  # see [Note: overwriting gathered parameters]
        self._versions = tuple(mp.version() for mp in self.params)
        self._fresh = False  # a write while the gather is in flight shows at the next check
        for lay in self.layouts:
            single = lay.params[0] if len(lay.params) == 1 else None
            if lay.contiguous_send is not None:
                send = lay.contiguous_send  # the shards already lie side by side: no copy-in
            else:
                send = torch.empty(lay.total, dtype=lay.dtype, device=self.device)
                for dst, mp in zip(torch.split(send, lay.sizes), lay.params):
                    dst.copy_(mp.flat_shard())
            if single is not None:
                # One parameter: gather straight into its full storage (no copy-out, no extra buffer).
                single.alloc_full()
                recv = single.full_padded_flat()
            else:
                recv = torch.empty(world * lay.total, dtype=lay.dtype, device=self.device)
            self._inflight.append(self.comm.all_gather(recv, send, self.label, on_demand=on_demand))
        if overwrite:
            for mp in self.params:
                torch.autograd.graph.increment_version(mp.full)
        self.state = GroupState.GATHERING
        if self.record is not None:
            self.record("gather", self.label)
        return True

    def in_flight(self) -> list[InFlight]:
        """The collectives issued and not yet waited for (empty unless gathering)."""
        return list(self._inflight)

    def wait(self) -> None:
        """Finish an in-flight gather: copy each parameter's rows out of the gathered buffer."""
        if self.state is not GroupState.GATHERING:
            return
        world = self.comm.shard_size  # the ranks a parameter is sharded over
        for lay, inflight in zip(self.layouts, self._inflight):
            inflight.wait()
            if len(lay.params) == 1:
                continue  # gathered in place
            recv = inflight.buffers[0].view(world, lay.total)
            for mp in lay.params:
                mp.alloc_full()
            torch.split_with_sizes_copy(recv, lay.sizes, dim=1, out=lay.outs())
            release(recv, *(() if lay.contiguous_send is not None else inflight.buffers[1:]))
        self._inflight.clear()  # drops the buffers: they have been waited on
        self.state = GroupState.GATHERED

    def ensure(self) -> bool:
        """Make the full parameters valid now. Returns True if this had to gather on demand.

        A gather whose shards changed while it was in flight (its version counters moved) is issued
        again; two rounds suffice unless something writes the shards concurrently."""
        on_demand = self.issue(on_demand=True)
        self.wait()
        if self.is_stale():
            self.issue(on_demand=True)
            self.wait()
            on_demand = True
        return on_demand

    def quiesce(self) -> None:
        """Wait for an in-flight gather (it reads the shards: call before writing them)."""
        if self.state is GroupState.GATHERING:
            self.wait()

    def free(self) -> None:
        if self.state is GroupState.GATHERING:
            self.wait()  # a collective must be consumed before its buffers go
        if self.state is GroupState.GATHERED:
            for mp in self.params:
                mp.free_full()
            self.state = GroupState.SHARDED
            if self.record is not None:
                self.record("free", self.label)
