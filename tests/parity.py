"""Parity runs: an AutoDist model on every rank against a single-process reference on the same data.

``run_case`` is executed on every rank of a pool. Each rank trains the AutoDist model on its slice of
a global batch, and also trains a plain copy of the model on the whole batch (the reference). After
every step it compares the global loss, the full gradients and the full parameters, and returns the
largest differences seen. Tolerances are applied by the calling test.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import models
from autodist import AutoDist, MixedPrecision
from autodist.builtins import block_groups
from autodist.plan import Bucket, GatherGroup, Plan, Prefetch, UnitPlan
from autodist.runtime.precision import cast_by_policy
from autodist.structure import discover


@dataclass
class Case:
    model: str = "mlp"
    plan: Any = "ddp"  # built-in name, or a dict of make_plan() options
    optim: str = "sgd"
    steps: int = 3
    per_rank: int = 4
    accumulate: int = 1
    zero_grad: str = "none"  # "none": set_to_none; "zeros": set_to_none=False; "never": accumulate across steps
    # "before_backward": zero_grad(set_to_none=True) between the step's first forward and its
    # backward (a common loop), checking that no gradient shows before backward
    zero_grad_at: str = "after_step"
    # a bf16 policy; the reference then computes as the policy does (bf16 copies of the parameters
    # but BatchNorm's, bf16 inputs, float32 gradients summed over per-rank chunks): the same
    # arithmetic on one process, so the tolerances stay those of float32
    bf16: bool = False
    clip: float | None = None
    extra: dict = field(default_factory=dict)
    meta: bool = False  # build the AutoDist model on the meta device (the reference on the CPU)
    # ranks per mesh (0: one mesh of every rank): the job is split into meshes of this many ranks
    # (``new_subgroups``), each training on its own; ``plan`` may then be a tuple, one per mesh
    mesh_size: int = 0
    # when buckets launch (engine.py LAUNCH_POLICIES): None is the backend's default ("ready" on
    # gloo); "sampled" runs NCCL's policy here
    launch_policy: str | None = None
    # blocks the plan compiles ("all": every block of the model) with ``compile_backend``; the
    # reference's blocks are compiled the same way
    compile: Any = ()
    compile_backend: str = "aot_eager"
    # forwards before each backward: the rank's batch in this many chunks, each through its own
    # forward, their losses summed into one backward (two views through one encoder); the
    # reference runs the same chunks, so BatchNorm sees the same batches
    forwards: int = 1
    # record the runtime's actions and report the most gather groups gathered at once
    # ("peak_gathered"), from its gathers and frees
    peak_groups: bool = False
    # a forward with gradients before each backward's own, its output dropped (a metric computed
    # outside no_grad): nothing of it may reach the gradients
    dropped_forward: bool = False
    # a forward without gradients between the loss and its backward (a target from the same
    # network, a metric): "no_grad", "inference_mode", or "eval" (under no_grad in model.eval());
    # it changes nothing the reference computes (models without BatchNorm)
    aside: str = ""
    # after each optimizer step, every parameter clamped to [-c, c] through ``p.data`` (WGAN's
    # weight clipping), which moves no version counter
    clamp_data: float | None = None
    # gradient hooks on the parameters, on the AutoDist model as on the reference: "scale" (each
    # parameter's gradient scaled by its own factor through ``register_hook``, registered after
    # wrapping; "scale-before-wrap" before), "optimizer-in-backward" (a per-parameter optimizer of
    # ``optim``'s kind stepped in a ``register_post_accumulate_grad_hook``; no optimizer step after
    # backward)
    hooks: str = ""


# every kind of residency a test of a training habit runs under: the built-in plans, persistent
# blocks, per-unit groups prefetched two ahead (names are test ids)
RESIDENCY_PLANS: dict[str, Any] = {
    "ddp": "ddp",
    "fsdp": "fsdp",
    "zero2": "zero2",
    "persistent": {"residency": "persistent", "grouping": "block"},
    "per-unit-window2": {"grouping": "unit", "window": 2},
}


def make_plan(
    model: torch.nn.Module,
    world: int,
    *,
    placement: str = "shard",
    residency: str = "after_forward",
    grouping: str = "unit",
    window: Any = 1,
    bwd_window: Any = None,
    buckets: str = "per_group",
    replicate_units: tuple[str, ...] = (),
    accumulate: str = "unsharded",
    recompute: Any = (),
    inflight: int | None = None,
) -> Plan:
    """A hand-written plan from a few knobs (see the test files for the combinations used);
    ``inflight``: the plan's ``max_inflight_buckets``."""
    s = discover(model)
    units = []
    for u in s.units:
        pl = placement
        if placement == "mixed":
            pl = "replicate" if len(units) % 2 else "shard"
        if u.name in replicate_units or any(len(s.params[p].shape) == 0 for p in u.params):
            pl = "replicate"
        units.append(UnitPlan(u.name, list(u.params), pl, residency, accumulate=accumulate))
    sharded = [u.name for u in units if u.placement == "shard"]
    if grouping == "unit":
        gl = [[u] for u in sharded]
    elif grouping == "all":
        gl = [sharded] if sharded else []
    elif grouping == "block":
        gl = [[u for u in g if u in sharded] for g in block_groups(s)]
        gl = [g for g in gl if g]
    else:
        raise ValueError(grouping)
    pf = Prefetch(forward=window, backward=window if bwd_window is None else bwd_window)
    groups = [GatherGroup(units=g, prefetch=pf) for g in gl]
    place = {u.name: u.placement for u in units}
    order = [p for u in reversed(units) for p in reversed(u.params) if s.params[p].requires_grad]

    def op(p: str) -> str:
        return "reduce_scatter" if place[s.unit_of_param[p]] == "shard" else "all_reduce"

    if buckets == "per_param":
        bl = [Bucket([p], op(p)) for p in order]
    elif buckets in ("one", "per_group"):
        bl = []
        for p in order:
            key = op(p) if buckets == "one" else (op(p), s.unit_of_param[p])
            if buckets == "per_group" and op(p) == "reduce_scatter":
                g = next(i for i, g in enumerate(gl) if s.unit_of_param[p] in g)
                key = ("rs", g)
            if bl and bl[-1][0] == key:
                bl[-1][1].append(p)
            elif buckets == "one" and any(k == key for k, _ in bl):
                next(ps for k, ps in bl if k == key).append(p)
            else:
                bl.append((key, [p]))
        bl = [Bucket(ps, op(ps[0])) for _, ps in bl]
    else:
        raise ValueError(buckets)
    blocks = list(s.blocks) if recompute == "all" else list(recompute)
    return Plan(
        world_size=world, units=units, gather_groups=groups, buckets=bl, recompute=blocks, provenance={"source": "test"},
        max_inflight_buckets=inflight,
    )


