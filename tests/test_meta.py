"""Models built on the meta device (issue 12, point 3).

``with torch.device("meta"): model = Net()`` wrapped by AutoDist is materialised module by module:
after ``torch.manual_seed(s)`` its parameters and buffers are bitwise those of ``Net()`` built on the
CPU after the same seed, every rank's random generator ends where that build would have left it,
and training matches the single-process reference (SGD with momentum, 3+ optimizer steps) under
every built-in plan and ``auto``. Tied embeddings (TinyGPT), BatchNorm buffers (ConvBN), an
initialiser that writes a child's tensor (``nn.MultiheadAttention``) and frozen parameters are
covered. Tolerance as in test_shard: 2e-5.
"""

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

import models
from autodist import AutoDist
from autodist.errors import InitError
from parity import Case, check, run_cases

ATOL = 2e-5
MODELS = ["mlp", "convbn", "gpt", "torch-transformer", "frozen"]


def _check_meta(results: list[list[dict]]) -> None:
    for rank_results in results:
        for r in rank_results:
            assert r["initial"] == {"differing": [], "rng_as_after_cpu_build": True}, r["initial"]
    for i in range(len(results[0])):
        check([rank_results[i] for rank_results in results], atol=ATOL)


@pytest.mark.parametrize("plan", ["ddp", "fsdp", "zero2"])
def test_a_meta_model_trains_like_the_model_built_on_the_cpu(world2, plan):
    cases = [Case(model=name, plan=plan, steps=3, meta=True) for name in MODELS]
    _check_meta(world2.run(run_cases, cases))


def _auto_cases(example: bool) -> list[dict]:
    rank = dist.get_rank()
    with tempfile.TemporaryDirectory() as d:
        cases = []
        for name in ("mlp", "gpt"):
            extra = {"cache_dir": f"{d}/{name}"}
            per_rank = 2 if name == "gpt" else 4
            if example:  # one batch of this rank's shape
                extra["example_inputs"] = (models.batch(name, per_rank, torch.Generator().manual_seed(rank))[0],)
            # without example inputs: 3 steps recorded under the safe (sharded) plan, then the switch
            cases.append(Case(model=name, plan="auto", steps=3 if example else 6, per_rank=per_rank, meta=True, extra=extra))
        return run_cases(cases)


@pytest.mark.parametrize("example", [False, True], ids=["profiled-in-training", "example-inputs"])
def test_a_meta_model_under_auto_starts_sharded_and_trains_like_the_cpu_build(world2, example):
    results = world2.run(_auto_cases, example)
    _check_meta(results)
    for r in results[0]:
        assert r["runtime"]["plan_switches"] == 1  # profiled (under the sharded plan), searched, switched
        assert r["sharded_units"] > 0  # placement stays what the model was materialised into


def test_a_meta_model_on_four_ranks(world4):
    cases = [Case(model=name, plan=plan, steps=3, per_rank=2, meta=True)
             for name, plan in (("mlp", "fsdp"), ("gpt", "fsdp"), ("convbn", "ddp"), ("torch-transformer", "zero2"))]
    _check_meta(world4.run(run_cases, cases))


# ---- what peaks during wrapping ------------------------------------------------------------------
LAYERS, WIDTH = 16, 256


def _stack() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _wrap_peak(on_meta: bool) -> dict:
    from autodist.measure.memory import trace_cpu_memory

    held = {}

    def build_and_wrap() -> None:
        torch.manual_seed(0)
        if on_meta:
            with torch.device("meta"):
                model = _stack()
        else:
            model = _stack()
        held["model"] = AutoDist(model, plan="fsdp")

    mem, _ = trace_cpu_memory(build_and_wrap)
    model = held.pop("model")
    shards = sum(mp.shard_flat.numel() * mp.shard_flat.element_size() for mp in model.runtime.params.values())
    full = sum(p.numel() * p.element_size() for p in _stack().parameters())
    model.close()
    return {"peak": max(m for _, m in mem), "shards": shards, "full": full, "unit": full // LAYERS}


def test_wrapping_a_meta_model_holds_its_shards_and_a_unit_at_a_time_not_the_model(world2):
    for r in world2.run(_wrap_peak, True):
        assert r["shards"] == r["full"] // 2
        # the sharded state, one layer being initialised, and one of its parameters' gather buffers
        assert r["peak"] <= r["shards"] + 2 * r["unit"] + 64 * 1024, r
    for r in world2.run(_wrap_peak, False):
        assert r["peak"] >= r["full"] + r["shards"]  # the CPU build holds the whole model, then shards it


# ---- tensors no initialiser writes, and param_init_fn --------------------------------------------
class LooseRoot(nn.Module):
    """A root that owns a parameter and a non-persistent buffer computed in ``__init__``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.ones(6))
        self.register_buffer("freqs", torch.arange(6.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale + self.freqs


def _loose_root(with_init_fn: bool) -> object:
    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.reset_parameters()
        elif isinstance(module, LooseRoot):
            module.scale.fill_(1.0)
            module.freqs.copy_(torch.arange(6.0))

    torch.manual_seed(0)
    with torch.device("meta"):
        model = LooseRoot()
    try:
        wrapped = AutoDist(model, plan="fsdp", param_init_fn=init if with_init_fn else None)
    except InitError as e:
        return str(e)
    torch.manual_seed(0)
    cpu = LooseRoot()
    sd = wrapped.state_dict()
    same = all(torch.equal(sd[k], v) for k, v in cpu.state_dict().items()) and torch.equal(model.freqs, cpu.freqs)
    wrapped.close()
    return same


def test_a_tensor_no_initialiser_writes_is_refused_with_its_name(world2):
    for message in world2.run(_loose_root, False):
        assert (
            "no initialiser writes 2 of its tensors: scale (LooseRoot: no reset_parameters()), "
            "freqs (LooseRoot: no reset_parameters())"
        ) in message
        assert "reset_parameters()" in message and "param_init_fn" in message


def test_param_init_fn_initialises_what_reset_parameters_cannot(world2):
    assert world2.run(_loose_root, True) == [True, True]


class Rotary(nn.Module):
    """Only a computed buffer, as Llama's rotary embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (100 ** (torch.arange(0, 6, 2).float() / 6)), persistent=False)


class WithRotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rot = Rotary()
        self.body = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x * self.rot.inv_freq.repeat(2))


