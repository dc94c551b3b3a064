"""Bad plans given to AutoDist on several ranks: every rank raises a clear error, none hangs, and
under torchrun the user reads it once."""

import contextlib
import os
import sys
import tempfile
import textwrap

import pytest
import torch
import torch.distributed as dist

import models
from autodist import AutoDist, PlanError, RankMismatchError, save_plan
from autodist.builtins import ddp_plan, fsdp_plan
from autodist.structure import discover
from harness import repo_env, run_command


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


_NET_SOURCE = """
import pytest
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x):
        return {head}
"""


def _different_source_per_rank(directory):
    # each rank imports the model class from its own file, as nodes with different checkouts would:
    # on rank 0 the root's forward reads the head's weight itself, on rank 1 it calls the head
    import importlib.util

    rank = dist.get_rank()
    head = "torch.nn.functional.linear(self.body(x), self.head.weight)" if rank == 0 else "self.head(self.body(x))"
    path = os.path.join(directory, f"net_rank{rank}.py")
    with open(path, "w") as f:
        f.write(_NET_SOURCE.format(head=head))
    spec = importlib.util.spec_from_file_location(f"net_rank{rank}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    m = mod.Net()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    try:
        AutoDist(m, plan=fsdp_plan(discover(m), 2))
    except RankMismatchError as e:
        return {"error": str(e), "unchanged": all(bool((before[k] == v).all()) for k, v in m.state_dict().items())}
    return {"error": None}


def test_ranks_whose_model_source_differs_are_refused(world2):
    # the units a module's own code reads come from each rank's source files: a plan alike on every
    # rank would still gather the head for the root's forward on rank 0 only
    with tempfile.TemporaryDirectory() as d:
        res = world2.run(_different_source_per_rank, d, timeout=60)
    for r in res:
        assert r["error"] is not None and "ranks read different model code" in r["error"], r
        assert "'(root)'" in r["error"] and "['head']" in r["error"] and r["unchanged"]


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


def _fully_sharded():
    from torch.distributed.fsdp import fully_shard

    m = models.make("mlp")
    fully_shard(m)
    return m


def _with_autodist_inside():
    m = models.make("mlp")
    m.layers[0] = AutoDist(m.layers[0], plan="ddp")
    return m


def _with_dtensor_parameter():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    m = models.make("mlp")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m.layers[1].weight = torch.nn.Parameter(distribute_tensor(m.layers[1].weight.detach(), mesh, [Shard(1)]))
    return m


def _bad_arguments():
    """Each case: (what to wrap, keyword arguments), the error type and what the message must say."""
    rank = dist.get_rank()
    mlp = models.make("mlp")
    first = AutoDist(mlp, plan="ddp")  # mlp is now managed by `first`
    cases = {
        "memory_limit=inf": (lambda: models.make("mlp"), {"memory_limit": float("inf")}, ValueError,
                             "memory_limit=inf is not a number of bytes; pass a finite size"),
        "memory_limit=nan": (lambda: models.make("mlp"), {"memory_limit": float("nan")}, ValueError,
                             "memory_limit=nan is not a number of bytes"),
        "memory_limit=0.5": (lambda: models.make("mlp"), {"memory_limit": 0.5}, ValueError, "at least 1 byte"),
        "torch DDP": (lambda: torch.nn.parallel.DistributedDataParallel(models.make("branchy")), {}, TypeError,
                      "the module is wrapped by torch's DistributedDataParallel; AutoDist replaces DDP: pass the "
                      "module DDP wraps (ddp_model.module)"),
        "fully_shard": (_fully_sharded, {}, TypeError, "the module is sharded by torch's FSDP"),
        "the same module twice": (lambda: mlp, {}, TypeError,
                                  "the module is already managed by another AutoDist instance"),
        "DTensor parameter": (_with_dtensor_parameter, {}, TypeError, "parameter 'layers.1.weight' is already a "
                              "DTensor ((Shard(dim=1),)): the model is already distributed"),
        "AutoDist inside": (_with_autodist_inside, {}, TypeError, "submodule 'layers.0' is an AutoDist; wrap the "
                            "whole model once"),
    }
    out = {}
    for name, (make, kwargs, exc, says) in cases.items():
        module = make()
        before = {k: v.detach().clone() for k, v in module.state_dict().items()}
        try:
            AutoDist(module, plan="fsdp", **kwargs)
            out[name] = "no error"
            continue
        except Exception as e:
            if not isinstance(e, exc) or says not in str(e) or "\n" in str(e):
                out[name] = f"{type(e).__name__}: {e}"
                continue
        after = module.state_dict()
        if not all(torch.equal(before[k], after[k]) for k in before) or len(after) != len(before):
            out[name] = "the module was modified"
            continue
        out[name] = "ok"
    # the first wrapper still trains, and after close() the module can be wrapped again
    x, y = models.batch("mlp", 4, torch.Generator().manual_seed(rank))
    models.loss_fn("mlp", first(x), y).backward()
    first.close()
    AutoDist(mlp, plan="ddp").close()
    return out


def test_distributed_or_bad_arguments_fail_with_one_line_on_every_rank_before_anything_changes(world2):
    for res in world2.run(_bad_arguments, timeout=120):
        assert res == {name: "ok" for name in res}
def _lazy_module_refused() -> str:
    m = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    try:
        AutoDist(m, plan="fsdp")
    except ValueError as e:
        said = str(e)
    else:
        said = "no error"
    m(torch.randn(4, 5))  # initialised by a forward, as the message says, it wraps and trains
    model = AutoDist(m, plan="fsdp")
    model(torch.randn(4, 5)).sum().backward()
    model.close()
    return said


def test_a_lazy_module_not_yet_initialised_is_refused_naming_the_fix(world2):
    for said in world2.run(_lazy_module_refused):
        assert said == ("parameter '0.weight' is not initialised yet (a lazy module such as nn.LazyLinear infers its "
                        "shapes at its first forward): run one forward with a batch of your data before wrapping, as DDP "
                        "requires"), said


def _used_after_close():
    m = AutoDist(models.make("mlp"), plan="fsdp")
    x, y = models.batch("mlp", 4, torch.Generator().manual_seed(0))
    models.loss_fn("mlp", m(x), y).backward()
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    m.close()
    try:
        m(x)
        said = "no error"
    except RuntimeError as e:
        said = str(e)
    after = m.state_dict()
    m.close()  # again: nothing to do
    return said, sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)


