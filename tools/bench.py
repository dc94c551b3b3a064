"""Benchmark AutoDist against torch DDP and FSDP2, side by side in one launch.

    python tools/bench.py                           # all models, all contenders, 2 CPU ranks
    python tools/bench.py --models gpt --json out.json
    python tools/bench.py --memory-limit 200MB      # a budget for every contender that takes one

The script re-launches itself under ``torchrun`` (``--nproc`` ranks), one thread each and glibc's
allocator as a user's training process has it ([Note: timing as users train]). Every contender trains the
same model (same seed) on the same batches; contenders run one after another, in two passes in
opposite orders. A pass times all of a contender's timed steps as one wall-clock window that ends
with a synchronisation waiting for everything the contender started asynchronously (AutoDist's
persistent refreshes and offload copies, the device's queue), so no contender's work spills outside
its window; the step time is the window over the number of steps (the maximum over ranks), and the
median over passes is reported. ``compute`` is the model with no wrapper and no communication: every
rank trains its own copy at the same time, so it is what the step costs when communication is free.

Memory is measured in a separate, untimed pass per contender (see [Note: what peak memory means] in
``autodist.measure.memory``): the contender is built, wrapped and trained for three steps under the torch
profiler's memory tracking (CUDA: the allocator's counters), and "peak tensors" is the most tensor
memory held during those steps, the model's own state included (maximum over ranks; gloo frees some
of its buffers on its own threads, where the tracking does not see it, so this figure errs high).
"step peak" is one more step measured from its start: the tensors the model, its gradients and its
optimizer hold when it starts (AutoDist's runtime buffers included; DDP's own gradient buckets are
not visible and not counted) plus what the step allocates and frees — the figure the simulator
predicts and the budget governs (offloaded state in host buffers is not in it). For contenders
that offload optimizer state, "device pool" is the peak after the first step (when offloading has
started) minus the bytes of the host buffers holding the offloaded state, measured from those
tensors: what an accelerator would hold. "resident" is the growth of the process's resident set over
the timed steps, above what it held before the contender was built: torch's own allocations,
allocator caching (glibc's heap keeps freed tensors) and the host's page cache included, so it is
shown apart and never compared with the budget; ``--fixed-mmap-threshold`` makes it follow live
tensors instead, at the price of the timings.

[Note: timing as users train] glibc serves an allocation of its mmap threshold or more (128 KiB at
start) with fresh pages and raises the threshold once such a block is freed, so a training loop soon
allocates its activations from the heap. Fixing the threshold (``MALLOC_MMAP_THRESHOLD_``, as the
bench did until 2026-11-28 to measure resident memory) makes every such allocation fault its pages in
afresh: the zoo's gpt on one CPU rank took 291.5 ms a step instead of 224.8 (thread time, the same
process otherwise), and the penalty grows with what a contender allocates per step (gathered
parameters, bucket copies), so it tilted the comparison and put every measured step 10-20% above
the simulator's prediction, whose profile is taken as users train. Timings are therefore taken
with glibc's defaults; ``--fixed-mmap-threshold`` restores the fixed threshold for a resident-memory
study, and the table and JSON say the timings are then not a user's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _launch import exit_rank, max_over_ranks, run_tool  # noqa: E402

from autodist import AutoDist, MixedPrecision  # noqa: E402
from autodist.cost.budget import format_bytes  # noqa: E402
from autodist.measure.memory import ResidentMeter, measure_step_peak, storage_bytes, trace_cpu_memory  # noqa: E402
from autodist.zoo import blocks_of, zoo  # noqa: E402

DEFAULT_MODELS = ["wide-mlp", "deep-mlp", "resnet18", "gpt", "gpt-deep"]


# ----------------------------------------------------------------------------------------------
# contenders
# ----------------------------------------------------------------------------------------------
def _skip_sync(model: nn.Module, last: bool) -> Any:
    """Gradient accumulation the way each wrapper spells it: no communication before the last
    micro-batch (DDP's and AutoDist's ``no_sync``, FSDP2's ``set_requires_gradient_sync``)."""
    import contextlib

    wrapper: Any = model  # FSDP2's and DDP's methods, which nn.Module's attribute typing hides
    if hasattr(model, "set_requires_gradient_sync") and not isinstance(model, AutoDist):
        wrapper.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    if hasattr(model, "no_sync") and not last:
        return wrapper.no_sync()
    return contextlib.nullcontext()


def _sync_every(model: nn.Module, last: bool) -> Any:
    """FSDP2's default under gradient accumulation: reduce-scatter in every micro-batch."""
    import contextlib

    return contextlib.nullcontext()


@dataclass
class Contender:
    name: str
    wrap: Callable[[nn.Module, argparse.Namespace, tuple], nn.Module]
    close: Callable[[nn.Module], None] = lambda m: None
    takes_budget: bool = False
    after_step: Callable[[nn.Module], None] = lambda m: None
    micro_batch: Callable[[nn.Module, bool], Any] = _skip_sync  # the context of one micro-batch


BF16 = torch.bfloat16


class _InBF16(nn.Module):
    """The model with bf16 parameters, its floating-point inputs cast to bf16 (the arithmetic the
    wrappers run under ``--mixed-precision bf16``; its optimizer steps the bf16 parameters)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model.to(BF16)

    def forward(self, *args: Any) -> Any:
        return self.model(*(a.to(BF16) if torch.is_tensor(a) and a.is_floating_point() else a for a in args))


def _compute(model: nn.Module, args: argparse.Namespace, example: tuple) -> nn.Module:
    """The model alone, with no wrapper and no communication."""
    return _InBF16(model) if args.mixed_precision == "bf16" else model


class _Autocast(nn.Module):
    """The model's forward under ``torch.autocast`` in bf16: fp32 parameters, gradients and
    reduction, bf16 arithmetic — how DDP users train in mixed precision (DDP's own experimental
    ``_MixedPrecision`` refuses tied parameters, which the zoo's GPT has)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> Any:
        device = next(self.model.parameters()).device.type
        with torch.autocast(device, dtype=BF16):
            return self.model(*args)


def _ddp(model: nn.Module, args: argparse.Namespace, example: tuple) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(_Autocast(model) if args.mixed_precision == "bf16" else model)


def _fsdp2(
    reshard: bool = True, group: int = 1, prefetch: int | None = None, cpu_offload: bool = False, checkpoint: bool = False
) -> Callable[..., nn.Module]:
    """``fully_shard`` on every ``group`` consecutive blocks (0: the whole model as one group),
    then the root; ``prefetch``: explicit forward and backward prefetch of that many groups;
    ``checkpoint``: every block checkpointed first, by hand (torchtitan's recipe: torch's
    ``checkpoint_wrapper`` on each block, then ``fully_shard`` on the wrapped blocks)."""

    def wrap(model: nn.Module, args: argparse.Namespace, example: tuple) -> nn.Module:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        policy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
        mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32) if args.mixed_precision == "bf16" else MixedPrecisionPolicy()
        blocks = blocks_of(model)
        if checkpoint:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                apply_activation_checkpointing,
                checkpoint_wrapper,
            )

            targets = {id(b) for b in blocks}
            apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: id(m) in targets)
            blocks = [m for m in model.modules() if type(m).__name__ == "CheckpointWrapper"]
        wrapped: list[FSDPModule] = []
        if args.mixed_precision == "bf16":
            # BatchNorm as FSDP2 users keep it: its own group computing in float32 (its kernels refuse
            # bf16 parameters beside float32 running statistics), its output cast back to bf16
            keep = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=BF16)
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    fully_shard(m, reshard_after_forward=reshard, offload_policy=policy, mp_policy=keep)
        if group > 0:
            for i in range(0, len(blocks), group):
                chunk = blocks[i : i + group]
                fully_shard(chunk if len(chunk) > 1 else chunk[0], reshard_after_forward=reshard, offload_policy=policy, mp_policy=mp)
                assert isinstance(chunk[0], FSDPModule)  # fully_shard made it one
                wrapped.append(chunk[0])
        # The root as users shard it: with blocks resharding, FSDP2's default (``None``) keeps the
        # root's parameters unsharded from forward to backward (an explicit True would free and
        # re-gather them around the loss), which AutoDist's ``fsdp`` plan also does.
        root_reshard = None if reshard and group > 0 else reshard
        fully_shard(model, reshard_after_forward=root_reshard, offload_policy=policy, mp_policy=mp)
        if prefetch and len(wrapped) > 1:
            for i, m in enumerate(wrapped):
                m.set_modules_to_forward_prefetch(wrapped[i + 1 : i + 1 + prefetch])
                m.set_modules_to_backward_prefetch(list(reversed(wrapped[max(0, i - prefetch) : i])))
        return model

    return wrap


