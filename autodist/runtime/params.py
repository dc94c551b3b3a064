"""Per-parameter state: what the user sees, what the model computes with, and the local shard.

Each managed parameter has two faces:

* ``visible`` — the ``nn.Parameter`` registered on the model between steps, which the user's
  optimizer, ``clip_grad_norm_`` and checkpoints see. A plain tensor when every parameter of the
  model is replicated (exactly as under DDP); otherwise a DTensor (``Replicate()`` or ``Shard(0)``)
  on a 1-D mesh, as under FSDP2, so that norms and checkpoints over mixed placements are correct.
  Under hybrid sharding the mesh is 2-D (replicas, shard group) and the placements are
  ``(Replicate(), Shard(0))`` or ``(Replicate(), Replicate())``, as under FSDP2's HSDP; ``rank``
  and ``world_size`` are then this rank's position in its shard group and that group's size.
* ``full`` — the leaf tensor the forward computes with. For a replicated parameter without a
  compute-dtype cast it *is* ``visible`` (or shares its storage); for a sharded one it is a separate
  leaf whose storage is allocated when its gather group is gathered and released when it is freed.

[Note: why storage is resized instead of reallocated] Autograd saves ``full`` (the same tensor
object) for backward. Freeing a gathered parameter after forward and gathering it again for backward
must therefore refill the *same* tensor: the runtime resizes its storage to zero bytes and back, and
writes through ``.data`` so the version counter autograd checks is not bumped.

[Note: one shard storage per dtype] The engine allocates the local shards of all sharded parameters
of one dtype in a single flat buffer, in the plan's unit order. A gather group of consecutive units
then sends a contiguous slice of it, with no copy-in.

[Note: dim-0 shards and padding] A parameter of ``R`` rows is split into ``world`` chunks of
``C = ceil(R / world)`` rows (``torch.chunk`` semantics, as DTensor's ``Shard(0)``); the last ranks may
hold fewer rows or none. Each rank keeps a padded ``C``-row buffer whose leading rows are its shard,
so every rank contributes the same number of elements to an all-gather and the gathered buffer holds
the parameter's rows in order followed by padding.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement
from torch.optim.optimizer import _foreach_supported_types as optim_foreach_types
from torch.utils._foreach_utils import _foreach_supported_types as util_foreach_types

from ..structure import ModelStructure, ParamInfo

if TYPE_CHECKING:
    from ..plan import Plan


def shard_geometry(shape: tuple[int, ...], world_size: int) -> tuple[int, int, int]:
    """(rows, elements per row, padded rows per rank) of a dim-0 sharded tensor."""
    rows = shape[0]
    row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
    return rows, row_numel, -(-rows // world_size)


def allocate_shard_storage(
    plan: Plan, structure: ModelStructure, world: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """One flat buffer per dtype for all local shards, in plan unit order (see params.py);
    ``world``: the ranks a parameter is sharded over (the shard group's size)."""
    order = [p for u in plan.units if u.placement == "shard" for p in u.params]
    sizes: dict[torch.dtype, int] = {}
    spans: dict[str, tuple[torch.dtype, int, int]] = {}
    for name in order:
        info = structure.params[name]
        _, row_numel, padded_rows = shard_geometry(info.shape, world)
        n = padded_rows * row_numel
        off = sizes.get(info.dtype, 0)
        spans[name] = (info.dtype, off, n)
        sizes[info.dtype] = off + n
    buffers = {dt: torch.zeros(n, dtype=dt, device=device) for dt, n in sizes.items()}
    return {name: buffers[dt][off : off + n] for name, (dt, off, n) in spans.items()}


class HeldDTensor(DTensor):
    """A DTensor parameter AutoDist holds (the ``visible`` face of a parameter under a plan with
    DTensors): a DTensor in every respect but ``.data``.

    [Note: assigning a parameter's .data] Momentum encoders update a frozen copy of a network from
    the trained one through ``.data``: MoCo and BYOL assign it (``pk.data = pk.data * m + pq.data *
    (1 - m)``, inside the forward or after the step), DINO writes into it (``pk.data.mul_(m)``).
    On a DTensor parameter, torch's ``.data =`` replaces the wrapper's metadata and leaves its local
    tensor as it was: the assignment was lost, silently (under FSDP2 too). Every sharded plan then
    trained the query encoder against a key encoder that never moved (1.0e-2 off a one-process
    reference after 4 steps), while DDP trained correctly. Here ``.data = value`` writes ``value``
    into the parameter's own storage (this rank's shard; a DTensor value of other placements is
    redistributed, a full tensor sliced as ``Shard(0)`` slices it) and bumps the version counter,
    so a gather of the old values in flight, or a persistent group holding them, is found stale
    and gathered again. ``.data`` returns ``detach()``: writes through it (DINO's) bump the same
    counter. The parameter's autograd leaf is another tensor (the gathered one, or the local one
    behind a replicated DTensor), so the bump never trips autograd's check of saved tensors. A
    value of another shape or dtype is refused: the parameter lives in storage AutoDist lays out
    (``model.half()`` is refused the same way)."""

    def detach(self) -> torch.Tensor:  # type: ignore[override]
        # of this type, as ``nn.Parameter(p)`` requires (``Module._apply`` makes one)
        out = super().detach()
        out.__class__ = HeldDTensor
        return out

    def _as_dtensor(self) -> DTensor:
        """This parameter as a plain DTensor over the same local tensor (copies and files hold
        torch's type, not AutoDist's)."""
        out = DTensor.detach(self)
        out.__class__ = DTensor
        return out  # type: ignore[return-value]

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        """A DTensor over a copy of the local tensor (a ``Parameter`` if this is one): torch's own
        copy of a DTensor whose local tensor lies at an offset in its storage failed as its pickling
        did ([Note: pickling a shard held in a flat buffer]): ``copy.deepcopy`` of
        ``model.module.state_dict()``."""
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            dt = DTensor.from_local(self._local_tensor.clone(), self.device_mesh, self.placements, run_check=False,
                                    shape=self.shape, stride=self.stride())
        out = (nn.Parameter(dt, requires_grad=self.requires_grad) if getattr(self, "_is_param", False)
               else dt.requires_grad_(self.requires_grad))
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol):  # type: ignore[override]
        """[Note: pickling a shard held in a flat buffer] ``torch.save(model.module.state_dict())``
        pickles the parameters as torch's DTensors (a file loads without AutoDist): a ``Parameter``
        if this is one, else (a ``state_dict()`` entry, detached) a DTensor. The local shards are
        views into one flat buffer per dtype ([Note: one shard storage per dtype]), and since torch
        2.10 a DTensor's wrapper takes its local tensor's storage offset (pytorch/pytorch#167597);
        torch's pickling tells a wrapper from a tensor with data by ``data_ptr() == 0``, which a
        wrapper of nonzero offset fails, so it pickled the wrapper's storage, which has none: every
        shard but the first of its buffer failed with "Attempted to access the data pointer on an
        invalid python storage". The wrapper is pickled here as torch pickles one, at offset zero
        (what the wrapper had before torch 2.10: it holds no data), so a DTensor loaded from the
        file saves and copies again; the local tensor as a view, its storage, the flat buffer,
        written once per file as torch writes any view's: a file of a few entries holds the whole
        buffer (clone them first to save less)."""
        dt = self._as_dtensor()
        param = getattr(self, "_is_param", False)
        wrapper = (DTensor, dt.dtype, tuple(dt.size()), dt.stride(), 0, dt.layout, dt.device, self.requires_grad and not param)
        reduced = (torch._tensor._rebuild_from_type_v2, (  # type: ignore[attr-defined]
            torch._utils._rebuild_wrapper_subclass, DTensor, wrapper, torch._utils._get_obj_state(dt),
        ))
        if not param:
            return reduced
        return (torch._utils._rebuild_parameter, (_Reduced(reduced), self.requires_grad, OrderedDict()))

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if tuple(value.shape) != tuple(self.shape) or value.dtype != self.dtype:
            raise ValueError(
                f"cannot assign .data of shape {tuple(value.shape)} and dtype {value.dtype} to a parameter of shape "
                f"{tuple(self.shape)} and dtype {self.dtype}: AutoDist holds its parameters in storage of its own "
                "(shards, gradient buckets). Assign values of the same shape and dtype, or change the model before "
                "wrapping it"
            )
        if isinstance(value, DTensor):
            _refuse_saved_elsewhere(value, ".data =")
            if value.device_mesh != self.device_mesh:
                raise ValueError("cannot assign .data from a DTensor on another device mesh than the parameter's")
            if tuple(value.placements) != tuple(self.placements):
                value = value.redistribute(self.device_mesh, self.placements)
            local = value.to_local()
        else:
            local = self._part_of(value)
        with torch.no_grad():
            self._local_tensor.copy_(local)
        torch.autograd.graph.increment_version(self)

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:  # type: ignore[override]
        """[Note: copying a whole tensor into a parameter] ``nn.Module.load_state_dict`` writes each
        parameter with ``param.copy_(value)``, and so do weight-loading helpers, target networks
        (``target.load_state_dict(online.state_dict())``) and weights averaged back in
        (``p.data.copy_(avg)``). Under a plan with DTensors, the module's own ``load_state_dict``
        (``model.module.load_state_dict(sd)``, a submodule's: pretrained weights loaded into a
        backbone after wrapping) failed inside DTensor ("mixed torch.Tensor and DTensor"), where DDP
        copies. A plain tensor of the parameter's whole shape is taken here as ``.data =`` takes it
        (this rank's part of it, the version counter bumped so that gathers of the old values are
        found stale); a DTensor or another shape goes to DTensor's ``copy_`` as before. As for any
        leaf, copying into a parameter that requires grad needs ``torch.no_grad()``."""
        if isinstance(src, DTensor):
            _refuse_saved_elsewhere(src, "copy_")
        if isinstance(src, DTensor) or not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(self.shape):
            return super().copy_(src, non_blocking)
        if self.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
        with torch.no_grad():
            self._local_tensor.copy_(self._part_of(src), non_blocking)
        torch.autograd.graph.increment_version(self)
        return self

    def _part_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``whole``, a plain tensor of the parameter's shape."""
        local_shape, offset = compute_local_shape_and_global_offset(self.shape, self.device_mesh, self.placements)
        for dim, (n, start) in enumerate(zip(local_shape, offset)):
            whole = whole.narrow(dim, start, n)
        return whole


