"""The optimizer's step in a profile: measured on the model with the user's optimizer
(:func:`measure_optimizer`), or, before it has run, AdamW estimated on scratch tensors the sizes of
the model's parameters (:func:`estimate_optimizer`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import nn

from ..cost.profile import OptimizerProfile
from .clock import Clock
from .robust import lower_quartile

OPTIMIZER_SAMPLE_BYTES = 32 << 20  # the most parameter bytes the Adam estimate steps over (4x that is allocated)
CACHE_FLUSH_BYTES = 64 << 20  # written before each timed step: larger than a CPU's last-level cache or a GPU's L2


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
    clock = Clock(device)
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


# The per-tensor probe: many tensors so small that their bytes cost next to nothing, so that the
# two-configuration fit below is well conditioned. (A probe of 1024-element tensors has the bytes per
# tensor of a model of many small layers: the zoo's gpt-deep averages ~4 KiB a tensor, and the fit's
# two equations were then nearly the same one, giving 364 us a tensor for an AdamW step that costs a
# few: a 21 ms step predicted 316 ms.)
PROBE_TENSORS, PROBE_NUMEL = 64, 16


def _per_tensor_cost(make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], device: torch.device) -> float:
    """The optimizer's cost per parameter tensor: its step over ``PROBE_TENSORS`` tensors of
    ``PROBE_NUMEL`` elements (the lower quartile of 5 steps after one that creates the state),
    divided by their number."""
    opt = make_optimizer(_scratch([PROBE_NUMEL] * PROBE_TENSORS, device))
    clock = Clock(device)
    times = []
    for k in range(6):
        t0 = clock.mark()
        opt.step()
        t1 = clock.mark()
        if k:
            times.append(clock.seconds(t0, t1))
    return lower_quartile(times) / PROBE_TENSORS


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
    lower quartile of each) — the per-tensor probe (``PROBE_TENSORS`` tiny tensors) and ``params``
    — each step after the caches were flushed, as a step in training follows a backward that
    streamed activations through them. The fit is bounded by what it fits: the tensors' share is at
    most the model configuration's whole step, the bytes get the rest."""
    configs = {"small": _scratch([PROBE_NUMEL] * PROBE_TENSORS, device), "model": params}
    opts = {name: make_optimizer(ps) for name, ps in configs.items()}
    clock = Clock(device)  # thread time on a single-threaded CPU rank, as the units are timed
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
    per_tensor, per_byte = fit_step(n1, b1, s1, n2, b2, s2)
    return OptimizerProfile(
        kind=kind, state_factor=state_bytes / max(b2, 1),
        state_names=sorted({k for k, _ in state}), transient_factor=transient, per_tensor_s=per_tensor,
        per_byte_s=per_byte,
    )


def fit_step(n1: int, b1: int, s1: float, n2: int, b2: int, s2: float) -> tuple[float, float]:
    """``(per_tensor_s, per_byte_s)`` from two steps: ``s1`` over ``n1`` tensors of ``b1`` bytes
    (the probe) and ``s2`` over ``n2`` of ``b2`` (the model). Two equations, two unknowns
    (``s = a*n + b*bytes``), the tensors' share held within the model's step and the bytes given
    the rest of it."""
    det = n1 * b2 - n2 * b1
    per_tensor = max(0.0, (s1 * b2 - s2 * b1) / det) if det > 0 else s1 / max(n1, 1)
    per_tensor = min(per_tensor, s2 / max(n2, 1))
    return per_tensor, max(0.0, (s2 - per_tensor * n2) / max(b2, 1))


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
