"""Per-step metrics: ``metrics()`` describes the last completed step, ``log_every`` logs every N steps
and the last one, and nothing stays registered after ``close()``."""

import logging
import weakref

import pytest
import torch
import torch.optim.optimizer as optim_hooks

import models
from autodist import AutoDist


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(steps, *, log_every=None, micro_batches=1, close=True, memory_limit=None, plan="ddp"):
    lines = _Lines()
    log = logging.getLogger("autodist")
    old_level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(lines)
    try:
        model = AutoDist(models.make("mlp"), plan=plan, log_every=log_every, memory_limit=memory_limit)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        seen = []
        for _ in range(steps):
            for i in range(micro_batches):
                x, y = models.batch("mlp", 4, torch.Generator().manual_seed(i))
                if i < micro_batches - 1:
                    with model.no_sync():
                        models.loss_fn("mlp", model(x), y).backward()
                else:
                    models.loss_fn("mlp", model(x), y).backward()
            opt.step()
            opt.zero_grad()
            seen.append(model.metrics().get("step"))
        if close:
            model.close()
    finally:
        log.removeHandler(lines)
        log.setLevel(old_level)
    step_lines = [line.split("  ")[0] for line in lines.lines if line.startswith("autodist: step ")]
    warnings = [line for line in lines.lines if "above the budget" in line]
    full_lines = [line for line in lines.lines if line.startswith("autodist: step ")]
    return {"seen": seen, "metrics": model.metrics(), "logged": step_lines, "warnings": warnings, "lines": full_lines}


def test_metrics_describe_the_step_that_just_ended(world2):
    for r in world2.run(_train, 6):
        assert r["seen"] == [1, 2, 3, 4, 5, 6]
        assert r["metrics"]["samples_per_second"] > 0 and r["metrics"]["reductions"] >= 1


def test_a_step_spans_its_accumulated_micro_batches(world2):
    one, three = world2.run(_train, 2)[0], world2.run(_train, 2, micro_batches=3)[0]
    assert three["seen"] == [1, 2]
    # three micro-batches of 4 samples on each of 2 ranks in one step
    assert three["metrics"]["samples_per_second"] * three["metrics"]["step_seconds"] == pytest.approx(24)
    assert one["metrics"]["samples_per_second"] * one["metrics"]["step_seconds"] == pytest.approx(8)


def test_log_every_logs_every_nth_step_and_the_last_at_close(world2):
    rank0, rank1 = world2.run(_train, 7, log_every=3)
    assert rank0["logged"] == ["autodist: step 3", "autodist: step 6", "autodist: step 7"]
    assert rank1["logged"] == []


def test_a_run_shorter_than_log_every_logs_its_last_step(world2):
    assert world2.run(_train, 2, log_every=5)[0]["logged"] == ["autodist: step 2"]


def test_the_last_step_is_not_logged_twice(world2):
    assert world2.run(_train, 4, log_every=2)[0]["logged"] == ["autodist: step 2", "autodist: step 4"]


def _hooks_after_close():
    before = len(optim_hooks._global_optimizer_post_hooks)
    model = AutoDist(models.make("mlp"), plan="ddp")
    during = len(optim_hooks._global_optimizer_post_hooks)
    model.close()
    return before, during, len(optim_hooks._global_optimizer_post_hooks)


def test_close_leaves_no_optimizer_hook_behind(world2):
    for before, during, after in world2.run(_hooks_after_close):
        assert during == before + 1
        assert after == before


def _hooks_after_dropping_unclosed_models():
    import gc

    before = len(optim_hooks._global_optimizer_post_hooks)
    engines = []
    for _ in range(3):
        model = AutoDist(models.make("mlp"), plan="ddp")
        engines.append(weakref.ref(model.runtime))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = models.batch("mlp", 4, torch.Generator().manual_seed(0))
        for _ in range(2):
            models.loss_fn("mlp", model(x), y).backward()
            opt.step()
            opt.zero_grad()
        del model, opt  # never closed
        gc.collect()
    return before, len(optim_hooks._global_optimizer_post_hooks), sum(e() is not None for e in engines)


def test_a_model_dropped_without_close_is_freed_with_its_optimizer_hooks(world2):
    # [Note: a model dropped without close()]: the step meter's finalizer kept the wrapper alive, and
    # the gradient hooks the runtime (the process-wide optimizer hooks with it)
    for before, after, alive in world2.run(_hooks_after_dropping_unclosed_models):
        assert (after, alive) == (before, 0)


