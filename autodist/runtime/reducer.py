"""Gradient buckets: one asynchronous collective per plan bucket, launched in bucket order.

A bucket is launched as soon as its last gradient is ready *and* every earlier bucket has been
launched, so every rank issues the same collectives in the same order. At the end of backward every
bucket still waiting is flushed: gradients that never arrived contribute zeros.

[Note: used flags] Each bucket carries one extra element per parameter, 1 if this rank produced a
gradient for it. After the reduction a parameter whose flag sum is zero was unused on *every* rank;
its ``.grad`` is left untouched (``None`` stays ``None``), exactly as DDP with
``find_unused_parameters`` does, so optimizers that skip gradient-less parameters behave the same as
in single-process training. The flags cost a few bytes per bucket and no extra collective.

[Note: gradients as bucket views] A replicated bucket owns a persistent flat buffer and, after the
reduction, each parameter's ``.grad`` *is* a view into it (DDP's ``gradient_as_bucket_view``). If the
user keeps gradients across steps (no ``zero_grad`` or ``zero_grad(set_to_none=False)``), autograd
accumulates straight into the view and nothing is copied; otherwise the fresh gradient is copied in
once, and the parameter's ``.grad`` becomes the view right then, so autograd's tensor is freed as it
arrives rather than at the end of backward (as DDP's hook does: no gradient is held twice, and the
simulator's accounting — gradients are the bucket — holds). A later accumulation (reentrant
checkpointing) then adds into the view in place, before the bucket launches. A gradient the user kept is already reduced and identical on all ranks, so averaging
``old + new_r`` over ranks yields ``old + mean(new)`` — the accumulation DDP gives. A sharded bucket
reduce-scatters into a fresh output buffer each step; existing local gradients are added to.

[Note: views attached before backward] Copying each gradient into its bucket costs a tensor operation
issued from Python per parameter, in the hook, on the issuing thread: on a model of many small
layers that is a large part of the step (DDP does it in C++). So when a backward that synchronises
begins, a replicated parameter whose ``.grad`` is ``None`` (the user called ``zero_grad()``) gets its
zeroed slot view as ``.grad`` (one ``_foreach_zero_`` per bucket), and autograd's AccumulateGrad adds
the gradient into it in place (in C++): the hook then only counts it. The views are attached at the
start of backward, not of forward, so a ``zero_grad()`` between forward and backward does not undo
them, and the user never sees ``.grad`` change before backward. Not attached: parameters whose
gradient dtype differs from the bucket's (a cast is needed), DTensor parameters (an in-place add on a
DTensor gradient is dispatched in Python), and parameters reduced at the end of backward (reentrant
checkpointing of a shared parameter). A slot attached and unused on every rank gets ``None`` back
after the reduction, as if nothing had been attached.

[Note: gradients that reach a parameter outside its bucket] Under a plan with DTensors the forward
computes with other tensors than the visible parameters (gathered ones, compute copies), so a use
of a visible parameter outside the forward (an L2 penalty or FedProx's proximal term added to the
loss through ``.full_tensor()``) is a second autograd leaf: its gradient is accumulated straight
into ``.grad``, whenever autograd reaches it. A bucket that took its gradient with ``.grad`` empty
used to set ``.grad`` to the reduced view when it finished, and a gradient accumulated in between
was lost: with the penalty computed before the forward, the units whose buckets finish at the end
of backward (the first ones) trained without it, silently (mlp under ``fsdp``: 0.028 off in the
first layer's gradient). FSDP2 adds its reduced gradient to a ``.grad`` already there; so does
``finish`` now: whatever ``.grad`` holds when a bucket finishes that the bucket did not put there
is added to the reduced gradient, not reduced with it (it came from a use every rank made alike,
as DTensor's rules assume). So that nothing is written into a buffer while it is communicated, a
gradient kept from the last step in a bucket's view, for a parameter whose forward used another
leaf (a sharded one's gathered tensor, a compute copy, a replicated DTensor's local tensor), is
moved to a copy when the bucket takes its gradient (or launches without one) and added back at
finish: what reached it meanwhile, in place, is then added on every rank alike, never averaged on
some ranks only (``plan="ddp"`` under a bf16 policy with ``zero_grad(set_to_none=False)`` was
2.7e-3 off after 3 steps, and with a rank leaving an expert out of its forward the ranks' copies
diverged). A replicated gradient taken by a cast copy leaves ``.grad`` empty at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .comm import Comm, InFlight, release
from .params import ManagedParam, dense_stride

# After-reduction action per parameter slot: make the slot the gradient; add it into the user's own
# gradient tensor; nothing (the slot already is the gradient and was reduced in place); add back the
# previous gradient saved before a reduce-scatter overwrote the slot.
_SET, _ADD, _KEEP = 0, 1, 2


class BucketRuntime:
    def __init__(
        self,
        index: int,
        op: str,
        params: list[ManagedParam],
        *,
        reduce_dtype: torch.dtype,
        comm: Comm,
        device: torch.device,
    ) -> None:
        self.index = index
        self.op = op
        self.params = params
        self.every = False  # reduced in every micro-batch, also those that do not synchronise
        self.taking = True  # reduced in the current backward (set by Reducer.begin)
        self.record: Callable[[str, object], None] | None = None  # the engine's action log, when on
        self.dtype = reduce_dtype
        self.comm = comm
        self.device = device
        # the ranks a reduce-scatter spans (the shard group) and the ranks every gradient is averaged
        # over (all of them; see [Note: hybrid sharding] in comm.py)
        self.world = comm.shard_size if op == "reduce_scatter" else comm.world_size
        self.divisor = comm.world_size
        self.n = len(params)
        self.label = f"bucket{index}"
        if op == "all_reduce":
            self.sizes = [int(torch.Size(mp.shape).numel()) for mp in params]
        else:
            self.sizes = [mp.shard_numel for mp in params]
        self.offsets = []
        off = 0
        for s in self.sizes:
            self.offsets.append(off)
            off += s
        self.total = off
        self.nbytes = self.total * reduce_dtype.itemsize
        # The persistent buffer: the all-reduce operand, or the reduce-scatter output. Either way the
        # visible gradients are views of it (see [Note: gradients as bucket views]).
        self.buffer = torch.zeros(self.total + self.n, dtype=reduce_dtype, device=device)
        if op == "all_reduce":
            # each slot in its parameter's layout (a channels-last weight's too), so autograd
            # accumulates into it as it is, as into DDP's bucket views
            self.views = [
                self.buffer[o : o + s].as_strided(mp.shape, dense_stride(mp.local))
                for o, s, mp in zip(self.offsets, self.sizes, params)
            ]
        else:
            self.views = [
                self.buffer[o : o + mp.local_rows * mp.row_numel].view(mp.local.shape)
                for o, mp in zip(self.offsets, params)
            ]
        if op == "reduce_scatter":  # its collective writes it whole: storage from the first launch on
            self.buffer.untyped_storage().resize_(0)
        self._grad_objs: list[torch.Tensor | None] = [None] * self.n
        self._swapped = [mp.needs_swap for mp in params]  # fixed for a parameter's life; read on every hook
        self._all_used: dict[torch.dtype, torch.Tensor] = {}  # a reduce-scatter's flags when nothing is missing
        self.used: list[bool] = [False] * self.n  # set by each finish()
        # the slots that may hold their view as ``.grad`` before backward (see [Note: views attached
        # before backward])
        self._attachable = [
            i for i, mp in enumerate(params)
            if op == "all_reduce" and not mp.needs_swap and not mp.is_dtensor and mp.dtype == reduce_dtype
            and mp.requires_grad
        ]
        # (slot, visible parameter, key) of each: what attach_views reads once per backward
        self._attach = [(i, params[i].visible, id(params[i])) for i in self._attachable]
        for i in self._attachable:
            self._grad_objs[i] = self.views[i]  # a plain parameter's gradient object is its view
        self.reset()

    def release_if_unused(self) -> None:
        """A reduce-scatter output holds gradients only until the user drops them
        (``zero_grad(set_to_none=True)``): then its storage goes until the next launch (the views
        and cached gradient objects stay valid; see [Note: why storage is resized instead of
        reallocated] in params.py). All-reduce buffers stay, as DDP's buckets do: they are also
        where gradients are copied during backward."""
        if self.op != "reduce_scatter" or self.inflight is not None:
            return
        storage = self.buffer.untyped_storage()
        if storage.nbytes() and all(mp.visible.grad is None for mp in self.params):
            storage.resize_(0)

    def _ensure_buffer(self) -> None:
        storage = self.buffer.untyped_storage()
        need = self.buffer.numel() * self.buffer.element_size()
        if storage.nbytes() != need:
            storage.resize_(need)

    def grad_obj(self, slot: int) -> torch.Tensor | None:
        """What ``visible.grad`` is set to: the slot view (wrapped once as a DTensor when the
        parameter is one), or ``None`` when dtypes differ and a cast copy is needed."""
        mp = self.params[slot]
        if self.dtype != mp.dtype:
            return None
        if self.op == "reduce_scatter":
            self._ensure_buffer()  # a view handed out as a gradient has storage behind it
        obj = self._grad_objs[slot]
        if obj is None:
            obj = self._grad_objs[slot] = mp.wrap_local_grad(self.views[slot])
        return obj

    def attach_views(self, skip: set[int]) -> None:
        """Make the zeroed slot view the ``.grad`` of every attachable parameter that has none
        (``skip``: ids of parameters not to attach). See [Note: views attached before backward]."""
        if skip:
            todo = [(i, vis) for i, vis, key in self._attach if vis.grad is None and key not in skip]
        else:
            todo = [(i, vis) for i, vis, _ in self._attach if vis.grad is None]
        if not todo:
            return
        views = self.views
        with torch.no_grad():
            if len(todo) == self.n:  # every slot (the common case): one fill of the bucket, not one per view
                self.buffer[: self.total].zero_()
            else:
                torch._foreach_zero_([views[i] for i, _ in todo])
        attached = self.attached
        for i, vis in todo:
            vis.grad = views[i]
            attached[i] = True

    def reset(self) -> None:
        self.attached = [False] * self.n
        self.ready = [False] * self.n
        self.action = [_SET] * self.n
        self.pending = self.n
        self.launched = False
        self.all_local = True
        self.inflight: InFlight | None = None
        self.replicas_due = False  # a reduce-scatter in flight whose shard is still to be all-reduced
        self._input: torch.Tensor | None = None
        self._deferred: list[tuple[int, torch.Tensor]] = []  # gradients held until launch (slot, gradient)

    # ------------------------------------------------------------------------------------------
    def _is_slot_view(self, t: torch.Tensor | None, slot: int) -> bool:
        if t is None or t.layout is not torch.strided:  # a sparse gradient kept over no_sync micro-batches
            return False
        v = self.views[slot]
        return t.dtype == v.dtype and t.data_ptr() == v.data_ptr() and t.shape == v.shape

    def _rs_input(self) -> torch.Tensor:
        if self._input is None:
            self._input = torch.empty(self.world, self.total + self.n, dtype=self.dtype, device=self.device)
        return self._input

    def _flags(self) -> torch.Tensor:
        return torch.tensor([1.0 if r else 0.0 for r in self.ready], dtype=self.dtype).to(self.device)

    def _ar_fill(self) -> None:
        """Copy the held gradients into their slots, in one call."""
        if not self._deferred:
            return
        views = self.views
        with torch.no_grad():
            torch._foreach_copy_([views[s_] for s_, _ in self._deferred], [g_ for _, g_ in self._deferred])
        self._deferred.clear()

    def _rs_fill(self, missing: list[str]) -> None:
        """Lay the held gradients (zeros for ``missing`` ones) and the used flags out in the input:
        each rank's row holds its dim-0 chunk of every gradient, zero padded, then the flags (see
        [Note: copy-in at launch])."""
        held = dict(self._deferred)
        self._deferred.clear()
        dtypes = {g.dtype for g in held.values()}
        dtype = dtypes.pop() if len(dtypes) == 1 else self.dtype  # the gradients' own, where they share one
        parts = []
        for slot, mp in enumerate(self.params):
            got = held.pop(slot, None)
            if got is None:
                got = torch.zeros(mp.shape, dtype=dtype, device=self.device)
            elif got.dtype != dtype:
                got = got.to(dtype)
            parts.append(got)
        if missing:
            parts.append(self._flags().to(dtype).expand(self.world, self.n))
        else:  # every gradient arrived: the same ones each launch, made once (no fill kernel a step)
            ones = self._all_used.get(dtype)
            if ones is None:
                ones = self._all_used[dtype] = torch.ones(self.n, dtype=dtype, device=self.device).expand(self.world, self.n)
            parts.append(ones)
        if dtype == self.dtype:
            torch._chunk_cat(parts, 0, self.world, out=self._rs_input())
            return
        # gradients in the compute dtype, reduced in another: laid out in their own dtype, dropped,
        # and only then converted into the input, so that the gradients, the layout and the input
        # never coexist (the peak is the gradients and the input, as with one dtype)
        laid = torch._chunk_cat(parts, 0, self.world)
        parts.clear()
        self._rs_input().copy_(laid)

    @staticmethod
    def _arrived(g: torch.Tensor | None, mp: ManagedParam) -> torch.Tensor:
        """The gradient a ready hook announced (it is there by then)."""
        if g is None:
            raise RuntimeError(f"autodist: the gradient of {mp.name!r} was announced ready but is None")
        return g

    @staticmethod
    def _taken(g: torch.Tensor | None, mp: ManagedParam) -> torch.Tensor:
        """An arrived gradient as the bucket takes it: dense. A sparse one (``nn.Embedding(...,
        sparse=True)``) is reduced densely, as DDP reduces it when its bucket holds dense ones too."""
        g = BucketRuntime._arrived(g, mp)
        return g if g.layout is torch.strided else g.to_dense()

    def add_grad(self, slot: int, mp: ManagedParam) -> None:
        """Take this rank's gradient for ``mp`` into the bucket (called once per step per parameter)."""
        if self.ready[slot]:
            return
        self.ready[slot] = True
        self.pending -= 1
        if self.op == "all_reduce":
            if not self._swapped[slot]:
                g = mp.visible.grad  # autograd accumulated straight into the visible parameter
                if (g is not None and g is self._grad_objs[slot]) or self._is_slot_view(g, slot):
                    self.action[slot] = _KEEP
                else:
                    self.views[slot].copy_(self._taken(g, mp))
                    # the gradient lives in the bucket from now on: autograd's tensor goes now,
                    # not at the end of backward (see [Note: gradients as bucket views]); a cast
                    # one comes back at finish ([Note: gradients that reach a parameter outside its bucket])
                    obj = self.grad_obj(slot)
                    mp.visible.grad = obj
                    self.action[slot] = _SET if obj is None else _KEEP
            else:
                # a compute-dtype (or DTensor-backed) leaf's gradient: held until the bucket
                # launches, then copied (cast) into the bucket with the others in one call (see
                # [Note: copy-in at launch])
                g = self._taken(mp.take_full_grad(), mp)
                vg = mp.local_grad()
                if vg is not None and self._is_slot_view(vg, slot):
                    # kept from the last step: off the bucket, added back at finish ([Note: gradients
                    # that reach a parameter outside its bucket])
                    mp.set_local_grad(vg.clone())
                    self.action[slot] = _SET
                else:
                    self.action[slot] = _SET if vg is None else _ADD
                self._deferred.append((slot, g))
        else:
            g = self._taken(mp.take_full_grad(), mp)
            vg = mp.local_grad()
            if vg is None:
                self.action[slot] = _SET
            elif self._is_slot_view(vg, slot):  # kept from the last step: the output will overwrite it
                mp.set_local_grad(vg.clone())  # added back at finish (see [Note: gradients that reach ...])
                self.action[slot] = _SET
            else:
                self.action[slot] = _ADD
            # [Note: copy-in at launch] A sharded bucket holds its gradients (in ``_deferred``) until
            # it launches, then lays them out in its input with one ``torch._chunk_cat`` (each
            # gradient's dim-0 chunks in its rank's row, zero padded): per-parameter slicing and
            # copies issued from Python on the hook would cost more host time than small layers'
            # kernels. The gradients and the input coexist only during that copy, as under FSDP2.
            # A replicated bucket does the same for the gradients it cannot take as views (a
            # compute-dtype leaf's, a DTensor-backed one's): one ``_foreach_copy_`` casts them into
            # their slots at launch. The simulator holds them until then too.
            self._deferred.append((slot, g))

    def add_late(self, slot: int, mp: ManagedParam) -> None:
        """Fold a further accumulation of a gradient already taken this step into the bucket (a
        parameter shared by several regions of reentrant activation checkpointing accumulates once
        per region). The bucket must not have been launched."""
        if self.op == "all_reduce" and not mp.needs_swap:
            g = mp.visible.grad
            if g is None or self._is_slot_view(g, slot):
                return
            if self.dtype != mp.dtype:  # taken by a cast copy, ``.grad`` left empty: g is the later part
                self.views[slot].add_(self._taken(g, mp))
                mp.visible.grad = None
            else:  # autograd accumulated into the view out of place: g holds the total
                self.views[slot].copy_(self._taken(g, mp))
                mp.visible.grad = self.grad_obj(slot)
            return
        g = mp.full.grad
        mp.full.grad = None
        if g is None:
            return
        for i, (s_, g_) in enumerate(self._deferred):
            if s_ == slot:
                self._deferred[i] = (s_, g_ + g)
                return
        raise RuntimeError(f"autodist: a late gradient of {mp.name!r} came after its bucket took none")

    def has_pending_grad(self, mp: ManagedParam) -> bool:
        """A gradient accumulated earlier (e.g. under ``no_sync``) for a parameter unused this step."""
        if not mp.needs_swap:
            g = mp.visible.grad
            return g is not None and not self._is_slot_view(g, self.params.index(mp))
        mp.reconcile_shown()  # an accumulator shown as .grad and dropped by zero_grad() is none
        return mp.full.grad is not None or mp.accum is not None

    def launch(self) -> list[str]:
        """Flush missing gradients as zeros and start the collective. Returns names of missing params."""
        missing = []
        for slot, mp in enumerate(self.params):
            if self.ready[slot]:
                continue
            if self.has_pending_grad(mp):
                self.add_grad(slot, mp)
                continue
            missing.append(mp.name)
            if self.op == "all_reduce":
                vg = mp.visible.grad if not mp.needs_swap else mp.local_grad()
                if self._is_slot_view(vg, slot) and mp.needs_swap:  # kept: off the bucket, as in add_grad
                    mp.set_local_grad(self.views[slot].clone())
                    self.views[slot].zero_()
                elif self._is_slot_view(vg, slot):
                    self.action[slot] = _KEEP  # an old, already-reduced gradient: keep it in the sum
                else:
                    self.views[slot].zero_()
        # [Note: flags without host synchronisation] When every gradient arrived (the common case)
        # the flags are filled on the device and never read back: every parameter is then used on
        # at least this rank. Only a bucket with a locally missing gradient builds its flags on the
        # host and reads the reduced flags in finish(), as DDP's find_unused_parameters does.
        self.all_local = not missing
        if self.op == "all_reduce":
            self._ar_fill()
            flag_dst = self.buffer[self.total :]
            if self.all_local:
                flag_dst.fill_(1.0)
            else:
                flag_dst.copy_(self._flags())
        else:
            self._rs_fill(missing)
        if self.op == "all_reduce":
            if self.world > 1:
                self.buffer.div_(self.world)
            self.inflight = self.comm.all_reduce(self.buffer, self.label)
        else:
            inp = self._rs_input()
            if self.divisor > 1:
                inp.div_(self.divisor)
            for slot, mp in enumerate(self.params):
                if not self.ready[slot] and self._is_slot_view(mp.local_grad(), slot):
                    mp.set_local_grad(self.views[slot].clone())  # a kept gradient of an unused parameter
                    self.action[slot] = _SET
            self._ensure_buffer()
            self.inflight = self.comm.reduce_scatter(self.buffer, inp.view(-1), self.label)
            self.replicas_due = self.comm.replicas > 1
            self._input = None  # the InFlight owns it now
        self.launched = True
        if self.record is not None:
            self.record("reduce", self.index)
        return missing

    def advance(self) -> None:
        """Under hybrid sharding: once the reduce-scatter is done, all-reduce the shard across the
        replicas (see [Note: hybrid sharding] in comm.py). Buckets advance in bucket order on every
        rank, so the all-reduces pair across ranks. Nothing to do otherwise."""
        if not self.replicas_due or self.inflight is None:
            return
        self.replicas_due = False
        self.inflight.wait()
        release(self.inflight.buffers[1])  # the input, this launch's own
        self.inflight = self.comm.all_reduce_replicas(self.buffer, self.label)

    def finish(self) -> None:
        """Wait for the collective and hand each parameter its reduced gradient."""
        assert self.inflight is not None, "finish() before launch()"
        self.advance()
        self.inflight.wait()
        if self.op == "reduce_scatter" and self.comm.replicas == 1:  # (with replicas, advance() released it)
            release(self.inflight.buffers[1])  # the input, this launch's own
        views = self.views
        used = [True] * self.n if self.all_local else (self.buffer[self.total :] > 0).tolist()
        self.used = used  # which parameters some rank computed a gradient for (the user's hooks run for those)
        with torch.no_grad():
            for slot, mp in enumerate(self.params):
                act = self.action[slot]
                if act == _SET and mp.visible.grad is not None:
                    # what ``.grad`` holds that the bucket did not put there is added to the reduced
                    # gradient ([Note: gradients that reach a parameter outside its bucket])
                    cur = self._arrived(mp.local_grad(), mp)
                    obj = self.grad_obj(slot)
                    if obj is not None:
                        views[slot].add_(cur)
                        mp.visible.grad = obj
                    else:
                        mp.set_local_grad(views[slot].to(mp.dtype).add_(cur))
                    continue
                if not used[slot]:
                    if self.attached[slot] and mp.visible.grad is self._grad_objs[slot]:
                        mp.visible.grad = None  # unused on every rank: as if nothing had been attached
                    continue
                if act == _KEEP:
                    continue
                if act == _SET:
                    obj = self.grad_obj(slot)
                    if obj is not None:
                        mp.visible.grad = obj
                    else:
                        mp.set_local_grad(views[slot].to(mp.dtype))
                else:
                    self._arrived(mp.local_grad(), mp).add_(views[slot].to(mp.dtype))
        self.inflight = None


