"""Activation checkpointing done by the model (issue 11): blocks whose forward runs again during
backward train exactly like the single-process reference under every built-in plan and under random
plans, with reentrant, non-reentrant, selective and wrapper-based checkpointing; a recomputed
sharded unit gathers as often as its residency implies and reduces once.

Tolerance: float32, as test_shard (2e-5): a recomputed forward is bitwise the original.
"""

import pytest

from parity import RESIDENCY_PLANS, Case, check_cases, run_case, run_cases

ATOL = 2e-5
MODES = ["nonreentrant", "reentrant", "selective", "wrapper", "alternate"]
PLANS = {
    **RESIDENCY_PLANS,
    "after-backward-window0": {"residency": "after_backward", "grouping": "unit", "window": 0},
    "mixed": {"placement": "mixed", "grouping": "unit"},
    "random0": {"random": 0},
    "random1": {"random": 1},
    "random2": {"random": 2},
}


@pytest.mark.parametrize("mode", MODES)
def test_user_checkpointed_blocks_match_single_process_under_every_plan(world2, mode):
    names = list(PLANS)
    cases = [Case(model=f"gpt-ckpt-{mode}", plan=PLANS[n], steps=3) for n in names]
    check_cases(world2.run(run_cases, cases, timeout=400), names, atol=ATOL)


SHARDED = ["fsdp", "zero2", "persistent", "after-backward-window0", "random1"]


@pytest.mark.parametrize("mode", ["reentrant", "nonreentrant", "alternate"])
def test_user_checkpointed_blocks_under_nccls_launch_policy(world2, mode):
    """On NCCL a plan that gathers launches buckets only at sharded-unit backward events
    ("sampled"; engine.py [Note: settled parameters]). Reentrant checkpointing runs a block's first
    forward without gradients: before the fix its buckets were launched before its recomputation,
    and its parameters got no gradient (the first GPU runs, plan fsdp and zero2)."""
    cases = [Case(model=f"gpt-ckpt-{mode}", plan=PLANS[n], steps=3, launch_policy="sampled") for n in SHARDED]
    check_cases(world2.run(run_cases, cases, timeout=400), SHARDED, atol=ATOL)


def test_user_checkpointed_blocks_on_four_ranks(world4):
    names = ["fsdp-reentrant", "fsdp-nonreentrant", "random-selective", "planned-gpt", "planned-mlp-mixed"]
    cases = [
        Case(model="gpt-ckpt-reentrant", plan="fsdp", per_rank=2),
        Case(model="gpt-ckpt-nonreentrant", plan="fsdp", per_rank=2),
        Case(model="gpt-ckpt-selective", plan={"random": 3}, per_rank=2),
        Case(model="gpt", plan={"grouping": "block", "recompute": "all"}, per_rank=2),
        Case(model="mlp", plan={"placement": "mixed", "grouping": "unit", "recompute": "all"}, per_rank=2),
    ]
    check_cases(world4.run(run_cases, cases, timeout=400), names, atol=ATOL)


def test_checkpointing_with_gradient_accumulation_and_bf16(world2):
    names = ["accumulate-fsdp", "accumulate-persistent", "bf16-fsdp", "bf16-ddp-reentrant", "bf16-mixed-reentrant"]
    cases = [
        Case(model="gpt-ckpt-reentrant", plan="fsdp", accumulate=2),
        Case(model="gpt-ckpt-selective", plan={"residency": "persistent", "grouping": "block"}, accumulate=3),
        Case(model="gpt-ckpt-nonreentrant", plan="fsdp", bf16=True),
        # replicated compute copies are registered for the whole forward and backward: a reentrant
        # recomputation reads them too (see [Note: replicated parameters swap at the root])
        Case(model="gpt-ckpt-reentrant", plan="ddp", bf16=True),
        Case(model="gpt-ckpt-reentrant", plan=PLANS["mixed"], bf16=True),
    ]
    results = world2.run(run_cases, cases, timeout=600)
    check_cases([r[:2] for r in results], names[:2], atol=ATOL)
    check_cases([r[2:] for r in results], names[2:], atol=1e-4)


