"""The ``autodist`` command: read plans, plan offline, draw a plan's simulated step, manage the cache,
report the environment.

    autodist show PLAN.json
    autodist plan --model MODULE:FACTORY --input-shape 8,128 --world-size N --out PLAN.json
                  [--input-dtype DTYPE] [--input-high N] [--memory-limit 2GiB]
                  [--interconnect NAME | --bandwidth GBPS --latency US] [--cache-dir DIR] [--reprofile]
    autodist timeline PLAN.json -o OUT.json|OUT.png --model MODULE:FACTORY --input-shape 8,128
                  [--input-dtype DTYPE] [--input-high N] [--interconnect NAME | --bandwidth GBPS --latency US]
                  [--cache-dir DIR] [--reprofile] [--width PX] [--height PX]
    autodist check --model MODULE:FACTORY --input-shape 8,128 [--input-dtype DTYPE] [--input-high N]
                  [--nproc N] [--plans N] [--steps N] [--accum N] [--json OUT.json] [--no-record] [--cache-dir DIR]
    autodist cache list|show KEY|clear [--kind KIND]|path [--cache-dir DIR]
    autodist env
    autodist --version

A wrong argument exits with status 2 and one line on stderr (``autodist <command>: <reason>``); so do
failures the user can fix (a missing or corrupt plan file, a model that cannot be imported, no comm
model for this machine, no plan within the budget). Output goes to stdout through :func:`_say`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .errors import PlanError
    from .plan import Plan

INPUT_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32")
DEFAULT_INPUT_HIGH = 1000
PNG_SIZE = (1400, 700)  # pixels: a step's streams and memory curve stay readable on one screen
TIMELINE_SUFFIXES = (".json", ".png")
TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID",
)
OPTIONAL_PACKAGES = ("torchvision", "matplotlib", "torch_geometric")


class CommandError(Exception):
    """A failure the user can fix; ``main`` prints it as one line and exits with status 2."""


class _Parser(argparse.ArgumentParser):
    """Reports a bad argument as one line, ``<prog>: <reason>``, and exits with status 2."""

    def error(self, message: str) -> NoReturn:
        _complain(self.prog, message)
        raise SystemExit(2)


# ------------------------------------------------------------------------------------------------
# Output: the only places the command writes.
# ------------------------------------------------------------------------------------------------


def _say(text: str = "") -> None:
    print(text, file=sys.stdout)


def _complain(prog: str, message: str) -> None:
    print(f"{prog}: {' '.join(str(message).split())}", file=sys.stderr)


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


# ------------------------------------------------------------------------------------------------
# Argument types: each rejects a bad value with a message that says what was expected.
# ------------------------------------------------------------------------------------------------


def _number(kind: type, what: str, ok: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses ``kind`` and accepts it when ``ok`` says so."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _number(int, "a positive integer", lambda v: v >= 1)
_positive_float = _number(float, "a positive number", lambda v: 0 < v < float("inf"))
_non_negative_float = _number(float, "a non-negative number", lambda v: 0 <= v < float("inf"))


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 8,128; got {text!r}")
    return dims


def _factory_spec(text: str) -> str:
    module, sep, attr = text.partition(":")
    if not sep or not module or not attr:
        raise argparse.ArgumentTypeError(
            f"expected MODULE:FACTORY (a module and a function in it that returns an nn.Module, such as "
            f"autodist.zoo:gpt); got {text!r}"
        )
    return text


def _memory_limit(text: str) -> str:
    import torch

    from .cost.budget import parse_memory_limit

    try:
        parse_memory_limit(text, torch.device("cpu"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _timeline_output(text: str) -> str:
    if Path(text).suffix.lower() not in TIMELINE_SUFFIXES:
        raise argparse.ArgumentTypeError(
            f"expected a file name ending in .json (a Chrome trace) or .png (a plot); got {text!r}"
        )
    return text


# ------------------------------------------------------------------------------------------------
# The parser.
# ------------------------------------------------------------------------------------------------


def _add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and example input")
    g.add_argument(
        "--model", required=True, type=_factory_spec, metavar="MODULE:FACTORY",
        help="a function that returns the model, e.g. autodist.zoo:gpt (the current directory is importable)",
    )
    g.add_argument(
        "--input-shape", required=True, type=_shape, metavar="D0,D1,...",
        help="shape of one example batch, e.g. 8,128",
    )
    g.add_argument("--input-dtype", choices=INPUT_DTYPES, default="float32", help="dtype of the example batch (default float32)")
    g.add_argument(
        "--input-high", type=_positive_int, metavar="N",
        help=f"integer inputs are drawn from [0, N), e.g. token ids below the vocabulary size (default {DEFAULT_INPUT_HIGH})",
    )
    g.add_argument(
        "--input-as", action="append", default=[], metavar="NAME", type=_keyword,
        help="also pass the example batch as keyword NAME (repeatable): --input-as labels makes a Hugging Face "
        "language model compute its own loss, which is then profiled",
    )


def _add_comm_options(p: argparse.ArgumentParser) -> None:
    from .cost.interconnect import INTERCONNECTS

    g = p.add_argument_group(
        "comm model",
        "an analytic model of a named interconnect (--interconnect) or of your own numbers (--bandwidth and "
        "--latency), or else the one measured and cached on this machine by a job with plan=\"auto\" on as "
        "many ranks",
    )
    presets = "; ".join(f"{i.name}: {i.what}, {i.bandwidth_gbps:g} GB/s, {i.latency_us:g} us" for i in INTERCONNECTS.values())
    g.add_argument(
        "--interconnect", choices=list(INTERCONNECTS), metavar="NAME",
        help=f"the link the ranks' collectives cross (the slowest one: the network when ranks span nodes): {presets}",
    )
    g.add_argument("--bandwidth", type=_positive_float, metavar="GBPS", help="link bandwidth in GB/s, one direction per rank")
    g.add_argument("--latency", type=_non_negative_float, metavar="US", help="per-collective latency in microseconds")
    _add_cache_dir(g)


def _add_reprofile(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--reprofile", action="store_true",
        help="profile the model again rather than use the profile cached for this model, input and machine "
        "(the first run caches it: the same command then plans from the same measurement)",
    )


def _add_cache_dir(p: argparse.ArgumentParser | Any) -> None:
    p.add_argument(
        "--cache-dir", metavar="DIR",
        help="cache directory (default $AUTODIST_CACHE_DIR, else $XDG_CACHE_HOME/autodist, else ~/.cache/autodist)",
    )


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="autodist", description="AutoDist: plans, timelines, cache and environment.")
    parser.add_argument("--version", action="version", version=f"autodist {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    show = sub.add_parser(
        "show", help="print a plan (a file or a cached plan's key) as tables",
        description="Print a plan as tables: a plan file, or the key (or a unique prefix of it) of a plan in the "
        "cache, as `autodist cache list` shows it.",
    )
    show.add_argument("plan", metavar="PLAN", help="a plan file, or a cached plan's key")
    _add_cache_dir(show)

    plan = sub.add_parser(
        "plan", help="profile a model here and search a plan for N ranks",
        description="Profile a model in this process and search the best plan for --world-size ranks under "
        "the memory budget; write it as JSON.",
    )
    _add_model_options(plan)
    plan.add_argument("--world-size", required=True, type=_positive_int, metavar="N", help="ranks the plan is for")
    plan.add_argument(
        "--memory-limit", type=_memory_limit, metavar="SIZE",
        help="budget per rank: bytes, a size such as 2GiB or 512MB, or a percentage such as 80%% "
        "(default: what this machine has available)",
    )
    _add_comm_options(plan)
    _add_reprofile(plan)
    plan.add_argument("--out", required=True, metavar="PLAN.json", help="where to write the plan")

    tl = sub.add_parser(
        "timeline", help="simulate one step of a plan and write it as a Chrome trace or PNG",
        description="Simulate one training step of a plan on a model profiled here, and write the timeline "
        "as a Chrome trace (.json: chrome://tracing, Perfetto) or a plot (.png, needs matplotlib).",
    )
    tl.add_argument("plan", metavar="PLAN.json", help="a plan file")
    tl.add_argument("-o", "--out", required=True, type=_timeline_output, metavar="OUT", help="OUT.json or OUT.png")
    _add_model_options(tl)
    _add_comm_options(tl)
    _add_reprofile(tl)
    tl.add_argument("--width", type=_positive_int, metavar="PX", help=f"PNG width in pixels (default {PNG_SIZE[0]})")
    tl.add_argument("--height", type=_positive_int, metavar="PX", help=f"PNG height in pixels (default {PNG_SIZE[1]})")

    check = sub.add_parser(
        "check", help="measure the simulator's predictions against real steps of your model",
        description="Launch --nproc ranks here (torchrun), profile the model, and run a handful of plans (the "
        "built-in ones, random ones and the ones the search picks under three budgets): predicted vs measured "
        "step time and peak memory, on one screen. The measured error is stored for this machine: plan=\"auto\" "
        "then takes its margins from it (how much faster a searched plan must be predicted than a built-in one, "
        "and how far below the budget plans are kept). It is not stored when the same plan measured twice "
        "disagrees by more than 5%% (a busy host) or the error is above 15%%; `autodist cache clear --kind "
        "fidelity` removes a stored one.",
    )
    _add_model_options(check)
    check.add_argument("--nproc", type=_positive_int, default=2, metavar="N", help="ranks to launch (default 2)")
    check.add_argument("--plans", type=_positive_int, default=6, metavar="N", help="built-in and random plans (default 6; 3 searched plans are added)")
    check.add_argument("--steps", type=_positive_int, default=4, metavar="N", help="timed steps per plan and pass (default 4)")
    check.add_argument("--accum", type=_positive_int, default=1, metavar="N", help="micro-batches (of --input-shape each) per step (default 1)")
    check.add_argument("--json", metavar="OUT.json", help="also write every figure as JSON")
    check.add_argument("--no-record", action="store_true", help="do not store the measured error for this machine")
    _add_cache_dir(check)
    check.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    check.add_argument("--out", help=argparse.SUPPRESS)

    cache = sub.add_parser(
        "cache", help="list, show or clear cached profiles, comm models and plans",
        description="List, show or clear the entries of the on-disk cache.",
    )
    actions = cache.add_subparsers(dest="action", metavar="ACTION", required=True)
    common = _Parser(add_help=False)
    _add_cache_dir(common)
    actions.add_parser("list", parents=[common], help="a table of the entries", description="List the cache entries.")
    show_entry = actions.add_parser(
        "show", parents=[common], help="summarise one entry (--json: the raw record)",
        description="Summarise the entry with this key (or key prefix): a plan as `autodist show` prints it, "
        "another entry field by field; --json prints the raw record.",
    )
    show_entry.add_argument("key", metavar="KEY", help="the entry's key, as `autodist cache list` shows it, or a unique prefix")
    show_entry.add_argument("--json", action="store_true", help="print the raw JSON record")
    clear = actions.add_parser("clear", parents=[common], help="remove entries", description="Remove cache entries.")
    from .cache import KINDS

    clear.add_argument("--kind", choices=KINDS, help="remove only this kind (default: all)")
    actions.add_parser("path", parents=[common], help="print the cache directory", description="Print the cache directory.")

    sub.add_parser(
        "env", help="versions, devices, default budget and cache location",
        description="Print the versions, devices, default backend and budget, cache location and torchrun variables.",
    )
    return parser


# ------------------------------------------------------------------------------------------------
# Shared steps.
# ------------------------------------------------------------------------------------------------


def _load_plan(path: str) -> Plan:
    from .errors import PlanError
    from .plan import load_plan

    if not Path(path).exists():
        raise CommandError(f"{path}: no such file; check the path, or write a plan with `autodist plan`")
    try:
        return load_plan(path)
    except PlanError as e:
        raise CommandError(_plan_error_line(e, path, "it is not a valid plan; `autodist plan` writes one")) from None


def _plan_error_line(e: PlanError, path: str, hint: str) -> str:
    """A :class:`PlanError` as one line: where, the first problem, how many more, and ``hint`` unless
    the problem already ends with its own advice (a full sentence)."""
    first = e.problems[0] if e.problems else str(e).splitlines()[0]
    where = "" if path in first else f"{path}: "
    more = f" (and {len(e.problems) - 1} more problems)" if len(e.problems) > 1 else ""
    advice = "" if first.endswith(".") and not more else f"; {hint}"
    return f"{where}{first}{more}{advice}"


def _build_model(spec: str) -> nn.Module:
    import torch

    module_name, _, attr = spec.partition(":")
    # a console script does not put the working directory on the path; `python -m` does
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise CommandError(f"--model {spec}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?") from None
    except Exception as e:  # the user's module failed while being imported
        raise CommandError(f"--model {spec}: importing {module_name!r} raised {type(e).__name__}: {_first_line(e)}") from None
    factory: Any = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
    if not callable(factory):
        raise CommandError(f"--model {spec}: module {module_name!r} has no function {attr!r}")
    torch.manual_seed(0)
    try:
        model = factory()
    except Exception as e:  # the user's code: report it, do not crash
        raise CommandError(f"--model {spec}: {attr}() raised {type(e).__name__}: {_first_line(e)}") from None
    if not isinstance(model, torch.nn.Module):
        raise CommandError(f"--model {spec}: {attr}() returned {type(model).__name__}, not an nn.Module")
    return model


def _keyword(text: str) -> str:
    if not text.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not a keyword argument name")
    return text


def _input_kwargs(x: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The keyword inputs ``--input-as`` asks for: the example batch under each name."""
    return {name: x for name in args.input_as}


