"""Optimizers DTensor cannot step ([Note: optimizers DTensor cannot step] in
autodist/runtime/optimizers.py). Under a plan that shards, the parameters are DTensors, as under
FSDP2, and some of torch's optimizers failed at their first step with DTensor's own words, after
part of the step had run (fused SGD and Adagrad, ZeroRedundancyOptimizer, Rprop, LBFGS, Adafactor
on a matrix), or stepped wrongly (Adafactor on a sharded vector). Now the step is refused before it
changes anything, on every rank, naming the optimizer, the parameters and the fix; under a
replicated plan the same optimizers train as in one process; ``plan="auto"`` keeps what the
optimizer cannot step sharded replicated; and each limit is checked against the torch installed, so
that a torch which lifts one fails here rather than leaving AutoDist refusing what works. Code
over the parameters outside the forward (a penalty in the loss, per-layer norms, the clipped
total) sees the whole model as the usage says it does."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import models
from autodist import AutoDist, AutoDistError
from autodist.runtime.optimizers import dtensor_limit
from parity import check_within, worst_difference

ATOL = 2e-5

# name: (the optimizer over ``params``, the limit's scope)
LIMITED = {
    "sgd-fused": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True), "dtensor"),
    "adagrad-fused": (lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True), "dtensor"),
    "zero-redundancy": (lambda p: ZeroRedundancyOptimizer(p, torch.optim.SGD, lr=0.1), "dtensor"),
    "rprop": (lambda p: torch.optim.Rprop(p, lr=1e-3), "shard"),
    "lbfgs": (lambda p: torch.optim.LBFGS(p, lr=0.1, max_iter=2), "shard"),
    "adafactor": (lambda p: torch.optim.Adafactor(p, lr=1e-2), "shard"),
}
# step DTensors as plain tensors: no limit
STEPS = {
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
}


def _step(opt, loss_of):
    """One step of ``opt``: LBFGS with a closure, any other after one backward."""
    def closure():
        opt.zero_grad()
        loss = loss_of()
        loss.backward()
        return loss

    if isinstance(opt, torch.optim.LBFGS):
        return opt.step(closure)
    closure()
    return opt.step()


def torch_limits() -> dict[str, object]:
    """Each limit against torch itself: the optimizer over one raw DTensor of the kind it refuses (a
    replicated matrix for ``"dtensor"``; a sharded matrix and a sharded vector of uneven rows for
    ``"shard"``), three steps, against the same steps over a plain tensor: ``"fails"`` or
    ``"differs"`` where the limit holds; the optimizers without one step shards as plain tensors."""
    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    out: dict[str, object] = {}

    def outcome(make, placement, shape) -> str:
        torch.manual_seed(0)
        w, grads = torch.randn(*shape), [torch.randn(*shape) for _ in range(3)]
        plain = torch.nn.Parameter(w.clone())
        dt = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [placement]))
        opts = [(plain, make([plain]), lambda g: g), (dt, make([dt]), lambda g: distribute_tensor(g, mesh, [placement]))]
        try:
            for g in grads:
                for p, opt, wrap in opts:
                    def closure(p=p, g=g, wrap=wrap):
                        p.grad = wrap(g.clone())
                        return torch.tensor(1.0)
                    opt.step(closure)
        except (RuntimeError, NotImplementedError):
            return "fails"
        return "same" if torch.equal(plain.detach(), dt.detach().full_tensor()) else "differs"

    for name, (make, _) in LIMITED.items():
        limit = dtensor_limit(make([torch.nn.Parameter(torch.zeros(3))]))
        out[f"{name}-limit"] = None if limit is None else limit.scope
        if out[f"{name}-limit"] == "dtensor":
            out[name] = [outcome(make, Replicate(), (5, 3))]
        else:
            out[name] = [outcome(make, Shard(0), (5, 3)), outcome(make, Shard(0), (5,))]
    for name, make in STEPS.items():
        out[f"{name}-limit"] = dtensor_limit(make([torch.nn.Parameter(torch.zeros(3))]))
        out[name] = [outcome(make, Shard(0), (5, 3)), outcome(make, Shard(0), (5,))]
    return out


def test_what_autodist_refuses_is_what_torch_cannot_step(world2):
    for rank, out in enumerate(world2.run(torch_limits)):
        for name, (_, scope) in LIMITED.items():
            assert out[f"{name}-limit"] == scope, (rank, name, out)
        # what torch 2.14 does with each (a change means a limit to revisit): Adafactor steps a
        # sharded vector silently wrong; LBFGS steps one right, and is refused for the matrices
        # every model shards with it (a refusal by scope, not by shape)
        assert {name: out[name] for name in LIMITED} == {
            "sgd-fused": ["fails"], "adagrad-fused": ["fails"], "zero-redundancy": ["fails"],
            "rprop": ["fails", "fails"], "lbfgs": ["fails", "same"], "adafactor": ["fails", "differs"],
        }
        for name in STEPS:
            assert out[f"{name}-limit"] is None and out[name] == ["same", "same"], (rank, name, out)


def _state(opt) -> list[tuple[int, str, list]]:
    """Every state value of ``opt``, full, as lists."""
    def full(v):
        v = v.full_tensor() if isinstance(v, DTensor) else v
        return v.tolist() if torch.is_tensor(v) else v

    return [(i, k, full(v)) for i, st in enumerate(opt.state.values()) for k, v in sorted(st.items())]


def refused_under_a_sharded_plan() -> dict[str, object]:
    """Each limited optimizer over the mlp under fsdp: its step raises before anything changed."""
    rank = dist.get_rank()
    out: dict[str, object] = {}
    for name, (make, _) in LIMITED.items():
        torch.manual_seed(0)
        model = AutoDist(models.make("mlp"), plan="fsdp")
        before = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in model.state_dict().items()}
        opt = make(model.parameters())
        inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
        state = _state(inner)  # Adagrad's is made with the optimizer
        x, y = models.batch("mlp", 4, torch.Generator().manual_seed(rank))
        try:
            _step(opt, lambda m=model, x=x, y=y: models.loss_fn("mlp", m(x), y))
            out[name] = "stepped"
        except AutoDistError as e:
            after = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
            out[name] = {
                "message": str(e), "every_rank": getattr(e, "raised_on_every_rank", False),
                "state": _state(inner) == state,
                "changed": max((after[k] - v).abs().max().item() for k, v in before.items()),
            }
        model.close()
    return out


def test_an_optimizer_dtensor_cannot_step_is_refused_before_it_steps(world2):
    for rank, out in enumerate(world2.run(refused_under_a_sharded_plan)):
        for name in LIMITED:
            r = out[name]
            assert isinstance(r, dict), f"rank {rank}: {name} {r}"
            assert r["every_rank"] and r["state"] and r["changed"] == 0.0, (rank, name, r)
            msg = r["message"]
            assert "layers.0.weight" in msg and "builtin:fsdp" in msg and "Nothing was stepped. Fix:" in msg, msg
        assert "fused=False" in out["sgd-fused"]["message"] and "holds as DTensors" in out["sgd-fused"]["message"]
        assert "plan='zero2'" in out["zero-redundancy"]["message"]
        assert "Adafactor cannot step the parameters plan builtin:fsdp shards" in out["adafactor"]["message"]


def replicated_parity() -> dict[str, float]:
    """Each limited optimizer under ddp (plain tensors) against one process on the same data."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (make, _) in LIMITED.items():
        torch.manual_seed(0)
        base = models.make("mlp")
        ref = copy.deepcopy(base)
        model = AutoDist(base, plan="ddp")
        opt, ropt = make(model.parameters()), make(ref.parameters())
        if isinstance(ropt, ZeroRedundancyOptimizer):  # the reference steps every parameter itself
            ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(3):
            xs = [models.batch("mlp", 4, torch.Generator().manual_seed(10 * step + r)) for r in range(world)]
            _step(opt, lambda m=model, xy=xs[rank]: models.loss_fn("mlp", m(xy[0]), xy[1]))
            _step(ropt, lambda r=ref, xs=xs: sum(models.loss_fn("mlp", r(x), y) for x, y in xs) / world)
            opt.zero_grad()
            ropt.zero_grad()
        out[name] = worst_difference(model, ref)
        model.close()
    return out