def coordinates(t: DTensor) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(the coordinate ``t``'s mesh gives this rank, the one the mesh's rank list gives it): they
    differ for a DTensor another rank pickled ([Note: one rank's shards loaded on every rank] in
    autodist/runtime/state.py)."""
    where = (t.device_mesh.mesh == dist.get_rank()).nonzero()
    return t.device_mesh.get_coordinate(), tuple(where[0].tolist()) if len(where) else None


def _refuse_saved_elsewhere(value: DTensor, what: str) -> None:
    claimed, actual = coordinates(value)
    if claimed != actual:
        raise ValueError(
            f"{what} of a DTensor another rank saved: its mesh gives this rank the coordinate {claimed}, where the "
            f"mesh's ranks put it at {actual}, so it holds that rank's part, not this one's (a file of "
            "`model.module.state_dict()` saved by one rank with torch.save and loaded on every rank). Save "
            "`model.state_dict()` (full tensors; every rank calls it) and load it with `model.load_state_dict`, or use "
            "torch.distributed.checkpoint"
        )


class _Reduced:
    """An object that pickles as ``reduce`` says (a part of another object's reduction)."""

    __slots__ = ("reduce",)

    def __init__(self, reduce: tuple) -> None:
        self.reduce = reduce

    def __reduce_ex__(self, protocol: object) -> tuple:
        return self.reduce


# torch's optimizers and clip_grad_norm_ take their foreach paths for the tensor types these lists
# name (DTensor registers itself the same way), and compare types exactly
for _types in (optim_foreach_types, util_foreach_types):
    if HeldDTensor not in _types:
        _types.append(HeldDTensor)


def _held(param: nn.Parameter) -> nn.Parameter:
    """``param`` (a DTensor parameter) as a :class:`HeldDTensor`."""
    param.__class__ = HeldDTensor  # type: ignore[assignment]
    return param


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def dense_stride(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides when its elements fill its storage span without gaps or overlap in some
    order of its dimensions (contiguous, channels-last, any permutation), else the contiguous ones:
    the layout a gradient slot made for ``t`` takes, so that ``.grad`` keeps its parameter's layout
    (autograd's gradient layout contract; DDP's bucket views do the same)."""
    shape, stride = tuple(t.shape), tuple(t.stride())
    acc = 1
    for d in sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: stride[d]):
        if stride[d] != acc:
            return _contiguous_stride(shape)
        acc *= shape[d]
    return stride if acc == t.numel() else _contiguous_stride(shape)


class ManagedParam:
    """One parameter under AutoDist's control."""

    def __init__(
        self,
        info: ParamInfo,
        original: nn.Parameter,
        *,
        placement: str,
        mesh: DeviceMesh | None,
        rank: int,
        world_size: int,
        use_dtensor: bool,
        compute_dtype: torch.dtype | None,
        device: torch.device,
        shard_storage: torch.Tensor | None = None,
    ) -> None:
        self.name = info.name
        self.info = info
        self.placement = placement
        self.requires_grad = original.requires_grad
        self.dtype = original.dtype
        self.compute_dtype = compute_dtype or original.dtype
        self.shape = tuple(original.shape)
        self.world_size = world_size
        self.rank = rank
        self.mesh = mesh
        self.is_dtensor = use_dtensor
        ndim = mesh.ndim if mesh is not None else 1
        # a replicated dimension for the replicas of a hybrid mesh, then the shard dimension
        self.placements: list[Placement] = [Replicate()] * (ndim - 1) + [Shard(0) if placement == "shard" else Replicate()]
        self.sites: list[tuple[nn.Module, str]] = []
        self._swaps = 0
        self.accum: torch.Tensor | None = None  # unsharded gradient accumulated in the reduce dtype
        self._accum_shown = False  # the accumulator is the visible .grad
        # A parameter on the meta device has no values yet: its storage is allocated here and filled
        # by ``load_full_`` (see autodist/runtime/materialize.py).
        pending = original.is_meta
        data = original.detach()  # a sharded pending parameter's data is not read
        if pending:
            if placement == "replicate":
                data = torch.empty(self.shape, dtype=self.dtype, device=device)
        elif data.device != device:
            data = data.to(device)

        if placement == "replicate":
            self.rows = self.padded_rows = self.local_rows = 0
            self.row_numel = 0
            if not use_dtensor:
                # Exactly DDP: the user's own Parameter object stays registered.
                keep = original.device == device and not pending
                self.visible = original if keep else nn.Parameter(data, original.requires_grad)
                self._master: torch.Tensor = self.visible
            else:
                self.visible = _held(nn.Parameter(
                    DTensor.from_local(data, mesh, self.placements, run_check=False),
                    requires_grad=original.requires_grad,
                ))
                self._master = data  # shares storage (and version counter) with visible's local tensor
            if self.compute_dtype == self.dtype:
                self.full = self.visible if not use_dtensor else nn.Parameter(
                    self._master, requires_grad=original.requires_grad
                )
                self._has_cast = False
            else:
                self.full = nn.Parameter(
                    self._master.detach().to(self.compute_dtype), requires_grad=original.requires_grad
                )
                self._has_cast = True  # cast at every forward (refresh_casts)
            self._copy_seen = (-1, 0)
            self.shard_flat = None
            self.local = self._master
            return

        # ---- sharded on dim 0 ----
        if len(self.shape) == 0:
            raise ValueError(f"parameter {self.name!r} is 0-dimensional and cannot be sharded")
        self.rows, self.row_numel, self.padded_rows = shard_geometry(self.shape, world_size)
        start = min(rank * self.padded_rows, self.rows)
        end = min(start + self.padded_rows, self.rows)
        self.local_rows = end - start
        if shard_storage is not None:
            if shard_storage.numel() != self.shard_numel or shard_storage.dtype != self.dtype:
                raise ValueError(f"shard storage for {self.name!r} has the wrong size or dtype")
            self.shard_flat = shard_storage
            self.shard_flat.zero_()
        else:
            self.shard_flat = torch.zeros(self.shard_numel, dtype=self.dtype, device=device)
        local = self.shard_flat[: self.local_rows * self.row_numel].view(self.local_rows, *self.shape[1:])
        if not pending:
            local.copy_(data[start:end])
        self.local = local
        self.visible = _held(nn.Parameter(
            DTensor.from_local(
                local, mesh, self.placements, run_check=False, shape=torch.Size(self.shape),
                stride=_contiguous_stride(self.shape),
            ),
            requires_grad=original.requires_grad,
        ))
        padded = torch.empty(world_size * self.shard_numel, dtype=self.compute_dtype, device=device)
        self.full = nn.Parameter(padded[: math.prod(self.shape)].view(self.shape), requires_grad=original.requires_grad)
        self._full_padded = padded  # the flat storage view, for copy-out
        self.free_full()
        self._has_cast = False

    # ------------------------------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        return self.placement == "shard"

    @property
    def shard_numel(self) -> int:
        """Elements of the padded local shard (what this parameter contributes to an all-gather)."""
        return self.padded_rows * self.row_numel

    def flat_shard(self) -> torch.Tensor:
        """The padded local shard, flat (``shard_flat``: what a sharded parameter sends in an all-gather)."""
        if self.shard_flat is None:
            raise ValueError(f"parameter {self.name!r} is replicated: it has no shard to gather")
        return self.shard_flat

    @property
    def full_nbytes(self) -> int:
        return math.prod(self.shape) * self.compute_dtype.itemsize

    @property
    def master(self) -> torch.Tensor:
        """The local tensor the optimizer updates (the whole tensor if replicated, else the shard)."""
        return self.local

    def local_grad(self) -> torch.Tensor | None:
        g = self.visible.grad
        if g is None:
            return None
        return g.to_local() if isinstance(g, DTensor) else g

    def wrap_local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` (this rank's part) as the visible gradient type: a DTensor like the parameter.

        [Note: a gradient shares its parameter's spec] Where the gradient's local tensor matches the
        parameter's (dtype and shape, the common case), the DTensor is built on the parameter's own
        spec object, as FSDP2 builds its sharded gradients: every operation of the optimizer step
        looks its sharding up by both operands' specs, and equal specs that are distinct objects are
        compared field by field on each lookup (gpt-deep's SGD step over 580 DTensor parameters: 861
        comparisons a step), where the same object is found by identity."""
        if not self.is_dtensor:
            return grad
        visible: DTensor = self.visible  # type: ignore[assignment]
        spec, local = visible._spec, visible._local_tensor
        if (spec.tensor_meta is not None and grad.dtype == local.dtype and grad.shape == local.shape
                and grad.stride() == local.stride()):
            return DTensor(grad, spec, requires_grad=False)  # type: ignore[call-arg]
        return DTensor.from_local(
            grad, self.mesh, self.placements, run_check=False, shape=torch.Size(self.shape),
            stride=_contiguous_stride(self.shape) if self.sharded else grad.stride(),
        )

    def stash_full_grad(self, dtype: torch.dtype) -> None:
        """Move the gradient autograd accumulated into ``full`` into an accumulator of ``dtype``:
        over micro-batches that do not synchronise, gradients accumulate in the reduce dtype (FSDP2
        does the same), not in the compute dtype they are produced in.

        [Note: gradients accumulated without sync, shown] A replicated parameter's accumulator is
        its visible ``.grad`` (where that held none and the dtypes agree), as DDP shows the local
        gradients of a ``no_sync`` backward: ``zero_grad()`` then drops them (a micro-batch thrown
        away, SAM's m-sharpness step on local gradients), where before they were kept out of
        sight and added to the synchronising backward's (0.70 off under ``plan="ddp"`` with bf16).
        A sharded parameter's visible gradient is a shard, which the whole accumulator cannot be:
        it shows none, as under FSDP2, and ``AutoDist.zero_grad()`` drops it."""
        g = self.full.grad
        if g is None:
            return
        self.full.grad = None
        self.reconcile_shown()
        if self.accum is None:
            self.accum = g.to(dtype, copy=True)
            if (not self.sharded and self.visible.grad is None and self.accum.dtype == self.visible.dtype
                    and not self.is_dtensor):
                self.visible.grad = self.accum
                self._accum_shown = True
        else:
            self.accum.add_(g)

    def reconcile_shown(self) -> None:
        """The accumulator shown as the visible gradient is what that gradient holds now: dropped
        by ``zero_grad()`` (none), zeroed in place, or another tensor put there (``p.grad = p.grad *
        0.5``); the next micro-batch adds to that ([Note: gradients accumulated without sync,
        shown])."""
        if self._accum_shown and self.visible.grad is not self.accum:
            self.accum = self.visible.grad
            self._accum_shown = self.accum is not None

    def take_full_grad(self) -> torch.Tensor | None:
        """This rank's whole unreduced gradient (the accumulator plus what autograd added since),
        which the runtime now owns: ``full.grad`` and the accumulator are cleared. An accumulator
        shown as the visible gradient is what that gradient holds now: dropped by ``zero_grad()``,
        zeroed in place, or another tensor put there ([Note: gradients accumulated without sync, shown])."""
        g = self.full.grad
        self.full.grad = None
        self.reconcile_shown()
        if self._accum_shown:
            self._accum_shown = False
            self.visible.grad = None
        if self.accum is None:
            return g
        acc, self.accum = self.accum, None
        if g is not None:
            acc.add_(g)
        return acc

    def drop_held_grad(self) -> None:
        """Drop the gradients accumulated out of sight (``AutoDist.zero_grad()``, after the module's
        own, which dropped or zeroed a shown accumulator as it does any ``.grad``)."""
        if self.full is not self.visible:
            self.full.grad = None
        self.reconcile_shown()
        if not self._accum_shown:
            self.accum = None

    def set_local_grad(self, grad: torch.Tensor) -> None:
        """Make ``grad`` (this rank's local part, master dtype) the visible gradient, without copying."""
        self.visible.grad = self.wrap_local_grad(grad)

    @torch.no_grad()
    def load_full_(self, value: torch.Tensor) -> None:
        """Write this rank's part of the full tensor ``value`` (any device or dtype) into the local
        storage the optimizer updates: the whole tensor if replicated, else the shard. Gathered and
        compute-dtype copies are then stale (the caller marks them)."""
        if tuple(value.shape) != self.shape:
            raise ValueError(f"{self.name}: a value of shape {tuple(value.shape)} for a parameter of shape {self.shape}")
        value = value.detach().to(device=self.local.device, dtype=self.dtype)
        if self.sharded:
            start = min(self.rank * self.padded_rows, self.rows)
            value = value[start : start + self.local_rows]
        self.local.copy_(value)

    # -- full (unsharded) storage -------------------------------------------------------------
    def alloc_full(self) -> None:
        storage = self.full.untyped_storage()
        need = self._full_padded.numel() * self._full_padded.element_size()
        if storage.nbytes() != need:
            storage.resize_(need)

    def free_full(self) -> None:
        storage = self.full.untyped_storage()
        if storage.nbytes() != 0:
            storage.resize_(0)

    def full_is_allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() != 0

    def full_padded_flat(self) -> torch.Tensor:
        """The full parameter's padded storage, flat (``.data``: writes do not bump the version)."""
        return self._full_padded.data

    def full_padded_2d(self) -> torch.Tensor:
        """The full parameter's padded storage as ``(world, shard_numel)`` (``.data``: no version bump)."""
        return self._full_padded.data.view(self.world_size, self.shard_numel)

    # -- replicated compute-dtype copy -------------------------------------------------------
    @property
    def has_cast_copy(self) -> bool:
        """A replicated parameter computed in another dtype: ``full`` is its cast copy."""
        return self._has_cast

    # -- module registration ------------------------------------------------------------------
    def register_visible(self) -> None:
        for module, attr in self.sites:
            module._parameters[attr] = self.visible

    def register_full(self) -> None:
        """``full`` at every site that holds the visible parameter.

        [Note: a tensor put in a parameter's place] ``torch.func.functional_call(model, params, x)``
        (meta-learning, per-sample gradients, a loss at perturbed weights) puts its own tensors in
        the modules' ``_parameters`` for one call. Swapping ``full`` in over them computed with the
        model's weights instead, silently (a loss at every weight x1.5 came out as the unperturbed
        one; first-order MAML 0.38 off under ``fsdp``). A site that holds another tensor than the
        visible parameter is left as it is, and swapping back restores only what was swapped in:
        the forward computes with the caller's tensors, as in one process. Under a plan that shards,
        tensors taken from ``model.parameters()`` are this rank's DTensor shards, which DTensor
        refuses to mix with the activations, as under FSDP2; full tensors (``p.full_tensor()``)
        compute."""
        for module, attr in self.sites:
            held = module._parameters.get(attr)
            if held is self.visible:
                module._parameters[attr] = self.full
            elif held is None:
                moved_after_wrapping(self.name, module, attr)

    def _register_visible_over_full(self) -> None:
        for module, attr in self.sites:
            if module._parameters.get(attr) is self.full:
                module._parameters[attr] = self.visible

    def swap_in(self) -> None:
        """Register ``full`` at every site while a forward that uses it runs. Nested uses (a module
        and the ancestor that reads its weight functionally, tied weights) are counted, so the
        innermost one finishing does not swap the visible parameter back under the outer one."""
        if self._swaps == 0:
            self.register_full()
        self._swaps += 1

    def swap_out(self) -> None:
        self._swaps -= 1
        if self._swaps == 0:
            self._register_visible_over_full()

    def reset_swaps(self) -> None:
        """Between steps: every site holds the visible parameter (after an exception mid-forward)."""
        if self._swaps:
            self._swaps = 0
            self._register_visible_over_full()

    @property
    def needs_swap(self) -> bool:
        return self.full is not self.visible

    def version(self) -> int:
        """Bumped by every in-place update through the visible parameter (an optimizer step).

        [Note: which version counter] For a DTensor parameter the in-place ops of an optimizer bump
        the DTensor wrapper's counter, not its local tensor's, so staleness is read here.
        """
        return self.visible._version


def moved_after_wrapping(name: str, module: nn.Module, attr: str) -> None:
    """Raise if ``attr`` is no longer a parameter of ``module``: a parametrization or pruning applied
    after wrapping moved it (``weight`` became ``parametrizations.weight.original`` or
    ``weight_orig``), and the forward would compute with what AutoDist no longer manages (torch
    failed with "mixed torch.Tensor and DTensor" or a dtype mismatch, naming neither)."""
    if attr in module._parameters:
        return
    raise ValueError(
        f"parameter {name!r} is no longer registered in its module (as {attr!r} of a {type(module).__name__}): "
        "it was moved after "
        "the model was wrapped (torch.nn.utils.parametrize.register_parametrization, torch.nn.utils.prune, "
        "weight_norm, or deleting or replacing it), and AutoDist manages the parameters where they were at "
        "wrapping. Apply parametrizations and pruning to the model before AutoDist(model, ...)"
    )


def release_casts(params: Sequence[ManagedParam]) -> None:
    """Drop the compute copies of ``params`` (replicated parameters with one: ``has_cast_copy``)
    before the optimizer step makes them stale: between steps they would hold memory DDP under autocast does
    not; the next forward casts them again (:func:`refresh_casts`). One version bump for all."""
    live = [mp.full for mp in params if mp.full.untyped_storage().nbytes()]
    if live:
        torch.autograd.graph.increment_version(live)  # a graph kept across the step must not read them
        for t in live:
            t.untyped_storage().resize_(0)


def refresh_casts(params: Sequence[ManagedParam]) -> None:
    """Cast the compute copy of each of ``params`` (replicated parameters with one:
    ``has_cast_copy``) from its master, in one ``_foreach_copy_``: a model of many small layers would otherwise issue one copy
    from Python per parameter per forward.

    [Note: compute copies cast at every forward] The engine calls this at the start of every
    forward, as autocast casts a weight at each forward and FSDP2 at each unshard: a write to a
    parameter cannot always be seen. ``p.data.add_(e)`` moves neither the parameter's version
    counter nor its storage (``.data`` of a plain tensor has a counter of its own), and copies that
    were cast again only when one of them moved missed such writes: SAM's perturbation between the
    two forward-backward passes of a step (``p.data.add_``) never reached the bfloat16 copies under
    ``plan="ddp"``, which trained as plain SGD (0.19 off the one-process run), and DINO's teacher
    update after the step was lost the same way (2.9e-3 off after 4 steps). The copies of trained
    parameters are released at each optimizer step (:func:`release_casts`), so what casting at
    every forward adds is one cast per further forward within a step: micro-batches under
    ``no_sync``, several forwards before one backward, evaluations beside a step. Each copy's own
    counter and storage are noted, so a write to the copy inside the forward is found
    (:func:`written_casts`): replicated parameters are registered as their copies for the whole
    root forward (per-module swaps would cost hooks on every module, and code reading a
    parameter's dtype, as Hugging Face's ``model.dtype`` does, would read float32), so MoCo's
    update made there writes the copy, never the parameter."""
    if not params:
        return
    for mp in params:
        storage = mp.full.untyped_storage()
        if storage.nbytes() == 0:  # released before the last optimizer step (``release_casts``)
            storage.resize_(mp.full.numel() * mp.full.element_size())
    with torch.no_grad():
        # ``.data``: the cast copy's own version counter is not bumped (a graph of an earlier forward
        # of this step saved it, and reads the same values unless the master was written since)
        torch._foreach_copy_([mp.full.data for mp in params], [mp._master for mp in params])
    for mp in params:
        mp._copy_seen = (mp.full._version, mp.full.data_ptr())


def written_casts(params: Sequence[ManagedParam]) -> list[ManagedParam]:
    """The parameters among ``params`` whose compute copy was written since it was cast (its version
    counter or storage moved: an in-place update under ``no_grad``, ``p.data = ...``; a write
    through the copy's ``.data`` moves neither)."""
    return [mp for mp in params if (mp.full._version, mp.full.data_ptr()) != mp._copy_seen]