def _example_input(model: nn.Module, args: argparse.Namespace) -> torch.Tensor:
    """One batch of the requested shape and dtype, checked by running a forward pass."""
    import torch

    dtype = getattr(torch, args.input_dtype)
    gen = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        if args.input_high is not None:
            raise CommandError(f"--input-high applies to integer inputs; --input-dtype is {args.input_dtype}")
        x = torch.randn(args.input_shape, generator=gen).to(dtype)
    else:
        high = DEFAULT_INPUT_HIGH if args.input_high is None else args.input_high
        x = torch.randint(0, high, args.input_shape, generator=gen, dtype=dtype)
    try:
        with torch.no_grad():
            model(x, **_input_kwargs(x, args))
    except Exception as e:  # the user's model on the user's input shape
        raise CommandError(
            f"the model's forward failed on an input of shape {','.join(map(str, args.input_shape))} "
            f"({args.input_dtype}){''.join(f' also passed as {n}=' for n in args.input_as)}: {type(e).__name__}: "
            f"{_first_line(e)}; check --input-shape, --input-dtype, --input-high and --input-as"
        ) from None
    return x


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _comm_model(args: argparse.Namespace, world: int) -> tuple[Any, str]:
    """The comm model and a phrase saying where it came from."""
    import torch

    from .cache import Cache, comm_cache_key
    from .cost.comm import CommModel

    if args.interconnect is not None:
        from .cost.interconnect import INTERCONNECTS

        link = INTERCONNECTS[args.interconnect]
        model = CommModel.analytic(world, bandwidth_bytes_s=link.bandwidth_gbps * 1e9, latency_s=link.latency_us * 1e-6)
        return model, f"the {link.name} interconnect ({link.what}: {link.bandwidth_gbps:g} GB/s, {link.latency_us:g} us)"
    if args.bandwidth is not None:
        model = CommModel.analytic(world, bandwidth_bytes_s=args.bandwidth * 1e9, latency_s=args.latency * 1e-6)
        return model, f"an analytic comm model ({args.bandwidth:g} GB/s, {args.latency:g} us)"
    cache = Cache(args.cache_dir, writer=False)
    path = cache.path("comm", comm_cache_key(world, "cpu", "cpu", "gloo"))
    if not path.is_file():
        from .cost.interconnect import INTERCONNECTS

        raise CommandError(
            f"no comm model is cached for {world} CPU ranks (gloo, torch {torch.__version__}) in {cache.dir}; pass "
            f"--interconnect NAME for the link your ranks use ({', '.join(INTERCONNECTS)}; `--help` lists their "
            "numbers), or --bandwidth GBPS --latency US, or run a job with plan=\"auto\" on this machine with "
            f"{world} ranks first (it measures one and caches it)"
        )
    try:
        # with the wait calibration `autodist check` fitted here, as the search simulates with it
        model = _search_config(args.cache_dir, world).calibrated(CommModel.from_json(path.read_text()))
        return model, f"the comm model measured on this machine ({path})"
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CommandError(
            f"the cached comm model {path} cannot be read ({type(e).__name__}: {_first_line(e)}); remove it with "
            "`autodist cache clear --kind comm` or pass --bandwidth and --latency"
        ) from None


