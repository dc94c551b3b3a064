"""The conventions DDP/FSDP2 users rely on: names, shapes, state dicts, no_sync, a world of one."""

import os
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import models
from autodist import AutoDist, RankMismatchError
from harness import run_command
from parity import make_plan


def _visible_params(plan):
    plain = models.make("gpt")
    expected = {n: (tuple(p.shape), p.dtype, p.requires_grad) for n, p in plain.named_parameters()}
    model = AutoDist(models.make("gpt"), plan=plan)
    got = {n: (tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()}
    # a plan with DTensors holds them as AutoDist's HeldDTensor ([Note: assigning a parameter's .data])
    kinds = {"DTensor" if isinstance(p, DTensor) else type(p.data).__name__ for p in model.parameters()}
    keys_ok = list(model.state_dict()) == list(plain.state_dict())
    full = all(type(v) is torch.Tensor for v in model.state_dict().values())
    is_module = model.module.__class__ is plain.__class__
    x, y = models.batch("gpt", 2, torch.Generator().manual_seed(dist.get_rank()))
    models.loss_fn("gpt", model(x), y).backward()
    # gradients as FSDP2's: each the parameter's type, shape and placements; a DTensor gradient on
    # its parameter's own spec object (runtime/params.py [Note: a gradient shares its parameter's spec])
    grads = [(p, p.grad) for p in model.parameters()]
    grads_like = all(type(g) is (DTensor if isinstance(p, DTensor) else torch.Tensor) and g.shape == p.shape for p, g in grads)
    specs = [g._spec is p._spec for p, g in grads if hasattr(p, "_spec")]
    model.close()
    return {"same": got == expected, "kinds": sorted(kinds), "keys_ok": keys_ok, "full": full, "is_module": is_module,
            "grads_like": grads_like, "specs": specs}


@pytest.mark.parametrize("plan", ["ddp", "fsdp"])
def test_visible_parameters_keep_names_shapes_dtypes(world2, plan):
    for r in world2.run(_visible_params, plan):
        assert r["same"] and r["keys_ok"] and r["full"] and r["is_module"] and r["grads_like"]
        assert r["kinds"] == (["Tensor"] if plan == "ddp" else ["DTensor"])
        assert r["specs"] == ([] if plan == "ddp" else [True] * len(r["specs"])) and (plan == "ddp" or r["specs"])


def _load_across_plans(src_plan, dst_plan):
    rank = dist.get_rank()
    torch.manual_seed(5)
    a = AutoDist(models.make("mlp", seed=1), plan=make_plan(models.make("mlp"), 2, **src_plan) if isinstance(src_plan, dict) else src_plan)
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    x, y = models.batch("mlp", 4, torch.Generator().manual_seed(rank))
    models.loss_fn("mlp", a(x), y).backward()
    opt.step()
    sd = a.state_dict()
    b = AutoDist(models.make("mlp", seed=2), plan=make_plan(models.make("mlp"), 2, **dst_plan) if isinstance(dst_plan, dict) else dst_plan)
    b.load_state_dict(sd)
    after = b.state_dict()
    same = all(torch.equal(sd[k], after[k]) for k in sd)
    # the loaded model computes with the loaded weights (gathered copies refreshed)
    out_a, out_b = a(x), b(x)
    prefixed = AutoDist(models.make("mlp", seed=3), plan="ddp")
    prefixed.load_state_dict({f"module.{k}": v for k, v in sd.items()})
    same_prefixed = all(torch.equal(sd[k], v) for k, v in prefixed.state_dict().items())
    for m in (a, b, prefixed):
        m.close()
    return {"same": same, "outputs": (out_a - out_b).abs().max().item(), "prefixed": same_prefixed}


@pytest.mark.parametrize(
    "src,dst",
    [
        ("ddp", "fsdp"),
        ("fsdp", "ddp"),
        ({"residency": "persistent", "grouping": "all"}, {"placement": "mixed", "residency": "after_backward"}),
    ],
)
def test_state_dict_loads_under_another_plan(world2, src, dst):
    for r in world2.run(_load_across_plans, src, dst):
        assert r["same"] and r["prefixed"] and r["outputs"] == 0.0


def test_load_state_dict_reports_missing_keys(world2):
    for r in world2.run(_load_missing):
        assert "missing keys ['layers.2.bias']" in r


def _load_missing():
    m = AutoDist(models.make("mlp"), plan="ddp")
    sd = m.state_dict()
    del sd["layers.2.bias"]
    try:
        m.load_state_dict(sd)
    except RuntimeError as e:
        return str(e)
    finally:
        m.close()
    return "no error"


def _load_differing_or_bad(kind):
    rank = dist.get_rank()
    m = AutoDist(models.make("mlp"), plan="fsdp")
    sd = {k: v + 1.0 for k, v in m.state_dict().items()}
    if kind == "rank-local keys" and rank == 1:
        del sd["layers.0.weight"]  # strict=False on rank 1 only would load a different subset there
    if kind == "late size mismatch":
        sd["layers.2.bias"] = torch.zeros(5)  # the last key: the ones before it must stay as they were
    before = {k: v.clone() for k, v in m.state_dict().items()}
    try:
        m.load_state_dict(sd, strict=False)
    except (RankMismatchError, RuntimeError) as e:
        after = m.state_dict()
        return type(e).__name__, str(e), all(torch.equal(before[k], after[k]) for k in before)
    finally:
        m.close()
    return None, "no error", False


def test_load_state_dict_refuses_different_keys_per_rank_on_every_rank_and_changes_nothing(world2):
    for name, msg, unchanged in world2.run(_load_differing_or_bad, "rank-local keys"):
        assert name == "RankMismatchError" and "'layers.0.weight'" in msg and "on rank 1" in msg, msg
        assert unchanged


def test_a_size_mismatch_in_a_state_dict_changes_nothing(world2):
    for name, msg, unchanged in world2.run(_load_differing_or_bad, "late size mismatch"):
        assert name == "RuntimeError" and "size mismatch for layers.2.bias" in msg, msg
        assert unchanged


def _count_collectives(plan, use_context):
    rank = dist.get_rank()
    m = AutoDist(models.make("mlp"), plan=plan)
    gen = torch.Generator().manual_seed(rank)
    counts = []
    for _step in range(2):
        for micro in range(3):
            x, y = models.batch("mlp", 4, gen)
            last = micro == 2
            if use_context == "attribute":  # DDP's flag, as nanoGPT's loop sets it
                m.require_backward_grad_sync = last
                ctx = torch.enable_grad()
            elif use_context:
                ctx = m.no_sync() if not last else torch.enable_grad()
            else:
                m.set_requires_gradient_sync(last)
                ctx = torch.enable_grad()
            with ctx:
                models.loss_fn("mlp", m(x), y).backward()
            s = m.runtime.comm.stats
            counts.append(s.all_reduces + s.reduce_scatters)
    n_buckets = len(m.plan.buckets)
    m.close()
    return counts, n_buckets


@pytest.mark.parametrize("plan", ["ddp", "fsdp"])
@pytest.mark.parametrize("use_context", [True, False, "attribute"], ids=["no_sync", "set_requires_gradient_sync", "require_backward_grad_sync"])
def test_accumulation_without_sync_communicates_once_per_step(world2, plan, use_context):
    counts, n = world2.run(_count_collectives, plan, use_context)[0]
    assert counts == [0, 0, n, n, n, 2 * n]


def test_single_process_without_torchrun(tmp_path):
    script = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from autodist import AutoDist
        torch.manual_seed(0)
        ref = torch.nn.Linear(4, 3)
        model = AutoDist(torch.nn.Linear(4, 3), plan="fsdp")
        assert dist.get_world_size() == 1
        model.load_state_dict(ref.state_dict())
        opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        x = torch.randn(8, 4)
        for _ in range(3):
            model(x).square().mean().backward(); opt.step(); opt.zero_grad()
            ref(x).square().mean().backward(); ropt.step(); ropt.zero_grad()
        err = max((model.state_dict()[k] - v).abs().max().item() for k, v in ref.state_dict().items())
        assert err < 1e-6, err
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = run_command([sys.executable, "-c", script], env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _module_attributes():
    model = AutoDist(models.make("moe"), plan="fsdp")
    x, _ = models.batch("moe", 4, torch.Generator().manual_seed(dist.get_rank()))
    model(x)
    out = {"reached": model.ran is model.module.ran and len(model.ran) == 1,
           "own_first": model.plan is model._engine.plan, "forward": model.forward.__self__ is model}
    try:
        out["missing"] = repr(model.no_such_attribute)
    except AttributeError as e:
        out["missing"] = str(e)
    model.close()
    return out


def test_attributes_of_the_wrapped_module_are_reached_through_the_wrapper(world2):
    # FSDP2 keeps the model's class, so `model.generate(...)` and `model.config` work after
    # wrapping; before, AutoDist raised AttributeError for them
    for r in world2.run(_module_attributes):
        assert r["reached"] and r["own_first"] and r["forward"], r
        assert "no_such_attribute" in r["missing"], r
