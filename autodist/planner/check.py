"""``autodist check``'s pipeline, on each rank torchrun launched: profile the model, take this
machine's comm model (the one ``plan="auto"`` uses, measured only where none is stored), choose
plans (built-in, random and searched), run each for a few steps, compare the measured step time
and peak with the predictions, fit the wait calibration, and store the measured error for this
machine, where ``plan="auto"`` and ``autodist plan`` take their margins from
(:func:`~autodist.planner.offline.search_config`).

The command (``autodist/cli.py``) parses the arguments, builds the model and its batches, and
renders the payload :func:`run_check` returns on rank 0.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._log import logger
from ..cost.comm import CommModel
from ..cost.fidelity import MIN_SEED_MARGIN, SCALE_TOLERANCE, WAIT_SCALES, FidelityRecord, refusal
from ..cost.profile import Profile
from ..cost.simulator import Simulator
from ..measure import fidelity as measure_fidelity
from ..measure import sweep as measure_sweep
from ..measure.sweep import CommNeeds
from ..measure.trace import model_loss, profile_model, surrogate_loss
from ..sched.search import SearchConfig
from ..sched.space import space_for
from ..structure import discover
from .cache import Cache
from .keys import machine, machine_key
from .online import COMM_SOURCES, comm_needs, machine_comm_model

WARMUP_STEPS = 2  # untimed steps per plan and pass: the allocator and the engine's first-step work
PASSES = 2  # passes in alternating order (see [Note: a host whose speed drifts] in measure/fidelity.py)


@dataclass
class CheckRequest:
    """What ``autodist check`` measures: the model (``build`` returns it, seeded the same each time),
    one step's batch (``batch(generator, device)``: ``accum`` micro-batches), the keyword inputs a
    micro-batch is also passed as (``kwargs_of``), and how much to measure."""

    model: str  # the factory's name, for the report
    build: Callable[[], nn.Module]
    validate: Callable[[nn.Module], object]  # runs the model once on an example batch; raises if it fails
    batch: Callable[[torch.Generator, torch.device], torch.Tensor]
    kwargs_of: Callable[[torch.Tensor], dict[str, Any]]
    input_shape: tuple[int, ...]
    plans: int
    steps: int
    accum: int
    record: bool
    cache_dir: str | None


def rank_device() -> tuple[torch.device, str]:
    """This rank's device and backend: its local GPU with NCCL where there is one, else the CPU with
    gloo, computing with one intra-op thread as a rank does under torchrun."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device, "nccl"
    torch.set_num_threads(1)
    return torch.device("cpu"), "gloo"


def check_on_ranks(req: CheckRequest, say: Callable[[str], None]) -> dict[str, Any] | None:
    """One rank of ``autodist check`` (launched by torchrun): join the process group, :func:`run_check`,
    leave it. Rank 0 returns the payload, the others ``None``."""
    device, backend = rank_device()
    dist.init_process_group(backend)
    try:
        return run_check(req, device, backend, say)
    finally:
        dist.destroy_process_group()


def _loss(out: Any, _target: Any) -> torch.Tensor:
    own = model_loss(out)  # the model's own loss (Hugging Face with labels), else the mean of its outputs
    loss = own if own is not None else surrogate_loss(out)
    if loss is None:
        raise ValueError(
            "the model's output has no floating-point tensor that requires grad: there is no training step to check "
            "(unfreeze a parameter, or return a loss)"
        )
    return loss