def _check_comm_options(args: argparse.Namespace) -> None:
    if args.interconnect is not None and (args.bandwidth is not None or args.latency is not None):
        raise CommandError("--interconnect and --bandwidth/--latency both describe the link; give one or the other")
    if (args.bandwidth is None) != (args.latency is None):
        given, missing = ("--bandwidth", "--latency") if args.latency is None else ("--latency", "--bandwidth")
        raise CommandError(f"{given} needs {missing} too (an analytic comm model takes both)")


def _budget_line(e: Exception) -> str:
    """A :class:`~autodist.errors.BudgetError` without its advice (the command gives its own, in
    its flags' words): everything before ``. To fit:`` — the breakdown itself contains full stops
    (``activations (incl. the loss)``)."""
    return str(e).split(". To fit:", 1)[0].rstrip(".")


# ------------------------------------------------------------------------------------------------
# show
# ------------------------------------------------------------------------------------------------


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
    if pred:
        header.append(("prediction", describe_prediction(plan)))
    out = [f"plan {path}", format_fields(header)]

    vs = pred.get("vs") or {}
    if vs:
        rows = [(name, f"{ratio:.2f}x") for name, ratio in sorted(vs.items())]
        out += ["", "predicted speed-up over the seeds", format_table(("seed", "speed-up"), rows)]

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
        rows = [
            (i, _span(g.units), g.prefetch.forward, g.prefetch.backward) for i, g in enumerate(plan.gather_groups)
        ]
        out.append(format_table(("group", "units", "fwd prefetch", "bwd prefetch"), rows))
    else:
        out.append("  none")

    out += ["", f"buckets ({len(plan.buckets)})"]
    if plan.buckets:
        rows = [
            (i, b.op, len(b.params), "?" if b.nbytes is None else format_bytes(b.nbytes))
            for i, b in enumerate(plan.buckets)
        ]
        out.append(format_table(("bucket", "op", "params", "size"), rows))
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
        rows = [(o.param, o.state, f"[{o.fragment[0]}, {o.fragment[1]})", o.out_after, o.back_from) for o in plan.offload]
        out.append(format_table(("param", "state", "fragment", "out_after", "back_from"), rows))
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


