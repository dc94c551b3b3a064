"""What a user's own script shows of AutoDist: without any logging configuration the plan in force
and the step lines reach stderr once; a configuration of the user's decides otherwise."""

import sys
import textwrap

import pytest

from harness import repo_env, run_command

TRAIN = """
import logging
import sys

import torch
from autodist import AutoDist

{configure}
torch.manual_seed(0)
model = AutoDist(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)), plan="ddp", log_every=2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
model.close()
print("done", flush=True)
"""


def _run(tmp_path, configure: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN.format(configure=configure)))
    out = run_command([sys.executable, script], env=repo_env(OMP_NUM_THREADS="1"), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stderr


def test_a_script_that_configures_no_logging_sees_the_plan_and_the_step_lines_once(tmp_path):
    err = _run(tmp_path, "")
    lines = err.splitlines()
    assert sum(line.startswith("autodist: plan builtin:ddp in force (source: built-in;") for line in lines) == 1, err
    assert sum(line.startswith("autodist: step 2 ") for line in lines) == 1, err
    assert sum(line.startswith("autodist: step 3 ") for line in lines) == 1, err  # the last, logged at close()
    # only what a user must see: not the process group's setup
    assert "no torchrun environment" not in err, err


@pytest.mark.parametrize("configure", [
    'logging.basicConfig(level=logging.INFO, format="[mine] %(name)s: %(message)s")',
    'h = logging.StreamHandler(sys.stderr); h.setFormatter(logging.Formatter("[mine] %(name)s: %(message)s")); '
    'logging.getLogger("autodist").addHandler(h); logging.getLogger("autodist").setLevel(logging.INFO)',
])
def test_a_users_own_logging_configuration_shows_each_line_once_in_its_format(tmp_path, configure):
    err = _run(tmp_path, configure)
    lines = err.splitlines()
    assert sum("plan builtin:ddp in force" in line for line in lines) == 1, err
    assert sum("autodist: step 3 " in line for line in lines) == 1, err
    assert all(line.startswith("[mine] autodist: autodist:") for line in lines if "plan builtin:ddp in force" in line or "step 3 " in line), err


@pytest.mark.parametrize("configure", [
    'logging.getLogger("autodist").setLevel(logging.WARNING)',
    "logging.basicConfig()",  # the user's own configuration, at its default level WARNING
])
def test_a_level_above_info_silences_the_announcements(tmp_path, configure):
    err = _run(tmp_path, configure)
    assert "autodist: plan" not in err and "autodist: step" not in err, err
