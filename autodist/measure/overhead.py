"""What the runtime itself costs on the host: Python hooks, collective bookkeeping, DTensor dispatch.

Measured, not assumed: ``measure_runtime_overhead`` runs AutoDist on one-rank groups (collectives
become local copies, so only the runtime's own work remains; see [Note: a one-rank world of its
own]) over a synthetic model of small units
in several configurations and solves for the cost per hooked unit (and per unit of a group hooked at
its root), per gather and per bucket; it also
times an optimizer step over DTensor parameters against plain ones. On models with large layers
these are small; on models of many small layers they decide whether sharding pays.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..runtime.comm import Comm
from .robust import lower_quartile

logger = logging.getLogger("autodist")


@dataclass
class RuntimeOverhead:
    per_unit_s: float = 0.0  # forward + backward hooks of one unit whose parameters are swapped
    per_gather_s: float = 0.0  # issue + wait + copy-out of one gather group, beyond the transfer
    per_bucket_s: float = 0.0  # copy-in + launch + finish of one bucket, beyond the transfer
    dtensor_opt_per_tensor_s: float = 0.0  # extra optimizer time per DTensor parameter
    per_param_s: float = 0.0  # a replicated parameter's gradient-ready hook and copy into its bucket
    per_step_s: float = 0.0  # the runtime's fixed work per step: root forward, start and end of backward
    # a unit of a gather group enacted at its root module (autodist/schedule.py [Note: hooks per gather
    # group]): its parameters' swaps and gradient hooks, and its share of the root's hooks
    per_grouped_unit_s: float = 0.0
    # the parameters of the smaller model per_param_s was measured between (and one twice its size;
    # [Note: the per-parameter cost at a model's scale]); 0: before it was taken at a model's scale
    per_param_at: int = 0


ROUNDS = 8  # interleaved rounds over the configurations (see [Note: stable overhead figures])
STEPS_PER_ROUND = 3


def _clock(device: torch.device) -> Callable[[], float]:
    """Thread CPU time for a single-threaded CPU rank (what the profile times; the other rank's work
    does not count), wall-clock time otherwise (on an accelerator the host's time is the cost)."""
    return time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


def _interleaved(steps: Mapping[str, Callable[[], object]], device: torch.device, *, warmup: int = 3) -> dict[str, float]:
    """Each of ``steps`` (name -> a function running one step) timed over ``ROUNDS`` interleaved
    rounds of ``STEPS_PER_ROUND`` steps; the lower quartile of each one's times.

    [Note: stable overhead figures] The costs are solved from differences between configurations
    of a few milliseconds each; timed one after another (ten steps of one, then ten of the next),
    a disturbance of the host during one configuration's turn moved the solved costs 2-5x between
    sweeps. Interleaved rounds spread a disturbance over every configuration, and the lower
    quartile of thread time ignores what is left of it."""
    now = _clock(device)
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    for r in range(ROUNDS):
        for name in names if r % 2 == 0 else reversed(names):
            fn = steps[name]
            for _ in range(STEPS_PER_ROUND):
                t0 = now()
                fn()
                times[name].append(now() - t0)
    return {k: lower_quartile(v) for k, v in times.items()}


def _train_step(run: Callable[[torch.Tensor], Any], module: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def one() -> None:
        run(x).sum().backward()
        for p in module.parameters():
            p.grad = None

    return one


def measure_runtime_overhead(device: torch.device, comm: Comm) -> RuntimeOverhead:
    """A collective over ``comm``'s group: every rank measures, the slowest rank's figures win.

    [Note: a one-rank world of its own] The runtime's own work is measured with AutoDist on a
    one-rank group per rank: its collectives are local copies, so only the runtime's bookkeeping is
    left, and the collectives' issue cost, which the comm model takes from the sweep, is not counted
    twice (measured on the mesh's real groups the figures came out about 2x: 2 CPU ranks, per unit
    208-278 us against 141-158). Where the mesh is the whole job, the one-rank groups are made here
    with ``new_subgroups``, a collective over every rank, all of which are sweeping. On a mesh
    smaller than the job that would wait for ranks outside it, and a group made by some ranks only
    advances their group counter, which names every later group (the next group made over every
    rank then waits forever); so there the figures come from a child process that is a one-rank
    world of its own (``python -m autodist.measure.overhead``; about 5 s on a CPU host, and on an
    accelerator a second context on the device while it runs). Where the child cannot run (no
    interpreter to start, a crash) on some rank, every rank of the mesh measures on ``comm``'s own
    groups instead, warned: the collectives are then real, and their issue cost is counted twice."""
    if comm.world_size == dist.get_world_size():
        own, _ = dist.new_subgroups(group_size=1)
        if own is None:  # every rank is in a group of one
            raise RuntimeError(f"torch made no one-rank group for rank {dist.get_rank()} to measure the runtime on")
        try:
            figures = _measure(device, Comm(own), DeviceMesh.from_group(own, device.type))
        finally:
            dist.destroy_process_group(own)
    else:
        error, figures = _in_a_child(device)
        failed = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64, device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=comm.group)
        if failed.item():
            logger.warning(
                "autodist: the runtime's overhead could not be measured in a process of its own (%s); measuring "
                "it on the mesh's own process groups, which counts each collective's issue cost twice",
                error or "on another rank",
            )
            figures = _measure(device, comm.sharing_groups(), DeviceMesh.from_group(comm.group, device.type))
    values = torch.tensor(figures, dtype=torch.float64, device=device)
    if comm.world_size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=comm.group)
    u, g, b, d, r, f, c, at = values.tolist()
    return RuntimeOverhead(
        per_unit_s=u, per_gather_s=g, per_bucket_s=b, dtensor_opt_per_tensor_s=d, per_param_s=r, per_step_s=f,
        per_grouped_unit_s=c, per_param_at=int(at),
    )