def cmd_show(args: argparse.Namespace) -> int:
    if Path(args.plan).exists():
        _say(render_plan(_load_plan(args.plan), args.plan))
        return 0
    from .cache import Cache

    cache = Cache(args.cache_dir)
    plans = [e for e in cache.entries() if e.kind == "plans"]
    matches = [e for e in plans if e.key == args.plan] or [e for e in plans if e.key.startswith(args.plan)]
    if not matches:
        raise CommandError(
            f"{args.plan}: no such file, nor a cached plan's key in {cache.dir}; check the path, or "
            "`autodist cache list` shows the keys"
        )
    if len(matches) > 1:
        raise CommandError(f"{args.plan!r} is the start of {len(matches)} cached plans' keys; give more of the key")
    path = str(matches[0].path)
    _say(render_plan(_load_plan(path), path))
    return 0


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


# ------------------------------------------------------------------------------------------------
# plan
# ------------------------------------------------------------------------------------------------


def _rank_threads() -> None:
    """Profile as a rank computes under torchrun: with one intra-op thread (OMP_NUM_THREADS=1)."""
    import torch

    torch.set_num_threads(1)


def cmd_plan(args: argparse.Namespace) -> int:
    import torch

    _rank_threads()

    from .cost.budget import format_bytes, parse_memory_limit
    from .describe import describe_prediction
    from .errors import BudgetError
    from .lifecycle import plan_offline
    from .plan import save_plan

    _check_comm_options(args)
    budget = parse_memory_limit(args.memory_limit, torch.device("cpu"))
    comm, comm_source = _comm_model(args, args.world_size)
    model = _build_model(args.model)
    x = _example_input(model, args)
    config = _search_config(args.cache_dir, args.world_size)
    profile, profile_source = _profile(args, model, x)
    try:
        plan, result, _ = plan_offline(
            model, (x,), world_size=args.world_size, budget_bytes=budget, comm=comm, config=config,
            example_kwargs=_input_kwargs(x, args), profile=profile,
        )
    except BudgetError as e:
        raise CommandError(f"{_budget_line(e)}; raise --memory-limit or plan for more ranks") from None
    try:
        save_plan(plan, args.out)
    except OSError as e:
        raise CommandError(f"cannot write {args.out}: {e.strerror or e}") from None
    _say(
        f"Planned {args.model} for {args.world_size} ranks within {format_bytes(budget)} per rank, using "
        f"{comm_source} and {profile_source}: {describe_prediction(plan)}. "
        f"{result.evaluated} plans evaluated in {result.seconds:.2f} s (stopped by: {result.stopped_by}). "
        f"Wrote {args.out}; read it with `autodist show {args.out}` and use it with "
        f"AutoDist(model, plan={str(args.out)!r})."
    )
    return 0


