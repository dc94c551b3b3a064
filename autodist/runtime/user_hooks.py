"""Gradient hooks the user registers on the parameters the model shows (``model.parameters()``).

[Note: hooks on the visible parameters] Training code registers two kinds of hook on parameters:

* ``p.register_hook(fn)``: ``fn`` sees the gradient before it is accumulated into ``p.grad`` and
  may replace it (per-parameter clipping, scaling, logging). Under DDP it sees this rank's local
  gradient, before the reduction.
* ``p.register_post_accumulate_grad_hook(fn)``: ``fn(p)`` runs once ``p.grad`` holds the gradient —
  torch's optimizer-in-backward recipe steps a per-parameter optimizer there. FSDP2 runs these on
  its sharded parameters after each reduce-scatter.

Autograd runs a tensor's hooks only on the leaf the forward computed with. Where that is not the
visible parameter (a sharded parameter's full tensor, a compute-dtype copy, the plain tensor behind
a replicated DTensor) the user's hooks never ran: a gradient-scaling hook was ignored and an
optimizer stepped in a post-accumulate hook never stepped (gpt under ``fsdp``: 0.45 off the
reference after 4 steps, the parameters untouched). Where the visible parameter is the leaf (a
replicated plan), post-accumulate hooks ran on the local gradient, before the reduction: each rank
stepped its own gradient and the ranks' parameters drifted apart (gpt under ``ddp``: 0.08 off, the
ranks disagreeing), as they do under DDP.

So, under every plan:

* a ``register_hook`` hook sees this rank's local gradient before the reduction, as under DDP:
  autograd runs it where the visible parameter is the leaf, and otherwise a hook on the leaf
  forwards the gradient (full-size, in the compute dtype) to the visible parameter's hooks, in
  their order, each one's result passed to the next;
* a post-accumulate hook runs once the visible ``.grad`` holds the backward's gradient: at the end
  of a backward that reduces it, on every rank alike (not for a parameter no rank computed a
  gradient for), and in a ``no_sync`` backward where that backward changed ``.grad``: a visible
  parameter that is the leaf (accumulated locally, as under DDP) or a sharded unit accumulating
  sharded gradients (reduced every micro-batch); other sharded parameters show no gradient until
  the synchronising backward. The runtime's own hook sits on that same leaf, in the same dict, so
  each of the user's entries there is replaced in place by a :class:`Deferred` that autograd calls
  to no effect and the runtime calls through after the reduction: the dict stays where it is, so
  the handles ``register_post_accumulate_grad_hook`` returned keep removing them, and the entries
  are put back as they were when the runtime's hooks are removed (a plan switch, ``close()``). The
  runtime's and its profiler's own hooks are marked :func:`internal` and left alone. A visible
  parameter that is not the forward's leaf gets its entries deferred the same way: autograd
  reaches it when a term of the loss outside the forward uses it (an L2 penalty through
  ``.full_tensor()``), before the reduction, and ran the user's hook there too (twice a step
  under ``fsdp``: an optimizer stepped in it stepped on the penalty's gradient alone first).

Hooks registered before wrapping move with the parameter where wrapping replaces it (a sharded
parameter becomes a DTensor). They are looked for at a step's first forward and at the start of
each backward, once any hook was registered since the last look; autograd takes a leaf's hooks
when it reaches the leaf, so one registered between a forward and its backward is seen in time.

Running the user's post-accumulate hooks at the end of the backward holds every gradient until
then: under a sharded plan torch's optimizer-in-backward recipe does not save the gradient memory
it saves under FSDP2 (which steps after each reduce-scatter); the results are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from .params import ManagedParam


INTERNAL = "_autodist_internal"  # set on the runtime's and its profiler's own post-accumulate hooks


def internal(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` (a function, or a method in its class body) as one of AutoDist's own
    post-accumulate hooks: left where it is when the user's are deferred."""
    setattr(fn, INTERNAL, True)
    return fn