def train_mlp(m: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, steps: int, global_batch: int) -> None:
    """``steps`` optimizer steps of the ``mlp`` model on this rank's share of ``global_batch``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per = global_batch // world
    for _ in range(steps):
        x, y = models.batch("mlp", global_batch, gen)
        models.loss_fn("mlp", m(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()


def random_plan(model: torch.nn.Module, world: int, seed: int) -> Plan:
    """A random point of the search's plan space (placement, residency, groups, windows, buckets,
    in-flight bound), the same on every rank."""
    import random

    from autodist.sched.space import PlanSpace

    s = discover(model)
    space = PlanSpace(s, world, [u.name for u in s.units], list(reversed(s.trainable)))
    rng = random.Random(seed)
    plan = space.to_plan(space.mutate(space.random(rng), rng, moves=3))
    plan.provenance = {"source": f"test:random{seed}"}
    return plan


def _compiled_plan(plan: Any, base: torch.nn.Module, world: int, case: Case, ref: torch.nn.Module) -> Plan:
    """``plan`` (a built-in name or a Plan) compiling ``case.compile``; the same blocks of ``ref``
    compiled with the same backend."""
    from autodist.builtins import builtin_plan

    s = discover(base)
    if isinstance(plan, str):
        plan = builtin_plan(plan, s, world)
    plan.compile = list(s.blocks) if case.compile == "all" else list(case.compile)
    plan.compile_backend = case.compile_backend
    for name in plan.compile:
        block = ref.get_submodule(name)
        block.forward = torch.compile(block.forward, backend=case.compile_backend)
    return plan


def run_cases(cases: list[Case]) -> list[dict[str, float]]:
    """Several cases in one pool call (the ranks are spawned once)."""
    return [run_case(c) for c in cases]


def _chunks(lo: int, hi: int, n: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` in ``n`` equal chunks (a case's ``forwards``; ``per_rank`` is a multiple of it)."""
    size = (hi - lo) // n
    assert size * n == hi - lo, f"per_rank ({hi - lo}) must be a multiple of forwards ({n})"
    return [(lo + i * size, lo + (i + 1) * size) for i in range(n)]


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.full_tensor() if isinstance(t, DTensor) else t