def test_the_same_optimizers_train_as_in_one_process_under_a_replicated_plan(world2):
    check_within(world2.run(replicated_parity), atol=ATOL)


@pytest.mark.parametrize("refusal", ["dtensor", "shard", "none"])
def test_the_plan_space_keeps_what_the_optimizer_cannot_step_replicated(refusal):
    """``space_for`` makes the units the recorded optimizer cannot step sharded unshardable: every
    unit for one that steps no DTensor, the units holding a trained parameter for one that steps
    no shard (a frozen unit may still be sharded)."""
    from autodist.cost.profile import OptimizerProfile, Profile, UnitProfile
    from autodist.sched.space import space_for
    from autodist.structure import discover

    structure = discover(models.make("frozen"))
    fields = {"dtensor": {"dtensor_refused": True}, "shard": {"shard_refused": True}, "none": {}}[refusal]
    profile = Profile(units=[UnitProfile(u.name, fwd_s=1e-3, bwd_s=2e-3) for u in structure.units],
                      ready_order=list(reversed(structure.trainable)), optimizer=OptimizerProfile(**fields))
    space = space_for(profile, structure, 2)
    shardable = {u for u, s in zip(space.units, space.shardable) if s}
    expected = {"dtensor": set(), "shard": {"embed"}, "none": {"embed", "body", "head"}}[refusal]
    assert shardable == expected
    sharded = space.normalize(space.fsdp()).shard  # FSDP's seed, as the search normalizes every plan
    assert {u for u, s in zip(space.units, sharded) if s} == expected


