"""Checkpoints: DCP save under one plan and world size, load under another, continue identically."""

import tempfile

import pytest
from dcp_roundtrip import check_loaded, load, save

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
