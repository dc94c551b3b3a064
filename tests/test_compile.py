"""Compiled blocks as a plan decision (issue 45): a plan's ``compile`` blocks run under
``torch.compile`` without touching the model's code, train exactly like the single-process
reference compiled the same way under every residency, with recomputation, accumulation and mixed
precision, with no graph break (AutoDist's hooks sit at the block's boundary, outside the compiled
code), and ``remove()`` hands the model back as it was.

Backend: the parity runs compile with ``aot_eager`` (the same graph capture and autograd split as
inductor, its kernels run eagerly), which the plan records as ``compile_backend``: inductor on this
2-core CPU takes about a minute per distinct block and process, too long for the suite; one case
runs inductor itself. Tolerance: float32, 1e-5 (a compiled block is bitwise its eager self under
aot_eager; inductor's fused kernels differ by rounding).
"""

import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import models
from autodist.errors import PlanError
from autodist.plan import OffloadFragment, Plan, validate_plan
from autodist.runtime.compiled import BlockCompile, compiled_by_user
from autodist.structure import discover
from parity import Case, check_cases, make_plan, run_cases

ATOL = 1e-5

PLANS = {
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "zero2": ("zero2", {}),
    "persistent": ({"residency": "persistent", "grouping": "block"}, {}),
    "mixed-placement": ({"placement": "mixed", "grouping": "block"}, {}),
    "fsdp-recompute": ({"grouping": "block", "recompute": "all"}, {}),
    "ddp-one-block": ("ddp", {"compile": ["blocks.1"]}),
    "ddp-accumulate": ("ddp", {"accumulate": 2}),
    "fsdp-accumulate-sharded": ({"grouping": "block", "accumulate": "sharded"}, {"accumulate": 3}),
    "zero2-accumulate": ("zero2", {"accumulate": 2}),
}


def _case(name: str) -> Case:
    plan, extra = PLANS[name]
    kw = {"compile": "all", **extra}
    return Case(model="gpt", plan=plan, steps=3, **kw)


def test_compiled_blocks_match_single_process_under_every_residency(world2):
    names = list(PLANS)
    results = world2.run(run_cases, [_case(n) for n in names], timeout=900)
    check_cases(results, names, atol=ATOL)
    for rank in results:
        for name, r in zip(names, rank):
            want = PLANS[name][1].get("compile", ["blocks.0", "blocks.1"])
            assert r["compiled_blocks"] == want, name
            assert r["graph_breaks"] == 0, f"{name}: {r['graph_breaks']} graph breaks"


def test_compiled_blocks_with_recomputation_and_bf16(world2):
    names = ["ddp-recompute", "zero2-recompute-accumulate", "fsdp-bf16", "ddp-bf16"]
    cases = [
        Case(model="gpt", plan={"placement": "replicate", "recompute": "all"}, compile="all"),
        Case(model="gpt", plan={"grouping": "block", "residency": "after_backward", "recompute": ["blocks.0"]},
             compile="all", accumulate=2),
        Case(model="gpt", plan="fsdp", compile="all", bf16=True),
        Case(model="gpt", plan="ddp", compile="all", bf16=True),
    ]
    results = world2.run(run_cases, cases, timeout=900)
    check_cases([r[:2] for r in results], names[:2], atol=ATOL)
    check_cases([r[2:] for r in results], names[2:], atol=1e-4)
    assert all(c["graph_breaks"] == 0 for r in results for c in r)
    assert all(c["runtime"]["recomputed_blocks"] > 0 for r in results for c in r[:2])


def test_inductor_compiled_blocks_match_the_reference(world2):
    names = ["fsdp-inductor"]
    results = world2.run(run_cases, [Case(model="gpt", plan="fsdp", compile="all", compile_backend="inductor")], timeout=900)
    check_cases(results, names, atol=ATOL)
    assert all(c["graph_breaks"] == 0 for r in results for c in r)


def _hooked_modules(plan_name: str) -> dict:
    """On every rank: which modules carry forward hooks under ``plan_name`` with every block
    compiled, and whether closing hands back every block's forward as it was."""
    from autodist import AutoDist
    from autodist.builtins import builtin_plan

    model = models.make("gpt")
    plan = builtin_plan(plan_name, discover(model), dist.get_world_size())
    plan.compile, plan.compile_backend = ["blocks.0", "blocks.1"], "aot_eager"
    wrapped = AutoDist(model, plan=plan)
    hooked = sorted(n for n, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks)
    patched = sorted(n for n, m in model.named_modules() if "forward" in m.__dict__)
    wrapped.close()
    after = sorted(n for n, m in model.named_modules() if "forward" in m.__dict__)
    return {"hooked": hooked, "patched": patched, "after_close": after}


