"""Profiling hooks: time every unit's forward and backward, count what it saves for backward.

:func:`profile_model` runs a few forward/backward passes of the plain (unwrapped) module on one
device, with no communication and no optimizer step, and returns a :class:`~autodist.cost.profile.Profile`.
It leaves parameters, gradients, buffers and RNG state as it found them, and frees each gradient as
soon as it is produced, so it needs no more memory than one training step. Its parts measured
elsewhere: the units' memory peaks and the libraries' workspaces (``unit_memory.py``), the
optimizer's step (``optimizer.py``), the model's slowdown under a train of collectives
(``contention.py``); the clock all of them time with (``clock.py``).

[Note: attributing time] Hooks mark when each unit enters and leaves its forward and when its
backward begins (a multi-grad hook on its outputs). Time between two marks belongs to the unit that
was running — the innermost one entered and not yet left; after a unit leaves, to that unit until
the next one starts (the glue between units, e.g. an activation in the parent's forward). Time
before the first unit and after the last one (the loss) is kept apart as ``pre_fwd_s``/``post_fwd_s``.
In backward, time from one unit's backward start to the next belongs to the first.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks
from torch.utils._pytree import tree_flatten

from .._loss import model_loss, surrogate_loss
from .._tree import output_leaves
from ..cost.profile import CompiledBlockProfile, OptimizerProfile, Profile, UnitProfile, estimated_loss_memory
from ..runtime.backward import in_backward
from ..runtime.compiled import compiled_by_user
from ..runtime.precision import cast_by_policy, cast_floats
from ..runtime.user_hooks import internal
from ..structure import ModelStructure
from .clock import Clock
from .contention import contended_slowdown
from .optimizer import estimate_optimizer, measure_optimizer
from .robust import lower_quartile
from .unit_memory import LOSS, library_workspace_bytes, memory_peaks

if TYPE_CHECKING:
    from .sweep import CollectiveTrain


def float_output_bytes(out: object) -> int:
    """Bytes, in float32, of the floating-point outputs a loss would differentiate."""
    return sum(t.numel() * 4 for t in output_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad)


def _storage_bytes(tree: object) -> int:
    """Bytes of the distinct storages of the tensors in ``tree``."""
    seen: dict[int, int] = {}
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor):
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _tensor_bytes(tree: object) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


@dataclass
class _Pass:
    fwd: list[tuple[Any, str, str]] = field(default_factory=list)  # (clock mark, "enter"|"exit", unit)
    bwd: list[tuple[Any, str, str]] = field(default_factory=list)  # (mark, "pre"|"ready", unit|param)
    saved: dict[str, int] = field(default_factory=dict)
    out: dict[str, int] = field(default_factory=dict)
    seen_storage: set[int] = field(default_factory=set)
    pre_seen: set[str] = field(default_factory=set)
    recompute: dict[str, str] = field(default_factory=dict)  # unit recomputed in backward -> anchor
    block_inputs: dict[str, int] = field(default_factory=dict)  # block -> bytes of its forward's inputs
    # block -> its forward saved a tensor for backward after the last of its units had finished (see
    # [Note: where a recomputation begins])
    block_tail: dict[str, bool] = field(default_factory=dict)
    bwd_current: str = ""  # the unit whose backward runs (its pre-backward hook fired last)
    input_grad: dict[str, bool] = field(default_factory=dict)  # unit -> a forward input requires grad


class UnitTracer:
    """Hooks on a plain module's units; ``with tracer.recording(pass_)`` to collect one pass."""

    def __init__(
        self,
        module: nn.Module,
        structure: ModelStructure,
        clock: Clock,
        *,
        params: list[tuple[str, torch.Tensor]] | None = None,
        free_grads: bool = True,
    ) -> None:
        """``params``: the leaf tensors whose gradient-ready events to record (default: the module's
        parameters; a wrapped model passes the full tensors it computes with). ``free_grads``: drop
        each gradient as soon as it is produced (standalone profiling only)."""
        self.module = module
        self.clock = clock
        self.free_grads = free_grads
        self.unit_of = {id(module.get_submodule(u.module_name)): u.name for u in structure.units}
        params = params if params is not None else list(module.named_parameters())
        self.params = params
        self.param_names = {id(p): n for n, p in params}
        self.param_storages: set[int] = set()
        self._pass: _Pass | None = None
        self._stack: list[str] = []
        self._last: str | None = None
        # open blocks, innermost last: [name, depth of the unit stack at its start, the unit last
        # finished when its forward saved a tensor outside any unit of its own]
        self._blocks: list[list[Any]] = []
        self._handles: list[Any] = []
        self.site_after: dict[str, str] = {}
        blocks = set(structure.blocks)
        for name, sub in module.named_modules():
            if name in blocks:
                self._handles.append(sub.register_forward_pre_hook(self._block(name), with_kwargs=True))
                self._handles.append(sub.register_forward_hook(self._block_exit(name), always_call=True))
            if id(sub) in self.unit_of:
                u = self.unit_of[id(sub)]
                self._handles.append(sub.register_forward_pre_hook(self._enter(u), with_kwargs=True))
                self._handles.append(sub.register_forward_hook(self._exit(u), always_call=True))
            elif any(p is not None for p in sub._parameters.values()):
                self._handles.append(sub.register_forward_pre_hook(self._site(name)))
        for _, p in params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._ready))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- hooks ----------------------------------------------------------------------------------
    def _enter(self, unit: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            p = self._pass
            if p is None:
                return
            if in_backward():  # the model's own activation checkpointing recomputes this unit
                p.recompute.setdefault(unit, p.bwd_current)
                return
            p.fwd.append((self.clock.mark(), "enter", unit))
            self._stack.append(unit)
            if unit not in p.input_grad:
                p.input_grad[unit] = any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten((args, kwargs))[0])

        return hook

    def _block(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            p = self._pass
            if p is not None and not in_backward():
                if name not in p.block_inputs:
                    p.block_inputs[name] = _storage_bytes((args, kwargs))
                self._blocks.append([name, len(self._stack), None])

        return hook

    def _block_exit(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            p = self._pass
            if p is None or in_backward() or not self._blocks or self._blocks[-1][0] != name:
                return
            _, _, tail = self._blocks.pop()
            p.block_tail.setdefault(name, tail is not None and tail == self._last)

        return hook

    def _site(self, module_name: str) -> Callable:
        """A module that only registers other units' parameters (a tied output layer)."""

        def hook(module: nn.Module, args: tuple) -> None:
            if self._pass is not None:
                after = self._stack[-1] if self._stack else self._last
                if after is not None:
                    self.site_after.setdefault(module_name, after)

        return hook

    def _exit(self, unit: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            p = self._pass
            if p is None:
                return
            if in_backward():  # a recomputation: its outputs' backward (reentrant checkpointing) is marked
                tensors = [t for t in output_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors and torch.is_grad_enabled():
                    register_multi_grad_hook(tensors, self._pre_backward(unit), mode="any")
                return
            p.fwd.append((self.clock.mark(), "exit", unit))
            if self._stack and self._stack[-1] == unit:
                self._stack.pop()
            self._last = unit
            if unit not in p.out:
                p.out[unit] = _tensor_bytes(output)
            tensors = [t for t in output_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors and torch.is_grad_enabled():
                register_multi_grad_hook(tensors, self._pre_backward(unit), mode="any")

        return hook

    def _pre_backward(self, unit: str) -> Callable:
        def hook(grads: object) -> None:
            p = self._pass
            if p is not None and unit not in p.pre_seen:
                p.pre_seen.add(unit)
                p.bwd_current = unit
                p.bwd.append((self.clock.mark(), "pre", unit))

        return hook

    @internal  # left where it is when the user's post-accumulate hooks are deferred (runtime/user_hooks.py)
    def _ready(self, param: torch.Tensor) -> None:
        p = self._pass
        if p is not None:
            p.bwd.append((self.clock.mark(), "ready", self.param_names.get(id(param), "?")))
        if self.free_grads:
            param.grad = None  # profiling keeps no gradients: memory stays that of one step

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        p = self._pass
        if p is not None and not in_backward() and self._blocks and len(self._stack) == self._blocks[-1][1]:
            self._blocks[-1][2] = self._last  # saved by the innermost block's own code, after this unit
        if p is not None and not in_backward():  # a recomputation's tensors live only in backward
            try:
                key = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):
                return t
            if key not in self.param_storages and key not in p.seen_storage:
                p.seen_storage.add(key)
                owner = self._stack[-1] if self._stack else (self._last or "(pre)")
                p.saved[owner] = p.saved.get(owner, 0) + t.untyped_storage().nbytes()
        return t

    def start(self, pass_: _Pass) -> None:
        """Record hooks into ``pass_`` until ``stop()``."""
        self.param_storages = {p.untyped_storage().data_ptr() for _, p in self.params}
        self.param_storages |= {p.untyped_storage().data_ptr() for p in self.module.parameters() if not hasattr(p, "_local_tensor")}
        self._pass, self._stack, self._last, self._blocks = pass_, [], None, []

    def stop(self) -> None:
        self._pass = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside (a forward that is not the recorded pass's), then go on recording
        the pass where it was."""
        held = self._pass, self._stack, self._last, self._blocks
        self._pass, self._stack, self._last, self._blocks = None, [], None, []
        try:
            yield
        finally:
            self._pass, self._stack, self._last, self._blocks = held

    def begin_loss(self) -> None:
        """The model's forward returned: what is saved from now on is the loss's."""
        self._stack, self._last = [], LOSS

    def saving(self) -> Any:
        """Context to wrap a forward in: counts the tensors saved for backward."""
        return saved_tensors_hooks(self._pack, lambda x: x)

    @contextlib.contextmanager
    def recording(self, pass_: _Pass, *, saved: bool = True) -> Iterator[None]:
        """Record into ``pass_``; ``saved``: count what the forward saves for backward too (a
        Python hook on every saved tensor: see [Note: timed passes carry no byte accounting])."""
        self.start(pass_)
        try:
            with self.saving() if saved else contextlib.nullcontext():
                yield
        finally:
            self.stop()


class _OwnOrSurrogateLoss:
    """The model's own loss when its output carries one (measured), else a surrogate (the real loss
    is the user's and unseen: its memory is then estimated)."""

    def __init__(self) -> None:
        self.own = False

    def __call__(self, out: object) -> torch.Tensor | None:
        loss = model_loss(out)
        self.own = loss is not None
        return loss if loss is not None else surrogate_loss(out)


@contextlib.contextmanager
def _preserved(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Restore gradients, buffers and RNG state after profiling."""
    grads = {id(p): p.grad for p in module.parameters()}
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    for p in module.parameters():
        p.grad = None
    try:
        yield
    finally:
        with torch.no_grad():
            for n, b in module.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
        for p in module.parameters():
            p.grad = grads.get(id(p))
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


@contextlib.contextmanager
def computing_in(module: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """The module's floating-point parameters hold ``dtype`` copies meanwhile (restored after).

    [Note: profiled as it runs] Under a mixed-precision policy the runtime computes with
    ``param_dtype`` copies of the parameters: each unit's time, what its forward saves for backward
    and the gradients it produces are those of the copies (bf16: about half the activation bytes,
    and on a GPU a fraction of the fp32 time). Profiling the fp32 model instead mispredicted bf16
    steps 3.2-3.7x on an H100. So the forward and backward passes are profiled with the copies in
    place (and the inputs cast as the policy casts them); the optimizer, which steps the fp32 master
    parameters, is measured on those. The simulator takes the dtypes of what it moves (gathers,
    gradients, reductions) from the policy, and the profile cache keeps the two apart. BatchNorm's
    parameters stay as they are ([Note: batch norm keeps its dtype])."""
    if dtype is None:
        yield
        return
    kept = [(p, p.data) for p in cast_by_policy(module, dtype)]
    with torch.no_grad():
        for p, data in kept:
            p.data = data.to(dtype)
    try:
        yield
    finally:
        for p, data in kept:
            p.data = data
            p.grad = None  # a gradient of the copy, in its dtype


def _attribute(pass_: _Pass, clock: Clock, t0: Any, t_fwd_end: Any, t_bwd_end: Any, units: list[str],
               scale: tuple[float, float] = (1.0, 1.0)) -> dict[str, Any]:
    """Each unit's forward and backward time in one traced pass; ``scale``: what the forward's and
    the backward's intervals are multiplied by to take the profiler's own time out (see [Note: the
    profiler's own time])."""
    fwd = {u: 0.0 for u in units}
    bwd = {u: 0.0 for u in units}
    ready: dict[str, list[str]] = {u: [] for u in units}
    pre_fwd = post_fwd = pre_bwd = 0.0
    # forward
    stack: list[str] = []
    owner: str | None = None
    prev = t0
    for mark, kind, unit in pass_.fwd:
        d = clock.seconds(prev, mark) * scale[0]
        if owner is None:
            pre_fwd += d
        else:
            fwd[owner] += d
        if kind == "enter":
            stack.append(unit)
            owner = unit
        else:
            if stack and stack[-1] == unit:
                stack.pop()
            owner = stack[-1] if stack else unit
        prev = mark
    tail = clock.seconds(prev, t_fwd_end) * scale[0]
    if stack or owner is None:
        pre_fwd += tail if owner is None else 0.0
        if owner is not None:
            fwd[owner] += tail
    else:
        post_fwd += tail
    # backward
    prev = t_fwd_end
    owner = None
    order: list[str] = []
    for mark, kind, name in pass_.bwd:
        d = clock.seconds(prev, mark) * scale[1]
        if owner is None:
            pre_bwd += d
        else:
            bwd[owner] += d
        prev = mark
        if kind == "pre":
            owner = name
        else:
            order.append(name)
            ready.setdefault(owner or units[-1], []).append(name)
    d = clock.seconds(prev, t_bwd_end) * scale[1]
    if owner is None:
        pre_bwd += d
    else:
        bwd[owner] += d
    return {
        "fwd": fwd, "bwd": bwd, "ready": ready, "order": order,
        "pre_fwd": pre_fwd, "post_fwd": post_fwd, "pre_bwd": pre_bwd,
    }


def _bare_pass(clock: Clock, forward_loss: Callable[[], torch.Tensor | None], lead: float = 0.0) -> tuple[float, float, float, float]:
    """One forward and backward with the tracer not recording (its hooks return at once; the
    gradient hook still frees each gradient as it arrives, so memory stays that of one step): its
    forward and backward on the device's clock and on the host's (``lead``: :meth:`Clock.lead`
    before it, as the traced passes had)."""
    clock.lead(lead)
    t0 = clock.mark()
    loss = forward_loss()
    t_fwd = clock.mark()
    if loss is not None:
        loss.backward()
    t_bwd = clock.mark()
    del loss
    return (clock.seconds(t0, t_fwd), clock.seconds(t_fwd, t_bwd),
            clock.host_seconds(t0, t_fwd), clock.host_seconds(t_fwd, t_bwd))


def _tracer_scale(raw: list[tuple[_Pass, Any, Any, Any]], clock: Clock,
                  bare_passes: list[tuple[float, float, float, float]],
                  bare: dict[str, float] | None = None) -> tuple[float, float, float, float]:
    """What the traced passes' forward and backward intervals are multiplied by so that they sum to
    the time of the same passes with the tracer not recording (``bare_passes``, of
    :func:`_bare_pass`): on the device's clock, and (the last two) on the host's. ``bare``: filled
    with the bare passes' medians.

    [Note: the profiler's own time] Every unit boundary and every gradient arrival runs a Python
    hook that marks the time (and, at a unit's exit, registers the hook that marks its backward).
    Where the host's dispatch sets the pace (small layers; any model on a GPU, whose kernels run
    asynchronously) that time shows in the intervals: on one H200 a 48-layer GPT of width 256
    summed to 47.6 ms of unit time for a step the bare model ran in 26-39 ms. The runtime's own
    hooks are charged by the simulator from their own measurement, so the profile must hold the
    model's time alone. The hooks' cost is not even over the intervals (a unit's exit costs more
    than its entry), so the intervals are scaled, forward and backward apart, by bare / traced
    (medians; never above 1): each unit keeps its share. Where compute sets the pace the hooks
    overlap it and the factor is about 1.

    [Note: bare passes beside the traced ones] The bare passes are taken one after each traced
    pass, not after all of them: the factor is a ratio of two timings, and a host whose state
    changed between the two sets moves it by as much. Taken after the traced passes, the zoo's
    gpt-deep on one CPU rank, beside another job's tests, profiled a forward of 5.9 ms for one
    that runs 10.3 (factor about 0.28 where 0.45 is usual), and ``plan="auto"`` predicted its step
    31% short; the passes themselves agreed within 1%, so nothing flagged it."""
    if not raw or not bare_passes:
        return 1.0, 1.0, 1.0, 1.0
    bare_f, bare_b, host_f, host_b = (list(col) for col in zip(*bare_passes))
    if bare is not None:  # the bare passes' medians: on the device's clock and the issuing thread's
        bare.update(forward=statistics.median(bare_f), backward=statistics.median(bare_b),
                    host_forward=statistics.median(host_f), host_backward=statistics.median(host_b))

    def factor(bare_times: list[float], traced: float) -> float:
        return min(1.0, statistics.median(bare_times) / traced) if traced > 0 else 1.0

    return (
        factor(bare_f, statistics.median(clock.seconds(t0, tf) for _, t0, tf, _ in raw)),
        factor(bare_b, statistics.median(clock.seconds(tf, tb) for _, _, tf, tb in raw)),
        factor(host_f, statistics.median(clock.host_seconds(t0, tf) for _, t0, tf, _ in raw)),
        factor(host_b, statistics.median(clock.host_seconds(tf, tb) for _, _, tf, tb in raw)),
    )


# [Note: device and host times of a unit] On CUDA a unit's kernels run after the host has issued
# them, so a unit has two times: the device's (its kernels) and the host's (issuing them: Python,
# dispatch, launches). The simulator keeps both ([Note: two clocks on an asynchronous device] in
# autodist/cost/sim/execute.py). Events recorded between units measure the device's time only
# while the device has the next kernels queued; where the host sets the pace (small layers, bf16)
# they measure the host's instead. So each timed pass is preceded by a sleep on the device
# (``Clock.lead``) of 1.25 times the host's time for the first pass, which was not led (and counts
# the saved bytes besides: slower than the timed ones), and at least 20 ms (more than a busy host
# mostly stalls a pass for): the host issues the whole pass while the device sleeps, and the
# intervals between the events are the kernels' own. The host's time per
# unit (and for the glue before, between and after the units) is read from the same marks on the
# host's clock, and scaled like the device's to take the tracer's hooks out ([Note: the profiler's
# own time]). A led pass the host took as long as the lead for either had it wait for the device
# (a model that reads a value back, ``.item()`` or ``nonzero``; a pass of more kernels than the
# launch queue holds, about a thousand), or was stalled (a busy host: another process took the
# core); its host times would hold the device's, and the device, having caught up, then ran at the
# host's pace. A model that waits does in every pass: where half the passes or more took the lead,
# no host times are kept (the profile's ``meta.host_times`` says so) and the simulator has only the
# runtime's own work on the host's clock (the device's times after the first wait are then the
# host's pace); otherwise the passes that took it are dropped, on both clocks. Unverified on a GPU.
LEAD_OVER_HOST = 1.25  # the device sleeps this many times the host's time for the first pass
MIN_LEAD_S = 0.02  # (a busy host's stalls of a pass are mostly shorter)
MAX_LEAD_S = 1.0  # (the first pass loads kernels and libraries: it can take the host far longer)

NOISY_SPREAD = 0.10  # passes whose median total time is this much above the fastest: a disturbed host
AGREED_PASSES = 3  # the timed passes end after this many when ...
PASSES_AGREE = 0.02  # ... their median total time is within this of the fastest ([Note: passes that agree need no more])
MIN_BARE_PASSES = 3  # passes with the tracer not recording: one after each traced pass, at least this many

# [Note: passes that agree need no more] Each unit's time is the lower quartile of the timed passes
# ([Note: timing on a noisy host]). Where the first three agree within 2% in total (gpt on 2 idle
# CPU ranks: 1.0-1.4% over five), the lower quartile of more, which lies between the fastest and
# the median of them on a steady host, would move by less than that: the passes stop at three.


def _spread(results: list[dict[str, Any]]) -> float:
    """How much slower the median pass is than the fastest, relatively (0 on a quiet host)."""
    totals = sorted(
        sum(r["fwd"].values()) + sum(r["bwd"].values()) + r["pre_fwd"] + r["post_fwd"] + r["pre_bwd"] for r in results
    )
    return totals[len(totals) // 2] / totals[0] - 1 if totals and totals[0] > 0 else 0.0


@dataclass
class _Passes:
    """What :func:`_run_passes` gathered: every timed pass's attribution (:func:`_attribute`), the
    pass that counted the bytes saved for backward, the last timed pass, the float bytes of the
    model's outputs, the units' transient memory peaks (:func:`memory_peaks`) and the libraries'
    workspace bytes."""

    results: list[dict[str, Any]]
    counted: _Pass
    last: _Pass | None
    out_fp32: int
    peaks: dict[str, tuple[int, int]]
    library: int
    scale: tuple[float, float] = (1.0, 1.0)  # forward and backward intervals scaled by, to take the profiler's time out
    # on an asynchronous device: every timed pass's attribution on the host's clock (the host's
    # time to issue each unit: [Note: device and host times of a unit]); empty elsewhere
    host_results: list[dict[str, Any]] = field(default_factory=list)
    host_waited: bool = False  # on an asynchronous device: the host waited for the device in most passes
    # the untraced passes' forward and backward, on the device's clock and the issuing thread's
    # (``forward``, ``backward``, ``host_forward``, ``host_backward``; see :func:`_tracer_scale`)
    bare: dict[str, float] = field(default_factory=dict)


def _run_passes(module: nn.Module, structure: ModelStructure, tracer: UnitTracer, clock: Clock,
                inputs: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: Callable[[Any], torch.Tensor | None],
                device: torch.device, compute_dtype: torch.dtype | None, *,
                memory: bool, warmup: int, repeats: int) -> _Passes:
    """The memory pass and the traced passes of :func:`profile_model`, parameters, gradients,
    buffers and RNG state left as found; ``tracer`` is closed at the end."""
    unit_names = [u.name for u in structure.units]
    results = []
    host_results: list[dict[str, Any]] = []
    last: _Pass | None = None
    out_fp32 = 0
    scale = (1.0, 1.0)
    bare: dict[str, float] = {}
    lead = 0.0  # [Note: device and host times of a unit]

    try:
        with _preserved(module, device), computing_in(module, compute_dtype):
            peaks = memory_peaks(module, structure, lambda: module(*inputs, **kwargs), loss_fn, device) if memory else {}
            library = library_workspace_bytes(device) if memory else 0
            raw: list[tuple[_Pass, Any, Any, Any]] = []

            def one_pass(saved: bool = False) -> tuple[dict[str, Any], _Pass]:
                nonlocal out_fp32
                p = _Pass()
                clock.lead(lead)
                with tracer.recording(p, saved=saved):
                    t0 = clock.mark()
                    out = module(*inputs, **kwargs)
                    tracer.begin_loss()
                    loss = loss_fn(out)
                    t_fwd = clock.mark()
                out_fp32 = float_output_bytes(out)
                del out
                with tracer.recording(p, saved=saved):
                    if loss is not None:  # None: nothing requires grad (see ``surrogate_loss``)
                        loss.backward()
                    t_bwd = clock.mark()
                del loss
                raw.append((p, t0, t_fwd, t_bwd))
                return _attribute(p, clock, t0, t_fwd, t_bwd, unit_names), p

            # [Note: timed passes carry no byte accounting] What a unit saves for backward is
            # counted by a Python hook on every saved tensor. Where the host's dispatch sets the
            # pace (small layers; any model on a GPU, whose kernels run asynchronously) that hook's
            # time lands in the units' times, and the runtime, which has no such hook, runs faster
            # than profiled. So one pass counts the bytes and the timed passes only mark times.
            _, counted = one_pass(saved=True)
            if clock.cuda:  # the first pass, not led: the host's own pace ([Note: device and host times of a unit])
                _, t0, _, t_bwd = raw[-1]
                lead = min(MAX_LEAD_S, max(MIN_LEAD_S, LEAD_OVER_HOST * clock.host_seconds(t0, t_bwd)))
            for _ in range(max(0, warmup - 1)):
                one_pass()
            raw.clear()
            bare_passes: list[tuple[float, float, float, float]] = []

            def forward_loss() -> torch.Tensor | None:
                return loss_fn(module(*inputs, **kwargs))

            def traced_then_bare() -> tuple[dict[str, Any], _Pass]:
                # [Note: bare passes beside the traced ones] in _tracer_scale
                out = one_pass()
                bare_passes.append(_bare_pass(clock, forward_loss, lead))
                return out

            for i in range(repeats):
                attr, last = traced_then_bare()
                results.append(attr)
                if i + 1 >= AGREED_PASSES and _spread(results) <= PASSES_AGREE:
                    break  # [Note: passes that agree need no more]
            # [Note: timing on a noisy host] Interference only ever adds time, so each time is
            # summarised by a low quantile of the passes, and a profile whose passes spread (a
            # disturbed host) is retaken with more passes; a spread that remains is recorded.
            for _ in range(2):
                if _spread(results) <= NOISY_SPREAD:
                    break
                for _ in range(repeats):
                    attr, last = traced_then_bare()
                    results.append(attr)
            while len(bare_passes) < MIN_BARE_PASSES:
                bare_passes.append(_bare_pass(clock, forward_loss, lead))
            # a led pass the host took at least the lead for waited for the device (the model reads a
            # value back: ``.item()``, ``nonzero``; or the launch queue filled) or was stalled (a busy
            # host): see [Note: device and host times of a unit]
            kept = [r for r in raw if clock.host_seconds(r[1], r[3]) < lead] if clock.cuda else raw
            waited = 2 * len(kept) <= len(raw)
            if not waited:
                raw[:] = kept
            f, b, host_f, host_b = _tracer_scale(raw, clock, bare_passes, bare)
            scale = (f, b)
            results = [_attribute(p, clock, t0, tf, tb, unit_names, scale) for p, t0, tf, tb in raw]
            if clock.cuda and not waited:
                on_host = clock.host_view()
                host_results = [_attribute(p, on_host, t0, tf, tb, unit_names, (host_f, host_b)) for p, t0, tf, tb in raw]
    finally:
        tracer.close()
    return _Passes(results, counted, last, out_fp32, peaks, library, scale, bare=bare, host_results=host_results,
                   host_waited=clock.cuda and not host_results)


def _optimizer_and_contention(
    module: nn.Module, structure: ModelStructure, train_backward: Callable[[], None], device: torch.device,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None, contention: CollectiveTrain | None,
    compute_dtype: torch.dtype | None,
) -> tuple[OptimizerProfile, float | None, float | None, dict[str, Any]]:
    """The optimizer's profile (measured with ``optimizer``, else Adam estimated) and, under
    ``contention``, the model's contended slowdown, its sensitivity and the measurement's meta
    fields; parameters, gradients, buffers and RNG state left as found."""
    slowdown = sensitivity = None
    contention_meta: dict[str, Any] = {}
    with _preserved(module, device):  # after the tracer, which drops gradients as they arrive
        if optimizer is not None:
            opt_profile = measure_optimizer(module, optimizer, train_backward, device)
        else:
            numels = [p.numel for p in structure.params.values() if p.requires_grad]
            opt_profile = estimate_optimizer(device, param_numels=numels)
        if contention is not None:
            t0 = time.perf_counter()
            with computing_in(module, compute_dtype):
                measured = contended_slowdown(train_backward, contention, device, agree=contention.largest)
            slowdown, sensitivity = measured.slowdown, measured.sensitivity
            if not measured.settled:
                # [Note: an unsettled sensitivity] Rounds that still spread when their time is up,
                # or that could no longer settle in the rounds left ([Note: stopping rounds that
                # cannot settle] in contention.py; a shared CPU host: one round's ratio reads
                # anything from 0.6 to 3), say nothing the search can use; the median of such
                # rounds is not stored as the model's figure. The model is taken to slow as the reference computation does (1: the
                # comm model's own slowdowns), which is what those rounds average on such hosts
                # ([Note: the model's own contention] in contention.py); the meta records it.
                sensitivity = 1.0
            contention_meta = {"contention_rounds": measured.rounds, "contention_spread": round(measured.spread, 4),
                               "contention_seconds": round(time.perf_counter() - t0, 3),
                               "contention_settled": measured.settled, "contention_stopped_by": measured.stopped_by}
    return opt_profile, slowdown, sensitivity, contention_meta


def profile_model(
    module: nn.Module,
    structure: ModelStructure,
    example_inputs: tuple[Any, ...],
    *,
    device: torch.device,
    loss_fn: Callable[[Any], torch.Tensor | None] | None = None,
    warmup: int = 1,
    repeats: int = 5,
    memory: bool = True,
    example_kwargs: dict[str, Any] | None = None,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
    contention: CollectiveTrain | None = None,
    compute_dtype: torch.dtype | None = None,
    cast_inputs: bool = True,
    compile_backend: str | None = None,
) -> Profile:
    """Profile ``module`` on one forward: ``module(*example_inputs, **example_kwargs)``. Without a
    ``loss_fn``, the loss is the one the model returns (``output.loss``, as Hugging Face models do
    when given ``labels=``), else a surrogate whose memory is estimated (see ``loss_fields``).
    ``optimizer``: builds the optimizer training will use over a list of parameters; its step is
    then measured on the model (:func:`measure_optimizer`), else Adam is assumed and estimated.
    ``contention``: starts a train of collectives on every rank for about the given seconds and
    returns the function that waits for it (:func:`autodist.measure.sweep.collective_train`; every
    rank profiles at once, and takes as many rounds as every other); the model's slowdown under it, and how much more that is than the
    reference computation's, are then measured (``Profile.contended_slowdown``,
    ``Profile.contention_sensitivity``; see :func:`contended_slowdown`).
    ``compute_dtype``: the mixed-precision policy's parameter dtype: the model is profiled as the
    runtime runs it (see [Note: profiled as it runs]); ``cast_inputs``: the policy casts the
    floating-point inputs of the forward to it. ``compile_backend``: also time every block
    compiled with it and eager (:func:`profile_compiled_blocks`)."""
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in example_inputs)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in (example_kwargs or {}).items()}
    if compute_dtype is not None and cast_inputs:
        inputs, kwargs = cast_floats((inputs, kwargs), compute_dtype)
    clock = Clock(device)
    unit_names = [u.name for u in structure.units]
    tracer = UnitTracer(module, structure, clock)
    chooser = None
    if loss_fn is None:
        loss_fn = chooser = _OwnOrSurrogateLoss()
    t_passes = time.perf_counter()
    passes = _run_passes(module, structure, tracer, clock, inputs, kwargs, loss_fn, device, compute_dtype,
                         memory=memory, warmup=warmup, repeats=repeats)
    passes_seconds = time.perf_counter() - t_passes
    compiled: dict[str, CompiledBlockProfile] = {}
    if compile_backend is not None:
        with computing_in(module, compute_dtype):
            compiled = profile_compiled_blocks(module, structure, inputs, kwargs, device=device,
                                               backend=compile_backend, repeats=repeats)
    results, counted, last, peaks = passes.results, passes.counted, passes.last, passes.peaks

    def train_backward() -> None:
        for p in module.parameters():
            p.grad = None
        loss = loss_fn(module(*inputs, **kwargs))
        if loss is not None:
            loss.backward()

    opt_profile, slowdown, sensitivity, contention_meta = _optimizer_and_contention(
        module, structure, train_backward, device, optimizer, contention, compute_dtype)
    assert last is not None
    seq = list(dict.fromkeys(u for _, kind, u in last.fwd if kind == "enter"))
    order = seq + [u for u in unit_names if u not in set(seq)]

    def med(key: str, u: str, of: list[dict[str, Any]] = results) -> float:
        return lower_quartile([r[key][u] for r in of]) if of else 0.0

    def glue(key: str, of: list[dict[str, Any]]) -> float:
        return lower_quartile([r[key] for r in of]) if of else 0.0

    units = [
        UnitProfile(
            name=u,
            fwd_s=med("fwd", u),
            bwd_s=med("bwd", u),
            act_bytes=counted.saved.get(u, 0),
            out_bytes=counted.out.get(u, 0),
            fwd_peak_bytes=peaks.get(u, (0, 0))[0],
            bwd_peak_bytes=peaks.get(u, (0, 0))[1],
            ready=results[-1]["ready"].get(u, []),
            input_requires_grad=last.input_grad.get(u, True),
            fwd_host_s=med("fwd", u, passes.host_results),
            bwd_host_s=med("bwd", u, passes.host_results),
        )
        for u in order
    ]
    # activations saved before any unit ran belong to the first unit's lifetime
    if "(pre)" in counted.saved and units:
        units[0].act_bytes += counted.saved["(pre)"]
    sig = ";".join(
        f"{tuple(x.shape)}:{str(x.dtype).replace('torch.', '')}" if isinstance(x, torch.Tensor) else type(x).__name__
        for x in tree_flatten((example_inputs, kwargs))[0]
    )
    return Profile(
        units=units,
        ready_order=results[-1]["order"],
        pre_fwd_s=glue("pre_fwd", results),
        post_fwd_s=glue("post_fwd", results),
        pre_bwd_s=glue("pre_bwd", results),
        pre_fwd_host_s=glue("pre_fwd", passes.host_results),
        post_fwd_host_s=glue("post_fwd", passes.host_results),
        pre_bwd_host_s=glue("pre_bwd", passes.host_results),
        batch_signature=sig,
        device=device.type,
        optimizer=opt_profile,
        site_after=dict(tracer.site_after),
        recompute_anchor=dict(last.recompute),
        block_input_bytes=dict(counted.block_inputs),
        block_tail_saves=[b for b, saves in counted.block_tail.items() if saves],
        contended_slowdown=slowdown,
        contention_sensitivity=sensitivity,
        library_bytes=passes.library,
        compiled_blocks=compiled,
        compile_backend=compile_backend or "",
        user_compiled=compiled_by_user(module),
        meta={
            "warmup": warmup, "passes": len(results), "torch": torch.__version__,
            **({"compute_dtype": str(compute_dtype).replace("torch.", "")} if compute_dtype is not None else {}),
            "spread": round(_spread(results), 4), "noisy": _spread(results) > NOISY_SPREAD, **contention_meta,
            "tracer_scale": [round(passes.scale[0], 4), round(passes.scale[1], 4)],
            # on an accelerator, the untraced passes on the device's clock and the issuing thread's:
            # a host time near the device's is a step the host's dispatch sets the pace of
            **({"bare_pass_s": {k: round(v, 6) for k, v in passes.bare.items()}} if device.type == "cuda" and passes.bare else {}),
            # [Note: device and host times of a unit]: "measured", or "none: the host waited for the device"
            **({"host_times": "measured" if passes.host_results else "none: the host waited for the device"}
               if passes.host_results or passes.host_waited else {}),
            # the memory pass, the timed passes and the tracer's own time, together
            "passes_seconds": round(passes_seconds, 3),
        },
        **loss_fields(
            counted.saved.get(LOSS, 0), peaks.get(LOSS, (0, 0)), passes.out_fp32,
            "estimated" if chooser is not None and not chooser.own else "measured",
        ),
    )


def _block_inputs(module: nn.Module, blocks: list[str], inputs: tuple, kwargs: dict) -> dict[str, tuple[tuple, dict]]:
    """The arguments each block got in one forward of ``module`` (its first call), detached copies
    that require gradients where the originals did."""
    captured: dict[str, tuple[tuple, dict]] = {}

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad)
        return x

    def hook(name: str) -> Callable[..., None]:
        def pre(m: nn.Module, args: tuple, kw: dict) -> None:
            if name not in captured:
                captured[name] = (tuple(copy(a) for a in args), {k: copy(v) for k, v in kw.items()})
        return pre

    handles = [module.get_submodule(b).register_forward_pre_hook(hook(b), with_kwargs=True) for b in blocks]
    try:
        module(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return captured


def _time_block(fn: Callable[..., Any], args: tuple, kwargs: dict, clock: Clock,
                lead: float = 0.0) -> tuple[float, float, float, float]:
    """One forward and backward of ``fn`` on fresh leaves of ``args``, the device held for ``lead``
    seconds first (:meth:`Clock.lead`): (forward, backward) seconds on the device's clock, then on
    the host's ([Note: device and host times of a unit])."""
    a = tuple(x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in args)
    clock.lead(lead)
    t0 = clock.mark()
    out = fn(*a, **kwargs)
    t1 = clock.mark()
    leaves = [t for t in output_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if leaves:
        torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
    t2 = clock.mark()
    return clock.seconds(t0, t1), clock.seconds(t1, t2), clock.host_seconds(t0, t1), clock.host_seconds(t1, t2)


def profile_compiled_blocks(
    module: nn.Module, structure: ModelStructure, inputs: tuple, kwargs: dict, *,
    device: torch.device, backend: str, repeats: int = 5,
) -> dict[str, CompiledBlockProfile]:
    """Every block of ``structure`` timed alone, eager and under ``torch.compile(backend=...)``, on
    the inputs it got in one forward of ``module`` (the lower quartile of ``repeats`` runs each).

    [Note: compiled once per distinct block] Blocks of one class with the same parameter shapes and
    input signature run the same compiled code (Dynamo keys its cache by the forward's code and
    guards on what it reads): the first of them pays the compilation, which is timed (wall time:
    inductor compiles in other processes) as its first compiled forward and backward less a later
    one; the others are timed warm and name it in ``same_as``. Blocks the user compiled already are
    measured as they run, compiled and eager alike. Parameters' gradients, buffers and the RNG state
    are left as they were."""

    clock = Clock(device)
    user = set(compiled_by_user(module))
    out: dict[str, CompiledBlockProfile] = {}
    first_of: dict[tuple, str] = {}
    with _preserved(module, device):
        captured = _block_inputs(module, list(structure.blocks), inputs, kwargs)
        for name, (args, kw) in captured.items():
            block = module.get_submodule(name)
            sig = tuple(
                (tuple(x.shape), str(x.dtype), x.requires_grad) if isinstance(x, torch.Tensor) else type(x).__name__
                for x in tree_flatten((args, kw))[0]
            )
            key = (type(block).__qualname__, tuple((n, tuple(p.shape), str(p.dtype)) for n, p in block.named_parameters()), sig)
            # the forward alone, as the runtime compiles it (recompute.py, compiled.py): no hooks;
            # on CUDA each run led by 1.25x the host's time for the eager warm-up's, so that the
            # device's times are the kernels' own ([Note: device and host times of a unit])
            _, _, hf, hb = _time_block(block.forward, args, kw, clock)
            lead = min(MAX_LEAD_S, LEAD_OVER_HOST * (hf + hb)) if clock.cuda else 0.0
            eager = [_time_block(block.forward, args, kw, clock, lead) for _ in range(repeats)]
            fn = block if name in user else torch.compile(block.forward, backend=backend)
            w0 = time.perf_counter()
            _time_block(fn, args, kw, clock)
            first = time.perf_counter() - w0
            w0 = time.perf_counter()
            warm = [_time_block(fn, args, kw, clock, lead)]
            again = time.perf_counter() - w0
            warm += [_time_block(fn, args, kw, clock, lead) for _ in range(repeats - 1)]
            same = first_of.setdefault(key, name)

            def lq(runs: list[tuple[float, float, float, float]], k: int) -> float:
                return lower_quartile([r[k] for r in runs])

            out[name] = CompiledBlockProfile(
                fwd_s=lq(warm, 0), bwd_s=lq(warm, 1), eager_fwd_s=lq(eager, 0), eager_bwd_s=lq(eager, 1),
                compile_s=max(0.0, first - (again - lead)),  # (the later run waited out its lead)
                same_as="" if same == name else same,
                **({"host_fwd_s": lq(warm, 2), "host_bwd_s": lq(warm, 3), "eager_host_fwd_s": lq(eager, 2),
                    "eager_host_bwd_s": lq(eager, 3)} if clock.cuda else {}),
            )
            for p in block.parameters():
                p.grad = None
    return out


def loss_fields(saved: int, peaks: tuple[int, int], out_fp32: int, source: str) -> dict[str, Any]:
    """The profile's loss fields: as measured, or (``source == "estimated"``: a surrogate loss ran,
    the user's is unknown) at least the estimate for a cross-entropy on the outputs."""
    act, fwd_peak, bwd_peak = saved, peaks[0], peaks[1]
    if source == "estimated":
        est = estimated_loss_memory(out_fp32)
        act, fwd_peak, bwd_peak = max(act, est[0]), max(fwd_peak, est[1]), max(bwd_peak, est[2])
    return {"loss_act_bytes": act, "loss_fwd_peak_bytes": fwd_peak, "loss_bwd_peak_bytes": bwd_peak, "loss_source": source}