def worst_difference(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    """The largest difference of any entry of ``ref``'s state dict from ``model``'s (full tensors:
    under a plan that shards, a collective)."""
    sd = model.state_dict()
    return max((_full(sd[k]) - v).abs().max().item() for k, v in ref.state_dict().items())


def _maxdiff(a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> float:
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        raise AssertionError(f"{what}: one side has no gradient (autodist={a is not None}, reference={b is not None})")
    return (a.detach().float() - b.detach().float()).abs().max().item() if a.numel() else 0.0


def _has_bn(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    raise ValueError(name)


def _scale_hooks(model: torch.nn.Module) -> None:
    """Each parameter's gradient scaled by a factor of its own (linear: the same whether a hook
    sees the local gradient or the reduced one)."""
    for i, p in enumerate(model.parameters()):
        p.register_hook(lambda g, f=0.5 + 0.25 * (i % 4): g * f)


def _step_in_backward(model: torch.nn.Module, kind: str, fired: list[int], slot: int) -> None:
    """torch's optimizer-in-backward recipe: one optimizer per parameter, stepped (and its
    gradient dropped) as soon as the gradient is in ``.grad``."""
    opts = {p: _optimizer(kind, [p]) for p in model.parameters()}

    def step(p: torch.Tensor) -> None:
        fired[slot] += 1
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)


def _aside_forward(model: torch.nn.Module, x: torch.Tensor, how: str) -> None:
    if how == "eval":
        model.eval()
    with torch.inference_mode() if how == "inference_mode" else torch.no_grad():
        model(x)
    if how == "eval":
        model.train()


def run_case(case: Case) -> dict[str, float]:
    group, extra, plan = None, dict(case.extra), case.plan
    if case.mesh_size:
        group, _ = dist.new_subgroups(group_size=case.mesh_size)
        extra["mesh"] = DeviceMesh.from_group(group, "cpu")
        if isinstance(plan, tuple):
            plan = plan[dist.get_rank() // case.mesh_size]
            if plan != "auto":  # the case's cache is for the meshes that plan "auto"
                extra.pop("cache_dir", None)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ref = models.make(case.model)
    rng_after_build = torch.get_rng_state()
    base = models.make(case.model, meta=case.meta)
    if isinstance(plan, dict) and "random" in plan:
        plan = random_plan(base, world, plan["random"])
    elif isinstance(plan, dict):
        plan = make_plan(base, world, **plan)
    if case.compile:
        from torch._dynamo.utils import counters

        counters.clear()
        plan = _compiled_plan(plan, base, world, case, ref)
    mpol = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if case.bf16 else None
    if case.hooks == "scale-before-wrap":
        _scale_hooks(base)
    model = AutoDist(base, plan=plan, mixed_precision=mpol, **extra)
    fired = [0, 0]
    if case.hooks == "scale":
        _scale_hooks(model)
    if case.hooks in ("scale", "scale-before-wrap"):
        _scale_hooks(ref)
    elif case.hooks == "optimizer-in-backward":
        _step_in_backward(model, case.optim, fired, 0)
        _step_in_backward(ref, case.optim, fired, 1)
    if case.launch_policy is not None:
        model.runtime.set_launch_policy(case.launch_policy)
    actions = model.runtime.record_actions() if case.peak_groups else None
    initial: dict[str, Any] = {}
    if case.meta:  # materialised as the CPU build: the same values and the generator where it left it
        sd = model.state_dict()
        initial = {
            "differing": [k for k, v in ref.state_dict().items() if not torch.equal(sd[k], v)],
            "rng_as_after_cpu_build": torch.equal(torch.get_rng_state(), rng_after_build),
        }
    opt = _optimizer(case.optim, model.parameters())
    ropt = _optimizer(case.optim, ref.parameters())
    gen = torch.Generator().manual_seed(1234)
    bn = _has_bn(ref)
    as_run = case.bf16  # the reference computes as the bf16 policy does
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "buffer": 0.0}
    ref_params = dict(ref.named_parameters())
    for step in range(case.steps):
        if case.model == "unused":
            base.use_sometimes = ref.use_sometimes = step % 2 == 0
        total_loss = torch.zeros(())
        ref_total = 0.0
        for micro in range(case.accumulate):
            x, y = models.batch(case.model, case.per_rank * world, gen)
            lo, hi = rank * case.per_rank, (rank + 1) * case.per_rank
            sync = micro == case.accumulate - 1
            ctx = model.no_sync() if not sync else _nullctx()
            chunks = _chunks(lo, hi, case.forwards)
            with ctx:
                if case.dropped_forward:
                    model(x[lo:hi])
                loss = sum(models.loss_fn(case.model, model(x[a:b]).float(), y[a:b]) for a, b in chunks) / (
                    case.accumulate * case.forwards)
                if case.aside:
                    _aside_forward(model, x[lo:hi], case.aside)
                if case.zero_grad_at == "before_backward" and micro == 0:
                    opt.zero_grad(set_to_none=True)
                    ropt.zero_grad(set_to_none=True)
                    shown = [n for n, p in model.named_parameters() if p.grad is not None]
                    assert not shown, f"gradients before backward: {shown[:3]}"
                loss.backward()
            total_loss += loss.detach().float()
            # reference: concatenated batch (per-rank chunks when BatchNorm must see each rank's batch)
            if bn or as_run:
                bufs0 = copy.deepcopy(dict(ref.named_buffers()))
                rank0_bufs = None
                for r in range(world):
                    for k, v in ref.named_buffers():
                        v.copy_(bufs0[k])
                    for a, b in _chunks(r * case.per_rank, (r + 1) * case.per_rank, case.forwards):
                        with as_policy(ref, as_run):
                            xs = x[a:b].bfloat16() if as_run and x.is_floating_point() else x[a:b]
                            rl = models.loss_fn(case.model, ref(xs).float(), y[a:b]) / (case.accumulate * world * case.forwards)
                            rl.backward()
                        ref_total += rl.item()
                    if r == 0:
                        rank0_bufs = {k: v.clone() for k, v in ref.named_buffers()}
                for k, v in ref.named_buffers():
                    v.copy_(rank0_bufs[k])
            else:
                rl = models.loss_fn(case.model, ref(x), y) / case.accumulate
                rl.backward()
                ref_total += rl.item()
        dist.all_reduce(total_loss, group=group)
        worst["loss"] = max(worst["loss"], abs(total_loss.item() / world - ref_total))
        named = dict(model.named_parameters())
        for name, p in named.items():
            worst["grad"] = max(worst["grad"], _maxdiff(_full(p.grad), ref_params[name].grad, f"step {step} {name}.grad"))
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), case.clip)
        if case.hooks != "optimizer-in-backward":
            opt.step()
            ropt.step()
        if case.clamp_data is not None:
            for p in [*model.parameters(), *ref.parameters()]:
                p.data.clamp_(-case.clamp_data, case.clamp_data)
        if case.zero_grad_at == "before_backward":
            pass
        elif case.zero_grad == "none":
            opt.zero_grad(set_to_none=True)
            ropt.zero_grad(set_to_none=True)
        elif case.zero_grad == "zeros":
            opt.zero_grad(set_to_none=False)
            ropt.zero_grad(set_to_none=False)
        sd = model.state_dict()
        for name, v in ref.state_dict().items():
            if name in ref_params:
                worst["param"] = max(worst["param"], _maxdiff(sd[name], v, f"step {step} {name}"))
            elif rank == 0:  # buffers: floating and not (BatchNorm's batch counter)
                worst["buffer"] = max(worst["buffer"], _maxdiff(sd[name], v, f"step {step} buffer {name}"))
    if case.compile:
        from torch._dynamo.utils import counters

        worst["graph_breaks"] = sum(counters["graph_break"].values())
        worst["compiled_blocks"] = list(model.runtime.compiled.blocks)
    if actions is not None:
        worst["peak_gathered"] = peak_gathered(actions.actions)
    if hasattr(base, "ran"):  # the experts each forward of a mixture of experts ran
        worst["ran"] = base.ran
    worst["stats"] = model.runtime.comm.stats.__dict__.copy()
    worst["stats"].pop("log", None)
    worst["runtime"] = model.runtime.stats.__dict__.copy()
    worst["sharded_units"] = len(model.plan.sharded_units)
    worst["shard_ranks"] = model.plan.shard_ranks
    worst["plan_source"] = model._auto.stats.source if model._auto is not None else "given"
    worst["grad_accum_steps"] = model.plan.grad_accum_steps
    worst["initial"] = initial
    worst["hooks_fired"] = fired
    worst["sweeps"] = model._auto.stats.sweeps if model._auto is not None else 0
    comm = model.runtime.comm
    worst["group_names"] = [comm.gather_pg.group_name, comm.reduce_pg.group_name]
    model.close()
    if group is not None:
        dist.destroy_process_group(group)
    return worst