def _counts(model: str, plan, steps: int = 3) -> dict:
    r = run_case(Case(model=model, plan=plan, steps=steps))
    return {**r["stats"], **{f"rt_{k}": v for k, v in r["runtime"].items()}}


def counts_with_and_without_checkpointing(plan) -> list[dict]:
    return [_counts("gpt", plan), _counts("gpt-ckpt-nonreentrant", plan), _counts("gpt-ckpt-reentrant", plan)]


@pytest.mark.parametrize("plan", ["fsdp", "zero2", {"residency": "persistent", "grouping": "block"}], ids=["fsdp", "zero2", "persistent"])
def test_recomputed_units_gather_as_their_residency_implies_and_reduce_once(world2, plan):
    for rank_counts in world2.run(counts_with_and_without_checkpointing, plan):
        plain, nonre, re = rank_counts
        for ck in (nonre, re):
            assert ck["all_gathers"] == plain["all_gathers"], (plain, ck)
            assert ck["reduce_scatters"] == plain["reduce_scatters"], (plain, ck)
            assert ck["all_reduces"] == plain["all_reduces"], (plain, ck)
            assert ck["rt_recomputations"] > 0, ck
        # recomputation gathers are prefetched: after the first step nothing is gathered on demand
        assert nonre["on_demand_gathers"] <= plain["on_demand_gathers"] + 3, (plain, nonre)


def hf_gradient_checkpointing(arch: str, plan: str, reentrant: bool, device: str = "cpu") -> float:
    """A Hugging Face model with ``gradient_checkpointing_enable()``, trained against a
    single-process reference (the mean of the per-rank losses, as the ranks' average gradient) on
    ``device`` (tools/gpu_check.py runs it on CUDA)."""
    import copy

    import torch
    import torch.distributed as dist
    import transformers

    from autodist import AutoDist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                       num_key_value_heads=2, vocab_size=64, max_position_embeddings=16)
        model = transformers.LlamaForCausalLM(cfg)
    model.to(device).train()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    wrapped = AutoDist(model, plan=plan)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        ids = torch.randint(0, 64, (2 * world, 8), generator=torch.Generator().manual_seed(step)).to(device)
        mine = ids[rank * 2 : (rank + 1) * 2]
        wrapped(input_ids=mine, labels=mine).loss.backward()
        (sum(ref(input_ids=ids[r * 2 : (r + 1) * 2], labels=ids[r * 2 : (r + 1) * 2]).loss for r in range(world)) / world).backward()
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    if plan != "ddp":  # a replicated plan installs no module hooks that would count them
        assert wrapped.runtime.stats.recomputations > 0
    sd = wrapped.state_dict()
    worst = max((sd[k].float() - v.float()).abs().max().item() for k, v in ref.state_dict().items() if k in sd)
    wrapped.close()
    return worst


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("plan", ["fsdp", "zero2"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "nonreentrant"])
def test_hugging_face_gradient_checkpointing_matches_single_process(world2, arch, plan, reentrant):
    pytest.importorskip("transformers", reason="transformers is not installed (optional; CI need not install it)")
    for worst in world2.run(hf_gradient_checkpointing, arch, plan, reentrant, timeout=300):
        assert worst <= 1e-5, worst


