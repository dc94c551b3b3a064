"""Hybrid sharding on 8 gloo ranks (issue 44): as a 2 x 4 mesh (two groups of four sharding ranks)
and as 4 x 2 (asked for by ``shard_size``), against the single-process reference under every
residency, with gradient accumulation and recomputation; and a checkpoint saved under 2 x 4 loaded
under 4 x 2 and sharded over all 8. The ranks are spawned once for the module (8 processes on a
small host are slow to start), and every case of a test runs in one pool call.

Tolerance: float32 as test_shard (2e-5). The MLP's 37-, 29- and 7-row layers split unevenly over a
group of 4 (the 7-row head: 2, 2, 2, 1 rows).
"""

from __future__ import annotations

import tempfile

import pytest
from dcp_roundtrip import check_loaded, load, save
from test_hybrid import _on_mesh

from harness import RankPool
from parity import Case, check_cases, run_cases

ATOL = 2e-5


@pytest.fixture(scope="module")
def world8():
    pool = RankPool(8)
    yield pool
    pool.close()


PARITY = {
    "after_forward": Case(model="mlp", plan={"residency": "after_forward"}, per_rank=2),
    "after_backward-accumulate-sharded": Case(
        model="mlp", plan={"residency": "after_backward", "accumulate": "sharded"}, per_rank=2, accumulate=2),
    "persistent-adamw-accumulate": Case(model="mlp", plan={"residency": "persistent"}, optim="adamw", per_rank=2, accumulate=2),
    "mixed-placement": Case(model="mlp", plan={"placement": "mixed"}, per_rank=2),
    "gpt-recompute-fsdp": Case(model="gpt", plan={"grouping": "block", "recompute": "all"}, per_rank=1),
    "gpt-ckpt-reentrant-zero2-accumulate": Case(model="gpt-ckpt-reentrant", plan="zero2", per_rank=1, accumulate=2),
}


@pytest.mark.parametrize("shape,how", [((2, 4), "mesh"), ((4, 2), "shard_size")], ids=["2x4-mesh", "4x2-shard_size"])
def test_hybrid_matches_single_process_on_8_ranks(world8, shape, how):
    names = list(PARITY)
    results = world8.run(_on_mesh, [PARITY[n] for n in names], shape, how, timeout=900)
    check_cases(results, names, atol=ATOL)
    for rank_results in results:
        for name, r in zip(names, rank_results):
            assert r["stats"]["all_reduces"] > 0, (name, r["stats"])  # shards all-reduced across replicas


def test_two_meshes_of_four_ranks_each_shard_within_pairs(world8):
    """``shard_size`` over a 1-D mesh that is part of the job (``new_subgroups``): each mesh of 4
    ranks makes its own 2 x 2 shard and replica groups, at the same time as the other."""
    names = ["fsdp", "persistent-accumulate"]
    cases = [
        Case(model="mlp", plan="fsdp", mesh_size=4, extra={"shard_size": 2}),
        Case(model="mlp", plan={"residency": "persistent", "accumulate": "sharded"}, accumulate=2, mesh_size=4,
             extra={"shard_size": 2}),
    ]
    results = world8.run(run_cases, cases, timeout=600)
    check_cases(results, names, atol=ATOL)
    for rank_results in results:
        assert all(r["stats"]["all_reduces"] > 0 for r in rank_results)


def test_dcp_checkpoint_saved_as_2x4_loads_as_4x2_and_over_all_8(world8):
    with tempfile.TemporaryDirectory() as d:
        world8.run(save, d, "fsdp", True, 4, timeout=600)
        check_loaded(world8.run(load, d, {"residency": "persistent"}, True, 2, timeout=600))
        check_loaded(world8.run(load, d, "zero2", True, timeout=600))