def peak_gathered(actions: list[tuple[str, str]]) -> int:
    """The most gather groups gathered at once in a runtime's action log (a group is gathered from
    its ``gather`` to its ``free``; gathering one gathered already, stale, counts it once)."""
    live: set[str] = set()
    peak = 0
    for kind, label in actions:
        if kind == "gather":
            live.add(label)
            peak = max(peak, len(live))
        elif kind == "free":
            live.discard(label)
    return peak


@contextlib.contextmanager
def as_policy(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """Meanwhile ``model`` computes as a bf16 policy runs it: bf16 copies of its floating-point
    parameters but BatchNorm's; the copies' gradients are added, in float32, to what the parameters
    held before."""
    if not on:
        yield
        return
    kept = [(p, p.data, p.grad) for p in cast_by_policy(model, torch.bfloat16)]
    for p, data, _ in kept:
        p.grad = None
        p.data = data.to(torch.bfloat16)
    try:
        yield
    finally:
        for p, data, held in kept:
            new, p.grad = p.grad, None
            p.data = data
            p.grad = held if new is None else (new.float() if held is None else held + new.float())


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def check(results: list[dict[str, float]], *, atol: float) -> None:
    for rank, r in enumerate(results):
        for key in ("loss", "grad", "param", "buffer"):
            assert r[key] <= atol, f"rank {rank}: max {key} difference {r[key]:.3g} exceeds {atol:.1g} ({r})"


def check_within(results: list[dict[str, float]], *, atol: float) -> None:
    """Every rank's named differences (``results``: per rank, name -> difference) within ``atol``."""
    for rank, worst in enumerate(results):
        bad = {k: v for k, v in worst.items() if v > atol}
        assert not bad, f"rank {rank}: {bad}"


def check_cases(results: list[list[dict[str, float]]], names: list[str], *, atol: float) -> None:
    """:func:`check` every case of a :func:`run_cases` run (``results``: per rank, per case), naming
    the case that fails."""
    for i, name in enumerate(names):
        try:
            check([r[i] for r in results], atol=atol)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def profiled_mlp(plan_kw: dict[str, Any], world: int = 2) -> tuple[Any, Any, Plan, torch.Tensor, torch.Tensor]:
    """On this rank: the test MLP's structure and profile (one pass, no memory), a plan of
    ``plan_kw`` (:func:`make_plan`) and this rank's batch of 4 — what a test comparing a wrapped
    model's step with the simulated one starts from."""
    from autodist.measure.trace import profile_model

    plain = models.make("mlp")
    structure = discover(plain)
    x, y = models.batch("mlp", 4, torch.Generator().manual_seed(dist.get_rank()))
    prof = profile_model(plain, structure, (x,), device=torch.device("cpu"), repeats=1, memory=False)
    return structure, prof, make_plan(models.make("mlp"), world, **plan_kw), x, y