class Reducer:
    """Launches buckets in order as their gradients become ready; flushes and finishes at the end.

    ``max_inflight`` bounds the reductions in flight: launching one more first waits for the oldest
    (``0``: every bucket is waited for right after launch; ``None``: all are waited for at the end of
    backward). Fewer in flight frees reduction buffers sooner at the cost of overlap.
    ``launch_on_ready``: launch a bucket the moment its last gradient arrives; otherwise only when
    :meth:`poll` is called (at sharded-unit events, see [Note: one issue order for NCCL] in
    engine.py) and at the flush, once each of its parameters has its gradient or is ``settled`` (no
    gradient will come this step: every module using it has finished its backward).
    """

    def __init__(
        self,
        buckets: list[BucketRuntime],
        *,
        max_inflight: int | None = None,
        launch_on_ready: bool = True,
        settled: Callable[[ManagedParam], bool] | None = None,
    ) -> None:
        self.buckets = buckets
        self.max_inflight = max_inflight
        self.launch_on_ready = launch_on_ready
        self.settled = settled
        self.slot: dict[int, tuple[BucketRuntime, int]] = {
            id(mp): (b, i) for b in buckets for i, mp in enumerate(b.params)
        }
        self.begin(sync=True)

    def begin(self, *, sync: bool) -> None:
        """A new backward: every bucket takes part if it synchronises; otherwise only the buckets
        reduced in every micro-batch (sharded units accumulating sharded gradients)."""
        self.active = self.buckets if sync else [b for b in self.buckets if b.every]
        for b in self.buckets:
            b.taking = sync or b.every
        self.next_launch = 0
        self.next_finish = 0
        self.late: list[str] = []  # gradients that came after their bucket went out (see take)

    def attach_views(self, skip: set[int]) -> None:
        """At the start of a backward that synchronises: see [Note: views attached before backward]."""
        for b in self.active:
            if b._attachable:
                b.attach_views(skip)

    def take(self, entry: tuple[BucketRuntime, int], mp: ManagedParam, first: bool, defer: bool) -> None:
        """``mp``'s gradient was accumulated (``first``: for the first time this step); ``entry`` is
        its bucket and slot (from :attr:`slot`), a bucket reduced in this backward (``taking``).
        ``defer``: it may accumulate again (reentrant checkpointing of a shared parameter): take it
        at the flush. The engine's gradient hook looks ``entry`` up itself: this runs once per
        parameter per backward, on the thread that issues the step's kernels.
        """
        if defer:
            return
        bucket, slot = entry
        if not first or bucket.ready[slot]:
            if bucket.launched:
                raise RuntimeError(
                    f"the gradient of {mp.name!r} was accumulated again after its bucket was reduced in this backward "
                    "(the parameter is used by several regions of reentrant activation checkpointing, or by a second "
                    "backward pass over the same forward). Use non-reentrant checkpointing "
                    "(torch.utils.checkpoint.checkpoint(..., use_reentrant=False)), or reduce in one backward."
                )
            bucket.add_late(slot, mp)
            return
        if bucket.launched:  # settled early: reported at the end of backward, on every rank (comm.LATE_GRADIENT)
            self.late.append(mp.name)
            return
        bucket.add_grad(slot, mp)
        if (
            self.launch_on_ready and bucket.pending == 0 and self.next_launch < len(self.active)
            and self.active[self.next_launch] is bucket
        ):
            self._launch_ready()

    def poll(self) -> None:
        """Launch the buckets that are complete, in order. Also when launching on readiness: a
        bucket whose missing gradients are settled (a unit this rank's forward left out) is
        launched at the event that settles them, where the ranks that computed them launch it when
        they arrive. Left to the flush, it held back this rank's reductions to the end of backward
        while the others waited for it with their in-flight bound, and this rank's next backward
        gather waited for them ([Note: units a forward left out] in autodist/schedule.py)."""
        self._launch_ready()

    def _complete(self, b: BucketRuntime) -> bool:
        if b.pending == 0:
            return True
        if self.settled is None:
            return False
        # the first missing gradient is usually unsettled (its unit's backward is still to come)
        return all(r or self.settled(mp) for r, mp in zip(b.ready, b.params))

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.active) and self._complete(self.active[self.next_launch]):
            self.active[self.next_launch].launch()
            self.next_launch += 1
            if self.max_inflight is not None:
                while self.next_launch - self.next_finish > self.max_inflight:
                    self.active[self.next_finish].finish()
                    self.next_finish += 1

    def flush(self) -> list[str]:
        """Launch every remaining bucket of this backward (in order), wait for all, assign gradients.

        Returns the names of parameters that got no gradient on this rank this step."""
        missing: list[str] = []
        while self.next_launch < len(self.active):
            missing.extend(self.active[self.next_launch].launch())
            self.next_launch += 1
        for b in self.active[self.next_finish :]:
            b.advance()  # hybrid sharding: every all-reduce across replicas in flight before waiting for one
        for b in self.active[self.next_finish :]:
            b.finish()
        self.reset()
        return missing

    def reset(self) -> None:
        for b in self.buckets:
            if b.inflight is not None:  # never leave a collective un-waited
                b.inflight.wait()
            b.reset()
        self.next_launch = 0
        self.next_finish = 0
