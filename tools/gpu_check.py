"""Verify the CUDA paths on a machine with a GPU; prints what it verified and what it could not.

    python tools/gpu_check.py                 # every check, on as many GPUs as there are (at most 2)
    python tools/gpu_check.py --nproc 1       # one rank
    python tools/gpu_check.py --skip-bench

The test suite runs on CPU with gloo, so these paths are written the FSDP2 way but exercised only
here: NCCL collectives and their issue order across the two communicators (one rank per GPU; NCCL
refuses two ranks on one device, so with one GPU only a world of one runs, where AutoDist issues no
collective), device placement of every managed tensor, gathers and reductions on CUDA tensors,
activation recomputation and gradient accumulation on the GPU, offload copies on a copy stream
into pinned memory ordered by events, the caching allocator's memory counters against a budget,
and a short benchmark against DDP and FSDP2.

Checks:

* ``parity`` — every built-in plan, a persistent plan, recomputation, accumulation with bf16 and
  fp32 reduction, against a single-process reference on the same GPU (3 optimizer steps);
* ``offload`` — all optimizer state offloaded (pinned memory, copy stream, events) trains bitwise
  like no offload;
* ``budget`` — ``plan="auto"`` under a budget: the caching allocator's peak stays within it and is
  compared with the plan's prediction;
* ``bench`` — ``tools/bench.py --models gpt`` (a few steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _parity(device, rank, world):
    import torch

    import models
    from autodist import AutoDist, MixedPrecision
    from parity import make_plan

    out = {}
    cases = {
        "ddp": ("gpt", "ddp", {}, 1),
        "fsdp": ("gpt", "fsdp", {}, 1),
        "zero2": ("gpt", "zero2", {}, 1),
        "persistent": ("gpt", {"residency": "persistent", "grouping": "block"}, {}, 1),
        "recompute-all-blocks": ("gpt", {"grouping": "block", "recompute": "all"}, {}, 1),
        "user-checkpointing-reentrant": ("gpt-ckpt-reentrant", "fsdp", {}, 1),
        "accumulate-3-sharded": ("gpt", {"grouping": "block", "accumulate": "sharded"}, {}, 3),
        "bf16-fp32-reduce": ("gpt", "fsdp", {"mixed_precision": MixedPrecision(torch.bfloat16, torch.float32)}, 2),
    }
    for name, (model_name, plan, extra, micro) in cases.items():
        ref, base = models.make(model_name).to(device), models.make(model_name)
        if isinstance(plan, dict):
            plan = make_plan(base, world, **plan)
        model = AutoDist(base, plan=plan, **extra)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            for m in range(micro):
                x, y = models.batch(model_name, 2 * world, gen)
                x, y = x.to(device), y.to(device)
                mine = slice(rank * 2, (rank + 1) * 2)
                ctx = model.no_sync() if m < micro - 1 else torch.enable_grad()
                with ctx:
                    models.loss_fn(model_name, model(x[mine]).float(), y[mine]).div(micro).backward()
                models.loss_fn(model_name, ref(x).float(), y).div(micro).backward()
            for o in (opt, ropt):
                o.step()
                o.zero_grad()
        sd = model.state_dict()
        diff = max((sd[k].float() - v.float()).abs().max().item() for k, v in ref.state_dict().items())
        on_device = all(mp.local.device == device for mp in model.runtime.params.values())
        tol = 3e-2 if "bf16" in name else 1e-4
        out[name] = (diff <= tol and on_device, f"max parameter difference {diff:.2e} (tolerance {tol:g}); tensors on {device}: {on_device}")
        model.close()
    return out


def _offload(device, rank, world):
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
        pinned = all(e.h.is_pinned() for e in model.runtime.offload.entries.values()) if offload else True
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        model.close()
        return sd, pinned

    a, _ = train(False)
    b, pinned = train(True)
    same = all(torch.equal(a[k], b[k]) for k in a)
    return {"offload": (same and pinned, f"bitwise identical to no offload: {same}; host buffers pinned: {pinned}")}


def _budget(device, rank, world):
    import tempfile

    import torch

    from autodist import AutoDist
    from autodist.cost.budget import format_bytes
    from autodist.zoo import zoo

    wl = zoo("default")["gpt"]
    torch.manual_seed(0)
    model0 = wl.build()
    full = sum(p.numel() * p.element_size() for p in model0.parameters())
    budget = int(8 * full)  # forces sharding or recomputation at the default batch on most GPUs' scale
    x, y = wl.batch(wl.default_batch, torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as d:
        model = AutoDist(model0, plan="auto", example_inputs=(x.to(device),), memory_limit=budget, cache_dir=d)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for i in range(4):
            if i == 2:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            wl.loss(model(x.to(device)), y.to(device)).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        predicted = model.plan.predicted.get("peak_bytes", 0)
        model.close()
    ok = peak <= budget
    return {"budget": (ok, f"measured peak {format_bytes(peak)} (caching allocator) vs budget {format_bytes(budget)}; "
                           f"predicted {format_bytes(predicted)} ({(predicted - peak) / max(peak, 1):+.1%})")}


CHECKS = {"parity": _parity, "offload": _offload, "budget": _budget}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    results = {}
    for name in args.checks:
        try:
            results.update({k: list(v) for k, v in CHECKS[name](device, rank, world).items()})
        except Exception:
            results[name] = [False, "raised:\n" + traceback.format_exc(limit=6)]
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world": world, "device": torch.cuda.get_device_name(device), "results": results}, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: the number of GPUs, at most 2)")
    ap.add_argument("--checks", default=",".join(CHECKS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.checks = [c for c in args.checks.split(",") if c]
    if args.worker:
        worker(args)
        return 0
    import torch

    not_verified = []
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here — nothing verified. Run this on a machine with a GPU.")
        return 2
    gpus = torch.cuda.device_count()
    nproc = args.nproc or min(2, gpus)
    if nproc > gpus:
        print(f"gpu_check: {nproc} ranks need {nproc} GPUs (NCCL runs one rank per device); this machine has {gpus}")
        return 2
    if nproc == 1:
        not_verified.append("NCCL collectives and their issue order (a world of one issues none; needs 2 GPUs)")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "gpu_check.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               os.path.abspath(__file__), "--worker", "--out", out, "--checks", ",".join(args.checks)]
        rc = subprocess.run(cmd).returncode
        if rc != 0 or not os.path.exists(out):
            print(f"gpu_check: the ranks failed (exit code {rc})")
            return 1
        with open(out) as f:
            payload = json.load(f)
    print(f"gpu_check on {payload['world']} x {payload['device']}:")
    failed = 0
    for name, (ok, detail) in payload["results"].items():
        print(f"  [{'verified' if ok else 'FAILED'}] {name}: {detail}")
        failed += not ok
    if not args.skip_bench:
        rc = subprocess.run([sys.executable, os.path.join(HERE, "bench.py"), "--models", "gpt", "--steps", "3",
                             "--warmup", "2", "--passes", "1", "--nproc", str(nproc)]).returncode
        print(f"  [{'verified' if rc == 0 else 'FAILED'}] bench: tools/bench.py --models gpt ran (exit code {rc})")
        failed += rc != 0
    for what in not_verified:
        print(f"  [not verified] {what}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
