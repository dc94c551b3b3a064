"""The cache: an entry that cannot be used — not text, not JSON, the wrong shape, or values that make
no sense — is reported once and replaced; it never crashes training and never changes results."""

import contextlib
import json
import logging
import math
import random
import tempfile

import pytest
import torch
import torch.distributed as dist

import models
from autodist import AutoDist
from autodist.planner.cache import Cache
from autodist.planner.online import PROFILE_STEPS, AutoPlanner

KINDS = ("plans", "profiles", "comm", "placements")


@contextlib.contextmanager
def _warnings():
    """The warnings the ``autodist`` logger emits inside the block."""
    seen = []

    class Handler(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Handler(logging.WARNING)
    log = logging.getLogger("autodist")
    log.addHandler(handler)
    try:
        yield seen
    finally:
        log.removeHandler(handler)


def _map_leaves(obj, fn):
    """``obj`` with ``fn`` applied to every leaf but the schema version (which alone would be refused)."""
    if isinstance(obj, dict):
        return {k: v if k == "schema_version" else _map_leaves(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_leaves(v, fn) for v in obj]
    return fn(obj)


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _corruptions(text, other_kind_text):
    """Ways an entry whose valid content is ``text`` gets damaged, by name -> bytes on disk."""
    obj = json.loads(text)
    rng = random.Random(0)
    out = {
        "random bytes": bytes(rng.randrange(256) for _ in range(512)) + b"\xff",
        "half the entry, then binary": text.encode()[: len(text) // 2] + b"\x00\xff\xfe",
        "UTF-16": text.encode("utf-16"),
        "NUL bytes": b"\x00" * 64,
        "empty": b"",
        "truncated": text[: len(text) // 2].encode(),
        "trailing garbage": (text + "}garbage").encode(),
        "nested deeper than the JSON reader recurses": ("[" * 100_000 + "]" * 100_000).encode(),
        "the entry of another kind": other_kind_text.encode(),
        "objects as lists": json.dumps(list(obj.items()) if isinstance(obj, dict) else obj).encode(),
        "numbers as strings": json.dumps(_map_leaves(obj, lambda x: str(x) if _is_number(x) else x)).encode(),
        "numbers not a number": json.dumps(_map_leaves(obj, lambda x: math.nan if _is_number(x) else x)).encode(),
        "numbers infinite": json.dumps(_map_leaves(obj, lambda x: math.inf if _is_number(x) else x)).encode(),
    }
    for literal in ("null", "[]", "{}", "42", '"text"', "true"):
        out[literal] = literal.encode()
    if isinstance(obj, dict) and all(v in ("replicate", "shard") for v in obj.values()):  # a placement
        first = sorted(obj)[0]
        out["a unit missing"] = json.dumps({k: v for k, v in obj.items() if k != first}).encode()
        out["an unknown unit"] = json.dumps({**obj, "decoder": "shard"}).encode()
        out["an unknown placement"] = json.dumps({**obj, first: "spread"}).encode()
    return {name: data for name, data in out.items() if data != text.encode()}


@pytest.fixture(scope="module")
def filled_cache():
    """A cache directory holding one valid entry of every kind, and the wrapped model that made it."""
    with tempfile.TemporaryDirectory() as d:
        x, _ = models.batch("mlp", 4, torch.Generator().manual_seed(0))
        m = AutoDist(models.make("mlp"), plan="auto", example_inputs=(x,), cache_dir=d)
        entries = {e.kind: e.path for e in Cache(d).entries()}
        assert sorted(entries) == sorted(KINDS)
        yield m, d, entries
        m.close()


def test_every_unusable_entry_of_every_kind_is_reported_once_and_removed(filled_cache):
    wrapper, directory, entries = filled_cache
    valid = {kind: path.read_text() for kind, path in entries.items()}
    cases = failures = 0
    problems = []
    for kind, path in entries.items():
        key = path.stem
        other = valid["plans" if kind != "plans" else "comm"]
        assert AutoPlanner(wrapper._auto.rt, directory, explicit_budget=False).read(kind, key) is not None, kind
        for name, data in _corruptions(valid[kind], other).items():
            cases += 1
            path.write_bytes(data)
            planner = AutoPlanner(wrapper._auto.rt, directory, explicit_budget=False)
            with _warnings() as seen:
                try:
                    results = [planner.read(kind, key), planner.read(kind, key)]
                except Exception as e:  # a crash is exactly what must never happen
                    results = [f"raised {type(e).__name__}: {str(e)[:100]}"]
            reports = [w for w in seen if str(path) in w and "it will be replaced" in w]
            if results != [None, None] or len(reports) != 1 or path.exists():
                failures += 1
                problems.append(f"{kind} / {name}: read {results}, reported {len(reports)}x, still on disk: {path.exists()}")
            path.write_text(valid[kind])
    assert cases >= 70
    assert not problems, f"{failures} of {cases} corrupt entries mishandled:\n" + "\n".join(problems)


def _launch_with_unusable_entries(cache_dir):
    """Fill the cache, damage every entry on rank 0, and train again without example inputs: the
    stored placement is read at wrap time, the profile and plan at the first forward, the comm model
    after the first steps are profiled."""
    rank = dist.get_rank()
    x, y = models.batch("mlp", 4, torch.Generator().manual_seed(rank))
    AutoDist(models.make("mlp"), plan="auto", example_inputs=(x,), cache_dir=cache_dir).close()
    dist.barrier()
    damage = {
        "plans": bytes(range(256)),
        "profiles": '{"schema_version": 2, "units": "'.encode("utf-16"),
        "comm": b"null",
        "placements": b'{"layers.0": "shard"}',
    }
    entries = {e.kind: e.path for e in Cache(cache_dir).entries()}
    if rank == 0:
        for kind, path in entries.items():
            path.write_bytes(damage[kind])
    dist.barrier()
    with _warnings() as seen:
        m = AutoDist(models.make("mlp"), plan="auto", cache_dir=cache_dir)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for _ in range(PROFILE_STEPS + 2):
            loss = models.loss_fn("mlp", m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        m.close()
    dist.barrier()
    reported = {kind: sum(str(path) in w and "it will be replaced" in w for w in seen) for kind, path in entries.items()}
    after = Cache(cache_dir).entries()  # the plan is stored under the optimizer now measured (SGD)
    readable = {kind: [_readable(e.path) for e in after if e.kind == kind] for kind in KINDS}
    return {"reported": reported, "readable": readable, "finite": all(math.isfinite(v) for v in losses)}


def _readable(path):
    try:
        json.loads(path.read_text())
        return True
    except ValueError:
        return False


def test_unusable_entries_of_every_kind_are_reported_once_and_replaced_while_training(world2):
    with tempfile.TemporaryDirectory() as d:
        results = world2.run(_launch_with_unusable_entries, d)
    assert results[0]["reported"] == {kind: 1 for kind in KINDS}  # rank 0 reads the cache ...
    assert results[1]["reported"] == {kind: 0 for kind in KINDS}  # ... and says so once for the job
    for r in results:
        assert r["finite"]
        # what was damaged is gone, and every kind was stored again
        assert all(r["readable"][kind] and all(r["readable"][kind]) for kind in KINDS), r["readable"]


def test_a_comm_model_with_one_unreadable_sample_is_partly_corrupt_and_keeps_the_rest():
    """A sample is what a later sweep extends and fits again: one that is not a number makes the
    entry partly corrupt (its fits alone looked fine), and only that sample is dropped."""
    from autodist.cost.comm import CommModel, OpModel, Piece
    from autodist.planner.entries import comm_entry, comm_parts

    samples = [(16384.0, 1e-4), (65536.0, 2e-4), (262144.0, 5e-4)]
    fit = OpModel(Piece(1e-9, 1e-4), Piece(1e-9, 1e-4), float("inf"), samples=samples)
    model = CommModel("gloo", 2, "cpu", {"all_gather": fit, "all_reduce": fit})
    here = {"backend": "gloo", "world": 2, "device_name": "cpu"}
    assert comm_entry(model.to_json(), here).ops["all_gather"].samples == samples
    d = json.loads(model.to_json())
    d["ops"]["all_gather"]["samples"][1][1] = "NaN"
    text = json.dumps(d)
    with pytest.raises(ValueError, match=r"all_gather\.samples\[1\]"):
        comm_entry(text, here)
    kept, problem = comm_parts(text, here)
    assert problem is not None and "samples[1]" in problem
    assert [x for x, _ in kept.ops["all_gather"].samples] == [16384.0, 262144.0]
    assert kept.ops["all_reduce"].samples == samples
