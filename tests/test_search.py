"""The search: brute-force optimum on a space small enough to enumerate, determinism, budgets."""

import itertools
import math
import random

import pytest
import torch
from torch import nn

from autodist.cost.comm import CommModel, OpModel, Piece
from autodist.cost.profile import OptimizerProfile, Profile, UnitProfile
from autodist.cost.simulator import Simulator
from autodist.sched.search import SearchConfig, Searcher
from autodist.sched.space import Genome, PlanSpace
from autodist.structure import discover

MS = 1e-3


class _P(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))


class _Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _P(40_000)  # 160 kB: the big one
        self.b = _P(2_000)
        self.c = _P(10_000)


def _lin(c, d):
    return OpModel(Piece(c, d), Piece(c, d), float("inf"))


COMM = CommModel(
    "test", 2, "cuda-like",  # device != "cpu": memory copies are nearly free
    {"all_gather": _lin(2e-8, 2e-4), "reduce_scatter": _lin(2e-8, 3e-4), "all_reduce": _lin(4e-8, 3e-4),
     "h2d": _lin(1e-9, 0), "d2h": _lin(1e-9, 0)},
)
STRUCTURE = discover(_Three())
PROFILE = Profile(
    units=[
        UnitProfile("a", fwd_s=2 * MS, bwd_s=4 * MS, act_bytes=20_000, ready=["a.w"]),
        UnitProfile("b", fwd_s=1 * MS, bwd_s=2 * MS, act_bytes=5_000, ready=["b.w"]),
        UnitProfile("c", fwd_s=3 * MS, bwd_s=6 * MS, act_bytes=30_000, ready=["c.w"]),
    ],
    ready_order=["c.w", "b.w", "a.w"],
    optimizer=OptimizerProfile(state_factor=2.0, transient_factor=0.0, per_byte_s=1e-9),
)


def _space():
    space = PlanSpace(STRUCTURE, 2, ["a", "b", "c"], PROFILE.ready_order)
    space.window_choices = (0, 1)
    space.inflight_choices = (-1, 0)
    return space


def _all_genomes(space):
    """Every distinct plan the search can reach: placements x group partitions x (residency,
    windows) per group x bucket partitions x in-flight bounds."""
    n = len(space.units)
    zero = ((0, 0),) * n
    for shard in itertools.product([False, True], repeat=n):
        partitions = set()
        for starts in itertools.chain.from_iterable(itertools.combinations(range(n), k) for k in range(n + 1)):
            partitions.add(space.normalize(Genome(shard, (0,) * n, frozenset(starts), zero, frozenset())).group_start)
        for starts in partitions:
            firsts = sorted(starts)
            per_group = list(itertools.product(range(3), itertools.product(space.window_choices, repeat=2)))
            for choice in itertools.product(per_group, repeat=len(firsts)):
                res, win = [0] * n, list(zero)
                for i, (r, w) in zip(firsts, choice):
                    res[i], win[i] = r, w
                for bstarts in itertools.chain.from_iterable(itertools.combinations(range(1, 3), k) for k in range(3)):
                    # the built-in seeds bound reductions in flight to one (builtins.py), and a
                    # mutation of a seed that does not touch the bound keeps it
                    for infl in sorted({*space.inflight_choices, 1}):
                        yield space.normalize(Genome(shard, tuple(res), starts, tuple(win), frozenset(bstarts), infl))


# A budget only plans that shard the big unit fit: the smallest peak of any plan is 816,016 bytes, of
# any that replicates ``a`` 857,012 (enumerated over the whole space).
TIGHT = 840_000


@pytest.mark.parametrize("budget", [None, TIGHT], ids=["unbounded", "tight"])
def test_search_finds_the_brute_force_optimum(budget):
    space = _space()
    sim = Simulator(PROFILE, STRUCTURE, COMM, world_size=2, budget_bytes=budget)
    best = math.inf
    count = 0
    for g in _all_genomes(space):
        r = sim.run(space.to_plan(g))
        count += 1
        if r.feasible:
            best = min(best, r.step_s)
    assert count > 1000  # the space really is enumerated
    # the pure optimum of the model: no preference for a nearly-as-fast built-in seed
    pure = SearchConfig(prefer_seed_within=0.0)
    found = Searcher(_space(), Simulator(PROFILE, STRUCTURE, COMM, world_size=2, budget_bytes=budget), pure).run()
    assert found.result.feasible
    assert found.result.step_s == pytest.approx(best, rel=1e-12)


def test_a_seed_within_the_margin_is_preferred_over_a_searched_plan():
    sim = Simulator(PROFILE, STRUCTURE, COMM, world_size=2)
    pure = Searcher(_space(), sim, SearchConfig(prefer_seed_within=0.0)).run()
    seed_name, seed = min(((n, r) for n, r in pure.seeds.items() if n in ("ddp", "fsdp", "zero2")), key=lambda x: x[1].step_s)
    gain = seed.step_s / pure.result.step_s - 1
    assert gain > 0  # the search beats every seed here, by this much
    wide = Searcher(_space(), sim, SearchConfig(prefer_seed_within=gain * 1.01)).run()
    assert wide.preferred_seed == seed_name and wide.result.step_s == seed.step_s
    narrow = Searcher(_space(), sim, SearchConfig(prefer_seed_within=gain * 0.99)).run()
    assert narrow.preferred_seed is None and narrow.result.step_s == pure.result.step_s


