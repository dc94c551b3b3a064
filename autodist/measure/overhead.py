"""What the runtime itself costs on the host: Python hooks, collective bookkeeping, DTensor dispatch.

Measured, not assumed: ``measure_runtime_overhead`` runs AutoDist on a one-rank group (collectives
become local copies, so only the runtime's own work remains) over a synthetic model of small units
in three configurations and solves for the cost per hooked unit, per gather and per bucket; it also
times an optimizer step over DTensor parameters against plain ones. On models with large layers
these are small; on models of many small layers they decide whether sharding pays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .robust import lower_quartile


@dataclass
class RuntimeOverhead:
    per_unit_s: float = 0.0  # forward + backward hooks of one unit whose parameters are swapped
    per_gather_s: float = 0.0  # issue + wait + copy-out of one gather group, beyond the transfer
    per_bucket_s: float = 0.0  # copy-in + launch + finish of one bucket, beyond the transfer
    dtensor_opt_per_tensor_s: float = 0.0  # extra optimizer time per DTensor parameter


ROUNDS = 8  # interleaved rounds over the configurations (see [Note: stable overhead figures])
STEPS_PER_ROUND = 3


def _clock(device: torch.device):
    """Thread CPU time for a single-threaded CPU rank (what the profile times; the other rank's work
    does not count), wall-clock time otherwise (on an accelerator the host's time is the cost)."""
    return time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


def _interleaved(steps: dict[str, object], device: torch.device, *, warmup: int = 3) -> dict[str, float]:
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


def _train_step(run: object, module: nn.Module, x: torch.Tensor):
    def one() -> None:
        run(x).sum().backward()
        for p in module.parameters():
            p.grad = None

    return one


def measure_runtime_overhead(device: torch.device, units: int = 12) -> RuntimeOverhead:
    """A collective over the default group (every rank measures; the slowest rank's values win)."""
    from ..plan import Bucket, GatherGroup, Plan, Prefetch, UnitPlan
    from ..runtime.comm import Comm
    from ..runtime.engine import Engine
    from ..structure import discover

    world = dist.get_world_size()
    rank = dist.get_rank()
    own, _ = dist.new_subgroups(group_size=1)
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(own, device.type)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(units)]).to(device)

    structure = discover(make())
    names = [u.name for u in structure.units]

    def plan(per_unit_groups: bool, per_unit_buckets: bool) -> Plan:
        ups = [UnitPlan(u.name, list(u.params), "shard", "after_backward") for u in structure.units]
        groups = [GatherGroup([n], Prefetch(0, 0)) for n in names] if per_unit_groups else [GatherGroup(names, Prefetch(0, 0))]
        order = [p for u in reversed(structure.units) for p in u.params]
        if per_unit_buckets:
            buckets = [Bucket(list(u.params), "reduce_scatter") for u in reversed(structure.units)]
        else:
            buckets = [Bucket(order, "reduce_scatter")]
        return Plan(world_size=1, units=ups, gather_groups=groups, buckets=buckets)

    x = torch.randn(4, 8, device=device)
    plain = make()
    steps = {"plain": _train_step(plain, plain, x)}
    comm = Comm(own)
    engines = []
    for key, (pg, pb) in {"A": (True, True), "B": (False, False), "C": (True, False)}.items():
        module = make()
        engine = Engine(
            module, plan(pg, pb), discover(module), comm=comm, mesh=mesh, device=device,
            mixed_precision=None, broadcast_buffers=False,
        )
        engines.append(engine)
        steps[key] = _train_step(lambda t, engine=engine: engine.forward((t,), {}), module, x)
    try:
        timings = _interleaved(steps, device)
    finally:
        for engine in engines:
            engine.close()
    k = units
    gather = max(0.0, (timings["C"] - timings["B"]) / (k - 1))
    bucket = max(0.0, (timings["A"] - timings["C"]) / (k - 1))
    unit = max(0.0, (timings["B"] - timings["plain"] - gather - bucket) / k)

    # optimizer over DTensor parameters vs plain tensors
    from torch.distributed.tensor import DTensor, Replicate

    n = 32
    plain = [torch.zeros(1024, device=device, requires_grad=True) for _ in range(n)]
    dts = [nn.Parameter(DTensor.from_local(torch.zeros(1024, device=device), mesh, [Replicate()], run_check=False)) for _ in range(n)]
    for p in plain:
        p.grad = torch.zeros_like(p)
    for p in dts:
        p.grad = DTensor.from_local(torch.zeros(1024, device=device), mesh, [Replicate()], run_check=False)

    opt_plain = torch.optim.AdamW(plain, lr=1e-3)
    opt_dts = torch.optim.AdamW(dts, lr=1e-3)
    opt = _interleaved({"plain": opt_plain.step, "dtensor": opt_dts.step}, device, warmup=1)
    dt_extra = max(0.0, (opt["dtensor"] - opt["plain"]) / n)
    values = torch.tensor([unit, gather, bucket, dt_extra], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    dist.destroy_process_group(own)
    del rank
    u, g, b, d = values.tolist()
    return RuntimeOverhead(per_unit_s=u, per_gather_s=g, per_bucket_s=b, dtensor_opt_per_tensor_s=d)
