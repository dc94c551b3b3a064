"""The collectives a known plan issues: count and order per step (recorded by the runtime)."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import models
from autodist import AutoDist, RankMismatchError
from autodist.plan import Prefetch
from parity import _full, make_plan


def _record(plan_kw, steps=3):
    rank = dist.get_rank()
    m = AutoDist(models.make("mlp"), plan=make_plan(models.make("mlp"), 2, **plan_kw))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    per_step = []
    for _ in range(steps):
        m.runtime.comm.stats.log = log = []
        x, y = models.batch("mlp", 4, gen)
        models.loss_fn("mlp", m(x), y).backward()
        opt.step()
        opt.zero_grad()
        per_step.append(log)
    m.close()
    return per_step


def test_after_forward_gathers_twice_per_group_in_plan_order(world2):
    steps = world2.run(_record, {"residency": "after_forward", "grouping": "unit", "window": 1})
    assert steps[0] == steps[1]  # identical on every rank
    expected = [
        ("all_gather", "layers.0"),  # window 1: issued at the start of the root forward
        ("all_gather", "layers.1"),  # ... when layers.0 starts
        ("all_gather", "layers.2"),  # ... when layers.1 starts
        ("all_gather", "layers.2"),  # backward: freed after forward, gathered again at the root's pre-backward
        ("all_gather", "layers.1"),  # ... one unit ahead
        ("reduce_scatter", "bucket0"),  # layers.2's gradients ready
        ("all_gather", "layers.0"),
        ("reduce_scatter", "bucket1"),
        ("reduce_scatter", "bucket2"),
    ]
    for step in steps[0]:
        assert step == expected


@pytest.mark.parametrize("residency", ["after_backward", "persistent"])
def test_once_gathered_residencies_gather_once_per_step(world2, residency):
    steps = world2.run(_record, {"residency": residency, "grouping": "unit", "window": 1})[0]
    for log in steps[1:]:  # steady state; persistent refreshes after the step belong to that step
        gathers = [label for kind, label in log if kind == "all_gather"]
        assert sorted(gathers) == ["layers.0", "layers.1", "layers.2"]
        assert [k for k, _ in log].count("reduce_scatter") == 3
    if residency == "persistent":
        # the three refreshes the previous optimizer step made due are issued at the forward's
        # start, before anything else ([Note: when persistent groups are refreshed])
        assert [k for k, _ in steps[1]][:3] == ["all_gather"] * 3


def test_fused_group_issues_one_gather(world2):
    steps = world2.run(_record, {"residency": "after_forward", "grouping": "all", "buckets": "one"})[0]
    for log in steps:
        assert log == [("all_gather", "layers.0..layers.2"), ("all_gather", "layers.0..layers.2"), ("reduce_scatter", "bucket0")]


def _profiled_steps_end_with_collectives_in_flight():
    # A wide layer, so that its persistent refresh gathers 8 MiB. An optimizer step issued it once,
    # still in flight when a profiler session around the step ended: the backend closed its
    # profiler record after the session and the process died with SIGSEGV. The refresh is now
    # issued at the next forward ([Note: when persistent groups are refreshed] in
    # autodist/runtime/optimizers.py), inside the session around that step, and waited there.
    from autodist import Plan
    from autodist.plan import Bucket, GatherGroup, UnitPlan

    rank = dist.get_rank()
    net = torch.nn.Sequential(torch.nn.Linear(1024, 2048))
    plan = Plan(
        world_size=2,
        units=[UnitPlan("0", ["0.weight", "0.bias"], "shard", "persistent")],
        gather_groups=[GatherGroup(["0"])],
        buckets=[Bucket(["0.weight", "0.bias"], "reduce_scatter")],
    )
    m = AutoDist(net, plan=plan)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            m(x).square().mean().backward()  # its forward issues the previous step's refresh
            opt.step()
            opt.zero_grad()
        names = {e.name for e in prof.events()}
        assert "autodist::all_gather(0)" in names and "autodist::reduce_scatter(bucket0)" in names
        assert all(not g.in_flight() for g in m.runtime.groups)
    m.close()
    return True


def test_profiled_steps_ending_with_collectives_in_flight_do_not_crash(world2):
    assert world2.run(_profiled_steps_end_with_collectives_in_flight) == [True, True]


def _on_a_group_with_a_short_timeout(timeout_s, plan):
    """mlp wrapped under ``plan`` on a new group of both ranks whose collectives time out after
    ``timeout_s``, and this rank's batch."""
    # the short timeout holds for every step on the group, its own making and AutoDist's groups'
    # included: the ranks start each together (the job's group waits as long as the pool allows)
    dist.barrier()
    group = dist.new_group([0, 1], timeout=timedelta(seconds=timeout_s))
    dist.barrier()
    m = AutoDist(models.make("mlp"), plan=plan, mesh=DeviceMesh.from_group(group, "cpu"))
    x, y = models.batch("mlp", 4, torch.Generator().manual_seed(dist.get_rank()))
    return group, m, x, y


