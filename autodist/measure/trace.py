"""Profiling hooks: time every unit's forward and backward, count what it saves for backward.

:func:`profile_model` runs a few forward/backward passes of the plain (unwrapped) module on one
device, with no communication and no optimizer step, and returns a :class:`~autodist.cost.profile.Profile`.
It leaves parameters, gradients, buffers and RNG state as it found them, and frees each gradient as
soon as it is produced, so it needs no more memory than one training step.

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten

from .._tree import output_leaves
from ..cost.profile import OptimizerProfile, Profile, UnitProfile, estimated_loss_memory
from ..runtime.backward import in_backward
from ..structure import ModelStructure
from .robust import lower_quartile

if TYPE_CHECKING:
    from .sweep import CollectiveTrain


class _Clock:
    """CUDA events on CUDA (resolved after the pass). On the CPU, with one intra-op thread (as every
    rank under torchrun computes), the thread's CPU time: it counts the computation and not the
    time the thread waited — for a core another process held, or for a collective — so a busy host
    does not inflate the profile (see [Note: timing on a noisy host]); with several threads, wall
    time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._now = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return self._now()

    def seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


LOSS = "(loss)"  # the owner of what the loss saves, in ``_Pass.saved``



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
        clock: _Clock,
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


def model_loss(out: object) -> torch.Tensor | None:
    """The loss a model returns itself (Hugging Face models given ``labels=``: an output mapping or
    object with a scalar ``loss`` that requires grad), or None."""
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad:
        return loss
    return None


class _OwnOrSurrogateLoss:
    """The model's own loss when its output carries one (measured), else a surrogate (the real loss
    is the user's and unseen: its memory is then estimated)."""

    def __init__(self) -> None:
        self.own = False

    def __call__(self, out: object) -> torch.Tensor:
        loss = model_loss(out)
        self.own = loss is not None
        return loss if loss is not None else surrogate_loss(out)


