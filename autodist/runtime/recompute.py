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

[Note: the recomputation leaves the block's state alone] A block's forward may change its own
buffers: BatchNorm in training adds the batch to its running statistics and counts it. Run again
during backward, it would do so twice, and the model's running statistics would silently differ from
training without recomputation (torch's checkpoint does nothing about this; BatchNorm's kernel even
writes its running statistics without bumping their version counter, so a change can only be seen by
value). So the recomputation runs on the buffers as the forward saw them and leaves them as the
forward left them:

- The first forward of a block with gradients on copies every buffer of the block, and compares
  afterwards: the buffers it changed (by value, by version or by being replaced) are the block's
  *state*. Every later forward copies the state alone beforehand (BatchNorm: two vectors and a
  counter per layer, held until the block's backward), and adds any buffer it is seen to change by
  version or replacement.
- The recomputation swaps the forward's copies in, runs, and puts back what the buffers held before
  it (the values after this forward, or after a later call of the same block), so the recomputed
  forward computes what the forward did and the model keeps the state training without recomputation
  would have.
- A buffer the recomputation changes that the forward was not seen to change (control flow taking
  another branch) is also put back; the two forwards then differed, which torch's checkpoint reports
  where it changes what is saved.

[Note: a Hugging Face layer's cache under recomputation] A Hugging Face decoder layer
(``transformers``' ``GradientCheckpointingLayer``: Llama's, T5's, ...) writes its keys and values into
the cache object its model passes it (``use_cache`` is on by default, in training too). Recomputed,
the layer wrote them a second time and attended over both copies: with a padding mask the
recomputation failed on the mask's shape (Llama: "size of tensor a (24) must match ... (12)"), and
T5 saved other tensors than its forward did (torch's ``CheckpointError``); under ``plan="auto"`` a
plan that recomputes blocks failed so. Such a layer declares how it is checkpointed: its own
``gradient_checkpointing`` flag makes it drop ``use_cache`` and the cache (unless it only reads the
cache) in a training forward with gradients and hand its forward to ``_gradient_checkpointing_func``,
and the model holding it (a ``PreTrainedModel``) has the same flag, which turns ``use_cache`` off
for every layer (GPT-2 passes its cache positionally, out of the layer's reach; in older
transformers versions the model's flag is what checkpoints its layers, through the same function).
A layer the plan recomputes and each Hugging Face model above it get the flag, with a function
that runs the forward as it is (the recomputation is the plan's, as above), so they follow the
contract of ``gradient_checkpointing_enable()``: no cache from a training forward with gradients
(transformers logs this once); evaluation and generation in ``eval()`` mode keep it (GPT-2 drops
it in training mode even without gradients, as under its own checkpointing).
``remove()`` puts both attributes back; a module the user already checkpoints is left as it is.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .backward import in_backward
from .forward_patch import ForwardPatches


class _BlockState:
    """Which of a block's buffers its forward changes (the block's state), learnt from its
    forwards; see [Note: the recomputation leaves the block's state alone]."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.state: set[str] | None = None  # None until a forward has been watched whole

    def before_forward(self) -> _Snapshot:
        buffers = dict(self.block.named_buffers())
        return _Snapshot(buffers, buffers if self.state is None else self.state)

    def after_forward(self, before: _Snapshot) -> None:
        changed = before.changed(dict(self.block.named_buffers()), by_value=self.state is None)
        if self.state is None:
            self.state = changed
            before.keep_only(changed)
        else:
            self.state |= changed

    @contextlib.contextmanager
    def as_in_forward(self, before: _Snapshot) -> Iterator[None]:
        """Run the recomputation on the buffers as this forward found them, then put back what
        they held before it."""
        now = dict(self.block.named_buffers())
        kept = _Snapshot(now, now)  # every buffer, for as long as the recomputation runs
        before.load(self.block, before.values)
        try:
            yield
        finally:
            stray = kept.changed(dict(self.block.named_buffers()), by_value=False)
            kept.load(self.block, set(before.values) | stray)


class _Snapshot:
    """A block's buffers at one moment: the tensor each name held, its version counter then, and
    copies of the values of the buffers named ``copy``."""

    def __init__(self, buffers: dict[str, torch.Tensor], copy: Iterable[str]) -> None:
        self.tensors = dict(buffers)
        self.versions = {n: t._version for n, t in buffers.items()}
        self.values = {n: buffers[n].detach().clone() for n in copy if n in buffers}

    def changed(self, buffers: dict[str, torch.Tensor], *, by_value: bool) -> set[str]:
        """Names whose buffer has been replaced, removed or written since (by value too: only
        where a copy was kept, and only when ``by_value``)."""
        out = {n for n in self.tensors if n not in buffers}
        for n, t in buffers.items():
            if self.tensors.get(n) is not t or self.versions[n] != t._version:
                out.add(n)
            elif by_value and n in self.values and not torch.equal(self.values[n], t):
                out.add(n)
        return out

    def keep_only(self, names: set[str]) -> None:
        self.values = {n: v for n, v in self.values.items() if n in names}

    def load(self, block: nn.Module, names: Iterable[str]) -> None:
        """Make each buffer of ``names`` the tensor it was, holding the value copied then.

        The value is written through ``.data``, out of sight of the tensor's version counter, as
        BatchNorm's kernel writes its running statistics: a running statistic is saved for
        BatchNorm's backward, and every buffer ends the recomputation holding what it held before
        it, so nothing saved for backward sees another value than it would have."""
        for name in names:
            if name not in self.values:
                continue
            owner, _, attr = name.rpartition(".")
            module = block.get_submodule(owner)
            tensor = self.tensors[name]
            if module._buffers.get(attr) is not tensor:
                module._buffers[attr] = tensor
            tensor.data.copy_(self.values[name])


def _recomputed(block: nn.Module, forward: Callable[..., Any], on_recompute: Callable[[], None]) -> Callable[..., Any]:
    watch = _BlockState(block)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or in_backward():
            return forward(*args, **kwargs)  # no graph to save (eval, or the recomputation itself)
        before = watch.before_forward()

        def again(*args: Any, **kwargs: Any) -> Any:
            if in_backward():
                on_recompute()
                # The recomputation goes through the block's ``__call__``, so its own hooks run as
                # they did in forward (a block that owns parameters itself is gathered and swapped
                # in, as when a model checkpoints a whole module); ``run`` above then calls
                # ``forward``.
                with watch.as_in_forward(before):
                    return block(*args, **kwargs)
            return forward(*args, **kwargs)

        out = checkpoint(again, *args, use_reentrant=False, **kwargs)
        watch.after_forward(before)
        return out

    return run


def _run_as_is(forward: Callable[..., Any], *args: Any) -> Any:
    return forward(*args)


_DECLARING_CLASSES = ("GradientCheckpointingLayer", "PreTrainedModel")


def _declares_checkpointing(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face layer or model that declares how it is checkpointed (see
    [Note: a Hugging Face layer's cache under recomputation]) and is not checkpointed already."""
    return getattr(module, "gradient_checkpointing", None) is False and any(
        c.__name__ in _DECLARING_CLASSES and c.__module__.startswith("transformers.") for c in type(module).__mro__
    )


_CHECKPOINTING_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")


class BlockRecompute:
    """Recompute the forward of ``blocks`` (module names) of ``module`` during backward;
    ``on_recompute`` is called each time one runs again."""

    def __init__(self, module: nn.Module, blocks: list[str], on_recompute: Callable[[], None] = lambda: None) -> None:
        self.blocks = list(blocks)
        self._patches = ForwardPatches()
        # each Hugging Face layer or model flagged here, with what its instance dict held for the
        # flag's attributes ([Note: a Hugging Face layer's cache under recomputation])
        self._flagged: list[tuple[nn.Module, dict[str, Any]]] = []
        for name in self.blocks:
            block = module.get_submodule(name)
            parts = name.split(".") if name else []
            for owner in [module.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]:
                if _declares_checkpointing(owner):
                    self._flagged.append((owner, {a: owner.__dict__[a] for a in _CHECKPOINTING_ATTRS if a in owner.__dict__}))
                    owner.__dict__.update(gradient_checkpointing=True, _gradient_checkpointing_func=_run_as_is)
            self._patches.shadow(block, _recomputed(block, block.forward, on_recompute))

    def remove(self) -> None:
        self._patches.remove()
        for block, previous in reversed(self._flagged):
            for attr in _CHECKPOINTING_ATTRS:
                if attr in previous:
                    block.__dict__[attr] = previous[attr]
                else:
                    block.__dict__.pop(attr, None)
        self._flagged.clear()