def test_a_compiled_blocks_hooks_sit_at_its_boundary(world2):
    r = world2.run(_hooked_modules, "fsdp")[0]
    assert [n for n in r["hooked"] if n.startswith("blocks.")] == ["blocks.0", "blocks.1"]
    assert "wte" in r["hooked"] and "head" in r["hooked"]  # units outside blocks keep their own hooks
    assert r["patched"] == ["blocks.0", "blocks.1"]
    assert r["after_close"] == []
    r = world2.run(_hooked_modules, "ddp")[0]
    assert r["hooked"] == []  # replicated: gradient hooks only, outside the compiled graph


# ---- single process: the plan field, the validator, enactment --------------------------------


def _plan(model, **kw) -> Plan:
    return make_plan(model, 2, grouping="block", **kw)


def test_the_compile_decision_round_trips_through_json():
    model = models.make("gpt")
    plan = _plan(model)
    plan.compile, plan.compile_backend = ["blocks.1"], "aot_eager"
    again = Plan.from_json(plan.to_json())
    assert again.compile == ["blocks.1"] and again.compile_backend == "aot_eager"
    assert again.hash() == plan.hash()
    validate_plan(again, discover(model))


def test_a_plan_without_compile_reads_and_hashes_as_before_the_field():
    model = models.make("gpt")
    plan = _plan(model)
    d = json.loads(plan.to_json())
    assert "compile" not in d and "compile_backend" not in d
    old = Plan.from_dict(d)
    assert old.compile == [] and old.hash() == plan.hash()
    plan.compile = ["blocks.0"]
    assert plan.hash() != old.hash()  # compiling changes execution


def test_the_validator_refuses_what_cannot_be_compiled_with_the_reason():
    model = models.make("gpt")
    s = discover(model)
    per_unit = make_plan(model, 2, grouping="unit")
    per_unit.compile = ["blocks.0", "blocks.7"]
    per_unit.offload = [OffloadFragment("blocks.0.fc1.weight", "exp_avg", (0, 4), "forward:blocks.0.fc1", "step")]
    with pytest.raises(PlanError) as e:
        validate_plan(per_unit, s)
    msg = str(e.value)
    assert "compile[1] = 'blocks.7' is not a block of this model" in msg
    assert "compile[0] = 'blocks.0': its sharded units are split over gather_groups" in msg
    assert "offload[0].out_after = 'forward:blocks.0.fc1' is inside compiled block 'blocks.0'" in msg
    d = json.loads(_plan(model).to_json())
    d["compile"], d["compile_backend"] = ["blocks.0"], "tvm-ish"
    with pytest.raises(PlanError, match="compile_backend: expected one of inductor, aot_eager, eager"):
        Plan.from_dict(d)
    d["compile"], d["compile_backend"] = ["blocks.0", "blocks.0"], "eager"
    with pytest.raises(PlanError, match="compile: lists a block more than once"):
        Plan.from_dict(d)


def test_block_compile_runs_the_blocks_compiled_and_remove_restores_them_exactly():
    model = models.make("gpt")
    own = model.blocks[1].forward  # an instance attribute the user set: kept and restored
    model.blocks[1].forward = own
    ref = models.make("gpt")
    x, _ = models.batch("gpt", 2, torch.Generator().manual_seed(0))
    compiled = BlockCompile(model, ["blocks.0", "blocks.1"], "aot_eager")
    from torch._dynamo.utils import counters

    counters.clear()
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    compiled.remove()
    assert "forward" not in model.blocks[0].__dict__
    assert model.blocks[1].__dict__["forward"] is own


def test_a_block_the_user_compiled_is_left_as_it_is():
    model = models.make("gpt")
    model.blocks[0].compile(backend="aot_eager")
    assert compiled_by_user(model) == ["blocks.0"]
    compiled = BlockCompile(model, ["blocks.0", "blocks.1"], "aot_eager")
    assert compiled.user_compiled == ["blocks.0"] and compiled.blocks == ["blocks.1"]
    assert "forward" not in model.blocks[0].__dict__
    compiled.remove()


