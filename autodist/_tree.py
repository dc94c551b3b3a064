"""Finding the tensors in what a model or module returns."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten


def output_leaves(out: object) -> list[object]:
    """The leaves of a model's or module's output: pytree containers (tuples, dicts, Hugging Face
    ``ModelOutput``) are flattened, and so are plain objects that hold their results as attributes
    (a ``SimpleNamespace``, a dataclass that is not a registered pytree)."""
    if isinstance(out, torch.Tensor):  # the common case, without pytree's cost (every module's output)
        return [out]
    leaves, seen = [], set()
    stack = [out]
    while stack:
        for leaf in tree_flatten(stack.pop())[0]:
            if isinstance(leaf, torch.Tensor) or not hasattr(leaf, "__dict__") or id(leaf) in seen:
                leaves.append(leaf)
            elif not isinstance(leaf, (type, nn.Module)):
                seen.add(id(leaf))
                stack.append(list(vars(leaf).values()))
    return leaves