def _mixed_precision(args: argparse.Namespace) -> MixedPrecision | None:
    return MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32) if args.mixed_precision == "bf16" else None


def _autodist(plan: str, compile: bool = False) -> Callable[..., nn.Module]:
    """AutoDist with ``plan``; ``compile``: ``plan="auto"`` may compile blocks with --compile-backend."""

    def wrap(model: nn.Module, args: argparse.Namespace, example: tuple) -> nn.Module:
        if plan == "auto":
            return AutoDist(
                model, plan="auto", example_inputs=example, cache_dir=args.cache_dir, memory_limit=args.memory_limit,
                grad_accum_steps=args.accum, mixed_precision=_mixed_precision(args),
                compile=args.compile_backend if compile else False,
            )
        return AutoDist(model, plan=plan, memory_limit=args.memory_limit, mixed_precision=_mixed_precision(args))

    return wrap


def _compiled_blocks(model: nn.Module, backend: str) -> nn.Module:
    """torchtitan's recipe: every block replaced in its parent by ``torch.compile(block)``, before
    the wrapper (whose hooks then sit on the compiled module, outside the compiled code)."""
    from autodist.structure import find_blocks

    for name in find_blocks(model):
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        compiled = torch.compile(owner.get_submodule(attr), backend=backend)
        assert isinstance(compiled, nn.Module)  # torch.compile of a module is a module (OptimizedModule)
        owner.register_module(attr, compiled)
    return model


