"""Described devices: a model's compute on a GPU this machine does not have (``autodist plan --device``).

A plan for H100s made on a CPU must not time the step with the CPU's compute. :func:`count_roofline`
runs the model's forward and backward once (on whatever device its tensors are, the meta device
included) under a dispatch mode that sees every aten operator and prices it on the described
device by a roofline, as ``torch.distributed._tools.RuntimeEstimator``'s roofline mode does: the
operator's FLOPs by ``torch.utils.flop_counter``'s formulas (matrix products, convolutions,
attention; other operators count none), the bytes it reads and writes from its tensors' sizes, and
its time ``max(flops / peak FLOP/s of its dtype, bytes / memory bandwidth)``. Scaled dot-product
attention runs as one fused operator, as FlashAttention does on a GPU (:class:`_FusedAttention`). Each operator's time
goes to the unit running it (``torch.utils.module_tracker``), forward or backward.
:func:`on_device` puts those times in a profile measured here in place of this machine's (the
orders and memory the profile measured are the same on the device: same shapes and dtypes), and
:func:`described_profile` builds a whole profile from the count alone, for models too large to
run here (the meta device: ``tools/anchors.py``).

[Note: what a roofline assumes] Peak figures are the datasheet's dense tensor-core rates: real
kernels reach 40-80% of them for large matrix products and less for small ones, and a kernel's
launch costs a few microseconds that the roofline ignores, so predicted compute is optimistic, and
more so for small models. A float32 matrix product is priced at the fp32 (non-tensor-core) rate,
as PyTorch runs it by default (``torch.backends.cuda.matmul.allow_tf32`` is off). The optimizer's
step is priced as memory traffic: Adam reads the parameter, its gradient and two states and writes
the parameter and both states, 7 passes over the parameter's bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.module_tracker import ModuleTracker

from .devices import DEVICES, Device, describe_devices
from .profile import OptimizerProfile, Profile, UnitProfile, estimated_loss_memory

__all__ = ["DEVICES", "Device", "describe_devices"]


ADAM_PASSES = 7  # bytes Adam moves per parameter byte ([Note: what a roofline assumes])


# operators that move no data (views, metadata) or only create a tensor
_FREE_OPS = {
    getattr(torch.ops.aten, n) for n in (
        "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "squeeze", "unsqueeze", "slice",
        "select", "alias", "as_strided", "detach", "split", "split_with_sizes", "unbind", "chunk", "empty", "empty_like",
        "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "arange", "empty_strided", "new_empty",
        "new_zeros", "lift_fresh",
    ) if hasattr(torch.ops.aten, n)
}


_FUSED_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FUSED_SDPA_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _FusedAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` as one fused operator, as a GPU runs it (FlashAttention):
    on the meta device it would decompose into the math path (the scores materialised, several
    passes over them), whose memory traffic no GPU pays. Grouped-query attention expands the key
    and value heads first. With a mask or dropout the call runs as written."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, args)) | kwargs
        if bound.get("attn_mask") is not None or bound.get("dropout_p", 0.0) or bound["query"].dim() != 4:
            return func(*args, **kwargs)
        q, k, v = bound["query"], bound["key"], bound["value"]
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return _FUSED_SDPA(q, k, v, 0.0, bool(bound.get("is_causal", False)), scale=bound.get("scale"))[0]


def _fused_flops(packet: Any, args: Any) -> float | None:
    """FLOPs of the fused attention operators (``torch.utils.flop_counter``'s formulas for SDPA,
    which count the masked half of a causal attention too); None for any other operator."""
    if packet is _FUSED_SDPA:
        q, k, v = args[:3]
        return float(sdpa_flop_count(q.shape, k.shape, v.shape))
    if packet is _FUSED_SDPA_BACKWARD:
        grad, q, k, v = args[:4]
        return float(sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape))
    return None


def _nbytes(t: torch.Tensor) -> int:
    """What reading or writing ``t`` moves (a broadcast dimension: once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


@dataclass
class Roofline:
    """Seconds on the described device per (unit, ``"fwd"``/``"bwd"``), and of what ran outside
    every unit: ``pre_fwd``, ``post_fwd`` (the loss included), ``pre_bwd``, ``post_bwd``; what
    each unit's forward saved for backward, its outputs, and its largest operator output (a stand-in
    for its transient peak); the gradient-ready order of the parameters."""

    device: Device
    seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    glue: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("pre_fwd", "post_fwd", "pre_bwd", "post_bwd"), 0.0))
    saved: dict[str, int] = field(default_factory=dict)
    out_bytes: dict[str, int] = field(default_factory=dict)
    largest: dict[tuple[str, str], int] = field(default_factory=dict)
    ready_order: list[str] = field(default_factory=list)
    output_fp32_bytes: int = 0
    flops: float = 0.0


