"""What the ``autodist`` command prints (``autodist/cli.py``), as text: aligned tables and fields, a
plan, a cache entry, ``autodist check``'s report and the environment."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .plan import Plan

OPTIONAL_PACKAGES = ("torchvision", "matplotlib", "torch_geometric")
TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID",
)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, indent: str = "  ") -> str:
    """Rows as aligned plain-text columns under a ruled header; numeric columns are right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    right = [bool(rows) and all(isinstance(r[i], (int, float)) for r in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)]
        return (indent + "  ".join(parts)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def format_fields(pairs: Sequence[tuple[str, Any]], *, indent: str = "  ") -> str:
    """``key  value`` lines with the values aligned."""
    width = max((len(k) for k, _ in pairs), default=0)
    return "\n".join(f"{indent}{k.ljust(width)}  {v}" for k, v in pairs)


def render_plan(plan: Plan, path: str) -> str:
    """A plan as a header and tables (what ``autodist show`` prints)."""
    from .cost.budget import format_bytes
    from .describe import describe_prediction

    pred = plan.predicted
    header: list[tuple[str, Any]] = [
        ("world size", plan.world_size),
        ("device", plan.device),
        ("budget", "-" if plan.budget_bytes is None else f"{format_bytes(plan.budget_bytes)} per rank"),
        ("schema version", plan.schema_version),
        ("micro-batches per step", plan.grad_accum_steps),
        ("fingerprint", plan.fingerprint or "-"),
        ("source", plan.provenance.get("source", "-")),
    ]
    if plan.shard_size is not None:
        header.insert(1, ("shard groups", f"{plan.world_size // plan.shard_ranks} of {plan.shard_ranks} ranks"
                          + (" (sharded within each, replicated across)" if plan.hybrid else "")))
    if pred:
        header.append(("prediction", describe_prediction(plan)))
    out = [f"plan {path}", format_fields(header)]

    vs = pred.get("vs") or {}
    if vs:
        speedups = [(name, f"{ratio:.2f}x") for name, ratio in sorted(vs.items())]
        out += ["", "predicted speed-up over the seeds", format_table(("seed", "speed-up"), speedups)]

    out += ["", f"units ({len(plan.units)})"]
    out.append(
        format_table(
            ("unit", "placement", "residency", "accumulate", "params"),
            [
                (u.name, u.placement, u.residency if u.placement == "shard" else "-",
                 (u.accumulate if u.placement == "shard" else "local") if plan.grad_accum_steps > 1 else "-", len(u.params))
                for u in plan.units
            ],
        )
    )

    out += ["", f"gather groups ({len(plan.gather_groups)})"]
    if plan.gather_groups:
        groups = [
            (i, _span(g.units), g.prefetch.forward, g.prefetch.backward) for i, g in enumerate(plan.gather_groups)
        ]
        out.append(format_table(("group", "units", "fwd prefetch", "bwd prefetch"), groups))
    else:
        out.append("  none")

    out += ["", f"buckets ({len(plan.buckets)})"]
    if plan.buckets:
        buckets = [
            (i, b.op, len(b.params), "?" if b.nbytes is None else format_bytes(b.nbytes))
            for i, b in enumerate(plan.buckets)
        ]
        out.append(format_table(("bucket", "op", "params", "size"), buckets))
    else:
        out.append("  none")
    if plan.rebuild_buckets is not None:
        rb = plan.rebuild_buckets
        out.append(
            f"  rebuilt once from the observed gradient-ready order: {format_bytes(rb.cap_bytes)} buckets, "
            f"first {format_bytes(rb.first_cap_bytes)}"
        )
    out.append(f"  max_inflight_buckets: {_inflight(plan.max_inflight_buckets)}")

    out += ["", f"recomputed blocks ({len(plan.recompute)})"]
    out.append("  " + ", ".join(plan.recompute) if plan.recompute else "  none (activations are kept from forward to backward)")

    out += ["", f"offload fragments ({len(plan.offload)})"]
    if plan.offload:
        fragments = [(o.param, o.state, f"[{o.fragment[0]}, {o.fragment[1]})", o.out_after, o.back_from) for o in plan.offload]
        out.append(format_table(("param", "state", "fragment", "out_after", "back_from"), fragments))
    else:
        out.append("  none")
    return "\n".join(out)


def _inflight(limit: int | None) -> str:
    """``max_inflight_buckets`` and what it does to the reductions."""
    if limit is None:
        return "no limit (reductions overlap the rest of backward; all are waited for at its end)"
    if limit == 0:
        return "0 (each reduction is waited for right after its launch: no overlap with backward, least memory)"
    return (
        f"{limit} (at most {limit} reduction{'s' if limit > 1 else ''} in flight: launching another first waits "
        "for the oldest)"
    )


def _span(units: Sequence[str]) -> str:
    if len(units) == 1:
        return f"{units[0]} (1)"
    return f"{units[0]}..{units[-1]} ({len(units)})"


def _summary_value(value: Any) -> str:
    """One line for a field of a cache entry: a number or string as it is, a list or an object by its
    size (and, when short, its contents)."""
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict):
        inline = json.dumps(value, sort_keys=True)
        return inline if len(inline) <= 80 else f"{{{len(value)} fields: {', '.join(list(value)[:6])}{', ...' if len(value) > 6 else ''}}}"
    if isinstance(value, list):
        inline = json.dumps(value)
        return inline if len(inline) <= 80 else f"[{len(value)} items]"
    return str(value)


