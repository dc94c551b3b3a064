"""Shadowing a module's ``forward`` on its instance, and putting back exactly what was there: how the
plan's recomputation (recompute.py) and compilation (compiled.py) take effect without touching the
model's code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

_MISSING = object()


class ForwardPatches:
    """The blocks whose ``forward`` was shadowed, each with what its instance dict held before
    (any value; ``_MISSING``: nothing, the class's method showed through)."""

    def __init__(self) -> None:
        self._patched: list[tuple[nn.Module, Any]] = []

    def shadow(self, block: nn.Module, forward: Callable[..., Any]) -> None:
        self._patched.append((block, block.__dict__.get("forward", _MISSING)))
        block.forward = forward  # type: ignore[method-assign]

    def remove(self) -> None:
        for block, previous in reversed(self._patched):
            if previous is _MISSING:
                block.__dict__.pop("forward", None)
            else:
                block.forward = previous  # type: ignore[method-assign]
        self._patched.clear()