class Deferred:
    """A user's post-accumulate hook held in its dict in place: autograd's call does nothing, the
    runtime calls ``fn`` once the gradient is reduced ([Note: hooks on the visible parameters])."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[torch.Tensor], Any]) -> None:
        self.fn = fn

    def __call__(self, param: torch.Tensor) -> None:
        return None


def carry_hooks(original: torch.Tensor, visible: torch.Tensor) -> None:
    """Hooks registered on a parameter before wrapping, onto the parameter that replaced it (the
    dicts themselves: their handles keep working)."""
    if visible is original:
        return
    if original._backward_hooks:
        visible._backward_hooks = original._backward_hooks
    if original._post_accumulate_grad_hooks:
        visible._post_accumulate_grad_hooks = original._post_accumulate_grad_hooks


def _forwarder(visible: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward_to_visible(grad: torch.Tensor) -> torch.Tensor:
        for hook in tuple((visible._backward_hooks or {}).values()):
            out = hook(grad)
            if out is not None:
                grad = out
        return grad

    return forward_to_visible


class ParamHooks:
    """The runtime's gradient-ready hooks and the user's hooks on the same parameters ([Note: hooks
    on the visible parameters])."""

    def __init__(self, params: list[ManagedParam]) -> None:
        trainable = [mp for mp in params if mp.requires_grad]
        self._own = [mp for mp in trainable if mp.full is mp.visible]  # the visible parameter is autograd's leaf
        self._own_visible = [mp.visible for mp in self._own]
        self._apart = [mp for mp in trainable if mp.full is not mp.visible]
        self._apart_visible = [mp.visible for mp in self._apart]
        self._runtime: list[RemovableHandle] = []  # the runtime's gradient-ready hooks
        self._forwarding: dict[int, RemovableHandle] = {}  # leaves forwarding to their visible's hooks
        self.post: list[ManagedParam] = []  # the parameters with post-accumulate hooks of the user's
        self._scanned_at = -1  # RemovableHandle.next_id, less the runtime's own, when the hooks were last looked at
        self._own_ids = 0  # handles the runtime's own per-step hooks took (own())

    def install(self, mp: ManagedParam, hook: Callable[[torch.Tensor], None]) -> None:
        """The runtime's gradient-ready hook on ``mp``'s leaf."""
        self._runtime.append(mp.full.register_post_accumulate_grad_hook(internal(hook)))

    def scan(self) -> None:
        """At a step's first forward and a backward's start: defer the user's post-accumulate hooks
        on the leaves the runtime's hook shares, forward leaves' gradients to visible hooks, list
        who has what. Every hook torch registers takes the next ``RemovableHandle`` id: while that
        has moved by no more than the runtime's own hooks took (:meth:`own`), no hook was registered
        anywhere and there is nothing to look at (a removed one is simply no longer in its dict when
        the hooks run). Looking costs an attribute read per parameter or two: 30-75 us a step for
        580; a second wrapped model, or a module's full backward hook, makes it look every step."""
        if RemovableHandle.next_id - self._own_ids == self._scanned_at:
            return
        listed = []
        for mp, d in zip(self._own, [v._post_accumulate_grad_hooks for v in self._own_visible]):
            if d is not None and len(d) > 1:  # more than the runtime's own
                user = False
                for key, hook in list(d.items()):
                    if isinstance(hook, Deferred):
                        user = True
                    elif not getattr(hook, INTERNAL, False):
                        d[key] = Deferred(hook)
                        user = True
                if user:
                    listed.append(mp)
        complete = True
        pre = [v._backward_hooks for v in self._apart_visible]
        if any(pre):
            for mp, hooks in zip(self._apart, pre):
                if hooks and id(mp) not in self._forwarding:
                    if mp.full.requires_grad:
                        self._forwarding[id(mp)] = mp.full.register_hook(_forwarder(mp.visible))
                    else:
                        complete = False  # frozen now: looked at again at the next step
        post = [v._post_accumulate_grad_hooks for v in self._apart_visible]
        for mp, d in zip(self._apart, post):
            if d:  # deferred too: autograd reaches the visible parameter when a term outside the
                for key, hook in list(d.items()):  # forward uses it, before the reduction
                    if not isinstance(hook, Deferred) and not getattr(hook, INTERNAL, False):
                        d[key] = Deferred(hook)
                listed.append(mp)
        self.post = listed
        if complete:
            self._scanned_at = RemovableHandle.next_id - self._own_ids

    def own(self, register: Callable[..., Any], tensors: list[torch.Tensor], fn: Callable[..., None]) -> None:
        """``register(tensors, fn, mode="any")`` (the runtime's per-forward multi-gradient hooks),
        counting the handle ids it takes, so that :meth:`scan` tells them from the user's."""
        before = RemovableHandle.next_id
        register(tensors, fn, mode="any")
        self._own_ids += RemovableHandle.next_id - before

    def fire(self, mp: ManagedParam) -> None:
        """Run the user's post-accumulate hooks of ``mp`` (its visible ``.grad`` is final)."""
        for hook in tuple((mp.visible._post_accumulate_grad_hooks or {}).values()):
            if isinstance(hook, Deferred):
                hook.fn(mp.visible)
            elif mp.full is not mp.visible:  # autograd never runs a visible parameter's that is not its leaf
                hook(mp.visible)

    def remove(self) -> None:
        """Remove the runtime's hooks; the user's deferred post-accumulate hooks are put back as
        they were registered."""
        for h in [*self._runtime, *self._forwarding.values()]:
            h.remove()
        self._runtime.clear()
        self._forwarding.clear()
        for v in [*self._own_visible, *self._apart_visible]:
            d = v._post_accumulate_grad_hooks
            for key, hook in list((d or {}).items()):
                if isinstance(hook, Deferred):
                    d[key] = hook.fn
        self._scanned_at = -1
        self.post = []
