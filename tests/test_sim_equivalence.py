"""The simulator's and the search's caches change no result.

A :class:`Simulator` keeps what every plan of its model shares (the backward orders, each block's
recomputable units, the comm model's figures by operation and size) and the search keeps each
genome's normal form. Here one simulator, warm from many plans, predicts random plans of a GPT with
blocks — sharded, replicated, mixed precision, under budgets, with micro-batches, offloaded state,
recomputation, memory-sized prefetch windows and hybrid sharding — exactly as a simulator that keeps nothing (every
figure asked of the comm model and the profile afresh) predicts each alone: every reported figure,
the timeline's events and the memory curve. The comm model is the one the
committed gpt simcheck record measured (contention tables, first-touch costs, overheads), so every
path of the timeline is priced.
"""

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from autodist.cost.comm import CommModel
from autodist.cost.sim.emit import StepOrders
from autodist.cost.simulator import Simulator
from autodist.measure.trace import profile_model
from autodist.sched.search import MOVE_KINDS, SearchConfig, Searcher
from autodist.sched.space import MEMORY_WINDOW, space_for
from autodist.structure import discover
from autodist.zoo import zoo

RECORD = Path(__file__).resolve().parents[1] / "benchmarks" / "simcheck-gpt.json"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    wl = zoo("tiny")["gpt-deep"]
    net = wl.build()
    structure = discover(net)
    x, y = wl.batch(wl.default_batch, torch.Generator().manual_seed(0))
    prof = profile_model(net, structure, (x,), device=torch.device("cpu"), loss_fn=lambda out: wl.loss(out, y), repeats=1)
    comm = CommModel.from_json(json.dumps(json.loads(RECORD.read_text())["comm_model"]))
    return prof, structure, comm


class Uncached(Simulator):
    """The simulator recomputing what :class:`Simulator` keeps, each time it is asked."""

    def _time(self, op, nbytes):
        return self.comm.time(op, nbytes)

    def _host(self, op, nbytes):
        return self.comm.host_time(op, nbytes)

    def _first_touch(self, nbytes):
        return self.comm.first_touch_s(nbytes)

    def _memcpy(self, nbytes):
        return self.comm.memcpy(nbytes)

    def _slowdowns(self, op, nbytes, *, scaled=True):
        return self.comm.slowdowns(op, nbytes, scaled=scaled)

    def orders(self):
        return StepOrders.of(self)

    def _recomputed_blocks(self, plan):
        out = {}
        for b in plan.recompute:
            units = [u for u in self.order if self.block_of.get(u) == b and u not in self.profile.recompute_anchor]
            if units:
                out[b] = units
        return out


def _figures(r):
    return (
        r.step_s, r.peak_bytes, r.static_bytes, r.feasible, r.budget_bytes, r.compute_s, r.comm_s, r.exposed_comm_s,
        r.gathers, r.reductions, r.copy_s, r.offload_log, r.breakdown, r.actions.actions if r.actions else None,
        [(e.stream, e.name, e.start, e.end) for e in r.events], r.memory,
    )


def _genomes(space, rng, n):
    """Random genomes, each moved a few times by the search's own moves, and the extremes."""
    f = space.fsdp()
    out = [space.ddp(), f, space.zero2(),
           replace(f, window=tuple((MEMORY_WINDOW, MEMORY_WINDOW) for _ in f.shard)),
           replace(f, residency=tuple(2 for _ in f.shard), inflight=0)]
    for _ in range(n):
        g = space.random(rng)
        for _ in range(rng.randint(0, 5)):
            g = space._move_kind(g, rng.choice(MOVE_KINDS), rng)
        for p, state, _ in rng.sample(space.offload_candidates(g), 2) if rng.random() < 0.4 else ():
            g = space.with_offload(g, p, state, back_unit=rng.choice([None, -1]))
        out.append(g)
    return out


@pytest.mark.parametrize("world,accum", [(2, 1), (4, 3)])
def test_a_warm_simulator_predicts_every_plan_as_one_that_keeps_nothing(model, world, accum):
    prof, structure, comm = model
    space = space_for(prof, structure, world, grad_accum_steps=accum)
    assert space.recompute_blocks and space.state_names  # the paths this test means to cover exist
    rng = random.Random(world * 10 + accum)
    plans = [space.to_plan(g) for g in _genomes(space, rng, 30)]
    if world == 4:  # hybrid sharding: sharded within groups of 2 ranks, replicated across them
        plans += [replace(p, shard_size=2) for p in plans[1:12]]
    fsdp_peak = Simulator(prof, structure, comm, world_size=world).run(plans[1]).peak_bytes
    settings = [
        {}, {"budget_bytes": int(fsdp_peak * 1.1)}, {"budget_bytes": int(fsdp_peak * 0.9)},
        {"param_dtype": torch.bfloat16}, {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "budget_bytes": fsdp_peak},
    ]
    compared = feasible = 0
    for kw in settings:
        warm = Simulator(prof, structure, comm, world_size=world, **kw)
        for plan in plans:  # warm it up on every plan first: what it keeps must not leak into the next
            warm.run(plan)
        for i, plan in enumerate(plans):
            record = i % 2 == 0
            got = warm.run(plan, record=record)
            want = Uncached(prof, structure, comm, world_size=world, **kw).run(plan, record=record)
            assert _figures(got) == _figures(want), (kw, i)
            compared += 1
            feasible += got.feasible
    assert compared == len(settings) * len(plans) and 0 < feasible < compared


def test_the_search_evaluates_a_genome_as_a_fresh_simulation_of_its_plan(model):
    prof, structure, comm = model
    space = space_for(prof, structure, 2, grad_accum_steps=2)
    sim = Simulator(prof, structure, comm, world_size=2)
    search = Searcher(space, sim, SearchConfig())
    rng = random.Random(7)
    for g in _genomes(space, rng, 40):
        n = space.normalize(g)
        assert space.normalize(n) == n  # normal forms are fixed points: the search keeps them as they are
        assert search.normalize(g) == n and search.normalize(g) is search.normalize(g)
        assert space.to_plan(n, normalized=True).to_json() == space.to_plan(g).to_json()
        fresh = Uncached(prof, structure, comm, world_size=2).run(space.to_plan(g))
        assert _figures(search.evaluate(g)) == _figures(fresh)
