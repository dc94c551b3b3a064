"""Checkpoints: DCP save under one plan and world size, load under another, continue identically."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import models
from autodist import AutoDist
from parity import make_plan, train_mlp

GLOBAL_BATCH = 8


def _build(plan, seed):
    world = dist.get_world_size()
    spec = make_plan(models.make("mlp"), world, **plan) if isinstance(plan, dict) else plan
    m = AutoDist(models.make("mlp", seed=seed), plan=spec)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def _train(m, opt, gen, steps):
    train_mlp(m, opt, gen, steps, GLOBAL_BATCH)


def _full_optim(m, opt):
    sd = get_optimizer_state_dict(m, opt, options=StateDictOptions(full_state_dict=True))
    return {k: {s: v.clone() for s, v in st.items()} for k, st in sd["state"].items()}


def _targets(m, opt, via_module):
    model_sd = get_model_state_dict(m.module if via_module else m)
    return {"model": model_sd, "optim": get_optimizer_state_dict(m, opt)}


def _save(path, plan, via_module):
    m, opt = _build(plan, seed=0)
    gen = torch.Generator().manual_seed(7)
    _train(m, opt, gen, 3)
    dcp.save(_targets(m, opt, via_module), checkpoint_id=path)
    saved = {"params": {k: v.clone() for k, v in m.state_dict().items()}, "optim": _full_optim(m, opt)}
    _train(m, opt, gen, 2)
    saved["final"] = m.state_dict()
    m.close()
    if dist.get_rank() == 0:
        torch.save(saved, os.path.join(path, "expected.pt"))
    dist.barrier()


def _load(path, plan, via_module):
    m, opt = _build(plan, seed=123)
    sd = _targets(m, opt, via_module)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(m.module if via_module else m, sd["model"])
    set_optimizer_state_dict(m, opt, sd["optim"])
    expected = torch.load(os.path.join(path, "expected.pt"), weights_only=False)
    got = m.state_dict()
    err = {"params": max((got[k] - v).abs().max().item() for k, v in expected["params"].items())}
    optim = _full_optim(m, opt)
    err["optim"] = max(
        (optim[k][s].float() - v.float()).abs().max().item() for k, st in expected["optim"].items() for s, v in st.items()
    )
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        models.batch("mlp", GLOBAL_BATCH, gen)  # same data stream as the saving run
    _train(m, opt, gen, 2)
    final = m.state_dict()
    err["continued"] = max((final[k] - v).abs().max().item() for k, v in expected["final"].items())
    m.close()
    return err


SAVE_LOAD = [
    ("fsdp", "ddp", False),
    ("ddp", {"residency": "persistent", "grouping": "all"}, False),
    ("fsdp", {"placement": "mixed", "residency": "after_backward"}, True),
    ({"residency": "persistent"}, "fsdp", True),
]


@pytest.mark.parametrize("src,dst,via_module", SAVE_LOAD)
def test_dcp_checkpoint_across_plans_same_world(world2, src, dst, via_module):
    with tempfile.TemporaryDirectory() as d:
        world2.run(_save, d, src, via_module)
        for err in world2.run(_load, d, dst, via_module):
            assert err["params"] == 0.0 and err["optim"] == 0.0, err
            assert err["continued"] < 1e-5, err


@pytest.mark.parametrize("via_module", [False, True], ids=["full", "sharded"])
def test_dcp_checkpoint_across_world_sizes(world2, world4, via_module):
    with tempfile.TemporaryDirectory() as d:
        world2.run(_save, d, "fsdp", via_module)
        for err in world4.run(_load, d, {"residency": "after_backward", "grouping": "all"}, via_module):
            assert err["params"] == 0.0 and err["optim"] == 0.0, err
            assert err["continued"] < 1e-5, err
    with tempfile.TemporaryDirectory() as d:
        world4.run(_save, d, {"placement": "mixed"}, via_module)
        for err in world2.run(_load, d, "fsdp", via_module):
            assert err["params"] == 0.0 and err["optim"] == 0.0, err
            assert err["continued"] < 1e-5, err
