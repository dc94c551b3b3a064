"""Hardening (issue 14): stale weights under persistent residency, freeing after the module's
backward, control flow that differs between steps or ranks, a failing rank, real-model patterns
(``nn.MultiheadAttention``), mixed parameter dtypes, optimizers built before wrapping, and hooks
that stay scoped to the wrapped model.

Tolerances as test_shard: 2e-5 in float32; bf16 compute 1e-4 against a reference computing as the
policy does.
"""

from __future__ import annotations

import copy
import logging
import os
import sys

import pytest
import torch
import torch.distributed as dist

import models
from autodist import AutoDist
from autodist.errors import RankMismatchError
from harness import repo_env, run_command
from parity import Case, check, check_cases, make_plan, run_case, run_cases

ATOL = 2e-5
HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------------------------------------
# 1. persistent residency never trains on stale or mixed weights
# ------------------------------------------------------------------------------------------------
class DataSGD(torch.optim.Optimizer):
    """Writes ``p.data`` (as Lion and many research optimizers do): no version counter moves."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad.data, alpha=-group["lr"])


def stale_weight_scenario(kind: str, steps: int = 4, per_rank: int = 2) -> float:
    """Train the GPT under a persistent plan and a reference side by side while, after step 1,
    something writes the shards behind the refresh in flight. Returns the largest difference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, base = models.make("gpt"), models.make("gpt")
    grouping = "unit" if kind.startswith("param-group") else "all"  # a group per unit: the added ones' own
    model = AutoDist(base, plan=make_plan(base, world, residency="persistent", grouping=grouping))

    def optimizers(params):
        params = list(params)
        if kind == "data-optimizer":
            return [DataSGD(params, lr=0.05)]
        if kind in ("param-group-added", "param-group-edited"):  # the rest added, or swapped in, after step 1
            return [DataSGD(params[: len(params) // 2], lr=0.05)]
        if kind == "added-to-a-foreign-optimizer":  # over none of the model's parameters until step 1
            return [DataSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.05)]
        if kind == "two-optimizers":
            return [torch.optim.SGD(params[::2], lr=0.05, momentum=0.9), torch.optim.SGD(params[1::2], lr=0.05)]
        return [torch.optim.SGD(params, lr=0.05, momentum=0.9)]

    opts, ropts = optimizers(model.parameters()), optimizers(ref.parameters())
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for step in range(steps):
        x, y = models.batch("gpt", per_rank * world, gen)
        models.loss_fn("gpt", model(x[rank * per_rank : (rank + 1) * per_rank]), y[rank * per_rank : (rank + 1) * per_rank]).backward()
        models.loss_fn("gpt", ref(x), y).backward()
        for o in opts + ropts:
            o.step()
            o.zero_grad()
        if step == 1:  # the refresh all-gather is in flight now
            if kind == "load-state-dict":
                sd = {k: v + 0.01 for k, v in ref.state_dict().items()}
                ref.load_state_dict(sd)
                model.load_state_dict(sd)
            elif kind == "in-place-edit":
                with torch.no_grad():
                    for p in list(model.parameters()) + list(ref.parameters()):
                        p.mul_(0.5)
            elif kind == "param-group-added":  # the step hooks' view of the optimizer is rebuilt
                for o, m in ((opts[0], model), (ropts[0], ref)):
                    params = list(m.parameters())
                    o.add_param_group({"params": params[len(params) // 2 :]})
            elif kind == "param-group-edited":  # ... also when the same list is edited in place
                for o, m in ((opts[0], model), (ropts[0], ref)):
                    params = list(m.parameters())
                    held = o.param_groups[0]["params"]
                    held[:] = params[len(params) - len(held) :]
            elif kind == "added-to-a-foreign-optimizer":  # its steps seen so far were not over this model
                for o, m in ((opts[0], model), (ropts[0], ref)):
                    m.zero_grad()
                    o.add_param_group({"params": list(m.parameters())})
            elif kind == "new-optimizer":  # built after the first one was seen over every parameter
                opts, ropts = [DataSGD(model.parameters(), lr=0.05)], [DataSGD(ref.parameters(), lr=0.05)]
        sd = model.state_dict()
        for k, v in ref.state_dict().items():
            worst = max(worst, (sd[k] - v).abs().max().item())
    model.close()
    return worst


@pytest.mark.parametrize("kind", ["load-state-dict", "data-optimizer", "in-place-edit", "two-optimizers", "param-group-added",
                                  "param-group-edited", "added-to-a-foreign-optimizer", "new-optimizer"])
def test_persistent_groups_never_compute_with_stale_weights(world2, kind):
    for worst in world2.run(stale_weight_scenario, kind):
        assert worst <= ATOL, f"{kind}: parameters {worst:.3g} away from the reference"


# ------------------------------------------------------------------------------------------------
# 2. gathered parameters are freed when the module's backward is complete
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("plan", ["fsdp", {"grouping": "unit", "window": 0}, "zero2"], ids=["fsdp", "unit-w0", "zero2"])
def test_backward_reading_the_full_weight_after_its_gradient(world2, plan):
    check(world2.run(run_case, Case(model="late-read", plan=plan)), atol=ATOL)


# ------------------------------------------------------------------------------------------------
# 3. control flow
# ------------------------------------------------------------------------------------------------
class RankBranch(torch.nn.Module):
    """Rank 0 runs ``left``, the others ``right``, each ``calls`` times in a row (four sharded
    units of one size)."""

    def __init__(self, calls: int = 1):
        super().__init__()
        self.calls = calls
        self.inp = torch.nn.Linear(16, 16)
        self.left = torch.nn.Linear(16, 16)
        self.right = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 16)  # every gather of one size: divergent ones pair, and are checked
        self.rank = dist.get_rank()

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for _ in range(self.calls):
            h = torch.tanh(self.left(h) if self.rank == 0 else self.right(h))
        return self.out(h)


def rank_divergent_control_flow() -> float:
    """Three steps of ``RankBranch`` under ``fsdp``, against one process running each rank's
    branch on its rank's batch: the largest parameter difference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = RankBranch()
    model = AutoDist(copy.deepcopy(ref), plan="fsdp")
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4 * world, 16, generator=gen)
        model(x[4 * rank : 4 * rank + 4]).square().mean().backward()
        for r in range(world):
            ref.rank = r
            (ref(x[4 * r : 4 * r + 4]).square().mean() / world).backward()
        opt.step(), ropt.step()
        opt.zero_grad(), ropt.zero_grad()
    sd = model.state_dict()
    model.close()
    return max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())


def test_a_branch_that_depends_on_the_rank_trains_as_in_one_process(world2):
    # Before [Note: units a forward left out] in autodist/schedule.py, the ranks' gathers of
    # ``left`` and ``right`` (equal sizes) paired with each other, and the check below raised
    for worst in world2.run(rank_divergent_control_flow):
        assert worst < 1e-6, worst


def module_called_again_on_some_ranks() -> str:
    torch.manual_seed(0)
    model = AutoDist(RankBranch(calls=2), plan="fsdp")
    try:
        model(torch.randn(4, 16)).sum().backward()
    except RankMismatchError as e:
        return str(e)
    finally:
        model.close()
    return "no error"


def test_a_module_called_again_on_some_ranks_only_raises_on_every_rank(world2):
    # a group freed after a unit's forward and gathered again for a second call on rank 0 only:
    # the gathers still pair (equal sizes) and the end-of-backward check names the first difference
    for rank, msg in enumerate(world2.run(module_called_again_on_some_ranks)):
        assert "all_gather(left) on rank 0" in msg and "same order on every rank" in msg, f"rank {rank}: {msg}"


def skipped_block_with_log(plan) -> dict:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("autodist").addHandler(handler)
    logging.getLogger("autodist").setLevel(logging.INFO)
    try:
        result = run_case(Case(model="gpt-skip", plan=plan, steps=5))
    finally:
        logging.getLogger("autodist").removeHandler(handler)
    result["logged"] = [m for m in records if "different order" in m]
    return result


@pytest.mark.parametrize("plan", ["fsdp", "zero2", {"residency": "persistent", "grouping": "block"}, {"grouping": "unit", "window": 2}], ids=["fsdp", "zero2", "persistent", "unit-w2"])
def test_a_block_skipped_on_alternate_steps_trains_correctly_without_changing_the_order(world2, plan):
    # a unit left out keeps its place in the learned order ([Note: units a forward left out]):
    # before, it moved to the end of the order and every later step counted and logged a deviation
    results = world2.run(skipped_block_with_log, plan)
    check(results, atol=ATOL)
    for r in results:
        assert r["runtime"]["order_deviations"] == 0
    assert not results[0]["logged"], results[0]["logged"]


# ------------------------------------------------------------------------------------------------
# 4. a failing rank
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["backward", "forward", "optimizer"])
def test_a_rank_dying_mid_step_stops_every_rank_with_a_message_naming_it(where):
    # The survivor stops because its peer's connection went, not at the process group's timeout
    # (300 s in the script; the backend's error would read "Timed out waiting 300000ms"). The
    # subprocess's own timeout, below the group's, only guards against a hang.
    out = run_command([sys.executable, os.path.join(HERE, "rank_failure_script.py"), where, "fsdp"], timeout=280,
                      env=repo_env())
    text = out.stdout + out.stderr
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("rank 0:")), "")
    assert "PeerFailure" in line and "rank(s) 1 failed or exited" in line, text[-3000:]
    assert "timed out" not in line.lower(), line


# ------------------------------------------------------------------------------------------------
# 5. real-model patterns and mixed dtypes
# ------------------------------------------------------------------------------------------------
TORCH_TRANSFORMER = {
    "fsdp": Case(model="torch-transformer", plan="fsdp"),
    "zero2": Case(model="torch-transformer", plan="zero2"),
    "per-unit": Case(model="torch-transformer", plan={"grouping": "unit", "window": 1}),
    "random": Case(model="torch-transformer", plan={"random": 5}),
    # recomputed under sharded plans: [Note: inputs keep their identity] (self-attention took another
    # path in the recomputation than in forward, and torch's checkpoint refused the backward)
    "recompute": Case(model="torch-transformer", plan={"recompute": ["layers.0", "layers.1"]}),
    "random-recompute": Case(model="torch-transformer", plan={"random": 8}, accumulate=2),
}


def test_pytorch_transformer_layers_train_under_sharded_plans(world2):
    names = list(TORCH_TRANSFORMER)
    results = world2.run(run_cases, [TORCH_TRANSFORMER[n] for n in names], timeout=300)
    check_cases(results, names, atol=ATOL)


def test_pytorch_transformer_layers_under_ddp_with_bf16(world2):
    check(world2.run(run_case, Case(model="torch-transformer", plan="ddp", bf16=True)), atol=1e-4)


def test_batch_norm_models_train_in_bf16_under_every_built_in_plan(world2):
    """[Note: batch norm keeps its dtype]: a bf16 policy on a model with BatchNorm (a ResNet) failed
    its first forward under every plan; BatchNorm's parameters now stay float32 and the model trains
    as a single process computing the same way does (bf16 copies of the other parameters, float32
    gradients), running statistics included. (Against a float32 reference the gradients differ by
    up to 0.1 here: bf16's own error on this model.)"""
    plans = ("ddp", "fsdp", "zero2")
    results = world2.run(run_cases, [Case(model="resnet", plan=p, bf16=True) for p in plans])
    for i in range(len(plans)):
        check([r[i] for r in results], atol=1e-4)


def test_float32_and_float64_parameters_match_the_reference_when_sharded(world2):
    results = world2.run(run_cases, [Case(model="dtypes-exact", plan=p) for p in ("ddp", "fsdp", "zero2")])
    for i in range(3):
        check([r[i] for r in results], atol=ATOL)


def distance_from_reference_by_plan() -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for plan in ("ddp", "fsdp", "zero2"):
        ref, base = models.make("dtypes"), models.make("dtypes")
        model = AutoDist(base, plan=plan)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = models.batch("dtypes", 4 * world, gen)
            models.loss_fn("dtypes", model(x[rank * 4 : (rank + 1) * 4]), y[rank * 4 : (rank + 1) * 4]).backward()
            models.loss_fn("dtypes", ref(x), y).backward()
            for o in (opt, ropt):
                o.step()
                o.zero_grad()
        sd = model.state_dict()
        out[plan] = max((sd[k].double() - v.double()).abs().max().item() for k, v in ref.state_dict().items())
        model.close()
    return out


def test_mixed_dtype_parameters_stay_within_bfloat16_rounding_of_the_reference(world2):
    """No bucket or gather mixes dtypes (float32 and float64 parameters match exactly, above). The
    bfloat16 parameters differ from the single-process reference, under every plan including DDP's,
    by bfloat16 rounding only: torch's CPU kernels round ``p.add_(buf, alpha=-lr)`` once or twice
    depending on the tensor's layout (measured: one ulp, 6.1e-5 to 4.9e-4 at these magnitudes)."""
    for d in world2.run(distance_from_reference_by_plan):
        assert max(d.values()) < 2e-3, d


# ------------------------------------------------------------------------------------------------
# 6. optimizers and process-wide hooks
# ------------------------------------------------------------------------------------------------
def optimizer_built_before_wrapping(plan: str) -> str:
    torch.manual_seed(0)
    base = models.make("mlp")
    early = torch.optim.SGD(base.parameters(), lr=0.1)
    model = AutoDist(base, plan=plan)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(4, 13)).sum().backward()
    try:
        early.step()
    except RuntimeError as e:
        return f"error: {e}"
    finally:
        model.close()
    after = model.state_dict()
    moved = any(not torch.equal(before[k], after[k]) for k in before)
    return "trained" if moved else "silent no-op"


@pytest.mark.parametrize("plan", ["fsdp", "zero2", "ddp"])
def test_an_optimizer_built_before_wrapping_is_reported_or_works(world2, plan):
    for msg in world2.run(optimizer_built_before_wrapping, plan):
        if plan == "ddp":  # replicated plans keep the user's parameter objects: it trains
            assert msg == "trained", msg
        else:
            assert msg.startswith("error:") and "Build the optimizer after wrapping" in msg, msg


def optimizer_hooks_while_wrapped() -> tuple[int, int, int, bool]:
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    def count() -> int:
        return len(_global_optimizer_pre_hooks) + len(_global_optimizer_post_hooks)

    torch.manual_seed(0)
    n0 = count()
    model = AutoDist(models.make("mlp"), plan="fsdp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n1 = count()
    for _ in range(2):
        model(torch.randn(4, 13)).sum().backward()
        opt.step()
        opt.zero_grad()
    n2 = count()
    model.close()
    return n1 - n0, n2 - n0, count() - n0, hasattr(opt, "_autodist_step_hooks")


def test_optimizer_hooks_are_process_wide_while_the_model_is_wrapped(world2):
    # see [Note: process-wide optimizer hooks]: an optimizer built later must be seen too
    for added, left, after_close, bound in world2.run(optimizer_hooks_while_wrapped):
        assert (added, left, after_close, bound) == (2, 2, 0, False)


# ------------------------------------------------------------------------------------------------
# issue-order invariant for NCCL, checked on gloo (see [Note: one issue order for NCCL])
# ------------------------------------------------------------------------------------------------
class RankDependentBias(torch.nn.Module):
    """The same modules run on every rank, but ``mid`` adds its bias on rank 0 only: its bias
    gradient arrives on rank 0 and never on rank 1 (the bucket is "late" there)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.blk = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 2)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.nn.functional.linear(h, self.mid.weight, self.mid.bias if dist.get_rank() == 0 else None)
        return self.out(torch.tanh(self.blk(torch.tanh(h))))


def issue_order_with_a_rank_dependent_gradient(policy: str) -> list[tuple[str, str]]:
    torch.manual_seed(0)
    base = RankDependentBias()
    world = dist.get_world_size()
    plan = make_plan(base, world, replicate_units=("mid",), grouping="unit", buckets="per_param", window=0)
    model = AutoDist(base, plan=plan)
    model.runtime.set_launch_policy(policy)
    model.runtime.comm.stats.log = []
    model(torch.randn(4, 8)).sum().backward()
    log = [e for e in model.runtime.comm.stats.log if e[0] != "broadcast"]
    model.close()
    return log


def test_sampled_launches_issue_collectives_in_the_same_order_on_every_rank(world2):
    """NCCL needs one issue order across its two communicators; launching buckets on readiness
    interleaves reductions with gathers differently on a rank where a gradient never arrives."""
    ready = world2.run(issue_order_with_a_rank_dependent_gradient, "ready")
    assert ready[0] != ready[1]  # the hazard exists
    sampled = world2.run(issue_order_with_a_rank_dependent_gradient, "sampled")
    assert sampled[0] == sampled[1], sampled
    assert {k for k, _ in sampled[0]} >= {"all_gather", "all_reduce", "reduce_scatter"}


def functional_call_scenario(plan) -> dict:
    """``torch.func.functional_call`` with tensors of the caller's (the weights x1.5, full tensors):
    the loss and its gradients with respect to those tensors, as in one process; then an ordinary
    training step, as the reference's ([Note: a tensor put in a parameter's place] in
    autodist/runtime/params.py). Every rank runs the same batch."""
    from torch.distributed.tensor import DTensor
    from torch.func import functional_call

    torch.manual_seed(0)
    base = models.make("gpt")
    ref = copy.deepcopy(base)
    model = AutoDist(base, plan=plan)
    x, y = models.batch("gpt", 4, torch.Generator().manual_seed(0))

    def at_moved(m, named):
        params = {n: ((p.full_tensor() if isinstance(p, DTensor) else p).detach() * 1.5).requires_grad_()
                  for n, p in named}
        loss = models.loss_fn("gpt", functional_call(m, params, (x,)), y)
        return loss, dict(zip(params, torch.autograd.grad(loss, list(params.values()))))

    loss, grads = at_moved(model, model.named_parameters())
    rloss, rgrads = at_moved(ref, ref.named_parameters())
    out = {"loss": abs(loss.item() - rloss.item()), "grad": max((grads[n] - rgrads[n]).abs().max().item() for n in rgrads)}
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for m, o in ((model, opt), (ref, ropt)):
        o.zero_grad()
        models.loss_fn("gpt", m(x), y).backward()
        o.step()
    sd = model.state_dict()
    out["param"] = max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    model.close()
    return out


@pytest.mark.parametrize("plan", ["ddp", "fsdp", "zero2", "mixed"])
def test_functional_call_computes_with_the_callers_tensors(world2, plan):
    spec = make_plan(models.make("gpt"), 2, placement="mixed") if plan == "mixed" else plan
    for r in world2.run(functional_call_scenario, spec):
        assert r["loss"] <= 1e-5 and r["grad"] <= ATOL and r["param"] <= ATOL, r

