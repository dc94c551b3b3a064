"""Gather groups hooked at their root module (autodist/schedule.py [Note: hooks per gather group]).

A group whose units are exactly one module's is enacted at that module once the first step has shown
that its forward encloses its units' ([Note: probing the group roots] in runtime/engine.py). These
tests train the same model from the same start with every unit hooked (``collapse=False``) and with
groups collapsed, and check that both issue the same actions and end bitwise equal, that a root the
model never calls (an iterated ``ModuleList``) or whose unit runs outside its forward is not
collapsed, and that training then still matches a single-process reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import models
from autodist import AutoDist
from autodist.runtime.engine import Engine
from autodist.schedule import collapsed_groups
from autodist.structure import discover
from parity import make_plan


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class CalledOutside(nn.Module):
    """``blocks.0.b`` also runs outside ``blocks.0``'s forward: its group must stay hooked per unit."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Pair() for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.blocks[0].b(x))


def _build(name: str) -> nn.Module:
    if name == "called-outside":
        torch.manual_seed(0)
        return CalledOutside()
    return models.make(name)


def _batch(name: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "called-outside":
        return torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
    return models.batch(name, 6, gen)


def _loss(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y) if name == "called-outside" else models.loss_fn(name, out, y)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def train(name: str, plan_spec, collapse: bool | None, steps: int = 3) -> dict:
    """``steps`` steps of ``name`` under ``plan_spec`` (every rank on the same batches, so the
    reduced gradient is the single-process one); ``collapse=None``: the plain model (reference)."""
    gen = torch.Generator().manual_seed(1)
    base = _build(name)
    world = torch.distributed.get_world_size()
    if collapse is None:
        model = copy.deepcopy(base)
    else:
        plan = make_plan(base, world, **plan_spec) if isinstance(plan_spec, dict) else plan_spec
        defaults = Engine.__init__.__kwdefaults__
        before = defaults["collapse"]
        defaults["collapse"] = collapse
        try:
            model = AutoDist(base, plan=plan)
        finally:
            defaults["collapse"] = before
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    logs, hooks = [], []
    for _ in range(steps):
        x, y = _batch(name, gen)
        log = None
        if collapse is not None:
            hooks.append(len(model.runtime._module_handles))
            log = model.runtime.record_actions()
        _loss(name, model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if log is not None:
            logs.append(list(log.actions))
    out = {"params": {n: _full(p) for n, p in model.named_parameters()}, "logs": logs, "hooks": hooks}
    if collapse is not None:
        rt = model.runtime
        out["candidates"] = sorted(rt._candidates)
        out["collapsed"] = sorted(rt._collapsed)
        out["in_structure"] = sorted(collapsed_groups(rt.plan, discover(_build(name))).values())
        model.close()
    return out


def compare(name: str, plan_spec) -> dict:
    ref = train(name, plan_spec, None)
    per_unit = train(name, plan_spec, False)
    grouped = train(name, plan_spec, True)
    return {
        "ref_diff": max((grouped["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"]),
        "bitwise": all(torch.equal(grouped["params"][k], per_unit["params"][k]) for k in ref["params"]),
        "same_actions": grouped["logs"] == per_unit["logs"],
        "same_action_sets": [sorted(a) for a in grouped["logs"]] == [sorted(a) for a in per_unit["logs"]],
        "candidates": grouped["candidates"],
        "collapsed": grouped["collapsed"],
        "in_structure": grouped["in_structure"],
        "hooks": grouped["hooks"],
        "hooks_per_unit": per_unit["hooks"],
    }


CASES = {
    "gpt-fsdp": ("gpt", "fsdp"),
    "gpt-zero2": ("gpt", "zero2"),
    "resnet-blocks": ("resnet", {"grouping": "block"}),
    "gpt-ckpt-reentrant": ("gpt-ckpt-reentrant", "fsdp"),
    "gpt-ckpt-nonreentrant": ("gpt-ckpt-nonreentrant", "fsdp"),
    "mlp-one-group": ("mlp", {"grouping": "all"}),
    "called-outside": ("called-outside", {"grouping": "block"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_groups_hooked_at_their_root_act_and_train_as_hooked_units(world2, case):
    name, plan = CASES[case]
    for r in world2.run(compare, name, plan):
        if case == "gpt-ckpt-reentrant":
            # Reentrant checkpointing inside a block: with every unit hooked, nothing sees the
            # block's backward begin before its recomputation (the units' first forward ran without
            # gradients, so no pre-backward hook was set), so the group is gathered on demand after
            # the recomputation is recorded; the root's pre-backward gathers it first, the order
            # the simulator takes. The same actions, one pair in another order.
            assert r["same_action_sets"], case
        else:
            assert r["same_actions"], case
        assert r["bitwise"], case
        assert r["ref_diff"] < 1e-5, (case, r["ref_diff"])
        assert r["candidates"] == r["in_structure"]
        if case == "mlp-one-group":  # the root, ``layers``, is a ModuleList the model iterates
            assert r["candidates"] == ["layers"] and r["collapsed"] == []
        elif case == "called-outside":
            assert r["candidates"] == ["blocks.0", "blocks.1", "blocks.2"]
            assert r["collapsed"] == ["blocks.1", "blocks.2"]
        else:
            assert r["collapsed"] and r["collapsed"] == r["candidates"], r
            # the first step hooks every unit and probes each root (two hooks); later ones hook the roots
            assert r["hooks"][0] == r["hooks_per_unit"][0] + 2 * len(r["candidates"]), r
            assert r["hooks"][1] < r["hooks_per_unit"][1] / (1.3 if "ckpt" in case else 2), r
