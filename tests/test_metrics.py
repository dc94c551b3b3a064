"""Per-step metrics: ``metrics()`` describes the last completed step, ``log_every`` logs every N steps
and the last one, and nothing stays registered after ``close()``."""

import logging

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


def _train(steps, *, log_every=None, micro_batches=1, close=True):
    lines = _Lines()
    log = logging.getLogger("autodist")
    old_level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(lines)
    try:
        model = AutoDist(models.make("mlp"), plan="ddp", log_every=log_every)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
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
    return {"seen": seen, "metrics": model.metrics(), "logged": step_lines}


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