def recorded_refusals(cache_dir: str) -> dict[str, object]:
    """``plan="auto"`` without example inputs over gpt, trained by each optimizer for the recorded
    steps and the switch: what the profile it stored says the optimizer cannot step, and the
    placements of the plans it searched."""
    rank = dist.get_rank()
    out: dict[str, object] = {}
    makers = {"adafactor": LIMITED["adafactor"][0], "sgd-fused": LIMITED["sgd-fused"][0], "sgd": STEPS["sgd"]}
    for name, make in makers.items():
        d = f"{cache_dir}/{name}"
        torch.manual_seed(0)
        model = AutoDist(models.make("gpt"), plan="auto", cache_dir=d)
        opt = make(model.parameters())
        for step in range(6):
            x, y = models.batch("gpt", 2, torch.Generator().manual_seed(10 * step + rank))
            models.loss_fn("gpt", model(x), y).backward()
            opt.step()
            opt.zero_grad()
        auto = model._auto
        assert auto is not None and auto.stats.source == "search", auto.stats.source
        prof = auto.read("profiles", auto.profile_key(auto._sig)) if rank == 0 else None
        out[name] = None if prof is None else (prof.optimizer.kind, prof.optimizer.dtensor_refused, prof.optimizer.shard_refused)
        model.close()
    return out


def test_plan_auto_records_what_the_optimizer_cannot_step(world2, tmp_path):
    """The profile of the first steps carries the optimizer's limit, which ``space_for`` turns into
    units kept replicated (the test above); rank 0 reads the stored profile."""
    out = world2.run(recorded_refusals, str(tmp_path))[0]
    assert out == {"adafactor": ("Adafactor", False, True), "sgd-fused": ("SGD", True, False), "sgd": ("SGD", False, False)}


