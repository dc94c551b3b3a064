"""The simulator on hand-computable cases, its speed, and its agreement with the runtime's order.

The hand cases: two units ``u0``, ``u1`` with one 250-element float32 parameter each (1000 bytes;
on 2 ranks a 125-element, 500-byte shard), 10 ms forward and 20 ms backward each, 100 bytes of
activations each, no optimizer time. Collectives take a fixed time whatever their size: all-gather
2 ms, reduce-scatter 3 ms, all-reduce 4 ms; memory copies and the runtime's own overheads cost
nothing unless a test says otherwise. A plan that gathers ends each backward with the collective-order
check, one all-reduce waited for on the CPU: 4 ms. Every expected number below is worked out in the
comment next to it.
"""

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

from autodist import AutoDist
from autodist.cost.comm import CommModel, OpModel, Piece
from autodist.cost.profile import OptimizerProfile, Profile, UnitProfile
from autodist.cost.simulator import Simulator
from autodist.plan import Bucket, GatherGroup, Plan, Prefetch, UnitPlan
from autodist.schedule import collapsed_groups
from autodist.structure import discover

MS = 1e-3


class _P(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.u0 = _P(250)
        self.u1 = _P(250)


def _const(seconds):
    return OpModel(Piece(0.0, seconds), Piece(0.0, seconds), float("inf"))


COMM = CommModel(
    "test", 2, "cpu",
    {"all_gather": _const(2 * MS), "reduce_scatter": _const(3 * MS), "all_reduce": _const(4 * MS),
     "h2d": _const(0.0), "d2h": _const(0.0)},  # memory copies free here; priced in a test of their own
)
PROFILE = Profile(
    units=[
        UnitProfile("u0", fwd_s=10 * MS, bwd_s=20 * MS, act_bytes=100, ready=["u0.w"]),
        UnitProfile("u1", fwd_s=10 * MS, bwd_s=20 * MS, act_bytes=100, ready=["u1.w"]),
    ],
    ready_order=["u1.w", "u0.w"],
    optimizer=OptimizerProfile(state_factor=2.0, transient_factor=0.0),
)
STRUCTURE = discover(_Two())


def _sharded_plan(residency="after_forward", window=1, inflight=None):
    """Each unit sharded and gathered alone, one reduce-scatter bucket each."""
    return Plan(
        world_size=2,
        units=[UnitPlan("u0", ["u0.w"], "shard", residency), UnitPlan("u1", ["u1.w"], "shard", residency)],
        gather_groups=[GatherGroup(["u0"], Prefetch(window, window)), GatherGroup(["u1"], Prefetch(window, window))],
        buckets=[Bucket(["u1.w"], "reduce_scatter"), Bucket(["u0.w"], "reduce_scatter")],
        max_inflight_buckets=inflight,
    )


def _sharded(residency="after_forward", window=1, inflight=None, budget=None, comm=COMM):
    plan = _sharded_plan(residency, window, inflight)
    return Simulator(PROFILE, STRUCTURE, comm, world_size=2, budget_bytes=budget).run(plan, record=True)


def _one_group_sharded():
    """Both units sharded, gathered together without prefetch, one reduce-scatter bucket."""
    return Plan(
        world_size=2,
        units=[UnitPlan("u0", ["u0.w"], "shard", "after_backward"), UnitPlan("u1", ["u1.w"], "shard", "after_backward")],
        gather_groups=[GatherGroup(["u0", "u1"], Prefetch(0, 0))],
        buckets=[Bucket(["u1.w", "u0.w"], "reduce_scatter")],
    )


def _two_all_reduce_buckets():
    """Both units replicated, one all-reduce bucket each."""
    return Plan(
        world_size=2,
        units=[UnitPlan("u0", ["u0.w"]), UnitPlan("u1", ["u1.w"])],
        buckets=[Bucket(["u1.w"], "all_reduce"), Bucket(["u0.w"], "all_reduce")],
    )


def _names(result, stream):
    return [e.name for e in result.events if e.stream == stream]


# Static memory of the sharded plans: 2 shards of 500 bytes + Adam state 2 x (2 x 500) = 3000.
# A reduce-scatter bucket of one parameter: input 2 x (500 + 4 flag bytes) = 1008, output 504.


def test_after_forward_window_1():
    r = _sharded()
    # fwd: AG u0 [0,2] waited; AG u1 issued at 2 [2,4]; fwd u0 2..12 (u0 freed); fwd u1 12..22 (freed)
    # bwd: AG u1 at 22 [22,24] waited; AG u0 prefetched [24,26]; bwd u1 24..44, RS u1 [44,47];
    #      bwd u0 44..64, RS u0 [64,67]; flush waits until 67; the order check 67..71.
    assert r.step_s == pytest.approx(71 * MS)
    # peak at 64: static 3000 + RS u1 input 1008 and output 504 (waited at the flush)
    #             + u0's gradient (1000) while it is copied into RS u0's new input (1008), u0's full
    #             parameter (1000) still gathered — it is freed when u0's backward ends
    #             (post-backward), after its gradient was taken into the bucket = 7520; then the
    #             gradient goes and the output (504) comes: 7024
    assert r.peak_bytes == 7520
    assert _names(r, "compute") == ["fwd u0", "fwd u1", "bwd u1", "bwd u0", "collective-order check"]
    assert _names(r, "comm") == [
        "all_gather gather u0", "all_gather gather u1", "all_gather gather u1", "all_gather gather u0",
        "reduce_scatter bucket0", "reduce_scatter bucket1",
    ]
    assert (r.gathers, r.reductions) == (4, 2)


def test_window_0_gathers_on_demand():
    r = _sharded(window=0)
    # fwd: AG u0 [0,2], fwd u0 2..12; AG u1 [12,14], fwd u1 14..24
    # bwd: AG u1 [24,26], bwd u1 26..46, RS u1 [46,49]; AG u0 queued behind it [49,51],
    #      bwd u0 51..71, RS u0 [71,74]; flush 74; the order check 74..78 (compute thread)
    assert r.step_s == pytest.approx(78 * MS)
    assert r.exposed_comm_s == pytest.approx((78 - 64) * MS)


def test_after_backward_gathers_once():
    r = _sharded(residency="after_backward")
    # fwd as window 1 but nothing freed: fwd u0 2..12, fwd u1 12..22
    # bwd u1 22..42 (u1 freed), RS u1 [42,45]; bwd u0 42..62, RS u0 [62,65]; flush 65; check 65..69
    assert r.step_s == pytest.approx(69 * MS)
    assert _names(r, "comm") == [
        "all_gather gather u0", "all_gather gather u1", "reduce_scatter bucket0", "reduce_scatter bucket1",
    ]
    assert r.peak_bytes == 7520  # same accounting as after_forward at its peak (t=62)


def test_persistent_refresh_overlaps_next_forward():
    r = _sharded(residency="persistent")
    # the first step's optimizer issued refreshes of u0 [0,2] and u1 [2,4] (times from the second
    # step's start); fwd u0 waits to 2, 2..12; fwd u1 12..22; bwd 22..42, 42..62; RS [42,45], [62,65];
    # the order check 65..69
    assert r.step_s == pytest.approx(69 * MS)
    # full parameters stay resident: 3000 static + 2000 full; at 62: + RS u1 1008 + 504, and u0's
    # gradient 1000 copied into RS u0's input 1008 = 8520
    assert r.peak_bytes == 8520
    assert _names(r, "comm")[:2] == ["all_gather refresh u0", "all_gather refresh u1"]


def _with_transient(**per_byte):
    """COMM whose collectives allocate backend buffers of ``per_byte`` times their message."""
    comm = CommModel.from_json(COMM.to_json())
    comm.transient = dict(per_byte)
    return comm


def test_a_reduce_scatters_backend_buffer_is_held_until_its_wait():
    # gloo's reduce-scatter allocates half its message when issued and frees it with its work
    # object, which the runtime drops at the wait: 504 bytes per bucket (message 1008)
    r = _sharded(comm=_with_transient(reduce_scatter=0.5))
    # as test_after_forward_window_1 (7520 when u0's input is allocated at 64), plus RS u1's buffer,
    # held from its launch at 44 to the flush although RS u1 completed at 47: 8024; u0's gradient
    # goes (7024), its output (504) and RS u0's buffer (504) come: 8032
    assert r.peak_bytes == 8032
    # in flight at the peak: both inputs (2 x 1008) and both backend buffers (2 x 504)
    assert r.breakdown["communication buffers in flight"] == 3024


def test_a_gather_holds_its_backend_buffer_from_its_issue_while_a_reduction_runs():
    # [Note: collectives taken up at once]: gathers and reductions run on process groups of their
    # own. With window 0 (test_window_0_gathers_on_demand) AG u0 is issued at 46, as RS u1 starts;
    # its transfer waits for RS u1's [49,51], but the gather group's backend takes it up at its
    # issue and allocates its 1000-byte buffer then (measured on gloo: resnet18's 9 MiB gather
    # buffer allocated 0.2 ms after its issue while a reduction ran)
    r = _sharded(window=0, comm=_with_transient(all_gather=1.0))
    at = [(round(t / MS, 3), b) for t, b in r.memory if 46 * MS <= t <= 51 * MS]
    # at 46, once u1's backward ended: static 3000, u0's activations 100, RS u1's input 1008 and
    # output 504 (u1's gradient and full parameter gone) = 4612; AG u0's full parameter (1000)
    # at its issue: 5612, and its buffer (1000) as the backend takes it up: 6612; the buffer goes
    # when the gather completes at 51
    assert at[-4:] == [(46.0, 4612), (46.0, 5612), (46.0, 6612), (51.0, 5612)], at
    assert not any(t == 49.0 for t, _ in at)  # nothing happens when its transfer starts


def test_a_gathers_buffer_is_gone_when_the_wait_for_it_returns():
    # [Note: what a wait returns after]: as above, with u0's backward peaking 3000 bytes above what
    # it starts from. AG u0 completes at 51 and u0's backward, which waited for it, starts then:
    # the backend freed the gather's buffer first (measured on gloo: resnet18's 9 MiB buffer freed
    # on the backend's thread 0.5 ms before the backward's first allocation), so the peak is
    # 5612 + 3000 = 8612, not 6612 + 3000
    prof = replace(PROFILE, units=[replace(PROFILE.units[0], bwd_peak_bytes=3000), PROFILE.units[1]])
    r = Simulator(prof, STRUCTURE, _with_transient(all_gather=1.0), world_size=2).run(_sharded_plan(window=0), record=True)
    assert [(round(t / MS, 3), b) for t, b in r.memory if t == 51 * MS] == [(51.0, 5612), (51.0, 8612)]
    assert r.peak_bytes == 8612


def test_a_groups_backend_takes_up_as_many_collectives_as_it_has_workers():
    # window 2: AG u0 and AG u1 are both issued at 0, before the forward waits for u0
    def forward_start(workers):
        comm = _with_transient(all_gather=1.0)
        comm.workers = workers
        r = _sharded(window=2, comm=comm)
        return [(round(t / MS, 3), b) for t, b in r.memory if t <= 4 * MS]

    # static 3000 with the last step's RS outputs (2 x 504) until the forward releases them; AG u0's
    # full parameter (4000) and buffer (5000), AG u1's full parameter (6000); one worker: u1's
    # buffer waits until u0's gather completes at 2 (5000, 6000) and goes at 4 ...
    assert forward_start(1) == [(0.0, 4008), (0.0, 3504), (0.0, 3000), (0.0, 4000), (0.0, 5000), (0.0, 6000),
                                (2.0, 5000), (2.0, 6000), (4.0, 5000)]
    # ... two workers (gloo's default): both buffers at 0
    assert forward_start(2) == [(0.0, 4008), (0.0, 3504), (0.0, 3000), (0.0, 4000), (0.0, 5000), (0.0, 6000),
                                (0.0, 7000), (2.0, 6000), (4.0, 5000)]
    # a worker count below one is refused where a comm model is read
    bad = json.loads(COMM.to_json())
    bad["workers"] = 0
    with pytest.raises(ValueError, match="workers 0 is not a positive integer"):
        CommModel.from_dict(bad)


def test_a_step_starts_with_the_last_steps_sharded_gradients_and_every_refreshs_buffer():
    r = _sharded(residency="persistent", comm=_with_transient(all_gather=1.0))
    # static 3000 + persistent full parameters 2000 + the previous step's reduce-scatter outputs
    # (2 x 504: zero_grad dropped the gradients, their storage goes at the forward) = 6008
    assert r.static_bytes == 6008
    # the refreshes of u0 and u1, taken up together by the backend before the step (see
    # test_collectives_issued_together_hold_their_backend_buffers_at_once in test_metrics.py), hold
    # their 1000-byte buffers: 8008; the forward releases the outputs (7000); the refresh of u0
    # completes at 2 (6000) and u1's at 4 (5000)
    assert r.memory[:7] == [(0.0, 6008), (0.0, 7008), (0.0, 8008), (0.0, 7504), (0.0, 7000), (2 * MS, 6000), (4 * MS, 5000)]


def test_bounded_inflight_reductions_wait_in_backward():
    r = _sharded(inflight=0)
    # RS u1 [44,47] is waited for right away: bwd u0 runs 47..67, RS u0 [67,70]; check 70..74
    assert r.step_s == pytest.approx(74 * MS)
    # its input is gone before u0's gradient arrives: 3000 + 504 + u0's gradient 1000 copied into
    # the input 1008 + u0's full 1000 (freed after its backward) = 6512 at 67; or 3000 + 1000 full u0
    # + 1000 full u1 (freed after u1's backward) + 100 act + u1's gradient 1000 copied into the
    # input 1008 = 7108 at 44
    assert r.peak_bytes == 7108


def test_replicated_plan_all_reduces_one_bucket():
    plan = Plan(
        world_size=2,
        units=[UnitPlan("u0", ["u0.w"]), UnitPlan("u1", ["u1.w"])],
        buckets=[Bucket(["u1.w", "u0.w"], "all_reduce")],
    )
    r = Simulator(PROFILE, STRUCTURE, COMM, world_size=2).run(plan, record=True)
    # fwd 0..20, bwd 20..60; the bucket launches when u0's gradient is ready: AR [60,64]; flush 64
    assert r.step_s == pytest.approx(64 * MS)
    # static: params 2000 + Adam 4000 + bucket buffer 2000 + 8 flag bytes = 8008; + 2 x 100 activations
    assert r.static_bytes == 8008
    assert r.peak_bytes == 8208


def test_the_loss_holds_its_saved_bytes_until_its_backward_and_peaks_there():
    import dataclasses

    plan = Plan(
        world_size=2,
        units=[UnitPlan("u0", ["u0.w"]), UnitPlan("u1", ["u1.w"])],
        buckets=[Bucket(["u1.w", "u0.w"], "all_reduce")],
    )
    prof = dataclasses.replace(PROFILE, loss_act_bytes=300, loss_fwd_peak_bytes=50, loss_bwd_peak_bytes=600)
    r = Simulator(prof, STRUCTURE, COMM, world_size=2).run(plan, record=True)
    # static 8008 + both activations 200 + the loss's 300 saved = 8508, + its backward's 600 = 9108
    # (the loss forward's 50 comes before its saved bytes: 8258, not the peak)
    assert r.peak_bytes == 9108
    assert r.step_s == pytest.approx(64 * MS)  # memory only: no time was added


def test_infeasible_plan_is_flagged():
    assert not _sharded(budget=7500).feasible  # peak 7520
    assert _sharded(budget=7520).feasible


def test_slowdown_stretches_overlapped_compute():
    slow = CommModel("test", 2, "cpu", COMM.ops, compute_slowdown=2.0, comm_slowdown=1.0)
    plan = _two_all_reduce_buckets()
    r = Simulator(PROFILE, STRUCTURE, slow, world_size=2).run(plan)
    # bwd u1 20..40; AR u1 [40,44] runs while bwd u0 computes: its first 4 ms of wall time do
    # 2 ms of work, so bwd u0 ends at 40 + 4 + 18 = 62; AR u0 [62,66]
    assert r.step_s == pytest.approx(66 * MS)


def test_compute_slows_by_the_sweeps_figure_times_the_models_measured_sensitivity():
    from dataclasses import replace

    # the sweep's reference computation slows 2x under an all-reduce (every size)
    slow = CommModel("test", 2, "cpu", COMM.ops, contention={"all_reduce": [[1.0, 2.0, 1.0, 1.0]]})
    plan = _two_all_reduce_buckets()

    def step(**measured):
        return Simulator(replace(PROFILE, **measured), STRUCTURE, slow, world_size=2).run(plan).step_s

    # bwd u1 20..40; AR u1 [40,44] under bwd u0, which computes at 1/(2 x sensitivity) of its speed
    # for those 4 ms; then the rest of bwd u0, and AR u0 (4 ms) waited for at once
    assert step() == pytest.approx((44 + (20 - 4 / 2) + 4) * MS)  # nothing measured: the reference's 2x
    three_times = (44 + (20 - 4 / 3) + 4) * MS
    assert step(contention_sensitivity=1.5) == pytest.approx(three_times)
    # the model measured against the reference under the same train wins over its slowdown alone ...
    assert step(contended_slowdown=4.0, contention_sensitivity=1.5) == pytest.approx(three_times)
    # ... which an older profile has alone: taken against the sweep's figure for the train's all-reduce
    assert step(contended_slowdown=3.0) == pytest.approx(three_times)


def test_runtime_overheads_and_copies_are_charged_to_compute():
    costly = CommModel(
        "test", 2, "cpu",
        dict(COMM.ops, h2d=_const(0.5 * MS)),
        overhead={"per_gather_s": 1 * MS, "per_bucket_s": 2 * MS, "per_unit_s": 4 * MS},
    )
    plan = _one_group_sharded()
    r = Simulator(PROFILE, STRUCTURE, costly, world_size=2).run(plan)
    # gather: 1 ms bookkeeping, AG [1,3], 0.5 ms copy-out (two parameters share the buffer): 3.5
    # four unit segments each 2 ms longer (half of 4 ms per unit, per pass): fwd 3.5..15.5..27.5,
    # bwd 27.5..49.5..71.5; bucket: 2 ms + two 0.5 ms passes = 3 ms -> 74.5; RS [74.5,77.5];
    # the order check 77.5..81.5
    assert r.step_s == pytest.approx(81.5 * MS)


def test_the_predicted_phases_hold_the_compute_threads_work_and_not_its_waits():
    # the step of the test above by phase: forward 1 ms gather bookkeeping + 0.5 ms copy-out + two
    # units of 10 + 2 ms = 25.5 ms (not the 2 ms it waits for the gather); backward two units of
    # 20 + 2 ms, the bucket's 3 ms and the collective-order check, which the host runs and waits
    # for itself, 4 ms = 51 ms (not the wait for the reduce-scatter); the optimizer costs nothing here
    costly = CommModel(
        "test", 2, "cpu",
        dict(COMM.ops, h2d=_const(0.5 * MS)),
        overhead={"per_gather_s": 1 * MS, "per_bucket_s": 2 * MS, "per_unit_s": 4 * MS},
    )
    phases = Simulator(PROFILE, STRUCTURE, costly, world_size=2).phase_seconds(_one_group_sharded())
    assert phases == pytest.approx({"forward": 25.5 * MS, "backward": 51 * MS, "optimizer": 0.0})
    timed = replace(PROFILE, optimizer=OptimizerProfile(fixed_s=5 * MS, state_factor=2.0, transient_factor=0.0))
    assert Simulator(timed, STRUCTURE, costly, world_size=2).phase_seconds(_one_group_sharded())["optimizer"] == pytest.approx(5 * MS)


def test_a_group_hooked_at_its_root_is_charged_one_hooked_unit_and_each_units_own_share():
    # the same step with the figure for a unit of a group hooked at its root (autodist/schedule.py
    # [Note: hooks per gather group]): the group's two units are charged, per pass, 4/2 + 1/2 ms
    # (the root's hooks and its own share) and 1/2 ms, instead of 2 ms each: 2 ms less over the
    # four unit segments than the 81.5 ms above
    plan = _one_group_sharded()
    assert collapsed_groups(plan, STRUCTURE) == {0: ""}
    costly = CommModel(
        "test", 2, "cpu",
        dict(COMM.ops, h2d=_const(0.5 * MS)),
        overhead={"per_gather_s": 1 * MS, "per_bucket_s": 2 * MS, "per_unit_s": 4 * MS, "per_grouped_unit_s": 1 * MS},
    )
    r = Simulator(PROFILE, STRUCTURE, costly, world_size=2).run(plan)
    assert r.step_s == pytest.approx(79.5 * MS)


def test_each_replicated_parameters_gradient_hook_is_charged_to_its_units_backward():
    plan = _two_all_reduce_buckets()
    base = Simulator(PROFILE, STRUCTURE, COMM, world_size=2).run(plan)
    hooked = Simulator(PROFILE, STRUCTURE, replace(COMM, overhead={"per_param_s": 1 * MS}), world_size=2).run(plan)
    trainable = [p for p in STRUCTURE.params.values() if p.requires_grad]
    assert len(trainable) == 2  # one weight per unit
    assert hooked.compute_s == pytest.approx(base.compute_s + 2 * MS)
    assert hooked.step_s > base.step_s
    # a comm model measured before the figure existed charges nothing
    assert Simulator(PROFILE, STRUCTURE, replace(COMM, overhead={}), world_size=2).run(plan).step_s == pytest.approx(base.step_s)


def test_the_compute_thread_pays_for_issuing_and_collecting_each_collective():
    # the caller's share of a collective (issue + collecting it when done): 0.5 ms per all-gather,
    # 1 ms per reduce-scatter, 0.25 ms per all-reduce; the operations themselves as before
    hosted = CommModel("test", 2, "cpu", COMM.ops, host={
        "all_gather": _const(0.5 * MS), "reduce_scatter": _const(1 * MS), "all_reduce": _const(0.25 * MS),
    })
    r = _sharded("after_backward", comm=hosted)
    # fwd: issue AG u0 0..0.5, AG u0 [0.5,2.5]; at u0 its own group first (wait to 2.5), then the
    #      prefetch: issue AG u1 2.5..3, AG u1 [3,5]; fwd u0 3..13; fwd u1 13..23 (u1 already there)
    # bwd u1 23..43; issue RS u1 43..44, RS u1 [44,47]; bwd u0 44..64; issue RS u0 64..65,
    #      RS u0 [65,68]; flush 68; the order check: issue 0.25 + all-reduce 4 -> 72.25
    assert r.step_s == pytest.approx(72.25 * MS)
    # a world of one issues nothing, so pays nothing
    assert CommModel("test", 1, "cpu", COMM.ops, host=hosted.host).host_time("all_gather", 1000) == 0.0


def test_a_collective_stays_slowed_while_the_compute_thread_waits_for_it():
    # a 4 ms all-reduce runs 2x slower while compute runs, 1.5x slower while the compute thread waits
    # (rows of the contention table: bytes, compute slowdown, comm slowdown, slowdown while waiting)
    rows = [[1.0, 1.0, 2.0, 1.5]]
    slow = CommModel("test", 2, "cpu", COMM.ops, contention={"all_reduce": rows})
    plan = _two_all_reduce_buckets()
    r = Simulator(PROFILE, STRUCTURE, slow, world_size=2).run(plan)
    # bwd u1 20..40; AR u1 [40, 48] overlaps bwd u0 (40..60) entirely: 8 ms of wall time at half speed;
    # AR u0 issued at 60 and waited for at once: 4 ms of work at 1/1.5 speed -> 66
    assert r.step_s == pytest.approx(66 * MS)
    assert slow.slowdowns("all_reduce", 1000) == (1.0, 2.0, 1.5)


def test_a_wait_on_a_collective_not_yet_done_costs_the_step_the_blocked_wait_time():
    blocked = replace(COMM, blocked_wait_s=1 * MS)
    # bwd u1 20..40; AR u1 [40,44] is done long before the flush at 60, whose wait for it does not
    # block; AR u0 issued at 60 and waited for at once: done at 64, and the wait costs 1 ms -> 65
    two = Simulator(PROFILE, STRUCTURE, blocked, world_size=2).run(_two_all_reduce_buckets())
    assert two.step_s == pytest.approx(65 * MS)
    # every wait that blocks pays (74 ms without; see test_bounded_inflight_reductions_wait_in_backward):
    # for u0's gather, issued at the step's start; for u1's, gathered again as the backward begins;
    # for both reduce-scatters, waited for right after launch. u1's forward gather, prefetched under
    # u0's forward, and u0's backward one, under u1's backward, are done when waited for
    assert _sharded(inflight=0, comm=blocked).step_s == pytest.approx((74 + 4) * MS)
    # the calibration travels with the model's JSON
    assert type(COMM).from_json(blocked.to_json()).blocked_wait_s == 1 * MS
    # a world of one issues nothing: its waits never block, whatever the calibration
    alone = replace(_two_all_reduce_buckets(), world_size=1)
    single = [Simulator(PROFILE, STRUCTURE, replace(c, world_size=1), world_size=1).run(alone).step_s for c in (COMM, blocked)]
    assert single[0] == single[1] == pytest.approx(60 * MS)


def test_the_wait_scale_applies_to_a_collective_taken_up_alone_not_to_one_queued_behind_another():
    # 1.5x slower while the compute thread waits, times the wait scale 2 -> 3x for a collective the
    # comm queue takes up alone; one it takes up as the one before finishes runs at the 1.5x unscaled
    rows = [[1.0, 1.0, 1.0, 1.5]]
    scaled = CommModel("test", 2, "cpu", COMM.ops, contention={"all_reduce": rows}, wait_scale=2.0)
    # u0's bucket first: u1's gradient (ready at 40) waits for it, and both launch at the end of
    # backward (60): AR u0 [60,72] at 3x, then AR u1, queued behind it, [72,78] at 1.5x
    plan = Plan(
        world_size=2,
        units=[UnitPlan("u0", ["u0.w"]), UnitPlan("u1", ["u1.w"])],
        buckets=[Bucket(["u0.w"], "all_reduce"), Bucket(["u1.w"], "all_reduce")],
    )
    r = Simulator(PROFILE, STRUCTURE, scaled, world_size=2).run(plan, record=True)
    comm = [(e.name, e.start, e.end) for e in r.events if e.stream == "comm"]
    assert [n for n, _, _ in comm] == ["all_reduce bucket0", "all_reduce bucket1"]
    assert [(s / MS, e / MS) for _, s, e in comm] == [pytest.approx((60, 72)), pytest.approx((72, 78))]
    assert r.step_s == pytest.approx(78 * MS)
    # a blocked wait's time stalls the queue too (the ranks meet there): the wait for AR u0 returns
    # at 72 and costs 72..73, AR u1 runs [72,79], and the wait for it costs 79..80
    b = Simulator(PROFILE, STRUCTURE, replace(scaled, blocked_wait_s=1 * MS), world_size=2).run(plan, record=True)
    assert [(e.start / MS, e.end / MS) for e in b.events if e.stream == "comm"] == [pytest.approx((60, 72)), pytest.approx((72, 79))]
    assert b.step_s == pytest.approx(80 * MS)
    assert scaled.slowdowns("all_reduce", 1000) == (1.0, 1.0, 3.0)
    assert scaled.slowdowns("all_reduce", 1000, scaled=False) == (1.0, 1.0, 1.5)


def test_fresh_memory_is_paid_where_the_runtime_allocates_it():
    # writing a freshly allocated tensor costs 1 ms per 1000 bytes beyond 500 bytes (a CPU's
    # allocator mapping fresh pages for large tensors)
    fresh = CommModel("test", 2, "cpu", COMM.ops, first_touch=[[500.0, 0.0], [1000.0, 1 * MS]])
    assert fresh.first_touch_s(400) == 0.0 and fresh.first_touch_s(750) == pytest.approx(0.5 * MS)
    assert fresh.first_touch_s(2000) == pytest.approx(2 * MS)  # proportional beyond the largest
    sharded = _one_group_sharded()
    r = Simulator(PROFILE, STRUCTURE, fresh, world_size=2).run(sharded)
    # the group's all-gather lands in a new 2000-byte buffer: 2 + 2 ms [0,4]; the copy-out writes two
    # new 1000-byte full tensors: 2 ms -> 6; fwd 6..26; bwd 26..66 (the profile's gradients were
    # fresh, as the runtime's are here); the reduce-scatter's new input, 2 x (2 x 500 + 8) = 2016
    # bytes: 2.016 ms -> 68.016; RS [68.016, 71.016]; the order check -> 75.016
    assert r.step_s == pytest.approx(75.016 * MS)
    replicated = Plan(
        world_size=2,
        units=[UnitPlan("u0", ["u0.w"]), UnitPlan("u1", ["u1.w"])],
        buckets=[Bucket(["u1.w", "u0.w"], "all_reduce")],
    )
    r = Simulator(PROFILE, STRUCTURE, fresh, world_size=2).run(replicated)
    # autograd writes each gradient into fresh memory before the bucket copies it in, as it did
    # when profiled ([Note: gradients are fresh memory]): each unit's backward is as profiled:
    # fwd 0..20, bwd 20..40..60, AR [60,64]
    assert r.step_s == pytest.approx(64 * MS)


WIDE = 4096  # a 4096 x 4096 weight: a 64 MiB gradient, above glibc's largest mmap threshold (32 MiB)


def _backward_page_faults():
    """Minor page faults of the compute thread in one backward of a wide linear layer: the plain
    module with its gradient freed before (what the profile times), and the module under the ddp
    plan, whose gradient the bucket copies into its persistent buffer (a view of which is then
    ``.grad``), in the steady state."""
    import resource

    torch.manual_seed(0)
    x = torch.randn(8, WIDE)

    def faults(step):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        step()
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

    plain = nn.Linear(WIDE, WIDE)
    wrapped = AutoDist(nn.Linear(WIDE, WIDE), plan="ddp")
    out = {"plain": [], "ddp": []}
    for _ in range(3):
        plain.zero_grad(set_to_none=True)
        loss = plain(x).square().mean()
        out["plain"].append(faults(loss.backward))
        wrapped.zero_grad(set_to_none=True)
        loss = wrapped(x).square().mean()
        out["ddp"].append(faults(loss.backward))
    return {k: v[-1] for k, v in out.items()}


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_THREAD"), reason="per-thread page faults are read on Linux")
def test_a_replicated_gradient_is_written_into_fresh_memory_as_the_profiled_one_is(world2):
    # the simulator charges a replicated plan's backward the profile's time, fresh memory included
    # (test above): measured, the bucket's persistent buffer saves none of a 64 MiB gradient's page
    # faults (wide-mlp's backward saved about a tenth: its 16 MiB gradients, below glibc's mmap
    # threshold, reuse the heap when freed as they arrive)
    faults = world2.run(_backward_page_faults)
    pages = WIDE * WIDE * 4 // 4096
    for f in faults:
        if f["plain"] < pages // 2:
            pytest.skip(f"this host's allocator reuses 64 MiB blocks ({f['plain']} page faults in the plain "
                        f"backward, not ~{pages}): there is no fresh memory to charge")
        assert f["ddp"] >= 0.9 * f["plain"], faults


def test_offload_frees_state_between_copy_out_and_copy_back():
    from autodist.plan import OffloadFragment

    # a GPU-like device: host copies take 5 ms, copies within device memory are free
    copies = CommModel("test", 2, "cuda-like", dict(COMM.ops, h2d=_const(5 * MS), d2h=_const(5 * MS)))
    plan = Plan(
        world_size=2,
        units=[UnitPlan("u0", ["u0.w"]), UnitPlan("u1", ["u1.w"])],
        buckets=[Bucket(["u1.w", "u0.w"], "all_reduce")],
        offload=[OffloadFragment("u0.w", "exp_avg", (0, 250), "step", "backward:u0")],
    )
    r = Simulator(PROFILE, STRUCTURE, copies, world_size=2).run(plan, record=True)
    # copy-out of u0's exp_avg (1000 bytes) on the copy stream [0,5] (left over from the previous
    # step), finished before the forward starts (the runtime releases offloaded state at that known
    # point): fwd 5..25; bwd u1 25..45; at u0's backward the copy-back [45,50] (the state is back on
    # the device: +1000); bwd u0 45..65; AR [65,69]; the sync before the step finds it done.
    assert r.step_s == pytest.approx(69 * MS)
    assert [e.name for e in r.events if e.stream == "copy"] == ["copy_out u0.w/exp_avg", "copy_back u0.w/exp_avg"]
    # static 8008 (see the replicated test); the state is off the device from 5 to 45: at 25 the
    # activations peak at 7208 instead of 8208; the copy-back at 45 brings 8108 (one activation freed)
    assert r.peak_bytes == 8108
    assert r.offload_log == [
        ("copy-out start", 1000), ("copy-out done", 0), ("copy-back start", 1000), ("copy-back done", 1000),
    ]


def test_deterministic():
    a, b = _sharded(window=1), _sharded(window=1)
    assert (a.step_s, a.peak_bytes, [(e.name, e.start) for e in a.events]) == (
        b.step_s, b.peak_bytes, [(e.name, e.start) for e in b.events]
    )


# ---- the simulator issues what the runtime issues, in the same order ---------------------------


import models  # noqa: E402


def _runtime_and_simulated_order(plan_kw):
    from autodist import AutoDist
    from parity import profiled_mlp

    structure, prof, plan, x, y = profiled_mlp(plan_kw)
    simulated = Simulator(prof, structure, COMM, world_size=2).run(plan, record=True)
    sim_order = [tuple(e.name.split(" ")) for e in simulated.events if e.stream == "comm"]
    m = AutoDist(models.make("mlp"), plan=plan)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    logs = []
    for _ in range(3):
        m.runtime.comm.stats.log = log = []
        models.loss_fn("mlp", m(x), y).backward()
        opt.step()
        opt.zero_grad()
        logs.append(log)
    m.close()
    # the steady step: the refreshes step 2's optimizer step made due are issued at step 3's
    # forward start, where the simulator's preamble has them
    runtime_order = [(k, lbl.split("..")[0]) for k, lbl in logs[2]]
    sim_keyed = [(parts[0], parts[-1]) for parts in sim_order]
    return runtime_order, sim_keyed


@pytest.mark.parametrize(
    "plan_kw",
    [
        {"residency": "after_forward", "window": 1},
        {"residency": "after_forward", "window": 0},
        {"residency": "after_forward", "window": 3, "buckets": "per_param"},
        {"residency": "after_backward", "window": 1, "buckets": "one"},
        {"residency": "persistent", "window": 1},
        {"residency": "after_forward", "grouping": "all", "buckets": "one"},
        {"placement": "mixed", "residency": "after_forward", "window": 1},
    ],
    ids=["af-w1", "af-w0", "af-w3-per-param", "ab-one-bucket", "persistent", "af-all", "mixed"],
)
def test_simulator_issues_collectives_in_the_runtimes_order(world2, plan_kw):
    runtime_order, sim_order = world2.run(_runtime_and_simulated_order, plan_kw)[0]
    assert runtime_order == sim_order


def _replicated(**kw):
    return Plan(
        world_size=2,
        units=[UnitPlan("u0", ["u0.w"]), UnitPlan("u1", ["u1.w"])],
        buckets=[Bucket(["u1.w", "u0.w"], "all_reduce")],
        **kw,
    )


# Static memory of the replicated plans: 2 parameters of 1000 bytes + one all-reduce bucket of
# 2 x 1000 + 2 x 4 flag bytes = 2008 + Adam state 2 x 2000 = 8008.
PROFILE_BLOCKS = Profile(
    units=PROFILE.units, ready_order=PROFILE.ready_order, optimizer=PROFILE.optimizer,
    block_input_bytes={"u0": 40, "u1": 40},
)


def test_recomputing_a_block_trades_its_activations_for_a_second_forward():
    sim = Simulator(PROFILE_BLOCKS, STRUCTURE, COMM, world_size=2)
    plain = sim.run(_replicated())
    r = sim.run(_replicated(recompute=["u0"]), record=True)
    # plain: fwd u0 0..10, fwd u1 10..20, bwd u1 20..40, bwd u0 40..60, all-reduce 60..64
    assert plain.step_s == pytest.approx(64 * MS)
    # recompute u0: its forward runs again at the start of its backward: bwd u1 20..40,
    # recompute u0 40..50, bwd u0 50..70, all-reduce 70..74
    assert r.step_s == pytest.approx(74 * MS)
    assert "recompute u0" in _names(r, "compute")
    # plain peak at the end of forward: 8008 + both activations 200 = 8208
    assert plain.peak_bytes == 8208
    # recompute: the block keeps its 40-byte input instead of its 100 bytes of activations; at the
    # end of forward 8008 + 40 + 100 (u1) = 8148; at the recomputation 8008 + 40 + 100 (u0 again,
    # u1's freed by its backward) = 8148
    assert r.peak_bytes == 8148
    assert r.breakdown["activations (incl. the loss)"] == 140


def test_accumulating_over_micro_batches_holds_local_gradients_until_the_synchronising_one():
    sim = Simulator(PROFILE_BLOCKS, STRUCTURE, COMM, world_size=2)
    r = sim.run(_replicated(grad_accum_steps=2))
    # micro-batch 0 (no_sync): 20 forward + 40 backward, no reduction; micro-batch 1 the same and
    # the all-reduce (4): 124 ms
    assert r.step_s == pytest.approx(124 * MS)
    assert r.reductions == 1
    # micro-batch 0's gradients (2 x 1000) are held until micro-batch 1 copies them into the bucket,
    # and micro-batch 1's gradient of a parameter is a new tensor until autograd adds it into the
    # held one: peak when u1's backward ends (its activations freed): 8008 + 2000 held + 100 (u0's
    # activations) + 1000 (u1's new gradient) = 11108, above the end of forward (8008 + 2000 + 200)
    assert r.peak_bytes == 11108


def test_sharded_accumulation_reduces_every_micro_batch_and_holds_no_full_gradient():
    sim = Simulator(PROFILE_BLOCKS, STRUCTURE, COMM, world_size=2)

    def plan(mode):
        return Plan(
            world_size=2,
            units=[UnitPlan("u0", ["u0.w"], "shard", "after_backward", mode), UnitPlan("u1", ["u1.w"], "shard", "after_backward", mode)],
            gather_groups=[GatherGroup(["u0"]), GatherGroup(["u1"])],
            buckets=[Bucket(["u1.w"], "reduce_scatter"), Bucket(["u0.w"], "reduce_scatter")],
            grad_accum_steps=3,
        )

    once, every = sim.run(plan("unsharded")), sim.run(plan("sharded"))
    assert once.reductions == 2 and every.reductions == 6
    # unsharded accumulation holds both full gradients (2 x 1000) from micro-batch 0 to the last one:
    # peak in the last backward when u1's reduce-scatter input (1008) is allocated: static 3000 +
    # gathered 2 x 1000 + held gradients 2000 + u0's activations 100 + 1008 = 8108
    assert once.peak_bytes == 8108 and once.breakdown["gradients (buckets, unreduced, accumulated)"] == 2000
    # sharded accumulation holds no full gradient across micro-batches: its peak is u0's copy-in in
    # a later micro-batch: static 3000 + u0 gathered 1000 + u1's reduction in flight (input 1008,
    # output 504, its accumulated output saved while overwritten 504) + u0's accumulated output 504
    # + u0's fresh gradient 1000 while it is copied into its new input 1008
    assert every.peak_bytes == 3000 + 1000 + (1008 + 504 + 504) + 504 + (1000 + 1008)
    assert every.breakdown["gradients (buckets, unreduced, accumulated)"] == 504 + 504 + 504 + 1000


def test_a_program_is_timed_alone():
    """The timeline (autodist/cost/sim/execute.py) on a hand-written program: 10 ms of compute, an
    all-gather of 2 ms issued with a 50-byte staging buffer and 100 bytes gathered, 1 ms of compute
    beside it, a wait, the gathered bytes freed. Compute runs 1.5 times slower beside the gather and
    the gather 2 times slower beside compute; a blocked wait costs 1 ms."""
    from autodist.cost.sim.execute import execute
    from autodist.cost.sim.program import COMPUTE, GATHERED, ISSUE, MEM, WAIT, CommOp

    comm = replace(COMM, compute_slowdown=1.5, comm_slowdown=2.0, blocked_wait_s=1 * MS)
    prog = [(COMPUTE, 10 * MS, "a", 0), (MEM, 100, GATHERED), (ISSUE, 0), (COMPUTE, 1 * MS, "b", 0), (WAIT, 0),
            (MEM, -100, GATHERED)]
    ops = [CommOp("all_gather", "g", 1000, 2 * MS, 50)]
    r = execute(prog, ops, [0] * 7, comm=comm, sensitivity=1.0, budget=140, record=True)
    # "b" takes 1.5 ms beside the gather, which does 0.75 ms of its 2 in that time; the wait runs the
    # remaining 1.25 ms at full speed (12.75 ms), then stands the step still for 1 ms
    assert r.step_s == pytest.approx(13.75 * MS)
    assert r.compute_s == pytest.approx(11 * MS) and r.exposed_comm_s == pytest.approx(2.75 * MS)
    assert [(e.stream, e.name) for e in r.events] == [("compute", "a"), ("compute", "b"), ("comm", "all_gather g")]
    assert r.events[2].start == pytest.approx(10 * MS) and r.events[2].end == pytest.approx(12.75 * MS)
    # the staging buffer is held from the issue to the gather's completion, beside the gathered bytes
    assert r.peak_bytes == 150 and not r.feasible
    assert r.breakdown["gathered full parameters"] == 100 and r.breakdown["communication buffers in flight"] == 50


def test_an_asynchronous_device_runs_the_host_and_the_compute_stream_on_clocks_of_their_own():
    """[Note: two clocks on an asynchronous device]: compute instructions with host-only seconds and
    an issue time, on a device whose kernels run apart from the host, against the same program on a
    synchronous one (a CPU: every instruction's seconds in turn, the extra fields ignored)."""
    from autodist.cost.sim.execute import execute
    from autodist.cost.sim.program import COMPUTE, ISSUE, WAIT, CommOp

    prog = [
        (COMPUTE, 3 * MS, "a", 0, 1 * MS, 1 * MS),  # 1 ms of hooks, 1 ms issuing 2 ms of kernels
        (ISSUE, 0),  # a 4 ms all-reduce
        (COMPUTE, 10 * MS, "b", 0, 0.0, 1 * MS),
        (COMPUTE, 5 * MS, "hooks", 0, 5 * MS, 0.0),  # the host's alone
        (WAIT, 0),
        (COMPUTE, 1 * MS, "c", 0, 0.0, 6 * MS),  # issuing it takes the host longer than running it
    ]

    def run(asynchronous):
        ops = [CommOp("all_reduce", "r", 1000, 4 * MS, 0)]
        return execute(prog, ops, [0] * 7, comm=COMM, sensitivity=1.0, budget=None, record=True,
                       asynchronous=asynchronous)

    gpu = run(True)
    # host: a's hooks 0..1 and its issue 1..2, b 2..3, hooks 3..8, c 8..14. Device: idle until the
    # host issues a (1 ms waiting for the host), a's 2 ms 1..3; the all-reduce, issued at 2, starts
    # when the stream has done a, 3..7, beside b 3..13; the wait finds it done; c, issued from 8,
    # runs 13..14, as the host issues the last of it
    assert gpu.step_s == pytest.approx(14 * MS)
    assert gpu.compute_s == pytest.approx(13 * MS) and gpu.host_s == pytest.approx(14 * MS)
    assert gpu.host_bound_s == pytest.approx(1 * MS) and gpu.exposed_comm_s == pytest.approx(0.0)
    comm_event = next(e for e in gpu.events if e.stream == "comm")
    assert (comm_event.start, comm_event.end) == (pytest.approx(3 * MS), pytest.approx(7 * MS))
    host = [(e.name, round(e.start / MS, 6), round(e.end / MS, 6)) for e in gpu.events if e.stream == "host"]
    assert host == [("a", 0, 2), ("b", 2, 3), ("hooks", 3, 8), ("c", 8, 14)]
    cpu = run(False)
    # one clock: a 0..3, the all-reduce 3..7 beside b 3..13, hooks 13..18, c 18..19
    assert cpu.step_s == pytest.approx(19 * MS) and cpu.compute_s == pytest.approx(19 * MS)
    assert cpu.host_s == 0.0 and not [e for e in cpu.events if e.stream == "host"]


def test_on_an_asynchronous_device_what_the_host_has_not_issued_does_not_run_and_its_last_work_is_not_communication():
    """A segment with no issue time of its own (the loss, after the hooks) starts no earlier than the
    host's clock; the host's work after the stream's last ends the step, and counts as the
    device waiting for the host, not as exposed communication."""
    from autodist.cost.sim.execute import execute
    from autodist.cost.sim.program import COMPUTE

    def run(prog):
        return execute(prog, [], [0] * 7, comm=COMM, sensitivity=1.0, budget=None, record=False, asynchronous=True)

    # hooks 0..5 on the host; the loss then runs 5..7 on the device
    r = run([(COMPUTE, 5 * MS, "hooks", 0, 5 * MS, 0.0), (COMPUTE, 2 * MS, "loss", 0)])
    assert r.step_s == pytest.approx(7 * MS) and r.host_bound_s == pytest.approx(5 * MS)
    # the optimizer: issued 0..1 on the host, its 2 ms of kernels 0..2 on the device; then 3 ms of
    # bookkeeping on the host, 1..4: a 4 ms step, the last 2 ms of it the host's alone
    r = run([(COMPUTE, 2 * MS, "optimizer", 0, 0.0, 1 * MS), (COMPUTE, 3 * MS, "gather bookkeeping", 0, 3 * MS, 0.0)])
    assert r.step_s == pytest.approx(4 * MS) and r.exposed_comm_s == pytest.approx(0.0)
    assert r.host_bound_s == pytest.approx(2 * MS)


def test_on_an_asynchronous_device_a_collective_starts_when_the_host_issues_it_and_a_wait_holds_the_stream_only():
    from autodist.cost.sim.execute import execute
    from autodist.cost.sim.program import COMPUTE, ISSUE, WAIT, CommOp

    prog = [(COMPUTE, 1 * MS, "a", 0, 0.0, 5 * MS), (ISSUE, 0), (WAIT, 0), (COMPUTE, 1 * MS, "b", 0, 0.0, 1 * MS)]
    ops = [CommOp("all_reduce", "r", 1000, 4 * MS, 0)]
    r = execute(prog, ops, [0] * 7, comm=COMM, sensitivity=1.0, budget=None, record=True, asynchronous=True)
    # host: a 0..5, b 5..6. Device: a 0..1, idle to 5 (waiting for the host); the all-reduce 5..9,
    # issued at 5; the stream waits for it; b, issued at 5, runs 9..10. The host never waited.
    assert ops[0].start == pytest.approx(5 * MS) and ops[0].end == pytest.approx(9 * MS)
    assert r.step_s == pytest.approx(10 * MS) and r.host_s == pytest.approx(6 * MS)
    assert r.host_bound_s == pytest.approx(4 * MS) and r.exposed_comm_s == pytest.approx(4 * MS)


def test_on_a_gpu_the_runtimes_host_work_hides_under_the_devices_compute():
    """What a bucket costs the host (its bookkeeping and launch, ``per_bucket_s``) lengthens a CPU
    step by as much, and a GPU step not at all while the device is the slower clock (measured on one
    H100: a bf16 GPT whose plan was searched with the bucket's cost on the device's timeline ran
    27.8 ms against 23.9 for the plan it was predicted to beat: docs/fidelity.md, "Version 17")."""
    plan = Plan(
        world_size=2,
        units=[UnitPlan("u0", ["u0.w"], "replicate"), UnitPlan("u1", ["u1.w"], "replicate")],
        gather_groups=[],
        buckets=[Bucket(["u1.w"], "all_reduce"), Bucket(["u0.w"], "all_reduce")],
    )
    costly = replace(COMM, overhead={"per_bucket_s": 2 * MS})
    issued = [replace(u, fwd_host_s=1 * MS, bwd_host_s=1 * MS) for u in PROFILE.units]

    def step(device, comm):
        return Simulator(replace(PROFILE, units=issued, device=device), STRUCTURE, comm, world_size=2).run(plan).step_s

    # CPU: forward 20; u1's backward 20..40, its bucket 2 ms, all-reduce 42..46 beside u0's
    # backward 42..62, its bucket 2 ms, all-reduce 64..68, waited for: 68 (64 without the cost)
    assert step("cpu", costly) == pytest.approx(68 * MS) and step("cpu", COMM) == pytest.approx(64 * MS)
    # GPU: the host issues each unit in 1 ms and does each bucket's 2 ms while the device computes:
    # the all-reduces run 40..44 and 60..64, whatever the bucket costs the host
    assert step("cuda", costly) == pytest.approx(64 * MS) and step("cuda", COMM) == pytest.approx(64 * MS)
    # by phase, each the longer of the stream's work and the host's: the backward's 40 ms of kernels
    # against the host's 2 ms of issue and 4 of buckets; a host issuing each forward in 15 ms
    # makes the forward its 30
    gpu = Simulator(replace(PROFILE, units=issued, device="cuda"), STRUCTURE, costly, world_size=2)
    assert gpu.phase_seconds(plan) == pytest.approx({"forward": 20 * MS, "backward": 40 * MS, "optimizer": 0.0})
    slow_host = [replace(u, fwd_host_s=15 * MS) for u in issued]
    gpu = Simulator(replace(PROFILE, units=slow_host, device="cuda"), STRUCTURE, costly, world_size=2)
    assert gpu.phase_seconds(plan)["forward"] == pytest.approx(30 * MS)