class _Counter(TorchDispatchMode):
    def __init__(self, device: Device, units: dict[str, str], tracker: ModuleTracker, out: Roofline) -> None:
        super().__init__()
        self.device, self.units, self.tracker, self.out = device, units, tracker, out
        self.last_fwd: str | None = None  # the unit whose forward ran last
        self.last_bwd: str | None = None
        self.in_bwd = False
        self.pending = 0.0  # glue seconds since the last unit's operator

    def finish(self) -> None:
        """The end of the step: the glue after the last unit is post_fwd or post_bwd."""
        self.out.glue["post_bwd" if self.in_bwd else "post_fwd"] += self.pending
        self.pending = 0.0

    def unit(self) -> str | None:
        """The innermost unit running now."""
        inside = [self.units[p] for p in self.tracker.parents if p in self.units]
        return max(inside, key=len) if inside else None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in _FREE_OPS:
            return result
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        moved = sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
        seconds = moved / self.device.memory_bytes_s
        flops = _fused_flops(packet, args)
        if flops is None and packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=result)
        if flops is not None:
            dtype = next((t.dtype for t in outs if t.is_floating_point()), torch.float32)
            seconds = max(seconds, flops / self.device.peak(dtype))
            self.out.flops += flops
        bw = self.tracker.is_bw
        if bw and not self.in_bwd:  # forward is over: what ran after its last unit is post_fwd
            self.in_bwd = True
            self.out.glue["post_fwd"] += self.pending
            self.pending = 0.0
        unit = self.unit()
        if unit is None:
            # glue between units goes to the unit that ran last, as the profile attributes it (held
            # until the next unit shows there was one after it)
            self.pending += seconds
            return result
        phase = "bwd" if bw else "fwd"
        last = self.last_bwd if bw else self.last_fwd
        if last is None:
            self.out.glue["pre_bwd" if bw else "pre_fwd"] += self.pending
        else:
            self.out.seconds[(last, phase)] = self.out.seconds.get((last, phase), 0.0) + self.pending
        self.pending = 0.0
        if bw:
            self.last_bwd = unit
        else:
            self.last_fwd = unit
        self.out.seconds[(unit, phase)] = self.out.seconds.get((unit, phase), 0.0) + seconds
        biggest = max((_nbytes(t) for t in outs), default=0)
        self.out.largest[(unit, phase)] = max(self.out.largest.get((unit, phase), 0), biggest)
        return result


def _leaves(out: Any) -> Iterator[torch.Tensor]:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            yield t


def count_roofline(
    module: nn.Module, structure: Any, example_inputs: tuple, device: Device, *, example_kwargs: dict[str, Any] | None = None,
) -> Roofline:
    """One forward and backward of ``module`` on ``example_inputs`` priced on ``device`` (see the
    module docstring); the loss as the profile takes it (the model's own, else the mean of its
    floating-point outputs). Gradients it leaves are dropped; the gradients held before are kept."""
    from .._loss import model_loss, surrogate_loss

    out = Roofline(device)
    tracker = ModuleTracker()
    root = type(module).__name__
    units = {(f"{root}.{u.module_name}" if u.module_name else root): u.name for u in structure.units}
    modules = dict(module.named_modules())
    params = {id(p) for p in module.parameters()}
    name_of = {id(p): n for n, p in module.named_parameters()}
    held = {id(p): p.grad for p in module.parameters()}
    handles = []
    saved_seen: dict[str, set[int]] = {}
    counter = _Counter(device, units, tracker, out)

    def pack(t: torch.Tensor) -> torch.Tensor:
        unit = counter.unit()
        base = t._base if t._base is not None else t
        if unit is not None and not tracker.is_bw and id(base) not in params and id(t) not in params:
            seen = saved_seen.setdefault(unit, set())
            if id(base) not in seen:
                seen.add(id(base))
                out.saved[unit] = out.saved.get(unit, 0) + _nbytes(base)
        return t

    def unit_output(name: str) -> Any:
        def hook(_m: nn.Module, _i: Any, o: Any) -> None:
            out.out_bytes[name] = sum(_nbytes(t) for t in _leaves(o))
        return hook

    for u in structure.units:
        m = modules.get(u.module_name)
        if m is not None:
            handles.append(m.register_forward_hook(unit_output(u.name)))
    for p in module.parameters():
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(lambda q: out.ready_order.append(name_of[id(q)])))
    try:
        with tracker, _FusedAttention(), counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = module(*example_inputs, **(example_kwargs or {}))
            loss = model_loss(result)
            if loss is None:
                floats = [t for t in _leaves(result) if t.is_floating_point()]
                out.output_fp32_bytes = sum(t.numel() * 4 for t in floats)
                loss = surrogate_loss(result)
            if loss is not None:
                loss.backward()
        counter.finish()
    finally:
        for h in handles:
            h.remove()
        for p in module.parameters():
            p.grad = held[id(p)]
    return out


