"""The memory side of a profile: every unit's transient peaks in forward and backward
(:func:`memory_peaks`) and the bytes the math libraries hold for their workspaces
(:func:`library_workspace_bytes`), both read by :func:`~autodist.measure.trace.profile_model`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.profiler import record_function

from .._tree import output_leaves
from ..runtime.backward import in_backward
from ..structure import ModelStructure

LOSS = "(loss)"  # the owner of what the loss saves and allocates, in a profile's per-unit figures


def memory_peaks(
    module: nn.Module,
    structure: ModelStructure,
    forward: Callable[[], Any],
    loss_fn: Callable[[Any], torch.Tensor | None],
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
        if loss is not None:  # None: nothing requires grad (a frozen model profiled forward only)
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