def run_check(req: CheckRequest, device: torch.device, backend: str, say: Callable[[str], None]) -> dict[str, Any] | None:
    """Measure the plans on every rank of the default process group; rank 0 returns the payload
    :func:`~autodist.cli.render_check` prints (the others ``None``). ``say`` reports each plan's
    measurement as it completes (rank 0)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("autodist check runs in a process group (torchrun); none is initialised")
    model = req.build()
    structure = discover(model)
    req.validate(model)
    gen = torch.Generator().manual_seed(1000 + rank)  # distinct data per rank and step
    batches = [(req.batch(gen, device), None) for _ in range(WARMUP_STEPS + req.steps + 1)]
    x0 = batches[0][0].chunk(req.accum)[0]
    train = measure_sweep.collective_train(group, device)
    model = model.to(device)

    def profile(memory: bool = True, contention: bool = True) -> Profile:
        return profile_model(
            model, structure, (x0,), device=device, loss_fn=lambda out: _loss(out, None),
            example_kwargs=req.kwargs_of(x0), optimizer=measure_fidelity.optimizer_for,
            contention=train if contention else None, memory=memory,
        )

    if rank == 0:
        say(f"[autodist check] {req.model} on {world} ranks: profiling it, taking this machine's comm model (measured "
            f"only where none is stored), then running {req.plans} or more plans for {PASSES} passes of "
            f"{WARMUP_STEPS} + {req.steps} steps each")
    t_profile = time.perf_counter()
    prof = measure_fidelity.slowest_over_ranks(profile())
    t_profile = time.perf_counter() - t_profile
    # the profiles after each pass re-time the model, whose speed drifts with the host's ([Note: a
    # host whose speed drifts]); its contention sensitivity, a ratio of two slowdowns measured in
    # the same rounds, does not drift with it and is the first profile's (its rounds took 6 of the
    # 9 s of each profile of gpt on 2 CPU ranks)
    reprofile = measure_fidelity.Reprofile(prof, lambda: profile(memory=False, contention=False))
    facts = machine(world, device, backend)
    comm, comm_source = check_comm_model(req, structure, facts, group, device, say)
    if rank == 0:
        say(f"[autodist check] comm model: {COMM_SOURCES[comm_source]} ({Cache(req.cache_dir).path('comm', machine_key(facts))}"
            + ("; `autodist cache clear --kind comm` has the next check measure it again)" if comm_source in ("stored", "seed") else ")"))
    space = space_for(prof, structure, world, grad_accum_steps=req.accum)
    sim = Simulator(prof, structure, comm, world_size=world)
    chosen = measure_fidelity.plans_to_check(space, sim, req.plans)
    if not any("=" in name for name, _, _ in chosen):
        # one plan measured twice: the measurement's own noise, which decides whether the record
        # is stored (autodist/cost/fidelity.py refusal); the search usually picks a built-in one
        chosen.append(("again=ddp", chosen[0][1], False))
    checks = [
        measure_fidelity.Checked(name, space.to_plan(g, provenance={"source": f"autodist check:{name}"}), sim.run(space.to_plan(g)), searched)
        for name, g, searched in chosen
    ]
    if rank == 0:
        say(f"[autodist check] measuring {len(checks)} plans: about {measuring_seconds(checks, req.steps, t_profile - prof.meta.get('contention_seconds', 0.0)):.0f} s "
            "at their predicted step times")

    def wrap(plan: Any) -> nn.Module:
        from ..wrapper import AutoDist

        # the check reports each plan itself (progress): not AutoDist's "plan ... in force" line per wrap
        level = logger.level
        logger.setLevel(max(logging.WARNING, level))
        try:
            return AutoDist(req.build(), plan=plan)
        finally:
            logger.setLevel(level)

    def progress(c: measure_fidelity.Checked) -> None:
        if rank == 0:
            # the table's predictions come later, from the profiles taken across all passes
            say(f"[autodist check] {c.name}: measured {c.measured_step_s * 1e3:.1f} ms (predicted "
                f"{c.predicted.step_s * 1e3:.1f} ms from the first profile)")

    measure_fidelity.measure_plans(
        checks, wrap, batches, _loss, device=device, accum=req.accum, steps=req.steps, warmup=WARMUP_STEPS,
        passes=PASSES, progress=progress, forward=lambda m, x: m(x, **req.kwargs_of(x)), after_pass=reprofile.after_pass,
    )
    prof = reprofile.predict(checks, sim)
    if rank != 0:
        return None
    return dict(_payload(req, checks, prof, structure, comm, facts), comm_model={"source": comm_source, "what": COMM_SOURCES[comm_source]})


def measuring_seconds(checks: list[measure_fidelity.Checked], steps: int, profile_s: float) -> float:
    """About how long measuring ``checks`` takes: each plan's predicted step over ``PASSES`` passes
    of ``WARMUP_STEPS + steps`` steps, and the profile taken after each pass (``profile_s``, as long
    as the first took less its contention rounds)."""
    return PASSES * (sum(c.predicted.step_s for c in checks) * (WARMUP_STEPS + steps) + profile_s)


def check_comm_model(
    req: CheckRequest, structure: Any, facts: dict[str, Any], group: dist.ProcessGroup, device: torch.device,
    say: Callable[[str], None],
) -> tuple[CommModel, str]:
    """The comm model the check predicts with, and where it came from (a key of ``COMM_SOURCES``):
    the one ``plan="auto"`` uses on this machine, measured (and stored) only where there is none
    or it lacks what this model's plans can issue (:func:`~autodist.planner.online.machine_comm_model`).
    The check thus measures the fidelity of the comm model the search here then plans with."""
    rank = dist.get_rank(group)

    def broadcast(obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]

    def measure(needs: CommNeeds, base: CommModel | None) -> CommModel:
        return measure_sweep.sweep(group, device, needs=needs, base=base)

    return machine_comm_model(
        Cache(req.cache_dir, writer=rank == 0), facts, comm_needs(structure), rank=rank, world=dist.get_world_size(group),
        device=device, broadcast=broadcast, measure=measure,
        tell=lambda text: say(f"[autodist check] {text.removeprefix('autodist: ')}"),
    )


def _payload(
    req: CheckRequest, checks: list[measure_fidelity.Checked], prof: Profile, structure: Any, comm: CommModel,
    facts: dict[str, Any],
) -> dict[str, Any]:
    """Rank 0's report of a check: each plan's figures, the fidelity summaries, the fitted wait
    calibration, the margins they give, and where the record was stored (if it was)."""
    world = facts["world"]
    # each row with its plan, so that a plan whose peak or time was off can be run again
    rows = [dict(c.row(), plan_json=json.loads(c.plan.to_json())) for c in checks]
    fidelity = measure_fidelity.summaries(rows)
    overall = fidelity["all"]
    # the wait calibration that fits these plans best ([Note: the wait calibration]); the
    # record's errors stay those measured at the sweep's scale
    by_scale = measure_fidelity.errors_by_wait_scale(
        prof, structure, comm, [c.plan for c in checks], [c.measured_step_s for c in checks], world,
        sorted({*WAIT_SCALES, comm.wait_scale}),
    )
    fitted = measure_fidelity.best_wait_scale(
        {s: {"": e} for s, e in by_scale.items()}, [""], prior=comm.wait_scale, within=SCALE_TOLERANCE,
    )
    record = replace(FidelityRecord.from_summary(overall, req.model), wait_scale=fitted, blocked_wait_s=comm.blocked_wait_s)
    stored = None
    repeated = measure_fidelity.repeatability(rows)
    refused = refusal(record, repeated)
    if req.record and refused is None:
        path = Cache(req.cache_dir).put("fidelity", machine_key(facts), record.to_json())
        stored = str(path) if path else None
    # the margins plan="auto" takes from it; a refused record is never stored, and so changes nothing
    # (for_machine would warn about it as if it were stored)
    cfg = SearchConfig() if refused is not None else SearchConfig.for_machine(record)
    return {
        "model": req.model, "world_size": world, "device": facts["device_name"], "backend": facts["backend"],
        "input_shape": list(req.input_shape), "accum": req.accum, "steps": req.steps, "passes": PASSES,
        "plans": rows, "all": overall,
        "builtin_and_random": fidelity["random_and_builtin"],
        "searched": fidelity["searched"],
        "repeated": repeated,
        "refused": refused,
        "calibration": {"wait_scale": fitted, "median_abs_pct_error_time": by_scale[fitted],
                        "sweep_wait_scale": comm.wait_scale, "at_sweep_scale": by_scale[comm.wait_scale],
                        "blocked_wait_s": comm.blocked_wait_s},
        "margins": {"prefer_seed_within": cfg.prefer_seed_within, "memory_headroom": cfg.memory_headroom,
                    "default_prefer_seed_within": SearchConfig().prefer_seed_within,
                    "min_prefer_seed_within": MIN_SEED_MARGIN,
                    "default_memory_headroom": SearchConfig().memory_headroom},
        "record_path": stored,
    }