def _profile(args: argparse.Namespace, model: nn.Module, x: torch.Tensor) -> tuple[Any, str]:
    """The model's profile for ``autodist plan`` and ``autodist timeline``, and a phrase saying
    where it came from: the one cached for this model, input and machine, else (or with
    ``--reprofile``) measured here and cached.

    [Note: planning twice] Profiling is robust to a busy host (thread time, a low quantile of
    several passes, retaken when they spread), but not to a host whose speed drifts: on the
    development VM the gpt zoo model's forward and backward took 299 to 411 ms (lower quartile of
    six passes, thread time) within two minutes, with no steal time, and a calibration kernel timed
    between the passes did not track it (the model's time over the kernel's ranged 411-527). So a profile is measured once per model, input and machine and
    reused, as a job with ``plan="auto"`` reuses its own: the same command plans from the same
    measurement and gives the same plan and prediction."""
    import torch

    from .cache import Cache
    from .lifecycle import input_signature, profile_cache_key, profile_entry
    from .measure.trace import profile_model
    from .structure import discover

    cache = Cache(args.cache_dir)
    kwargs = _input_kwargs(x, args)
    structure = discover(model)
    key = profile_cache_key(structure, input_signature(((x,), kwargs)), "cpu", measured_by="autodist plan")
    if not args.reprofile:
        cached = cache.get("profiles", key, profile_entry)
        if cached is not None:
            return cached, f"the profile cached in {cache.path('profiles', key)} (--reprofile measures it again)"
    profile = profile_model(model, structure, (x,), device=torch.device("cpu"), example_kwargs=kwargs)
    cache.put("profiles", key, profile.to_json())
    noisy = (
        f", on a busy host (its passes spread {profile.meta['spread']:.0%} after {profile.meta['passes']}; "
        "--reprofile on a quieter host measures it again)" if profile.meta.get("noisy") else ""
    )
    return profile, f"a profile measured here{noisy}"