def render_cache_entry(kind: str, key: str, path: Path, data: Any) -> str:
    """``autodist cache show``'s summary: a plan as ``autodist show`` prints it, another entry one
    line per field."""
    if kind == "plans":
        from .errors import PlanError
        from .plan import Plan

        try:
            return render_plan(Plan.from_json(json.dumps(data), source=str(path)), str(path))
        except PlanError:
            pass  # a plan of another schema: field by field, like any entry
    head = f"{kind}/{key} ({path})"
    if not isinstance(data, dict):
        return f"{head}\n  {_summary_value(data)}"
    return f"{head}\n{format_fields([(k, _summary_value(v)) for k, v in sorted(data.items())])}\n(--json prints the raw record)"


def render_check(payload: dict[str, Any]) -> str:
    """``autodist check``'s report: one row per plan, the fidelity figures, and what they change."""
    accum = f", {payload['accum']} micro-batches per step" if payload.get("accum", 1) > 1 else ""
    out = [
        f"autodist check: {payload['model']} on {payload['world_size']} ranks ({payload['device']}, {payload['backend']}), "
        f"input {','.join(map(str, payload['input_shape']))}{accum}; {payload['steps']} timed steps x {payload['passes']} passes per plan",
        *([f"comm model: {payload['comm_model']['what']}"] if payload.get("comm_model") else []),
        "",
    ]
    rows = []
    for r in payload["plans"]:
        et = (r["predicted_step_s"] - r["measured_step_s"]) / r["measured_step_s"]
        ep = (r["predicted_peak_bytes"] - r["measured_peak_bytes"]) / max(1, r["measured_peak_bytes"])
        rows.append((r["plan"], f"{r['predicted_step_s'] * 1e3:.1f}", f"{r['measured_step_s'] * 1e3:.1f}", f"{et:+.0%}",
                     f"{r['predicted_peak_bytes'] / 2**20:.1f}", f"{r['measured_peak_bytes'] / 2**20:.1f}", f"{ep:+.0%}"))
    out.append(format_table(("plan", "pred ms", "meas ms", "error", "pred MiB", "meas MiB", "error"), rows))
    out.append("  (predicted from the profiles taken across all passes; the progress lines predicted from the first one)")
    out.append("")

    def line(what: str, f: dict[str, Any]) -> str:
        sp = f["spearman"]
        rank = "n/a (fewer than 3 plans)" if sp is None or sp != sp else f"{sp:.2f}"
        return (f"  {what} ({f['plans']}): step time Spearman {rank}, median |error| {f['median_abs_pct_error_time']:.1f}%; "
                f"peak median |error| {f['median_abs_pct_error_peak']:.1f}%, at most {max(0.0, f['max_pct_peak_excess']):.1f}% above prediction")

    out.append(line("all plans", payload["all"]))
    for key, what in (("builtin_and_random", "built-in and random"), ("searched", "searched")):
        if payload.get(key):
            out.append(line(what, payload[key]))
    for rep in payload.get("repeated", []):
        out.append(f"  measured twice: {rep['plans'][0]} and {rep['plans'][1]}, {rep['pct_apart']:.1f}% apart (the measurement's noise)")
    cal = payload.get("calibration")
    if cal:
        out.append(
            f"  wait calibration: {cal['wait_scale']:.2f} fits these plans (median |error| "
            f"{cal['median_abs_pct_error_time']:.1f}%, against {cal['at_sweep_scale']:.1f}% at the sweep's "
            f"{cal['sweep_wait_scale']:.2f}; of the scales within a point of the best, the nearest the sweep's; "
            f"the blocked-wait time held at the sweep's {1000 * cal.get('blocked_wait_s', 0.0):.2f} ms); "
            "the search here simulates with it"
        )
    m = payload["margins"]
    out.append("")
    if payload.get("refused"):
        out.append(
            f"Not stored: {payload['refused']}. plan=\"auto\" on {payload['world_size']} ranks here plans as before "
            "(with the record an earlier check stored, if any; `autodist cache clear --kind fidelity` removes it)."
        )
        return "\n".join(out)
    where = (f"Stored for this machine in {payload['record_path']}: plan=\"auto\" on {payload['world_size']} ranks here now"
             if payload.get("record_path") else f"Not stored (--no-record); stored, it would make plan=\"auto\" on {payload['world_size']} ranks here")
    out.append(
        f"{where} keeps a built-in plan unless a searched one is predicted {m['prefer_seed_within']:.1%} faster (default "
        f"{m['default_prefer_seed_within']:.0%}; never less than {m['min_prefer_seed_within']:.0%}), and plans {m['memory_headroom']:.1%} below the memory budget (default "
        f"{m['default_memory_headroom']:.0%}; never less)."
    )
    if payload.get("record_path"):
        out.append("To undo: `autodist cache clear --kind fidelity` (plan=\"auto\" then uses the default margins).")
    return "\n".join(out)


