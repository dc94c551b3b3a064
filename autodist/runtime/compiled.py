"""Compiled blocks the plan asks for: a block's forward runs under ``torch.compile`` (its operators
fused), without touching the model's code.

[Note: how a block is compiled] Each compiled block's ``forward`` is shadowed by an instance
attribute holding ``torch.compile(block.forward, backend=plan.compile_backend)``, as recompute.py
shadows it for recomputation: the module keeps its class, its code, its parameters and their names,
and ``remove()`` (a plan switch, ``AutoDist.close()``) restores exactly what the instance held. The
block's ``__call__`` — and with it the module hooks registered on the block itself — stays eager;
only the forward's body is traced. Dynamo's code cache is keyed by the forward's code, so identical
blocks share one compilation (a block of another shape or dtype adds one). Recomputation, where the
plan asks for both, wraps the compiled forward: the checkpoint runs the compiled code again in
backward.

[Note: hooks at a compiled block's boundary] Nothing of AutoDist may run inside the compiled code:
a module hook traced into the graph runs once at compile time, and one that swaps parameters by
``setattr`` breaks the graph. What the runtime hooks on:

- gradients: post-accumulate-grad hooks on the parameters' autograd leaves fire when autograd's
  ``AccumulateGrad`` runs, after the compiled backward (one autograd node for the whole block) has
  produced every gradient of the block: outside the graph, all at the end of the block's backward;
- replicated parameters: swapped at the root ([Note: replicated parameters swap at the root] in
  engine.py), before the compiled code is entered;
- sharded parameters and the prefetch triggers: the module hooks of every module inside a compiled
  block are merged into one site on the block (:func:`merge_block_sites`): the block's pre-forward
  hook gathers (or waits for) its groups, swaps every full tensor in and fires the prefetches of
  the units it holds; its post-forward hook swaps them out and frees by residency; the backward
  hooks are on the block's inputs and outputs. So the plan validator requires a compiled block's
  sharded units to lie in one gather group, and no offload copy to be anchored inside one.

The merged site fires forward prefetch at the position of the block's *last* unit and backward
prefetch at the position of its *first* unit (last in backward): every trigger that falls inside
the block fires when the block starts, as a window counted from the block's boundary.

A block the user compiled already (``block.compile()``, or a block that is itself a
``torch.compile``'d module) is left as it is and named in :attr:`BlockCompile.user_compiled`. Its
compiled code is the user's ``__call__``, module hooks included: under a replicated plan nothing of
AutoDist is hooked on modules (it trains as compiled); where the plan hooks modules inside it (a
sharded plan), torch.compile traces or breaks at those hooks (graph breaks, recompilations; the
hooks still run, so training stays correct, only slower), so :func:`merge_block_sites` warns,
naming the fix: compile the block through the plan instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .._log import logger
from .forward_patch import ForwardPatches
from .step_state import ModuleSite


def compiled_by_user(module: nn.Module) -> list[str]:
    """Names of the modules under ``module`` (``""``: itself) that the user compiled: a
    ``torch.compile``'d module (``OptimizedModule``) or one whose ``compile()`` was called."""
    from torch._dynamo.eval_frame import OptimizedModule

    return [
        name for name, m in module.named_modules()
        if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
    ]


def _inside(name: str, block: str) -> bool:
    return name == block or name.startswith(block + ".")


class BlockCompile:
    """Run the forward of ``blocks`` (module names) of ``module`` under ``torch.compile`` with
    ``backend``; blocks the user compiled already are left alone (:attr:`user_compiled`)."""

    def __init__(self, module: nn.Module, blocks: Iterable[str], backend: str = "inductor") -> None:
        self.backend = backend
        self.blocks: list[str] = []
        user = compiled_by_user(module)
        blocks = list(blocks)
        self.user_compiled = [b for b in blocks if any(_inside(b, u) or _inside(u, b) for u in user)]
        if self.user_compiled:
            logger.info(
                "autodist: %d block(s) the plan compiles are compiled by the model already (e.g. %s); left as they are",
                len(self.user_compiled), self.user_compiled[0],
            )
        self._patches = ForwardPatches()
        for name in blocks:
            if name in self.user_compiled:
                continue
            block = module.get_submodule(name)
            self._patches.shadow(block, torch.compile(block.forward, backend=backend))
            self.blocks.append(name)

    def remove(self) -> None:
        self._patches.remove()


def merge_block_sites(
    sites: list[ModuleSite], blocks: Iterable[str], module: nn.Module, unit_order: list[str], *, warn: bool = True
) -> list[ModuleSite]:
    """``sites`` (the engine's module hook sites) with every site inside a compiled block of
    ``blocks`` merged into one site on the block (see [Note: hooks at a compiled block's
    boundary]); ``unit_order``: units in forward order."""
    blocks = list(blocks)
    if warn:  # once per plan: the hooks are installed again after the first step's probes
        _warn_hooks_in_user_compiled(sites, module)
    if not blocks:
        return sites
    rank = {u: i for i, u in enumerate(unit_order)}
    out: list[ModuleSite] = []
    merged: dict[str, list[ModuleSite]] = {b: [] for b in blocks}
    for site in sites:
        block = next((b for b in blocks if _inside(site.name, b)), None)
        if block is None:
            out.append(site)
        else:
            merged[block].append(site)
    for block, inner in merged.items():
        if not inner:
            continue
        units = sorted({u for s in inner for u in s.units}, key=lambda u: rank.get(u, len(rank)))
        own = sorted((s.unit for s in inner if s.unit is not None), key=lambda u: rank.get(u, len(rank)))
        out.append(
            ModuleSite(
                module=module.get_submodule(block),
                name=block,
                unit=own[-1] if own else None,
                swaps=_union(m for s in inner for m in s.swaps),
                groups=_union(g for s in inner for g in s.groups),
                units=units,
                params=_union(m for s in inner for m in s.params),
                backward_unit=own[0] if own else None,
            )
        )
    return out


def _warn_hooks_in_user_compiled(sites: list[ModuleSite], module: nn.Module) -> None:
    user = compiled_by_user(module)
    inside = [s.name for s in sites if any(_inside(s.name, u) for u in user)]
    if inside:
        logger.warning(
            "autodist: %d module(s) the plan hooks (e.g. %r) are inside %r, which the model compiled itself "
            "(torch.compile / .compile()): torch.compile traces AutoDist's hooks there (graph breaks, "
            "recompilations). Compile the block through the plan instead (Plan.compile, with the model's own "
            "compilation removed): AutoDist then keeps its hooks at the block's boundary.",
            len(inside), inside[0], next(u for u in user if _inside(inside[0], u)),
        )


def _union(items: Iterable[Any]) -> list[Any]:
    seen: set[int] = set()
    out = []
    for x in items:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out