def test_a_closed_instance_refuses_to_run_and_still_gives_its_state_dict(world2):
    for said, same_state in world2.run(_used_after_close):
        assert said.startswith("this AutoDist instance was closed") and "Wrap the model again" in said, said
        assert same_state


def _caught_and_uncaught_forms(directory):
    path = os.path.join(directory, "p4.json")
    if dist.get_rank() == 0:
        save_plan(fsdp_plan(discover(models.make("mlp")), 4), path)
    dist.barrier()
    try:
        AutoDist(models.make("mlp"), plan=path)
    except PlanError as e:
        return {"system_exit": isinstance(e, SystemExit), "code": e.code}
    return None


def test_an_error_every_rank_raises_is_still_the_error_and_exits_quietly_off_rank_0(world2):
    with tempfile.TemporaryDirectory() as d:
        rank0, rank1 = world2.run(_caught_and_uncaught_forms, d)
    assert rank0["system_exit"] and rank0["code"].startswith("autodist.errors.PlanError: invalid plan")
    assert "made for 4 ranks but this job has 2" in rank0["code"]
    assert rank1 == {"system_exit": True, "code": 1}


TRAIN = """
import sys
import pytest
import torch
from autodist import AutoDist
model = AutoDist(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)), plan=sys.argv[1])
"""


