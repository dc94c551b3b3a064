"""The comm model: fitting, and the sweep on the real process group."""

import json
import math
import os

import pytest
import torch
import torch.distributed as dist

from autodist.cost.comm import CommModel, fit_op
from autodist.cost.fidelity import DEFAULT_CPU_BLOCKED_WAIT_S, DEFAULT_CPU_WAIT_SCALE
from autodist.measure.sweep import COLLECTIVES, sweep


def test_two_piece_fit_recovers_a_known_curve():
    # latency-bound below 1 MiB, bandwidth-bound above, with +-5% deterministic "noise"
    sizes = [2**k for k in range(12, 26)]
    truth = [(x, (50e-6 + x * 1e-10) if x < 2**20 else (x * 1e-9 + 20e-6)) for x in sizes]
    noisy = [(x, t * (1.05 if i % 2 else 0.95)) for i, (x, t) in enumerate(truth)]
    model = fit_op(noisy)
    assert model.split_bytes < 2**21 and model.split_bytes > 2**19
    for x, t in truth:
        assert abs(model(x) - t) / t < 0.10


def test_single_line_when_one_fits():
    pts = [(float(x), 1e-4 + x * 2e-10) for x in (1e3, 1e4, 1e5, 1e6, 1e7)]
    model = fit_op(pts)
    assert model.small == model.large
    assert abs(model(5e5) - (1e-4 + 5e5 * 2e-10)) < 1e-9


def test_a_larger_message_never_takes_less_time_and_the_pieces_join_between_their_samples():
    """[Note: joining the pieces] An all-gather swept on the development host: the large-message
    piece, fitted to 256 KiB and up, read 141 us at 256 KiB while the small piece read 201 us at
    128 KiB; evaluated between the pieces' samples the model now follows the line joining them."""
    samples = [(16384.0, 80e-6), (65536.0, 132e-6), (262144.0, 158e-6), (1048576.0, 447e-6), (4194304.0, 2132e-6),
               (16777216.0, 8076e-6)]
    model = fit_op(samples)
    assert model.small != model.large  # two pieces: the case where they must be joined
    sizes = sorted({2.0**k for k in range(10, 27)} | {1.5 * 2.0**k for k in range(10, 26)} | {x for x, _ in samples})
    times = [model(x) for x in sizes]
    assert all(b >= a for a, b in zip(times, times[1:])), [(x, t) for x, t in zip(sizes, times)]
    lo = max(x for x, _ in samples if x <= model.split_bytes)
    hi = min(x for x, _ in samples if x > model.split_bytes)
    mid = (lo + hi) / 2
    assert model(mid) == pytest.approx((model(lo) + model(hi)) / 2)
    for x, t in samples:  # still the measurement's fit
        assert abs(model(x) - t) / t < 0.25
    # a stored model evaluates the same after a round trip (the join is derived, not stored)
    stored = CommModel("gloo", 2, "cpu", {"all_gather": model})
    again = CommModel.from_json(stored.to_json()).ops["all_gather"]
    assert [again(x) for x in sizes] == times


def _sweep():
    return sweep(dist.group.WORLD, torch.device("cpu")).to_json()


def test_sweep_is_identical_on_every_rank_and_is_the_fit_of_its_own_samples(world2):
    """The sweep on the real process group: what load cannot change. How well the fits follow
    their samples on a given host, and how long the sweep takes, are figures of the host, measured
    by ``tools/sweepcheck.py`` (its ``fit`` table); the fitting itself is tested on known curves
    above."""
    texts = world2.run(_sweep)
    assert texts[0] == texts[1]
    model = CommModel.from_json(texts[0])
    assert model.world_size == 2 and model.backend == "gloo"
    assert set(model.ops) == {"all_reduce", "all_gather", "reduce_scatter", "h2d", "d2h"}
    for op, om in model.ops.items():  # each op's model is the fit of the samples it keeps, in size order
        assert len(om.samples) >= 2 and [x for x, _ in om.samples] == sorted(x for x, _ in om.samples)
        assert all(t > 0 for _, t in om.samples) and fit_op(list(om.samples)) == om, op
    assert model.meta["sweep_seconds"] > 0
    assert model.compute_slowdown >= 1.0 and model.comm_slowdown >= 1.0
    assert json.loads(texts[0])["transient"]["all_gather"] > 0  # gloo stages all-gather output
    # on its worker threads, two collectives at a time per group (tests/test_metrics.py measures it)
    assert model.workers == 2
    # the compute thread's own share of each collective, measured at every size, and fitted
    assert set(model.host) == {"all_reduce", "all_gather", "reduce_scatter"}
    for op, fit in model.host.items():
        assert len(fit.samples) == len(model.ops[op].samples) and all(t > 0 for _, t in fit.samples)
        assert model.host_time(op, 1 << 20) > 0
    # contention at every measured size: compute slowdown, comm slowdown, slowdown while compute waits
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        rows = model.contention[op]
        assert [r[0] for r in rows] == sorted(r[0] for r in rows) and all(len(r) == 4 for r in rows)
        assert all(min(r[1:]) >= 1.0 for r in rows)
    # a CPU sweep carries the machine class's wait calibration (autodist/cost/fidelity.py)
    assert (model.wait_scale, model.blocked_wait_s) == (DEFAULT_CPU_WAIT_SCALE, DEFAULT_CPU_BLOCKED_WAIT_S)
    assert model.meta["passes"] == 1 and model.meta["pass_spread"] == 0  # AUTODIST_SWEEP_PASSES=1 (tests/conftest.py)
    # a copy is timed whole: on the CPU it runs inside the call (schema 6, which timed only the
    # call's return, read a 16 MiB copy at 8 us). Load only slows a copy, so a bound below holds on
    # any host: 16 MiB read and written cannot take less than at 400 GB/s (84 us), more than one
    # thread copies even within its caches
    for op in ("d2h", "h2d"):
        assert model.time(op, 16 << 20) > 2 * (16 << 20) / 400e9, (op, model.time(op, 16 << 20))
    # fresh memory costs its page faults at every size measured from the mmap threshold up (glibc's
    # threshold stops rising at 32 MiB): a new 64 MiB tensor's pages are zeroed by the kernel first
    from autodist.measure.sweep import FIRST_TOUCH_MIB

    assert [b for b, _ in model.first_touch] == [float(mib << 20) for mib in FIRST_TOUCH_MIB]
    assert model.first_touch_s(64 << 20) > 0, model.first_touch


def _runtime_overhead(mesh_size, fail_on=None):
    """``measure_runtime_overhead`` on meshes of ``mesh_size`` ranks (the job's own group when it is
    every rank), the child process failing on rank ``fail_on``: (figures, warnings logged)."""
    import logging
    from dataclasses import astuple

    from autodist.measure import overhead
    from autodist.runtime.comm import Comm

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("autodist").addHandler(handler)
    group = None if mesh_size == dist.get_world_size() else dist.new_subgroups(group_size=mesh_size)[0]
    comm = Comm(group)
    real = overhead._in_a_child
    if dist.get_rank() == fail_on:
        overhead._in_a_child = lambda device: ("no interpreter (forced by the test)", [])
    try:
        figures = astuple(overhead.measure_runtime_overhead(torch.device("cpu"), comm))
    finally:
        overhead._in_a_child = real
        logging.getLogger("autodist").removeHandler(handler)
        comm.destroy()
        if group is not None:
            dist.destroy_process_group(group)
    return figures, warnings


