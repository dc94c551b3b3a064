"""Peak tensor memory while a model is built and wrapped: on the meta device vs on the CPU.

    python tools/wrappeak.py                          # gpt and wide-mlp, plans fsdp and ddp, 2 ranks
    python tools/wrappeak.py --models gpt --plans fsdp --nproc 4 --json out.json

Each rank builds the model (after ``torch.manual_seed(0)``) and wraps it, once on the CPU and once
under ``with torch.device("meta"):``, inside the torch profiler's memory tracking (tensors this
thread allocates; see ``autodist.measure.memory.trace_cpu_memory``). Reported per rank (the maximum over
ranks): the peak above what was live before building, what the rank still holds once wrapping
returns (its shards or replicas and gradient buffers), the model's full size and its largest unit.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _launch import max_over_ranks, run_tool  # noqa: E402

from autodist import AutoDist  # noqa: E402
from autodist.cost.budget import format_bytes  # noqa: E402
from autodist.measure.memory import trace_cpu_memory  # noqa: E402
from autodist.structure import discover  # noqa: E402
from autodist.zoo import zoo  # noqa: E402


def measure(build, plan: str, on_meta: bool) -> tuple[int, int]:
    """(peak, held after wrapping) in bytes, above what was live before building."""
    held = {}

    def build_and_wrap() -> None:
        torch.manual_seed(0)
        if on_meta:
            with torch.device("meta"):
                model = build()
        else:
            model = build()
        held["model"] = AutoDist(model, plan=plan)

    gc.collect()
    mem, _ = trace_cpu_memory(build_and_wrap)
    held.pop("model").close()
    gc.collect()
    return max(m for _, m in mem), mem[-1][1]


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = []
    for name in args.models:
        wl = zoo(args.size)[name]
        with torch.device("meta"):
            structure = discover(wl.build())
        full = structure.total_bytes()
        unit = max(sum(structure.params[p].nbytes for p in u.params) for u in structure.units)
        for plan in args.plans:
            row = {"model": name, "plan": plan, "full_bytes": full, "largest_unit_bytes": unit}
            for source in ("meta", "cpu"):
                peak, kept = measure(wl.build, plan, source == "meta")
                row[f"{source}_peak_bytes"] = int(max_over_ranks(peak))
                row[f"{source}_kept_bytes"] = int(max_over_ranks(kept))
            rows.append(row)
    if dist.get_rank() == 0:
        import json

        with open(args.out, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


def table(payload: dict) -> str:
    lines = [
        f"{payload['world_size']} ranks; peak and kept: tensor bytes per rank (max over ranks) while building and wrapping",
        f"{'model':<10}{'plan':<6}{'full model':>12}{'largest unit':>14}{'kept':>12}{'peak (meta)':>13}{'peak (cpu)':>12}",
    ]
    for r in payload["rows"]:
        lines.append(
            f"{r['model']:<10}{r['plan']:<6}{format_bytes(r['full_bytes']):>12}{format_bytes(r['largest_unit_bytes']):>14}"
            f"{format_bytes(r['meta_kept_bytes']):>12}{format_bytes(r['meta_peak_bytes']):>13}{format_bytes(r['cpu_peak_bytes']):>12}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (unknown models or plans exit with status 2)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt,wide-mlp", help="comma-separated zoo models (default: %(default)s)")
    ap.add_argument("--plans", default="fsdp,ddp", help="comma-separated built-in plans (default: %(default)s)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (default: 2)")
    ap.add_argument("--size", default="default", choices=["default", "tiny"])
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.plans = [p for p in args.plans.split(",") if p]
    from autodist.builtins import BUILTIN_PLANS

    unknown = [m for m in args.models if m not in zoo()] + [p for p in args.plans if p not in BUILTIN_PLANS]
    if unknown:
        ap.error(f"unknown model or plan: {', '.join(unknown)} (models: {', '.join(zoo())}; plans: {', '.join(BUILTIN_PLANS)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    worker_args = ["--models", ",".join(args.models), "--plans", ",".join(args.plans), "--size", args.size]
    return run_tool(__file__, args.nproc, worker_args, table, args.json)


if __name__ == "__main__":
    sys.exit(main())
