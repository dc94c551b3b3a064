"""DCP round trips run on a rank pool: train the test MLP under one plan (and shard size), save with
``torch.distributed.checkpoint``, load under another plan, shard size or world size, and report
how far the loaded state and two continued steps are from the saving run's."""

import os

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


def build(plan, seed, shard_size=None):
    world = dist.get_world_size()
    spec = make_plan(models.make("mlp"), world, **plan) if isinstance(plan, dict) else plan
    m = AutoDist(models.make("mlp", seed=seed), plan=spec, shard_size=shard_size)
    assert m.plan.shard_ranks == (shard_size or world)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def _train(m, opt, gen, steps):
    train_mlp(m, opt, gen, steps, GLOBAL_BATCH)


def _full_optim(m, opt):
    sd = get_optimizer_state_dict(m, opt, options=StateDictOptions(full_state_dict=True))
    return {k: {s: v.clone() for s, v in st.items()} for k, st in sd["state"].items()}


def _targets(m, opt, via_module):
    return {"model": get_model_state_dict(m.module if via_module else m), "optim": get_optimizer_state_dict(m, opt)}


def save(path, plan, via_module, shard_size=None):
    """Train 3 steps, save a DCP checkpoint at ``path``, train 2 more; rank 0 keeps the full state
    at the save and at the end beside it (``expected.pt``) for :func:`load` to compare with."""
    m, opt = build(plan, 0, shard_size)
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


def load(path, plan, via_module, shard_size=None):
    """Build a differently seeded model under ``plan``, load the checkpoint, compare, continue the
    saving run's data stream for 2 steps; returns the largest differences."""
    m, opt = build(plan, 123, shard_size)
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
        models.batch("mlp", GLOBAL_BATCH, gen)  # the saving run's data stream
    _train(m, opt, gen, 2)
    final = m.state_dict()
    err["continued"] = max((final[k] - v).abs().max().item() for k, v in expected["final"].items())
    m.close()
    return err


def check_loaded(errors):
    """The loaded state is exactly the saved one on every rank, and training continues the same."""
    for err in errors:
        assert err["params"] == 0.0 and err["optim"] == 0.0, err
        assert err["continued"] < 1e-5, err