def _sane(figures):
    """Figures a measurement gives on any host, however loaded (load only makes them larger):
    a unit costs something, the rest nothing less than nothing; the per-parameter figure is taken
    between models of hundreds of parameters ([Note: the per-parameter cost at a model's scale])."""
    from autodist.measure.overhead import WIDE_UNITS

    per_unit, per_gather, per_bucket, per_tensor, per_param, per_step, per_grouped_unit, per_param_at = figures
    return all(math.isfinite(f) for f in figures) and per_unit > 0 and min(
        per_gather, per_bucket, per_tensor, per_param, per_step, per_grouped_unit) >= 0 and per_param_at == 2 * WIDE_UNITS


def test_the_runtime_overhead_over_the_whole_job_is_measured_on_one_rank_groups(world2):
    (fig0, warned0), (fig1, warned1) = world2.run(_runtime_overhead, 2, timeout=300)
    assert fig0 == fig1 and _sane(fig0), (fig0, fig1)  # the slowest rank's figures, on every rank
    assert not warned0 and not warned1


def test_the_runtime_overhead_on_a_smaller_mesh_comes_from_a_child_or_on_every_rank_of_the_mesh_without_it(world4):
    # [Note: a one-rank world of its own]: meshes [0, 1] and [2, 3] measure at once, without any
    # group made over the job; the child fails on rank 1 only, and both ranks of its mesh measure on
    # the mesh's groups instead (a rank that went on alone would wait in the other's collectives)
    results = world4.run(_runtime_overhead, 2, 1, timeout=300)
    (fig0, warned0), (fig1, warned1), (fig2, warned2), (fig3, warned3) = results
    assert fig0 == fig1 and fig2 == fig3 and _sane(fig0) and _sane(fig2), results
    assert not warned2 and not warned3
    assert "forced by the test" in warned1[0] and "on another rank" in warned0[0], (warned0, warned1)


def test_a_sweep_in_passes_keeps_each_figure_s_median_so_one_pass_read_high_is_left_out():
    from autodist.measure.sweep import _combine, _Pass, _pass_spread

    def one(scale, wait, spread):
        samples = {"all_gather": [(1024.0, 1e-4 * scale), (4096.0, 2e-4 * scale)]}
        host = {"all_gather": [(1024.0, 1e-5 * scale), (4096.0, 1e-5 * scale)]}
        return _Pass(samples, host, {"all_gather": [[1024.0, 1.2, 3.0 * scale, wait], [4096.0, 1.1, 2.0, wait]]}, spread,
                     [[float(32 << 20), 0.01 * scale], [float(64 << 20), 0.02 * scale]])

    passes = [one(1.0, 1.5, 1.2), one(1.5, 2.7, 1.9), one(1.1, 1.6, 1.3)]  # the second read high throughout
    c = _combine(passes)
    assert c.samples == {"all_gather": [(1024.0, pytest.approx(1.1e-4)), (4096.0, pytest.approx(2.2e-4))]}
    assert c.host_samples["all_gather"][0] == (1024.0, pytest.approx(1.1e-5))
    assert c.contention == {"all_gather": [[1024.0, 1.2, pytest.approx(3.3), 1.6], [4096.0, 1.1, 2.0, 1.6]]}
    assert c.spread == 1.3
    assert c.first_touch == [[float(32 << 20), pytest.approx(0.011)], [float(64 << 20), pytest.approx(0.022)]]
    # how far the passes disagreed, the median over the eight figures: three at 0.5/1.1 (the two
    # times, the 1 KiB comm slowdown), two at 1.2/1.6 (the waits), three at 0
    assert _pass_spread(passes) == pytest.approx(0.5 / 1.1)
    assert _pass_spread(passes[:1]) == 0 and _combine(passes[:1]).contention == passes[0].contention


def test_a_third_pass_measures_again_only_what_the_first_two_disagree_on_and_the_median_keeps_every_pass():
    from autodist.measure.sweep import PASSES_AGREE, _combine, _Pass, _unsettled

    def one(small, large, wait, touch):
        samples = {"all_gather": [(1024.0, small), (4096.0, 2e-4)], "h2d": [(1024.0, 1e-5)]}
        host = {"all_gather": [(1024.0, 1e-5), (4096.0, 1e-5)]}
        return _Pass(samples, host, {"reduce_scatter": [[1024.0, 1.2, large, wait]]}, 1.0, [[float(32 << 20), touch]])

    first, second = one(1e-4, 3.0, 1.5, 0.010), one(1e-4 * (1 + PASSES_AGREE / 2), 3.0, 1.5 * (1 + 2 * PASSES_AGREE), 0.010)
    # the 1 KiB all-gather agrees within the margin, the reduce-scatter's wait figure does not
    assert _unsettled([first, second]) == {("reduce_scatter", 1024.0)}
    assert _unsettled([first, one(1e-4, 3.0, 1.5, 0.02)]) == {("first_touch", 0.0)}
    # a third pass of the one unsettled figure: it alone gets a median of three
    third = _Pass({}, {}, {"reduce_scatter": [[1024.0, 1.3, 3.3, 1.6]]}, 2.0, [])
    c = _combine([first, second, third])
    assert c.contention == {"reduce_scatter": [[1024.0, 1.2, 3.0, 1.6]]}
    assert c.samples["all_gather"][0] == (1024.0, pytest.approx(1e-4 * (1 + PASSES_AGREE / 4)))
    assert c.first_touch == [[float(32 << 20), 0.010]] and c.spread == 1.0


def test_the_sweep_s_passes_come_from_the_environment_with_a_clear_error_for_a_bad_value(monkeypatch):
    from autodist.measure.sweep import SWEEP_PASSES, sweep_passes

    monkeypatch.delenv("AUTODIST_SWEEP_PASSES", raising=False)
    assert sweep_passes() == SWEEP_PASSES == 3
    monkeypatch.setenv("AUTODIST_SWEEP_PASSES", "2")
    assert sweep_passes() == 2
    for bad in ("0", "three", "-1"):
        monkeypatch.setenv("AUTODIST_SWEEP_PASSES", bad)
        with pytest.raises(ValueError, match=f"AUTODIST_SWEEP_PASSES='{bad}'.*at least 1"):
            sweep_passes()


def _passes_with_rank1_environment(value):
    from autodist.measure.sweep import agreed_passes

    saved = os.environ.get("AUTODIST_SWEEP_PASSES")
    if dist.get_rank() == 1:
        os.environ["AUTODIST_SWEEP_PASSES"] = value
    try:
        return agreed_passes(None, dist.group.WORLD, torch.device("cpu"))
    except ValueError as e:
        return str(e)
    finally:
        if saved is None:
            os.environ.pop("AUTODIST_SWEEP_PASSES", None)
        else:
            os.environ["AUTODIST_SWEEP_PASSES"] = saved


