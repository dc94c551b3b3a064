"""Plan files: JSON round trip, and a clear error for every way a plan can be wrong."""

import json

import pytest
import torch

import models
from autodist import AutoDist, Plan, PlanError, load_plan, save_plan, validate_plan
from autodist.builtins import ddp_plan, fsdp_plan, zero2_plan
from autodist.structure import ROOT_UNIT, discover


@pytest.fixture
def gpt():
    return models.make("gpt")


@pytest.fixture
def structure(gpt):
    return discover(gpt)


def _plan_dict(structure, world=2, kind=fsdp_plan):
    return json.loads(kind(structure, world).to_json())


def _problems(data, structure, world=2):
    with pytest.raises(PlanError) as e:
        validate_plan(Plan.from_dict(data), structure, world_size=world)
    return str(e.value)


def test_plan_round_trips_through_json(tmp_path, structure):
    for kind in (ddp_plan, fsdp_plan, zero2_plan):
        plan = kind(structure, 4)
        plan.predicted = {"step_seconds": 0.5, "vs": {"ddp": 1.2}}
        save_plan(plan, tmp_path / "p.json")
        again = load_plan(tmp_path / "p.json", structure, world_size=4)
        assert again == plan
        assert again.hash() == plan.hash()


def test_plan_json_is_sorted_and_diffable(structure):
    text = fsdp_plan(structure, 2).to_json()
    data = json.loads(text)
    assert list(data) == sorted(data)
    assert text.count("\n") > 20  # one field per line, not one long line


def test_tied_parameter_is_covered_once(structure):
    owners = [u.name for u in structure.units if "wte.weight" in u.params]
    assert owners == ["wte"]
    assert ("head", "weight") in structure.params["wte.weight"].sites
    assert "head.weight" not in structure.params