def _stall_on_rank1(timeout_s):
    """Train one step on a process group with a short timeout, then rank 1 stops taking part."""
    rank = dist.get_rank()
    group, m, x, y = _on_a_group_with_a_short_timeout(timeout_s, "ddp")
    dist.barrier()
    models.loss_fn("mlp", m(x), y).backward()
    outcome = None
    if rank == 0:  # rank 1 stalls: it never joins the next step's gradient all-reduce
        try:
            models.loss_fn("mlp", m(x), y).backward()
        except RuntimeError as e:
            outcome = {"error": str(e)}
    for pg in (m.runtime.comm.gather_pg, m.runtime.comm.reduce_pg, group):
        dist.destroy_process_group(pg)
    return outcome


def test_a_stalled_rank_fails_the_others_after_the_process_group_timeout(world2):
    # AutoDist's own process groups inherit the timeout of the group it runs on (here 10 s: making
    # a group on a loaded machine took more than 2; under torchrun, init_process_group's): without it
    # the all-reduce waits torch's default 30 minutes. The backend's error names the timeout it
    # waited (torch's default would read 1800000ms).
    outcome = world2.run(_stall_on_rank1, 10, timeout=300)[0]
    assert outcome is not None, "the step on rank 0 finished although rank 1 never joined it"
    assert "Timed out waiting 10000ms" in outcome["error"], outcome["error"]


def _python_objects_held_by_collectives_issued_in_backward():
    # [Note: a collective issued in backward outliving the interpreter]: inside backward, torch
    # stashes a Python object in thread-local state; a work handle that captured it makes the
    # backend's thread take the GIL to drop it, which aborts the process at interpreter exit. The
    # probe puts an object of its own under that key, so the issued works are its only owners
    # once the key is cleared.
    import weakref

    if not hasattr(torch._C, "_get_obj_in_tls"):
        return None
    m = AutoDist(models.make("mlp"), plan=make_plan(models.make("mlp"), 2, residency="persistent"))
    comm = m.runtime.comm
    held = {}

    class Probe:
        pass

    def probe(grad):
        held["context stashed"] = torch._C._is_key_in_tls("context")
        ctx = torch._C._get_obj_in_tls("context")
        torch._C._remove_obj_from_tls("context")
        obj = Probe()
        ref = weakref.ref(obj)
        torch._C._stash_obj_in_tls("context", obj)
        del obj
        inflight = [
            ("all_reduce", comm.all_reduce(torch.ones(4), "probe")),
            ("reduce_scatter", comm.reduce_scatter(torch.empty(2), torch.ones(4), "probe")),
            ("all_gather", comm.all_gather(torch.empty(4), torch.ones(2), "probe")),
        ]
        torch._C._remove_obj_from_tls("context")  # the key's owner gone: the works are what is left
        torch._C._stash_obj_in_tls("context", ctx)
        held["kept alive"] = ref() is not None
        for _, f in inflight:
            f.wait()
        return grad

    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(probe)
    y.sum().backward()
    m.close()
    return held