# ---- recomputation the plan asks for --------------------------------------------------------------
PLANNED = {
    # gpt: blocks hold several units
    "gpt-fsdp": Case(model="gpt", plan={"grouping": "block", "recompute": "all"}),
    "gpt-persistent": Case(model="gpt", plan={"residency": "persistent", "grouping": "block", "recompute": "all"}),
    "gpt-per-unit-window2": Case(model="gpt", plan={"grouping": "unit", "window": 2, "recompute": "all"}),
    "gpt-replicated": Case(model="gpt", plan={"placement": "replicate", "recompute": "all"}),
    # mlp: each block is one unit that owns its parameters (the recomputation must swap them in itself)
    "mlp-mixed": Case(model="mlp", plan={"placement": "mixed", "grouping": "unit", "recompute": "all"}),
    "mlp-after-backward": Case(model="mlp", plan={"residency": "after_backward", "grouping": "unit", "recompute": "all"}),
    "mlp-persistent-adamw": Case(model="mlp", plan={"residency": "persistent", "recompute": "all"}, optim="adamw"),
    "mlp-replicated": Case(model="mlp", plan={"placement": "replicate", "recompute": "all"}),
    # BatchNorm in every block: the running statistics and batch counters must be updated once per
    # forward, as without recomputation (compared on rank 0, whose buffers DDP's semantics keep)
    "resnet-replicated": Case(model="resnet", plan={"placement": "replicate", "recompute": "all"}),
    "resnet-sharded": Case(model="resnet", plan={"grouping": "block", "recompute": "all"}),
    "resnet-mixed-accumulate": Case(model="resnet", plan={"placement": "mixed", "grouping": "unit", "recompute": "all"}, accumulate=2),
}


def test_blocks_the_plan_recomputes_match_single_process(world2):
    names = list(PLANNED)
    results = world2.run(run_cases, [PLANNED[n] for n in names], timeout=400)
    check_cases(results, names, atol=ATOL)
    for per_rank in results:
        counts = {n: r["runtime"]["recomputed_blocks"] for n, r in zip(names, per_rank)}
        assert all(c > 0 for c in counts.values()), counts


def hf_blocks_the_plan_recomputes(arch: str, placement: str) -> dict:
    """A Hugging Face model whose layers the plan recomputes, with its cache on (``use_cache`` is on by
    default in training too) and a padding mask, trained against a single-process reference that
    recomputes nothing; then the layers' checkpointing flags after ``close()`` and a cache from a
    forward without gradients. See [Note: a Hugging Face layer's cache under recomputation]."""
    import copy

    import torch
    import torch.distributed as dist
    import transformers

    from autodist import AutoDist
    from parity import make_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    elif arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=64, max_position_embeddings=16))
    else:
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
            relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    model.train()
    ref = copy.deepcopy(model)
    plan = make_plan(model, world, placement=placement, grouping="block", recompute="all")
    wrapped = AutoDist(model, plan=plan)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def batch(ids: torch.Tensor, mask: torch.Tensor) -> dict:
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}

    for step in range(3):
        ids = torch.randint(1, 64, (2 * world, 12), generator=torch.Generator().manual_seed(step))
        mask = torch.ones_like(ids)
        mask[1::2, 9:] = 0  # every rank's second sequence padded
        wrapped(**batch(ids[2 * rank : 2 * rank + 2], mask[2 * rank : 2 * rank + 2])).loss.backward()
        (sum(ref(**batch(ids[2 * r : 2 * r + 2], mask[2 * r : 2 * r + 2])).loss for r in range(world)) / world).backward()
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    recomputed = wrapped.runtime.stats.recomputed_blocks
    wrapped.eval()
    with torch.no_grad():  # generation's forward: the cache is kept
        out = wrapped(**batch(ids[:2], mask[:2]), use_cache=True)
    wrapped.train()
    cache = out["cache"] if "cache" in out else out.get("past_key_values")  # its name before transformers 5
    sd = wrapped.state_dict()
    worst = max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items() if k in sd)
    wrapped.close()
    flags = sorted(n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False)
                   or "_gradient_checkpointing_func" in m.__dict__)
    return {"worst": worst, "recomputed": recomputed, "cache": cache.get_seq_length() if cache is not None else 0,
            "flags_after_close": flags}


@pytest.mark.parametrize("arch", ["gpt2", "llama", "t5"])
@pytest.mark.parametrize("placement", ["shard", "replicate"])
def test_hugging_face_layers_the_plan_recomputes_keep_their_cache_out(world2, arch, placement):
    pytest.importorskip("transformers", reason="transformers is not installed (optional; CI need not install it)")
    for r in world2.run(hf_blocks_the_plan_recomputes, arch, placement, timeout=300):
        assert r["worst"] <= ATOL, r
        assert r["recomputed"] > 0, r
        assert r["cache"] == 12, r
        assert r["flags_after_close"] == [], r
