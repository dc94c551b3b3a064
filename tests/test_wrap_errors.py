"""Bad plans given to AutoDist on several ranks: every rank raises a clear error, none hangs."""

import contextlib
import os
import tempfile

import torch
import torch.distributed as dist

import models
from autodist import AutoDist, PlanError, RankMismatchError, save_plan
from autodist.sched.seeds import ddp_plan, fsdp_plan
from autodist.structure import discover


def _wrap_expecting(plan_for_rank, exc=PlanError):
    rank = dist.get_rank()
    m = models.make("mlp")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    try:
        AutoDist(m, plan=plan_for_rank(rank))
    except exc as e:
        unchanged = all((before[k] == v).all() for k, v in m.state_dict().items())
        return {"error": str(e), "unchanged": bool(unchanged)}
    return {"error": None}


def _corrupt_everywhere(directory):
    path = os.path.join(directory, "plan.json")
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            f.write('{"schema_version": 1, "world_size": 2, "units": [')
    dist.barrier()
    return _wrap_expecting(lambda r: path)


def _corrupt_on_rank1(directory):
    good = os.path.join(directory, "good.json")
    bad = os.path.join(directory, "bad.json")
    if dist.get_rank() == 0:
        save_plan(ddp_plan(discover(models.make("mlp")), 2), good)
        with open(bad, "w") as f:
            f.write("garbage")
    dist.barrier()
    return _wrap_expecting(lambda r: good if r == 0 else bad)


def _wrong_world(directory):
    path = os.path.join(directory, "p4.json")
    if dist.get_rank() == 0:
        save_plan(fsdp_plan(discover(models.make("mlp")), 4), path)
    dist.barrier()
    return _wrap_expecting(lambda r: path)


def _ranks_disagree():
    s = discover(models.make("mlp"))
    return _wrap_expecting(lambda r: ddp_plan(s, 2) if r == 0 else fsdp_plan(s, 2), exc=RankMismatchError)


def test_corrupt_plan_file_fails_on_every_rank(world2):
    with tempfile.TemporaryDirectory() as d:
        res = world2.run(_corrupt_everywhere, d)
    for r in res:
        assert "not valid JSON" in r["error"] and r["unchanged"]


def test_plan_file_corrupt_on_one_rank_fails_everywhere_without_hanging(world2):
    with tempfile.TemporaryDirectory() as d:
        res = world2.run(_corrupt_on_rank1, d, timeout=60)
    assert "rank 1 could not resolve the plan" in res[0]["error"]
    assert "not valid JSON" in res[1]["error"]


def test_plan_for_other_world_size(world2):
    with tempfile.TemporaryDirectory() as d:
        res = world2.run(_wrong_world, d)
    for r in res:
        assert "made for 4 ranks but this job has 2" in r["error"] and r["unchanged"]


def test_ranks_with_different_plans_are_refused(world2):
    for r in world2.run(_ranks_disagree):
        assert "ranks disagree on the plan" in r["error"]


@contextlib.contextmanager
def _cwd(path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _plan_file_on_some_ranks(directory, ranks_with_file):
    """Every rank passes the same relative path ``plan.json`` from its own working directory: the
    file exists only where ``ranks_with_file`` says, as on disks that are not shared."""
    rank = dist.get_rank()
    here = os.path.join(directory, f"rank{rank}")
    os.makedirs(here, exist_ok=True)
    expected = ddp_plan(discover(models.make("mlp")), 2)
    if rank in ranks_with_file:
        save_plan(expected, os.path.join(here, "plan.json"))
    dist.barrier()
    with _cwd(here):
        try:
            m = AutoDist(models.make("mlp"), plan="plan.json")
        except PlanError as e:
            return {"error": str(e)}
    out = {"error": None, "hash": m.plan.hash(), "expected": expected.hash()}
    x, y = models.batch("mlp", 4, torch.Generator().manual_seed(rank))
    models.loss_fn("mlp", m(x), y).backward()  # the ranks train together
    m.close()
    return out


def test_plan_file_on_rank0_only_is_sent_to_the_other_ranks(world2):
    with tempfile.TemporaryDirectory() as d:
        res = world2.run(_plan_file_on_some_ranks, d, [0], timeout=60)
    for r in res:
        assert r["error"] is None and r["hash"] == r["expected"]


def test_plan_file_missing_on_rank0_fails_on_every_rank(world2):
    with tempfile.TemporaryDirectory() as d:
        res = world2.run(_plan_file_on_some_ranks, d, [1], timeout=60)
    for r in res:
        assert "plan file 'plan.json' does not exist on rank 0 (it does on rank(s) [1])" in r["error"]
        assert "copy it there" in r["error"]


def test_plan_file_missing_everywhere_is_refused_as_an_unknown_plan_on_every_rank(world2):
    with tempfile.TemporaryDirectory() as d:
        res = world2.run(_plan_file_on_some_ranks, d, [], timeout=60)
    for r in res:
        assert "plan='plan.json' is neither one of 'auto', 'ddp', 'fsdp', 'zero2' nor an existing plan file" in r["error"]
