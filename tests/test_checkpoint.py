"""Checkpoints: DCP save under one plan and world size, load under another, continue identically."""

import tempfile

import pytest
from dcp_roundtrip import check_loaded, load, save
from file_roundtrip import hugging_face_save_pretrained, one_ranks_shards, resume, state_of_other_shapes

SAVE_LOAD = [
    ("fsdp", "ddp", False),
    ("ddp", {"residency": "persistent", "grouping": "all"}, False),
    ("fsdp", {"placement": "mixed", "residency": "after_backward"}, True),
    ({"residency": "persistent"}, "fsdp", True),
]


@pytest.mark.parametrize("src,dst,via_module", SAVE_LOAD)
def test_dcp_checkpoint_across_plans_same_world(world2, src, dst, via_module):
    with tempfile.TemporaryDirectory() as d:
        world2.run(save, d, src, via_module)
        check_loaded(world2.run(load, d, dst, via_module))


@pytest.mark.parametrize("via_module", [False, True], ids=["full", "sharded"])
def test_dcp_checkpoint_across_world_sizes(world2, world4, via_module):
    with tempfile.TemporaryDirectory() as d:
        world2.run(save, d, "fsdp", via_module)
        check_loaded(world4.run(load, d, {"residency": "after_backward", "grouping": "all"}, via_module))
    with tempfile.TemporaryDirectory() as d:
        world4.run(save, d, {"placement": "mixed"}, via_module)
        check_loaded(world2.run(load, d, "fsdp", via_module))


MIXED = {"placement": "mixed", "residency": "after_backward"}


@pytest.mark.parametrize("after_a_step", [False, True], ids=["before-first-step", "after-a-step"])
@pytest.mark.parametrize("src,dst,per_rank", [
    ("ddp", "fsdp", False), ("ddp", MIXED, False), ("ddp", "zero2", True), ("fsdp", "fsdp", True),
    ("fsdp", "zero2", True), ("ddp", "ddp", False),
], ids=["ddp-fsdp", "ddp-mixed", "ddp-zero2-own", "fsdp-fsdp-own", "fsdp-zero2-own", "ddp-ddp"])
def test_checkpoints_written_the_ddp_way_resume_under_another_plan(world2, src, dst, per_rank, after_a_step):
    """`torch.save({"model": model.state_dict(), "optim": opt.state_dict()})` and the plain
    `load_state_dict` calls (nanoGPT's checkpointing): optimizer state saved as full tensors under a
    replicated plan (the first launch of plan="auto") loads into a plan that shards, each rank
    keeping its part, and each rank's own file of shards loads under the same layout; training
    continues exactly as the saving run did."""
    for rank, out in enumerate(world2.run(resume, src, dst, per_rank, after_a_step)):
        assert out["loaded"] == 0.0 and "refused" not in out, (rank, out)
        assert out["continued"] < 1e-5, (rank, out)


@pytest.mark.parametrize("src,dst,per_rank,problem", [
    ("fsdp", "fsdp", False, "it was saved by another rank"),
    ("zero2", MIXED, False, "is a DTensor placed (Shard(dim=0),), the parameter is placed (Replicate(),)"),
    ("fsdp", "ddp", True, "is a sharded DTensor (one rank's part"),
], ids=["rank0-file", "rank0-file-mixed", "shards-into-ddp"])
def test_optimizer_state_of_one_ranks_shards_is_refused_before_the_step(world2, src, dst, per_rank, problem):
    """`opt.state_dict()` under a plan that shards holds this rank's shards: rank 0's file loaded on
    every rank gave every rank rank 0's moments (silently, or with uneven shards an error on one
    rank and a hang on the others); shards loaded into replicated parameters failed in DTensor's
    words. Now the first step raises on every rank, naming the problem and the fix, before
    anything changes."""
    for rank, out in enumerate(world2.run(resume, src, dst, per_rank, False)):
        refused = out.get("refused")
        assert refused is not None and out["loaded"] == 0.0, (rank, out)
        assert problem in refused["message"] and "full_state_dict=True" in refused["message"], (rank, refused)
        assert refused["every_rank"] and refused["changed"] == 0.0, (rank, refused)


@pytest.mark.parametrize("plan", ["fsdp", MIXED])
def test_one_ranks_shards_saved_with_torch_save_are_refused_by_load_state_dict(world2, plan):
    """`torch.save(model.module.state_dict())` (DTensor shards; it failed to pickle every shard but
    the first of its buffer) and `copy.deepcopy` of it work; rank 0's file loaded on every rank put rank 0's rows in every
    place (0.52 off what was saved) and is now refused on every rank, changing nothing; each
    rank's own file loads exactly. The module's own `load_state_dict` of rank 0's file (not a
    collective) raises on the other ranks, where it copied rank 0's rows silently."""
    for rank, out in enumerate(world2.run(one_ranks_shards, plan)):
        refused = out["per_rank=False"]
        assert isinstance(refused, dict) and refused["error"] == "RankMismatchError", (rank, out)
        assert "saved by another rank" in refused["message"] and refused["every_rank"], (rank, refused)
        assert out["per_rank=True"] == 0.0, (rank, out)
        assert out["deepcopy"] == 0.0 and out["deepcopy_types"] == ["DTensor"], (rank, out)
        assert out["saved_again"] == ["DTensor"] and out["module_copy"] == ["DTensor"], (rank, out)
        # the module's own load_state_dict copies each DTensor into its parameter: rank 0's own
        # parts are right on rank 0; every other rank sees the mesh coordinate is not its own
        assert (out["module"] is None) == (rank == 0), (rank, out["module"])
        assert rank == 0 or "another rank saved" in out["module"], (rank, out["module"])


@pytest.mark.parametrize("plan", ["fsdp", "ddp"])
def test_save_pretrained_through_the_wrapper_writes_the_trained_model(world2, plan):
    """`model.save_pretrained(dir)` on every rank (a Hugging Face model): under a plan that shards,
    the model's own save_pretrained took AutoDist's shards, views into one flat buffer, for tied
    weights and failed inside transformers; the wrapper's passes the full state dict and lets rank
    0 alone write. `from_pretrained` gives the one-process reference's weights."""
    pytest.importorskip("transformers", reason="transformers is not installed (an optional test dependency)")
    with tempfile.TemporaryDirectory() as d:
        for rank, out in enumerate(world2.run(hugging_face_save_pretrained, d, plan)):
            assert out["worst"] < 1e-5 and "model.safetensors" in out["files"], (rank, out)


@pytest.mark.parametrize("plan", ["fsdp", MIXED])
def test_optimizer_state_of_other_shapes_is_the_optimizers_own(world2, plan):
    """State not shaped like its parameter (a 1-element scale made at construction, per-row
    statistics) is left alone at the first step and after reloading the optimizer's own state
    dict (the review of the change found both refused)."""
    for rank, out in enumerate(world2.run(state_of_other_shapes, plan)):
        assert out == 0.0, (rank, out)
