"""What ``autodist check`` stores for the machine: the decision, tested with injected timings (the
measurement is replaced; nothing here times anything), and what a stored record may do."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest

from autodist.cost.fidelity import MAX_REPEAT_PCT_APART, MAX_SEED_MARGIN, FidelityRecord, refusal
from autodist.planner.cache import Cache
from autodist.sched.search import SearchConfig

TINY_MODEL = '''\
import torch


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
'''


@pytest.fixture(autouse=True)
def no_default_process_group():
    """``autodist check``'s rank initialises the default process group itself (a world of one
    here); an earlier test of the session may have left one (AutoDist run without torchrun
    initialises a world of one and leaves it, as a user's own would be left)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    yield


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_with_injected_timings(tmp_path: Path, monkeypatch, *, repeat_factor: float, error: float,
                                 sweeps: list | None = None) -> dict:
    """One rank of ``autodist check`` (a world of one) on a tiny model, every plan 'measured' at its
    prediction times ``1 + error``, and the plan measured a second time at ``repeat_factor`` times
    its first measurement. Returns the check's payload; ``sweeps`` gets the ``base`` of each comm
    sweep the check ran."""
    import autodist.measure.fidelity as measure_fidelity
    import autodist.measure.sweep as measure_sweep
    import autodist.planner.online  # noqa: F401  (imported first: it binds the real sweep, not the patched one below)
    from autodist.cli import build_parser, cmd_check
    from autodist.cost.comm import CommModel

    (tmp_path / "tinycheckmodel.py").write_text(TINY_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AUTODIST_COMM_SEED", raising=False)  # the session's seed is for measured comm models

    def sweep(group, device, *, needs, base):
        if sweeps is not None:
            sweeps.append(base)
        return CommModel.analytic(1, bandwidth_bytes_s=1e9, latency_s=1e-5, backend="gloo")

    monkeypatch.setattr(measure_sweep, "sweep", sweep)

    def measure_plans(checks, wrap, batches, loss, *, steps, passes, progress=None, **_):
        first = {}
        for c in checks:
            _, eq, other = c.name.partition("=")
            t = first[other] * repeat_factor if eq else c.predicted.step_s * (1 + error)
            first.setdefault(c.name, t)
            c.times = [t] * (steps * passes)
            c.peak_bytes = c.predicted.peak_bytes
            if progress is not None:
                progress(c)

    monkeypatch.setattr(measure_fidelity, "measure_plans", measure_plans)
    out = tmp_path / "payload.json"
    args = build_parser().parse_args([
        "check", "--worker", "--out", str(out), "--model", "tinycheckmodel:build", "--input-shape", "4,16",
        "--plans", "3", "--steps", "2", "--cache-dir", str(tmp_path / "cache"),
    ])
    assert cmd_check(args) == 0
    return json.loads(out.read_text())


def test_a_check_whose_repeated_measurement_disagrees_is_not_stored_and_says_why(tmp_path, monkeypatch):
    from autodist.cli import render_check

    payload = _check_with_injected_timings(tmp_path, monkeypatch, repeat_factor=1.12, error=0.02)
    rep = payload["repeated"]
    assert rep and max(r["pct_apart"] for r in rep) == pytest.approx(200 * 0.12 / 2.12)
    assert payload["record_path"] is None
    assert not [e for e in Cache(tmp_path / "cache").entries() if e.kind == "fidelity"]
    a, b = max(rep, key=lambda r: r["pct_apart"])["plans"]
    assert payload["refused"].startswith(f"the same plan, measured twice ({a} and {b}), came out 11.3% apart, more than the 5%")
    text = render_check(payload)
    assert f"Not stored: {payload['refused']}." in text and "Stored for this machine" not in text
    assert "`autodist cache clear --kind fidelity` removes it" in text


def test_a_check_refused_for_its_error_warns_of_no_stored_record(tmp_path, monkeypatch, caplog):
    """A check whose median error is past the cap is not stored; it said so and then warned that
    "this machine's fidelity record ... is not used", as if one had been stored (the report took
    its margins from the record it had just refused)."""
    from autodist.cli import render_check

    with caplog.at_level(logging.WARNING, logger="autodist"):
        payload = _check_with_injected_timings(tmp_path, monkeypatch, repeat_factor=1.0, error=0.4)
    assert "median step-time error" in payload["refused"] and payload["record_path"] is None
    assert not [r for r in caplog.records if "fidelity record" in r.getMessage()]
    assert payload["margins"]["prefer_seed_within"] == SearchConfig().prefer_seed_within
    assert f"Not stored: {payload['refused']}." in render_check(payload)


def test_a_check_whose_repeated_measurement_agrees_is_stored_and_says_how_to_undo_it(tmp_path, monkeypatch):
    from autodist.cli import render_check
    from autodist.planner.offline import offline_search_config as _search_config

    payload = _check_with_injected_timings(tmp_path, monkeypatch, repeat_factor=1.01, error=0.04)
    assert payload["refused"] is None and payload["record_path"]
    record = FidelityRecord.from_json(Path(payload["record_path"]).read_text())
    # every plan measured 4% slower than predicted (the repeated ones 1% slower again)
    assert record.median_abs_error_time == pytest.approx(payload["all"]["median_abs_pct_error_time"] / 100)
    assert 0.04 / 1.04 <= record.median_abs_error_time <= 0.0505 / 1.0505
    assert _search_config(str(tmp_path / "cache"), 1).prefer_seed_within == pytest.approx(record.seed_margin)
    text = render_check(payload)
    assert "Stored for this machine in" in text and "To undo: `autodist cache clear --kind fidelity`" in text


def test_a_check_takes_the_machines_stored_comm_model_and_sweeps_only_without_one(tmp_path, monkeypatch, capsys):
    from autodist.cli import render_check

    sweeps: list = []
    first = _check_with_injected_timings(tmp_path, monkeypatch, repeat_factor=1.0, error=0.02, sweeps=sweeps)
    said = capsys.readouterr().err.splitlines()
    # up front: what it does; then what it measures of the comm model and about how long, and each step
    assert said[0].startswith("[autodist check] tinycheckmodel:build on 1 ranks: profiling it, taking this machine's comm model")
    assert [line for line in said if line.startswith("[autodist check] measuring the communication cost model: ")]
    assert [line for line in said if line.startswith("[autodist check] measuring ") and " plans: about " in line]
    assert sweeps == [None] and first["comm_model"]["source"] == "measured"
    assert [e.kind for e in Cache(tmp_path / "cache").entries()].count("comm") == 1  # stored, as plan="auto" stores it
    assert "comm model: measured now (none was stored for this machine)" in render_check(first)
    second = _check_with_injected_timings(tmp_path, monkeypatch, repeat_factor=1.0, error=0.02, sweeps=sweeps)
    assert len(sweeps) == 1, "a second check on the machine sweeps again"
    assert second["comm_model"]["source"] == "stored"
    said = capsys.readouterr().err
    assert "[autodist check] comm model: the one stored for this machine" in said and "measuring the communication" not in said
    assert "`autodist cache clear --kind comm` has the next check measure it again" in said
    assert "comm model: the one stored for this machine" in render_check(second)


def test_the_comm_model_is_completed_where_the_stored_one_lacks_what_the_model_needs(tmp_path, monkeypatch):
    """``machine_comm_model`` (``plan="auto"``'s and ``autodist check``'s): a stored model with the
    model's messages is used as it is; one that lacks larger messages is the base of a sweep of
    what it lacks, and the result is stored; none stored is measured whole."""
    monkeypatch.delenv("AUTODIST_COMM_SEED", raising=False)  # the session's seed would answer first
    from dataclasses import fields

    import torch

    from autodist.cost.comm import CommModel, OpModel, Piece
    from autodist.measure.overhead import RuntimeOverhead
    from autodist.measure.sweep import CommNeeds, plan_sweep
    from autodist.planner.keys import machine, machine_key
    from autodist.planner.online import machine_comm_model

    here = machine(2, torch.device("cpu"), "gloo")
    cache = Cache(tmp_path / "cache")
    small = CommNeeds({"all_reduce": 60_000.0})
    large = CommNeeds({"all_reduce": 3e6})
    calls: list = []

    def measure(needs, base):
        calls.append(base)
        todo = plan_sweep(needs, base, 2)
        times = dict(base.ops["all_reduce"].samples if base else [])
        times.update({float(size): 1e-4 * (1 + size / 1e6) for size in todo.timings.get("all_reduce", [])})
        rows = {r[0]: r for r in (base.contention["all_reduce"] if base else [])}
        rows.update({float(size): [float(size), 1.5, 2.0, 2.5] for size in todo.contention.get("all_reduce", [])})
        fit = OpModel(Piece(1e-9, 1e-4), Piece(1e-9, 1e-4), float("inf"), samples=sorted(times.items()))
        overhead = {f.name: 1e-5 for f in fields(RuntimeOverhead)}  # every runtime figure (none measured again)
        return CommModel("gloo", 2, "cpu", {"all_reduce": fit}, host={"all_reduce": fit}, overhead=overhead,
                         contention={"all_reduce": [rows[k] for k in sorted(rows)]})

    def get(needs):
        return machine_comm_model(cache, here, needs, rank=0, world=2, device=torch.device("cpu"),
                                  broadcast=lambda obj: obj, measure=measure)

    model, source = get(small)
    assert (source, calls) == ("measured", [None])
    assert cache.path("comm", machine_key(here)).exists()
    again, source = get(small)
    assert (source, len(calls)) == ("stored", 1)
    assert again.ops["all_reduce"].samples == model.ops["all_reduce"].samples
    _, source = get(large)
    assert (source, len(calls)) == ("completed", 2)
    assert calls[1] is not None and calls[1].ops["all_reduce"].samples == model.ops["all_reduce"].samples


def test_refusal_names_each_reason_a_record_is_not_stored():
    good = FidelityRecord(0.04, 0.9, 0.0, 7, "m", 0)
    assert refusal(good, [{"plans": ["ddp", "searched@none=ddp"], "pct_apart": MAX_REPEAT_PCT_APART}]) is None
    assert "no plan was measured twice" in refusal(good, [])
    assert "5.1% apart" in refusal(good, [{"plans": ["ddp", "again=ddp"], "pct_apart": 5.1}])
    far = FidelityRecord(0.527, 0.9, 0.0, 7, "m", 0)
    assert "median step-time error 52.7% is above the 15%" in refusal(far, [{"plans": ["ddp", "again=ddp"], "pct_apart": 1.0}])


def test_a_stored_record_past_the_cap_is_not_used_and_a_warning_says_why(caplog):
    over = FidelityRecord(MAX_SEED_MARGIN + 0.01, 0.9, 0.2, 7, "gpt", 0, wait_scale=2.5)
    with caplog.at_level(logging.WARNING, logger="autodist"):
        cfg = SearchConfig.for_machine(over)
    assert cfg == SearchConfig()
    said = [r.getMessage() for r in caplog.records if r.name == "autodist"]
    assert len(said) == 1 and "fidelity record (autodist check on gpt) is not used" in said[0], said
    assert "16.0% is above the 15%" in said[0] and "`autodist cache clear --kind fidelity` removes it" in said[0]
    at_cap = FidelityRecord(MAX_SEED_MARGIN, 0.9, 0.2, 7, "gpt", 0)
    assert SearchConfig.for_machine(at_cap).prefer_seed_within == MAX_SEED_MARGIN
