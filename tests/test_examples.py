"""The examples under torchrun on 2 ranks (plan="auto", a fresh cache), small and short; and the
README's Quickstart command as written, with flags appended for a small model and few steps.

Each launch uses ``torchrun --standalone`` (a free rendezvous port: other jobs may be running) and
puts this checkout first on ``PYTHONPATH`` (an example's own directory is its ``sys.path[0]``, so it
would otherwise import whichever autodist is installed).
"""

import os
import sys

import pytest

import readme
from harness import repo_env, run_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMALL = {
    "gpt": ["--steps", "3", "--batch-size", "2", "--seq", "16", "--vocab", "128", "--d-model", "32", "--layers", "2",
            "--heads", "2", "--log-every", "2"],
    "mlp": ["--steps", "3", "--batch-size", "4", "--width", "64", "--depth", "2", "--samples", "16", "--log-every", "2"],
    "resnet": ["--steps", "3", "--batch-size", "2", "--image-size", "16", "--log-every", "2"],
}


def _torchrun(argv, tmp_path):
    assert argv[0] == "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *argv[1:]]
    env = repo_env(AUTODIST_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    return run_command(cmd, env=env, timeout=300, cwd=ROOT)


def _check_small_run(out):
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step    1  loss" in out.stdout
    assert "plan in force: auto:" in out.stdout
    # AutoDist's own step line: every second step, and the last at exit
    logged = [line.split("autodist: ")[1].split("  ")[0] for line in out.stderr.splitlines() if "autodist: step " in line]
    assert logged == ["step 2", "step 3"], out.stderr[-3000:]
    assert "initialised process group" in out.stderr
    assert not [line for line in (out.stdout + out.stderr).splitlines() if "ERROR" in line], out.stderr[-3000:]


@pytest.mark.parametrize("name", ["mlp", "resnet"])
def test_example_trains_on_two_ranks_and_logs_autodist_step_lines(name, tmp_path):
    if name == "resnet":
        pytest.importorskip("torchvision")
    _check_small_run(_torchrun(["torchrun", "--nproc_per_node", "2", f"examples/{name}.py", *SMALL[name]], tmp_path))


def test_the_readme_quickstart_command_trains(tmp_path):
    (quickstart,) = readme.of_kind("example")
    out = _torchrun(readme.with_overrides(quickstart, SMALL["gpt"]), tmp_path)
    _check_small_run(out)
    assert out.stderr.count("initialised process group") == 1  # rank 0 only
    assert "last step (3): " in out.stdout


HIDE_TORCHVISION = """
import runpy
import sys

sys.modules["torchvision"] = None  # as if it were not installed: importing it raises ImportError
sys.argv = ["examples/resnet.py"]
runpy.run_path("examples/resnet.py", run_name="__main__")
"""


def test_an_example_without_its_optional_dependency_says_which_in_one_line(tmp_path):
    out = run_command([sys.executable, "-c", HIDE_TORCHVISION], env=repo_env(), timeout=300, cwd=ROOT)
    assert out.returncode == 1
    assert (out.stdout + out.stderr).strip() == "examples/resnet.py needs torchvision: pip install 'autodist[vision]'"