def _compiled(wrap: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def compiled_wrap(model: nn.Module, args: argparse.Namespace, example: tuple) -> nn.Module:
        return wrap(_compiled_blocks(model, args.compile_backend), args, example)

    return compiled_wrap


def _autodist_compiled(builtin: str) -> Callable[..., nn.Module]:
    """A built-in plan with every block compiled by AutoDist itself (``Plan.compile``)."""

    def wrap(model: nn.Module, args: argparse.Namespace, example: tuple) -> nn.Module:
        from autodist.builtins import builtin_plan
        from autodist.structure import discover

        structure = discover(model)
        plan = builtin_plan(builtin, structure, dist.get_world_size())
        plan.compile, plan.compile_backend = list(structure.blocks), args.compile_backend
        plan.provenance = {"source": f"bench:{builtin}+compile"}
        return AutoDist(model, plan=plan, memory_limit=args.memory_limit, mixed_precision=_mixed_precision(args))

    return wrap


def _close_autodist(m: nn.Module) -> None:
    assert isinstance(m, AutoDist)
    m.close()


def _offload_all_sync(model: nn.Module, args: argparse.Namespace, example: tuple) -> nn.Module:
    """The FSDP plan with every optimizer-state tensor (AdamW's two moments) on the host, copied
    back at the step and out again right after it, waiting for both (ZeRO-Offload's schedule)."""
    import dataclasses

    from autodist import OffloadFragment
    from autodist.builtins import fsdp_plan
    from autodist.runtime.params import shard_geometry
    from autodist.structure import discover

    structure = discover(model)
    world = dist.get_world_size()
    plan = fsdp_plan(structure, world)

    def held(p: str) -> int:  # elements of p's state on the rank that holds the most of it
        info = structure.params[p]
        if plan.placement_of_param[p] != "shard":
            return info.numel
        _, row_numel, rows_per_rank = shard_geometry(info.shape, world)
        return rows_per_rank * row_numel

    frags = [
        OffloadFragment(p, state, (0, held(p)), "step", "step")
        for p in structure.trainable for state in ("exp_avg", "exp_avg_sq")
    ]
    plan = dataclasses.replace(plan, offload=frags, provenance={"source": "bench:offload-all-sync"})
    return AutoDist(model, plan=plan, memory_limit=args.memory_limit, mixed_precision=_mixed_precision(args))


def _wait_offload(m: nn.Module) -> None:
    assert isinstance(m, AutoDist)
    m.runtime.offload.finish_out()


CONTENDERS: dict[str, Contender] = {
    "compute": Contender("compute", _compute),
    "ddp": Contender("ddp", _ddp),
    "autodist:ddp": Contender("autodist:ddp", _autodist("ddp"), _close_autodist, takes_budget=True),
    "fsdp2": Contender("fsdp2", _fsdp2(True)),
    "autodist:fsdp": Contender("autodist:fsdp", _autodist("fsdp"), _close_autodist, takes_budget=True),
    "fsdp2:no-reshard": Contender("fsdp2:no-reshard", _fsdp2(False)),
    "autodist:zero2": Contender("autodist:zero2", _autodist("zero2"), _close_autodist, takes_budget=True),
    "autodist:auto": Contender("autodist:auto", _autodist("auto"), _close_autodist, takes_budget=True),
    # the offload scenario (run with a --memory-limit below what sharding alone needs)
    "autodist:offload-all-sync": Contender(
        "autodist:offload-all-sync", _offload_all_sync, _close_autodist, takes_budget=True, after_step=_wait_offload
    ),
    "fsdp2:cpu-offload": Contender("fsdp2:cpu-offload", _fsdp2(True, cpu_offload=True)),
    # the activation-memory scenario: FSDP2 with every block checkpointed by hand
    "fsdp2:ckpt": Contender("fsdp2:ckpt", _fsdp2(True, checkpoint=True)),
    "fsdp2:no-reshard:ckpt": Contender("fsdp2:no-reshard:ckpt", _fsdp2(False, checkpoint=True)),
    # the accumulation scenario (--accum N): FSDP2 reduce-scattering every micro-batch (its default,
    # "fsdp2" above skips sync until the last micro-batch)
    "fsdp2:sync-every": Contender("fsdp2:sync-every", _fsdp2(True), micro_batch=_sync_every),
    # the compile scenario (issue 45): every block compiled with --compile-backend, torchtitan's
    # recipe for DDP and FSDP2, and by AutoDist's plan for its built-in plans
    "ddp:compile": Contender("ddp:compile", _compiled(_ddp)),
    "fsdp2:compile": Contender("fsdp2:compile", _compiled(_fsdp2(True))),
    "autodist:ddp+compile": Contender("autodist:ddp+compile", _autodist_compiled("ddp"), _close_autodist, takes_budget=True),
    "autodist:fsdp+compile": Contender("autodist:fsdp+compile", _autodist_compiled("fsdp"), _close_autodist, takes_budget=True),
    # plan="auto" with compile allowed: the search decides per block
    "autodist:auto+compile": Contender("autodist:auto+compile", _autodist("auto", compile=True), _close_autodist, takes_budget=True),
}
COMPILE_CONTENDERS = ("ddp:compile", "fsdp2:compile", "autodist:ddp+compile", "autodist:fsdp+compile", "autodist:auto+compile")
DEFAULT_CONTENDERS = [
    n for n in CONTENDERS
    if n not in ("autodist:offload-all-sync", "fsdp2:cpu-offload", "fsdp2:ckpt", "fsdp2:no-reshard:ckpt", "fsdp2:sync-every")
    and n not in COMPILE_CONTENDERS  # compiling takes minutes on the CPU: asked for by name
]
# FSDP2's own knobs, brute force: grouping (per block, per two blocks, whole model) x
# reshard_after_forward x prefetch depth 1-3
GRID = {
    f"fsdp2[{'block' if g == 1 else 'model' if g == 0 else f'{g}blocks'},{'reshard' if r else 'keep'},pf{p}]": Contender(
        "grid", _fsdp2(r, g, p)
    )
    for g in (1, 2, 0)
    for r in (True, False)
    for p in (1, 2, 3)
}


# ----------------------------------------------------------------------------------------------
# measurement
# ----------------------------------------------------------------------------------------------
@dataclass
class Result:
    model: str
    contender: str
    step_times: list[float] = field(default_factory=list)  # per pass: the timed window over its steps
    peak_bytes: int = 0  # tensor memory (the memory pass)
    # growth of the resident set over the timed steps; measured only with glibc's mmap threshold fixed
    # (--fixed-mmap-threshold): with its defaults the heap keeps freed tensors of earlier contenders
    resident_bytes: int | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.step_times) if self.step_times else float("nan")


