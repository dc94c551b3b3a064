"""The GPU acceptance run: verify the CUDA paths and measure AutoDist against DDP and FSDP2.

    python tools/gpu_check.py --json gpu_check.json      # everything, on as many GPUs as there are (at most 2)
    python tools/gpu_check.py --nproc 1 --skip-bench
    python tools/gpu_check.py --device cpu --quick       # a dry run of the script itself on the CPU (gloo)

The test suite runs on the CPU with gloo, so these paths are written the FSDP2 way and
exercised here only: NCCL collectives and the launch policy NCCL selects ("sampled", see
[Note: one issue order for NCCL] in autodist/runtime/engine.py), device placement of every managed
tensor, activation recomputation and every user checkpointing mode on autograd's device threads,
offload copies on a copy stream into pinned memory ordered by events, the caching allocator against
a budget, and step time, overhead and peak memory against DDP and FSDP2 (``tools/bench.py
--device cuda``). NCCL refuses two ranks on one GPU, so with one GPU a world of one runs, where no
collective crosses ranks: what that leaves unverified is printed at the end.

Checks (``--checks``):

* ``parity`` — built-in and hand-written plans, recomputation, accumulation, bf16 with fp32
  reduction, every user checkpointing mode (reentrant, non-reentrant, selective, wrapper, every
  other block) under ddp, fsdp and zero2, and Hugging Face GPT-2 and Llama with gradient
  checkpointing where transformers is installed, against a single-process reference on the same device (3 steps);
* ``offload`` — all optimizer state offloaded (pinned memory, copy stream, events) trains bitwise
  like no offload;
* ``allocator`` — what the caching allocator holds that no tensor names (a stream's cuBLAS
  workspace), for reading the budget cases;
* ``budget`` — ``plan="auto"`` under budgets, fp32 and bf16: the allocator's peak
  (``max_memory_allocated``) stays within the budget and is compared with the plan's prediction
  (target: within 5%);
* ``bench`` — ``tools/bench.py`` at one GPU's scale (a GPT of large layers and one of many small
  layers), fp32 and bf16: step time, overhead over the unwrapped model, peak, auto's prediction;
  then the many-small-layer GPT's wrappers timed step by step in turn (``--interleave``): AutoDist's
  per-step cost against DDP's and FSDP2's as median differences of neighbouring steps.

Everything goes into one JSON (``--json``); ``--minutes`` bounds the run (what did not start in time
is reported as not run) and ``--trace-dir`` keeps the allocator's history of the budget cases.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

CHECKPOINTING = ["reentrant", "nonreentrant", "selective", "wrapper", "alternate"]


def _peak_reset(device):
    import gc

    import torch

    gc.collect()  # what earlier cases left in reference cycles is not this case's memory
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _whole(t):
    """A DTensor's full value (a plain tensor as it is)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train_against_reference(device, rank, world, model_name, plan, extra, micro, steps=3, hooks=""):
    """Max parameter (and buffer) difference after ``steps`` SGD steps of AutoDist against the
    single-process reference on the same device (computing as the mixed-precision policy does,
    where ``extra`` has one), the largest over the ranks, and whether every managed tensor is on
    ``device``. ``hooks``: gradient hooks on both models' parameters, as ``parity.Case.hooks``
    ("scale", "optimizer-in-backward": stepped in post-accumulate hooks, run on autograd's device
    thread on CUDA; "penalty": an L2 term of the parameters added to the loss outside the forward;
    "root-call": the root module called directly, not the wrapper)."""
    import torch
    import torch.distributed as dist

    import models
    from autodist import AutoDist
    from parity import _scale_hooks, _step_in_backward, as_policy, make_plan

    ref, base = models.make(model_name).to(device), models.make(model_name)
    if isinstance(plan, dict):
        plan = make_plan(base, world, **plan)
    model = AutoDist(base, plan=plan, **extra)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    fired = [0, 0]
    if hooks == "scale":
        _scale_hooks(model)
        _scale_hooks(ref)
    elif hooks == "optimizer-in-backward":
        _step_in_backward(model, "sgd", fired, 0)
        _step_in_backward(ref, "sgd", fired, 1)
    gen = torch.Generator().manual_seed(0)
    bufs: list[dict[str, torch.Tensor]] = []  # each rank's buffers (BatchNorm's statistics)
    for _ in range(steps):
        for m in range(micro):
            x, y = models.batch(model_name, 2 * world, gen)
            x, y = x.to(device), y.to(device)
            mine = slice(rank * 2, (rank + 1) * 2)
            ctx = model.no_sync() if m < micro - 1 else torch.enable_grad()
            with ctx:
                # "penalty": an L2 term of the parameters outside the forward, computed before it, so
                # that autograd reaches it last ([Note: gradients that reach a parameter outside its
                # bucket]); the reference adds it once a step, below
                penalty = sum(_whole((p ** 2).sum()) for p in model.parameters()) if hooks == "penalty" else 0.0
                # "root-call": the root module called directly, as DDP code's raw_model ([Note: a
                # submodule called outside the model's forward])
                fwd = model.module if hooks == "root-call" else model
                (models.loss_fn(model_name, fwd(x[mine]).float(), y[mine]).div(micro) + 0.05 * penalty).backward()
            # under a bf16 policy the reference computes as the policy does (bf16 copies but
            # BatchNorm's, bf16 inputs, float32 gradients), and rank by rank, as the ranks do: the
            # same arithmetic on one process (bf16 sums a batch of 2 and one of 4 apart; BatchNorm
            # normalises each rank's batch). Each rank's buffers are kept apart: a forward after a
            # synchronised one (the first micro-batch of a step) starts from rank 0's, broadcast as
            # DDP's ([Note: when buffers are broadcast] in autodist/runtime/engine.py), one under
            # no_sync from the rank's own; this rank's are the reference's at the end
            policy = "mixed_precision" in extra
            if m == 0:
                base = bufs[0] if bufs else {k: v.clone() for k, v in ref.named_buffers()}
                bufs = [dict(base) for _ in range(world)]
            for r in range(world):
                for k, v in ref.named_buffers():
                    v.copy_(bufs[r][k])
                chunk = slice(r * 2, (r + 1) * 2)
                with as_policy(ref, policy):
                    xr = x[chunk].bfloat16() if policy and x.is_floating_point() else x[chunk]
                    models.loss_fn(model_name, ref(xr).float(), y[chunk]).div(micro * world).backward()
                bufs[r] = {k: v.clone() for k, v in ref.named_buffers()}
        if hooks == "penalty":
            (0.05 * sum((p ** 2).sum() for p in ref.parameters())).backward()
        if hooks != "optimizer-in-backward":
            for o in (opt, ropt):
                o.step()
                o.zero_grad()
    if hooks == "optimizer-in-backward" and fired[0] != fired[1]:
        model.close()
        return float("inf"), False, f"post-accumulate hooks ran {fired[0]} times, the reference's {fired[1]}"
    for k, v in ref.named_buffers():
        v.copy_(bufs[rank][k])
    sd = model.state_dict()
    diff = max((sd[k].float() - v.float()).abs().max().item() for k, v in ref.state_dict().items())
    if world > 1:  # every rank's against its own reference; rank 0 reports the largest
        worst = torch.tensor([diff], device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        diff = worst.item()
    on_device = all(mp.local.device == device for mp in model.runtime.params.values())
    policy = model.runtime.launch_policy
    model.close()
    return diff, on_device, policy


def _parity(device, rank, world, args, out):
    import torch

    from autodist import MixedPrecision

    bf16 = {"mixed_precision": MixedPrecision(torch.bfloat16, torch.float32)}
    cases = {
        "ddp": ("gpt", "ddp", {}, 1),
        "fsdp": ("gpt", "fsdp", {}, 1),
        "zero2": ("gpt", "zero2", {}, 1),
        "persistent": ("gpt", {"residency": "persistent", "grouping": "block"}, {}, 1),
        "recompute-all-blocks": ("gpt", {"grouping": "block", "recompute": "all"}, {}, 1),
        "accumulate-3-sharded": ("gpt", {"grouping": "block", "accumulate": "sharded"}, {}, 3),
        "bf16-fp32-reduce-fsdp": ("gpt", "fsdp", bf16, 2),
        "bf16-fp32-reduce-ddp": ("gpt", "ddp", bf16, 2),
        # BatchNorm keeps float32 parameters under the policy (cuDNN's kernel on bf16 activations)
        "bf16-batchnorm-ddp": ("resnet", "ddp", bf16, 1),
        "bf16-batchnorm-fsdp": ("resnet", "fsdp", bf16, 1),
        # a layer frozen when wrapped: its bf16 copy is cast at every step's first forward, on the compute
        # stream ([Note: compute copies cast at every forward])
        "bf16-frozen-ddp": ("frozen", "ddp", bf16, 1),
        "bf16-frozen-fsdp": ("frozen", "fsdp", bf16, 1),
        # user hooks on the parameters: forwarded from the leaves the forward uses, and stepped at the
        # end of backward ([Note: hooks on the visible parameters])
        "hooks-scale-fsdp": ("gpt", "fsdp", {}, 1, "scale"),
        "hooks-scale-fsdp-bf16": ("gpt", "fsdp", bf16, 1, "scale"),
        "optimizer-in-backward-ddp": ("gpt", "ddp", {}, 1, "optimizer-in-backward"),
        "optimizer-in-backward-fsdp": ("gpt", "fsdp", {}, 1, "optimizer-in-backward"),
        "penalty-outside-forward-fsdp": ("gpt", "fsdp", {}, 1, "penalty"),
        "penalty-outside-forward-ddp-bf16": ("gpt", "ddp", bf16, 1, "penalty"),
        "root-module-called-persistent": ("gpt", {"residency": "persistent"}, {}, 1, "root-call"),
        "root-module-called-ddp-bf16": ("gpt", "ddp", bf16, 1, "root-call"),
    }
    for mode in CHECKPOINTING if not args.quick else ["reentrant", "nonreentrant"]:
        for plan in ("ddp", "fsdp", "zero2"):
            cases[f"user-checkpointing-{mode}-{plan}"] = (f"gpt-ckpt-{mode}", plan, {}, 1)
    cases["user-checkpointing-reentrant-fsdp-bf16"] = ("gpt-ckpt-reentrant", "fsdp", bf16, 1)
    for name, (model_name, plan, extra, micro, *hooks) in cases.items():
        if hooks == ["optimizer-in-backward"] and world > 1:  # the reference runs a backward per rank's chunk
            out[name] = (None, "one rank only: the reference would step once per rank's chunk")
            continue
        diff, on_device, policy = _train_against_reference(device, rank, world, model_name, plan, extra, micro,
                                                           hooks=hooks[0] if hooks else "")
        tol = 1e-3 if "bf16" in name else 1e-4
        out[name] = (diff <= tol and on_device,
                     f"max parameter difference {diff:.2e} (tolerance {tol:g}); tensors on {device}: {on_device}; "
                     f"bucket launches: {policy}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        out["hugging-face-checkpointing"] = (None, "transformers is not installed: not verified")
        return
    from test_recompute import hf_gradient_checkpointing

    for arch in ("gpt2", "llama"):
        for plan in ("ddp", "fsdp", "zero2"):
            for reentrant in (True, False):
                diff = hf_gradient_checkpointing(arch, plan, reentrant, device=str(device))
                name = f"hf-{arch}-{'reentrant' if reentrant else 'nonreentrant'}-{plan}"
                out[name] = (diff <= 1e-4, f"max parameter difference {diff:.2e} (tolerance 0.0001)")


def _offload(device, rank, world, args, out):
    import dataclasses

    import torch

    import models
    from autodist import AutoDist, OffloadFragment
    from autodist.builtins import fsdp_plan
    from autodist.runtime.params import shard_geometry
    from autodist.structure import discover

    def train(offload: bool):
        torch.manual_seed(0)
        base = models.make("gpt")
        s = discover(base)
        plan = fsdp_plan(s, world)
        if offload:
            def held(p):
                _, row, rows = shard_geometry(s.params[p].shape, world)
                return rows * row
            plan = dataclasses.replace(plan, offload=[
                OffloadFragment(p, st, (0, held(p)), "step", "step") for p in s.trainable for st in ("exp_avg", "exp_avg_sq")
            ])
        model = AutoDist(base, plan=plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            x, y = models.batch("gpt", 2, gen)
            models.loss_fn("gpt", model(x.to(device)), y.to(device)).backward()
            opt.step()
            opt.zero_grad()
        pinned = all(e.h.is_pinned() for e in model.runtime.offload.entries.values()) if offload and device.type == "cuda" else True
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        model.close()
        return sd, pinned

    a, _ = train(False)
    b, pinned = train(True)
    same = all(torch.equal(a[k], b[k]) for k in a)
    out["offload"] = (same and pinned, f"bitwise identical to no offload: {same}; host buffers pinned: {pinned}")


def _budget(device, rank, world, args, out):
    """``plan="auto"`` under budgets of a few times the model's bytes, fp32 and bf16: the
    allocator's peak over steps 3 and 4 against the budget and against the plan's prediction."""
    from autodist.zoo import zoo

    wl = zoo("tiny" if args.quick else "default")["gpt"]
    with tempfile.TemporaryDirectory() as d:  # one cache: the comm model is swept once
        for precision in ("fp32", "bf16"):
            for factor in (14, 10):
                name = f"budget-{precision}-{factor}x"
                trace = os.path.join(args.trace_dir, f"{name}.pickle") if args.trace_dir and rank == 0 else None
                out[name] = _budget_case(device, wl, precision, factor, d, trace)


def _budget_case(device, wl, precision, factor, cache_dir, trace):
    import torch

    from autodist import AutoDist, MixedPrecision
    from autodist.cost.budget import format_bytes
    from autodist.measure.memory import measure_step_peak, storage_bytes

    torch.manual_seed(0)
    model0 = wl.build()
    budget = int(factor * sum(p.numel() * p.element_size() for p in model0.parameters()))
    x, y = (t.to(device) for t in wl.batch(wl.default_batch, torch.Generator().manual_seed(0)))
    mp = MixedPrecision(torch.bfloat16, torch.float32) if precision == "bf16" else None
    _peak_reset(device)
    try:
        model = AutoDist(model0, plan="auto", example_inputs=(x,), memory_limit=budget, cache_dir=cache_dir, mixed_precision=mp)
    except Exception as e:  # an impossible budget is an answer too, when it says so
        return type(e).__name__ == "BudgetError", f"{type(e).__name__}: {str(e)[:200]}"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        wl.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    def live():
        held = [p.detach() for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
        held += [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.device == device]
        return held + list(model.runtime.held_tensors()) + [x, y]

    for _ in range(2):
        step()
    outside, numbers = "", {}
    if device.type == "cuda":
        # what the allocator holds beyond the model's parameters, gradients and optimizer state
        # and the runtime's buffers between steps (cuBLAS workspaces, collective buffers,
        # offloaded state not yet released), and what rounding to blocks adds at the peak
        torch.cuda.synchronize(device)
        held = storage_bytes(t for t in live() if t.device == device)
        between = torch.cuda.memory_allocated(device)
        _peak_reset(device)
        if trace:
            torch.cuda.memory._record_memory_history(max_entries=100000)
        step()
        step()
        torch.cuda.synchronize(device)
        peak, what = torch.cuda.max_memory_allocated(device), "caching allocator"
        requested = torch.cuda.memory_stats(device).get("requested_bytes.all.peak", peak)
        if trace:
            torch.cuda.memory._dump_snapshot(trace)
            torch.cuda.memory._record_memory_history(enabled=None)
        numbers = {"between_steps_allocated": between, "between_steps_tensors": held, "peak_requested": requested,
                   "offload_device_bytes_between_steps": model.runtime.offload.account.device_bytes}
        outside = (f"; between steps the allocator holds {format_bytes(between - held)} beyond the model's tensors; "
                   f"rounding adds {format_bytes(peak - requested)} at the peak")
    else:
        peak, what = max(measure_step_peak(step, device, live) for _ in range(2)), "tensor peak"
    predicted = model.plan.predicted.get("peak_bytes", 0)
    label, offloaded = model.plan.label, len(model.plan.offload)
    numbers.update(budget=budget, peak=peak, predicted=predicted, predicted_all=dict(model.plan.predicted))
    model.close()
    err = (predicted - peak) / max(peak, 1)
    return (
        peak <= budget and abs(err) <= 0.05,
        f"{label}: measured peak {format_bytes(peak)} ({what}) vs budget {format_bytes(budget)}; predicted "
        f"{format_bytes(predicted)} ({err:+.1%}; target within 5%); {offloaded} offload fragments{outside}",
        numbers,
    )


def _allocator(device, rank, world, args, out):
    """What the caching allocator holds that no tensor names: the cuBLAS workspace of a stream
    (allocated by its first matrix product, fp32 and bf16)."""
    import torch

    from autodist.cost.budget import format_bytes

    if device.type != "cuda":
        out["cublas-workspace"] = ("info", "no cuBLAS on the CPU")
        return
    got = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.cuda.synchronize(device)
        torch._C._cuda_clearCublasWorkspaces()
        before = torch.cuda.memory_allocated(device)
        a = torch.ones(64, 64, device=device, dtype=dtype)
        (a @ a).sum().item()
        got[str(dtype)] = torch.cuda.memory_allocated(device) - before - 2 * 64 * 64 * a.element_size() - 512
        del a
    out["cublas-workspace"] = ("info", "per stream, measured as the allocator's growth over a first matrix product: "
                               + ", ".join(f"{k} {format_bytes(v)}" for k, v in got.items()), got)


CHECKS = {"parity": _parity, "offload": _offload, "allocator": _allocator, "budget": _budget}


class _Report(dict):
    """The results of the checks, each printed (rank 0) as soon as it is known."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def __setitem__(self, name, value) -> None:
        value = list(value)
        super().__setitem__(name, value)
        if self.rank == 0:
            print(f"gpu_check: {_mark(value[0])} {name}: {value[1]}", flush=True)


def _mark(ok) -> str:
    return {None: "[not verified]", "info": "[info]", True: "[verified]", False: "[FAILED]"}.get(ok, "[?]")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        name = torch.cuda.get_device_name(device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        name = "cpu (dry run)"
    results, seconds = _Report(rank), {}
    for check in args.checks:
        if args.deadline and time.time() > args.deadline:
            results[check] = (None, "not run: out of time (--minutes)")
            continue
        t0 = time.perf_counter()
        try:
            CHECKS[check](device, rank, world, args, results)
        except Exception:
            results[check] = (False, "raised:\n" + traceback.format_exc(limit=6))
        seconds[check] = round(time.perf_counter() - t0, 1)
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump({"world": world, "device": name, "torch": torch.__version__, "results": dict(results),
                           "seconds": seconds}, f)
    dist.destroy_process_group()


def _stderr_digest(err: str | bytes | None) -> str:
    """What a failed run's stderr says: the lines that name an error (a rank's traceback or abort
    comes early, and torchrun's own report fills the end), then the end."""
    text = err.decode(errors="replace") if isinstance(err, bytes) else (err or "")
    lines = text.splitlines()
    keys = ("Error", "error:", "Traceback", "terminate", "Abort", "abort", "what():", "Exception")
    named = [line for line in lines if any(k in line for k in keys)][:40]
    return "\n".join(named) + "\n...\n" + text[-1500:]


def _bench(args: argparse.Namespace, nproc: int, d: str) -> tuple[dict, list[str]]:
    """tools/bench.py at one GPU's scale (tiny on a dry run), fp32 and bf16; then, with fp32 among
    them, the many-small-layer GPT's wrappers step by step in turn (``--interleave``, [Note: paired
    steps] in bench.py): each wrapper's per-step host cost against torch's on the workload where
    it is step time, as a median difference of neighbouring steps."""
    out, lines = {}, []
    size = "tiny" if args.device == "cpu" else "gpu"
    runs = [(precision, precision, ["--models", "gpt,gpt-deep",
                                    "--contenders", "compute,ddp,autodist:ddp,fsdp2,autodist:fsdp,autodist:auto",
                                    "--steps", "3" if args.quick else "8", "--passes", "1" if args.quick else "2"])
            for precision in args.precisions]
    if "none" in args.precisions:
        runs.append(("paired", "none", ["--models", "gpt-deep", "--interleave",
                                        "--contenders", "compute,ddp,autodist:ddp,fsdp2,autodist:fsdp",
                                        "--steps", "2" if args.quick else "8", "--passes", "2"]))
    for key, precision, chosen in runs:
        path = os.path.join(d, f"bench-{key}.json")
        cmd = [sys.executable, os.path.join(HERE, "bench.py"), "--device", args.device, "--size", size,
               "--mixed-precision", precision, "--nproc", str(nproc), "--warmup", "2", *chosen, "--json", path]
        left = args.deadline - time.time() if args.deadline else None
        if left is not None and left < 30:
            out[key] = {"error": "not run: out of time (--minutes)"}
            continue
        try:
            rc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired as e:
            out[key] = {"error": f"stopped after {left:.0f} s: out of time (--minutes)",
                        "stderr": _stderr_digest(e.stderr)}
            lines.append((e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or "").strip())
            continue
        lines.append(rc.stdout.strip())
        print(rc.stdout.strip(), flush=True)
        if rc.returncode != 0 or not os.path.exists(path):
            out[key] = {"error": f"exit code {rc.returncode}", "stderr": _stderr_digest(rc.stderr)}
            continue
        with open(path) as f:
            out[key] = json.load(f)
    return out, lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (an unknown check exits with status 2)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: the number of GPUs, at most 2)")
    ap.add_argument("--checks", default=",".join(CHECKS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--bench-precisions", default="none,bf16", help="the benchmark's runs (default: %(default)s)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of this script on gloo")
    ap.add_argument("--quick", action="store_true", help="fewer cases and steps, small models")
    ap.add_argument("--json", default=None, help="write everything measured here")
    ap.add_argument("--minutes", type=float, default=None,
                    help="stop starting work after this long; what did not run is reported as not run")
    ap.add_argument("--trace-dir", default=None,
                    help="CUDA: dump the allocator's history of each budget case's measured steps here (pickles)")
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.checks = [c for c in args.checks.split(",") if c]
    args.precisions = [c for c in args.bench_precisions.split(",") if c]
    if set(args.precisions) - {"none", "bf16"}:
        ap.error("--bench-precisions takes none and bf16")
    if args.minutes is not None and args.deadline is None:
        args.deadline = time.time() + 60 * args.minutes
    unknown = [c for c in args.checks if c not in CHECKS]
    if unknown:
        ap.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import torch

    t0 = time.perf_counter()
    not_verified = []
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here — nothing verified (--device cpu runs this script on the CPU)")
            return 2
        gpus = torch.cuda.device_count()
        nproc = args.nproc or min(2, gpus)
        if nproc > gpus:
            print(f"gpu_check: {nproc} ranks need {nproc} GPUs (NCCL runs one rank per device); this machine has {gpus}")
            return 2
    else:
        nproc = args.nproc or 2
        not_verified.append("every CUDA path: this was a dry run on the CPU (gloo)")
    if nproc == 1:
        not_verified.append("collectives across ranks and NCCL's issue order across AutoDist's two communicators "
                            "(a world of one issues no collective that crosses ranks; needs 2 GPUs)")
    payload = {}
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "gpu_check.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               os.path.abspath(__file__), "--worker", "--out", out, "--checks", ",".join(args.checks), "--device", args.device]
        if args.quick:
            cmd.append("--quick")
        if args.deadline:
            cmd += ["--deadline", str(args.deadline)]
        if args.trace_dir:
            os.makedirs(args.trace_dir, exist_ok=True)
            cmd += ["--trace-dir", os.path.abspath(args.trace_dir)]
        left = args.deadline - time.time() + 60 if args.deadline else None
        try:
            rc = subprocess.run(cmd, timeout=left).returncode
        except subprocess.TimeoutExpired:
            rc = "stopped: out of time"
        if rc != 0 or not os.path.exists(out):
            print(f"gpu_check: the ranks failed (exit code {rc})")
            if os.path.exists(out) and args.json:  # what the ranks finished
                with open(out) as f, open(args.json, "w") as g:
                    g.write(f.read())
            return 1
        with open(out) as f:
            payload = json.load(f)
        if not args.skip_bench:
            payload["bench"], tables = _bench(args, nproc, d)
    print(f"gpu_check on {payload['world']} x {payload['device']} (torch {payload['torch']}):")
    failed = 0
    for name, (ok, detail, *_) in payload["results"].items():
        print(f"  {_mark(ok)} {name}: {detail}")
        failed += ok is False
    if not args.skip_bench:
        for precision, result in payload["bench"].items():
            ok = "error" not in result
            what = {"bf16": "bf16", "paired": "fp32, gpt-deep's steps in turn"}.get(precision, "fp32")
            print(f"  [{'ran' if ok else 'FAILED'}] bench ({what})"
                  + ("" if ok else f": {result['error']}\n{result.get('stderr', '')}"))
            failed += not ok
        for t in tables:
            print(t)
    for what in not_verified:
        print(f"  [not verified] {what}")
    payload["wall_seconds"] = round(time.perf_counter() - t0, 1)
    payload["not_verified"] = not_verified
    payload["command"] = "python tools/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"gpu_check: {payload['wall_seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