def test_missing_file(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        load_plan(tmp_path / "nope.json")


def test_corrupt_json(tmp_path):
    (tmp_path / "p.json").write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON.*line 1"):
        load_plan(tmp_path / "p.json")


def test_a_file_cut_inside_a_string_says_where_the_string_starts(tmp_path):
    (tmp_path / "p.json").write_text('{"units": [\n  "blocks.0')
    with pytest.raises(PlanError) as e:
        load_plan(tmp_path / "p.json")
    assert "(Unterminated string starting at line 2, column 3)" in str(e.value)


def test_truncated_file(tmp_path, structure):
    text = fsdp_plan(structure, 2).to_json()
    (tmp_path / "p.json").write_text(text[: len(text) // 2])
    with pytest.raises(PlanError, match="truncated or corrupt"):
        load_plan(tmp_path / "p.json")
    (tmp_path / "e.json").write_text("")
    with pytest.raises(PlanError, match="empty"):
        load_plan(tmp_path / "e.json")


def test_not_an_object(tmp_path):
    (tmp_path / "p.json").write_text("[1, 2]")
    with pytest.raises(PlanError, match="expected a JSON object"):
        load_plan(tmp_path / "p.json")


def test_unknown_schema_version(structure):
    d = _plan_dict(structure)
    d["schema_version"] = 7
    with pytest.raises(PlanError, match="schema_version 7 is not supported.*upgrade autodist or regenerate"):
        Plan.from_dict(d)


def test_wrong_world_size(structure):
    msg = _problems(_plan_dict(structure, world=4), structure, world=2)
    assert "made for 4 ranks but this job has 2" in msg


def test_plan_for_another_model(structure):
    other = fsdp_plan(discover(models.make("mlp")), 2)
    with pytest.raises(PlanError) as e:
        validate_plan(other, structure, world_size=2)
    msg = str(e.value)
    assert "layers.0" in msg and "different model" in msg
    assert "'wte.weight' is not in any unit" in msg


def test_parameter_listed_twice(structure):
    d = _plan_dict(structure)
    d["units"][1]["params"].append(d["units"][0]["params"][0])
    assert "listed in unit 'wte' and again in 'wpe'" in _problems(d, structure)


def test_parameter_missing_from_units(structure):
    d = _plan_dict(structure)
    dropped = d["units"][2]["params"].pop()
    assert f"parameter '{dropped}' is not in any unit" in _problems(d, structure)


def test_trainable_parameter_in_no_bucket(structure):
    d = _plan_dict(structure)
    dropped = d["buckets"][0]["params"].pop()
    assert f"trainable parameter '{dropped}' is in no bucket" in _problems(d, structure)


def test_unknown_parameter_in_bucket(structure):
    d = _plan_dict(structure)
    d["buckets"][0]["params"].append("decoder.weight")
    assert "names parameter 'decoder.weight', which this model does not have" in _problems(d, structure)


def test_bucket_op_must_match_placement(structure):
    d = _plan_dict(structure)
    d["buckets"][0]["op"] = "all_reduce"
    assert "needs reduce_scatter" in _problems(d, structure)


def test_frozen_parameter_in_bucket():
    m = models.make("frozen")
    s = discover(m)
    d = json.loads(ddp_plan(s, 2).to_json())
    d["buckets"][0]["params"].append("embed.weight")
    assert "frozen parameter 'embed.weight'" in _problems(d, s)


def test_sharded_unit_without_group(structure):
    d = _plan_dict(structure)
    d["gather_groups"][0]["units"] = d["gather_groups"][0]["units"][1:]
    assert "is in no gather group" in _problems(d, structure)


def test_replicated_unit_in_gather_group(structure):
    d = _plan_dict(structure)
    d["units"][0]["placement"] = "replicate"
    msg = _problems(d, structure)
    assert "'wte', which is replicated" in msg


def test_group_mixing_residencies(structure):
    d = _plan_dict(structure)
    g = next(g for g in d["gather_groups"] if len(g["units"]) > 1)
    unit = next(u for u in d["units"] if u["name"] == g["units"][0])
    unit["residency"] = "persistent"
    assert "mixes residencies" in _problems(d, structure)


def test_bad_field_values_name_their_path(structure):
    d = _plan_dict(structure)
    d["units"][3]["placement"] = "spread"
    d["gather_groups"][0]["prefetch"]["forward"] = -1
    d["buckets"][1]["op"] = "allreduce"
    d["unitz"] = []
    with pytest.raises(PlanError) as e:
        Plan.from_dict(d)
    msg = str(e.value)
    assert "units[3].placement: expected one of replicate, shard; got \"spread\"" in msg
    assert "gather_groups[0].prefetch.forward: expected a non-negative integer" in msg
    assert "buckets[1].op" in msg
    assert "unitz: unknown field" in msg


def test_zero_dim_parameter_cannot_be_sharded():
    m = torch.nn.Module()
    m.scale = torch.nn.Parameter(torch.ones(()))
    m.lin = torch.nn.Linear(3, 3)
    s = discover(m)
    d = json.loads(fsdp_plan(s, 2).to_json())
    assert next(u for u in d["units"] if u["name"] == ROOT_UNIT)["placement"] == "replicate"
    next(u for u in d["units"] if u["name"] == ROOT_UNIT)["placement"] = "shard"
    assert "0-dimensional" in _problems(d, s)


def test_unknown_plan_name_fails_before_touching_the_model():
    m = models.make("mlp")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(PlanError, match="neither one of 'auto', 'ddp', 'fsdp', 'zero2' nor an existing plan file"):
        AutoDist(m, plan="fdsp")
    with pytest.raises(TypeError, match="plan must be one of"):
        AutoDist(m, plan=3)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def _with_offload(structure, *fragments, world=2):
    """An fsdp plan for ``world`` ranks with offload fragments (param, state, start, end)."""
    d = _plan_dict(structure, world=world)
    d["offload"] = [{"param": p, "state": s, "fragment": [a, b]} for p, s, a, b in fragments]
    return d


def test_offload_fragment_beyond_the_state_a_rank_holds(structure):
    # blocks.0.fc1.weight: 96 x 24, sharded over 2 ranks -> a rank holds at most 48 rows = 1152 elements
    msg = _problems(_with_offload(structure, ("blocks.0.fc1.weight", "exp_avg", 0, 1153)), structure)
    assert (
        "offload[0].fragment = [0, 1153] ends beyond the optimizer state of 'blocks.0.fc1.weight': a rank holds at "
        "most 1152 elements of it (dim-0 shards of 96 rows over 2 ranks); keep the fragment within [0, 1152]"
    ) in msg
    msg = _problems(_with_offload(structure, ("blocks.0.ln1.bias", "exp_avg", 30, 40), world=2), structure)
    assert "offload[0].fragment = [30, 40] starts beyond the optimizer state of 'blocks.0.ln1.bias'" in msg
    d = json.loads(ddp_plan(structure, 2).to_json())
    d["offload"] = [{"param": "blocks.0.fc1.weight", "state": "exp_avg", "fragment": [0, 2304]}]
    validate_plan(Plan.from_dict(d), structure, world_size=2)  # replicated: the whole 96 x 24 state


def test_overlapping_offload_fragments_of_one_state(structure):
    d = _with_offload(
        structure,
        ("blocks.0.fc1.weight", "exp_avg", 0, 500),
        ("blocks.0.fc1.weight", "exp_avg_sq", 200, 700),  # another state: no overlap
        ("blocks.0.fc1.weight", "exp_avg", 500, 800),  # adjacent: fine
        ("blocks.0.fc1.weight", "exp_avg", 700, 900),
    )
    with pytest.raises(PlanError) as e:
        Plan.from_dict(d)
    assert str(e.value).count("overlaps") == 1
    assert (
        "offload[3].fragment: [700, 900] overlaps offload[2].fragment (which ends at 800) of the same state "
        "(blocks.0.fc1.weight / exp_avg); make the fragments disjoint or merge them into one"
    ) in str(e.value)


def test_offload_fragment_naming_state_optimizers_do_not_keep(structure):
    with pytest.raises(PlanError) as e:
        Plan.from_dict(_with_offload(structure, ("wte.weight", "exp_avgsq", 0, 10), ("wpe.weight", "step", 0, 1)))
    msg = str(e.value)
    assert "offload[0].state: 'exp_avgsq' is not state that torch's optimizers keep per element (acc_delta, ax, " in msg
    assert "fix the name, or, if your optimizer keeps state under it, list it in the plan's optimizer_states" in msg
    assert "offload[1].state: 'step' is a scalar; only per-element optimizer state can be offloaded" in msg
    for state in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg", "acc_delta"):
        Plan.from_dict(_with_offload(structure, ("wte.weight", state, 0, 10)))
    d = _with_offload(structure, ("wte.weight", "lion_ema", 0, 10))
    d["optimizer_states"] = ["lion_ema"]  # declared by the plan: a third-party optimizer's state
    Plan.from_dict(d)


def test_negative_bucket_rebuild_cap_is_refused_and_zero_is_kept(structure):
    d = json.loads(ddp_plan(structure, 2).to_json())
    d["rebuild_buckets"]["cap_bytes"] = -1
    with pytest.raises(PlanError, match=r"rebuild_buckets.cap_bytes: expected a non-negative number of bytes "
                                        r"\(DDP's default: 26214400\); got -1"):
        Plan.from_dict(d)
    d["rebuild_buckets"]["cap_bytes"] = 0  # one parameter per bucket
    assert Plan.from_dict(d).rebuild_buckets.cap_bytes == 0


def test_prefetch_window_longer_than_the_model(structure):
    d = _plan_dict(structure)
    d["gather_groups"][0]["prefetch"]["forward"] = 10**9
    assert (
        f"gather_groups[0].prefetch.forward = 1000000000: a prefetch window counts units and this model has "
        f"{len(structure.units)}; use at most {len(structure.units)}"
    ) in _problems(d, structure)
    d["gather_groups"][0]["prefetch"]["forward"] = len(structure.units)
    validate_plan(Plan.from_dict(d), structure, world_size=2)


def test_plan_for_a_model_of_another_width_is_refused(tmp_path):
    narrow, wide = models.MLP(dims=(13, 37, 29, 7)), models.MLP(dims=(13, 74, 29, 7))
    model = AutoDist(narrow, plan="fsdp")
    save_plan(model.plan, tmp_path / "plan.json")  # the plan in force records the shapes it was made for
    model.close()
    with pytest.raises(PlanError) as e:
        AutoDist(wide, plan=str(tmp_path / "plan.json"))
    assert (
        "param_shapes: 3 parameter(s) have other shapes in this model than in the plan (e.g. 'layers.0.weight': "
        "[37, 13] in the plan, [74, 13] here); the plan was made for a model of another size: regenerate it for "
        "this one"
    ) in str(e.value)


def test_plan_file_without_recorded_shapes_still_loads(tmp_path, structure):
    d = _plan_dict(structure)
    d.pop("param_shapes", None)
    d.pop("optimizer_states", None)
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert load_plan(tmp_path / "old.json", structure, world_size=2).param_shapes == {}


def test_float_schema_version(structure):
    d = _plan_dict(structure)
    d["schema_version"] = 1.0
    with pytest.raises(PlanError, match=r'schema_version: expected an integer such as 2, got 1.0; write "schema_version": 2'):
        Plan.from_dict(d)


def test_deeply_nested_json_is_a_plan_error(tmp_path, structure):
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PlanError, match="nests JSON arrays or objects too deeply to be read"):
        load_plan(tmp_path / "deep.json")
    d = _plan_dict(structure)
    deep = {}
    for _ in range(500):  # readable, but deeper than any plan field
        deep = {"x": deep}
    d["provenance"] = deep
    (tmp_path / "deep2.json").write_text(json.dumps(d))
    with pytest.raises(PlanError, match="provenance: nested deeper than 32 levels"):
        load_plan(tmp_path / "deep2.json")


def test_version_1_plan_files_load_with_no_recomputation_and_one_micro_batch(structure):
    d = _plan_dict(structure)
    d["schema_version"] = 1
    for key in ("recompute", "grad_accum_steps"):
        d.pop(key)
    for u in d["units"]:
        u.pop("accumulate")
    plan = Plan.from_dict(d)
    validate_plan(plan, structure, world_size=2)
    assert plan.recompute == [] and plan.grad_accum_steps == 1
    assert {u.accumulate for u in plan.units} == {"unsharded"}


def test_recomputation_and_accumulation_round_trip(structure):
    d = _plan_dict(structure)
    d["recompute"] = ["blocks.0"]
    d["grad_accum_steps"] = 4
    d["units"][1]["accumulate"] = "sharded"
    plan = Plan.from_dict(d)
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.recompute == ["blocks.0"] and plan.grad_accum_steps == 4


def test_recomputing_something_that_is_not_a_block_is_refused(structure):
    d = _plan_dict(structure)
    d["recompute"] = ["blocks.0.qkv", "nope"]
    msg = _problems(d, structure)
    assert "recompute[0] = 'blocks.0.qkv' is not a block of this model" in msg
    assert "recompute[1] = 'nope'" in msg


def test_bad_accumulation_values_are_refused(structure):
    d = _plan_dict(structure)
    d["grad_accum_steps"] = 0
    d["units"][0]["accumulate"] = "sometimes"
    with pytest.raises(PlanError) as e:
        Plan.from_dict(d)
    assert "grad_accum_steps: expected the number of micro-batches" in str(e.value)
    assert "accumulate: expected one of unsharded, sharded" in str(e.value)


def test_a_bucket_mixing_accumulation_modes_is_refused(structure):
    d = _plan_dict(structure)
    d["buckets"] = [{"params": [p for b in d["buckets"] for p in b["params"] if p.startswith("blocks.0")], "op": "reduce_scatter"}] + [
        b for b in d["buckets"] if not any(p.startswith("blocks.0") for p in b["params"])
    ]
    for u in d["units"]:
        if u["name"] == "blocks.0.qkv":
            u["accumulate"] = "sharded"
    assert "accumulate gradients differently" in _problems(d, structure)