def test_tight_budget_forces_sharding():
    found = Searcher(_space(), Simulator(PROFILE, STRUCTURE, COMM, world_size=2, budget_bytes=TIGHT)).run()
    assert found.plan.unit("a").placement == "shard"  # the big unit cannot stay replicated
    assert found.result.peak_bytes <= TIGHT


def test_search_is_deterministic():
    runs = [Searcher(_space(), Simulator(PROFILE, STRUCTURE, COMM, world_size=2)).run() for _ in range(2)]
    assert runs[0].plan.to_json() == runs[1].plan.to_json()
    assert runs[0].evaluated == runs[1].evaluated


def test_infeasible_budget_reports_the_smallest_peak():
    found = Searcher(_space(), Simulator(PROFILE, STRUCTURE, COMM, world_size=2, budget_bytes=10_000)).run()
    assert not found.result.feasible
    peak, genome = found.smallest_peak
    assert peak > 10_000 and genome is not None


def test_random_plans_are_valid():
    from autodist.plan import validate_plan

    space = _space()
    rng = random.Random(0)
    for _ in range(200):
        validate_plan(space.to_plan(space.mutate(space.random(rng), rng, moves=5)), STRUCTURE, world_size=2)


def test_random_plans_of_a_model_with_fewer_units_than_the_widest_window_are_valid():
    # found by `autodist check` on a two-layer model: a window of 3 units on a 2-unit model
    from autodist.plan import validate_plan

    structure = discover(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)))
    assert len(structure.units) < 3
    space = PlanSpace(structure, 2, [u.name for u in structure.units], list(reversed(structure.trainable)))
    rng = random.Random(0)
    for _ in range(200):
        validate_plan(space.to_plan(space.mutate(space.random(rng), rng, moves=5)), structure, world_size=2)