CHILD_TIMEOUT_S = 300.0
FIGURES = 8  # what _measure returns
_LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def _in_a_child(device: torch.device) -> tuple[str | None, list[float]]:
    """(None, the eight figures) measured in a child process, or (what went wrong, [])."""
    import autodist

    root = os.path.dirname(os.path.dirname(os.path.abspath(autodist.__file__)))
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if device.type == "cuda" and device.index is None:  # the child runs on this rank's device
        device = torch.device("cuda", torch.cuda.current_device())
    cmd = [sys.executable, "-m", "autodist.measure.overhead", "--device", str(device), "--threads", str(torch.get_num_threads())]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}", []
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        return f"the child exited with status {done.returncode}: {tail[0]}", []
    try:
        figures = [float(v) for v in json.loads(lines[-1])]
    except (ValueError, TypeError) as e:
        return f"the child's answer was unreadable: {e}", []
    if len(figures) != FIGURES or not all(math.isfinite(v) and v >= 0 for v in figures):
        return f"the child's answer was not {FIGURES} figures: {lines[-1]!r}", []
    return None, figures


WIDE_UNITS = 150  # units of the models the per-parameter figure is measured between (and twice as many)


def _measure(device: torch.device, comm: Comm, mesh: DeviceMesh, units: int = 12, wide: int = WIDE_UNITS) -> list[float]:
    """[per unit, per gather, per bucket, DTensor optimizer per tensor, per replicated parameter,
    per step, per unit of a group hooked at its root, the parameters the per-parameter figure was
    measured at] in seconds (the last a count), on ``comm``.

    [Note: the per-parameter cost at a model's scale] A replicated parameter's gradient hook, its
    bucket slot and the view attached as its gradient cost more per parameter in a model of
    hundreds of parameters than in one of tens: the objects each touches no longer stay in the
    CPU's caches between steps. Measured between models of 24 and 48 parameters it read 3.1 us on
    the development host, between 300 and 600 parameters 5.0 us, and gpt-deep's 580 parameters
    under ``ddp`` cost its step 3.7 ms over the unwrapped model's where the small models' figure
    predicted 1.2 (tools/bench.py, one rank). Real models have hundreds of parameter tensors (a
    Llama of 8B: 291; of 70B: 723), so the figure is taken between ``wide`` units (two parameters
    each) and twice as many; the fixed cost per step still comes from the small pair, whose line
    through the origin the other figures are solved against."""
    from ..plan import Bucket, GatherGroup, Plan, Prefetch, UnitPlan
    from ..runtime.engine import Engine
    from ..structure import discover

    def make(n: int = units) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)]).to(device)

    structure = discover(make())
    names = [u.name for u in structure.units]

    def replicated(n: int) -> Plan:
        s = discover(make(n))
        ups = [UnitPlan(u.name, list(u.params), "replicate", "after_backward") for u in s.units]
        order = [p for u in reversed(s.units) for p in u.params]
        return Plan(world_size=comm.world_size, units=ups, gather_groups=[], buckets=[Bucket(order, "all_reduce")])

    def plan(per_unit_groups: bool, per_unit_buckets: bool) -> Plan:
        ups = [UnitPlan(u.name, list(u.params), "shard", "after_backward") for u in structure.units]
        groups = [GatherGroup([n], Prefetch(0, 0)) for n in names] if per_unit_groups else [GatherGroup(names, Prefetch(0, 0))]
        order = [p for u in reversed(structure.units) for p in u.params]
        if per_unit_buckets:
            buckets = [Bucket(list(u.params), "reduce_scatter") for u in reversed(structure.units)]
        else:
            buckets = [Bucket(order, "reduce_scatter")]
        return Plan(world_size=comm.world_size, units=ups, gather_groups=groups, buckets=buckets)

    x = torch.randn(4, 8, device=device)
    plain, plain2 = make(), make(2 * units)
    steps = {"plain": _train_step(plain, plain, x), "plain2": _train_step(plain2, plain2, x)}
    engines = []
    # B: one group of every unit, hooked at the root (the model); B1: the same, every unit hooked
    configurations = {
        "A": plan(True, True), "B": plan(False, False), "B1": plan(False, False), "C": plan(True, False),
        "D": replicated(units), "D2": replicated(2 * units), "W": replicated(wide), "W2": replicated(2 * wide),
    }
    sizes = {"D2": 2 * units, "W": wide, "W2": 2 * wide}
    plain_w, plain_w2 = make(wide), make(2 * wide)
    steps["plainW"], steps["plainW2"] = _train_step(plain_w, plain_w, x), _train_step(plain_w2, plain_w2, x)
    for key, the_plan in configurations.items():
        module = make(sizes.get(key, units))
        engine = Engine(
            module, the_plan, discover(module), comm=comm, mesh=mesh, device=device,
            mixed_precision=None, broadcast_buffers=False, collapse=key != "B1",
        )
        engines.append(engine)

        def run(t: torch.Tensor, engine: Engine = engine) -> Any:
            return engine.forward((t,), {})

        steps[key] = _train_step(run, module, x)
    try:
        timings = _interleaved(steps, device)
    finally:
        for engine in engines:
            engine.close()
    k = units
    gather = max(0.0, (timings["C"] - timings["B1"]) / (k - 1))
    bucket = max(0.0, (timings["A"] - timings["C"]) / (k - 1))
    # a replicated plan hooks no module: what it adds is each parameter's gradient-ready hook, and
    # the runtime's fixed work per step (root forward, start and end of backward, its one bucket's
    # launch); twice the units tell the two apart
    d1, d2 = timings["D"] - timings["plain"], timings["D2"] - timings["plain2"]
    small_per_param = max(0.0, (d2 - d1) / (2 * k))
    per_step = max(0.0, d1 - 2 * k * small_per_param)
    # [Note: the per-parameter cost at a model's scale]
    w1, w2 = timings["W"] - timings["plainW"], timings["W2"] - timings["plainW2"]
    per_param = max(0.0, (w2 - w1) / (2 * wide))
    unit = max(0.0, (timings["B1"] - timings["plain"] - gather - bucket - per_step) / k)
    grouped = max(0.0, (timings["B"] - timings["plain"] - gather - bucket - per_step) / k)

    # optimizer over DTensor parameters vs plain tensors
    from torch.distributed.tensor import DTensor, Replicate

    n = 32
    plain_params = [torch.zeros(1024, device=device, requires_grad=True) for _ in range(n)]
    dts = [nn.Parameter(DTensor.from_local(torch.zeros(1024, device=device), mesh, [Replicate()], run_check=False)) for _ in range(n)]
    for p in plain_params:
        p.grad = torch.zeros_like(p)
    for p in dts:
        p.grad = DTensor.from_local(torch.zeros(1024, device=device), mesh, [Replicate()], run_check=False)

    opt_plain = torch.optim.AdamW(plain_params, lr=1e-3)
    opt_dts = torch.optim.AdamW(dts, lr=1e-3)
    opt = _interleaved({"plain": opt_plain.step, "dtensor": opt_dts.step}, device, warmup=1)
    dt_extra = max(0.0, (opt["dtensor"] - opt["plain"]) / n)
    return [unit, gather, bucket, dt_extra, per_param, per_step, grouped, float(2 * wide)]


def _child(argv: list[str] | None = None) -> None:
    """The child process: a one-rank world of its own, the figures as one JSON line on stdout."""
    import argparse

    ap = argparse.ArgumentParser(description="measure the AutoDist runtime's own overhead (a one-rank world)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "gloo" if device.type == "cpu" else dist.get_default_backend_for_device(device)
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        world = dist.group.WORLD
        if world is None:
            raise RuntimeError("init_process_group made no default process group")
        figures = _measure(device, Comm(world), DeviceMesh.from_group(world, device.type))
    finally:
        dist.destroy_process_group()
    sys.stdout.write(json.dumps(figures) + "\n")


if __name__ == "__main__":
    _child()
