"""Replicated data parallelism (issue 2): parity with a single-process reference on 2 ranks.

Tolerance: float32 all-reduce sums in a different order than the reference's single backward, and
the difference compounds over a few optimizer steps; 2e-5 absolute holds for these models with SGD
and AdamW (AdamW only on models whose parameters all get nonzero gradients: Adam divides by
sqrt(v), which turns rounding noise on a zero gradient into a full-size update).
"""

import pytest

from parity import Case, check, run_case

ATOL = 2e-5

CASES = {
    "ddp-buckets-sgd": Case(model="mlp", plan="ddp"),
    "ddp-buckets-adamw": Case(model="mlp", plan="ddp", optim="adamw"),
    "bucket-per-param": Case(model="mlp", plan={"placement": "replicate", "buckets": "per_param"}),
    "one-bucket-adamw": Case(model="mlp", plan={"placement": "replicate", "buckets": "one"}, optim="adamw"),
    "batchnorm": Case(model="convbn", plan="ddp", steps=4),
    "batchnorm-adamw": Case(model="convbn", plan={"placement": "replicate", "buckets": "per_param"}, optim="adamw"),
    "unused-params": Case(model="unused", plan="ddp", steps=4),
    "unused-params-adamw": Case(model="unused", plan={"placement": "replicate", "buckets": "one"}, optim="adamw", steps=4),
    "no-sync-accumulation": Case(model="mlp", plan="ddp", accumulate=3),
    "no-sync-accumulation-bn": Case(model="convbn", plan={"placement": "replicate", "buckets": "per_param"}, accumulate=2),
    "grads-kept-across-steps": Case(model="mlp", plan="ddp", zero_grad="never"),
    # the bucket views become the gradients at the start of backward, not of forward
    "zero-grad-before-backward": Case(model="mlp", plan="ddp", zero_grad_at="before_backward", steps=4),
    "zero-grad-before-backward-unused": Case(model="unused", plan="ddp", zero_grad_at="before_backward", steps=4),
    "grads-zeroed-in-place": Case(model="mlp", plan={"placement": "replicate", "buckets": "one"}, zero_grad="zeros"),
    "clip-grad-norm": Case(model="mlp", plan="ddp", clip=0.05),
    "tied-embeddings": Case(model="gpt", plan="ddp"),
    "frozen": Case(model="frozen", plan="ddp"),
    "branches": Case(model="branchy", plan="ddp", steps=4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_replicated_training_matches_single_process(world2, name):
    check(world2.run(run_case, CASES[name]), atol=ATOL)


def test_replicated_training_on_four_ranks(world4):
    check(world4.run(run_case, Case(model="mlp", plan="ddp", per_rank=2)), atol=ATOL)
