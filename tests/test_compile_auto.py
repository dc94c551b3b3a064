"""``AutoDist(plan="auto", compile=...)``: the switch that lets the planner compile blocks.

Checked here: a bad value is one clear error on every rank, before anything changes; the plan cache
keeps plans searched with compilation allowed apart from plans searched without (and reuses each
for its own launches); and ``plan="auto"`` with compilation allowed trains like the single-process
reference compiled the same way, both where the search keeps every block eager and where it
compiles them; a block the user compiled is never planned and stays as compiled; and ``autodist
plan --compile`` searches with compilation allowed. Backend ``aot_eager`` (the graph capture and autograd split of inductor, its kernels
run eagerly; see tests/test_compile.py for why): float32, 1e-5.
"""

import contextlib
import tempfile

import pytest
import torch
import torch.distributed as dist

import models
from autodist import AutoDist

ATOL = 1e-5
PER_RANK = 4


def test_a_bad_compile_value_is_one_clear_error_naming_the_fix():
    x, _ = models.batch("gpt", PER_RANK, torch.Generator().manual_seed(0))
    cases = [
        ({"compile": "nope", "example_inputs": (x,)}, "compile must be False (never compile), True"),
        ({"compile": 1, "example_inputs": (x,)}, "compile must be False (never compile), True"),
        ({"compile": None, "example_inputs": (x,)}, "compile must be False (never compile), True"),
        ({"compile": True, "plan": "ddp"}, "compile lets plan='auto' decide which blocks to compile"),
        ({"compile": "aot_eager"}, "needs an example forward: pass example_inputs"),
    ]
    for kwargs, says in cases:
        model = models.make("gpt")
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError) as info:
            AutoDist(model, **{"plan": "auto", **kwargs})
        assert says in str(info.value), (kwargs, str(info.value))
        assert "\n" not in str(info.value)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="this model is on the meta device"):
        AutoDist(models.make("gpt", meta=True), plan="auto", example_inputs=(x,), compile=True)


def _refused_on_every_rank():
    x, _ = models.batch("gpt", PER_RANK, torch.Generator().manual_seed(0))
    try:
        AutoDist(models.make("gpt"), plan="auto", example_inputs=(x,), compile="fast")
    except ValueError as e:
        return str(e)
    return None


def test_a_bad_compile_value_is_refused_on_every_rank(world2):
    for said in world2.run(_refused_on_every_rank, timeout=120):
        assert said is not None and said.startswith("compile must be False"), said
        assert "got 'fast'" in said


def _launches(cache_dir, switches):
    """One wrap per entry of ``switches`` (the ``compile`` argument), one cache: where each plan came
    from, its key and what it records of compilation."""
    x, y = models.batch("gpt", PER_RANK, torch.Generator().manual_seed(dist.get_rank()))
    out = []
    for compile in switches:
        m = AutoDist(models.make("gpt"), plan="auto", example_inputs=(x,), cache_dir=cache_dir, compile=compile)
        models.loss_fn("gpt", m(x), y).backward()
        stats = m._auto.stats
        out.append({
            "source": stats.source, "key": stats.plan_key, "allowed": m.plan.provenance.get("compile_allowed"),
            "compiled": list(m.plan.compile), "backend": m.plan.compile_backend,
        })
        m.close()
    return out


def test_the_plan_cache_keeps_compile_allowed_and_disallowed_apart(world2):
    with tempfile.TemporaryDirectory() as d:
        results = world2.run(_launches, d, [False, "aot_eager", "aot_eager", False], timeout=600)
    for off, on, on_again, off_again in results:
        assert (off["source"], on["source"]) == ("search", "search")  # allowing compilation plans again
        assert off["key"] != on["key"]
        assert (on_again["source"], on_again["key"]) == ("cache", on["key"])
        assert (off_again["source"], off_again["key"]) == ("cache", off["key"])
        assert off["allowed"] is None and off["compiled"] == []
        assert on["allowed"] == on_again["allowed"] == "aot_eager"
        if on["compiled"]:
            assert on["backend"] == "aot_eager"
    assert results[0] == results[1]  # every rank agrees


@contextlib.contextmanager
def _compiled_faster(speedup):
    """The profile's compiled block times divided by ``speedup`` while the planner profiles."""
    import autodist.measure.trace as trace

    measured = trace.profile_compiled_blocks

    def faster(*args, **kwargs):
        out = measured(*args, **kwargs)
        for c in out.values():
            c.fwd_s, c.bwd_s = c.fwd_s / speedup, c.bwd_s / speedup
        return out

    trace.profile_compiled_blocks = faster
    try:
        yield
    finally:
        trace.profile_compiled_blocks = measured