def outside_the_forward(plan: str, set_to_none: bool) -> dict[str, float]:
    """Code over the parameters outside the forward, as training loops write it: an L2 penalty added
    to the loss (through ``full_tensor()``, as the usage says), computed before the forward, so that
    autograd reaches it last ([Note: gradients that reach a parameter outside its bucket]), per-layer
    gradient norms for a log, and ``clip_grad_norm_``'s total, against one process on the same data
    (SGD, 3 steps; gradients zeroed to ``None`` or kept as zeros); a post-accumulate hook runs once
    a step, not also where the penalty's gradient reaches the parameter."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    torch.manual_seed(0)
    base = models.make("mlp")
    ref = copy.deepcopy(base)
    model = AutoDist(base, plan=plan)
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    out = {"norms": 0.0, "total": 0.0, "hook calls off one a step": 0.0}
    calls = {n: 0 for n, _ in model.named_parameters()}  # a post-accumulate hook runs once a backward
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=n: calls.__setitem__(n, calls[n] + 1))
    for step in range(3):
        xs = [models.batch("mlp", 4, torch.Generator().manual_seed(10 * step + r)) for r in range(world)]
        penalty = sum(full((p ** 2).sum()) for p in model.parameters())
        (models.loss_fn("mlp", model(xs[rank][0]), xs[rank][1]) + 0.05 * penalty).backward()
        (sum(models.loss_fn("mlp", ref(x), y) for x, y in xs) / world + 0.05 * sum((p ** 2).sum() for p in ref.parameters())).backward()
        out["hook calls off one a step"] = max(out["hook calls off one a step"], *(abs(c - step - 1) for c in calls.values()))
        norms = {n: full(p.grad.norm()).item() for n, p in model.named_parameters()}
        out["norms"] = max(out["norms"], *(abs(norms[n] - p.grad.norm().item()) for n, p in ref.named_parameters()))
        total, rtotal = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        out["total"] = max(out["total"], abs(total.item() - rtotal.item()))
        opt.step()
        ropt.step()
        opt.zero_grad(set_to_none=set_to_none)
        ropt.zero_grad(set_to_none=set_to_none)
    out["params"] = worst_difference(model, ref)
    model.close()
    return out


@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zeros"])
@pytest.mark.parametrize("plan", ["ddp", "fsdp", "zero2"])
def test_code_over_the_parameters_outside_the_forward_sees_the_whole_model(world2, plan, set_to_none):
    for rank, out in enumerate(world2.run(outside_the_forward, plan, set_to_none)):
        assert max(out.values()) <= ATOL, f"rank {rank}: {out}"


def penalty_against_its_gradient(plan: str, set_to_none: bool, name: str = "mlp") -> float:
    """Under a bf16 policy the forward computes with compute copies, so even a replicated parameter
    used outside the forward is another leaf: training with an L2 penalty in the loss against the
    same training with the penalty's gradient (0.1 p) added by hand after the backward. ``moe``:
    experts some ranks leave out of their forward (their buckets launch without this rank's
    gradient), where the ranks' copies diverged."""
    from autodist import MixedPrecision

    rank, world = dist.get_rank(), dist.get_world_size()

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    def run(in_loss: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = AutoDist(models.make(name), plan=plan,
                         mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x, y = models.batch(name, 4, torch.Generator().manual_seed(10 * step + rank))
            penalty = sum(full((p ** 2).sum()) for p in model.parameters()) if in_loss else 0.0
            (models.loss_fn(name, model(x).float(), y) + 0.05 * penalty).backward()
            if not in_loss:
                with torch.no_grad():
                    for p in model.parameters():
                        if p.grad is None:  # left out of every rank's forward
                            p.grad = p.detach().mul(0.1)
                        else:
                            p.grad.add_(p, alpha=0.1)
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        out = {k: full(v).clone() for k, v in model.state_dict().items()}
        model.close()
        return out

    a, b = run(True), run(False)
    assert world == 2
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zeros"])
@pytest.mark.parametrize("plan,name", [("ddp", "mlp"), ("fsdp", "mlp"), ("ddp", "moe")])
def test_a_penalty_under_a_bf16_policy_adds_its_exact_gradient(world2, plan, name, set_to_none):
    for rank, worst in enumerate(world2.run(penalty_against_its_gradient, plan, set_to_none, name)):
        assert worst <= ATOL, f"rank {rank}: {worst}"
