"""Each example trains for 2 steps on 2 ranks under torchrun (plan="auto", a fresh cache)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXAMPLES = {
    "gpt": ["--steps", "2", "--batch-size", "2", "--seq", "16", "--vocab", "128", "--d-model", "32", "--layers", "2", "--heads", "2", "--log-every", "1"],
    "mlp": ["--steps", "2", "--batch-size", "4", "--width", "64", "--depth", "2"],
    "resnet": ["--steps", "2", "--batch-size", "2", "--image-size", "16"],
}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_trains_two_steps_on_two_ranks(name, tmp_path):
    if name == "resnet":
        pytest.importorskip("torchvision")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "examples", f"{name}.py"), *EXAMPLES[name]]
    env = dict(os.environ, AUTODIST_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step    2" in out.stdout or "step    1" in out.stdout
    assert "plan in force: auto:" in out.stdout
    assert "autodist: plan chosen" in out.stderr or "autodist: plan" in out.stderr
