"""Where the runtime stands in autograd's backward pass, and the post-backward signal of a module.

[Note: post-backward] A gathered parameter may be freed only when no backward computation will read
it again. "All its gradients have arrived" is not that moment: a backward node can still read the
full weight after the weight's gradient was produced (a ``W.detach()`` saved for another input's
gradient, a weight shared by two operations). The moment is the end of the module's backward, and
the end of a module's backward is when the gradients of the module's *inputs* have been computed:
the runtime passes the inputs of every module forward (that runs with gradients enabled and has an
input that requires grad) through :class:`PostBackward`, an identity autograd function whose
backward runs after every node of the module's backward. A forward whose inputs need no gradient
(the first layer of a network) has no such signal; its end is when every gradient of its
parameters has been accumulated, or the end of the whole backward.

[Note: recomputation] Activation checkpointing runs a module's forward again *inside* the backward
pass. Its forward hooks then fire while autograd is executing a graph task, which is how the runtime
tells a recomputation from a forward (FSDP2 does the same). A recomputation needs the parameters
gathered and must not free them after its forward: its backward follows at once. With
non-reentrant checkpointing the recomputed graph is discarded (only the saved tensors are kept), so
the original forward's post-backward signal is the one that fires; with reentrant checkpointing the
original forward ran without gradients, had no signal, and the recomputed graph is the one that is
backpropagated, so the recomputation attaches the signal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)


def outside_dispatch_modes() -> contextlib.AbstractContextManager:
    """Run the runtime's own tensor operations (gather copies, bucket copies) unseen by the
    ``TorchDispatchMode``s active around a hook. Selective activation checkpointing is such a mode:
    it records every operation of a checkpointed region and requires the recomputation to repeat
    them exactly, which the runtime's operations — gathered at a different point in forward than in
    recomputation — would not. A no-op when no mode is active."""
    if _dispatch_modes is None or _dispatch_modes() == 0:
        return contextlib.nullcontext()
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def in_backward() -> bool:
    """Whether autograd is executing a backward pass on this thread (a module forward that runs now
    is a recomputation)."""
    return _graph_task_id is not None and _graph_task_id() != -1


class PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; ``callback()`` runs when the module's backward is complete."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def attach_post_backward(args: tuple, kwargs: dict, callback: Callable[[], None]) -> tuple[tuple, dict] | None:
    """Route the tensors of ``(args, kwargs)`` that require grad through :class:`PostBackward`.
    Returns the new ``(args, kwargs)``, or ``None`` when no input requires grad (no signal).

    [Note: inputs keep their identity] A tensor passed more than once is routed once, and every
    place that held it gets the same output: modules branch on identity (``nn.MultiheadAttention``
    takes ``query is key is value`` as self-attention and projects it with one packed matmul). Routed
    one place at a time, the copies were distinct, so the module took its other path in forward; in
    a recomputation, which is not routed (the original forward's signal is in the graph), it took
    the packed one, saved a different number of tensors, and torch's checkpoint refused the
    backward (``nn.TransformerEncoderLayer`` recomputed under any sharded plan)."""
    if not kwargs and all(type(x) is torch.Tensor for x in args):
        # tensors only, the common case: no pytree round trip (every module's forward)
        leaves, spec = list(args), None
    else:
        leaves, spec = tree_flatten((args, kwargs))
    distinct: list[torch.Tensor] = []
    slot_of: dict[int, int] = {}  # id of a tensor -> its place in ``distinct``
    places: list[tuple[int, int]] = []  # (leaf index, place in ``distinct``)
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            if id(x) not in slot_of:
                slot_of[id(x)] = len(distinct)
                distinct.append(x)
            places.append((i, slot_of[id(x)]))
    if not distinct:
        return None
    outs = PostBackward.apply(callback, *distinct)
    for i, k in places:
        leaves[i] = outs[k]
    if spec is None:
        return tuple(leaves), kwargs
    new_args, new_kwargs = tree_unflatten(leaves, spec)
    return new_args, new_kwargs