def test_every_rank_refuses_sweep_passes_that_differ_between_ranks_or_are_bad_on_one(world2):
    # each rank reads its own environment (a variable set on one node only); a rank that took more
    # passes would wait in collectives the others never issue, so every rank raises instead
    assert world2.run(_passes_with_rank1_environment, "1") == [1, 1]  # tests/conftest.py sets 1
    differ = world2.run(_passes_with_rank1_environment, "2")
    assert all(isinstance(m, str) and "1 to 2 comm sweep passes" in m and "same on every node" in m for m in differ)
    bad = world2.run(_passes_with_rank1_environment, "three")
    assert "AUTODIST_SWEEP_PASSES='three'" in bad[1] and "at least 1" in bad[1]
    assert "not a whole number of at least 1 on another rank" in bad[0]


def test_contention_is_interpolated_in_log_size_between_measured_sizes():
    from autodist.cost.comm import OpModel, Piece

    flat = OpModel(Piece(0.0, 1e-3), Piece(0.0, 1e-3), float("inf"))
    m = CommModel(
        "gloo", 2, "cpu", {"all_gather": flat}, compute_slowdown=1.5, comm_slowdown=1.25,
        contention={"all_gather": [[1 << 20, 2.0, 3.0], [16 << 20, 1.0, 1.5]]},
    )
    # rows without the slowdown while compute waits (not measured) run at full speed then
    assert m.slowdowns("all_gather", 1 << 10) == (2.0, 3.0, 1.0)  # below the smallest: the smallest
    assert m.slowdowns("all_gather", 64 << 20) == (1.0, 1.5, 1.0)  # above the largest: the largest
    assert m.slowdowns("all_gather") == (1.0, 1.5, 1.0)
    # 4 MiB is halfway between 1 and 16 MiB in log size
    assert m.slowdowns("all_gather", 4 << 20) == pytest.approx((1.5, 2.25, 1.0))
    assert m.slowdowns("reduce_scatter", 4 << 20) == (1.5, 1.25, 1.0)  # not measured: the global factors
    assert CommModel.from_json(m.to_json()).slowdowns("all_gather", 4 << 20) == pytest.approx((1.5, 2.25, 1.0))
    m.contention["all_gather"] = [[1 << 20, 2.0, 3.0, 2.0], [16 << 20, 1.0, 1.5, 1.0]]
    assert m.slowdowns("all_gather", 4 << 20) == pytest.approx((1.5, 2.25, 1.5))