def surrogate_loss(out: object) -> torch.Tensor:
    """A stand-in when the model returns no loss: the sum of the means of its floating-point outputs
    that require grad (every output's backward runs, as a real loss's would)."""
    floats = [t for t in output_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not floats:
        raise ValueError("the model's output has no floating-point tensor that requires grad; cannot profile backward")
    means = [t.float().mean() for t in floats]
    return sum(means[1:], start=means[0])


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
    gradients, reductions) from the policy, and the profile cache keeps the two apart."""
    if dtype is None:
        yield
        return
    kept = [(p, p.data) for p in module.parameters() if p.is_floating_point() and p.dtype != dtype]
    with torch.no_grad():
        for p, data in kept:
            p.data = data.to(dtype)
    try:
        yield
    finally:
        for p, data in kept:
            p.data = data
            p.grad = None  # a gradient of the copy, in its dtype


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def _attribute(pass_: _Pass, clock: _Clock, t0: Any, t_fwd_end: Any, t_bwd_end: Any, units: list[str]) -> dict[str, Any]:
    fwd = {u: 0.0 for u in units}
    bwd = {u: 0.0 for u in units}
    ready: dict[str, list[str]] = {u: [] for u in units}
    pre_fwd = post_fwd = pre_bwd = 0.0
    # forward
    stack: list[str] = []
    owner: str | None = None
    prev = t0
    for mark, kind, unit in pass_.fwd:
        d = clock.seconds(prev, mark)
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
    tail = clock.seconds(prev, t_fwd_end)
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
        d = clock.seconds(prev, mark)
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
    d = clock.seconds(prev, t_bwd_end)
    if owner is None:
        pre_bwd += d
    else:
        bwd[owner] += d
    return {
        "fwd": fwd, "bwd": bwd, "ready": ready, "order": order,
        "pre_fwd": pre_fwd, "post_fwd": post_fwd, "pre_bwd": pre_bwd,
    }


def _memory_peaks(
    module: nn.Module,
    structure: ModelStructure,
    forward: Callable[[], Any],
    loss_fn: Callable[[Any], torch.Tensor],
    device: torch.device,
) -> dict[str, tuple[int, int]]:
    """Per unit: (forward, backward) transient peak above the live bytes at the segment's start;
    under the key ``LOSS``, the same for the loss (its forward; its backward up to the first unit's).

    CUDA: the caching allocator's counters, reset at every unit boundary. CPU: one pass under the
    torch profiler's memory tracking, segments delimited by zero-length ``record_function`` marks
    (the host allocator keeps no statistics).
    """
    marks: list[tuple[str, str]] = []  # (phase, unit) in order
    readings: list[tuple[int, int]] = []  # CUDA: (allocated at mark, peak since previous mark)
    cuda = device.type == "cuda"

    def mark(phase: str, unit: str) -> None:
        marks.append((phase, unit))
        if cuda:
            readings.append((torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)))
            torch.cuda.reset_peak_memory_stats(device)
        else:
            with record_function(f"autodist::mark({len(marks) - 1})"):
                pass

    handles = []
    seen_bwd: set[str] = set()

    def pre_fwd(u: str) -> Callable:
        def hook(m: nn.Module, a: tuple) -> None:
            if not in_backward():  # a recomputation belongs to the backward segment it runs in
                mark("fwd", u)

        return hook

    def post_fwd(u: str) -> Callable:
        def hook(m: nn.Module, a: tuple, out: object) -> None:
            tensors = [t for t in output_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors and torch.is_grad_enabled():
                def pre_bwd(grads: object, u: str = u) -> None:
                    if u not in seen_bwd:
                        seen_bwd.add(u)
                        mark("bwd", u)

                register_multi_grad_hook(tensors, pre_bwd, mode="any")

        return hook

    for uinfo in structure.units:
        sub = module.get_submodule(uinfo.module_name)
        handles.append(sub.register_forward_pre_hook(pre_fwd(uinfo.name)))
        handles.append(sub.register_forward_hook(post_fwd(uinfo.name), always_call=True))
    def run() -> None:
        out = forward()
        mark("fwd", LOSS)
        loss = loss_fn(out)
        del out
        mark("bwd", LOSS)
        loss.backward()
        for q in module.parameters():
            q.grad = None

    peaks: dict[str, list[int]] = {}
    try:
        if cuda:
            # one pass first: what a first pass allocates for good (library workspaces, see [Note:
            # what the allocator holds for libraries]) is not a transient of the unit it ran in
            run()
            marks.clear()
            readings.clear()
            seen_bwd.clear()
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            run()
            mark("end", "")
            for i, (phase, unit) in enumerate(marks[:-1]):
                start = readings[i][0]
                seg_peak = readings[i + 1][1]
                key = 0 if phase == "fwd" else 1
                peaks.setdefault(unit, [0, 0])[key] = max(peaks.get(unit, [0, 0])[key], seg_peak - start)
        else:
            from .memory import trace_cpu_memory

            def run_and_end() -> None:
                run()
                mark("end", "")

            mem, named = trace_cpu_memory(run_and_end)
            mark_ts = {int(k[len("autodist::mark(") : -1]): v for k, v in named.items()}
            times = [m for _, m in sorted(mark_ts.items())]
            j, live = 0, 0
            for i, (phase, unit) in enumerate(marks[:-1]):
                if i + 1 >= len(times):
                    break
                t_start, t_end = times[i], times[i + 1]
                while j < len(mem) and mem[j][0] < t_start:
                    live = mem[j][1]
                    j += 1
                start, top = live, live
                while j < len(mem) and mem[j][0] < t_end:
                    live = mem[j][1]
                    top = max(top, live)
                    j += 1
                key = 0 if phase == "fwd" else 1
                cur = peaks.setdefault(unit, [0, 0])
                cur[key] = max(cur[key], int(top - start))
    finally:
        for h in handles:
            h.remove()
    return {u: (v[0], v[1]) for u, v in peaks.items()}


NOISY_SPREAD = 0.10  # passes whose median total time is this much above the fastest: a disturbed host


def _spread(results: list[dict[str, Any]]) -> float:
    """How much slower the median pass is than the fastest, relatively (0 on a quiet host)."""
    totals = sorted(
        sum(r["fwd"].values()) + sum(r["bwd"].values()) + r["pre_fwd"] + r["post_fwd"] + r["pre_bwd"] for r in results
    )
    return totals[len(totals) // 2] / totals[0] - 1 if totals and totals[0] > 0 else 0.0


def library_workspace_bytes(device: torch.device) -> int:
    """Bytes the caching allocator holds for the math libraries' workspaces on ``device`` (0 on the CPU).

    [Note: what the allocator holds for libraries] cuBLAS and cuBLASLt take a workspace from the
    caching allocator the first time a handle runs a matrix product on a stream, and keep it: 32 MiB
    each on Hopper (``CUBLAS_WORKSPACE_CONFIG`` sets it). Handles are per thread, and autograd runs a
    CUDA backward on its own device thread, so a training step holds at least two — 64 MiB on an
    H200 (measured by tools/gpu_check.py, which found them the largest part of the gap between a
    plan's predicted and measured peak). No tensor names them, so they are measured here, after
    the model has run forward and backward, as what releasing them frees; the next product
    re-creates them. The simulator holds them for the whole step."""
    if device.type != "cuda":
        return 0
    release = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if release is None:
        return 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    release()
    return max(0, before - torch.cuda.memory_allocated(device))


def profile_model(
    module: nn.Module,
    structure: ModelStructure,
    example_inputs: tuple[Any, ...],
    *,
    device: torch.device,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    warmup: int = 1,
    repeats: int = 5,
    memory: bool = True,
    example_kwargs: dict[str, Any] | None = None,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
    contention: CollectiveTrain | None = None,
    compute_dtype: torch.dtype | None = None,
    cast_inputs: bool = True,
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
    floating-point inputs of the forward to it."""
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in example_inputs)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in (example_kwargs or {}).items()}
    if compute_dtype is not None and cast_inputs:
        inputs, kwargs = _cast_floating((inputs, kwargs), compute_dtype)
    clock = _Clock(device)
    unit_names = [u.name for u in structure.units]
    tracer = UnitTracer(module, structure, clock)
    chooser = None
    if loss_fn is None:
        loss_fn = chooser = _OwnOrSurrogateLoss()
    results = []
    last: _Pass | None = None
    out_fp32 = 0

    try:
        with _preserved(module, device), computing_in(module, compute_dtype):
            peaks = _memory_peaks(module, structure, lambda: module(*inputs, **kwargs), loss_fn, device) if memory else {}
            library = library_workspace_bytes(device) if memory else 0
            def one_pass(saved: bool = False) -> tuple[dict[str, Any], _Pass]:
                nonlocal out_fp32
                p = _Pass()
                with tracer.recording(p, saved=saved):
                    t0 = clock.mark()
                    out = module(*inputs, **kwargs)
                    tracer.begin_loss()
                    loss = loss_fn(out)
                    t_fwd = clock.mark()
                out_fp32 = float_output_bytes(out)
                del out
                with tracer.recording(p, saved=saved):
                    loss.backward()
                    t_bwd = clock.mark()
                del loss
                return _attribute(p, clock, t0, t_fwd, t_bwd, unit_names), p

            # [Note: timed passes carry no byte accounting] What a unit saves for backward is
            # counted by a Python hook on every saved tensor. Where the host's dispatch sets the
            # pace (small layers; any model on a GPU, whose kernels run asynchronously) that hook's
            # time lands in the units' times, and the runtime, which has no such hook, runs faster
            # than profiled. So one pass counts the bytes and the timed passes only mark times.
            _, counted = one_pass(saved=True)
            for _ in range(max(0, warmup - 1)):
                one_pass()
            for _ in range(repeats):
                attr, last = one_pass()
                results.append(attr)
            # [Note: timing on a noisy host] Interference only ever adds time, so each time is
            # summarised by a low quantile of the passes, and a profile whose passes spread (a
            # disturbed host) is retaken with more passes; a spread that remains is recorded.
            for _ in range(2):
                if _spread(results) <= NOISY_SPREAD:
                    break
                for _ in range(repeats):
                    attr, last = one_pass()
                    results.append(attr)
    finally:
        tracer.close()

    def train_backward() -> None:
        for p in module.parameters():
            p.grad = None
        loss_fn(module(*inputs, **kwargs)).backward()

    slowdown = sensitivity = None
    contention_meta: dict[str, Any] = {}
    with _preserved(module, device):  # after the tracer, which drops gradients as they arrive
        if optimizer is not None:
            opt_profile = measure_optimizer(module, optimizer, train_backward, device)
        else:
            numels = [p.numel for p in structure.params.values() if p.requires_grad]
            opt_profile = estimate_optimizer(device, param_numels=numels)
        if contention is not None:
            with computing_in(module, compute_dtype):
                measured = contended_slowdown(train_backward, contention, device, agree=contention.largest)
            slowdown, sensitivity = measured.slowdown, measured.sensitivity
            contention_meta = {"contention_rounds": measured.rounds, "contention_spread": round(measured.spread, 4)}
    assert last is not None
    seq = list(dict.fromkeys(u for _, kind, u in last.fwd if kind == "enter"))
    order = seq + [u for u in unit_names if u not in set(seq)]

    def med(key: str, u: str) -> float:
        return lower_quartile([r[key][u] for r in results])

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
        pre_fwd_s=lower_quartile([r["pre_fwd"] for r in results]),
        post_fwd_s=lower_quartile([r["post_fwd"] for r in results]),
        pre_bwd_s=lower_quartile([r["pre_bwd"] for r in results]),
        batch_signature=sig,
        device=device.type,
        optimizer=opt_profile,
        site_after=dict(tracer.site_after),
        recompute_anchor=dict(last.recompute),
        block_input_bytes=dict(counted.block_inputs),
        block_tail_saves=[b for b, saves in counted.block_tail.items() if saves],
        contended_slowdown=slowdown,
        contention_sensitivity=sensitivity,
        library_bytes=library,
        meta={
            "warmup": warmup, "passes": len(results), "torch": torch.__version__,
            **({"compute_dtype": str(compute_dtype).replace("torch.", "")} if compute_dtype is not None else {}),
            "spread": round(_spread(results), 4), "noisy": _spread(results) > NOISY_SPREAD, **contention_meta,
        },
        **loss_fields(
            counted.saved.get(LOSS, 0), peaks.get(LOSS, (0, 0)), out_fp32,
            "estimated" if chooser is not None and not chooser.own else "measured",
        ),
    )