def _child_buffer() -> object:
    """``param_init_fn`` (called with every module, children first, as Hugging Face's
    ``_init_weights`` is passed) writes a child's computed buffer; the root's call, which comes
    after the buffer's value went to every rank, writes nothing. Before, that call was taken for a
    write the trial run had not seen and the model was refused."""
    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.reset_parameters()
        elif isinstance(module, Rotary):
            module.inv_freq.copy_(1.0 / (100 ** (torch.arange(0, 6, 2).float() / 6)))

    torch.manual_seed(0)
    with torch.device("meta"):
        model = WithRotary()
    try:
        wrapped = AutoDist(model, plan="fsdp", param_init_fn=init)
    except InitError as e:
        return str(e)
    torch.manual_seed(0)
    cpu = WithRotary()
    sd = wrapped.state_dict()
    same = all(torch.equal(sd[k], v) for k, v in cpu.state_dict().items()) and torch.equal(model.rot.inv_freq, cpu.rot.inv_freq)
    x = torch.randn(4, 6)
    same = same and torch.allclose(wrapped(x), cpu(x), atol=1e-6)
    wrapped.close()
    return same


def test_param_init_fn_initialises_a_childs_buffer(world2):
    assert world2.run(_child_buffer) == [True, True]


def _stale_reference() -> str | None:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = models.MLP()
    taken_before = model.layers[0].weight  # the meta tensor: wrapping replaces it

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.reset_parameters()
        if module is model:
            taken_before.zero_()

    try:
        AutoDist(model, plan="ddp", param_init_fn=init)
    except InitError as e:
        return str(e)
    return None


def test_an_initialiser_writing_a_tensor_that_is_not_materialised_is_refused(world2):
    for message in world2.run(_stale_reference):
        assert message is not None and "wrote layers.0.weight" in message


def test_param_init_fn_is_refused_for_a_model_that_is_not_on_the_meta_device():
    with pytest.raises(ValueError, match="param_init_fn initialises a model built on the meta device"):
        AutoDist(models.make("mlp"), plan="ddp", param_init_fn=lambda m: None)


def _init_fails_on_rank1_only() -> dict:
    from torch._subclasses.fake_tensor import FakeTensor

    rank = dist.get_rank()
    with torch.device("meta"):
        model = models.MLP()

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            if rank == 1 and module is model.layers[1] and not isinstance(module.weight, FakeTensor):
                raise RuntimeError("CUDA out of memory (simulated)")  # the trial on fake tensors passed
            module.reset_parameters()

    try:
        AutoDist(model, plan="fsdp", param_init_fn=init)
    except InitError as e:
        return {"error": str(e), "hooks": len(model.layers[0]._forward_pre_hooks)}
    return {"error": None}


def test_an_initialiser_failing_on_one_rank_fails_on_every_rank_without_a_hang(world2):
    # the failing rank used to raise while the others waited in the next broadcast
    r0, r1 = world2.run(_init_fails_on_rank1_only, timeout=120)
    assert "rank 1 could not initialise the model" in r0["error"] and "out of memory (simulated)" in r0["error"]
    assert "initialising module 'layers.1'" in r1["error"] and "out of memory (simulated)" in r1["error"]
    assert r0["hooks"] == r1["hooks"] == 0  # the half-built wrapper let the module go
