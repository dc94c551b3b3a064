"""Recomputation the plan asks for: the forward of a block runs again during backward instead of its
activations being kept from forward to backward (activation checkpointing, without touching the
model's code).

[Note: how a block is recomputed] Each recomputed block's forward runs under torch's non-reentrant
``torch.utils.checkpoint.checkpoint``: the block keeps only its inputs, and the first time backward
needs one of its saved tensors the block's original forward runs again (with the RNG state of the
forward, so dropout repeats). The runtime's module hooks treat that recomputation as they treat any
model's own checkpointing (backward.py): its gathers are prefetched, nothing is freed until the
block's backward is complete. The block's ``forward`` is wrapped by an instance attribute that
shadows the class's method — the module keeps its class, its code, its parameters and their names,
and ``remove()`` (a plan switch, ``AutoDist.close()``) restores it exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .backward import in_backward

_MISSING = object()


def _recomputed(block: nn.Module, forward: Callable[..., Any], on_recompute: Callable[[], None]) -> Callable[..., Any]:
    def again(*args: Any, **kwargs: Any) -> Any:
        if in_backward():
            on_recompute()
            # The recomputation goes through the block's ``__call__``, so its own hooks run as they
            # did in forward (a block that owns parameters itself is gathered and swapped in, as
            # when a model checkpoints a whole module); ``run`` below then calls ``forward``.
            return block(*args, **kwargs)
        return forward(*args, **kwargs)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or in_backward():
            return forward(*args, **kwargs)  # no graph to save (eval, or the recomputation itself)
        return checkpoint(again, *args, use_reentrant=False, **kwargs)

    return run


class BlockRecompute:
    """Recompute the forward of ``blocks`` (module names) of ``module`` during backward;
    ``on_recompute`` is called each time one runs again."""

    def __init__(self, module: nn.Module, blocks: list[str], on_recompute: Callable[[], None] = lambda: None) -> None:
        self.blocks = list(blocks)
        self._patched: list[tuple[nn.Module, object]] = []
        for name in self.blocks:
            block = module.get_submodule(name)
            previous = block.__dict__.get("forward", _MISSING)
            block.forward = _recomputed(block, block.forward, on_recompute)
            self._patched.append((block, previous))

    def remove(self) -> None:
        for block, previous in reversed(self._patched):
            if previous is _MISSING:
                block.__dict__.pop("forward", None)
            else:
                block.forward = previous
        self._patched.clear()