def loss_fields(saved: int, peaks: tuple[int, int], out_fp32: int, source: str) -> dict[str, Any]:
    """The profile's loss fields: as measured, or (``source == "estimated"``: a surrogate loss ran,
    the user's is unknown) at least the estimate for a cross-entropy on the outputs."""
    act, fwd_peak, bwd_peak = saved, peaks[0], peaks[1]
    if source == "estimated":
        est = estimated_loss_memory(out_fp32)
        act, fwd_peak, bwd_peak = max(act, est[0]), max(fwd_peak, est[1]), max(bwd_peak, est[2])
    return {"loss_act_bytes": act, "loss_fwd_peak_bytes": fwd_peak, "loss_bwd_peak_bytes": bwd_peak, "loss_source": source}


OPTIMIZER_SAMPLE_BYTES = 32 << 20  # the most parameter bytes the Adam estimate steps over (4x that is allocated)
CACHE_FLUSH_BYTES = 64 << 20  # written before each timed step: larger than a CPU's last-level cache or a GPU's L2


CONTENDED_ROUNDS = 5  # rounds of the model's and the reference's passes alone and under the train, per batch
CONTENDED_BATCHES = 3  # at most this many batches ...
CONTENDED_SPREAD = 0.25  # ... while the sensitivities' quartiles lie this far apart, relative to their median