def _version_of(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_report() -> str:
    import torch

    from . import __version__
    from .cost.budget import default_budget, format_bytes
    from .planner.cache import Cache
    from .runtime.comm import default_device

    versions = [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", torch.__version__),
        ("autodist", __version__),
        ("numpy", _version_of("numpy")),
        ("psutil", _version_of("psutil")),
    ] + [(name, _version_of(name)) for name in OPTIONAL_PACKAGES]

    device = default_device()
    if device.type == "cpu":
        backend = "gloo"
    else:
        import torch.distributed as dist

        backend = dist.get_default_backend_for_device(device)
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") and torch.accelerator.is_available() else None
    if acc is not None:
        accel = f"{acc.type} x {torch.accelerator.device_count()}"
        if acc.type == "cuda":
            accel += f" ({torch.cuda.get_device_name(device)})"
    else:
        accel = "none"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cache = Cache()
    torchrun = [f"{k}={os.environ[k]}" for k in TORCHRUN_VARS if k in os.environ]
    machine = [
        ("device", str(device)),
        ("backend", backend),
        ("accelerator", accel),
        ("cpu count", f"{os.cpu_count()} ({usable} usable by this process)"),
        ("default budget", _default_budgets(device, default_budget, format_bytes)),
        ("cache", f"{cache.dir} ({len(cache.entries())} entries)"),
        ("torchrun", " ".join(torchrun) if torchrun else "not set (not launched by torchrun)"),
    ]
    return "\n".join(["versions", format_fields(versions), "", "machine", format_fields(machine)])


def _default_budgets(device: torch.device, default_budget: Callable[..., int], format_bytes: Callable[[float], str]) -> str:
    """The budget each rank gets without ``memory_limit``: per GPU on CUDA; on the CPU, the host's
    available memory shared by the ranks launched on it (torchrun's ``--nproc_per_node``)."""
    if device.type != "cpu":
        return f"{format_bytes(default_budget(device))} per rank on {device}"
    launched = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    counts = [launched] if launched else [1, 2, 4]
    shares = [
        f"{format_bytes(default_budget(device, local_ranks=n))} {'each for' if n > 1 else 'for'} {n} rank{'s' if n > 1 else ''}"
        for n in counts
    ]
    return f"{', '.join(shares)} on this host (available host memory shared by the local ranks, minus a margin)"