# ---- the simulator: a compiled block's gradients are all ready when its backward ends ---------
# The hand case of tests/test_simulator.py with both units inside one block ``blk``: units
# ``blk.u0``, ``blk.u1``, one 250-element float32 parameter each, 10 ms forward and 20 ms backward
# each eager; collectives take a fixed time (all-gather 2 ms, reduce-scatter 3 ms, all-reduce 4 ms),
# one at a time. Compiled, the block measured 10 ms forward and 30 ms backward against 20 and 40
# eager: each unit's forward is scaled by 1/2 (5 ms) and its backward by 3/4 (15 ms).


class _P(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))


class _Blk(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.u0 = _P(250)
        self.u1 = _P(250)


class _OneBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blk = _Blk()


def _hand_sim():
    from test_simulator import COMM as comm  # every collective a constant 2 / 3 / 4 ms, copies free

    from autodist.cost.profile import CompiledBlockProfile, OptimizerProfile, Profile, UnitProfile
    from autodist.cost.simulator import Simulator

    ms = 1e-3
    profile = Profile(
        units=[
            UnitProfile("blk.u0", fwd_s=10 * ms, bwd_s=20 * ms, act_bytes=100, ready=["blk.u0.w"]),
            UnitProfile("blk.u1", fwd_s=10 * ms, bwd_s=20 * ms, act_bytes=100, ready=["blk.u1.w"]),
        ],
        ready_order=["blk.u1.w", "blk.u0.w"],
        optimizer=OptimizerProfile(state_factor=2.0, transient_factor=0.0),
        compiled_blocks={"blk": CompiledBlockProfile(fwd_s=10 * ms, bwd_s=30 * ms, eager_fwd_s=20 * ms,
                                                     eager_bwd_s=40 * ms, compile_s=1.5)},
        compile_backend="inductor",
    )
    structure = discover(_OneBlock())
    assert structure.blocks == ["blk"]
    return Simulator(profile, structure, comm, world_size=2)


def _comm_events(r):
    return [(e.name, round(e.start * 1e3, 6), round(e.end * 1e3, 6)) for e in r.events if e.stream == "comm"]


def test_a_compiled_blocks_gradients_reach_their_buckets_when_its_backward_ends():
    from autodist.plan import Bucket, UnitPlan

    sim = _hand_sim()
    plan = Plan(world_size=2, units=[UnitPlan("blk.u0", ["blk.u0.w"]), UnitPlan("blk.u1", ["blk.u1.w"])],
                buckets=[Bucket(["blk.u1.w"], "all_reduce"), Bucket(["blk.u0.w"], "all_reduce")])
    eager = sim.run(plan, record=True)
    # eager: fwd 0..20; bwd u1 20..40, its bucket all-reduced [40,44] under bwd u0 40..60; the
    # second bucket [60,64], waited for at once
    assert _comm_events(eager) == [("all_reduce bucket0", 40, 44), ("all_reduce bucket1", 60, 64)]
    assert eager.step_s == pytest.approx(64e-3) and eager.compile_s == 0
    plan.compile = ["blk"]
    compiled = sim.run(plan, record=True)
    # compiled: fwd 0..10; bwd u1 10..25 and u0 25..40 (one compiled backward): both gradients
    # arrive at 40, the buckets run one after the other [40,44], [44,48]: nothing overlaps
    assert _comm_events(compiled) == [("all_reduce bucket0", 40, 44), ("all_reduce bucket1", 44, 48)]
    assert compiled.step_s == pytest.approx(48e-3)
    assert compiled.compute_s == pytest.approx(40e-3)
    assert compiled.compile_s == pytest.approx(1.5)  # the one-off cost, reported apart from the step
    # one bucket for the whole block: eager it waits for u0 (all-reduce [60,64]); compiled [40,44]
    plan.buckets = [Bucket(["blk.u1.w", "blk.u0.w"], "all_reduce")]
    assert sim.run(plan).step_s == pytest.approx(44e-3)
    plan.compile = []
    assert sim.run(plan).step_s == pytest.approx(64e-3)


def test_a_compiled_sharded_block_reduces_its_gradients_after_its_backward():
    from autodist.plan import Bucket, GatherGroup, Prefetch, UnitPlan

    sim = _hand_sim()
    plan = Plan(
        world_size=2,
        units=[UnitPlan("blk.u0", ["blk.u0.w"], "shard", "after_backward"),
               UnitPlan("blk.u1", ["blk.u1.w"], "shard", "after_backward")],
        gather_groups=[GatherGroup(["blk.u0", "blk.u1"], Prefetch(0, 0))],
        buckets=[Bucket(["blk.u1.w"], "reduce_scatter"), Bucket(["blk.u0.w"], "reduce_scatter")],
        compile=["blk"],
    )
    validate_plan(plan, sim.structure)
    r = sim.run(plan, record=True)
    # all-gather [0,2] waited; fwd 2..12; bwd 12..27 and 27..42; both reduce-scatters issued at 42:
    # [42,45], [45,48]; the collective-order check (an all-reduce, 4 ms) after the flush: 48..52
    assert _comm_events(r)[:3] == [("all_gather gather blk.u0", 0, 2), ("reduce_scatter bucket0", 42, 45),
                                   ("reduce_scatter bucket1", 45, 48)]
    assert r.step_s == pytest.approx(52e-3)


def test_the_profile_times_each_block_compiled_and_eager_compiling_identical_blocks_once():
    from autodist.cost.profile import Profile
    from autodist.measure.trace import profile_model

    model = models.make("gpt")
    model.blocks[1].compile(backend="aot_eager")  # the user's own: measured as it runs, and recorded
    s = discover(model)
    x, _ = models.batch("gpt", 2, torch.Generator().manual_seed(0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    prof = profile_model(model, s, (x,), device=torch.device("cpu"), repeats=2, memory=False, compile_backend="aot_eager")
    assert sorted(prof.compiled_blocks) == ["blocks.0", "blocks.1"]
    assert prof.compile_backend == "aot_eager" and prof.user_compiled == ["blocks.1"]
    assert prof.compiled_blocks["blocks.1"].same_as == "blocks.0"
    assert all(c.fwd_s > 0 and c.bwd_s > 0 and c.eager_fwd_s > 0 for c in prof.compiled_blocks.values())
    assert Profile.from_json(prof.to_json()).compiled_blocks == prof.compiled_blocks
    # nothing left changed: no gradient, no forward patched, the same values
    assert all(p.grad is None for p in model.parameters())
    assert "forward" not in model.blocks[0].__dict__
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# ---- the search: fusion gain against the overlap delayed gradients cost (DisCo) --------------
# Two blocks of two replicated units each (1000-byte parameters), each unit 10 ms forward and 20 ms
# backward eager; an all-reduce costs 15 ms per 1000 bytes. Compiled, a block runs ``scale`` times
# its eager time. Eager, per-unit buckets hide all but the last unit's all-reduce under later
# backward; compiling the first block in backward (blocks.1) delays its gradients to its end, still
# hidden under blocks.0's backward (40 ms); compiling blocks.0 exposes its first unit's all-reduce
# too (15 ms) against a gain of 60 ms x (1 - scale): worth it below scale 0.75.


class _TwoBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Blk(), _Blk()])


def _search(scale: float):
    from autodist.cost.comm import CommModel, OpModel, Piece
    from autodist.cost.profile import CompiledBlockProfile, OptimizerProfile, Profile, UnitProfile
    from autodist.cost.simulator import Simulator
    from autodist.sched.search import SearchConfig, Searcher
    from autodist.sched.space import space_for

    ms = 1e-3

    def linear(per_byte):
        return OpModel(Piece(per_byte, 0.0), Piece(per_byte, 0.0), float("inf"))

    comm = CommModel("test", 2, "cpu", {"all_gather": linear(0), "reduce_scatter": linear(0),
                                        "all_reduce": linear(15 * ms / 1000), "h2d": linear(0), "d2h": linear(0)})
    s = discover(_TwoBlocks())
    names = [u.name for u in s.units]
    prof = Profile(
        units=[UnitProfile(u, fwd_s=10 * ms, bwd_s=20 * ms, act_bytes=100, ready=[u + ".w"]) for u in names],
        ready_order=[u + ".w" for u in reversed(names)],
        optimizer=OptimizerProfile(state_factor=2.0, transient_factor=0.0),
        compiled_blocks={b: CompiledBlockProfile(20 * ms * scale, 40 * ms * scale, 20 * ms, 40 * ms, 1.0) for b in s.blocks},
        compile_backend="inductor",
    )
    space = space_for(prof, s, 2, fixed_placement={u: "replicate" for u in names})
    space.inflight_choices = (-1,)
    sim = Simulator(prof, s, comm, world_size=2)
    return space, sim, Searcher(space, sim, SearchConfig(seed=0, prefer_seed_within=0)).run()


@pytest.mark.parametrize(("scale", "compiled"), [(0.5, ["blocks.0", "blocks.1"]), (0.9, ["blocks.1"]), (1.0, [])])
def test_the_search_compiles_a_block_only_where_its_fusion_gain_beats_the_overlap_it_costs(scale, compiled):
    import itertools

    space, sim, found = _search(scale)
    assert "ddp+compile-all" in found.seeds  # the seeds "compile every block" and "compile none" (ddp)
    # the optimum over every compile decision and bucketing of the ready order, by enumeration
    best = None
    for chosen in itertools.chain.from_iterable(itertools.combinations(range(2), k) for k in range(3)):
        for cuts in itertools.product([False, True], repeat=len(space.ready) - 1):
            g = space.with_compile(replace(space.ddp(), bucket_start=frozenset(k + 1 for k, c in enumerate(cuts) if c)), chosen)
            step = sim.run(space.to_plan(g)).step_s
            if best is None or step < best[0] - 1e-12:
                best = (step, sorted(space.compile_blocks[c] for c in chosen))
    assert found.result.step_s == pytest.approx(best[0])
    assert found.plan.compile == compiled == best[1]
    assert found.plan.compile_backend == "inductor"


def test_every_plan_of_the_space_with_compiled_blocks_is_valid():
    import random

    from autodist.sched.space import PlanSpace

    model = models.make("gpt")
    s = discover(model)
    space = PlanSpace(s, 2, [u.name for u in s.units], list(reversed(s.trainable)), state_names=("exp_avg",),
                      compile_blocks=list(s.blocks))
    rng = random.Random(0)
    compiled = 0
    for _ in range(200):
        g = space.random(rng)
        for kind in ("offload_add", "offload_add", "compile", "placement", "group_split", "offload_shift"):
            g = space._move_kind(g, kind, rng)
        plan = space.to_plan(g)
        validate_plan(plan, s)
        assert space.genome_of(plan).compile == space.normalize(g).compile
        compiled += bool(plan.compile)
    assert compiled > 50


def test_hooks_inside_a_block_the_user_compiled_are_warned_about(caplog):
    from autodist.runtime.compiled import merge_block_sites
    from autodist.runtime.step_state import ModuleSite

    model = models.make("gpt")
    model.blocks[0].compile(backend="aot_eager")
    sites = [ModuleSite(model.get_submodule(n), n, n, [], [], [n], []) for n in ("wte", "blocks.0.fc1", "blocks.1.fc1")]
    with caplog.at_level("WARNING", logger="autodist"):
        assert merge_block_sites(sites, [], model, ["wte", "blocks.0.fc1", "blocks.1.fc1"]) == sites
    assert "1 module(s) the plan hooks (e.g. 'blocks.0.fc1') are inside 'blocks.0'" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="autodist"):
        merge_block_sites(sites[::2], [], model, ["wte", "blocks.1.fc1"])
    assert caplog.text == ""