def test_the_wait_scale_multiplies_only_the_slowdown_of_small_messages_while_compute_waits_and_never_below_full_speed():
    from dataclasses import replace

    from autodist.cost.comm import WAIT_SCALED_BELOW_BYTES, OpModel, Piece

    flat = OpModel(Piece(0.0, 1e-3), Piece(0.0, 1e-3), float("inf"))
    m = CommModel(
        "gloo", 2, "cpu", {"all_gather": flat}, compute_slowdown=1.5, comm_slowdown=1.25,
        contention={"all_gather": [[1 << 20, 2.0, 3.0, 2.0], [16 << 20, 1.0, 1.5, 1.2], [64 << 20, 1.0, 1.5, 1.0]]},
        wait_scale=1.5,
    )
    assert WAIT_SCALED_BELOW_BYTES == 16 << 20
    assert m.slowdowns("all_gather", 1 << 20) == (2.0, 3.0, 3.0)
    assert m.slowdowns("all_gather", 16 << 20) == (1.0, 1.5, 1.2)  # a large message: the sweep's own figure
    assert m.slowdowns("all_gather", 4 << 20) == pytest.approx((1.5, 2.25, 2.1))  # scaled below, then interpolated
    assert m.slowdowns("all_gather") == (1.0, 1.5, 1.0)
    # rows as a sweep on 3 ranks writes them: each size padded down to a multiple of the world size
    padded = replace(m, contention={"all_gather": [[r[0] // 12 * 12, *r[1:]] for r in m.contention["all_gather"]]})
    assert padded.contention["all_gather"][1][0] < 16 << 20
    assert padded.slowdowns("all_gather", 16 << 20) == pytest.approx((1.0, 1.5, 1.2))
    assert m.slowdowns("reduce_scatter", 1 << 20) == (1.5, 1.25, 1.5)  # not measured: full speed, scaled ...
    assert m.slowdowns("reduce_scatter", 16 << 20) == (1.5, 1.25, 1.0)  # ... below 16 MiB
    assert m.slowdowns("reduce_scatter") == (1.5, 1.25, 1.0)
    # a scale below 1 cannot make a collective faster than alone
    assert replace(m, wait_scale=0.4).slowdowns("all_gather", 1 << 20) == (2.0, 3.0, 1.0)
    again = CommModel.from_json(m.to_json())
    assert again.wait_scale == 1.5 and again.slowdowns("all_gather", 4 << 20) == m.slowdowns("all_gather", 4 << 20)
    for bad in (0, -1.5, float("inf"), "1.6", True):
        with pytest.raises(ValueError, match="wait_scale"):
            CommModel.from_dict(dict(json.loads(m.to_json()), wait_scale=bad))
    # the blocked-wait time: seconds, 0 or more ([Note: what a blocked wait costs] in cost/sim/execute.py)
    assert CommModel.from_json(replace(m, blocked_wait_s=4e-4).to_json()).blocked_wait_s == 4e-4
    for bad in (-1e-4, float("inf"), float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="blocked_wait_s"):
            CommModel.from_dict(dict(json.loads(m.to_json()), blocked_wait_s=bad))
    from autodist.cost.comm import COMM_SCHEMA_VERSION, comm_model_of_another_checkout

    # a model of an earlier schema, read by the tools that re-predict records, takes the calibration
    # it is given where it has none, and keeps the one it carries
    schema9 = {k: v for k, v in json.loads(m.to_json()).items() if k != "blocked_wait_s"}
    schema9["schema_version"] = 9
    read = comm_model_of_another_checkout(schema9, wait_scale=2.0, blocked_wait_s=3e-4)
    assert (read.wait_scale, read.blocked_wait_s) == (1.5, 3e-4)

    older = json.loads(m.to_json())
    older["schema_version"] = 4  # measured before the calibration existed: measured again, not read as 1
    with pytest.raises(ValueError, match=f"schema_version 4 is not {COMM_SCHEMA_VERSION}"):
        CommModel.from_dict(older)
    older["schema_version"] = 5  # one pass ([Note: a sweep in passes]): measured again too
    with pytest.raises(ValueError, match=f"schema_version 5 is not {COMM_SCHEMA_VERSION}"):
        CommModel.from_dict(older)


def _trains_of_different_lengths():
    """Each rank asks for a train of a different length; both must issue the same collectives."""
    from autodist.measure.sweep import collective_train

    start = collective_train(dist.group.WORLD, torch.device("cpu"))
    stop = start(0.001 if dist.get_rank() == 0 else 0.05)
    stop()
    t = torch.ones(1)
    dist.all_reduce(t)  # the group still pairs collectives: no leftover from the train
    return t.item()


def test_a_collective_train_is_the_same_on_every_rank_whatever_each_asks(world2):
    assert world2.run(_trains_of_different_lengths) == [2.0, 2.0]


def test_a_train_is_sized_at_its_all_reduces_rate_beside_the_pass_once_one_outlasted_it():
    """[Note: a train as long as its pass], with injected timings: first TRAIN_COVER times the pass
    at the all-reduces' time alone; then at their measured rate beside a pass, for the longest pass."""
    from autodist.measure.sweep import TRAIN_COVER, train_length

    assert TRAIN_COVER == 1.5
    assert train_length(0.25, 0.0625) == 6  # 1.5 x 0.25 s at 62.5 ms each, alone
    # beside a pass, 125 ms each; the pass ran 2x its time alone: 1.5 x 0.5 s / 125 ms
    assert train_length(0.25, 0.0625, (0.125, 2.0)) == 6
    assert train_length(0.25, 0.0625, (0.0625, 1.5)) == 9
    assert train_length(0.25, 0.0625, (0.0625, 0.5)) == 6  # a pass never counts as shorter than alone
    assert train_length(1e-6, 0.01) == 1 and train_length(0.25, 0.0) == 375000  # at least one; a zero time guarded


class _Clock:
    """A clock for :func:`~autodist.measure.contention.contended_slowdown` (its ``clock``): the passes a
    test fakes advance it by the seconds they stand for, so the rounds' figures are exact, whatever
    else the machine runs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def spend(self, seconds):
        self.now += seconds


def _contention_with_a_disturbed_rank():
    """Rank 1's second contended pass is twice as long as its others (a disturbed host), rank 0's
    are steady: rank 1 alone would take more rounds, each with trains the other rank must join."""
    import itertools

    from autodist.measure.contention import contended_slowdown
    from autodist.measure.sweep import collective_train

    train = collective_train(dist.group.WORLD, torch.device("cpu"))
    clock, busy = _Clock(), [False]
    slow = itertools.chain([0.004, 0.008], itertools.repeat(0.004)) if dist.get_rank() == 1 else itertools.repeat(0.004)

    def train_backward():
        clock.spend(next(slow) if busy[0] else 0.002)

    def reference():
        clock.spend(0.004 if busy[0] else 0.002)

    def contention(seconds):
        stop = train(seconds)  # a real train of collectives, which both ranks must issue alike
        busy[0] = True

        def done():
            busy[0] = False
            stop()

        return done

    got = contended_slowdown(train_backward, contention, torch.device("cpu"), reference=reference,
                             agree=train.largest, clock=clock)
    t = torch.ones(1)
    dist.all_reduce(t)  # the ranks still pair their collectives: none left over from a train
    return got.rounds, got.sensitivity, got.stopped_by, t.item()


def test_every_rank_takes_as_many_contention_rounds_as_the_most_disturbed_one(world2):
    from autodist.measure.contention import CONTENDED_MAX_ROUNDS, CONTENDED_REL_SE
    from autodist.measure.robust import relative_se

    # rank 0's ratios are 1, 1, 1 (settled at the fewest rounds); rank 1's 1, 2, 1, 1, ...: settled
    # once enough agreeing rounds outvote the second
    ratios = [1.0, 2.0] + [1.0] * CONTENDED_MAX_ROUNDS
    expected = next(n for n in range(3, CONTENDED_MAX_ROUNDS + 1) if relative_se(ratios[:n], median=True) <= CONTENDED_REL_SE)
    assert expected > 3
    (rounds0, sens0, why0, t0), (rounds1, sens1, why1, t1) = world2.run(_contention_with_a_disturbed_rank)
    assert (rounds0, rounds1, t0, t1) == (expected, expected, 2.0, 2.0)
    assert (sens0, sens1, why0, why1) == (1.0, 1.0, "settled", "settled")


def test_the_model_s_contended_slowdown_and_its_sensitivity_are_taken_against_the_reference_under_the_same_train():
    from autodist.measure.contention import CONTENDED_MAX_ROUNDS, CONTENDED_MIN_ROUNDS, contended_slowdown

    clock, busy = _Clock(), [False]
    calls = []

    def train_backward():  # 2 ms alone, 5 ms while the train runs
        calls.append(("model", busy[0]))
        clock.spend(0.005 if busy[0] else 0.002)

    def reference():  # 2 ms alone, 4 ms while the train runs
        calls.append(("reference", busy[0]))
        clock.spend(0.004 if busy[0] else 0.002)

    def contention(seconds):
        assert seconds == pytest.approx(0.002)  # sized from a pass measured first
        busy[0] = True

        def stop():
            busy[0] = False

        return stop

    got = contended_slowdown(train_backward, contention, torch.device("cpu"), reference=reference, clock=clock)
    assert got.slowdown == pytest.approx(2.5)
    assert got.sensitivity == pytest.approx(1.25)  # 2.5 against the reference's 2.0
    assert got.rounds == CONTENDED_MIN_ROUNDS == 3 and got.spread == pytest.approx(0, abs=1e-9)  # steady rounds: the fewest
    model, ref = [("model", False), ("model", True)], [("reference", False), ("reference", True)]
    # one pass to size the train, then each alone and under its own train, which goes first alternating
    assert calls == [("model", False)] + model + ref + ref + model + model + ref
    # a train that slows neither: both figures 1, in the fewest rounds
    assert CONTENDED_MIN_ROUNDS < CONTENDED_MAX_ROUNDS
    quiet = contended_slowdown(lambda: clock.spend(0.002), lambda s: (lambda: None), torch.device("cpu"),
                               reference=lambda: clock.spend(0.003), clock=clock)
    assert quiet.rounds == CONTENDED_MIN_ROUNDS and (quiet.slowdown, quiet.sensitivity, quiet.spread) == pytest.approx((1.0, 1.0, 0), abs=1e-9)


def test_contended_rounds_go_on_until_the_sensitivity_s_standard_error_is_within_its_bound():
    """[Note: repeating until the estimate is known]: with injected pass times, the rounds stop at
    the first count whose ratios' median has a standard error within CONTENDED_REL_SE of it (never
    before CONTENDED_MIN_ROUNDS), and a host whose rounds keep spreading takes the most."""
    import itertools

    from autodist.measure.contention import (
        CONTENDED_MAX_ROUNDS,
        CONTENDED_MIN_ROUNDS,
        CONTENDED_REL_SE,
        contended_slowdown,
    )
    from autodist.measure.robust import relative_se

    def measured(contended_model_s, **kw):
        clock, busy = _Clock(), [False]
        slow = iter(contended_model_s)

        def train_backward():
            clock.spend(next(slow) if busy[0] else 0.002)

        def contention(seconds):
            busy[0] = True
            return lambda: busy.__setitem__(0, False)

        return contended_slowdown(train_backward, contention, torch.device("cpu"), reference=lambda: clock.spend(0.002),
                                  clock=clock, **kw)

    # ratios 2, 4, 2, 2, 2, ... (the reference is not slowed): the second round apart keeps it going
    # until enough agreeing rounds bring the median's standard error within the bound
    ratios = [2.0, 4.0] + [2.0] * 20
    expected = next(n for n in range(CONTENDED_MIN_ROUNDS, len(ratios)) if relative_se(ratios[:n], median=True) <= CONTENDED_REL_SE)
    assert CONTENDED_MIN_ROUNDS < expected < CONTENDED_MAX_ROUNDS
    apart = measured([0.002 * r for r in ratios])
    assert apart.rounds == expected and apart.sensitivity == pytest.approx(2.0)
    # 2, 2.2, 2.1: their median's standard error is within the bound at the fewest rounds
    assert relative_se([2.0, 2.2, 2.1], median=True) <= CONTENDED_REL_SE
    steady = measured(itertools.chain([0.004, 0.0044, 0.0042], itertools.repeat(0.03)))
    assert steady.rounds == CONTENDED_MIN_ROUNDS and steady.sensitivity == pytest.approx(2.1)
    # ratios that alternate 1 and 4 could not settle in the rounds left even if every further one
    # agreed: they stop at the fewest, unsettled ([Note: stopping rounds that cannot settle])
    spread = measured(itertools.cycle([0.002, 0.008]), max_rounds=7)
    assert (spread.rounds, spread.stopped_by, spread.settled) == (CONTENDED_MIN_ROUNDS, "hopeless", False)
    assert spread.sensitivity == pytest.approx(1.0)
    assert (apart.stopped_by, steady.stopped_by) == ("settled", "settled")
    # an agree() that reports another rank's larger standard error (and a best case of its own that
    # can still settle) keeps this rank measuring as long: agree is called with the standard error,
    # the elapsed time and the best case, in that order, each round past the fewest
    figures = itertools.cycle([lambda x: max(x, 0.5), lambda x: x, lambda x: x])
    held = measured(itertools.repeat(0.004), max_rounds=6, agree=lambda x: next(figures)(x))
    assert (held.rounds, held.stopped_by) == (6, "rounds")


def test_contended_rounds_stop_unsettled_once_their_time_is_up():
    """Rounds that keep spreading stop at the first round that ends past ``max_seconds`` (never
    before the fewest), reported unsettled; the time is agreed like the spread (the largest over
    the ranks), so a rank whose own rounds were quick stops with the slow one."""
    import itertools

    from autodist.measure.contention import CONTENDED_MIN_ROUNDS, contended_slowdown

    def measured(model_alone_s, **kw):
        clock, busy = _Clock(), [False]
        slow = itertools.cycle([1.0, 4.0])  # ratios 1 and 4 in turn: never settled

        def train_backward():
            clock.spend(model_alone_s * (next(slow) if busy[0] else 1.0))

        def contention(seconds):
            busy[0] = True
            return lambda: busy.__setitem__(0, False)

        return contended_slowdown(train_backward, contention, torch.device("cpu"), reference=lambda: clock.spend(model_alone_s),
                                  clock=clock, **kw)

    # a round: the model alone and under the train (1 or 4 times as long), the reference alone and
    # under it (not slowed): with passes of 0.2 s the rounds take 0.8 and 1.4 s in turn and end at
    # 0.8, 2.2 and 3.0 s: past 2 s, but never before the fewest rounds
    got = measured(0.2, max_seconds=2.0)
    assert (got.settled, got.rounds, got.stopped_by) == (False, CONTENDED_MIN_ROUNDS, "time")
    # a quick rank held by a slow one's elapsed time (agree: the largest over the ranks)
    held = measured(0.001, max_seconds=6.0, max_rounds=8, agree=lambda x: max(x, 7.0))
    assert (held.rounds, held.stopped_by) == (CONTENDED_MIN_ROUNDS, "time")


def test_rounds_that_cannot_settle_in_the_rounds_left_stop():
    """[Note: stopping rounds that cannot settle]: the best case supposes every round to come reads
    the median; the rounds to come are those that begin within the time at the rounds' mean
    duration, and within max_rounds."""
    from autodist.measure.contention import CONTENDED_REL_SE, best_case_se, rounds_within
    from autodist.measure.robust import relative_se

    assert rounds_within(3, 3.0, 6.0, 15) == 6  # rounds of 1 s: three more begin at 3, 4 and 5 s
    assert rounds_within(3, 3.3, 6.0, 15) == 6 and rounds_within(3, 2.9, 6.0, 15) == 7
    assert rounds_within(3, 0.003, 6.0, 15) == 15 and rounds_within(3, 7.0, 6.0, 15) == 3
    # the best over one value read by every further round: no worse than the median's or the mean's
    for padded in ([2.0, 4.0, 2.0, 2.0, 2.0, 2.0], [2.0, 4.0, 2.0] + [8.0 / 3] * 3):
        assert best_case_se([2.0, 4.0, 2.0], 6) <= relative_se(padded, median=True) + 1e-12
    assert best_case_se([2.0, 4.0, 2.0], 2) == pytest.approx(relative_se([2.0, 4.0, 2.0], median=True))
    # 2, 4, 2 can still settle in fifteen rounds, not in six
    assert best_case_se([2.0, 4.0, 2.0], 15) <= CONTENDED_REL_SE < best_case_se([2.0, 4.0, 2.0], 6)
    # 2.0, 2.78, 1.81 then 2.2 twice settle in five rounds (padding with their median, 2.0, would not)
    settled = relative_se([2.0, 2.78, 1.81, 2.2, 2.2], median=True)
    assert settled <= CONTENDED_REL_SE < relative_se([2.0, 2.78, 1.81, 2.0, 2.0], median=True)
    assert best_case_se([2.0, 2.78, 1.81], 5) <= settled


def test_relative_standard_error_of_a_mean_and_of_a_median():
    import math

    from autodist.measure.robust import MEDIAN_SE_FACTOR, relative_se

    assert relative_se([3.0]) == math.inf and relative_se([]) == math.inf
    assert relative_se([2.0, 2.0, 2.0]) == 0.0
    # sd 1, n 4, mean 2.5: 0.5 / 2.5
    values = [1.0, 2.0, 3.0, 4.0]
    sd = math.sqrt(sum((v - 2.5) ** 2 for v in values) / 3)
    assert relative_se(values) == pytest.approx(sd / 2 / 2.5)
    assert relative_se(values, median=True) == pytest.approx(sd / 2 * MEDIAN_SE_FACTOR / 2.5)


def test_a_contention_measurement_whose_rounds_cannot_settle_stops_and_keeps_their_median():
    import itertools

    from autodist.measure.contention import contended_slowdown

    clock, busy = _Clock(), [False]
    # the model's contended pass alternates 2 ms and 8 ms (a disturbed host), the reference's is 4 ms;
    # alone both take 2 ms: round ratios 1 / 2 and 4 / 2 in turn
    slow = itertools.cycle([0.002, 0.008])

    def train_backward():
        clock.spend(next(slow) if busy[0] else 0.002)

    def reference():
        clock.spend(0.004 if busy[0] else 0.002)

    def contention(seconds):
        busy[0] = True
        return lambda: busy.__setitem__(0, False)

    got = contended_slowdown(train_backward, contention, torch.device("cpu"), max_rounds=9, reference=reference,
                             clock=clock)
    # rounds 0.5, 2, 0.5 could not settle in nine even if the rest agreed: the fewest, their median
    assert (got.rounds, got.stopped_by) == (3, "hopeless") and got.spread == pytest.approx(3.0)
    assert got.sensitivity == pytest.approx(0.5)  # two of three at 0.5
    assert got.slowdown == pytest.approx(1.0)  # the model's own: 1, 4, 1


def _contention_rounds_per_cell(seconds_per_round: float = 0.0):
    """The sweep's contention loop with each round's figures given (``_contention_round`` replaced):
    a small all-reduce steady on both ranks, a 1 MiB all-gather steady on rank 0 and not on rank 1,
    a 4 MiB reduce-scatter whose rounds spread a little on both, and a 64 MiB all-reduce (its
    rounds fewer whatever they read). ``seconds_per_round``: what each round advances the clock the
    loop reads its time from. Returns the rounds each cell took and the rows."""
    import itertools

    import autodist.measure.sweep as measure_sweep

    rank = dist.get_rank()
    taken = {}
    figures = {
        "steady": itertools.repeat((2.0, 3.0, 1.5)),
        "one rank apart": itertools.cycle([(2.0, 3.0, 1.5)] if rank == 0 else [(2.0, 3.0, 1.5), (2.0, 6.0, 1.5)]),
        "a little apart": itertools.cycle([(2.0, 3.0, 1.5), (2.0, 4.5, 1.5)]),
        "long": itertools.repeat((1.2, 1.1, 1.0)),
    }

    now = [0.0]

    def fake_round(issue, t_op, k, one, work_q, group, device, collect_s):
        taken[issue] = taken.get(issue, 0) + 1
        now[0] += seconds_per_round
        return next(figures[issue])

    real = measure_sweep._contention_round
    measure_sweep._contention_round = fake_round
    try:
        cells = [("all_reduce", 64 << 10, "steady"), ("all_gather", 1 << 20, "one rank apart"),
                 ("reduce_scatter", 4 << 20, "a little apart"), ("all_reduce", 64 << 20, "long")]
        rows, rounds = measure_sweep._contention(
            dist.group.WORLD, torch.device("cpu"), {op: (lambda n: 1e-3) for op in ("all_reduce", "all_gather", "reduce_scatter")},
            {}, cells, clock=lambda: now[0])
    finally:
        measure_sweep._contention_round = real
    assert rounds == sum(taken.values())
    return [taken[c[2]] for c in cells], rows


def test_contention_rounds_begin_no_more_once_their_time_is_up(world2):
    """[Note: contention rounds within a time], with injected figures and a clock each round
    advances: past the fewest rounds, the first round count whose rounds have taken
    CONTENTION_MAX_SECONDS ends every cell, on both ranks alike; the cells keep the rounds they have."""
    from autodist.measure.sweep import CONTENTION_MAX_SECONDS, CONTENTION_MIN_ROUNDS

    # four cells a round (then three: the steady one settles at the fewest), a second each: past
    # the fewest rounds (3 x 4 = 12 s) the time is up at once
    per_round = CONTENTION_MAX_SECONDS / 8
    (taken0, rows0), (taken1, rows1) = world2.run(_contention_rounds_per_cell, per_round)
    assert taken0 == taken1 == [CONTENTION_MIN_ROUNDS] * 4
    assert rows0 == rows1 and rows0["all_reduce"][0] == [float(64 << 10), 2.0, 3.0, 1.5]
    # rounds quick enough leave the spread alone to decide (the test below)
    (quick0, _), _ = world2.run(_contention_rounds_per_cell, 1e-6)
    assert quick0[1] > CONTENTION_MIN_ROUNDS


def test_contention_cells_take_rounds_until_their_figures_are_known_on_every_rank(world2):
    """[Note: contention rounds until the figures are known], with injected figures: a cell stops at
    the first round count (CONTENTION_MIN_ROUNDS at least) where every figure's standard error is
    within CONTENTION_REL_SE of it on every rank, at CONTENTION_MAX_ROUNDS (fewer at 64 MiB) at most."""
    from autodist.measure.sweep import (
        CONTENTION_LONG_ROUNDS,
        CONTENTION_MAX_ROUNDS,
        CONTENTION_MIN_ROUNDS,
        CONTENTION_REL_SE,
        rounds_uncertainty,
    )

    def rounds_until_known(figures):
        return next((n for n in range(CONTENTION_MIN_ROUNDS, CONTENTION_MAX_ROUNDS)
                     if rounds_uncertainty(figures[:n]) <= CONTENTION_REL_SE), CONTENTION_MAX_ROUNDS)

    a_little = [(2.0, 3.0, 1.5), (2.0, 4.5, 1.5)] * 10
    (taken0, rows0), (taken1, rows1) = world2.run(_contention_rounds_per_cell)
    # rank 1's all-gather rounds read 3.0 and 6.0 in turn and never settle: both ranks measure it to the end;
    # the reduce-scatter's 3.0 and 4.5 settle after a few rounds (more than the fewest)
    assert CONTENTION_MIN_ROUNDS < rounds_until_known(a_little) < CONTENTION_MAX_ROUNDS
    assert rounds_until_known([(2.0, 3.0, 1.5), (2.0, 6.0, 1.5)] * 10) == CONTENTION_MAX_ROUNDS
    assert taken0 == taken1 == [CONTENTION_MIN_ROUNDS, CONTENTION_MAX_ROUNDS, rounds_until_known(a_little), CONTENTION_LONG_ROUNDS]
    assert rows0 == rows1  # the slowest rank's figures
    assert rows0["all_reduce"][0] == [float(64 << 10), 2.0, 3.0, 1.5]
    # rank 1's 3.0, 6.0, ... over 8 rounds, trimmed of one 3.0 and one 6.0
    assert rows0["all_gather"][0][2] == pytest.approx((3 * 3.0 + 3 * 6.0) / 6)


def test_sweepcheck_tells_how_far_the_comm_models_move_each_plan_s_prediction():
    """tools/sweepcheck.py: the committed deep-mlp simcheck record's plans, predicted from its own
    comm model twice (nothing moves), then beside a copy whose all-gathers and reduce-scatters are
    twice as slow while the compute thread waits — which moves the sharded plans, whose units wait
    on them, and not ddp, which issues neither. A comm model of an older schema (another
    checkout's) is read with this one's fields."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("sweepcheck_tool", root / "tools" / "sweepcheck.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    record = root / "benchmarks" / "simcheck-deep-mlp.json"
    data = json.loads(record.read_text())
    comm = data["comm_model"]
    same = tool.spreads([str(record)], [json.dumps(comm), json.dumps(comm)])["deep-mlp"]
    assert same["max_pct_apart"] == 0.0 and len(same["plans"]) == len(data["plans"])
    slower = json.loads(json.dumps(comm))
    for kind in ("all_gather", "reduce_scatter"):
        for r in slower["contention"][kind]:
            r[3] *= 2
    slower["schema_version"] = 3  # measured by an older checkout
    moved = {p["plan"]: p for p in tool.spreads([str(record)], [json.dumps(comm), json.dumps(slower)])["deep-mlp"]["plans"]}
    fsdp = moved["fsdp"]
    assert fsdp["predicted_step_s"][1] > fsdp["predicted_step_s"][0]
    assert fsdp["pct_apart"] > 5 and moved["ddp"]["pct_apart"] == 0.0
    # each sweep's own figures, which the test suite leaves to the tool: its seconds and how far its
    # fits lie from their samples (the fit of a sample taken as the model's own value: 0%)
    figures = tool.fit_figures(json.dumps(comm))
    model = CommModel.from_json(json.dumps(comm))
    assert figures["sweep_seconds"] == comm["meta"]["sweep_seconds"] > 0
    assert set(figures["worst_fit_pct"]) == set(model.ops)
    om = model.ops["all_gather"]
    assert figures["worst_fit_pct"]["all_gather"] == pytest.approx(100 * max(abs(om(x) - t) / t for x, t in om.samples))
    exact = json.loads(json.dumps(comm))
    exact["ops"]["all_gather"]["samples"] = [[x, om(x)] for x, _ in om.samples]
    assert tool.fit_figures(json.dumps(exact))["worst_fit_pct"]["all_gather"] == pytest.approx(0, abs=1e-9)
    text = tool.table({"sweeps": 1, "by_checkout": {"this": {"deep-mlp": same}}, "fit": {"this": [figures]}})
    assert "furthest sample" in text and f"{figures['sweep_seconds']:.1f}" in text
    unknown = dict(comm, schema_version=2)  # fields this checkout does not know: refused, by name
    with pytest.raises(SystemExit, match="schema version 2"):
        tool.spreads([str(record)], [json.dumps(unknown)])


def test_contention_figures_are_the_mean_of_their_middle_rounds_and_the_largest_messages_get_three():
    from autodist.measure.robust import trimmed_mean
    from autodist.measure.sweep import CONTENTION_MAX_ROUNDS, contention_rounds

    assert trimmed_mean([5.0, 1.0, 2.0, 3.0, 100.0]) == pytest.approx(10 / 3)  # one disturbed round either way left out
    assert trimmed_mean([4.0, 1.0, 9.0]) == 4.0  # three rounds: their median
    assert trimmed_mean([1.0, 2.0]) == 1.5 and trimmed_mean([7.0]) == 7.0
    assert CONTENTION_MAX_ROUNDS == 8
    assert [contention_rounds(n) for n in (64 << 10, 16 << 20, 64 << 20, 256 << 20)] == [8, 8, 3, 3]


# ---- what plan="auto" measures: what the model's plans can issue, and only what is missing ----------


def _mlp(widths, frozen_first):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    if frozen_first:
        layers[0].requires_grad_(False)
    return torch.nn.Sequential(*layers)


def _launch_and_read_comm(cache_dir, widths, frozen_first=True, batch=4):
    """``plan="auto"`` with example inputs of ``batch`` rows on ``cache_dir`` (another batch: no
    cached plan, so the comm model is looked up): (sweeps taken, the stored comm model's JSON, the
    messages logged)."""
    import logging

    from autodist import AutoDist
    from autodist.planner.cache import Cache

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep(level=logging.INFO)
    log = logging.getLogger("autodist")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        x = torch.randn(batch, widths[0], generator=torch.Generator().manual_seed(dist.get_rank()))
        m = AutoDist(_mlp(widths, frozen_first), plan="auto", example_inputs=(x,), cache_dir=cache_dir)
        sweeps = m._auto.stats.sweeps
        m.close()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    dist.barrier()
    [entry] = [e for e in Cache(cache_dir).entries() if e.kind == "comm"]
    return sweeps, entry.path.read_text(), seen


def _measured(text):
    return json.loads(text)["meta"]["measured"]


def _grown_and_damaged(cache_dir):
    """A partly frozen small model, then a larger one on the same cache, then the stored entry damaged
    in two parts, then wholly unreadable: what each launch measured and said."""
    out = {"small": _launch_and_read_comm(cache_dir, [16, 32, 8])}
    out["larger"] = _launch_and_read_comm(cache_dir, [64, 256, 256, 64], frozen_first=False)
    out["again"] = _launch_and_read_comm(cache_dir, [64, 256, 256, 64], frozen_first=False, batch=5)
    from autodist.planner.cache import Cache

    [entry] = [e for e in Cache(cache_dir).entries() if e.kind == "comm"]
    if dist.get_rank() == 0:
        d = json.loads(entry.path.read_text())
        d["ops"]["all_gather"]["samples"][1][1] = "NaN"  # one sample of one collective unreadable
        d["contention"]["reduce_scatter"][0] = [1.0, 2.0]  # one contention row of another
        d["meta"]["contention_measured"]["reduce_scatter"][0] = "a row"
        entry.path.write_text(json.dumps(d))
    dist.barrier()
    out["damaged"] = _launch_and_read_comm(cache_dir, [64, 256, 256, 64], frozen_first=False, batch=6)
    if dist.get_rank() == 0:
        entry.path.write_text(entry.path.read_text()[:300])
    dist.barrier()
    out["unreadable"] = _launch_and_read_comm(cache_dir, [16, 32, 8], batch=7)
    return out


@pytest.mark.sweeps
def test_plan_auto_measures_only_what_the_model_can_issue_then_only_what_a_later_model_or_a_damaged_entry_lacks(world2, tmp_path):
    from autodist.sched.search import SearchConfig

    out = world2.run(_grown_and_damaged, str(tmp_path), timeout=900)[0]  # rank 0 logs
    # a partly frozen model training 1 KiB of parameters (4 KiB in all): the two smallest sizes of each
    # collective, contention at the smallest size, no first-touch figures (its messages stay far below
    # the mmap threshold); host copies up to its parameters' bytes
    sweeps, text, said = out["small"]
    small = CommModel.from_json(text)
    assert sweeps == 1 and _measured(text) == {
        "timings": {op: [16384, 65536] for op in ("all_reduce", "all_gather", "reduce_scatter", "d2h", "h2d")},
        "contention": {op: [65536] for op in ("all_reduce", "all_gather", "reduce_scatter")},
    }
    assert small.first_touch == [] and [r[0] for r in small.contention["all_gather"]] == [65536.0]
    [up_front] = [s for s in said if "measuring the communication cost model" in s]
    assert "all-gather, all-reduce, reduce-scatter and host copies, 16 KiB to 64 KiB" in up_front and "about " in up_front
    # ... after the launch's own, which says what it measures and the search's bound, before any of it
    [first] = [i for i, s in enumerate(said) if "no cached plan for this model and input" in s]
    assert first < said.index(up_front) and "taking this machine's comm model" in said[first], said[first]
    assert f"searching (at most {SearchConfig().time_budget_s:.0f} s)" in said[first]
    # a model of 350 KiB trained: the sizes up to 1 MiB it adds, contention up to 256 KiB (350 KiB lies
    # within twice that: [Note: contention up to what the model sends]), and nothing measured before
    sweeps, text, _ = out["larger"]
    larger = CommModel.from_json(text)
    assert _measured(text) == {
        "timings": {op: [262144, 1048576] for op in ("all_reduce", "all_gather", "reduce_scatter", "d2h", "h2d")},
        "contention": {op: [262144] for op in ("all_reduce", "all_gather", "reduce_scatter")},
    }
    from autodist.measure.sweep import _monotone

    for op, fit in small.ops.items():  # what the first launch measured is kept (no message cheaper than a smaller one)
        added = larger.ops[op].samples[2:]
        assert [x for x, _ in added] == [262144.0, 1048576.0], op
        assert larger.ops[op].samples == (_monotone(fit.samples + added) if op in ("d2h", "h2d", *COLLECTIVES) else None), op
    assert [r[0] for r in larger.meta["contention_measured"]["all_gather"]] == [65536.0, 262144.0]
    assert larger.meta["contention_measured"]["all_gather"][0] == small.meta["contention_measured"]["all_gather"][0]
    # the same model again: nothing to measure
    assert out["again"][0] == 0 and out["again"][1] == text
    # two parts damaged: only they are measured again, the warning says how long that takes
    sweeps, text, said = out["damaged"]
    assert sweeps == 1 and _measured(text) == {"timings": {"all_gather": [65536]}, "contention": {"reduce_scatter": [65536]}}
    [warned] = [s for s in said if "partly corrupt" in s]
    assert "it will be replaced" in warned and "only all-gather and reduce-scatter, 64 KiB measured again" in warned
    assert "about " in warned and " s " in warned, warned
    repaired = CommModel.from_json(text)
    assert repaired.ops["all_reduce"].samples == larger.ops["all_reduce"].samples
    assert len(repaired.ops["all_gather"].samples) == 4
    # wholly unreadable: reported with the whole measurement's estimate, and measured again
    sweeps, text, said = out["unreadable"]
    [warned] = [s for s in said if "it will be replaced" in s]
    assert "measuring all-gather, all-reduce, reduce-scatter and host copies, 16 KiB to 64 KiB (about " in warned, warned
    assert sweeps == 1 and not [s for s in said if "measuring the communication cost model" in s]  # said once


def test_the_sweep_plan_follows_the_model_s_largest_messages_and_estimates_from_its_rates():
    from autodist.measure.sweep import (
        CONTENTION_LONG_ROUNDS,
        CONTENTION_MAX_ROUNDS,
        CONTENTION_MIN_ROUNDS,
        CommNeeds,
        contention_sizes,
        plan_sweep,
    )

    everything = plan_sweep(CommNeeds.everything(), None, 2)
    assert everything.timings["all_reduce"] == [16 << 10 << 2 * i for i in range(6)]
    assert everything.contention["all_gather"] == [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    assert everything.first_touch and everything.overhead
    # nothing reduced: no all-reduce or reduce-scatter; gathers up to 20 MiB, timed up to 16 MiB (the
    # grid's largest), contention up to 16 MiB: 20 MiB lies within twice that ([Note: contention up
    # to what the model sends])
    plan = plan_sweep(CommNeeds({"all_gather": 20 << 20, "d2h": 20 << 20, "h2d": 20 << 20}), None, 2)
    assert set(plan.timings) == {"all_gather", "d2h", "h2d"} and set(plan.contention) == {"all_gather"}
    assert plan.timings["all_gather"][-1] == 16 << 20 and plan.contention["all_gather"][-1] == 16 << 20
    # beyond twice the largest size below, the next size is measured too
    assert contention_sizes(40 << 20)[-2:] == [16 << 20, 64 << 20]
    assert contention_sizes(5 << 20) == [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    assert contention_sizes(1000) == [64 << 10] and contention_sizes(64 << 10) == [64 << 10]
    assert contention_sizes(200 << 10) == [64 << 10, 256 << 10]
    # one rank: copies only
    assert set(plan_sweep(CommNeeds.everything(), None, 1).timings) == {"d2h", "h2d"}
    # the estimate: (timed samples x passes) x their rate + contention rounds (once) x theirs + the
    # overhead; at most every pass and every round, at least two passes and the fewest rounds
    rates = {"timing_s": 0.5, "contention_round_s": 2.0, "overhead_s": 3.0}
    most = 3 * (5 * CONTENTION_MAX_ROUNDS + CONTENTION_LONG_ROUNDS)
    fewest = 3 * (5 * CONTENTION_MIN_ROUNDS + min(CONTENTION_MIN_ROUNDS, CONTENTION_LONG_ROUNDS))
    assert everything.estimate_seconds(3, rates) == pytest.approx(3 * 30 * 0.5 + most * 2.0 + 3.0)
    assert everything.estimate_seconds(3, rates, fewest=True) == pytest.approx(2 * 30 * 0.5 + fewest * 2.0 + 3.0)
    assert everything.estimate_seconds(1, rates, fewest=True) == pytest.approx(30 * 0.5 + fewest * 2.0 + 3.0)


def test_a_stored_model_without_a_runtime_figure_has_the_overhead_measured_again():
    from dataclasses import fields, replace

    from autodist.measure.overhead import RuntimeOverhead
    from autodist.measure.sweep import CommNeeds, plan_sweep

    needs = CommNeeds({"all_gather": 1 << 20})
    samples = [(2.0**k, 1e-4 + 1e-9 * 2.0**k) for k in range(10, 22)]
    stored = CommModel("gloo", 2, "cpu", {"all_gather": fit_op(samples)}, overhead={f.name: 1e-5 for f in fields(RuntimeOverhead)})
    assert not plan_sweep(needs, stored, 2).overhead
    older = dict(stored.overhead)
    del older["per_grouped_unit_s"]  # measured before groups were hooked at their root
    assert plan_sweep(needs, replace(stored, overhead=older), 2).overhead


def _launches_from_a_seed(root):
    """Three fresh caches beside one seed (``AUTODIST_COMM_SEED``), and a fourth holding an entry of
    its own: what each launch swept, and the seed's entry after each."""
    from comm_seed import set_seed

    from autodist.cost.comm import CommModel as Model
    from autodist.planner.cache import Cache
    from autodist.planner.keys import comm_cache_key

    key = comm_cache_key(dist.get_world_size(), "cpu", "cpu", "gloo")
    seed = os.path.join(root, "seed")

    def seeded():
        path = Cache(seed).path("comm", key)
        return path.read_text() if path.exists() else None

    set_seed(seed)
    try:
        out = {}
        for name, widths in (("first", [16, 32, 8]), ("same", [16, 32, 8]), ("larger", [64, 256, 256, 64])):
            sweeps, text, _ = _launch_and_read_comm(os.path.join(root, name), widths)
            out[name] = (sweeps, text, seeded())
        own = os.path.join(root, "own")
        if dist.get_rank() == 0:
            Cache(own).put("comm", key, Model.analytic(2, bandwidth_bytes_s=1e9, latency_s=1e-4, backend="gloo").to_json())
        dist.barrier()
        sweeps, text, _ = _launch_and_read_comm(own, [16, 32, 8])
        out["own"] = (sweeps, text, seeded())
        return out
    finally:
        set_seed(None)


@pytest.mark.sweeps
def test_a_fresh_cache_starts_from_the_seed_and_what_it_measures_beyond_it_is_added_to_the_seed(world2, tmp_path):
    out = world2.run(_launches_from_a_seed, str(tmp_path), timeout=900)[0]
    sweeps, text, seed = out["first"]
    assert sweeps == 1 and seed == text  # nothing in the seed: measured, stored in both
    sweeps, text, seed = out["same"]
    assert sweeps == 0 and text == seed == out["first"][1]  # another fresh cache: the seed's, copied in
    sweeps, text, seed = out["larger"]
    assert sweeps == 1 and seed == text and _measured(text)["timings"]["all_reduce"] == [262144, 1048576]
    sweeps, text, seed = out["own"]  # a cache's own entry is used, and never written to the seed
    assert seed == out["larger"][2] and CommModel.from_json(text).meta.get("source") == "analytic"


def test_a_contention_train_after_the_first_round_lasts_no_longer_than_its_bound_at_the_measured_slowdown():
    from autodist.measure.sweep import CONTENTION_MAX_CALLS, CONTENTION_TRAIN_S, train_calls

    assert train_calls(0.33e-3) == CONTENTION_MAX_CALLS and train_calls(0.05) == 1  # base time alone
    assert train_calls(0.33e-3, 10.0) == CONTENTION_MAX_CALLS  # 24 x 3.3 ms: within the bound, as before
    slow = 200.0  # a busy host: 24 calls would take 1.6 s
    k = train_calls(0.33e-3, slow)
    assert k * 0.33e-3 * slow >= CONTENTION_TRAIN_S > (k - 1) * 0.33e-3 * slow
    assert train_calls(0.33e-3, 1e6) == 3 and train_calls(0.05, 30.0) == 1  # never under 3, never over the base count
