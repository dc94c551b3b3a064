"""Offloaded optimizer-state fragments: only the location of state changes, never a value."""

import copy
import dataclasses
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import models
from autodist import AutoDist, OffloadFragment
from parity import make_plan

STATES = {"adam": ["exp_avg", "exp_avg_sq"], "adamw": ["exp_avg", "exp_avg_sq"], "sgd": ["momentum_buffer"]}


def _opt(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _offload_plan(base_kw, optim, variant):
    plan = make_plan(models.make("mlp"), 2, **base_kw)
    states = STATES[optim]
    frags = []
    if variant == "whole-after-step":
        for p in ("layers.0.weight", "layers.1.weight", "layers.1.bias"):
            for s in states:
                frags.append(OffloadFragment(p, s, (0, _held(plan, p)), "step", "backward:layers.1"))
    elif variant == "partial-forward-anchor":
        for s in states:
            frags.append(OffloadFragment("layers.1.weight", s, (50, 300), "forward:layers.0", "backward:layers.2"))
            frags.append(OffloadFragment("layers.2.weight", s, (0, 40), "forward:layers.1", "step"))
    return dataclasses.replace(plan, offload=frags)


def _held(plan, param):
    """How many elements of ``param``'s optimizer state the rank holding the most of it holds."""
    shape = dict(models.make("mlp").named_parameters())[param].shape
    if plan.placement_of_param[param] == "replicate":
        return shape.numel()
    return -(-shape[0] // plan.world_size) * (shape.numel() // shape[0])


def _local_state(opt):
    return {
        (i, k): (v.to_local() if hasattr(v, "to_local") else v).clone()
        for i, st in opt.state_dict()["state"].items() for k, v in st.items() if torch.is_tensor(v)
    }


def _train(plan, optim, steps, *, checkpoint_at=None, directory=None, reads=None):
    """``reads``: a list given gets ``opt.state_dict()``'s tensors after every step (periodic
    checkpoints, logging), taken as part of the training."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = AutoDist(models.make("mlp"), plan=plan)
    opt = _opt(optim, model.parameters())
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x, y = models.batch("mlp", 4, gen)
        models.loss_fn("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if checkpoint_at == step:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, os.path.join(directory, f"r{rank}.pt"))
        if reads is not None:
            reads.append(_local_state(opt))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ostate = _local_state(opt)
    account = list(model.runtime.offload.account.log)
    model.close()
    return state, ostate, account


def _compare(base_kw, optim, variant):
    ref = _train(make_plan(models.make("mlp"), 2, **base_kw), optim, 4)
    off = _train(_offload_plan(base_kw, optim, variant), optim, 4)
    same_params = all(torch.equal(ref[0][k], off[0][k]) for k in ref[0])
    same_state = ref[1].keys() == off[1].keys() and all(torch.equal(ref[1][k], off[1][k]) for k in ref[1])
    events = [e for e, _, _ in off[2]]
    return {"params": same_params, "state": same_state, "events": events}


@pytest.mark.parametrize("optim", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("variant", ["whole-after-step", "partial-forward-anchor"])
@pytest.mark.parametrize("base", [{"residency": "after_forward"}, {"placement": "replicate", "buckets": "one"}], ids=["sharded", "replicated"])
def test_offload_is_bitwise_identical_to_no_offload(world2, optim, variant, base):
    for r in world2.run(_compare, base, optim, variant):
        assert r["params"] and r["state"]
        assert "copy-out start" in r["events"] and "copy-back done" in r["events"]


def _compare_with_reads(optim):
    """``opt.state_dict()`` after every step, with and without offload: it changes nothing the
    optimizer steps, and every read holds the values the optimizer has."""
    base_kw = {"residency": "after_forward"}
    ref_reads: list = []
    off_reads: list = []
    ref = _train(make_plan(models.make("mlp"), 2, **base_kw), optim, 4, reads=ref_reads)
    off = _train(_offload_plan(base_kw, optim, "whole-after-step"), optim, 4, reads=off_reads)
    return {
        "params": max((ref[0][k] - off[0][k]).abs().max().item() for k in ref[0]),
        "reads": max((a[k] - b[k]).abs().max().item() for a, b in zip(ref_reads, off_reads) for k in a),
        "same_keys": [a.keys() == b.keys() for a, b in zip(ref_reads, off_reads)],
    }


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_reading_the_optimizer_state_dict_changes_nothing_under_offload(world2, optim):
    for r in world2.run(_compare_with_reads, optim):
        assert r["params"] == 0.0 and r["reads"] == 0.0, r
        assert r["same_keys"] == [True] * 4, r


def _rollback(plan, optim):
    """A rollback to an in-memory copy of the optimizer's state (``copy.deepcopy(opt.state_dict())``
    after step 1, loaded back after step 2), then two more steps; the parameters and the state."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = AutoDist(models.make("mlp"), plan=plan)
    opt = _opt(optim, model.parameters())
    gen = torch.Generator().manual_seed(rank)
    saved = None
    for step in range(4):
        x, y = models.batch("mlp", 4, gen)
        models.loss_fn("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            saved = copy.deepcopy(opt.state_dict())
        elif step == 1:
            opt.load_state_dict(saved)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ostate = _local_state(opt)
    model.close()
    return state, ostate


def _compare_rollback(optim):
    from autodist.builtins import fsdp_plan
    from autodist.structure import discover

    s = discover(models.make("mlp"))
    plan = fsdp_plan(s, 2)
    # every trainable parameter's state offloaded from one step to the next, as auto plans do
    frags = [OffloadFragment(p, st, (0, -(-s.params[p].shape[0] // 2) * (s.params[p].numel // s.params[p].shape[0])),
                             "step", "step") for p in s.trainable for st in STATES[optim]]
    ref = _rollback(plan, optim)
    off = _rollback(dataclasses.replace(plan, offload=frags), optim)
    return (all(torch.equal(ref[0][k], off[0][k]) for k in ref[0])
            and ref[1].keys() == off[1].keys() and all(torch.equal(ref[1][k], off[1][k]) for k in ref[1]))


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_a_rollback_to_an_in_memory_copy_of_offloaded_state(world2, optim):
    """Before, the loaded copy's sharded values were kept for the check across ranks at the next
    step, after the offload had freed their device storage: every rank died (SIGSEGV)."""
    assert world2.run(_compare_rollback, optim) == [True, True]


def _two_optimizers(plan):
    """Two AdamWs over the model's parameters (matrices and the rest, as a Muon + AdamW split):
    the fragments of both are offloaded; the parameters, the state, and how many fragments are held."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = AutoDist(models.make("mlp"), plan=plan)
    named = list(model.named_parameters())
    opts = [torch.optim.AdamW([p for _, p in named if p.dim() == 2], lr=1e-3),
            torch.optim.AdamW([p for _, p in named if p.dim() != 2], lr=1e-3)]
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = models.batch("mlp", 4, gen)
        models.loss_fn("mlp", model(x), y).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ostate = [_local_state(o) for o in opts]
    held = len(model.runtime.offload.entries)
    model.close()
    return state, ostate, held


def _compare_two_optimizers():
    plan = _offload_plan({"residency": "after_forward"}, "adamw", "whole-after-step")
    ref = _two_optimizers(dataclasses.replace(plan, offload=[]))
    off = _two_optimizers(plan)
    same = (all(torch.equal(ref[0][k], off[0][k]) for k in ref[0])
            and all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(ref[1], off[1])))
    return same, off[2], len(plan.offload)


def test_the_offloaded_state_of_every_optimizer_is_offloaded(world2):
    """Before, only the first optimizer to step had its state bound; the second's fragments stayed
    on the device, with a warning that their state did not exist."""
    for same, held, planned in world2.run(_compare_two_optimizers):
        assert same and held == planned, (same, held, planned)


def _resume(directory, optim):
    """Train 4 steps straight; and 2 steps, checkpoint (state partly offloaded), load into a fresh
    model + optimizer under the same plan, 2 more steps. Both must end bitwise equal."""
    rank = dist.get_rank()
    plan = _offload_plan({"residency": "after_forward"}, optim, "whole-after-step")
    straight = _train(plan, optim, 4, checkpoint_at=1, directory=directory)
    torch.manual_seed(0)
    model = AutoDist(models.make("mlp", seed=5), plan=plan)
    opt = _opt(optim, model.parameters())
    ck = torch.load(os.path.join(directory, f"r{rank}.pt"), weights_only=False)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optim"])
    gen = torch.Generator().manual_seed(rank)
    for step in range(4):
        x, y = models.batch("mlp", 4, gen)
        if step < 2:
            continue  # the same data stream as the straight run
        models.loss_fn("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    resumed = {k: v.clone() for k, v in model.state_dict().items()}
    model.close()
    return all(torch.equal(straight[0][k], resumed[k]) for k in resumed)


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_checkpoint_with_offloaded_fragments_restores_identical_state(world2, optim):
    with tempfile.TemporaryDirectory() as d:
        assert all(world2.run(_resume, d, optim))


def _failing_copy(optim):
    """A copy-out that fails midway leaves the state on the device; training stays exact."""
    from autodist.runtime import offload as off

    original = off.OffloadManager.copy_out

    def broken(self, keys):
        keys = list(keys)
        original(self, keys)
        for e in self.entries.values():
            if e.pending is not None:
                e.pending.result()
                fut = __import__("concurrent.futures").futures.Future()
                fut.set_exception(RuntimeError("simulated copy failure"))
                e.pending = fut

    ref = _train(make_plan(models.make("mlp"), 2, residency="after_forward"), optim, 3)
    off.OffloadManager.copy_out = broken
    try:
        got = _train(_offload_plan({"residency": "after_forward"}, optim, "whole-after-step"), optim, 3)
    finally:
        off.OffloadManager.copy_out = original
    return all(torch.equal(ref[0][k], got[0][k]) for k in ref[0])


def test_failed_copy_leaves_state_recoverable(world2):
    assert all(world2.run(_failing_copy, "adamw"))


def _accounting(variant):
    """The runtime's device-pool account of offloaded state at each sync point against the
    simulator's for the same plan."""
    from autodist.cost.comm import CommModel
    from autodist.cost.simulator import Simulator
    from autodist.measure.trace import profile_model
    from autodist.structure import discover

    rank = dist.get_rank()
    plan = _offload_plan({"residency": "after_forward"}, "adamw", variant)
    plain = models.make("mlp")
    x, _ = models.batch("mlp", 4, torch.Generator().manual_seed(rank))
    prof = profile_model(plain, discover(plain), (x,), device=torch.device("cpu"), repeats=1, memory=False)
    comm = CommModel.analytic(2, bandwidth_bytes_s=1e9, latency_s=1e-4)
    sim = Simulator(prof, discover(plain), comm, world_size=2).run(plan)
    _, _, log = _train(plan, "adamw", 3)
    runtime = [(e, dev) for e, dev, _ in log if e.startswith("copy-back")]
    steady = runtime[-len([e for e in sim.offload_log if e[0].startswith("copy-back")]):]
    return {"runtime": steady, "simulated": [e for e in sim.offload_log if e[0].startswith("copy-back")]}


@pytest.mark.parametrize("variant", ["whole-after-step", "partial-forward-anchor"])
def test_runtime_device_pool_accounting_matches_the_simulator(world2, variant):
    # Rank 0 holds the largest (padded) shard of every parameter, which is what the simulator
    # assumes: its account must match exactly (tolerance: 0 bytes). Other ranks hold fewer rows.
    r0, r1 = world2.run(_accounting, variant)
    assert r0["runtime"] == r0["simulated"]
    assert [e for e, _ in r1["runtime"]] == [e for e, _ in r1["simulated"]]
    assert all(v1 <= v0 for (_, v1), (_, v0) in zip(r1["runtime"], r0["simulated"]))


def _device_bytes_over_micro_batches():
    """Offloaded state on the device after each backward of a step of 3 micro-batches (the first two
    under ``no_sync``), and at the step's start."""
    rank = dist.get_rank()
    plan = dataclasses.replace(_offload_plan({"residency": "after_forward"}, "adamw", "whole-after-step"), grad_accum_steps=3)
    torch.manual_seed(0)
    model = AutoDist(models.make("mlp"), plan=plan)
    opt = _opt("adamw", model.parameters())
    gen = torch.Generator().manual_seed(rank)
    account = model.runtime.offload.account
    seen = []
    for _ in range(3):
        seen = []
        for micro in range(3):
            x, y = models.batch("mlp", 4, gen)
            if micro < 2:
                with model.no_sync():
                    out = model(x)
                    if micro == 0:
                        seen.append(account.device_bytes)  # the step's copy-outs are finished by now
                    models.loss_fn("mlp", out, y).backward()
            else:
                models.loss_fn("mlp", model(x), y).backward()
            seen.append(account.device_bytes)
        opt.step()
        opt.zero_grad()
    model.close()
    return seen


def test_offloaded_state_stays_on_the_host_until_the_synchronising_backward(world2):
    # the copy-backs anchored at a unit's backward run in the backward that reduces: under no_sync
    # the state stays off the device (as the simulator plans it), and comes back for the step
    for start, after0, after1, after_sync in world2.run(_device_bytes_over_micro_batches):
        assert after0 == after1 == start
        assert after_sync > start


def _tied_peak() -> tuple[int, int, int]:
    """A GPT whose output layer is its embedding (``head.weight is wte.weight``), replicated, all of
    its Adam state offloaded and copied back at its first backward unit, so that the step's peak
    falls late in backward: (predicted peak, measured peak, the embedding's bytes)."""
    from autodist.cost.comm import CommModel
    from autodist.cost.simulator import Simulator
    from autodist.measure.memory import measure_step_peak
    from autodist.measure.trace import profile_model
    from autodist.sched.space import PlanSpace
    from autodist.structure import discover
    from autodist.zoo import GPT

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(8192, 128, 2, 2, 32)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())

    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randint(0, 8192, (1, 32), generator=gen), torch.randint(0, 8192, (1, 32), generator=gen)
    plain = build()
    structure = discover(plain)
    assert structure.params["wte.weight"].sites == (("wte", "weight"), ("head", "weight"))
    prof = profile_model(plain, structure, (x,), device=torch.device("cpu"), repeats=1, loss_fn=lambda out: loss(out, y))
    space = PlanSpace(structure, 2, [u.name for u in prof.units], prof.ready_order, state_names=STATES["adamw"])
    first_backward = f"backward:{structure.units[-1].name}"
    plan = dataclasses.replace(space.to_plan(space.ddp()), offload=[
        OffloadFragment(p, s, (0, info.numel), "step", first_backward) for p, info in structure.params.items() for s in STATES["adamw"]
    ])
    comm = CommModel.analytic(2, bandwidth_bytes_s=1e9, latency_s=1e-4)
    predicted = Simulator(prof, structure, comm, world_size=2).run(plan).peak_bytes
    model = AutoDist(build(), plan=plan)
    opt = _opt("adamw", model.parameters())

    def step() -> None:
        loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()

    def live() -> list[torch.Tensor]:
        held = list(model.runtime.held_tensors()) + [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
        return held + [p.grad for p in model.parameters() if p.grad is not None] + [x, y]

    measured = measure_step_peak(step, torch.device("cpu"), live)
    model.close()
    return predicted, measured, structure.params["wte.weight"].nbytes


def test_a_tied_parameters_first_gradient_is_held_through_backward(world2):
    """[Note: a tied parameter's first gradient]: the output layer's contribution to the embedding's
    gradient waits in autograd for the embedding's own until the end of backward. With the peak
    there (the optimizer state copied back early in backward) the prediction was the embedding's
    4 MiB short (30.1 against 34.1 MiB measured); now it is within 0.1%."""
    for predicted, measured, embedding in world2.run(_tied_peak):
        assert abs(predicted - measured) <= 0.001 * measured, (predicted, measured, embedding)