def on_device(profile: Profile, roofline: Roofline) -> Profile:
    """``profile`` (measured here) with its compute times those ``roofline`` priced on its device:
    each unit's forward and backward, the glue around them, and the optimizer's step as memory
    traffic. Orders and memory stay as measured."""
    prof = Profile.from_json(profile.to_json())
    for u in prof.units:
        u.fwd_s = roofline.seconds.get((u.name, "fwd"), 0.0)
        u.bwd_s = roofline.seconds.get((u.name, "bwd"), 0.0)
    prof.pre_fwd_s, prof.post_fwd_s = roofline.glue["pre_fwd"], roofline.glue["post_fwd"]
    prof.pre_bwd_s, prof.post_bwd_s = roofline.glue["pre_bwd"], roofline.glue["post_bwd"]
    prof.optimizer.per_byte_s = ADAM_PASSES / roofline.device.memory_bytes_s
    prof.optimizer.per_tensor_s = 0.0
    prof.optimizer.fixed_s = 0.0
    prof.contended_slowdown = None
    prof.contention_sensitivity = None
    prof.device = "cuda"  # the plan's device type; which GPU is in meta["compute"]
    prof.meta = dict(prof.meta, compute=f"roofline of the {roofline.device.what}", flops=roofline.flops)
    return prof


def described_profile(module: nn.Module, structure: Any, example_inputs: tuple, device: Device, *,
                      example_kwargs: dict[str, Any] | None = None) -> Profile:
    """A profile from :func:`count_roofline` alone (``module`` and inputs may be on the meta
    device, so that the real shapes of a model too large for this machine can be planned):
    compute times from the roofline, each unit's activations the bytes its forward saved for
    backward (parameters excluded), its transient peaks its largest operator output (forward) and
    twice it (backward), the loss's memory estimated as a cross-entropy on the outputs, Adam's
    state assumed."""
    r = count_roofline(module, structure, example_inputs, device, example_kwargs=example_kwargs)
    units = [
        UnitProfile(
            u.name, fwd_s=r.seconds.get((u.name, "fwd"), 0.0), bwd_s=r.seconds.get((u.name, "bwd"), 0.0),
            act_bytes=r.saved.get(u.name, 0), out_bytes=r.out_bytes.get(u.name, 0),
            fwd_peak_bytes=r.largest.get((u.name, "fwd"), 0), bwd_peak_bytes=2 * r.largest.get((u.name, "bwd"), 0),
        )
        for u in structure.units
    ]
    unit_of = structure.unit_of_param
    by_unit = {u.name: u for u in units}
    order = r.ready_order + [p for p in reversed(structure.trainable) if p not in set(r.ready_order)]
    for p in order:
        by_unit[unit_of[p]].ready.append(p)
    act, fwd_peak, bwd_peak = estimated_loss_memory(r.output_fp32_bytes)
    return Profile(
        units=units, ready_order=order, pre_fwd_s=r.glue["pre_fwd"], post_fwd_s=r.glue["post_fwd"],
        pre_bwd_s=r.glue["pre_bwd"], post_bwd_s=r.glue["post_bwd"], device="cuda",
        optimizer=OptimizerProfile(per_byte_s=ADAM_PASSES / device.memory_bytes_s),
        loss_act_bytes=act, loss_fwd_peak_bytes=fwd_peak, loss_bwd_peak_bytes=bwd_peak, loss_source="estimated",
        meta={"source": f"roofline of the {device.what} (nothing measured)", "compute": f"roofline of the {device.what}",
              "flops": r.flops},
    )