def _optimizer_of_another_model():
    model = AutoDist(models.make("mlp"), plan="ddp")
    other = torch.nn.Linear(2, 2)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = models.batch("mlp", 4, torch.Generator().manual_seed(0))
    models.loss_fn("mlp", model(x), y).backward()
    other(torch.ones(1, 2)).sum().backward()
    other_opt.step()
    after_other = model.metrics().get("step")
    opt.step()
    after_own = model.metrics().get("step")
    model.close()
    return after_other, after_own


def test_only_an_optimizer_over_the_models_parameters_ends_its_step(world2):
    for after_other, after_own in world2.run(_optimizer_of_another_model):
        assert (after_other, after_own) == (None, 1)


# ---- memory: tensor memory against the budget, resident memory under its own name ----------------
MLP_PARAM_BYTES = sum(p.numel() * 4 for p in models.make("mlp").parameters())


def test_peak_memory_is_the_models_tensor_memory_not_the_resident_set(world2):
    for r in world2.run(_train, 4, log_every=2):
        m = r["metrics"]
        # parameters, gradients and SGD's momentum at least; far below what the process has resident
        assert 3 * MLP_PARAM_BYTES <= m["peak_bytes"] < 1 << 20 < m["resident_bytes"]
        assert (m["peak_step"], m["peak_scope"], m["host_state_bytes"]) == (4, "step", 0)
        assert m["budget_fraction"] == pytest.approx(m["peak_bytes"] / m["budget_bytes"])
    line = world2.run(_train, 4, log_every=2)[0]["lines"][-1]
    assert "  peak tensors " in line and " of budget)  resident " in line


def test_a_measured_peak_above_the_budget_warns_once_with_both_figures(world2):
    for rank, r in enumerate(world2.run(_train, 6, memory_limit="1KB", log_every=100)):
        assert len(r["warnings"]) == 1, r["warnings"]
        assert f"at step 1 on rank {rank} is above the budget 1000 B" in r["warnings"][0]
        peak = r["warnings"][0].split("measured peak tensor memory ")[1].split(" at step")[0]
        assert peak.endswith("KiB") and float(peak.split()[0]) > 3 * MLP_PARAM_BYTES / 1024


def test_a_peak_within_the_budget_does_not_warn(world2):
    assert [r["warnings"] for r in world2.run(_train, 3, memory_limit="100MB", log_every=100)] == [[], []]


def _profiler_started_mid_step():
    model = AutoDist(models.make("mlp"), plan="ddp")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = models.batch("mlp", 4, torch.Generator().manual_seed(0))
    for _ in range(3):
        loss = models.loss_fn("mlp", model(x), y)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            loss.backward()
            opt.step()
        opt.zero_grad()
    peak = model.metrics()["peak_bytes"]
    model.close()
    return peak


def test_without_log_every_the_cpu_runs_no_profiler_of_its_own(world2):
    # a profiler session of AutoDist's own would make the user's, entered mid-step, fail to start
    assert world2.run(_profiler_started_mid_step) == [None, None]


def _high_water_mark_kept():
    from autodist.measure.memory import _status_bytes

    big = torch.ones(64 << 20)  # 256 MiB resident, then freed: the process's high-water mark
    del big
    before = _status_bytes("VmHWM")
    _train(3)
    return before, _status_bytes("VmHWM")


def test_the_process_peak_statistics_are_not_reset_by_training(world2):
    for before, after in world2.run(_high_water_mark_kept):
        assert after >= before


