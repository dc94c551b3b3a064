"""Planning beyond one node (issue 44): the two-level comm model, hybrid sharding's memory and
search, and ``autodist plan --nodes``. No process group: the comm models are injected."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from autodist.builtins import fsdp_plan
from autodist.cli import main
from autodist.cost.comm import CommModel, OpModel, Piece
from autodist.cost.profile import OptimizerProfile, Profile, UnitProfile
from autodist.cost.simulator import OPTIMIZER, PARAMETERS, Simulator
from autodist.sched.search import SearchConfig, Searcher
from autodist.sched.space import PlanSpace, hybrid_shard_sizes
from autodist.structure import discover

MS = 1e-3
LAYERS, WIDTH = 8, 512


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


STRUCTURE = discover(_Stack())
UNITS = [u.name for u in STRUCTURE.units]
READY = list(reversed(STRUCTURE.trainable))
PROFILE = Profile(
    units=[UnitProfile(n, fwd_s=0.05 * MS, bwd_s=0.1 * MS, act_bytes=100_000, ready=[f"{n}.weight"]) for n in UNITS],
    ready_order=READY, optimizer=OptimizerProfile(state_factor=2.0, transient_factor=0.0, per_byte_s=1e-12),
)


def _lin(c: float, d: float) -> OpModel:
    return OpModel(Piece(c, d), Piece(c, d), float("inf"))


def _level(ranks: int, c: float, d: float) -> CommModel:
    """A level whose collectives over ``ranks`` ranks take ``c`` s/byte and ``d`` s (fitted lines)."""
    ops = {op: _lin(c * (2 if op == "all_reduce" else 1), d) for op in ("all_reduce", "all_gather", "reduce_scatter")}
    ops |= {"h2d": _lin(1e-10, 0.0), "d2h": _lin(1e-10, 0.0)}
    return CommModel("test", ranks, "cuda-like", ops)


def _two(slow: float, *, nodes: int = 2, per_node: int = 4) -> CommModel:
    """Nodes of ``per_node`` ranks; the level across nodes ``slow`` times slower than the one within
    (an emulated network on one machine: the same fitted lines, slowed)."""
    inside = _level(per_node, 4e-11, 1e-5)
    return CommModel.two_level(inside, _level(nodes, 4e-11, 1e-5).slowed(slow), ranks_per_node=per_node, world_size=nodes * per_node)


# ---- the two-level model -------------------------------------------------------------------------
def test_collectives_are_priced_on_the_level_they_cross() -> None:
    comm = _two(20.0)
    inside, across = comm.ops, comm.cross_node.ops  # type: ignore[union-attr]
    n = 1 << 20
    # a shard group within a node (4 consecutive ranks): the node's fitted line over its own group size
    assert comm.group_time("all_gather", n, 4) == pytest.approx(inside["all_gather"](n))
    # the replicas of a node-sized shard (2 ranks, 4 apart): one per node, the network's line alone
    assert comm.group_time("all_reduce", n, 2, stride=4) == pytest.approx(across["all_reduce"](n))
    assert across["all_reduce"](n) == pytest.approx(20 * (8e-11 * n + 1e-5))
    # the world (2 nodes x 4): hierarchically, the network carrying a quarter of the message
    expected = inside["reduce_scatter"](n) + across["all_reduce"](n / 4) + inside["all_gather"](n)
    assert comm.time("all_reduce", n) == pytest.approx(expected)
    assert comm.group_time("all_gather", n, 8) == pytest.approx(across["all_gather"](n / 4) + inside["all_gather"](n))
    levels = comm.level_time("reduce_scatter", n, 8)
    assert levels["within node"] == pytest.approx(inside["reduce_scatter"](n))
    assert levels["across nodes"] == pytest.approx(across["reduce_scatter"](n / 4))
    # a pair within a node: the node's line for the bytes a ring of 2 sends against one of 4
    assert comm.group_time("all_gather", n, 2) == pytest.approx(inside["all_gather"](round(n * (1 / 2) / (3 / 4))))


def test_equal_levels_without_latency_price_the_world_as_one_level() -> None:
    """Ring arithmetic: a world collective split into levels of equal links moves the same bytes per
    rank as one flat ring over the world."""
    inside = CommModel.analytic(4, bandwidth_bytes_s=50e9, latency_s=0.0)
    flat = CommModel.analytic(8, bandwidth_bytes_s=50e9, latency_s=0.0)
    comm = CommModel.two_level(inside, CommModel.analytic(2, bandwidth_bytes_s=50e9, latency_s=0.0), ranks_per_node=4, world_size=8)
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert comm.time(op, 1 << 24) == pytest.approx(flat.time(op, 1 << 24))


def test_one_level_models_and_their_json_are_unchanged() -> None:
    one = _level(8, 4e-11, 1e-5)
    d = json.loads(one.to_json())
    assert "ranks_per_node" not in d and "cross_node" not in d
    assert one.group_time("all_gather", 1000, 8) == one.ops["all_gather"](1000)
    assert one.group_time("all_gather", 1000, 4) == one.ops["all_gather"](round(1000 * (3 / 4) / (7 / 8)))
    two = _two(3.0)
    again = CommModel.from_json(two.to_json())
    assert again.levels == 2 and again.ranks_per_node == 4
    assert again.time("all_reduce", 12345) == pytest.approx(two.time("all_reduce", 12345))
    with pytest.raises(ValueError, match="ranks_per_node"):
        CommModel.from_dict(dict(json.loads(two.to_json()), ranks_per_node=0))


def test_a_free_level_costs_nothing() -> None:
    comm = _two(20.0)
    n = 1 << 20
    no_net = comm.with_free_level("across nodes")
    assert no_net.time("all_reduce", n) == pytest.approx(comm.ops["reduce_scatter"](n) + comm.ops["all_gather"](n))
    assert comm.with_free_level("within node").group_time("all_gather", n, 4) == 0.0


# ---- memory ------------------------------------------------------------------------------------
@pytest.mark.parametrize("shard_size", [None, 4, 2])
def test_hybrid_shards_are_a_shard_group_s_share(shard_size: int | None) -> None:
    sim = Simulator(PROFILE, STRUCTURE, _two(20.0), world_size=8)
    static = sim.compile(replace(fsdp_plan(STRUCTURE, 8), shard_size=shard_size)).static
    shard = LAYERS * WIDTH * WIDTH * 4 // (shard_size or 8)
    assert static[PARAMETERS] == shard
    assert static[OPTIMIZER] == 2 * shard  # Adam's two states, of the shard


# ---- the search --------------------------------------------------------------------------------
def _search(comm: CommModel, budget: int | None, *, sizes: tuple[int, ...] | None = None) -> object:
    sizes = hybrid_shard_sizes(8, comm.ranks_per_node) if sizes is None else sizes
    space = PlanSpace(STRUCTURE, 8, UNITS, READY, shard_sizes=sizes)
    return Searcher(space, Simulator(PROFILE, STRUCTURE, comm, world_size=8, budget_bytes=budget), SearchConfig(stall=100)).run()


def test_the_search_shards_within_a_node_when_the_network_is_slow() -> None:
    """A budget without room for DDP (every rank holding all parameters, gradients and state): the
    gathers stay within the node."""
    replicated = LAYERS * WIDTH * WIDTH * 4 * 4  # parameters, gradients and Adam's two states
    result = _search(_two(20.0), replicated * 6 // 10)
    plan = result.plan  # type: ignore[attr-defined]
    assert plan.shard_size == 4 and plan.sharded_units
    sim = Simulator(PROFILE, STRUCTURE, _two(20.0), world_size=8)
    assert result.result.step_s < sim.run(replace(plan, shard_size=None)).step_s  # type: ignore[attr-defined]
    assert result.result.step_s < result.seeds["fsdp"].step_s  # type: ignore[attr-defined]


def test_hybrid_gains_with_the_network_s_slowness() -> None:
    """With equal levels hybrid sharding saves only the bytes a smaller ring does not send; with a
    slow network it keeps the gathers off it."""
    def gain(slow: float) -> float:
        seeds = _search(_two(slow), None).seeds  # type: ignore[attr-defined]
        return seeds["fsdp"].step_s / seeds["hsdp"].step_s

    assert gain(20.0) > gain(1.0) * 1.3


def test_equal_levels_without_room_for_hybrid_shard_over_the_world() -> None:
    sim = Simulator(PROFILE, STRUCTURE, _two(1.0), world_size=8)
    fsdp, hsdp = (sim.run(replace(fsdp_plan(STRUCTURE, 8), shard_size=s)) for s in (None, 4))
    budget = (fsdp.peak_bytes + hsdp.peak_bytes) // 2
    plan = _search(_two(1.0), budget).plan  # type: ignore[attr-defined]
    assert plan.shard_size is None


def test_one_node_offers_no_hybrid_sharding() -> None:
    assert hybrid_shard_sizes(8, None) == () and hybrid_shard_sizes(8, 8) == ()
    assert hybrid_shard_sizes(64, 8) == (8, 16, 32)
    one = CommModel.analytic(8, bandwidth_bytes_s=50e9, latency_s=1e-5, device="cuda")
    plan = _search(one, None).plan  # type: ignore[attr-defined]
    assert plan.shard_size is None


# ---- autodist plan --nodes ---------------------------------------------------------------------
@pytest.fixture
def tiny_gpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setenv("AUTODIST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return ["plan", "--model", "autodist.zoo:gpt", "--input-shape", "2,16", "--input-dtype", "int64", "--input-high", "8192"]


def test_plan_for_a_described_cluster(tiny_gpt: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([*tiny_gpt, "--nodes", "2", "--gpus-per-node", "4", "--interconnect", "nvlink4,ib-ndr", "--device", "h100",
               "--memory-limit", "80GiB", "--out", "plan.json"])
    out = capsys.readouterr().out
    assert rc == 0
    plan = json.loads(Path("plan.json").read_text())
    assert plan["world_size"] == 8 and plan.get("shard_size") in (None, 4)
    assert plan["device"] == "cuda"
    assert "nvlink4 within a node" in out and "ib-ndr across nodes" in out
    assert "within node" in out and "across nodes" in out and "exposed" in out
    assert "described h100" in out and "roofline" in out
    assert "Sharding: " in out


@pytest.mark.parametrize("extra, says", [
    (["--world-size", "8", "--nodes", "2", "--gpus-per-node", "4", "--interconnect", "nvlink4,ib-ndr"], "both give the ranks"),
    (["--nodes", "2", "--interconnect", "nvlink4,ib-ndr"], "--nodes needs --gpus-per-node"),
    (["--nodes", "2", "--gpus-per-node", "4", "--interconnect", "nvlink4"], "names one link"),
    (["--world-size", "8", "--interconnect", "nvlink4,ib-ndr"], "--world-size plans for one node"),
    (["--nodes", "2", "--gpus-per-node", "4", "--interconnect", "nvlink4,warp"], "each one of"),
    (["--nodes", "2", "--gpus-per-node", "4"], "name its links"),
    (["--nodes", "2", "--gpus-per-node", "4", "--interconnect", "nvlink4,ib-ndr", "--device", "tpu"], "not a described device"),
    (["--world-size", "8", "--interconnect", "nvlink4", "--device", "h100", "--profile", "p.json"], "pass one"),
    (["--interconnect", "nvlink4"], "give the ranks"),
])
def test_plan_flags_that_do_not_go_together(
    tiny_gpt: list[str], capsys: pytest.CaptureFixture[str], extra: list[str], says: str,
) -> None:
    rc = main([*tiny_gpt, *extra, "--memory-limit", "80GiB", "--out", "plan.json"])
    err = capsys.readouterr().err
    assert rc != 0 and says in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1
    assert not Path("plan.json").exists()


# ---- the described device ----------------------------------------------------------------------
def test_the_roofline_counts_what_flop_counter_counts_and_prices_it_on_the_device() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from autodist.cost.device import DEVICES, count_roofline, described_profile, on_device

    model = _Stack()
    x = torch.randn(64, WIDTH)
    with FlopCounterMode(display=False) as counter:
        model(x).float().mean().backward()
    model.zero_grad(set_to_none=True)
    h100 = DEVICES["h100"]
    roofline = count_roofline(model, STRUCTURE, (x,), h100)
    assert roofline.flops == counter.get_total_flops()
    assert all(p.grad is None for p in model.parameters())  # the count leaves no gradients
    # a float32 matrix product of 64 x 512 x 512: 2*64*512*512 FLOPs at the fp32 peak, or its bytes
    # at the memory bandwidth, whichever is longer
    mm = max(2 * 64 * WIDTH * WIDTH / h100.fp32_flops, 4 * (64 * WIDTH * 2 + WIDTH * WIDTH) / h100.memory_bytes_s)
    assert roofline.seconds[("layers.3", "fwd")] == pytest.approx(mm, rel=1e-6)
    assert roofline.ready_order == READY
    on = on_device(PROFILE, roofline)
    assert on.device == "cuda" and on.units[3].fwd_s == roofline.seconds[("layers.3", "fwd")]
    assert "H100" in on.meta["compute"]
    with torch.device("meta"):
        meta = _Stack()
    described = described_profile(meta, discover(meta), (torch.empty(64, WIDTH, device="meta"),), h100)
    assert [u.name for u in described.units] == UNITS and described.ready_order == READY
    assert described.units[3].fwd_s == pytest.approx(mm, rel=1e-6)
    assert described.units[3].act_bytes == 64 * WIDTH * 4  # its input, saved for the weight's gradient
