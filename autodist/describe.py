"""What a plan's prediction and provenance say, in words: one function for the log line of the plan
chosen and for ``autodist show`` / ``autodist plan``, so the same plan reads the same everywhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .cost.budget import format_bytes

if TYPE_CHECKING:
    from .plan import Plan

BUILTIN_SEEDS = ("ddp", "fsdp", "zero2", "hsdp")


def kept_seed(plan: Plan) -> str | None:
    """Why the search kept a built-in plan over a searched one, or ``None`` if it did not."""
    seed = plan.provenance.get("preferred_seed")
    if not seed:
        return None
    within = plan.provenance.get("prefer_seed_within")
    margin = f"≥{100 * within:g}%" if isinstance(within, (int, float)) else "clearly"
    return f"kept {seed}: no searched plan was predicted {margin} faster"


def describe_prediction(plan: Plan) -> str:
    """``predicted step 12.34 ms, peak 1.50 GiB; speed-up over ddp 1.00x, fsdp 1.09x; kept ddp: …``"""
    pred = plan.predicted
    parts = []
    if "step_seconds" in pred:
        parts.append(f"predicted step {pred['step_seconds'] * 1e3:.2f} ms")
    if "peak_bytes" in pred:
        parts.append(f"peak {format_bytes(pred['peak_bytes'])}")
    text = ", ".join(parts) or "no prediction recorded"
    vs = pred.get("vs") or {}
    gains = ", ".join(f"{name} {vs[name]:.2f}x" for name in BUILTIN_SEEDS if name in vs)
    if gains:
        text += f"; speed-up over {gains}"
    kept = kept_seed(plan)
    if kept:
        text += f"; {kept}"
    memory = describe_memory_levers(plan)
    if memory:
        text += f"; {memory}"
    compiled = describe_compile(plan)
    if compiled:
        text += f"; {compiled}"
    return text


def describe_compile(plan: Plan) -> str:
    """The plan's compiled blocks and their one-off compile time, apart from the step (empty when
    it compiles nothing and was not searched with compilation allowed)."""
    allowed = plan.provenance.get("compile_allowed")
    if not plan.compile:
        return f"compiles no block (compile={allowed!r} allowed it; none was predicted to gain)" if allowed else ""
    shown = ", ".join(plan.compile[:4]) + (f" and {len(plan.compile) - 4} more" if len(plan.compile) > 4 else "")
    text = f"compiles {len(plan.compile)} block(s) with {plan.compile_backend} ({shown})"
    seconds = plan.predicted.get("compile_seconds")
    if isinstance(seconds, (int, float)) and seconds >= 0.05:
        text += f", a one-off {seconds:.1f} s of compiling as profiled (not in the predicted step)"
    elif isinstance(seconds, (int, float)):
        text += ", compiled already in this process when profiled (its one-off compile time not measured)"
    return text


def describe_memory_levers(plan: Plan) -> str:
    """The plan's recomputation and gradient accumulation, in words (empty when it has neither)."""
    parts = []
    if plan.recompute:
        shown = ", ".join(plan.recompute[:4]) + (f" and {len(plan.recompute) - 4} more" if len(plan.recompute) > 4 else "")
        parts.append(f"recomputes {len(plan.recompute)} block(s) in backward ({shown})")
    if plan.grad_accum_steps > 1:
        sharded = [u for u in plan.units if u.placement == "shard"]
        every = sum(u.accumulate == "sharded" for u in sharded)
        how = f", {every} of {len(sharded)} sharded units reduce every micro-batch" if sharded else ""
        parts.append(f"planned for {plan.grad_accum_steps} micro-batches per step{how}")
    return "; ".join(parts)