def test_the_allocators_peak_counter_is_reset_only_when_per_step_figures_are_asked_for(monkeypatch):
    from autodist.metrics import StepMeter
    from autodist.runtime.comm import CommStats

    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 7 << 20)
    counts = {}
    for log_every in (None, 5):
        meter = StepMeter(CommStats(), torch.device("cuda", 0), 1 << 30, 1, 0, log_every)
        before = len(resets)
        for _ in range(3):
            meter.on_forward((torch.zeros(2, 3),), {}, sync=True)
            meter.on_optimizer_step(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
        counts[log_every] = len(resets) - before
        scope = meter.as_dict()["peak_scope"]
        assert meter.as_dict()["peak_bytes"] == 7 << 20 and scope == ("process" if log_every is None else "step")
    assert counts == {None: 0, 5: 3}


def _signals():
    """Events between the ranks, through the job's store: ``signal(name)`` on one rank releases
    ``wait_for(name)`` on another (which consumes it, so the next signal of that name is a new one)."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.PrefixStore("tests/test_metrics", dist.distributed_c10d._get_default_store())

    def signal(name: str) -> None:
        store.set(name, "1")

    def wait_for(name: str) -> None:
        store.wait([name], timedelta(seconds=600))  # a guard against a hang only, as the pool's own
        store.delete_key(name)

    return signal, wait_for


def _backend_threads() -> dict[int, tuple[str, str, int]]:
    """This process's threads: (name, state, voluntary context switches) by thread id (Linux)."""
    import os

    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except OSError:  # the thread ended
            continue
        threads[int(tid)] = (name, fields["State"].split()[0], int(fields["voluntary_ctxt_switches"]))
    return threads


def _until_backend_threads_block(before: dict[int, tuple[str, str, int]], count: int) -> None:
    """Wait until ``count`` of gloo's worker threads have taken up a collective issued after
    ``before`` (a snapshot of :func:`_backend_threads`) and blocked in it, waiting for the peer: a
    worker idle since then has not switched out again, one that woke for the collective has, and
    sleeps. The collective's own buffers are allocated by then (gloo allocates them first)."""
    import time

    deadline = time.monotonic() + 120  # a guard against a hang only: the condition is what is waited for
    stable = 0
    while True:
        now = _backend_threads()
        taken = [tid for tid, (name, state, switches) in now.items()
                 if name == "pt_gloo_runloop" and state == "S" and switches > before.get(tid, ("", "", 0))[2]]
        stable = stable + 1 if len(taken) >= count else 0
        if stable >= 2:  # seen twice running: not a thread passing through a lock on its way
            return
        assert time.monotonic() < deadline, f"gloo's worker threads never took up the collective: {now}"
        time.sleep(0.001)


def _backend_buffer_across_the_window():
    """The peak of a step that starts while a collective issued before it still holds the backend's
    buffer (a persistent group's refresh, issued at the optimizer step), and of the same step with
    the collective issued and waited for inside it."""
    import torch.distributed as dist

    from autodist.measure.memory import measure_step_peak

    rank, n = dist.get_rank(), 1 << 20
    shard, out = torch.ones(n // 2), torch.empty(n)
    inflight, calls = [], [0]
    signal, wait_for = _signals()

    def step():
        # measure_step_peak runs two steps and measures the second: rank 0's collective of the
        # first completes only after its second started, since rank 1 joins it only then
        calls[0] += 1
        if rank == 0 and calls[0] == 2:
            signal("rank 0 measures")
        if rank == 1 and calls[0] == 1:
            wait_for("rank 0 measures")
        if inflight:
            inflight.pop().wait()
        before = _backend_threads()
        inflight.append(dist.all_gather_into_tensor(out, shard, async_op=True))
        if rank == 0 and calls[0] == 1:
            _until_backend_threads_block(before, 1)  # the backend holds its buffer before the window

    across = measure_step_peak(step, torch.device("cpu"), lambda: [shard, out])
    inflight.pop().wait()
    inside = measure_step_peak(
        lambda: dist.all_gather_into_tensor(out, shard, async_op=True).wait(), torch.device("cpu"), lambda: [shard, out]
    )
    return across, inside, (n + n // 2) * 4


def test_a_backend_buffer_held_across_the_step_start_counts_toward_the_peak(world2):
    # gloo's all-gather allocates a message-sized buffer on its own thread, freed there when the
    # collective completes: a step that starts with one held must count it, as a step that issues it
    across, inside, tensors = world2.run(_backend_buffer_across_the_window)[0]
    assert inside > tensors  # the backend's buffer is seen at all
    assert across == inside


def _backend_buffers_of_collectives_issued_together():
    """The peak while one all-gather, then two and three issued together, wait for a late peer (as a step's
    persistent refreshes do, issued at the optimizer step), beyond the tensors themselves."""
    import torch.distributed as dist

    from autodist.measure.memory import measure_step_peak
    from autodist.runtime.comm import backend_workers

    rank, n = dist.get_rank(), 1 << 20
    shards, outs = [torch.ones(n // 2) for _ in range(3)], [torch.empty(n) for _ in range(3)]
    workers = backend_workers(dist.group.WORLD)
    signal, wait_for = _signals()

    def issue(k: int) -> None:
        # rank 1 joins only once rank 0's backend threads have taken up every collective they can
        # at once: until then each holds its buffer, waiting for this rank
        if rank == 1:
            wait_for("rank 0 issued")
        before = _backend_threads()
        works = [dist.all_gather_into_tensor(outs[i], shards[i], async_op=True) for i in range(k)]
        if rank == 0:
            _until_backend_threads_block(before, min(k, workers))
            signal("rank 0 issued")
        for w in works:
            w.wait()

    tensors = 3 * (n + n // 2) * 4
    peaks = [measure_step_peak(lambda k=k: issue(k), torch.device("cpu"), lambda: shards + outs) - tensors for k in (1, 2, 3)]
    return peaks, n * 4, workers


def _reduce_scatters_in_one_step(count: int):
    """The peak of a step that issues and waits for ``count`` reduce-scatters one after another
    through the runtime's collectives, beyond the tensors the step holds; and the backend's own
    buffer for one of them (its allocation inside the issue)."""
    import torch.distributed as dist

    from autodist.measure.memory import _trace_events, measure_step_peak
    from autodist.runtime.comm import Comm

    comm = Comm(dist.group.WORLD)
    n = 1 << 17
    out, inp = torch.empty(n), torch.ones(2, n)

    def step():
        for _ in range(count):
            comm.reduce_scatter(out, inp.view(-1), "bucket0").wait()

    peak = measure_step_peak(step, torch.device("cpu"), lambda: [out, inp]) - (3 * n * 4)
    events = _trace_events(lambda: comm.reduce_scatter(out, inp.view(-1), "bucket0").wait())
    return peak, max(m for _, m in events.mem)


def test_a_backend_buffer_freed_by_the_backends_thread_counts_only_until_its_wait(world2):
    # [Note: a backend's buffer freed out of sight] gloo's reduce-scatter allocates an output-sized
    # buffer when issued, freed by whichever thread drops the work handle last; a free on gloo's
    # thread is invisible to the profiler. Without the correction, each such free left the buffer
    # counted to the end of the step: the peak grew with the number of reduce-scatters
    results = world2.run(_reduce_scatters_in_one_step, 24)
    for peak, staging in results:
        assert staging >= (1 << 17) * 4  # the backend's buffer is seen at all
        assert peak <= 1.05 * staging, results


def test_a_collectives_buffer_unfreed_on_this_thread_is_freed_at_its_waits_end():
    from autodist.measure.memory import _from_deltas

    own, worker = 1, 2
    ranges = [
        ("autodist::reduce_scatter(bucket0)", 10.0, 12.0), ("autodist::wait(reduce_scatter(bucket0))", 20.0, 25.0),
        ("autodist::reduce_scatter(bucket0)", 30.0, 32.0), ("autodist::wait(reduce_scatter(bucket0))", 40.0, 45.0),
        ("autodist::all_gather(g)", 50.0, 51.0), ("autodist::wait(all_gather(g))", 60.0, 61.0),
        ("autodist::wait(all_reduce(bucket1))", 70.0, 71.0),  # issued before the window
    ]
    deltas = [
        (11.0, 100, own),  # the first reduce-scatter's buffer: its free happened on the backend's thread
        (31.0, 100, own), (44.0, -100, own),  # the second's: freed here, inside its wait
        (50.5, 7, worker), (50.6, -7, worker),  # the all-gather's, on the backend's thread: allocated nothing here
        (70.5, -3, own),  # something freed inside a wait whose issue is not in the window
    ]
    events = _from_deltas(deltas, own, {}, ranges)
    assert events.mem == [(11.0, 100), (25.0, 0), (31.0, 100), (44.0, 0), (50.5, 7), (50.6, 0), (70.5, -3)]
    assert events.elsewhere == [(50.5, 7, worker), (50.6, -7, worker)]


def test_the_log_line_says_when_the_exposed_communication_was_not_measured():
    """On CUDA the compute thread does not block on an NCCL wait, so its blocked time is no measure
    of exposed communication: the figure is None there and the line says so, not 0%."""
    from autodist.metrics import StepMetrics, format_step

    m = StepMetrics(step=3, step_seconds=0.05, samples_per_second=80.0, tokens_per_second=None, peak_bytes=None,
                    peak_step=None, peak_scope=None, host_state_bytes=0, budget_bytes=1 << 30, budget_fraction=None,
                    resident_bytes=1 << 30, exposed_comm_share=None, all_gathers=0, reductions=2)
    assert format_step(m).endswith("exposed comm not measured")
    m.exposed_comm_share = 0.25
    assert format_step(m).endswith("exposed comm 25%")
