"""Keyword example inputs (issue 16): a model whose forward takes keyword arguments and returns its
own loss (as Hugging Face models do with ``labels=``) is profiled with that loss, planned for it,
and trains under ``plan="auto"`` like the single-process reference on the concatenated batch.

Tolerance: float32, as test_shard (2e-5).
"""

from __future__ import annotations

import copy
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import models
from autodist import AutoDist
from autodist.measure.trace import profile_model
from autodist.structure import discover

ATOL = 2e-5
VOCAB, SEQ, PER_RANK = 512, 16, 4


class TinyLM(nn.Module):
    """A Hugging Face-style language model: ``forward(input_ids, labels=None)`` returns an object
    with ``.logits`` and, given labels, its own ``.loss``, one that holds three times the logits'
    float32 bytes for backward (tanh's and sigmoid's outputs, the log-softmax), where AutoDist's
    estimate for a loss it cannot see is one."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)) for _ in range(2)])
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SimpleNamespace:
        h = self.wte(input_ids)
        for b in self.blocks:
            h = h + b(h)
        logits = self.head(h)
        loss = None
        if labels is not None:  # squashed logits: what the loss holds is 3x the logits in float32
            squashed = torch.sigmoid(torch.tanh(logits.float()))
            loss = F.cross_entropy(squashed.view(-1, VOCAB), labels.view(-1))
        return SimpleNamespace(loss=loss, logits=logits)


def _ids(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))


def test_the_loss_a_model_returns_is_profiled_when_keyword_inputs_give_labels():
    torch.manual_seed(0)
    model = TinyLM()
    ids = _ids(0, 0)
    with_labels = profile_model(model, discover(model), (ids,), device=torch.device("cpu"), repeats=1, example_kwargs={"labels": ids})
    without = profile_model(model, discover(model), (ids,), device=torch.device("cpu"), repeats=1)
    assert with_labels.loss_source == "measured" and without.loss_source == "estimated"

    def held(p):  # activations saved for backward, the loss's included (inside forward: the head's)
        return sum(u.act_bytes for u in p.units) + p.loss_act_bytes

    logits = PER_RANK * SEQ * VOCAB * 4
    assert held(with_labels) - held(without) >= 2 * logits - 4096, (held(with_labels), held(without))


def auto_with_keyword_inputs(cache_dir: str, labels: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    ids = _ids(0, rank)
    wrapped = AutoDist(
        model, plan="auto", example_inputs=(ids,), example_kwargs={"labels": ids} if labels else None, cache_dir=cache_dir,
    )
    planned_peak = wrapped.plan.predicted.get("peak_bytes")
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(4):
        mine = _ids(step, rank)
        loss = wrapped(mine, labels=mine).loss
        loss.backward()
        everyone = [_ids(step, r) for r in range(world)]
        (sum(ref(x, labels=x).loss for x in everyone) / world).backward()
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    sd = wrapped.state_dict()
    worst = max((sd[k].full_tensor() if hasattr(sd[k], "full_tensor") else sd[k]).sub(v).abs().max().item()
                for k, v in ref.state_dict().items())
    out = {"worst": worst, "planned_peak": planned_peak, "label": wrapped.plan.label, "losses": losses}
    wrapped.close()
    return out


@pytest.mark.parametrize("labels", [True, False], ids=["labels", "no-labels"])
def test_auto_with_keyword_example_inputs_trains_like_single_process(world2, labels):
    with tempfile.TemporaryDirectory() as d:
        results = world2.run(auto_with_keyword_inputs, d, labels)
    for r in results:
        assert r["planned_peak"] is not None, r
        assert r["worst"] < ATOL, r


def test_the_planned_peak_includes_the_model_s_own_loss(world2):
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        with_labels = world2.run(auto_with_keyword_inputs, a, True)
        without = world2.run(auto_with_keyword_inputs, b, False)
    for w, wo in zip(with_labels, without):
        assert w["planned_peak"] > wo["planned_peak"], (w, wo)


def hugging_face_gpt2_with_labels(cache_dir: str) -> float:
    torch.manual_seed(0)
    model = models.hf_gpt2()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    wrapped = AutoDist(model, plan="auto", example_inputs=(ids,), example_kwargs={"labels": ids}, cache_dir=cache_dir)
    models.hf_gpt2_steps(wrapped, ref, 3)
    sd = wrapped.state_dict()
    worst = max((sd[k].full_tensor() if hasattr(sd[k], "full_tensor") else sd[k]).float().sub(v.float()).abs().max().item()
                for k, v in ref.state_dict().items() if k in sd)
    wrapped.close()
    return worst


def test_a_hugging_face_model_with_keyword_example_inputs(world2):
    pytest.importorskip("transformers", reason="transformers is not installed (an optional test dependency)")
    with tempfile.TemporaryDirectory() as d:
        for worst in world2.run(hugging_face_gpt2_with_labels, d):
            assert worst < 1e-5, worst
