"""tools/bench.py measures what it says: a contender's timed window ends only when everything it
started asynchronously is done, and offloaded optimizer state is measured from its host buffers."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import models
from autodist import AutoDist
from parity import make_plan

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    """tools/bench.py as a module (in a pool worker: the tools put their folder on sys.path)."""
    name = "bench_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "bench.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _left_running_after_drain():
    from autodist.runtime.offload import FragState

    bench = _bench()
    args = type("Args", (), {"memory_limit": None, "mixed_precision": "none"})()
    persistent = AutoDist(models.make("mlp"), plan=make_plan(models.make("mlp"), 2, residency="persistent"))
    offloaded = bench._offload_all_sync(models.make("mlp"), args, ())
    out = {}
    for name, model in (("persistent", persistent), ("offload", offloaded)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = models.batch("mlp", 4, torch.Generator().manual_seed(0))
        for _ in range(2):
            models.loss_fn("mlp", model(x), y).backward()
            opt.step()  # starts offload copy-outs that outlive the step (a persistent refresh waits for the next forward)
            opt.zero_grad()
        before = sum(len(g.in_flight()) for g in model.runtime.groups) + sum(
            e.status is FragState.OUT for e in model.runtime.offload.entries.values()
        )
        bench._drain(model, torch.device("cpu"))
        after = sum(len(g.in_flight()) for g in model.runtime.groups) + sum(
            e.status is FragState.OUT for e in model.runtime.offload.entries.values()
        )
        out[name] = (before, after)
        if name == "offload":
            host = sum(e.h.numel() * e.h.element_size() for e in model.runtime.offload.entries.values())
            out["host"] = (bench._host_state_bytes(model), host, model.runtime.offload.account.host_bytes)
        model.close()
    return out


def test_the_timed_window_ends_after_every_asynchronous_operation_the_contender_started(world2):
    for r in world2.run(_left_running_after_drain):
        # nothing of a persistent plan outlives its optimizer step: the refresh is issued at the
        # next forward ([Note: when persistent groups are refreshed] in autodist/runtime/optimizers.py)
        assert r["persistent"] == (0, 0)
        assert r["offload"][0] > 0 and r["offload"][1] == 0


def test_host_resident_state_is_measured_from_the_buffers_that_hold_it(world2):
    for r in world2.run(_left_running_after_drain):
        measured, buffers, _bookkeeping = r["host"]
        assert measured == buffers > 0


def _interleaved_order(fails: str | None = None, on_rank: int | None = None):
    """``run_interleaved`` with each contender's step replaced by one that logs its name;
    ``fails``: that contender's third step raises (on ``on_rank`` only, or on every rank)."""
    import torch.distributed as dist

    bench = _bench()
    log = []

    def build(workload, contender, batches, args):
        model = torch.nn.Linear(2, 2)

        def step(x, y, name=contender.name):
            log.append(name)
            if name == fails and log.count(name) == 3 and on_rank in (None, dist.get_rank()):
                raise RuntimeError("CUDA out of memory (a stand-in)")

        return model, None, step

    real, bench._build = bench._build, build
    try:
        args = type("Args", (), {"steps": 2, "passes": 2, "warmup": 1, "device": "cpu", "deadline": None})()
        names = ["compute", "ddp", "fsdp2"]  # (closed as torch models are: a plain module stands in)
        results = {n: bench.Result("m", n) for n in names}
        bench.run_interleaved(None, names, [(None, None)] * 3, args, results)
    finally:
        bench._build = real
    return log, {n: (len(r.step_times), r.extra.get("interleaved"), r.error) for n, r in results.items()}


def test_interleaved_steps_alternate_their_order_and_each_contender_takes_steps_times_passes(world2):
    a, b, c = "compute", "ddp", "fsdp2"
    for log, timed in world2.run(_interleaved_order):
        assert log == [a, b, c] + [a, b, c, c, b, a] * 2  # warm-up, then rounds in alternating order
        assert timed == {a: (4, True, None), b: (4, True, None), c: (4, True, None)}


@pytest.mark.parametrize("on_rank", [None, 1], ids=["every-rank", "one-rank"])
def test_a_contender_failing_mid_run_is_dropped_on_every_rank_and_the_rest_go_on(world2, on_rank):
    a, b, c = "compute", "ddp", "fsdp2"
    for rank, (log, timed) in enumerate(world2.run(_interleaved_order, b, on_rank)):
        # ddp's third step (its second timed one) fails: it is dropped from then on, everywhere
        assert log == [a, b, c] + [a, b, c] + [c, b, a] + [a, c] + [c, a], log
        assert timed[a] == (4, True, None) and timed[c] == (4, True, None)
        steps, interleaved, error = timed[b]
        assert (steps, interleaved) == (1, None)
        assert error == ("RuntimeError: CUDA out of memory (a stand-in)" if on_rank in (None, rank)
                         else "failed on another rank"), error


def test_paired_differences_are_taken_step_by_step():
    bench = _bench()
    ddp = [0.100, 0.200, 0.150, 0.120]
    mine = {
        "ddp": {"error": None, "step_times_s": ddp, "extra": {"interleaved": True}},
        # 1, 2, 3 and 4 ms above its neighbouring DDP steps, however far those move
        "autodist:ddp": {"error": None, "step_times_s": [t + d for t, d in zip(ddp, (0.001, 0.002, 0.003, 0.004))],
                         "extra": {"interleaved": True}},
    }
    line = [x for x in bench._paired(mine) if x.startswith("  autodist:ddp")][0]
    assert "over 4: ddp +2.50 (+1.25 to +3.75)" in line, line