def _drain(model: nn.Module, device: torch.device) -> None:
    """Wait for everything a contender started asynchronously: AutoDist's offload copy-outs (the
    optimizer step starts them) and any gather still in flight, and the device's queue (DDP's and
    FSDP2's streams)."""
    if isinstance(model, AutoDist):
        model.runtime.quiesce()
        model.runtime.offload.finish_out()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_state_bytes(model: nn.Module) -> int:
    """Bytes of the host buffers that hold AutoDist's offloaded optimizer state."""
    if not isinstance(model, AutoDist):
        return 0
    return storage_bytes(e.h for e in model.runtime.offload.entries.values() if e.h is not None)


def _device(args: argparse.Namespace) -> torch.device:
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")


def _phase_clock(device: torch.device, phases: dict[str, float] | None) -> Callable[[str], None]:
    """``lap(phase)``: add the seconds since the last lap (the first: since this was made) to
    ``phases[phase]``, the device drained first; without ``phases``, nothing (nor any drain)."""
    if phases is None:
        return lambda phase: None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    last = [time.perf_counter()]

    def lap(phase: str) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        phases[phase] = phases.get(phase, 0.0) + now - last[0]
        last[0] = now

    return lap


def _build(workload: Any, contender: Contender, batches: list, args: argparse.Namespace):
    torch.manual_seed(0)
    model = contender.wrap(workload.build().to(_device(args)), args, (batches[0][0].chunk(args.accum)[0],))  # one micro-batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    device = _device(args)

    def step(x: torch.Tensor, y: torch.Tensor, phases: dict[str, float] | None = None) -> None:
        """One optimizer step; ``phases``: add each phase's wall time to it (forward with the loss,
        backward, optimizer), the device synchronized at each boundary."""
        lap = _phase_clock(device, phases)
        n = args.accum
        for i, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n))):  # n micro-batches per optimizer step
            with contender.micro_batch(model, i == n - 1):
                loss = workload.loss(model(xm), ym).div(n)
                lap("forward")
                loss.backward()
                lap("backward")
        opt.step()
        contender.after_step(model)
        opt.zero_grad(set_to_none=True)
        lap("optimizer")

    return model, opt, step


def _plan_extra(model: nn.Module, res: Result) -> None:
    """What AutoDist planned and predicted for ``model``, into ``res.extra`` (nothing for other contenders)."""
    if not (isinstance(model, AutoDist) and model.plan.predicted):
        return
    res.extra.update({
        "predicted_step_s": model.plan.predicted.get("step_seconds"),
        "predicted_peak_bytes": model.plan.predicted.get("peak_bytes"),
        "plan": model.plan.label,
        "sharded_units": len(model.plan.sharded_units),
        "recomputed_blocks": len(model.plan.recompute),
        "offload_fragments": len(model.plan.offload),
        "predicted_peak": model.plan.predicted.get("peak_bytes"),
        "search_seconds": model.plan.provenance.get("search_seconds"),
        "compiled_blocks": list(model.plan.compile),
        "compile_backend": model.plan.compile_backend if model.plan.compile else None,
        "predicted_compile_s": model.plan.predicted.get("compile_seconds"),
        "predicted_phase_s": model.plan.predicted.get("phase_seconds"),
        "predicted_model_s": model.plan.predicted.get("model_seconds"),
        "predicted_exposed_comm_s": model.plan.predicted.get("exposed_comm_seconds"),
        # the built-in plans the search started from, as it predicted them (its seeds: the
        # plans autodist:ddp, autodist:fsdp and autodist:zero2 run, ddp's buckets in the
        # profile's gradient order)
        "predicted_seeds_s": {k: v * model.plan.predicted["step_seconds"] for k, v in model.plan.predicted.get("vs", {}).items()},
        # on an asynchronous device: the host's predicted issuing and the device's wait for it
        "predicted_host_s": model.plan.predicted.get("host_seconds"),
        "predicted_waiting_for_host_s": model.plan.predicted.get("waiting_for_host_seconds"),
        # whether the profile kept the units' host times ([Note: device and host times of a unit])
        "profile_host_times": model.plan.provenance.get("profile_host_times"),
    })


def run_contender(workload: Any, contender: Contender, batches: list, args: argparse.Namespace, res: Result) -> None:
    """One timed pass: warm-up steps, then the timed steps as one window ending with ``_drain``."""
    device = _device(args)
    resident = ResidentMeter()
    gc.collect()
    base = resident.current()
    model, _, step = _build(workload, contender, batches, args)
    _plan_extra(model, res)
    try:
        # the last warm-up step is timed by phase, the device drained at each boundary (the timed
        # steps are not: draining stops the host from running ahead of the device)
        phases: dict[str, float] = {}
        for i, (x, y) in enumerate(batches[: args.warmup]):
            step(x, y, phases if i == args.warmup - 1 and i > 0 else None)
        if phases:
            res.extra.setdefault("phase_s", []).append(phases)
        _drain(model, device)
        resident.reset_peak()
        timed = batches[args.warmup :]
        dist.barrier()
        t0 = time.perf_counter()
        for x, y in timed:
            step(x, y)
        _drain(model, device)
        res.step_times.append(max_over_ranks(time.perf_counter() - t0) / len(timed))
        if "MALLOC_MMAP_THRESHOLD_" in os.environ:  # [Note: timing as users train]
            grown = int(max_over_ranks(resident.peak() - base))
            # the smallest over passes: a first run also pays one-time allocations (thread pools, caches)
            res.resident_bytes = grown if res.resident_bytes is None else min(res.resident_bytes, grown)
    finally:
        contender.close(model)
        model = step = None  # released before collecting (step() holds the optimizer)
        gc.collect()