def _search_config(cache_dir: str | None, world: int) -> Any:
    """The search's margins for ``world`` CPU ranks on this machine (its fidelity record, else the defaults)."""
    from .cache import Cache, comm_cache_key
    from .cost.fidelity import FidelityRecord
    from .sched.search import SearchConfig

    cache = Cache(cache_dir, writer=False)
    return SearchConfig.for_machine(cache.get("fidelity", comm_cache_key(world, "cpu", "cpu", "gloo"), FidelityRecord.from_json))


# ------------------------------------------------------------------------------------------------
# check
# ------------------------------------------------------------------------------------------------


def _check_args(args: argparse.Namespace) -> list[str]:
    """The arguments the ranks of ``autodist check`` get (the parent's, less --json and --nproc, which
    torchrun's own parser would take for an abbreviation of its --nproc-per-node)."""
    out = ["--model", args.model, "--input-shape", ",".join(map(str, args.input_shape)), "--input-dtype", args.input_dtype,
           "--plans", str(args.plans), "--steps", str(args.steps), "--accum", str(args.accum)]
    if args.input_high is not None:
        out += ["--input-high", str(args.input_high)]
    for name in args.input_as:
        out += ["--input-as", name]
    if args.no_record:
        out.append("--no-record")
    if args.cache_dir:
        out += ["--cache-dir", os.path.abspath(args.cache_dir)]
    return out


def cmd_check(args: argparse.Namespace) -> int:
    if args.worker:
        return _check_worker(args)
    import subprocess
    import tempfile

    _rank_threads()
    _example_input(_build_model(args.model), args)  # a bad --model or input fails here, once, before any rank starts
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "check.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "autodist.cli", "check", "--worker", "--out", out, *_check_args(args)]
        # the ranks compute with one thread each, as under torchrun, in a process like the user's
        # training (glibc's allocator as it is: no fixed mmap threshold, which would slow steps that
        # allocate large tensors; see tools/_launch.py relaunch)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        # torch's C++ warnings (the profiler's about blocks allocated before it started) are not the user's business
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *filter(None, [env.get("PYTHONPATH")])])
        rc = subprocess.run(cmd, env=env).returncode
        if rc != 0 or not os.path.exists(out):
            raise CommandError(f"the {args.nproc} ranks failed (exit code {rc}); their output is above")
        with open(out) as f:
            payload = json.load(f)
    _say(render_check(payload))
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(payload, indent=1))
        except OSError as e:
            raise CommandError(f"cannot write {args.json}: {e.strerror or e}") from None
    return 0


