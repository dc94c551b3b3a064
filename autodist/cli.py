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
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .report import environment_report, format_table, render_cache_entry, render_check, render_plan

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .errors import PlanError
    from .plan import Plan

INPUT_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32")
DEFAULT_INPUT_HIGH = 1000
PNG_SIZE = (1400, 700)  # pixels: a step's streams and memory curve stay readable on one screen
TIMELINE_SUFFIXES = (".json", ".png")


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


def _add_comm_options(p: argparse.ArgumentParser, *, levels: bool = False) -> None:
    """The comm model's flags; ``levels``: ``--interconnect`` may name two links, WITHIN,ACROSS
    (``autodist plan --nodes``), checked by the command."""
    from .cost.interconnect import INTERCONNECTS

    g = p.add_argument_group(
        "comm model",
        "an analytic model of a named interconnect (--interconnect) or of your own numbers (--bandwidth and "
        "--latency), or else the one measured and cached on this machine by a job with plan=\"auto\" on as "
        "many ranks",
    )
    presets = "; ".join(f"{i.name}: {i.what}, {i.bandwidth_gbps:g} GB/s, {i.latency_us:g} us" for i in INTERCONNECTS.values())
    if levels:
        g.add_argument(
            "--interconnect", metavar="NAME[,NAME]",
            help="the link the ranks' collectives cross on one node, or with --nodes two links, WITHIN,ACROSS "
            f"(e.g. nvlink4,ib-ndr): {presets}",
        )
    else:
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
    p.add_argument(
        "--profile", metavar="PROFILE.json", dest="profile_file",
        help="plan from this profile of the model instead of profiling it here: a file from the profiles/ "
        "directory of an AutoDist cache on the machine the plan is for (a GPU's compute times come from a GPU)",
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
    plan.add_argument("--world-size", type=_positive_int, metavar="N", help="ranks the plan is for, on one node")
    plan.add_argument(
        "--nodes", type=_positive_int, metavar="N",
        help="nodes the plan is for, with --gpus-per-node ranks each (instead of --world-size); on more than one, "
        "--interconnect names two links, WITHIN,ACROSS, and the search considers hybrid sharding (shard within a "
        "node, replicate across nodes)",
    )
    plan.add_argument("--gpus-per-node", type=_positive_int, metavar="G", help="ranks per node, with --nodes")
    plan.add_argument(
        "--memory-limit", type=_memory_limit, metavar="SIZE",
        help="budget per rank: bytes, a size such as 2GiB or 512MB, or a percentage such as 80%% "
        "(default: what this machine has available)",
    )
    _add_comm_options(plan, levels=True)
    _add_reprofile(plan)
    from .cost.devices import describe_devices

    plan.add_argument(
        "--device", metavar="NAME", dest="described_device",
        help="time the model's compute on this described GPU, not this machine's: each operator of one forward "
        f"and backward priced by a roofline of its FLOPs and bytes ({describe_devices()})",
    )
    from .compile_backends import COMPILE_BACKENDS

    plan.add_argument(
        "--compile", nargs="?", const="inductor", default=None, choices=COMPILE_BACKENDS, metavar="BACKEND",
        help="let the plan compile blocks (torch.compile, operators fused) where the search predicts a gain: every "
        "block is timed here compiled and eager, as AutoDist(..., compile=BACKEND) does; BACKEND is one of "
        f"{', '.join(COMPILE_BACKENDS)} (default inductor; compiling takes minutes on a CPU). Without it, no block is compiled",
    )
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
    from .planner.cache import KINDS

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
    """The comm model the flags ask for, and a phrase saying where it came from (``planner/offline.py``)."""
    from .planner import offline

    try:
        return offline.comm_model(
            world, cache_dir=args.cache_dir, interconnect=args.interconnect, bandwidth_gbps=args.bandwidth, latency_us=args.latency,
        )
    except offline.OfflineError as e:
        raise CommandError(str(e)) from None


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


def cmd_show(args: argparse.Namespace) -> int:
    if Path(args.plan).exists():
        _say(render_plan(_load_plan(args.plan), args.plan))
        return 0
    from .planner.cache import Cache

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
    from .plan import save_plan
    from .planner.offline import level_report, offline_search_config, plan_offline, sharding_reason

    nodes, per_node = _check_plan_options(args)
    world = nodes * per_node
    if nodes > 1 or args.nodes is not None:
        from .planner.offline import cluster_comm_model

        within, _, across = args.interconnect.partition(",")
        comm, comm_source = cluster_comm_model(nodes, per_node, within, across or None)
        comm_source = f"the analytic comm model of {comm_source}"
    else:
        comm, comm_source = _comm_model(args, world)
    model = _build_model(args.model)
    x = _example_input(model, args)
    config = offline_search_config(args.cache_dir, world)
    profile, profile_source = _profile(args, model, x)
    if args.described_device is not None:
        profile, profile_source = _on_described_device(args, model, x, profile)
    if profile.device != "cpu" and args.memory_limit is None:
        which = f"the plan is for a described {args.described_device}" if args.described_device else (
            f"the profile was measured on {profile.device}")
        raise CommandError(
            f"{which}: this machine's memory says nothing about that device's; "
            "pass --memory-limit, the budget per rank there (e.g. 70GiB)"
        )
    budget = parse_memory_limit(args.memory_limit, torch.device("cpu"))
    try:
        plan, result, prof = plan_offline(
            model, (x,), world_size=world, budget_bytes=budget, comm=comm, config=config,
            example_kwargs=_input_kwargs(x, args), profile=profile, device=torch.device(profile.device),
        )
    except BudgetError as e:
        raise CommandError(f"{_budget_line(e)}; raise --memory-limit or plan for more ranks") from None
    try:
        save_plan(plan, args.out)
    except OSError as e:
        raise CommandError(f"cannot write {args.out}: {e.strerror or e}") from None
    ranks = (f"{nodes} node{'s' if nodes > 1 else ''} of {per_node} rank{'s' if per_node > 1 else ''} ({world} ranks)"
             if args.nodes is not None else f"{world} ranks")
    _say(
        f"Planned {args.model} for {ranks} within {format_bytes(budget)} per rank, using "
        f"{comm_source} and {profile_source}: {describe_prediction(plan)}. "
        f"{result.evaluated} plans evaluated in {result.seconds:.2f} s (stopped by: {result.stopped_by}). "
        f"Wrote {args.out}; read it with `autodist show {args.out}` and use it with "
        f"AutoDist(model, plan={str(args.out)!r})."
    )
    if profile.device == "cpu" and (args.interconnect is not None or args.nodes is not None):
        _say("Note: the compute times are this machine's CPU's, not a GPU's: pass --device NAME to price them on a "
             "described GPU, or --profile FILE, a profile taken on one.")
    if comm.levels == 2:
        from .structure import discover

        structure = discover(model)
        step = plan.predicted["step_seconds"]
        levels = level_report(plan, prof, structure, comm)
        _say("Communication per level (busy: its collectives' time in a step; exposed: what it adds to the step): " + "; ".join(
            f"{name} {lv['busy_s'] * 1e3:.2f} ms busy, {lv['exposed_s'] * 1e3:.2f} ms exposed" for name, lv in levels.items()
        ) + f"; step {step * 1e3:.2f} ms, compute {result.result.compute_s * 1e3:.2f} ms.")
        _say("Sharding: " + sharding_reason(plan, prof, structure, comm, result) + ".")
    return 0


def _check_plan_options(args: argparse.Namespace) -> tuple[int, int]:
    """(nodes, ranks per node) of ``autodist plan``'s flags, or one error naming the combination
    that does not work and the fix."""
    from .cost.devices import DEVICES
    from .cost.interconnect import INTERCONNECTS

    _check_comm_options(args)
    if args.world_size is not None and (args.nodes is not None or args.gpus_per_node is not None):
        raise CommandError("--world-size and --nodes/--gpus-per-node both give the ranks; pass --world-size N for one "
                           "node, or --nodes N --gpus-per-node G")
    if args.world_size is None and (args.nodes is None or args.gpus_per_node is None):
        given = "--nodes" if args.nodes is not None else "--gpus-per-node" if args.gpus_per_node is not None else None
        if given:
            missing = "--gpus-per-node" if given == "--nodes" else "--nodes"
            raise CommandError(f"{given} needs {missing} too (the ranks are nodes x GPUs per node)")
        raise CommandError("give the ranks the plan is for: --world-size N (one node), or --nodes N --gpus-per-node G")
    if args.described_device is not None and args.described_device not in DEVICES:
        raise CommandError(f"--device {args.described_device!r}: not a described device; use one of {', '.join(DEVICES)}")
    if args.described_device is not None and args.compile is not None:
        raise CommandError("--compile times blocks compiled on this machine's CPU, and --device prices the compute on a "
                           "described GPU, where those times do not hold; drop one of them")
    if args.described_device is not None and args.profile_file is not None:
        raise CommandError("--device and --profile both give the compute times; pass one: --device to price them on a "
                           "described GPU, --profile for a profile taken on the device")
    names = [] if args.interconnect is None else args.interconnect.split(",")
    unknown = [n for n in names if n not in INTERCONNECTS]
    if unknown or len(names) > 2 or "" in names:
        raise CommandError(f"--interconnect {args.interconnect!r}: expected NAME or WITHIN,ACROSS, each one of "
                           f"{', '.join(INTERCONNECTS)}")
    if args.world_size is not None:
        if len(names) == 2:
            raise CommandError("--interconnect names two links, but --world-size plans for one node, whose ranks share one "
                               "link; pass --nodes N --gpus-per-node G for several nodes, or one interconnect")
        return 1, args.world_size
    nodes, per_node = args.nodes, args.gpus_per_node
    if args.bandwidth is not None:
        raise CommandError("--bandwidth/--latency describe one link; with --nodes name the links with --interconnect "
                           "WITHIN,ACROSS (e.g. nvlink4,ib-ndr)")
    if not names:
        raise CommandError("--nodes plans for a described cluster: name its links with --interconnect WITHIN,ACROSS "
                           "(e.g. nvlink4,ib-ndr), or NAME on one node")
    if nodes > 1 and len(names) != 2:
        raise CommandError(f"--interconnect {args.interconnect!r} names one link, but {nodes} nodes have two: the link "
                           "within a node and the one across nodes; pass WITHIN,ACROSS (e.g. nvlink4,ib-ndr)")
    if nodes == 1 and len(names) == 2:
        raise CommandError("--interconnect names two links, but one node has one; pass one NAME, or more --nodes")
    return nodes, per_node


def _on_described_device(args: argparse.Namespace, model: nn.Module, x: torch.Tensor, profile: Any) -> tuple[Any, str]:
    """``profile`` with its compute timed on ``--device`` (``cost/device.py``), and a phrase saying so."""
    from .cost.device import DEVICES, count_roofline, on_device
    from .structure import discover

    device = DEVICES[args.described_device]
    roofline = count_roofline(model, discover(model), (x,), device, example_kwargs=_input_kwargs(x, args))
    return on_device(profile, roofline), (
        f"compute timed on a described {device.name} (a per-operator roofline of {device.describe()}; "
        f"{roofline.flops / 1e9:.1f} GFLOP per step), with the orders and memory of this machine's profile"
    )


def _profile(args: argparse.Namespace, model: nn.Module, x: torch.Tensor) -> tuple[Any, str]:
    """The model's profile for ``autodist plan`` and ``autodist timeline`` and where it came from
    (``--profile``, cached, or measured here: ``planner/offline.py`` [Note: planning twice])."""
    from .planner.offline import offline_profile

    compile_backend = getattr(args, "compile", None)
    if getattr(args, "profile_file", None):
        from .planner.keys import input_signature

        profile, source = _profile_from_file(args.profile_file, model, input_signature(((x,), _input_kwargs(x, args))))
        if compile_backend is not None and profile.compile_backend != compile_backend:
            timed = f"with {profile.compile_backend}" if profile.compile_backend else "not at all"
            raise CommandError(
                f"--compile {compile_backend}: the profile {args.profile_file} timed its blocks compiled {timed}; pass a "
                f"profile from a job run with AutoDist(..., compile={compile_backend!r}), or drop --profile to profile here"
            )
        if compile_backend is None and hasattr(args, "compile") and profile.compiled_blocks:
            from dataclasses import replace

            # `autodist plan` without --compile compiles nothing, whatever the profile timed
            profile = replace(profile, compiled_blocks={}, compile_backend="")
        return profile, source
    profile, source = offline_profile(model, (x,), _input_kwargs(x, args), cache_dir=args.cache_dir, reprofile=args.reprofile,
                                      compile_backend=compile_backend)
    return profile, f"{source} (compute times of this machine's {profile.device})"


def _profile_from_file(path: str, model: nn.Module, signature: str) -> tuple[Any, str]:
    """A profile read from ``path`` and checked against ``model``'s units and the example input's
    ``signature`` (shapes and dtypes)."""
    import json

    from .cost.profile import PROFILE_SCHEMA_VERSION, Profile
    from .structure import discover

    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise CommandError(f"cannot read the profile {path}: {e.strerror or e}") from None
    try:
        profile = Profile.from_dict(json.loads(text))
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CommandError(f"{path} is not a profile this version reads ({e}); take it again with plan=\"auto\" "
                           "or `autodist plan` on that machine") from None
    units = [u.name for u in discover(model).units]
    have = [u.name for u in profile.units]
    if sorted(units) != sorted(have):
        missing = sorted(set(units) - set(have))[:3]
        extra = sorted(set(have) - set(units))[:3]
        raise CommandError(
            f"the profile {path} is of another model: its units differ from this model's "
            f"(missing {missing or 'none'}, not in the model {extra or 'none'}); pass the profile of the same model "
            "and example input"
        )
    if profile.batch_signature and profile.batch_signature != signature:
        raise CommandError(
            f"the profile {path} was measured on an input of {profile.batch_signature}, this command's is {signature}: "
            "give --input-shape and --input-dtype as the profile was taken"
        )
    meta = profile.meta or {}
    taken = f" with torch {meta['torch']}" if meta.get("torch") else ""
    older = (
        f"; of schema {profile.schema_version}, before {PROFILE_SCHEMA_VERSION}: its unit times still hold the "
        "profiler's own time, which overstates many small layers"
        if profile.schema_version != PROFILE_SCHEMA_VERSION else ""
    )
    return profile, f"the profile {path} (compute times measured on {profile.device}{taken}{older})"


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
    """One rank of ``autodist check`` (launched by torchrun): the pipeline of ``planner/check.py``
    on the model and batches the flags describe; rank 0 writes the payload to ``--out``."""
    import torch

    from .planner.check import CheckRequest, check_on_ranks

    dtype = getattr(torch, args.input_dtype)
    shape = (args.input_shape[0] * args.accum, *args.input_shape[1:])  # a step: --accum micro-batches

    def batch(gen: torch.Generator, device: torch.device) -> torch.Tensor:
        if dtype.is_floating_point:
            return torch.randn(shape, generator=gen).to(dtype).to(device)
        high = DEFAULT_INPUT_HIGH if args.input_high is None else args.input_high
        return torch.randint(0, high, shape, generator=gen, dtype=dtype).to(device)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    request = CheckRequest(
        model=args.model, build=lambda: _build_model(args.model), validate=lambda m: _example_input(m, args),
        batch=batch, kwargs_of=lambda x: _input_kwargs(x, args), input_shape=tuple(args.input_shape),
        plans=args.plans, steps=args.steps, accum=args.accum, record=not args.no_record, cache_dir=args.cache_dir,
    )
    payload = check_on_ranks(request, say)
    if payload is not None:
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1, default=lambda v: None)
    return 0


# ------------------------------------------------------------------------------------------------
# timeline
# ------------------------------------------------------------------------------------------------


def cmd_timeline(args: argparse.Namespace) -> int:
    _rank_threads()
    from . import timeline
    from .errors import PlanError
    from .plan import validate_plan
    from .planner.offline import simulate
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
    result = simulate(plan, profile, structure, comm)
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
    from .cost.budget import format_bytes
    from .planner.cache import Cache

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