def run_interleaved(workload: Any, names: list[str], batches: list, args: argparse.Namespace,
                    results: dict[str, Result]) -> None:
    """``--interleave``: every contender built at once, then their steps in turn (contender A's step,
    B's, ..., the order reversed every other round), each step timed alone from a barrier to the
    end of a ``_drain`` and recorded as the slowest rank's; ``--steps`` x ``--passes`` timed steps
    each, after ``--warmup`` (fewer past ``--minutes``). A contender that fails to build, warm up or
    step on any rank is dropped on every rank with its error, and the others go on.

    [Note: paired steps] On a shared 2-core host the passes of the default mode move by +-10 ms for
    a 260 ms step (the host's state from one contender's window to the next): the zoo's gpt on 2
    ranks read AutoDist ``ddp`` 11.3 ms above torch's DDP in one run, 3.5 ms in the next, with
    every pass inside the other's range. Steps of the two taken in turn, seconds apart, see the
    same host; the difference of each pair of neighbouring steps cancels what the host does to
    both, and the median of those differences says which contender is faster. The step is timed
    with its drain, so work a plan leaves in flight across steps (persistent refreshes, offload
    copy-outs) is waited for within it: compare such plans in the default mode. With every
    contender's model alive at once, each step also starts with caches the others' steps filled:
    absolute times read higher than in the default mode (gpt-deep's unwrapped step 44.8 against
    40.4 ms on one rank), so predictions are compared with the default mode's."""
    device = _device(args)
    built: dict[str, tuple] = {}

    def agreed(n: str, what: Callable[[], None]) -> bool:
        """Run ``what`` for contender ``n``; False on every rank if it raised on any (reported as
        the contender's error), so every rank drops the same contenders and pairs its barriers."""
        try:
            what()
            ok = 1.0
        except Exception as e:  # a contender that cannot run is reported, not fatal
            results[n].error = f"{type(e).__name__}: {e}"
            ok = 0.0
        flag = torch.tensor([ok], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() < 1.0:
            results[n].error = results[n].error or "failed on another rank"
            return False
        return True

    def build(n: str) -> None:
        built[n] = _build(workload, CONTENDERS.get(n) or GRID[n], batches, args)
        _plan_extra(built[n][0], results[n])

    def warm(n: str) -> None:
        model, _, step = built[n]
        for x, y in batches[: args.warmup]:
            step(x, y)
        _drain(model, device)

    try:
        live = [n for n in names if agreed(n, lambda n=n: build(n)) and agreed(n, lambda n=n: warm(n))]
        timed = batches[args.warmup :]
        for i in range(args.steps * args.passes):
            if _out_of_time(args, device):
                break  # (agreed) the steps timed so far stand
            x, y = timed[i % len(timed)]
            for n in list(live) if i % 2 == 0 else live[::-1]:
                elapsed = [0.0]

                def one(n: str = n, x: torch.Tensor = x, y: torch.Tensor = y, elapsed: list = elapsed) -> None:
                    model, _, step = built[n]
                    t0 = time.perf_counter()
                    step(x, y)
                    _drain(model, device)
                    elapsed[0] = time.perf_counter() - t0

                dist.barrier()
                if not agreed(n, one):
                    live.remove(n)  # dropped on every rank alike; its earlier steps are kept
                    continue
                results[n].step_times.append(max_over_ranks(elapsed[0]))
        for n in live:
            results[n].extra["interleaved"] = True
    finally:
        for n, (model, _, _) in built.items():
            (CONTENDERS.get(n) or GRID[n]).close(model)
        built.clear()
        gc.collect()


MEMORY_STEPS = 3


def memory_pass(workload: Any, contender: Contender, batches: list, args: argparse.Namespace, res: Result) -> None:
    """Build, wrap and train ``MEMORY_STEPS`` steps under the profiler's memory tracking (untimed);
    record the tensor peak of the steps and, with offload, the device pool (see the module docstring)."""
    held: dict[str, Any] = {}

    def mark(name: str) -> None:
        with torch.profiler.record_function(f"autodist::mark({name})"):
            pass

    def run() -> None:
        model, opt, step = _build(workload, contender, batches, args)
        held.update(model=model, opt=opt, step=step)
        mark("steps")
        for i, (x, y) in enumerate(batches[:MEMORY_STEPS]):
            step(x, y)
            mark(f"step {i + 1}")
        _drain(model, _device(args))

    gc.collect()
    device = _device(args)
    try:
        if device.type == "cuda":
            # the caching allocator's counters: the peak of the steps over what was allocated before
            # the contender was built (the model's own state is built inside run())
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            run()
            torch.cuda.synchronize(device)
            res.peak_bytes = int(max_over_ranks(torch.cuda.max_memory_allocated(device) - base))
            host = 0
        else:
            mem, marks = trace_cpu_memory(run)
            steps, first = marks["autodist::mark(steps)"], marks["autodist::mark(step 1)"]
            peak = max((m for ts, m in mem if ts >= steps), default=0)
            res.peak_bytes = int(max_over_ranks(peak))
            host = _host_state_bytes(held["model"])
        if host:
            pool = max((m for ts, m in mem if ts >= first), default=0) - host
            res.extra["host_state_bytes"] = int(max_over_ranks(host))
            res.extra["device_pool_bytes"] = int(max_over_ranks(pool))
        # One more step measured from its start (what the simulator predicts and the budget governs):
        # the tensors held when it starts plus what it allocates and frees (see measure_step_peak);
        # host buffers of offloaded state are not device memory and are not counted.
        model, opt = held["model"], held["opt"]
        x, y = batches[MEMORY_STEPS % len(batches)]

        def live() -> list[torch.Tensor]:
            out = [p.detach() for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
            out += [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
            if isinstance(model, AutoDist):
                out += list(model.runtime.held_tensors())
            return out + [x, y]

        step = held["step"]
        res.extra["step_peak_bytes"] = int(max_over_ranks(measure_step_peak(lambda: step(x, y), device, live)))
    finally:
        if "model" in held:
            contender.close(held["model"])
        held.clear()
        gc.collect()


def allreduce_seconds(nbytes: int, device: torch.device) -> float:
    """One step's least communication for data parallelism: all-reducing every gradient once, in
    DDP-sized (25 MiB) messages, on this process group (the median of 3)."""
    cap = 25 * 1024 * 1024 // 4
    n = max(1, nbytes // 4)
    bufs = [torch.zeros(min(cap, n - i), device=device) for i in range(0, n, cap)]
    times = []
    for _ in range(4):
        dist.barrier()
        t0 = time.perf_counter()
        for b in bufs:
            dist.all_reduce(b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(max_over_ranks(time.perf_counter() - t0))
    return statistics.median(times[1:])


NOT_RUN = "not run: out of time (--minutes)"


def _out_of_time(args: argparse.Namespace, device: torch.device) -> bool:
    """Past ``--minutes`` on any rank (agreed, so every rank skips the same runs)."""
    if args.deadline is None:
        return False
    late = torch.tensor([float(time.time() > args.deadline)], device=device)
    dist.all_reduce(late, op=dist.ReduceOp.MAX)
    return bool(late.item())


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    device = _device(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    workloads = zoo(args.size)
    names = [c for c in args.contenders]
    results: list[Result] = []
    comm_only: dict[str, float] = {}
    for model_name in args.models:
        wl = workloads[model_name]
        per_rank = (args.batch or wl.default_batch) * args.accum  # --accum N: N micro-batches of --batch
        gen = torch.Generator().manual_seed(1000 + rank)
        batches = [tuple(t.to(device) for t in wl.batch(per_rank, gen)) for _ in range(args.warmup + args.steps)]
        by_name = {n: Result(model_name, n) for n in names}
        schedule = [(p, names if p % 2 == 0 else list(reversed(names))) for p in range(args.passes)]
        if args.fsdp_grid:
            for n in GRID:
                by_name[n] = Result(model_name, n)
            schedule += [(p, list(GRID)) for p in range(args.grid_passes)]
        if args.interleave:
            run_interleaved(wl, names, batches, args, by_name)
            schedule = []
        for _, order in schedule:
            for n in order:
                if _out_of_time(args, device):
                    if not by_name[n].step_times:  # a contender timed in an earlier pass keeps its times
                        by_name[n].error = by_name[n].error or NOT_RUN
                    continue
                try:
                    run_contender(wl, CONTENDERS.get(n) or GRID[n], batches, args, by_name[n])
                except Exception as e:  # a contender that cannot run is reported, not fatal
                    by_name[n].error = f"{type(e).__name__}: {e}"
                    if rank == 0:
                        print(f"[bench] {model_name} / {n} failed: {by_name[n].error}", file=sys.stderr)
        for n, r in by_name.items():
            if r.error is None and not _out_of_time(args, device):
                try:
                    memory_pass(wl, CONTENDERS.get(n) or GRID[n], batches, args, r)
                except Exception as e:
                    r.error = f"memory pass: {type(e).__name__}: {e}"
        results.extend(by_name.values())
        torch.manual_seed(0)
        grad_bytes = sum(p.numel() * p.element_size() for p in wl.build().parameters() if p.requires_grad)
        comm_only[model_name] = allreduce_seconds(grad_bytes, device)
        if rank == 0:
            print(f"[bench] {model_name}: done", file=sys.stderr, flush=True)
    if rank == 0:
        payload = {
            "world_size": world,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "mixed_precision": args.mixed_precision,
            "size": args.size,
            "steps": args.steps,
            "passes": args.passes,
            "interleave": args.interleave,
            "memory_limit": args.memory_limit,
            "accum": args.accum,
            "allreduce_all_grads_s": comm_only,
            "results": [
                {
                    "model": r.model,
                    "contender": r.contender,
                    "median_step_s": r.median,
                    "step_times_s": r.step_times,
                    "peak_bytes": r.peak_bytes,
                    "resident_bytes": r.resident_bytes,
                    "error": r.error,
                    "extra": r.extra,
                }
                for r in results
            ],
        }
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def table(payload: dict) -> str:
    rows = payload["results"]
    lines = []
    if payload.get("malloc") == "fixed mmap threshold":
        lines.append("timed with glibc's mmap threshold fixed (--fixed-mmap-threshold): every step runs slower than "
                     "in a user's process, which is what the predictions below are of")
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = {r["contender"]: r for r in rows if r["model"] == model}
        ddp = mine.get("ddp", {}).get("median_step_s")
        fsdp = mine.get("fsdp2", {}).get("median_step_s")
        compute = mine.get("compute", {}).get("median_step_s")
        comm = payload.get("allreduce_all_grads_s", {}).get(model)
        bound = max(compute, comm) if compute and comm else None
        lines.append(f"\n{model} ({payload.get('device', 'cpu')}, {payload.get('world_size')} rank(s), {payload.get('mixed_precision') or 'fp32'})")
        if bound:
            lines.append(
                f"  full-overlap bound max(compute {compute * 1e3:.1f} ms, all-reduce of all gradients "
                f"{comm * 1e3:.1f} ms) = {bound * 1e3:.1f} ms"
            )
        lines.append(
            f"  {'contender':<30}{'step (ms)':>10}{'overhead':>10}{'vs ddp':>8}{'vs fsdp2':>9}{'vs bound':>9}{'step peak':>12}{'peak tensors':>14}{'resident':>12}"
        )
        for name, r in mine.items():
            if r["error"]:
                lines.append(f"  {name:<30}  failed: {r['error'][:70]}")
                continue
            t = r["median_step_s"]
            rd = f"{t / ddp:.3f}" if ddp else "-"
            rf = f"{t / fsdp:.3f}" if fsdp else "-"
            rb = f"{t / bound:.3f}" if bound else "-"
            # [Note: overhead over compute] what the contender adds to the model's own step: its
            # hooks, copies and waits for communication (in the same launch, timed the same way)
            ov = f"{(t - compute) * 1e3:.1f}" if compute and name != "compute" else "-"
            note = ""
            e = r.get("extra", {})
            if e.get("predicted_step_s"):
                note = f"  (predicted {e['predicted_step_s'] * 1e3:.1f} ms; {e['sharded_units']} units sharded"
                if e.get("recomputed_blocks"):
                    note += f", {e['recomputed_blocks']} blocks recomputed"
                if e.get("offload_fragments"):
                    note += f", {e['offload_fragments']} offload fragments"
                if e.get("compiled_blocks"):
                    note += f", {len(e['compiled_blocks'])} blocks compiled"
                note += ")"
            if e.get("host_state_bytes"):
                note += (
                    f"  [device pool {format_bytes(e['device_pool_bytes'])}: the tensor peak after step 1 minus "
                    f"{format_bytes(e['host_state_bytes'])} of optimizer state in host buffers]"
                )
            peak = format_bytes(r["peak_bytes"])
            resident = "-" if r.get("resident_bytes") is None else format_bytes(r["resident_bytes"])
            sp = e.get("step_peak_bytes")
            sp = format_bytes(sp) if sp else "-"
            lines.append(f"  {name:<30}{t * 1e3:>10.1f}{ov:>10}{rd:>8}{rf:>9}{rb:>9}{sp:>12}{peak:>14}{resident:>12}{note}")
        lines += _against_fastest_torch(mine)
        lines += _paired(mine)
        lines += _seeds_predicted(mine)
        lines += _phases(mine)
        grid = {n: r for n, r in mine.items() if n.startswith("fsdp2[") and not r["error"]}
        auto = mine.get("autodist:auto")
        if grid and auto and not auto["error"]:
            best = min(grid, key=lambda n: grid[n]["median_step_s"])
            lines.append(
                f"  best FSDP2 grid point: {best} {grid[best]['median_step_s'] * 1e3:.1f} ms; "
                f"auto is {grid[best]['median_step_s'] / auto['median_step_s']:.3f}x its speed"
            )
    return "\n".join(lines)


def _paired(mine: dict[str, dict]) -> list[str]:
    """Under ``--interleave``: each contender's steps minus the neighbouring steps of torch's DDP and
    FSDP2 (and ``compute``), the median difference and its quartiles ([Note: paired steps])."""
    out = []
    # a base whose memory pass failed still has its steps
    bases = [b for b in ("compute", "ddp", "fsdp2") if b in mine and mine[b].get("step_times_s")]
    for name, r in mine.items():
        if not r.get("step_times_s") or not (r.get("extra") or {}).get("interleaved"):
            continue
        cells = []
        for b in bases:
            if b == name:
                continue
            diffs = sorted((t - u) * 1e3 for t, u in zip(r["step_times_s"], mine[b]["step_times_s"]))
            if len(diffs) >= 4:
                q = statistics.quantiles(diffs, n=4)
                cells.append(f"{b} {statistics.median(diffs):+.2f} ({q[0]:+.2f} to {q[2]:+.2f})")
        if cells:
            out.append(f"  {name} minus its neighbouring steps, ms, median (quartiles) over "
                       f"{len(r['step_times_s'])}: " + ", ".join(cells))
    return out


def _seeds_predicted(mine: dict[str, dict]) -> list[str]:
    """``autodist:auto``'s predictions of the built-in plans it started its search from, against
    those plans measured in the same launch (``autodist:ddp``, ...): more points of the simulator's
    error than auto's own plan alone."""
    out = []
    for name, r in mine.items():
        seeds = (r.get("extra") or {}).get("predicted_seeds_s") or {}
        cells = []
        for seed, predicted in seeds.items():
            measured = mine.get(f"autodist:{seed}")
            if measured and not measured["error"] and predicted:
                t = measured["median_step_s"]
                cells.append(f"{seed} {predicted * 1e3:.1f} / {t * 1e3:.1f} ({(predicted - t) / t * 100:+.1f}%)")
        if cells:
            out.append(f"  {name}'s predictions of the built-in plans, ms, predicted / measured: " + ", ".join(cells))
    return out


def _phases(mine: dict[str, dict]) -> list[str]:
    """Each contender's last warm-up step by phase (the device drained at each boundary) and, for
    a plan AutoDist predicted, the simulator's compute-thread time in each phase (with the model's
    own time from the profile in parentheses)."""
    out = []
    for name, r in mine.items():
        extra = r.get("extra") or {}
        if r["error"] or not extra.get("phase_s"):
            continue
        measured = {k: statistics.median(p.get(k, 0.0) for p in extra["phase_s"]) for k in ("forward", "backward", "optimizer")}
        pred, model = extra.get("predicted_phase_s") or {}, extra.get("predicted_model_s") or {}
        parts = []
        host = any(f"host_{k}" in model for k in measured)
        for k, v in measured.items():
            cell = f"{k} {v * 1e3:.1f}"
            if k in pred:
                cell += f" / {pred[k] * 1e3:.1f}"
                if k in model:
                    issued = f", host {model[f'host_{k}'] * 1e3:.1f}" if f"host_{k}" in model else ""
                    cell += f" (model {model[k] * 1e3:.1f}{issued})"
            parts.append(cell)
        what = "measured / predicted (the profile's model time" + (", and the host's time issuing it" if host else "") + ")" if pred else "measured"
        line = f"  {name} phases, ms, {what}: " + ", ".join(parts)
        if extra.get("predicted_host_s"):  # [Note: two clocks on an asynchronous device]
            line += (f"; predicted host {extra['predicted_host_s'] * 1e3:.1f} ms, device waiting for it "
                     f"{(extra.get('predicted_waiting_for_host_s') or 0.0) * 1e3:.1f} ms")
        if extra.get("profile_host_times"):
            line += f"; the profile's host times: {extra['profile_host_times']}"
        out.append(line)
    return out


def _against_fastest_torch(mine: dict[str, dict]) -> list[str]:
    """AutoDist's auto contenders against the fastest of torch's DDP and FSDP2, eager and compiled
    (issue 45's target: auto at least as fast), and their predicted against measured step."""
    torch_ok = {n: r for n, r in mine.items() if n in ("ddp", "ddp:compile", "fsdp2", "fsdp2:compile") and not r["error"]}
    if not torch_ok:
        return []
    best = min(torch_ok, key=lambda n: torch_ok[n]["median_step_s"])
    out = []
    for name in ("autodist:auto", "autodist:auto+compile"):
        r = mine.get(name)
        if not r or r["error"]:
            continue
        t, b = r["median_step_s"], torch_ok[best]["median_step_s"]
        pred = r.get("extra", {}).get("predicted_step_s")
        err = f"; predicted {pred * 1e3:.1f} ms ({(pred - t) / t:+.1%} of measured)" if pred else ""
        out.append(f"  {name}: {t * 1e3:.1f} ms vs fastest torch ({best}) {b * 1e3:.1f} ms: {b / t:.3f}x its speed{err}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (unknown models or contenders exit with status 2)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help=f"comma-separated (default: {','.join(DEFAULT_MODELS)}, those the --size has)")
    ap.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS), help="comma-separated (default: all)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (default: 2)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per contender per pass (default: 8)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    ap.add_argument("--passes", type=int, default=2, help="passes over the contenders, alternating order (default: 2)")
    ap.add_argument("--batch", type=int, default=None, help="per-rank batch (default: per model)")
    ap.add_argument("--size", default="default", choices=["default", "tiny", "gpu"], help="model sizes (tiny: for tests; gpu: one GPU's scale)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    ap.add_argument("--mixed-precision", default="none", choices=["none", "bf16"],
                    help="bf16: every wrapper computes in bf16 and reduces in fp32 (compute: the model cast to bf16)")
    ap.add_argument("--memory-limit", default=None, help="budget for contenders that take one, e.g. 300MB")
    ap.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
                    help="torch.compile backend of the compile contenders (default: inductor)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches (of --batch each) per optimizer step (default: 1)")
    ap.add_argument("--interleave", action="store_true",
                    help="build every contender at once and time their steps in turn, each alone (see [Note: paired "
                         "steps]); reports the median difference of neighbouring steps")
    ap.add_argument("--fsdp-grid", action="store_true", help="also run FSDP2's knob grid (18 configurations)")
    ap.add_argument("--grid-passes", type=int, default=1, help="passes over the grid (default: 1)")
    ap.add_argument("--cache-dir", default=None, help="AutoDist cache for plan=auto (default: a fresh temporary one)")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    ap.add_argument("--fixed-mmap-threshold", action="store_true",
                    help="fix glibc's mmap threshold so that 'resident' follows live tensors; every allocation of "
                         "128 KiB or more then faults its pages afresh, so steps run slower than a user's (up to "
                         "30-40%% on a CPU host) than the predictions assume")
    ap.add_argument("--minutes", type=float, default=None,
                    help="start no contender run after this long; those left are reported as not run")
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.minutes is not None and args.deadline is None:
        args.deadline = time.time() + 60 * args.minutes
    models = zoo(args.size)
    args.models = [m for m in args.models.split(",") if m] if args.models else [m for m in DEFAULT_MODELS if m in models]
    args.contenders = [c for c in args.contenders.split(",") if c]
    unknown = [m for m in args.models if m not in models] + [c for c in args.contenders if c not in CONTENDERS and c not in GRID]
    if unknown:
        ap.error(f"unknown model or contender: {', '.join(unknown)} (models: {', '.join(models)}; contenders: {', '.join(CONTENDERS)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        exit_rank()  # [Note: a rank's exit after torch's DDP] in tools/_launch.py
    worker_args = [
        "--models", ",".join(args.models), "--contenders", ",".join(args.contenders),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--passes", str(args.passes),
        "--size", args.size, "--device", args.device, "--mixed-precision", args.mixed_precision,
        "--grid-passes", str(args.grid_passes), "--accum", str(args.accum), "--compile-backend", args.compile_backend,
        "--cache-dir", args.cache_dir or os.path.join("{tmp}", "cache"),
    ]
    if args.fsdp_grid:
        worker_args.append("--fsdp-grid")
    if args.interleave:
        if args.fsdp_grid:
            print("bench: --interleave does not take --fsdp-grid (the grid's 18 configurations at once)", file=sys.stderr)
            return 2
        worker_args.append("--interleave")
    if args.deadline is not None:
        worker_args += ["--deadline", repr(args.deadline)]
    if args.batch is not None:
        worker_args += ["--batch", str(args.batch)]
    if args.memory_limit is not None:
        worker_args += ["--memory-limit", args.memory_limit]
    t0 = time.time()
    load_before = os.getloadavg()  # the host is shared: its load says how noisy the timings are

    def stamp(payload: dict, _name: str) -> None:
        payload["wall_seconds"] = time.time() - t0
        payload["compile_backend"] = args.compile_backend
        payload["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
        payload["command"] = "python tools/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
        # [Note: timing as users train]
        payload["malloc"] = "fixed mmap threshold" if args.fixed_mmap_threshold else "default"

    return run_tool(__file__, args.nproc, worker_args, table, args.json, extra=stamp, resident=args.fixed_mmap_threshold)


if __name__ == "__main__":
    sys.exit(main())