def test_a_plan_for_8_ranks_on_2_prints_its_message_once_without_tracebacks(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    plan = tmp_path / "plan8.json"
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    save_plan(fsdp_plan(discover(model), 8), plan)
    out = run_command(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, plan],
        env=repo_env(OMP_NUM_THREADS="1"), timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1
    assert text.count("the plan was made for 8 ranks but this job has 2") == 1, text
    assert "autodist.errors.PlanError: invalid plan" in text
    assert "[rank" not in text and "train.py\", line" not in text, text  # no worker traceback
    # torchrun's summary: the ranks exited with status 1 (one that was still shutting down when
    # torchrun stopped the job shows its signal instead)
    assert text.count("exitcode  : 1 ") >= 1, text


_BAD_ARGUMENTS = {
    "memory_limit": ({"plan": "fsdp", "memory_limit": "lots"}, "ValueError: cannot parse memory_limit 'lots'"),
    "log_every": ({"plan": "ddp", "log_every": 0}, "ValueError: log_every must be a positive number of steps or None, got 0"),
    "grad_accum_steps": ({"grad_accum_steps": 0}, "ValueError: grad_accum_steps must be a positive number"),
    "cache_dir": ({"plan": "ddp", "cache_dir": "/tmp"}, "ValueError: cache_dir is only used by plan='auto'"),
    "example_kwargs": ({"example_kwargs": [1]}, "TypeError: example_kwargs must be a dict of keyword inputs, got list"),
    "plan name": ({"plan": "fsdpp"}, "autodist.errors.PlanError: invalid plan:"),
    "missing plan file": ({"plan": "no_such_plan.json"}, "autodist.errors.PlanError: invalid plan:"),
    "plan type": ({"plan": 3}, "TypeError: plan must be one of 'auto', 'ddp', 'fsdp', 'zero2', a Plan, or a path; got int"),
    "unknown keyword": ({"plann": "ddp"}, "TypeError: AutoDist() got an unexpected keyword argument 'plann'; its "
                        "arguments are module, plan, mesh, memory_limit,"),
    # DDP's keywords with DDP's meaning ([Note: DDP's keywords] in autodist/wrapper.py)
    "device_ids on a CPU module": ({"plan": "ddp", "device_ids": [0]}, "ValueError: device_ids=[0] does not name this "
                                   "rank's device: a CPU module takes none, as under DDP; drop device_ids"),
    "bucket_cap_mb beside fsdp": ({"plan": "fsdp", "bucket_cap_mb": 25}, "ValueError: bucket_cap_mb caps the buckets of "
                                  "plan='ddp' (DDP's bucketing); plan='fsdp' sets its own buckets"),
    "find_unused_parameters": ({"find_unused_parameters": "yes"}, "TypeError: find_unused_parameters must be True or False"),
    # every argument but the module is keyword-only, as FSDP2's are
    "plan by position": ({"args": ("ddp",)}, "TypeError: AutoDist takes the module as its only positional argument, "
                         "got 1 more ('ddp'); pass the others by keyword, e.g. AutoDist(model, plan='ddp')"),
}


def _each_bad_argument():
    out = {}
    for name, (kwargs, _) in _BAD_ARGUMENTS.items():
        kwargs = dict(kwargs)
        try:
            AutoDist(models.make("mlp"), *kwargs.pop("args", ()), **kwargs)
            out[name] = None
        except Exception as e:
            out[name] = {"type": type(e).__name__, "system_exit": isinstance(e, SystemExit), "code": getattr(e, "code", None)}
    return out


def test_every_bad_argument_is_one_line_from_rank_0_and_a_quiet_exit_elsewhere(world2):
    rank0, rank1 = world2.run(_each_bad_argument, timeout=120)
    for name, (_, says) in _BAD_ARGUMENTS.items():
        got0, got1 = rank0[name], rank1[name]
        assert got0 is not None and got0["system_exit"] and got0["code"].startswith(says), (name, got0)
        assert "\n" not in got0["code"], (name, got0)
        assert got1 is not None and got1["system_exit"] and got1["code"] == 1, (name, got1)
        assert got0["type"] == got1["type"], name  # `except ValueError` still catches it on every rank
    # a path meant as a plan file says how to make one; a misspelt name does not
    assert "To make no_such_plan.json: `autodist.save_plan(model.plan, 'no_such_plan.json')`" in rank0["missing plan file"]["code"]
    assert "`autodist plan --model MODULE:FACTORY" in rank0["missing plan file"]["code"]
    assert "To make" not in rank0["plan name"]["code"]


def _one_rank_refuses():
    rank = dist.get_rank()
    try:
        AutoDist(models.make("mlp"), plan="ddp", log_every=0 if rank == 1 else None)
    except ValueError as e:
        return str(e)
    return None


def test_an_argument_refused_on_one_rank_fails_every_rank_without_hanging(world2):
    rank0, rank1 = world2.run(_one_rank_refuses, timeout=60)
    assert rank1.startswith("log_every must be a positive number"), rank1
    assert rank0.startswith("rank 1 refused its AutoDist arguments (ValueError: log_every must be"), rank0


def _torchrun(script, *args):
    out = run_command(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, *args],
        env=repo_env(OMP_NUM_THREADS="1"), timeout=300,
    )
    return out.returncode, out.stdout + out.stderr