def test_collectives_issued_in_backward_hold_no_python_object(world2):
    held = world2.run(_python_objects_held_by_collectives_issued_in_backward)
    if held[0] is None:
        pytest.skip("this torch has no Python objects in thread-local state")
    assert held == [{"context stashed": True, "kept alive": False}] * 2


def _object_exchanges_then_destroy():
    # [Note: object exchanges and interpreter exit]: once a Comm is destroyed, no backend thread of
    # its groups is left, nor any tensor an exchange handed to one
    import gc
    import os
    import weakref

    from autodist.runtime.comm import Comm

    def threads():
        return len(os.listdir("/proc/self/task"))

    if not os.path.isdir("/proc/self/task"):
        return None
    before = threads()
    comm = Comm(dist.group.WORLD)
    rank = dist.get_rank()
    alive = [0]
    real = {name: getattr(dist, name) for name in ("all_gather", "broadcast")}

    def watching(fn):
        def run(*args, **kwargs):
            for arg in args[:2]:
                for t in arg if isinstance(arg, list) else [arg]:
                    if isinstance(t, torch.Tensor):
                        alive[0] += 1
                        weakref.finalize(t, lambda: alive.__setitem__(0, alive[0] - 1))
            return fn(*args, **kwargs)
        return run

    results = []
    try:
        for name, fn in real.items():
            setattr(dist, name, watching(fn))
        for i in range(3):
            results.append(comm.all_gather_object({"rank": rank, "i": i, "pad": "x" * (100 * rank)}))
            results.append(comm.broadcast_object(f"from rank 1, exchange {i}" if rank == 1 else None, src=1))
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    during = threads()
    comm.destroy()
    after, held = threads(), alive[0]
    del comm
    gc.collect()
    return {"results": results, "threads": (before, during, after), "tensors alive": held}


def test_object_exchanges_leave_no_backend_thread_or_tensor_once_destroyed(world2):
    out = world2.run(_object_exchanges_then_destroy)
    if out[0] is None:
        pytest.skip("no /proc/self/task here to count a process's threads with")
    expected = []
    for i in range(3):
        expected.append([{"rank": r, "i": i, "pad": "x" * (100 * r)} for r in range(2)])
        expected.append(f"from rank 1, exchange {i}")
    for r in range(2):
        assert out[r]["results"] == expected
        before, during, after = out[r]["threads"]
        assert during > before and after == before, out[r]["threads"]
        assert out[r]["tensors alive"] == 0