def _check_worker(args: argparse.Namespace) -> int:
    """One rank of ``autodist check`` (launched by torchrun)."""
    from dataclasses import replace

    import torch
    import torch.distributed as dist

    from . import AutoDist
    from .cache import Cache, comm_cache_key
    from .cost.fidelity import MIN_SEED_MARGIN, SCALE_TOLERANCE, WAIT_SCALES, FidelityRecord, refusal
    from .cost.simulator import Simulator
    from .measure.fidelity import (
        Checked,
        Reprofile,
        best_wait_scale,
        errors_by_wait_scale,
        measure_plans,
        optimizer_for,
        plans_to_check,
        repeatability,
        slowest_over_ranks,
        summaries,
    )
    from .measure.sweep import collective_train, sweep
    from .measure.trace import model_loss, profile_model, surrogate_loss
    from .sched.search import SearchConfig
    from .sched.space import space_for
    from .structure import discover

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend, device_name = "nccl", torch.cuda.get_device_name(device)
    else:
        device, backend, device_name = torch.device("cpu"), "gloo", "cpu"
        _rank_threads()
    dist.init_process_group(backend)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = _build_model(args.model)
        structure = discover(model)
        _example_input(model, args)
        # distinct data per rank and step; a step is --accum micro-batches of --input-shape
        gen = torch.Generator().manual_seed(1000 + rank)
        shape = (args.input_shape[0] * args.accum, *args.input_shape[1:])
        dtype = getattr(torch, args.input_dtype)
        warmup, passes = 2, 2

        def batch() -> torch.Tensor:
            if dtype.is_floating_point:
                return torch.randn(shape, generator=gen).to(dtype).to(device)
            high = DEFAULT_INPUT_HIGH if args.input_high is None else args.input_high
            return torch.randint(0, high, shape, generator=gen, dtype=dtype).to(device)

        batches = [(batch(), None) for _ in range(warmup + args.steps + 1)]

        def loss(out: Any, _target: Any) -> torch.Tensor:
            own = model_loss(out)  # the model's own loss (Hugging Face with labels), else the mean of its outputs
            return own if own is not None else surrogate_loss(out)

        x0 = batches[0][0].chunk(args.accum)[0]
        train = collective_train(dist.group.WORLD, device)
        model = model.to(device)

        def profile(memory: bool = True) -> Any:
            return profile_model(
                model, structure, (x0,), device=device, loss_fn=lambda out: loss(out, None),
                example_kwargs=_input_kwargs(x0, args), optimizer=optimizer_for, contention=train, memory=memory,
            )

        prof = slowest_over_ranks(profile())
        reprofile = Reprofile(prof, lambda: profile(memory=False))
        comm = sweep(dist.group.WORLD, device)
        space = space_for(prof, structure, world, grad_accum_steps=args.accum)
        sim = Simulator(prof, structure, comm, world_size=world)
        chosen = plans_to_check(space, sim, args.plans)
        if not any("=" in name for name, _, _ in chosen):
            # one plan measured twice: the measurement's own noise, which decides whether the record
            # is stored (autodist/cost/fidelity.py refusal); the search usually picks a built-in one
            chosen.append(("again=ddp", chosen[0][1], False))
        checks = [
            Checked(name, space.to_plan(g, provenance={"source": f"autodist check:{name}"}), sim.run(space.to_plan(g)), searched)
            for name, g, searched in chosen
        ]

        def wrap(plan: Any) -> Any:
            return AutoDist(_build_model(args.model), plan=plan)  # the factory is seeded the same each time

        def progress(c: Checked) -> None:
            if rank == 0:
                # the table's predictions come later, from the profiles taken across all passes
                print(f"[autodist check] {c.name}: measured {c.measured_step_s * 1e3:.1f} ms (predicted "
                      f"{c.predicted.step_s * 1e3:.1f} ms from the first profile)", file=sys.stderr, flush=True)

        measure_plans(checks, wrap, batches, loss, device=device, accum=args.accum, steps=args.steps, warmup=warmup,
                      passes=passes, progress=progress, forward=lambda m, x: m(x, **_input_kwargs(x, args)),
                      after_pass=reprofile.after_pass)
        prof = reprofile.predict(checks, sim)
        if rank == 0:
            # each row with its plan, so that a plan whose peak or time was off can be run again
            rows = [dict(c.row(), plan_json=json.loads(c.plan.to_json())) for c in checks]
            fidelity = summaries(rows)
            overall = fidelity["all"]
            # the wait calibration that fits these plans best ([Note: the wait calibration]); the
            # record's errors stay those measured at the sweep's scale
            by_scale = errors_by_wait_scale(prof, structure, comm, [c.plan for c in checks],
                                            [c.measured_step_s for c in checks], world,
                                            sorted({*WAIT_SCALES, comm.wait_scale}))
            fitted = best_wait_scale({s: {"": e} for s, e in by_scale.items()}, [""], prior=comm.wait_scale,
                                     within=SCALE_TOLERANCE)
            record = replace(FidelityRecord.from_summary(overall, args.model), wait_scale=fitted,
                             blocked_wait_s=comm.blocked_wait_s)
            stored = None
            repeated = repeatability(rows)
            refused = refusal(record, repeated)
            if not args.no_record and refused is None:
                path = Cache(args.cache_dir).put("fidelity", comm_cache_key(world, device.type, device_name, backend), record.to_json())
                stored = str(path) if path else None
            cfg = SearchConfig.for_machine(record)
            payload = {
                "model": args.model, "world_size": world, "device": device_name, "backend": backend,
                "input_shape": list(args.input_shape), "accum": args.accum, "steps": args.steps, "passes": passes,
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
            with open(args.out, "w") as f:
                json.dump(payload, f, indent=1, default=lambda v: None)
    finally:
        dist.destroy_process_group()
    return 0


def render_check(payload: dict[str, Any]) -> str:
    """``autodist check``'s report: one row per plan, the fidelity figures, and what they change."""
    accum = f", {payload['accum']} micro-batches per step" if payload.get("accum", 1) > 1 else ""
    out = [
        f"autodist check: {payload['model']} on {payload['world_size']} ranks ({payload['device']}, {payload['backend']}), "
        f"input {','.join(map(str, payload['input_shape']))}{accum}; {payload['steps']} timed steps x {payload['passes']} passes per plan",
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


# ------------------------------------------------------------------------------------------------
# timeline
# ------------------------------------------------------------------------------------------------


def cmd_timeline(args: argparse.Namespace) -> int:
    _rank_threads()
    from . import timeline
    from .cost.simulator import Simulator
    from .errors import PlanError
    from .plan import validate_plan
    from .structure import discover

    _check_comm_options(args)
    png = Path(args.out).suffix.lower() == ".png"
    if not png and (args.width is not None or args.height is not None):
        raise CommandError(f"--width and --height apply to PNG output; {args.out} is a Chrome trace")
    plan = _load_plan(args.plan)
    comm, comm_source = _comm_model(args, plan.world_size)
    model = _build_model(args.model)
    structure = discover(model)
    try:
        validate_plan(plan, structure, world_size=plan.world_size, source=args.plan)
    except PlanError as e:
        raise CommandError(
            _plan_error_line(e, args.plan, f"the plan does not fit {args.model}; was it made for another model?")
        ) from None
    x = _example_input(model, args)
    profile, _ = _profile(args, model, x)
    sim = Simulator(profile, structure, comm, world_size=plan.world_size, budget_bytes=plan.budget_bytes)
    result = sim.run(plan, record=True)
    tl = timeline.from_simulation(
        result, f"{plan.label}: simulated step ({Path(args.plan).name}, {plan.world_size} ranks, {comm_source})",
        budget_bytes=plan.budget_bytes,
    )
    try:
        if png:
            width, height = args.width or PNG_SIZE[0], args.height or PNG_SIZE[1]
            timeline.to_png(tl, args.out, width_px=width, height_px=height)
        else:
            timeline.to_chrome_trace(tl, args.out)
    except ImportError as e:
        raise CommandError(f"{e}; or write a Chrome trace (-o OUT.json)") from None
    except OSError as e:
        raise CommandError(f"cannot write {args.out}: {e.strerror or e}") from None
    _say(f"Wrote {args.out}: {result.summary()}, {len(tl.intervals)} intervals.")
    return 0


# ------------------------------------------------------------------------------------------------
# cache
# ------------------------------------------------------------------------------------------------


def cmd_cache(args: argparse.Namespace) -> int:
    from .cache import Cache
    from .cost.budget import format_bytes

    cache = Cache(args.cache_dir)
    if args.action == "path":
        _say(str(cache.dir))
        return 0
    entries = cache.entries()
    if args.action == "list":
        if not entries:
            _say(f"the cache at {cache.dir} is empty")
            return 0
        rows = [
            (e.kind, e.key, format_bytes(e.bytes), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.modified)))
            for e in entries
        ]
        _say(format_table(("kind", "key", "size", "modified"), rows, indent=""))
        _say(f"{len(entries)} entries, {format_bytes(sum(e.bytes for e in entries))}, in {cache.dir}")
        return 0
    if args.action == "show":
        matches = [e for e in entries if e.key == args.key] or [e for e in entries if e.key.startswith(args.key)]
        if not matches:
            raise CommandError(f"no cache entry has key {args.key!r} in {cache.dir}; `autodist cache list` shows the keys")
        if len(matches) > 1:
            names = ", ".join(f"{e.kind}/{e.key}" for e in matches[:4])
            raise CommandError(f"{args.key!r} matches {len(matches)} entries ({names}); give more of the key")
        entry = matches[0]
        try:
            data = json.loads(entry.path.read_text())
        except (OSError, ValueError) as e:
            raise CommandError(
                f"cache entry {entry.path} cannot be read as JSON ({_first_line(e)}); `autodist cache clear "
                f"--kind {entry.kind}` removes it"
            ) from None
        _say(json.dumps(data, indent=1, sort_keys=True) if args.json else render_cache_entry(entry.kind, entry.key, entry.path, data))
        return 0
    # clear
    doomed = [e for e in entries if args.kind is None or e.kind == args.kind]
    removed = cache.clear(args.kind) if doomed else 0
    what = f" of kind {args.kind}" if args.kind else ""
    _say(f"removed {removed} cache {'entry' if removed == 1 else 'entries'}{what} from {cache.dir}")
    return 0


# ------------------------------------------------------------------------------------------------
# env
# ------------------------------------------------------------------------------------------------


def _version_of(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_report() -> str:
    import torch

    from . import __version__
    from .cache import Cache
    from .cost.budget import default_budget, format_bytes
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
    has_accelerator = hasattr(torch, "accelerator") and torch.accelerator.is_available()
    if has_accelerator:
        acc = torch.accelerator.current_accelerator()
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


def cmd_env(args: argparse.Namespace) -> int:
    _say(environment_report())
    return 0


# ------------------------------------------------------------------------------------------------


COMMANDS = {
    "show": cmd_show, "plan": cmd_plan, "timeline": cmd_timeline, "check": cmd_check, "cache": cmd_cache, "env": cmd_env,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (argparse exits with 2 itself on a bad argument)."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except CommandError as e:
        _complain(f"autodist {args.command}", str(e))
        return 2
    except BrokenPipeError:
        # the reader went away (`autodist show plan.json | head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