# ---- one schedule: the runtime's actions with compiled blocks are the simulated ones -----------
AGREEMENT = {
    "fsdp-all": ("fsdp", ["blocks.0", "blocks.1"], 1),
    "zero2-one": ("zero2", ["blocks.1"], 1),
    "window2": ({"grouping": "block", "window": 2}, ["blocks.0", "blocks.1"], 1),
    "recompute-accumulate": ({"grouping": "block", "recompute": "all", "accumulate": "sharded"}, ["blocks.0"], 2),
    "mixed-placement": ({"placement": "mixed", "grouping": "block"}, ["blocks.0", "blocks.1"], 1),
}


def _compiled_actions(plan_spec, blocks, micro):
    from test_schedule import runtime_and_simulated_actions

    from autodist.builtins import builtin_plan

    base = models.make("gpt")
    world = dist.get_world_size()
    plan = builtin_plan(plan_spec, discover(base), world) if isinstance(plan_spec, str) else make_plan(base, world, **plan_spec)
    plan.compile, plan.compile_backend = list(blocks), "aot_eager"
    return runtime_and_simulated_actions("gpt", plan, micro)


@pytest.mark.parametrize("name", list(AGREEMENT))
def test_the_runtime_carries_out_the_simulated_schedule_of_compiled_blocks(world2, name):
    for ran, simulated, deviations, _ in world2.run(_compiled_actions, *AGREEMENT[name]):
        assert not deviations
        assert ran == simulated, "\n".join(
            f"{i}: ran {a} simulated {b}" for i, (a, b) in enumerate(zip(ran + [None] * 99, simulated + [None] * 99)) if a != b
        )[:2000]