def test_offloaded_state_follows_its_units_placement():
    # found by tools/collect_timelines.py: the search offloaded a replicated unit's whole optimizer
    # state, then sharded the unit; the fragment kept the whole tensor's extent, which the plan's
    # validation refuses (a rank holds half of it) — the search picked a plan that could not be enacted
    from autodist.plan import validate_plan

    structure = discover(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)))
    space = PlanSpace(structure, 2, [u.name for u in structure.units], list(reversed(structure.trainable)))
    space.state_names = ("exp_avg",)
    kinds = ["offload_add", "offload_shift", "offload_remove", "placement", "placement", "bucket_split", "group_split"]
    rng = random.Random(0)
    flipped = 0
    for _ in range(200):
        g = space.random(rng)
        for _ in range(6):
            before = g
            g = space.normalize(space._move_kind(g, rng.choice(kinds), rng))
            flipped += bool(g.offload) and before.offload != () and before.shard != g.shard
        plan = space.to_plan(g)
        validate_plan(plan, structure, world_size=2)
        for f in plan.offload:  # and the whole state a rank holds, no less
            unit = structure.unit_of_param[f.param]
            rows = structure.params[f.param].shape[0]
            sharded = g.shard[space.index[unit]]
            assert f.fragment[1] - f.fragment[0] == (-(-rows // 2) if sharded else rows) * (structure.params[f.param].numel // rows)
    assert flipped > 10  # placements did move under offloaded state


def _space_with_offload():
    space = _space()
    space.state_names = ("exp_avg", "exp_avg_sq")
    return space


def test_offload_is_chosen_only_when_the_budget_requires_it():
    free = Searcher(_space_with_offload(), Simulator(PROFILE, STRUCTURE, COMM, world_size=2)).run()
    assert free.result.feasible and not free.plan.offload
    # the smallest peak any plan without offload reaches (enumerated), then a budget just below it
    space = _space()
    sim = Simulator(PROFILE, STRUCTURE, COMM, world_size=2)
    floor = min(sim.run(space.to_plan(g)).peak_bytes for g in _all_genomes(space))
    tight = Searcher(_space_with_offload(), Simulator(PROFILE, STRUCTURE, COMM, world_size=2, budget_bytes=floor - 1)).run()
    assert tight.result.feasible and tight.result.peak_bytes < floor
    assert tight.plan.offload


def test_a_budget_met_only_inside_the_headroom_is_searched_within_the_budget_itself(caplog):
    from autodist.planner.offline import search_within_budget

    def sim(budget):
        return Simulator(PROFILE, STRUCTURE, COMM, world_size=2, budget_bytes=budget)

    cfg = SearchConfig(memory_headroom=0.10)
    smallest = Searcher(_space(), sim(10_000), cfg).run().smallest_peak[0]
    budget = int(smallest / 0.95)  # the smallest peak fits the budget, not the budget less 10%
    with caplog.at_level("WARNING", logger="autodist"):
        searcher, found = search_within_budget(_space(), sim, cfg, budget)
    assert found.result.feasible and found.inside_headroom and found.result.peak_bytes <= budget
    assert searcher.sim.budget == budget
    assert "within the budget but inside that margin" in caplog.text
    # below the smallest peak nothing is enacted; with room under the headroom, nothing changes
    _, none = search_within_budget(_space(), sim, cfg, smallest - 1)
    assert not none.result.feasible and not none.inside_headroom
    _, roomy = search_within_budget(_space(), sim, cfg, 10 * smallest)
    assert roomy.result.feasible and not roomy.inside_headroom


def test_the_search_simulates_with_the_wait_calibration_autodist_check_fitted():
    from dataclasses import replace

    from autodist.cost.fidelity import FidelityRecord
    from autodist.planner.offline import plan_offline

    record = FidelityRecord(
        median_abs_error_time=0.05, spearman=0.9, max_peak_excess=0.0, plans=5, model="m:f", measured_at=0.0,
        wait_scale=2.5, blocked_wait_s=3e-4,
    )
    again = FidelityRecord.from_json(record.to_json())
    assert (again.wait_scale, again.blocked_wait_s) == (2.5, 3e-4)
    cfg = SearchConfig.for_machine(record)
    # the scale with the blocked-wait time it was fitted with, whatever the comm model carries now
    assert (cfg.calibrated(COMM).wait_scale, cfg.calibrated(COMM).blocked_wait_s) == (2.5, 3e-4)
    assert SearchConfig().calibrated(COMM) is COMM
    # a record of before the blocked-wait time was kept leaves the comm model's
    older = SearchConfig.for_machine(replace(record, blocked_wait_s=None))
    assert older.calibrated(replace(COMM, blocked_wait_s=1e-4)).blocked_wait_s == 1e-4
    # a link given by bandwidth and latency was not measured here: the calibration is not this link's
    link = CommModel.analytic(2, bandwidth_bytes_s=50e9, latency_s=2e-5)
    assert cfg.calibrated(link) is link
    plan, _, _ = plan_offline(_Three(), (), world_size=2, budget_bytes=1 << 30, comm=COMM, config=cfg, profile=PROFILE)

    def step(scale: float) -> float:
        return Simulator(PROFILE, STRUCTURE, replace(COMM, wait_scale=scale, blocked_wait_s=3e-4), world_size=2).run(plan).step_s

    assert plan.predicted["step_seconds"] == pytest.approx(step(2.5)) and step(2.5) > step(1.0)


@pytest.mark.parametrize("bad", [0.2, 3.5, True, "1.5", float("nan")])
def test_a_fidelity_record_with_a_wait_scale_outside_the_calibration_s_range_is_refused(bad):
    import json

    from autodist.cost.fidelity import FidelityRecord

    d = json.loads(FidelityRecord(0.05, 0.9, 0.0, 5, "m:f", 0.0).to_json())
    d["wait_scale"] = bad
    with pytest.raises(ValueError, match="wait_scale"):
        FidelityRecord.from_json(json.dumps(d))


@pytest.mark.parametrize("bad", [-1e-4, float("inf"), float("nan"), True, "0.1"])
def test_a_fidelity_record_with_a_bad_blocked_wait_time_is_refused(bad):
    import json

    from autodist.cost.fidelity import FidelityRecord

    d = json.loads(FidelityRecord(0.05, 0.9, 0.0, 5, "m:f", 0.0).to_json())
    d["blocked_wait_s"] = bad
    with pytest.raises(ValueError, match="blocked_wait_s"):
        FidelityRecord.from_json(json.dumps(d))


def test_plans_to_check_picks_the_searched_plans_under_evenly_spaced_tighter_budgets():
    from dataclasses import replace

    from autodist.measure.fidelity import plans_to_check

    # gathers cost, so the unbudgeted pick is the replicated plan, the largest peak: the budgets differ
    comm = replace(COMM, ops={**COMM.ops, "all_gather": _lin(2e-6, 2e-3)})
    sim = Simulator(PROFILE, STRUCTURE, comm, world_size=2)
    kw = {"seed": 0}
    for budgets in (0, 1, 4):
        chosen = plans_to_check(_space(), sim, 5, budgets=budgets, **kw)
        searched = [(name, g) for name, g, is_searched in chosen if is_searched]
        assert [name for name, _, s in chosen if not s][:3] == ["ddp", "fsdp", "zero2"]
        assert searched[0][0].startswith("searched@none")
        assert len(searched) == 1 + budgets
        # the budgets fall from the loosest, and the search's pick under each fits it
        units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}
        limits = []
        for name, g in searched[1:]:
            text = name.split("@")[1].split("=")[0]
            unit = next(u for u in ("KiB", "MiB", "B") if text.endswith(u))
            limits.append(float(text[: -len(unit)]) * units[unit])
            assert sim.run(_space().to_plan(g)).peak_bytes <= limits[-1] * 1.001, name
        assert limits == sorted(limits, reverse=True) and len(set(limits)) == len(limits)
    with pytest.raises(ValueError, match="budgets must be 0 or more"):
        plans_to_check(_space(), sim, 5, budgets=-1, **kw)
