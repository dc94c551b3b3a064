"""The loss a step backpropagates when AutoDist runs a model itself (profiling, counting, checking):
the model's own when it returns one, else a stand-in over its outputs."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ._tree import output_leaves


def model_loss(out: object) -> torch.Tensor | None:
    """The loss a model returns itself (Hugging Face models given ``labels=``: an output mapping or
    object with a scalar ``loss`` that requires grad), or None."""
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad:
        return loss
    return None


def surrogate_loss(out: object) -> torch.Tensor | None:
    """A stand-in when the model returns no loss: the sum of the means of its floating-point outputs
    that require grad (every output's backward runs, as a real loss's would); ``None`` when no
    output requires grad (a frozen model fed inputs that need none: it has no backward, and is
    profiled forward only)."""
    floats = [t for t in output_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not floats:
        return None
    means = [t.float().mean() for t in floats]
    return sum(means[1:], start=means[0])