BAD_MEMORY_LIMIT = """
import pytest
import torch
from autodist import AutoDist
model = AutoDist(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)), memory_limit="lots")
"""


def test_a_bad_memory_limit_under_torchrun_prints_one_line_like_a_bad_plan(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(BAD_MEMORY_LIMIT))
    rc, text = _torchrun(script)
    assert rc == 1
    assert text.count("cannot parse memory_limit 'lots'") == 1, text
    assert any(line.startswith("ValueError: cannot parse memory_limit 'lots'; use bytes") for line in text.splitlines()), text
    assert "[rank" not in text and "train.py\", line" not in text, text  # no worker traceback


FATAL_BUDGET = """
import logging
import sys
import tempfile

import pytest
import torch
from autodist import AutoDist, BudgetError

logging.basicConfig(level=logging.INFO, format="%(message)s")
torch.manual_seed(0)
model = AutoDist(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)),
                 plan="auto", memory_limit="200KiB", log_every=10, cache_dir=sys.argv[1])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    for _ in range(8):
        model(torch.randn(32, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
except BudgetError as e:
    print("fatal:", str(e).splitlines()[0][:40], flush=True)
try:
    model(torch.randn(32, 64))
except RuntimeError as e:
    print("after:", e, flush=True)
"""


def test_no_step_is_logged_or_trained_after_a_fatal_budget_error(tmp_path):
    # the safe plan runs the profiled steps (about 450 KiB), then no plan fits 200 KiB: the search's
    # BudgetError ends training; the steps that ran are not logged after it, at exit or otherwise
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(FATAL_BUDGET))
    out = run_command([sys.executable, script, tmp_path / "cache"], env=repo_env(OMP_NUM_THREADS="1"), timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "fatal: no plan fits the budget of 200.00 KiB" in text, text
    assert "after: this AutoDist instance stopped at a fatal error (BudgetError: no plan fits" in text, text
    assert "autodist: step" not in text, text  # log_every=10: only a step logged at exit could appear


def _moved_after_wrapping(plan, how: str, bf16: bool) -> str:
    """A parametrization or pruning applied to a wrapped model: the next forward is refused with
    the parameter's name and the fix, before anything is computed with it."""
    from torch.nn.utils import parametrize, prune

    from autodist import MixedPrecision

    class Scale(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    model = AutoDist(models.make("mlp"), plan=plan,
                     mixed_precision=MixedPrecision(torch.bfloat16, torch.float32) if bf16 else None)
    layer = model.module.layers[1]
    if how == "parametrize":
        parametrize.register_parametrization(layer, "weight", Scale())
    else:
        prune.random_unstructured(layer, "weight", amount=0.5)
    x, _ = models.batch("mlp", 4, torch.Generator().manual_seed(0))
    try:
        model(x)
    except ValueError as e:
        said = str(e)
    else:
        said = "no error"
    model.close()
    return said


@pytest.mark.parametrize("plan,bf16,how", [
    *[(plan, bf16, "parametrize") for plan, bf16 in (("ddp", False), ("ddp", True), ("fsdp", False), ("mixed", False))],
    # pruning a sharded parameter fails inside torch's prune itself (DTensor refuses its in-place
    # masking, as under FSDP2); a replicated one is pruned and then refused here
    ("ddp", False, "prune"), ("ddp", True, "prune"),
])
def test_a_parameter_moved_after_wrapping_is_refused_naming_the_fix(world2, plan, bf16, how):
    from parity import make_plan

    spec = make_plan(models.make("mlp"), 2, placement="mixed") if plan == "mixed" else plan
    for said in world2.run(_moved_after_wrapping, spec, how, bf16):
        if plan == "ddp" and not bf16:
            # nothing of AutoDist's is swapped in: the module computes with what it holds, as under DDP
            assert said == "no error", said
            continue
        assert said.startswith("parameter 'layers.1.weight' is no longer registered in its module (as 'weight' of "), said
        assert "it was moved after the model was wrapped" in said, said
        assert said.endswith("Apply parametrizations and pruning to the model before AutoDist(model, ...)"), said
