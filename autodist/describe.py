"""What a plan's prediction and provenance say, in words: one function for the log line of the plan
chosen and for ``autodist show`` / ``autodist plan``, so the same plan reads the same everywhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .cost.budget import format_bytes

if TYPE_CHECKING:
    from .plan import Plan

BUILTIN_SEEDS = ("ddp", "fsdp", "zero2")


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
    return text
