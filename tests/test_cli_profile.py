"""``autodist plan --profile``: planning for a machine one does not have from a profile taken there
(issue 44: a plan for GPUs made elsewhere must not present this machine's compute times as the GPU's)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from autodist.cli import main
from autodist.measure.trace import profile_model
from autodist.plan import load_plan
from autodist.structure import discover

TINY = '''\
import torch


def build():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def other():
    return torch.nn.Sequential(torch.nn.Linear(16, 8))
'''
ARGS = ["--model", "tinyprof:build", "--input-shape", "4,16", "--world-size", "4", "--interconnect", "nvlink4"]


@pytest.fixture
def carried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The tiny model's profile as if carried from a GPU machine (its device says cuda), and a
    writer for variants of it."""
    (tmp_path / "tinyprof.py").write_text(TINY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AUTODIST_CACHE_DIR", str(tmp_path / "cache"))
    import tinyprof

    model = tinyprof.build()
    prof = profile_model(model, discover(model), (torch.randn(4, 16),), device=torch.device("cpu"), repeats=2)
    prof = dataclasses.replace(prof, device="cuda")

    def write(name: str, scale: float = 1.0) -> Path:
        units = [dataclasses.replace(u, fwd_s=u.fwd_s * scale, bwd_s=u.bwd_s * scale) for u in prof.units]
        path = tmp_path / name
        path.write_text(dataclasses.replace(prof, units=units).to_json())
        return path

    return write


def _plan(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_a_plan_from_a_carried_profile_uses_its_times_and_says_where_they_come_from(carried, tmp_path, capsys):
    fast, slow = carried("fast.json"), carried("slow.json", scale=100.0)
    rc, text = _plan([*ARGS, "--profile", str(fast), "--out", str(tmp_path / "p.json")], capsys)
    assert rc != 0 and "measured on cuda" in text and "--memory-limit" in text  # no budget of this machine's
    rc, text = _plan([*ARGS, "--profile", str(fast), "--memory-limit", "70GiB", "--out", str(tmp_path / "fast-plan.json")], capsys)
    assert rc == 0, text
    assert f"the profile {fast} (compute times measured on cuda" in text
    rc, text = _plan([*ARGS, "--profile", str(slow), "--memory-limit", "70GiB", "--out", str(tmp_path / "slow-plan.json")], capsys)
    assert rc == 0, text
    fast_plan, slow_plan = load_plan(tmp_path / "fast-plan.json"), load_plan(tmp_path / "slow-plan.json")
    assert fast_plan.device == slow_plan.device == "cuda"
    # planned from the file's compute times, not from a measurement here (which would give both
    # commands the same prediction); the step also holds what the units' times do not scale
    # (collectives, the optimizer), so it grows by less than the units' 100x
    assert slow_plan.predicted["step_seconds"] > 5 * fast_plan.predicted["step_seconds"]


def test_a_profile_of_another_model_or_input_is_refused_with_the_reason(carried, tmp_path, capsys):
    path = carried("p.json")
    other = ["--model", "tinyprof:other", *ARGS[2:]]
    rc, text = _plan([*other, "--profile", str(path), "--memory-limit", "1GiB", "--out", str(tmp_path / "o.json")], capsys)
    assert rc != 0 and "is of another model" in text
    shape = [*ARGS[:3], "8,16", *ARGS[4:]]
    rc, text = _plan([*shape, "--profile", str(path), "--memory-limit", "1GiB", "--out", str(tmp_path / "s.json")], capsys)
    assert rc != 0 and "(4, 16):float32" in text and "(8, 16):float32" in text
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"schema_version": 2}))
    rc, text = _plan([*ARGS, "--profile", str(broken), "--memory-limit", "1GiB", "--out", str(tmp_path / "b.json")], capsys)
    assert rc != 0 and "is not a profile this version reads" in text