def _auto_compiled_parity(cache_dir, compiled_speedup):
    """``plan="auto"`` with ``compile="aot_eager"`` against the single-process reference with the
    blocks the plan compiles compiled the same way, ``steps`` SGD steps on the same batches.
    ``compiled_speedup``: the profile's compiled block times divided by it (1: as measured), so that
    the search's decision to compile is known in advance."""
    from torch._dynamo.utils import counters

    rank, world = dist.get_rank(), dist.get_world_size()
    ref, base = models.make("gpt"), models.make("gpt")
    example, _ = models.batch("gpt", PER_RANK, torch.Generator().manual_seed(99))
    counters.clear()
    with _compiled_faster(compiled_speedup):
        model = AutoDist(base, plan="auto", example_inputs=(example,), cache_dir=cache_dir, compile="aot_eager")
    for name in model.plan.compile:  # the reference compiled as the plan compiles the model
        block = ref.get_submodule(name)
        block.forward = torch.compile(block.forward, backend=model.plan.compile_backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1234)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for _ in range(4):
        x, y = models.batch("gpt", PER_RANK * world, gen)
        lo, hi = rank * PER_RANK, (rank + 1) * PER_RANK
        loss = models.loss_fn("gpt", model(x[lo:hi]), y[lo:hi])
        loss.backward()
        rloss = models.loss_fn("gpt", ref(x), y)
        rloss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        worst["loss"] = max(worst["loss"], abs(total.item() / world - rloss.item()))
        rp = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            worst["grad"] = max(worst["grad"], (p.grad - rp[n].grad).abs().max().item())
        opt.step()
        ropt.step()
        opt.zero_grad(set_to_none=True)
        ropt.zero_grad(set_to_none=True)
        sd = model.state_dict()
        worst["param"] = max(worst["param"], max((sd[n] - p).abs().max().item() for n, p in rp.items()))
    out = {
        **worst, "plan_compiles": list(model.plan.compile), "runtime_compiles": list(model.runtime.compiled.blocks),
        "allowed": model.plan.provenance.get("compile_allowed"), "graph_breaks": sum(counters["graph_break"].values()),
        "compile_seconds": model.plan.predicted.get("compile_seconds"),
    }
    model.close()
    return out


@pytest.mark.parametrize("speedup", [1.0, 20.0], ids=["as-measured", "compiling-pays"])
def test_auto_with_compile_allowed_trains_like_the_reference_compiled_the_same_way(world2, speedup):
    with tempfile.TemporaryDirectory() as d:
        results = world2.run(_auto_compiled_parity, d, speedup, timeout=600)
    for r in results:
        assert max(r["loss"], r["grad"], r["param"]) <= ATOL, r
        assert r["allowed"] == "aot_eager"
        assert r["runtime_compiles"] == r["plan_compiles"]
        assert r["graph_breaks"] == 0
    if speedup > 1:  # blocks 20x faster compiled: the search compiles them, and says what compiling costs
        assert results[0]["plan_compiles"] == ["blocks.0", "blocks.1"], results[0]
        assert results[0]["compile_seconds"] is not None and results[0]["compile_seconds"] >= 0
    assert results[0]["plan_compiles"] == results[1]["plan_compiles"]


def _user_compiled_block(cache_dir):
    """plan="auto" with compilation allowed (and paying) on a model whose first block the user
    compiled: that block is left as the user compiled it, before, during and after AutoDist."""
    model = models.make("gpt")
    model.blocks[0].compile(backend="aot_eager")
    x, y = models.batch("gpt", PER_RANK, torch.Generator().manual_seed(dist.get_rank()))
    with _compiled_faster(20.0):
        wrapped = AutoDist(model, plan="auto", example_inputs=(x,), cache_dir=cache_dir, compile="aot_eager")
    models.loss_fn("gpt", wrapped(x), y).backward()
    out = {
        "plan_compiles": list(wrapped.plan.compile), "runtime_compiles": list(wrapped.runtime.compiled.blocks),
        "user_compiled_kept": model.blocks[0]._compiled_call_impl is not None,
        "patched": sorted(n for n, m in model.named_modules() if "forward" in m.__dict__),
    }
    wrapped.close()
    out["after_close"] = {
        "user_compiled_kept": model.blocks[0]._compiled_call_impl is not None,
        "patched": sorted(n for n, m in model.named_modules() if "forward" in m.__dict__),
    }
    return out


def test_auto_never_plans_a_block_the_user_compiled(world2):
    with tempfile.TemporaryDirectory() as d:
        for r in world2.run(_user_compiled_block, d, timeout=600):
            assert r["plan_compiles"] == r["runtime_compiles"] == ["blocks.1"], r
            assert r["user_compiled_kept"] and r["patched"] == ["blocks.1"]
            assert r["after_close"] == {"user_compiled_kept": True, "patched": []}


GPT_FACTORY = '''\
import models


def build():
    return models.make("gpt")
'''


def test_autodist_plan_compile_lets_the_search_compile_blocks(tmp_path, monkeypatch, capsys):
    from autodist.cli import main
    from autodist.plan import load_plan

    (tmp_path / "cagpt.py").write_text(GPT_FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AUTODIST_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()  # the command profiles with one thread, as a rank does
    common = ["plan", "--model", "cagpt:build", "--input-shape", "4,8", "--input-dtype", "int64", "--input-high", "53",
              "--world-size", "2", "--bandwidth", "1", "--latency", "50"]
    try:
        assert main([*common, "--compile", "aot_eager", "--out", str(tmp_path / "on.json")]) == 0
        assert main([*common, "--out", str(tmp_path / "off.json")]) == 0
        said = capsys.readouterr().out
        assert main([*common, "--compile", "--device", "h100", "--memory-limit", "70GiB", "--out", str(tmp_path / "x.json")]) == 2
        refused = capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
    on, off = load_plan(tmp_path / "on.json"), load_plan(tmp_path / "off.json")
    assert on.provenance["compile_allowed"] == "aot_eager" and "compile_allowed" not in off.provenance
    assert off.compile == []
    # the plan line says what the plan compiles, or that compiling was allowed and not chosen
    assert ("compiles no block (compile='aot_eager' allowed it" in said) or (f"compiles {len(on.compile)} block(s) with aot_eager" in said)
    assert "--compile times blocks compiled on this machine's CPU, and --device prices the compute" in refused
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(SystemExit):  # argparse: an unknown backend
        main([*common, "--compile", "fast", "--out", str(tmp_path / "y.json")])