@dataclass(frozen=True)
class Contention:
    """What :func:`contended_slowdown` measured: the model's slowdown under the train, its
    sensitivity (that slowdown against the reference computation's under the same train), the
    rounds they took and the spread of the rounds' sensitivities (their quartiles' distance over the
    median)."""

    slowdown: float
    sensitivity: float
    rounds: int
    spread: float


def _quartile_spread(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    lo, hi = ordered[(n - 1) // 4], ordered[n - 1 - (n - 1) // 4]
    return (hi - lo) / max(statistics.median(ordered), 1e-9)


def contended_slowdown(train_backward: Callable[[], None], contention: Callable[[float], Callable[[], None]],
                       device: torch.device, rounds: int = CONTENDED_ROUNDS,
                       reference: Callable[[], None] | None = None, batches: int = CONTENDED_BATCHES,
                       agree: Callable[[float], float] | None = None,
                       clock: Callable[[], float] = time.perf_counter) -> Contention:
    """How many times longer the model's forward and backward (``train_backward``) take in
    wall-clock time while a train of collectives runs (``contention``), at least 1; and how many
    times more that is than the reference computation's slowdown under the same train, the model's
    *sensitivity*. Each round times the model and the reference alone and under a train of their
    own, the two in turn (which goes first alternates); the slowdown is the median over rounds, the
    sensitivity the median of each round's ratio. Rounds come in batches of ``rounds``; another
    batch is run, up to ``batches``, while the rounds' sensitivities spread by more than
    ``CONTENDED_SPREAD`` (a disturbed host) on any rank: ``agree`` gives a figure's largest value
    over the ranks (``CollectiveTrain.largest``), so every rank runs as many batches, and so issues
    as many trains, as every other; without it the figure is this process's own (one rank, or
    no collectives). ``reference``: one pass of the reference computation, by default
    :func:`~autodist.measure.sweep.reference_product` repeated for about as long as the model's
    pass. ``clock``: the seconds every pass is timed with (a test's own clock, advanced by the
    passes it fakes, makes the rounds' figures exact).

    [Note: the model's own contention] While a collective runs, the compute it overlaps slows down:
    on an accelerator a little (the collective's kernels take SMs and memory bandwidth), on a CPU
    host a lot (the backend's threads take the cores the ranks compute on, and the memory
    bandwidth). The comm sweep measures it per collective and size with a reference computation
    (small matrix products); the simulator scales those figures by how much more this model slows
    than the reference does. That ratio is taken here, the model and the reference each under a
    train of their own in the same round — not the model's slowdown here against the sweep's figure
    for the reference, which was measured minutes apart and under one collective at a time rather
    than a queued train: that ratio read resnet18 1.48, wide-mlp 1.30, deep-mlp 1.13 and gpt 1.10 in
    the zoo's simcheck records (slowdowns 1.71-1.98 against the sweep's 1.34-1.57), where both
    under the same train read 1.16, 1.13, 0.91 and 1.03 (slowdowns 1.44-1.78 against the
    reference's 1.44-1.72). resnet18's plans that overlap their reductions with backward were
    predicted 8-15% slow relative to those that wait at once, because its compute was taken to
    slow 1.48x more than the reference does under every collective. On a shared 2-core CPU host one
    round's ratio can read anything from 0.6 to 3 (five rounds per zoo model gave medians of
    0.80-1.39 under 4 MiB all-reduces and 0.98-1.35 under 64 MiB ones, no model consistently above
    or below 1): hence the median, and more rounds while they spread."""
    from .sweep import reference_product  # measurement beside measurement: no cycle at import

    def timed(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return clock() - t0

    typical = timed(train_backward)
    if reference is None:
        product = reference_product(device)
        product()
        per = timed(lambda: [product() for _ in range(16)]) / 16
        n = max(1, round(typical / max(per, 1e-9)))

        def reference() -> None:
            for _ in range(n):
                product()

    def under_train(fn: Callable[[], None]) -> float:
        alone = timed(fn)
        stop = contention(typical)
        try:
            return timed(fn) / max(alone, 1e-9)
        finally:
            stop()

    model: list[float] = []
    ratios: list[float] = []
    for _ in range(max(1, batches)):
        for _ in range(rounds):
            if len(model) % 2 == 0:
                m = under_train(train_backward)
                ref = under_train(reference)
            else:
                ref = under_train(reference)
                m = under_train(train_backward)
            model.append(m)
            ratios.append(max(m, 1.0) / max(ref, 1.0))
        spread = _quartile_spread(ratios)
        if (agree(spread) if agree is not None else spread) <= CONTENDED_SPREAD:
            break
    return Contention(max(1.0, statistics.median(model)), statistics.median(ratios), len(ratios), _quartile_spread(ratios))


def estimate_optimizer(device: torch.device, kind: str = "Adam", param_numels: Sequence[int] | None = None) -> OptimizerProfile:
    """The Adam assumption before the user's optimizer has run: scratch AdamW steps over tensors
    the sizes of the model's parameters (``param_numels``, the first of them up to
    ``OPTIMIZER_SAMPLE_BYTES``; without them, four of 1 Mi elements), fitted by
    :func:`_step_costs`. The sizes matter: a step's cost per byte depends on whether parameters,
    gradients and state fit in the caches (1.0-4.5 ns/byte on a 2-core CPU host)."""
    sizes = [1 << 20] * 4
    if param_numels:
        sizes, total = [], 0
        for n in param_numels:
            take = min(n, (OPTIMIZER_SAMPLE_BYTES - total) // 4)
            if take <= 0:
                break
            sizes.append(take)
            total += 4 * take
    costs = _step_costs(lambda params: torch.optim.AdamW(params, lr=1e-3), _scratch(sizes, device), device)
    return replace(costs, kind=kind, state_factor=2.0, measured=False)


def measure_optimizer(module: nn.Module, make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                      backward: Callable[[], None], device: torch.device, steps: int = 5) -> OptimizerProfile:
    """The step of the optimizer ``make_optimizer`` builds, timed in training steps on ``module``
    (``backward()`` runs a forward and a backward, leaving gradients) as the first training steps
    time it under ``plan="auto"``; parameters and gradients are left as found. Its per-tensor cost
    comes from :func:`_step_costs`' small tensors, the rest is per byte.

    [Note: the optimizer step in training] The step measured in a training loop costs more than
    the same step repeated on its own: up to 2x on a 2-core CPU host (resnet18's AdamW: 108 ms
    after each backward, 54 ms repeated), and random gradients make it cheaper still — so the
    step is timed after real backwards."""
    params: list[torch.Tensor] = list(dict.fromkeys(p for p in module.parameters() if p.requires_grad))
    saved = [(p.detach().clone(), p.grad) for p in params]
    clock = _Clock(device)
    opt = make_optimizer(params)
    times = []
    try:
        for k in range(steps + 1):  # the first step creates the state
            for p in params:
                p.grad = None
            backward()
            t0 = clock.mark()
            opt.step()
            t1 = clock.mark()
            if k:
                times.append(clock.seconds(t0, t1))
        state = [(n, t) for p in params for n, t in opt.state.get(p, {}).items() if torch.is_tensor(t) and t.dim() > 0]
        kind = type(opt).__name__
        transient = _step_transient(opt, device)
    finally:
        del opt
        with torch.no_grad():
            for p, (data, grad) in zip(params, saved):
                p.copy_(data)
                p.grad = grad
    nbytes = sum(p.numel() * p.element_size() for p in params)
    step = statistics.median(times)
    per_tensor = min(_per_tensor_cost(make_optimizer, device), step / max(len(params), 1))
    return OptimizerProfile(
        kind=kind, state_factor=sum(t.numel() * t.element_size() for _, t in state) / max(nbytes, 1),
        state_names=sorted({n for n, _ in state}), transient_factor=transient / max(nbytes, 1), per_tensor_s=per_tensor,
        per_byte_s=(step - per_tensor * len(params)) / max(nbytes, 1), measured=True,
    )


def _per_tensor_cost(make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], device: torch.device) -> float:
    """The optimizer's cost per parameter tensor: its step over 32 tensors of 1024 elements (the
    lower quartile of 5 steps after one that creates the state), divided by 32."""
    opt = make_optimizer(_scratch([1024] * 32, device))
    clock = _Clock(device)
    times = []
    for k in range(6):
        t0 = clock.mark()
        opt.step()
        t1 = clock.mark()
        if k:
            times.append(clock.seconds(t0, t1))
    return lower_quartile(times) / 32


def _scratch(numels: Sequence[int], device: torch.device) -> list[torch.Tensor]:
    """Parameters with gradients, valued like a model's in training: an all-zero step runs ~2x
    slower on the CPU (measured 47.6 vs 21.6 ms on the gpt zoo model's sizes)."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = [(torch.randn(n, device=device, generator=gen) * 0.02).requires_grad_() for n in numels]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
    return params


def _step_costs(make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], params: list[torch.Tensor],
                device: torch.device) -> OptimizerProfile:
    """``per_tensor_s`` and ``per_byte_s`` of the optimizer ``make_optimizer`` builds, its state and
    temporary bytes per parameter byte: two configurations stepped in interleaved rounds (the
    lower quartile of each) — 32 small tensors (the per-tensor cost) and ``params`` — each step
    after the caches were flushed, as a step in training follows a backward that streamed
    activations through them."""
    configs = {"small": _scratch([1024] * 32, device), "model": params}
    opts = {name: make_optimizer(ps) for name, ps in configs.items()}
    clock = _Clock(device)  # thread time on a single-threaded CPU rank, as the units are timed
    times: dict[str, list[float]] = {k: [] for k in configs}
    flush = torch.empty(CACHE_FLUSH_BYTES // 4, device=device)
    for r in range(6):  # the first round warms up (state is created by the first step)
        for name in configs if r % 2 == 0 else reversed(list(configs)):
            flush.fill_(r)
            t0 = clock.mark()
            opts[name].step()
            t1 = clock.mark()
            if r:
                times[name].append(clock.seconds(t0, t1))
    del flush
    (n1, b1, s1), (n2, b2, s2) = (
        (len(ps), sum(p.numel() * p.element_size() for p in ps), lower_quartile(times[k])) for k, ps in configs.items()
    )
    transient = _step_transient(opts["model"], device) / max(b2, 1)
    state = [(k, t) for p in params for k, t in opts["model"].state.get(p, {}).items() if torch.is_tensor(t) and t.dim() > 0]
    state_bytes = sum(t.numel() * t.element_size() for _, t in state)
    kind = type(opts["model"]).__name__
    opts.clear()
    # two equations, two unknowns: s = a*n + b*bytes
    det = n1 * b2 - n2 * b1
    per_tensor = max(0.0, (s1 * b2 - s2 * b1) / det) if det else 0.0
    per_byte = max(0.0, (n1 * s2 - n2 * s1) / det) if det else s2 / max(b2, 1)
    return OptimizerProfile(
        kind=kind, state_factor=state_bytes / max(b2, 1),
        state_names=sorted({k for k, _ in state}), transient_factor=transient, per_tensor_s=per_tensor,
        per_byte_s=per_byte,
    )


def _step_transient(opt: torch.optim.Optimizer, device: torch.device) -> int:
    """Peak temporary bytes of one optimizer step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        opt.step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from .memory import trace_cpu_memory

    mem, _ = trace_cpu_memory(opt.step)
    return max((m for _, m in mem), default=0)
