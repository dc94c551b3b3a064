"""Planning from one process, and the stages every planner shares.

* **The shared stages** — :func:`search_within_budget` (search under the budget less its headroom,
  then within the budget itself), :func:`annotate` (what a searched plan records), :func:`budget_error`
  (no plan fits: what the smallest peak is made of and what would make one fit). ``plan="auto"``
  (``online.py``) and ``autodist plan`` both search through them.
* **``autodist plan`` and ``autodist timeline``** — :func:`offline_machine` (the machine they plan
  for), :func:`comm_model` (an interconnect's analytic model, the user's numbers, or the one
  ``plan="auto"`` measured on this machine), :func:`search_config` (the margins ``autodist check``
  measured here; :func:`offline_search_config` for ``autodist plan``), :func:`offline_profile` (the model's profile, cached) and :func:`plan_offline`.

A failure the user can fix (no comm model cached, a cached one unreadable) raises
:class:`OfflineError`, whose message says what to do; the CLI prints it as one line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from .._log import logger
from ..cost.budget import format_bytes
from ..cost.comm import OPS, CommModel
from ..cost.fidelity import FidelityRecord
from ..cost.interconnect import INTERCONNECTS
from ..cost.profile import Profile
from ..cost.simulator import SimResult, Simulator
from ..errors import BudgetError
from ..measure.trace import profile_model
from ..plan import Plan, made_for
from ..sched.search import SearchConfig, Searcher, SearchResult
from ..sched.space import hybrid_shard_sizes, space_for
from ..structure import discover
from .cache import Cache
from .entries import profile_entry
from .keys import input_signature, machine, machine_key, profile_cache_key


class OfflineError(Exception):
    """A failure of an offline stage the user can fix; the message says how."""


def offline_machine(world: int) -> dict[str, Any]:
    """The machine ``autodist plan`` and ``autodist timeline`` plan for: ``world`` ranks on the CPU
    of this process (where they profile), with its default backend."""
    return machine(world, torch.device("cpu"))


def search_config(cache: Cache, facts: dict[str, Any]) -> SearchConfig:
    """The search's margins on the machine of ``facts``: from its fidelity record when ``autodist
    check`` left one, else the defaults (see [Note: margins from measured error])."""
    return SearchConfig.for_machine(cache.get("fidelity", machine_key(facts), FidelityRecord.from_json))


def offline_search_config(cache_dir: str | None, world: int) -> SearchConfig:
    """:func:`search_config` for ``world`` ranks of :func:`offline_machine` (``autodist plan``)."""
    return search_config(Cache(cache_dir, writer=False), offline_machine(world))


def comm_model(
    world: int, *, cache_dir: str | None, interconnect: str | None = None,
    bandwidth_gbps: float | None = None, latency_us: float | None = None,
) -> tuple[CommModel, str]:
    """The comm model ``autodist plan`` and ``autodist timeline`` simulate with, and a phrase saying
    where it came from: a named interconnect's analytic model, one of the given bandwidth and
    latency, else the one ``plan="auto"`` measured and cached on this machine for ``world`` ranks,
    with the wait calibration ``autodist check`` fitted here (as the search simulates with it)."""
    if interconnect is not None:
        link = INTERCONNECTS[interconnect]
        model = CommModel.analytic(world, bandwidth_bytes_s=link.bandwidth_gbps * 1e9, latency_s=link.latency_us * 1e-6)
        return model, f"the {link.name} interconnect ({link.what}: {link.bandwidth_gbps:g} GB/s, {link.latency_us:g} us)"
    if bandwidth_gbps is not None and latency_us is not None:
        model = CommModel.analytic(world, bandwidth_bytes_s=bandwidth_gbps * 1e9, latency_s=latency_us * 1e-6)
        return model, f"an analytic comm model ({bandwidth_gbps:g} GB/s, {latency_us:g} us)"
    cache = Cache(cache_dir, writer=False)
    facts = offline_machine(world)
    path = cache.path("comm", machine_key(facts))
    if not path.is_file():
        raise OfflineError(
            f"no comm model is cached for {world} CPU ranks ({facts['backend']}, torch {torch.__version__}) in {cache.dir}; "
            f"pass --interconnect NAME for the link your ranks use ({', '.join(INTERCONNECTS)}; `--help` lists their "
            "numbers), or --bandwidth GBPS --latency US, or run a job with plan=\"auto\" on this machine with "
            f"{world} ranks first (it measures one and caches it)"
        )
    try:
        model = search_config(cache, facts).calibrated(CommModel.from_json(path.read_text()))
        unmeasured = [op for op in OPS if op not in model.ops]
        if unmeasured:  # plan="auto" measures only what its model can use (measure/sweep.py plan_sweep)
            raise OfflineError(
                f"the comm model cached in {path} was measured for a model that issues no {', '.join(unmeasured)}; "
                "run a job with plan=\"auto\" and this model on this machine first (it measures what is missing), "
                "or pass --interconnect NAME, or --bandwidth GBPS --latency US"
            )
        return model, f"the comm model measured on this machine ({path})"
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise OfflineError(
            f"the cached comm model {path} cannot be read ({type(e).__name__}: {_first_line(e)}); remove it with "
            "`autodist cache clear --kind comm` or pass --bandwidth and --latency"
        ) from None


def cluster_comm_model(nodes: int, gpus_per_node: int, within: str, across: str | None) -> tuple[CommModel, str]:
    """The analytic comm model of ``nodes`` nodes of ``gpus_per_node`` ranks (``autodist plan
    --nodes``): the ``within`` interconnect between the ranks of a node and, on more than one
    node, ``across`` between nodes (two levels, [Note: collectives across nodes] in
    cost/comm.py); a phrase naming both."""
    inside = INTERCONNECTS[within]
    world = nodes * gpus_per_node
    node_model = CommModel.analytic(gpus_per_node, bandwidth_bytes_s=inside.bandwidth_gbps * 1e9, latency_s=inside.latency_us * 1e-6)
    said = f"{inside.name} within a node ({inside.what}: {inside.bandwidth_gbps:g} GB/s, {inside.latency_us:g} us)"
    if nodes == 1 or across is None:
        return CommModel.analytic(world, bandwidth_bytes_s=inside.bandwidth_gbps * 1e9, latency_s=inside.latency_us * 1e-6), said
    out = INTERCONNECTS[across]
    net = CommModel.analytic(nodes, bandwidth_bytes_s=out.bandwidth_gbps * 1e9, latency_s=out.latency_us * 1e-6)
    model = CommModel.two_level(node_model, net, ranks_per_node=gpus_per_node, world_size=world)
    return model, f"{said} and {out.name} across nodes ({out.what}: {out.bandwidth_gbps:g} GB/s, {out.latency_us:g} us)"


def level_report(plan: Plan, profile: Profile, structure: Any, comm: CommModel) -> dict[str, dict[str, float]]:
    """Per level of a two-level ``comm`` (``"within node"``, ``"across nodes"``): ``busy_s``, the
    time its collectives of one step take, and ``exposed_s``, what they add to the step: the step
    less the step with that level free (a counterfactual, so the two need not add up to the
    step's exposed communication, which overlap of the levels shares)."""
    def sim(c: CommModel) -> SimResult:
        return Simulator(profile, structure, c, world_size=plan.world_size, budget_bytes=plan.budget_bytes).run(plan)

    step = sim(comm).step_s
    out = {}
    for level, other in (("within node", "across nodes"), ("across nodes", "within node")):
        out[level] = {"busy_s": sim(comm.with_free_level(other)).comm_s, "exposed_s": max(0.0, step - sim(comm.with_free_level(level)).step_s)}
    return out


def sharding_reason(plan: Plan, profile: Profile, structure: Any, comm: CommModel, result: SearchResult) -> str:
    """Why the plan shards over the groups it does, in one sentence: the same plan with the other
    choice (hybrid groups of a node, or the whole world) simulated side by side, and the built-in
    plans' steps."""
    world, node = plan.world_size, comm.ranks_per_node
    if not plan.sharded_units:
        return "no unit is sharded (every parameter replicated): " + _seed_steps(result)
    if node is None or node >= world:
        return f"sharded over all {world} ranks (one node: no hybrid choice); " + _seed_steps(result)
    if node == 1:
        return f"sharded over all {world} ranks (one rank per node: no smaller shard group); " + _seed_steps(result)
    other_size = None if plan.hybrid else node
    other = replace(plan, shard_size=other_size)
    r = Simulator(profile, structure, comm, world_size=world, budget_bytes=plan.budget_bytes).run(other)
    mine = plan.predicted["step_seconds"]
    fits = "" if r.feasible else f", over the budget at {format_bytes(r.peak_bytes)}"
    if plan.hybrid:
        where = "stay within a node" if plan.shard_ranks <= node else f"span {plan.shard_ranks // node} nodes, not {world // node}"
        text = (f"hybrid shard_size={plan.shard_ranks}: all-gathers and reduce-scatters {where}, the gradients' "
                f"all-reduce across the {world // plan.shard_ranks} replicas crosses nodes; the same plan fully sharded over "
                f"{world} ranks is predicted at {r.step_s * 1e3:.2f} ms ({_saves(r.step_s - mine)}), peak "
                f"{format_bytes(r.peak_bytes)} against {format_bytes(plan.predicted['peak_bytes'])}{fits}")
    else:
        text = (f"full sharding over all {world} ranks: the same plan sharded within each node of {node} "
                f"(hybrid) is predicted at {r.step_s * 1e3:.2f} ms ({_saves(r.step_s - mine)}), peak "
                f"{format_bytes(r.peak_bytes)} against {format_bytes(plan.predicted['peak_bytes'])}{fits}")
    return text + "; " + _seed_steps(result)


def _saves(seconds: float) -> str:
    """``seconds`` the other choice takes longer, in words."""
    return f"this plan saves {seconds * 1e3:.2f} ms" if seconds >= 0 else f"this plan costs {-seconds * 1e3:.2f} ms more"


def _seed_steps(result: SearchResult) -> str:
    names = [n for n in ("ddp", "fsdp", "hsdp", "zero2") if n in result.seeds]
    parts = [f"{n} {result.seeds[n].step_s * 1e3:.2f} ms" + ("" if result.seeds[n].feasible else " (over budget)") for n in names]
    return "built-in plans: " + ", ".join(parts) if parts else "no built-in plan applies"


def offline_profile(
    model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict[str, Any], *, cache_dir: str | None, reprofile: bool,
    compile_backend: str | None = None,
) -> tuple[Profile, str]:
    """The model's profile for ``autodist plan`` and ``autodist timeline``, and a phrase saying where
    it came from: the one cached for this model, input and machine, else (or with ``reprofile``)
    measured here and cached. ``compile_backend`` (``autodist plan --compile``): every block also
    timed compiled with it (a profile cached apart from the one without).

    [Note: planning twice] Profiling is robust to a busy host (thread time, a low quantile of
    several passes, retaken when they spread), but not to a host whose speed drifts: on a shared
    2-vCPU VM the gpt zoo model's forward and backward took 299 to 411 ms (lower quartile of six
    passes, thread time) within two minutes, with no steal time, and a calibration kernel timed
    between the passes did not track it (the model's time over the kernel's ranged 411-527). So a
    profile is measured once per model, input and machine and reused, as a job with ``plan="auto"``
    reuses its own: the same command plans from the same measurement and gives the same plan and
    prediction."""
    cache = Cache(cache_dir)
    structure = discover(model)
    device = torch.device("cpu")
    sig = input_signature((example_inputs, example_kwargs))
    compiled = {"compile": compile_backend} if compile_backend is not None else {}
    key = profile_cache_key(structure, sig, offline_machine(1)["device_name"], measured_by="autodist plan", **compiled)
    if not reprofile:
        cached = cache.get("profiles", key, profile_entry)
        if cached is not None:
            return cached, f"the profile cached in {cache.path('profiles', key)} (--reprofile measures it again)"
    profile = profile_model(model, structure, example_inputs, device=device, example_kwargs=example_kwargs,
                            compile_backend=compile_backend)
    cache.put("profiles", key, profile.to_json())
    noisy = (
        f", on a busy host (its passes spread {profile.meta['spread']:.0%} after {profile.meta['passes']}; "
        "--reprofile on a quieter host measures it again)" if profile.meta.get("noisy") else ""
    )
    return profile, f"a profile measured here{noisy}"


def simulate(plan: Plan, profile: Profile, structure: Any, comm: CommModel) -> SimResult:
    """One step of ``plan`` simulated with its events recorded (``autodist timeline``)."""
    sim = Simulator(profile, structure, comm, world_size=plan.world_size, budget_bytes=plan.budget_bytes)
    return sim.run(plan, record=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def search_provenance(result: SearchResult, source: str) -> dict[str, Any]:
    """What a searched plan records about how it was found."""
    from .. import __version__

    cfg = result.config
    prov = {
        "source": source, "search": "backtracking", "alpha": cfg.alpha, "beta": cfg.beta,
        "evaluated": result.evaluated, "search_seconds": round(result.seconds, 3), "stopped_by": result.stopped_by,
        "autodist_version": __version__, "torch_version": torch.__version__,
    }
    if result.inside_headroom:
        prov["inside_headroom"] = True  # nothing fitted the budget less the headroom; this fits the budget
    if result.refined:
        prov["estimator"] = "learned: the finalists ranked by the simulator with the learned estimator"
    if result.preferred_seed:
        # the plan is the built-in seed, kept over a searched plan predicted less than this much faster
        prov["source"] = f"{source} (kept {result.preferred_seed})"
        prov["preferred_seed"] = result.preferred_seed
        prov["prefer_seed_within"] = round(cfg.prefer_seed_within, 4)
        prov["margin_source"] = cfg.margin_source
    return prov


def annotate(
    result: SearchResult, structure: Any, profile: Profile, *, device: torch.device, budget_bytes: int | None, source: str,
    sim: Simulator | None = None,
) -> Plan:
    """Complete the searched plan ``result.plan`` in place (and return it): the model it is made for,
    its device and budget, the prediction (with the seeds it beats, and the analytic step time where
    the learned estimator corrected it; with ``sim``, the step's phases beside the profile's model
    time in them) and its provenance."""
    plan, r = result.plan, result.result
    made_for(plan, structure, optimizer_states=profile.optimizer.state_names)
    plan.device = device.type
    plan.budget_bytes = budget_bytes
    plan.predicted = {
        "step_seconds": r.step_s,
        "peak_bytes": r.peak_bytes,
        "vs": {name: s.step_s / r.step_s for name, s in result.seeds.items() if s.feasible and r.step_s > 0},
    }
    if r.analytic_step_s is not None:  # the learned estimator corrected the prediction
        plan.predicted["analytic_step_seconds"] = r.analytic_step_s
    if sim is not None:  # where the predicted time goes, to set against a step timed by phase
        plan.predicted["phase_seconds"] = sim.phase_seconds(plan)
        plan.predicted["model_seconds"] = {
            "forward": profile.pre_fwd_s + profile.post_fwd_s + sum(u.fwd_s for u in profile.units),
            "backward": profile.pre_bwd_s + profile.post_bwd_s + sum(u.bwd_s for u in profile.units),
        }
        bare = profile.meta.get("bare_pass_s") or {}
        if "host_forward" in bare and "host_backward" in bare:  # on an accelerator: what issuing the model took the host
            plan.predicted["model_seconds"].update(host_forward=bare["host_forward"], host_backward=bare["host_backward"])
        plan.predicted["exposed_comm_seconds"] = r.exposed_comm_s
        if r.host_s:  # an asynchronous device: the host's issuing, and the device's wait for it
            plan.predicted["host_seconds"] = r.host_s
            plan.predicted["waiting_for_host_seconds"] = r.host_bound_s
    if plan.compile:  # the one-off cost of compiling its blocks, apart from the step
        plan.predicted["compile_seconds"] = sum(c.compile_s for b, c in profile.compiled_blocks.items() if b in plan.compile)
    plan.provenance = search_provenance(result, source)
    if "host_times" in profile.meta:  # on an accelerator: whether the units' host times were kept
        plan.provenance["profile_host_times"] = profile.meta["host_times"]
    if profile.compile_backend:  # the search could compile blocks (and which it chose is plan.compile)
        plan.provenance["compile_allowed"] = profile.compile_backend
        plan.compile_backend = profile.compile_backend
    return plan


def search_within_budget(
    space: Any, simulator: Callable[[int | None], Simulator], config: SearchConfig, budget: int | None,
) -> tuple[Searcher, SearchResult]:
    """Search within ``budget`` less the config's memory headroom (the simulator's measured peak
    error). When nothing is predicted to fit there but a plan is predicted to fit the budget itself,
    search again within the budget: that plan is enacted (its provenance says ``inside_headroom``
    and a warning says its measured peak may exceed the budget) rather than refused — the contract
    is that no plan predicted above the budget runs. ``simulator(b)`` builds a simulator for budget ``b``."""
    searcher = Searcher(space, simulator(config.planning_budget(budget)), config)
    result = searcher.run()
    if result.result.feasible or budget is None:
        return searcher, result
    smallest = (result.smallest_peak or (result.result.peak_bytes, None))[0]
    if smallest > budget:
        return searcher, result
    inside = Searcher(space, simulator(budget), config)
    again = inside.run()
    if not again.result.feasible:
        return searcher, result
    again.inside_headroom = True
    logger.warning(
        "autodist: no plan is predicted to fit %s less its %.0f%% headroom (the simulator's measured peak error); "
        "using one predicted at %s, within the budget but inside that margin: its measured peak may exceed the budget",
        format_bytes(budget), 100 * config.memory_headroom, format_bytes(again.result.peak_bytes),
    )
    return inside, again


def budget_error(budget: int, result: SearchResult, structure: Any, plan: Plan | None = None) -> BudgetError:
    """The error when no plan fits: the smallest predicted peak, what it is made of, and what would
    make a plan fit (the levers for the largest part first)."""
    peak, genome = result.smallest_peak or (result.result.peak_bytes, None)
    sim = result.smallest_peak_result or result.result
    parts = sorted(((v, k) for k, v in sim.breakdown.items() if v > 0), reverse=True)
    made_of = ", ".join(f"{k} {format_bytes(v)}" for v, k in parts) or "unknown"
    how = []
    if genome is not None:
        n_units = len(genome.shard)
        how.append(f"{sum(genome.shard)} of {n_units} units sharded")
        if genome.recompute:
            how.append(f"{len(genome.recompute)} block(s) recomputed")
        if genome.offload:
            how.append(f"{len(genome.offload)} optimizer-state tensor(s) offloaded to host memory")
    largest = parts[0][1] if parts else ""
    fixes = []
    if largest.startswith("activations"):
        fixes.append("reduce the batch per rank (activations grow with it)")
    fixes.append("launch more ranks (shards of parameters, gradients and optimizer state shrink with the world size)")
    if not largest.startswith("activations"):
        fixes.append("use mixed precision (MixedPrecision(param_dtype=torch.bfloat16))")
    fixes.append(f"or raise memory_limit above {format_bytes(peak)} if the device has room")
    headroom = result.config.memory_headroom
    return BudgetError(
        f"no plan fits the budget of {format_bytes(budget)} per rank (plans are kept {headroom:.0%} below it, the "
        f"simulator's measured error): the smallest predicted peak is "
        f"{format_bytes(peak)}{' (' + ', '.join(how) + ')' if how else ''}, made of {made_of}. "
        f"To fit: {'; '.join(fixes)}."
    )


def plan_offline(
    module: Any,
    example_inputs: tuple,
    *,
    world_size: int,
    budget_bytes: int,
    comm: CommModel,
    device: torch.device | None = None,
    config: SearchConfig | None = None,
    grad_accum_steps: int | None = None,
    example_kwargs: dict[str, Any] | None = None,
    profile: Profile | None = None,
) -> tuple[Plan, SearchResult, Profile]:
    """Plan for ``world_size`` ranks from one process (``autodist plan``): profile ``module`` here
    (unless given its ``profile``), search with ``comm`` (a cached sweep or an analytic model)
    under ``budget_bytes``. A two-level ``comm`` (several nodes) adds hybrid sharding to the
    search: shard groups of a node, or of several (``sched/space.py`` ``hybrid_shard_sizes``)."""
    device = device or torch.device("cpu")
    config = config or SearchConfig()
    comm = config.calibrated(comm)
    structure = discover(module)
    prof = profile or profile_model(module, structure, example_inputs, device=device, example_kwargs=example_kwargs)
    space = space_for(prof, structure, world_size, grad_accum_steps=grad_accum_steps,
                      shard_sizes=hybrid_shard_sizes(world_size, comm.ranks_per_node))
    searcher, result = search_within_budget(
        space, lambda budget: Simulator(prof, structure, comm, world_size=world_size, budget_bytes=budget),
        config, budget_bytes,
    )
    if not result.result.feasible:
        raise budget_error(budget_bytes, result, structure)
    annotate(result, structure, prof, device=device, budget_bytes=budget_bytes, source="autodist plan", sim=searcher.sim)
    return result.plan, result, prof
