"""timm models as timm builds them train under AutoDist as they do in one process: a residual
network with BatchNorm, a vision transformer and a ConvNeXt (layer scale, LayerNorm over channels),
under sharded plans, recomputation and random plans with gradient accumulation.

timm is an optional test dependency (CI need not install it): the test skips without it.
Tolerance as test_shard: 2e-5 in float32.
"""

from __future__ import annotations

import pytest

from parity import Case, check_cases, run_cases

ATOL = 2e-5
RECOMPUTE_ALL = {"grouping": "block", "recompute": "all"}

CASES = {
    "resnet-fsdp": Case(model="timm-resnet", plan="fsdp"),
    # BatchNorm in every recomputed block: its running statistics and counters as without recomputation
    "resnet-recompute": Case(model="timm-resnet", plan=RECOMPUTE_ALL),
    # (no accumulation here: with BatchNorm over 1x1 maps, summing micro-batches in another order than
    # the reference moves the gradients by ~1e-4 under ddp as under every plan)
    "resnet-random": Case(model="timm-resnet", plan={"random": 3}),
    "vit-fsdp": Case(model="timm-vit", plan="fsdp"),
    "vit-recompute": Case(model="timm-vit", plan=RECOMPUTE_ALL),
    "vit-random-accumulate": Case(model="timm-vit", plan={"random": 3}, accumulate=2),
    "convnext-zero2": Case(model="timm-convnext", plan="zero2"),
    "convnext-recompute": Case(model="timm-convnext", plan=RECOMPUTE_ALL),
    "convnext-random-accumulate": Case(model="timm-convnext", plan={"random": 3}, accumulate=2),
}


def test_timm_models_train_under_autodist_as_in_one_process(world2):
    pytest.importorskip("timm", reason="timm is not installed (an optional test dependency; CI need not install it)")
    names = list(CASES)
    results = world2.run(run_cases, [CASES[n] for n in names], timeout=600)
    check_cases(results, names, atol=ATOL)
    recomputed = {n: results[0][i]["runtime"]["recomputed_blocks"] for i, n in enumerate(names) if n.endswith("recompute")}
    assert all(c > 0 for c in recomputed.values()), recomputed