class _SkipsAMiddleLayer(torch.nn.Module):
    """Four layers of different sizes; ``skip`` leaves out the second (control flow of this rank's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = (torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 12), torch.nn.Linear(12, 3))
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.l0(x))
        if not self.skip:
            x = torch.tanh(self.l1(x))
        return self.l3(torch.tanh(self.l2(x)))


def _train_with_a_rank_skipping(make, plan, skips, steps=4):
    """Train ``make()`` under ``plan`` where ``skips(step, rank)`` sets the model's ``skip`` (a
    rank-dependent branch), against a single-process reference over every rank's batch: the
    all-gathers of each step (the runtime's log) and the largest parameter error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * s + r)) for s in range(steps) for r in range(world)]

    torch.manual_seed(0)
    ref = make()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(steps):
        for r in range(world):  # the mean over ranks of each rank's gradient (zero where a layer was left out)
            ref.skip = skips(s, r)
            (ref(batches[s * world + r]).square().mean() / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    torch.manual_seed(0)
    net = make()
    m = AutoDist(net, plan=plan)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    gathers = []
    for s in range(steps):
        m.runtime.comm.stats.log = log = []
        net.skip = skips(s, rank)
        m(batches[s * world + rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        gathers.append([label for kind, label in log if kind == "all_gather"])
    ours = {n: _full(p.detach()) for n, p in m.named_parameters()}
    err = max((ours[n] - p).abs().max().item() for n, p in ref.named_parameters())
    m.close()
    return gathers, err


def _persistent_units_skipped_on_one_rank():
    plan = make_plan(_SkipsAMiddleLayer(), dist.get_world_size(), residency="persistent", grouping="unit", window=1)
    # rank 1 leaves l1 out in the first step only
    return _train_with_a_rank_skipping(_SkipsAMiddleLayer, plan, lambda s, r: s == 0 and r == 1)


def test_persistent_units_refresh_in_plan_order_when_one_rank_skipped_one(world2):
    # The refreshes after the optimizer step used to follow each rank's own observed unit order: the
    # unit rank 1 left out moved to the end of its order, so the ranks gathered l1 against l2 (gloo
    # aborts: the sizes differ) — though a skipped persistent unit issues no collective in its step.
    (refresh0, err0), (refresh1, err1) = world2.run(_persistent_units_skipped_on_one_rank)
    assert refresh0 == refresh1
    assert all(step[-4:] == ["l0", "l1", "l2", "l3"] for step in refresh0)  # the optimizer step's refreshes
    assert max(err0, err1) < 1e-5


class _BranchInTheMiddle(torch.nn.Module):
    """Five equal layers; ``skip`` leaves out the middle one (replicated by the plan: control flow of
    this rank's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.r, self.l2, self.l3 = (torch.nn.Linear(8, 8) for _ in range(5))
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.l1(torch.tanh(self.l0(x))))
        if not self.skip:
            x = torch.tanh(self.r(x))
        return self.l3(torch.tanh(self.l2(x)))


def _replicated_unit_skipped_on_one_rank():
    plan = make_plan(_BranchInTheMiddle(), dist.get_world_size(), replicate_units=("r",))
    # windows (forward, backward) under which positions counted over every unit put l3's forward
    # gather before l1's on the rank that skipped r, and l0's backward gather before l2's
    windows = {"l0": (1, 4), "l1": (1, 1), "l2": (1, 1), "l3": (4, 1)}
    for g in plan.gather_groups:
        g.prefetch = Prefetch(*windows[g.units[0]])
    # rank 1 leaves r out in steps 0 and 2
    return _train_with_a_rank_skipping(_BranchInTheMiddle, plan, lambda s, r: s in (0, 2) and r == 1)


def test_a_replicated_unit_one_rank_skips_moves_no_gather(world2):
    # Prefetch positions used to count every unit: the rank that skipped r counted the units after it
    # one earlier, and with these windows issued l3's gather before l1's in the next forward and l0's
    # before l2's in the skipping step's backward (equal sizes: the ranks paired different layers).
    (gathers0, err0), (gathers1, err1) = world2.run(_replicated_unit_skipped_on_one_rank)
    assert gathers0 == gathers1
    # forward, counted over the four gathering units: l3's window of 4 reaches the start of forward
    assert gathers0[1][:4] == ["l0", "l3", "l1", "l2"]
    assert max(err0, err1) < 1e-5


def _grad_scaler_with_inf_in_one_shard(kind, steps=4):
    # a mixed plan whose first unit is replicated: torch's DTensor rule for GradScaler combines the
    # inf/NaN finding across ranks only when the first gradient it checks is sharded
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * s + r)) for s in range(steps) for r in range(world)]

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))

    ref = make()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for s in range(steps):
        total = sum(ref(batches[s * world + r]).square().mean() for r in range(world)) / world
        ref_scaler.scale(total).backward()
        if s == 1:
            ref[2].weight.grad[0, 0] = float("inf")  # row 0: in rank 0's shard
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()

    net = make()
    m = AutoDist(net, plan=make_plan(make(), world, replicate_units=("0",)))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=4.0) if kind == "sharded" else torch.amp.GradScaler("cpu", init_scale=4.0)
    try:
        for s in range(steps):
            scaler.scale(m(batches[s * world + rank]).square().mean()).backward()
            if s == 1 and rank == 0:
                with torch.no_grad():
                    net[2].weight.grad.to_local().view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    except RankMismatchError as e:
        return str(e), None
    finally:
        m.close()
    ours = {n: _full(p.detach()) for n, p in m.named_parameters()}
    return None, max((ours[n] - p).abs().max().item() for n, p in ref.named_parameters())


def test_a_grad_scaler_step_skipped_on_one_rank_is_reported_on_every_rank(world2):
    # plain GradScaler: rank 0 finds the inf and skips the step, rank 1 steps; the next backward's
    # check names it instead of training on with parameters that differ between ranks
    for error, _ in world2.run(_grad_scaler_with_inf_in_one_shard, "plain"):
        assert error is not None and "the optimizer stepped on rank 1 but not on rank 0" in error, error
        assert "ShardedGradScaler" in error


def test_a_sharded_grad_scaler_skips_on_every_rank_and_matches_the_reference(world2):
    for error, err in world2.run(_grad_scaler_with_inf_in_one_shard, "sharded"):
        assert error is None and err < 1e-5, (error, err)


@pytest.mark.parametrize(
    "config,name,device_type,expected",
    [
        ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", "cuda", "nccl"),  # backend="cpu:gloo,cuda:nccl"
        ("cpu:gloo,cuda:nccl", "undefined", "cuda", "nccl"),  # init_process_group() on a GPU host
        ("cpu:gloo,cuda:nccl", "undefined", "cpu", "gloo"),
        ("cpu:gloo", "undefined", "cpu", "gloo"),  # init_process_group() on a CPU host
        ("cpu:gloo,cuda:gloo", "gloo", "cuda", "gloo"),
        ("nccl", "nccl", "cuda", "nccl"),
    ],
)
def test_the_backend_for_a_device_is_read_from_the_group_s_configuration(config, name, device_type, expected):
    """NCCL's one launch order is chosen for a group made without a backend, or for several, on a
    GPU host: the engine decided by the group's name, which reads "undefined" or the whole string
    there, and launched buckets in gradient-ready order on NCCL."""
    from autodist.runtime.comm import backend_in_config

    assert backend_in_config(config, name, device_type) == expected



def _state_dict_on_rank0_only(timeout_s):
    """A sharded model on a group with a short timeout; DDP's habit `if rank == 0: model.state_dict()`,
    then the same on every rank."""
    from autodist.errors import RankMismatchError

    rank = dist.get_rank()
    group, m, x, y = _on_a_group_with_a_short_timeout(timeout_s, "fsdp")
    models.loss_fn("mlp", m(x), y).backward()
    error = None
    if rank == 0:
        try:
            m.state_dict()
        except RankMismatchError as e:
            error = str(e)
    dist.barrier()
    full = m.state_dict()  # every rank: the n-th call on each
    keys = sorted(full)
    m.close()
    dist.destroy_process_group(group)
    return error, keys


def test_a_state_dict_asked_on_one_rank_of_a_sharded_plan_fails_there_with_the_fix(world2):
    """[Note: a collective called on some ranks only] in autodist/runtime/comm.py: the caller
    gets an error naming the ranks that did not call and what to do (it waited in a gather until
    the group's timeout before); called on every rank, the state dict is whole."""
    (error, keys), (other, other_keys) = world2.run(_state_dict_on_rank0_only, 6, timeout=300)
    assert error is not None and "not on rank(s) 1" in error and "torch.save(sd, path)" in error, error
    assert other is None and keys == other_keys and "layers.0.weight" in keys


def _eval_on_rank0_only(timeout_s, plan):
    """DDP's habit `if rank == 0: model.eval(); model(x)` after a training step, then the same
    evaluation on every rank and two more training steps: rank 0's error, and the model's output
    on one batch after the steps (the same on every rank when the ranks' parameters agree)."""
    from autodist.errors import RankMismatchError

    rank = dist.get_rank()
    group, m, x, y = _on_a_group_with_a_short_timeout(timeout_s, plan)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    models.loss_fn("mlp", m(x), y).backward()
    opt.step()
    error = None
    if rank == 0:
        m.eval()
        try:
            with torch.no_grad():
                m(x)
        except RankMismatchError as e:
            error = str(e)
        m.train()
    dist.barrier()
    for _ in range(2):  # every rank evaluates, then trains
        m.eval()
        with torch.no_grad():
            m(x)
        m.train()
        models.loss_fn("mlp", m(x), y).backward()
        opt.step()
        opt.zero_grad()
    # not state_dict(): DeviceMesh.from_group on a group of the same ranks as an earlier, destroyed
    # one reads that group's name in DTensor collectives (torch 2.14): this test runs last
    with torch.no_grad():
        out = m(models.batch("mlp", 4, torch.Generator().manual_seed(9))[0])
    m.close()
    dist.destroy_process_group(group)
    return error, out


@pytest.mark.parametrize("plan", ["fsdp", "persistent"])
def test_an_evaluation_on_one_rank_of_a_sharded_plan_fails_there_with_the_fix(world2, plan):
    """[Note: a forward on some ranks only] in autodist/runtime/engine.py: rank 0's forward in
    evaluation mode alone gets an error naming rank 1 and what to do (gloo aborted both processes
    on mismatched collectives before); every rank's evaluation and training then go on."""
    plan_arg = plan if plan == "fsdp" else make_plan(models.make("mlp"), 2, residency="persistent")
    (error, out0), (other, out1) = world2.run(_eval_on_rank0_only, 6, plan_arg, timeout=300)
    assert error is not None and "not on rank(s) 1" in error and "all_reduce" in error, error
    assert other is None
    assert torch.equal(out0, out1)


def _late_rank_at_a_mode_change(timeout_s, late_s):
    """Every rank evaluates, then rank 0 alone is late (a checkpoint written on rank 0) by
    ``late_s`` before every rank trains again: what each rank raised (nothing), and the warning
    rank 1 logged while it waited."""
    import logging

    rank = dist.get_rank()
    group, m, x, y = _on_a_group_with_a_short_timeout(timeout_s, "fsdp")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("autodist").addHandler(handler)
    error = None
    try:
        models.loss_fn("mlp", m(x), y).backward()
        m.eval()
        with torch.no_grad():
            m(x)
        m.train()
        if rank == 0:  # late by ``late_s`` after rank 1 has come to the meeting (its key in the store)
            import time

            comm = m.runtime.comm
            call = "a forward in training mode (model.train())"
            key = f"autodist/rendezvous/{comm.check_pg.group_name}/{call}/{comm._calls.get(call, 0) + 1}/1"
            store = dist.distributed_c10d._get_default_store()
            while not store.check([key]):
                time.sleep(0.01)
            time.sleep(late_s)
        models.loss_fn("mlp", m(x), y).backward()
    except Exception as e:  # noqa: BLE001 (the test reports whatever was raised)
        error = f"{type(e).__name__}: {e}"
    finally:
        logging.getLogger("autodist").removeHandler(handler)
    m.close()
    dist.destroy_process_group(group)
    return error, [r for r in records if "has waited" in r]


def test_a_rank_late_at_a_mode_change_is_waited_for_with_a_warning(world2):
    """A correct job whose rank 0 is slow between evaluation and training (past half the group's
    timeout, before it ends) trains on: the meeting warns and waits instead of failing it (the
    collective itself would have waited the whole timeout)."""
    # a 12 s group: the warning at 6 s, the error at 10.8 s; rank 0 comes 7.5 s after rank 1
    (error0, warned0), (error1, warned1) = world2.run(_late_rank_at_a_mode_change, 12, 7.5, timeout=300)
    assert error0 is None and error1 is None, (error0, error1)
    assert not warned0 and len(warned1) == 1 and "rank(s) 0" in warned1[0] and "training mode" in warned1[0], warned1
