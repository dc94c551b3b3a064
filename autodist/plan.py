"""The plan: every decision AutoDist makes, as plain versioned data (docs/design.md, "The plan").

A plan is separate from everything that reads it: the validator below checks it against a model, the
simulator predicts it, the runtime enacts it, ``autodist show`` prints it. JSON is the interchange
form; it is written with sorted, indented keys so two plans diff line by line.

Over 800 lines on purpose: the data model, its reading from JSON and its validation are one contract
(the plan schema), so a schema change is made, and reviewed, in this one file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from .compile_backends import COMPILE_BACKENDS
from .errors import PlanError
from .structure import ModelStructure

SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (1, 2)  # 1: before recomputation and gradient accumulation (defaults apply)
MAX_NESTING = 32  # free-form fields (predicted, provenance) deeper than this are refused

PLACEMENTS = ("replicate", "shard")
RESIDENCIES = ("after_forward", "after_backward", "persistent")
ACCUMULATIONS = ("unsharded", "sharded")
BUCKET_OPS = ("all_reduce", "reduce_scatter")
OP_FOR_PLACEMENT = {"replicate": "all_reduce", "shard": "reduce_scatter"}

Window = int | Literal["memory"]

# Optimizer state that offload fragments may name: the per-element state tensors of torch.optim's
# optimizers (from the torch 2.14 sources: Adam, AdamW, NAdam, RAdam and SparseAdam; Adamax; Adagrad;
# Adadelta; RMSprop; Rprop; ASGD; SGD and Muon; Adafactor), plus whatever a plan lists in its
# ``optimizer_states`` (what the optimizer it was planned for keeps, e.g. a third-party one).
OPTIMIZER_STATES = frozenset({
    "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "sum", "square_avg", "acc_delta", "grad_avg",
    "momentum_buffer", "prev", "step_size", "ax", "row_var", "col_var", "variance",
})
# Their scalar state: nothing to offload.
SCALAR_OPTIMIZER_STATES = frozenset({"step", "eta", "mu", "mu_product"})


@dataclass
class UnitPlan:
    """One unit: its parameters, their placement, and (if sharded) when gathered copies are freed
    and how its gradients accumulate over the micro-batches of a step.

    ``accumulate`` (sharded units; replicated ones always accumulate locally, as DDP's ``no_sync``):
    ``"unsharded"`` — during micro-batches that do not synchronise, the full gradient is kept (in
    the reduce dtype) and reduce-scattered once, by the synchronising backward; ``"sharded"`` —
    every micro-batch reduce-scatters, and the sharded gradient accumulates (FSDP2's default:
    more traffic, less memory)."""

    name: str
    params: list[str]
    placement: str = "replicate"
    residency: str = "after_forward"  # ignored for replicate units, which are always resident
    accumulate: str = "unsharded"


@dataclass
class Prefetch:
    """How many units ahead of use a gather group's all-gather is issued, or ``"memory"``."""

    forward: Window = 1
    backward: Window = 1


@dataclass
class GatherGroup:
    units: list[str]
    prefetch: Prefetch = field(default_factory=Prefetch)


@dataclass
class Bucket:
    """Parameters whose gradients are reduced by one collective, in gradient-ready order.
    ``nbytes``: their gradients' size, for people reading the plan (informational)."""

    params: list[str]
    op: str = "all_reduce"
    nbytes: int | None = None


@dataclass
class BucketRebuild:
    """Ask the runtime to re-bucket once from the observed gradient-ready order (DDP's behaviour)."""

    cap_bytes: int = 25 * 1024 * 1024
    first_cap_bytes: int = 1024 * 1024


@dataclass
class OffloadFragment:
    """A slice ``[start, end)`` of one optimizer-state tensor (local shard, flattened) kept on the host.

    ``out_after``: ``"step"`` (copy out right after the optimizer step) or ``"forward:<unit>"`` (start
    the copy-out when that unit's forward begins). ``back_from``: ``"backward:<unit>"`` (start the
    copy-back when that unit's backward begins) or ``"step"`` (copy back just before the step).
    """

    param: str
    state: str
    fragment: tuple[int, int]
    out_after: str = "step"
    back_from: str = "step"


@dataclass
class Plan:
    """Every decision, as data. ``max_inflight_buckets``: at most this many bucket reductions in
    flight (launching one more waits for the oldest; 0 = wait right after launch; null = no limit,
    all waited for at the end of backward)."""

    world_size: int
    units: list[UnitPlan]
    gather_groups: list[GatherGroup] = field(default_factory=list)
    buckets: list[Bucket] = field(default_factory=list)
    offload: list[OffloadFragment] = field(default_factory=list)
    rebuild_buckets: BucketRebuild | None = None
    max_inflight_buckets: int | None = None
    # blocks (structure.blocks) whose forward AutoDist runs again during backward instead of keeping
    # their activations (activation checkpointing the model's code does not do itself)
    recompute: list[str] = field(default_factory=list)
    # blocks (structure.blocks) whose forward AutoDist runs under torch.compile with
    # ``compile_backend`` (autodist/runtime/compiled.py): the block's operators fused, its
    # parameters managed at its boundary, its gradients all ready when its backward ends
    compile: list[str] = field(default_factory=list)
    compile_backend: str = "inductor"
    # micro-batches per optimizer step the plan was made for (a loop with another count stays correct)
    grad_accum_steps: int = 1
    # Over how many ranks every sharded unit is sharded: null = the whole world (FSDP's full
    # sharding); otherwise groups of this many consecutive ranks of the mesh (typically a node), the
    # groups replicating each other (FSDP2's HSDP): gathers and reduce-scatters stay within a group,
    # and the sharded gradients are then all-reduced across groups. Divides ``world_size``.
    shard_size: int | None = None
    schema_version: int = SCHEMA_VERSION
    fingerprint: str = ""
    device: str = "cpu"
    budget_bytes: int | None = None
    # What the plan was made for, checked when it is applied (empty: not recorded, as in older files):
    # every parameter's shape, so that a plan for a model of another size is refused; and the
    # optimizer's state names, so that offload fragments naming other state are refused.
    param_shapes: dict[str, list[int]] = field(default_factory=dict)
    optimizer_states: list[str] = field(default_factory=list)
    predicted: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    # ---- convenience views -------------------------------------------------------------------
    def unit(self, name: str) -> UnitPlan:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)

    @property
    def placement_of_param(self) -> dict[str, str]:
        return {p: u.placement for u in self.units for p in u.params}

    @property
    def sharded_units(self) -> list[UnitPlan]:
        return [u for u in self.units if u.placement == "shard"]

    @property
    def shard_ranks(self) -> int:
        """How many ranks a sharded unit is split over (the shard group's size)."""
        return self.shard_size or self.world_size

    @property
    def hybrid(self) -> bool:
        """Sharded within groups smaller than the world and replicated across them."""
        return self.shard_ranks < self.world_size

    @property
    def label(self) -> str:
        return str(self.provenance.get("source", "custom"))

    # ---- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for o in d["offload"]:
            o["fragment"] = list(o["fragment"])
        if d["shard_size"] is None:  # the whole world: written as before hybrid sharding (same hash)
            del d["shard_size"]
        if not d["compile"]:  # nothing compiled: written as before compiled blocks (same hash)
            del d["compile"], d["compile_backend"]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any, *, source: str | None = None) -> Plan:
        return _parse_plan(data, source)

    @classmethod
    def from_json(cls, text: str, *, source: str | None = None) -> Plan:
        where = source or "<string>"
        if not text.strip():
            raise PlanError(
                f"{where} is empty; the file was probably truncated while being written. "
                "Regenerate it (`autodist plan ...` or AutoDist(..., plan='auto')) or pass a built-in "
                "plan such as plan='ddp'.",
                source=source,
            )
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(
                f"{where} is not valid JSON ({e.msg.removesuffix(' at')} at line {e.lineno}, column {e.colno}); it may be "
                "truncated or corrupt. Regenerate it or pass a built-in plan such as plan='ddp'.",
                source=source,
            ) from None
        except RecursionError:
            raise PlanError(
                f"{where} nests JSON arrays or objects too deeply to be read (a plan nests at most "
                f"{MAX_NESTING} levels); it is corrupt. Regenerate it or pass a built-in plan such as plan='ddp'.",
                source=source,
            ) from None
        return _parse_plan(data, source)

    def hash(self) -> str:
        """Digest of every field that affects execution (not predictions or provenance)."""
        d = self.to_dict()
        for k in ("predicted", "provenance", "fingerprint", "budget_bytes", "param_shapes", "optimizer_states"):
            d.pop(k, None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def made_for(plan: Plan, structure: ModelStructure, *, optimizer_states: list[str] | None = None) -> None:
    """Record in ``plan`` what it was made for, which ``validate_plan`` checks when it is applied:
    the model's parameter shapes and (given) the optimizer's state names. Prefetch windows longer
    than the model's units (which act as the number of units) are shortened to it."""
    plan.param_shapes = {name: list(info.shape) for name, info in structure.params.items()}
    if optimizer_states is not None:
        plan.optimizer_states = sorted(optimizer_states)
    n_units = len(structure.units)
    for g in plan.gather_groups:
        for direction in ("forward", "backward"):
            w = getattr(g.prefetch, direction)
            if w != "memory" and w > n_units:
                setattr(g.prefetch, direction, n_units)


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write ``plan`` as JSON, atomically (a reader never sees a half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(plan.to_json() + "\n")
    os.replace(tmp, path)


def load_plan(path: str | os.PathLike[str], model: Any = None, *, world_size: int | None = None) -> Plan:
    """Read a plan file; if ``model`` (an ``nn.Module`` or ``ModelStructure``) is given, validate it."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlanError(f"plan file {str(path)!r} does not exist", source=str(path)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"cannot read plan file {str(path)!r}: {e}", source=str(path)) from None
    plan = Plan.from_json(text, source=str(path))
    if model is not None:
        from .structure import discover

        structure = model if isinstance(model, ModelStructure) else discover(model)
        validate_plan(plan, structure, world_size=world_size, source=str(path))
    return plan


# ------------------------------------------------------------------------------------------------
# Parsing: a small typed reader that reports the path of every field it rejects.
# ------------------------------------------------------------------------------------------------


class _Reader:
    def __init__(self, source: str | None) -> None:
        self.source = source
        self.problems: list[str] = []

    def fail(self, path: str, msg: str) -> None:
        self.problems.append(f"{path}: {msg}")

    def obj(self, value: Any, path: str, required: set[str], optional: set[str]) -> dict | None:
        if not isinstance(value, dict):
            self.fail(path, f"expected a JSON object, got {type(value).__name__}")
            return None
        for k in sorted(required - value.keys()):
            self.fail(f"{path}.{k}" if path else k, "missing required field")
        for k in sorted(value.keys() - required - optional):
            known = ", ".join(sorted(required | optional))
            self.fail(f"{path}.{k}" if path else k, f"unknown field (known fields: {known})")
        return value

    def typed(self, value: Any, path: str, kind: type | tuple[type, ...], what: str) -> Any:
        ok = isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, (int, float)))
        if not ok:
            self.fail(path, f"expected {what}, got {json.dumps(value)[:60]}")
            return None
        return value

    def count(self, value: Any, path: str, what: str) -> int | None:
        """A non-negative integer (bytes, a count)."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self.fail(path, f"expected {what}; got {json.dumps(value)[:60]}")
            return None
        return value

    def choice(self, value: Any, path: str, choices: tuple[str, ...]) -> Any:
        if value not in choices:
            self.fail(path, f"expected one of {', '.join(choices)}; got {json.dumps(value)[:60]}")
            return None
        return value

    def objects(self, d: dict, key: str, required: set[str], optional: set[str], default: Any = ()) -> Iterator[tuple[str, dict]]:
        """The objects of list field ``key`` of ``d``, each with its path; problems are recorded."""
        raw = d.get(key, default)
        if not isinstance(raw, list):
            self.fail(key, "expected a list of objects")
            return
        for i, item in enumerate(raw):
            path = f"{key}[{i}]"
            obj = self.obj(item, path, required, optional)
            if obj is not None:
                yield path, obj

    def str_list(self, value: Any, path: str) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            self.fail(path, "expected a list of strings")
            return []
        return value

    def window(self, value: Any, path: str) -> Window:
        if value == "memory" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        self.fail(path, f"expected a non-negative integer or \"memory\"; got {json.dumps(value)[:60]}")
        return 0


_TOP_REQUIRED = {"schema_version", "world_size", "units"}
_TOP_OPTIONAL = {
    "gather_groups", "buckets", "offload", "rebuild_buckets", "max_inflight_buckets", "fingerprint", "device",
    "budget_bytes", "param_shapes", "optimizer_states", "predicted", "provenance", "recompute", "grad_accum_steps",
    "shard_size", "compile", "compile_backend",
}


def _parse_plan(data: Any, source: str | None) -> Plan:
    r = _Reader(source)
    _check_schema_version(data, source)
    d = r.obj(data, "", _TOP_REQUIRED, _TOP_OPTIONAL)
    if d is None:
        raise PlanError(r.problems, source=source)

    world_size = _read_world_size(r, d)
    units = _read_units(r, d)
    groups = _read_gather_groups(r, d)
    buckets = _read_buckets(r, d)
    offload = _read_offload(r, d)
    optimizer_states = r.str_list(d.get("optimizer_states", []), "optimizer_states")
    _check_fragments(r, offload, set(optimizer_states))
    rebuild = _read_rebuild_buckets(r, d)
    inflight = _read_max_inflight(r, d)
    budget = d.get("budget_bytes")
    if budget is not None:
        budget = r.count(budget, "budget_bytes", "a non-negative number of bytes or null")
    param_shapes = _read_param_shapes(r, d)
    _check_free_form(r, d)
    recompute = r.str_list(d.get("recompute", []), "recompute")
    if len(set(recompute)) != len(recompute):
        r.fail("recompute", "lists a block more than once; list each block once")
    accum = _read_grad_accum_steps(r, d)
    compiled = r.str_list(d.get("compile", []), "compile")
    if len(set(compiled)) != len(compiled):
        r.fail("compile", "lists a block more than once; list each block once")
    backend = r.choice(d.get("compile_backend", "inductor"), "compile_backend", COMPILE_BACKENDS)
    shard_size = d.get("shard_size")
    if shard_size is not None:
        shard_size = r.typed(shard_size, "shard_size", int, "a positive number of ranks or null (the whole world)")
        if isinstance(shard_size, int) and shard_size < 1:
            r.fail("shard_size", f"expected a positive number of ranks or null (the whole world), got {shard_size}")
    if r.problems:
        raise PlanError(r.problems, source=source)
    return Plan(
        shard_size=shard_size,
        schema_version=d["schema_version"],
        recompute=list(recompute),
        compile=list(compiled),
        compile_backend=str(backend),
        grad_accum_steps=accum,
        world_size=world_size,
        units=units,
        gather_groups=groups,
        buckets=buckets,
        offload=offload,
        rebuild_buckets=rebuild,
        max_inflight_buckets=inflight,
        fingerprint=str(d.get("fingerprint", "")),
        device=str(d.get("device", "cpu")),
        budget_bytes=budget,
        param_shapes={k: list(v) for k, v in param_shapes.items()},
        optimizer_states=list(optimizer_states),
        predicted=dict(d.get("predicted", {})),
        provenance=dict(d.get("provenance", {})),
    )


def _check_schema_version(data: Any, source: str | None) -> None:
    """Refuse a plan of an unreadable schema version at once, before its fields are read."""
    if not (isinstance(data, dict) and "schema_version" in data):
        return
    v = data["schema_version"]
    if isinstance(v, bool) or not isinstance(v, int):
        raise PlanError(
            f"schema_version: expected an integer such as {SCHEMA_VERSION}, got {json.dumps(v)[:60]}; write "
            f'"schema_version": {SCHEMA_VERSION}',
            source=source,
        )
    if v not in SUPPORTED_SCHEMA_VERSIONS:
        raise PlanError(
            f"schema_version {json.dumps(v)} is not supported by this autodist (it reads "
            f"{', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}); upgrade autodist or regenerate "
            "the plan with this version",
            source=source,
        )


def _read_world_size(r: _Reader, d: dict) -> Any:
    world_size = r.typed(d.get("world_size"), "world_size", int, "a positive integer")
    if isinstance(world_size, int) and world_size < 1:
        r.fail("world_size", f"expected a positive integer, got {world_size}")
    return world_size


def _read_units(r: _Reader, d: dict) -> list[UnitPlan]:
    units: list[UnitPlan] = []
    for p, uo in r.objects(d, "units", {"name", "params"}, {"placement", "residency", "accumulate"}, default=None):
        units.append(
            UnitPlan(
                name=r.typed(uo.get("name"), f"{p}.name", str, "a string") or "",
                params=r.str_list(uo.get("params"), f"{p}.params"),
                placement=r.choice(uo.get("placement", "replicate"), f"{p}.placement", PLACEMENTS)
                or "replicate",
                residency=r.choice(uo.get("residency", "after_forward"), f"{p}.residency", RESIDENCIES)
                or "after_forward",
                accumulate=r.choice(uo.get("accumulate", "unsharded"), f"{p}.accumulate", ACCUMULATIONS)
                or "unsharded",
            )
        )
    return units


def _read_gather_groups(r: _Reader, d: dict) -> list[GatherGroup]:
    groups: list[GatherGroup] = []
    for p, go in r.objects(d, "gather_groups", {"units"}, {"prefetch"}):
        pf = go.get("prefetch", {"forward": 1, "backward": 1})
        pfo = r.obj(pf, f"{p}.prefetch", set(), {"forward", "backward"}) or {}
        groups.append(
            GatherGroup(
                units=r.str_list(go.get("units"), f"{p}.units"),
                prefetch=Prefetch(
                    forward=r.window(pfo.get("forward", 1), f"{p}.prefetch.forward"),
                    backward=r.window(pfo.get("backward", 1), f"{p}.prefetch.backward"),
                ),
            )
        )
    return groups


def _read_buckets(r: _Reader, d: dict) -> list[Bucket]:
    buckets: list[Bucket] = []
    for p, bo in r.objects(d, "buckets", {"params"}, {"op", "nbytes"}):
        nb = bo.get("nbytes")
        if nb is not None:
            nb = r.count(nb, f"{p}.nbytes", "a non-negative number of bytes or null")
        buckets.append(
            Bucket(
                params=r.str_list(bo.get("params"), f"{p}.params"),
                op=r.choice(bo.get("op", "all_reduce"), f"{p}.op", BUCKET_OPS) or "all_reduce",
                nbytes=nb,
            )
        )
    return buckets


def _read_offload(r: _Reader, d: dict) -> list[OffloadFragment]:
    offload: list[OffloadFragment] = []
    for p, oo in r.objects(d, "offload", {"param", "state", "fragment"}, {"out_after", "back_from"}):
        frag = oo.get("fragment")
        if not (
            isinstance(frag, list)
            and len(frag) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in frag)
            and 0 <= frag[0] < frag[1]
        ):
            r.fail(f"{p}.fragment", f"expected [start, end] with 0 <= start < end; got {json.dumps(frag)}")
            frag = [0, 1]
        offload.append(
            OffloadFragment(
                param=r.typed(oo.get("param"), f"{p}.param", str, "a string") or "",
                state=r.typed(oo.get("state"), f"{p}.state", str, "a string") or "",
                fragment=(frag[0], frag[1]),
                out_after=r.typed(oo.get("out_after", "step"), f"{p}.out_after", str, "a string") or "step",
                back_from=r.typed(oo.get("back_from", "step"), f"{p}.back_from", str, "a string") or "step",
            )
        )
    return offload


def _read_rebuild_buckets(r: _Reader, d: dict) -> BucketRebuild | None:
    if d.get("rebuild_buckets") is None:
        return None
    ro = r.obj(d["rebuild_buckets"], "rebuild_buckets", set(), {"cap_bytes", "first_cap_bytes"})
    if ro is None:
        return None
    caps: dict[str, int] = {}
    for key, default in (("cap_bytes", BucketRebuild.cap_bytes), ("first_cap_bytes", BucketRebuild.first_cap_bytes)):
        what = f"a non-negative number of bytes (DDP's default: {default})"
        cap = r.count(ro.get(key, default), f"rebuild_buckets.{key}", what)
        caps[key] = default if cap is None else cap
    return BucketRebuild(**caps)


def _read_max_inflight(r: _Reader, d: dict) -> Any:
    inflight = d.get("max_inflight_buckets")
    if inflight is not None and not (isinstance(inflight, int) and not isinstance(inflight, bool) and inflight >= 0):
        r.fail("max_inflight_buckets", f"expected a non-negative integer or null; got {json.dumps(inflight)[:60]}")
        inflight = None
    return inflight


def _read_param_shapes(r: _Reader, d: dict) -> Any:
    param_shapes = d.get("param_shapes", {})
    if not isinstance(param_shapes, dict) or not all(
        isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
        for v in param_shapes.values()
    ):
        r.fail("param_shapes", f"expected an object of parameter name -> shape (a list of sizes); got {json.dumps(param_shapes)[:60]}")
        param_shapes = {}
    return param_shapes


def _check_free_form(r: _Reader, d: dict) -> None:
    """``predicted`` and ``provenance``: shallow objects; ``predicted``'s figures are numbers."""
    for key in ("predicted", "provenance"):
        if _depth(d.get(key)) > MAX_NESTING:
            r.fail(key, f"nested deeper than {MAX_NESTING} levels; a plan's {key} is a shallow object: regenerate the plan")
    for key in ("predicted", "provenance"):
        if not isinstance(d.get(key, {}), dict):
            r.fail(key, "expected a JSON object")
    predicted = d.get("predicted", {})
    if isinstance(predicted, dict):
        for key in ("step_seconds", "peak_bytes"):
            v = predicted.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                r.fail(f"predicted.{key}", f"expected a non-negative number; got {json.dumps(v)[:60]}")
        vs = predicted.get("vs", {})
        if not isinstance(vs, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vs.values()):
            r.fail("predicted.vs", f"expected an object of numbers (predicted speed-ups); got {json.dumps(vs)[:60]}")


def _read_grad_accum_steps(r: _Reader, d: dict) -> Any:
    accum = d.get("grad_accum_steps", 1)
    if isinstance(accum, bool) or not isinstance(accum, int) or not 1 <= accum <= 4096:
        r.fail("grad_accum_steps", f"expected the number of micro-batches per optimizer step (1 to 4096); got {json.dumps(accum)[:60]}")
        accum = 1
    return accum


def _check_fragments(r: _Reader, offload: list[OffloadFragment], declared: set[str]) -> None:
    """Offload fragments name optimizer state that exists, and fragments of one state are disjoint."""
    known = ", ".join(sorted(OPTIMIZER_STATES))
    spans: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
    for i, o in enumerate(offload):
        if o.state in SCALAR_OPTIMIZER_STATES and o.state not in declared:
            r.fail(f"offload[{i}].state", f"{o.state!r} is a scalar; only per-element optimizer state can be offloaded: remove this fragment")
        elif o.state not in OPTIMIZER_STATES and o.state not in declared:
            r.fail(
                f"offload[{i}].state",
                f"{o.state!r} is not state that torch's optimizers keep per element ({known}); fix the name, or, "
                "if your optimizer keeps state under it, list it in the plan's optimizer_states",
            )
        spans.setdefault((o.param, o.state), []).append((o.fragment[0], o.fragment[1], i))
    for (param, state), frags in spans.items():
        frags.sort()
        _, end, i0 = frags[0]
        for a, b, i in frags[1:]:
            if a < end:
                r.fail(
                    f"offload[{i}].fragment",
                    f"[{a}, {b}] overlaps offload[{i0}].fragment (which ends at {end}) of the same state "
                    f"({param} / {state}); make the fragments disjoint or merge them into one",
                )
            if b > end:
                end, i0 = b, i


def _depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (iteratively: a deep value cannot overflow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_NESTING:
                stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


# ------------------------------------------------------------------------------------------------
# Validation against a model.
# ------------------------------------------------------------------------------------------------


_FIX_OTHER_MODEL = (
    "this plan was probably made for a different model; regenerate it for this one "
    "(plan='auto' or `autodist plan`)"
)


def validate_plan(
    plan: Plan,
    structure: ModelStructure,
    *,
    world_size: int | None = None,
    source: str | None = None,
) -> None:
    """Raise :class:`PlanError` listing every way ``plan`` does not fit ``structure``."""
    problems = [
        *_check_header(plan, world_size),
        *_check_shard_size(plan),
        *_check_param_shapes(plan, structure),
        *_check_units(plan, structure),
        *_check_gather_groups(plan),
        *_check_prefetch_windows(plan, structure),
        *_check_buckets(plan, structure),
        *_check_bucket_accumulation(plan),
        *_check_recompute(plan, structure),
        *_check_offload(plan, structure),
        *_check_compile(plan, structure),
    ]
    if problems:
        raise PlanError(problems, source=source)


def _check_header(plan: Plan, world_size: int | None) -> list[str]:
    """The schema version is readable and the plan was made for this job's world size."""
    problems: list[str] = []
    if plan.schema_version not in SUPPORTED_SCHEMA_VERSIONS:
        problems.append(
            f"schema_version {plan.schema_version} is not supported (this autodist reads "
            f"{', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))})"
        )
    if world_size is not None and plan.world_size != world_size:
        problems.append(
            f"world_size: the plan was made for {plan.world_size} ranks but this job has {world_size}; "
            "regenerate the plan for this world size or launch with the matching --nproc_per_node"
        )
    return problems


def _check_shard_size(plan: Plan) -> list[str]:
    """Shard groups tile the world: ``shard_size`` divides ``world_size``."""
    s = plan.shard_size
    if s is None:
        return []
    if isinstance(s, bool) or not isinstance(s, int) or s < 1:
        return [f"shard_size = {s!r}: expected a positive number of ranks, or null to shard over the whole world"]
    if plan.world_size % s:
        divisors = [d for d in range(1, plan.world_size + 1) if plan.world_size % d == 0]
        return [
            f"shard_size = {s} does not divide world_size = {plan.world_size}: the ranks are split into shard "
            f"groups of shard_size ranks that replicate each other; use one of {divisors} (e.g. the ranks per "
            "node), or null to shard over the whole world"
        ]
    return []


def _check_param_shapes(plan: Plan, structure: ModelStructure) -> list[str]:
    """Parameter shapes, where the plan records them (plans from older versions do not)."""
    resized = [
        (p, plan.param_shapes[p], list(info.shape))
        for p, info in structure.params.items()
        if p in plan.param_shapes and plan.param_shapes[p] != list(info.shape)
    ]
    if not resized:
        return []
    p, theirs, ours = resized[0]
    return [
        f"param_shapes: {len(resized)} parameter(s) have other shapes in this model than in the plan (e.g. "
        f"{p!r}: {theirs} in the plan, {ours} here); the plan was made for a model of another size: regenerate "
        "it for this one (plan='auto' or `autodist plan`)"
    ]


def _check_units(plan: Plan, structure: ModelStructure) -> list[str]:
    """Units: names exist, each parameter covered exactly once, and by its own unit."""
    problems: list[str] = []
    params = structure.params
    unit_of_param = structure.unit_of_param
    seen_units: set[str] = set()
    covered: dict[str, str] = {}
    model_units = {u.name for u in structure.units}
    for i, u in enumerate(plan.units):
        if u.name in seen_units:
            problems.append(f"units[{i}] {u.name!r} appears twice; each unit must be listed once")
        seen_units.add(u.name)
        if u.name not in model_units:
            problems.append(
                f"units[{i}] {u.name!r} is not a module of this model that owns parameters; {_FIX_OTHER_MODEL}"
            )
        for p in u.params:
            if p not in params:
                problems.append(f"units[{i}] ({u.name}) names parameter {p!r}, which this model does not have; {_FIX_OTHER_MODEL}")
                continue
            if p in covered:
                problems.append(f"parameter {p!r} is listed in unit {covered[p]!r} and again in {u.name!r}; list it once")
            covered[p] = u.name
            if unit_of_param.get(p) != u.name and u.name in model_units:
                problems.append(
                    f"parameter {p!r} is owned by module unit {unit_of_param.get(p)!r}, not {u.name!r}; "
                    "move it to that unit"
                )
            if u.placement == "shard" and len(params[p].shape) == 0:
                problems.append(
                    f"parameter {p!r} is 0-dimensional and cannot be sharded on dim 0; "
                    f"make unit {u.name!r} placement 'replicate'"
                )
    for p in params:
        if p not in covered:
            problems.append(f"parameter {p!r} is not in any unit; add it to unit {unit_of_param[p]!r}")
    return problems


def _check_gather_groups(plan: Plan) -> list[str]:
    """Gather groups: only sharded units, each exactly once."""
    problems: list[str] = []
    placement = {u.name: u.placement for u in plan.units}
    residency: dict[str, str] = {}  # of the first unit of each name
    for u in plan.units:
        residency.setdefault(u.name, u.residency)
    grouped: dict[str, int] = {}
    for gi, g in enumerate(plan.gather_groups):
        if not g.units:
            problems.append(f"gather_groups[{gi}] is empty; remove it")
        for un in g.units:
            if un not in placement:
                problems.append(f"gather_groups[{gi}] names unit {un!r}, which is not in the plan's units")
            elif placement[un] != "shard":
                problems.append(
                    f"gather_groups[{gi}] names unit {un!r}, which is replicated; only sharded units are gathered"
                )
            if un in grouped:
                problems.append(f"unit {un!r} is in gather_groups[{grouped[un]}] and gather_groups[{gi}]; list it once")
            grouped[un] = gi
        res = {residency[un] for un in g.units if un in residency}
        if len(res) > 1:
            problems.append(
                f"gather_groups[{gi}] mixes residencies {sorted(res)}; units gathered together are freed together, "
                "so give them one residency or split the group"
            )
    for u in plan.units:
        if u.placement == "shard" and u.name not in grouped:
            problems.append(f"sharded unit {u.name!r} is in no gather group; add it to one")
    return problems


def _check_prefetch_windows(plan: Plan, structure: ModelStructure) -> list[str]:
    """A window counts units: one as long as the model already issues the gather before the first unit."""
    problems: list[str] = []
    n_units = len(structure.units)
    for gi, g in enumerate(plan.gather_groups):
        for direction in ("forward", "backward"):
            w = getattr(g.prefetch, direction)
            if w != "memory" and w > n_units:
                problems.append(
                    f"gather_groups[{gi}].prefetch.{direction} = {w}: a prefetch window counts units and this model "
                    f"has {n_units}; use at most {n_units} (that already issues the gather before the first unit "
                    'runs), or "memory" to prefetch as early as the budget allows'
                )
    return problems


def _check_buckets(plan: Plan, structure: ModelStructure) -> list[str]:
    """Buckets: every trainable parameter exactly once, op matching placement, one dtype per bucket."""
    problems: list[str] = []
    params = structure.params
    pplace = plan.placement_of_param
    in_bucket: dict[str, int] = {}
    for bi, b in enumerate(plan.buckets):
        if not b.params:
            problems.append(f"buckets[{bi}] is empty; remove it")
        dtypes = set()
        for p in b.params:
            if p not in params:
                problems.append(f"buckets[{bi}] names parameter {p!r}, which this model does not have; {_FIX_OTHER_MODEL}")
                continue
            if p in in_bucket:
                problems.append(f"parameter {p!r} is in buckets[{in_bucket[p]}] and buckets[{bi}]; list it once")
            in_bucket[p] = bi
            if not params[p].requires_grad:
                problems.append(f"buckets[{bi}] names frozen parameter {p!r} (requires_grad=False); remove it")
            want = OP_FOR_PLACEMENT.get(pplace.get(p, ""), None)
            if want is not None and b.op != want:
                problems.append(
                    f"buckets[{bi}] reduces {p!r} with {b.op}, but its placement is {pplace[p]!r}, which needs "
                    f"{want}; split the bucket by placement"
                )
            dtypes.add(params[p].dtype)
        if len(dtypes) > 1:
            names = ", ".join(sorted(str(t).replace("torch.", "") for t in dtypes))
            problems.append(f"buckets[{bi}] mixes dtypes {names}; split it so each bucket has one dtype")
    for p in structure.trainable:
        if p not in in_bucket:
            problems.append(f"trainable parameter {p!r} is in no bucket; add it to one (its gradient would never be reduced)")
    return problems


def _check_bucket_accumulation(plan: Plan) -> list[str]:
    """A bucket is reduced in every micro-batch or once: its sharded units accumulate alike."""
    problems: list[str] = []
    accumulate = {p: u.accumulate for u in plan.units if u.placement == "shard" for p in u.params}
    for bi, b in enumerate(plan.buckets):
        modes = {accumulate[p] for p in b.params if p in accumulate}
        if len(modes) > 1:
            problems.append(
                f"buckets[{bi}] holds parameters of units that accumulate gradients differently ({', '.join(sorted(modes))}); "
                "a bucket is reduced in every micro-batch or once: split it, or give its units one 'accumulate'"
            )
    return problems


def _check_recompute(plan: Plan, structure: ModelStructure) -> list[str]:
    """Recomputed blocks are blocks of this model."""
    blocks = set(structure.blocks)
    return [
        f"recompute[{i}] = {block!r} is not a block of this model (its blocks: "
        f"{', '.join(structure.blocks[:6])}{', ...' if len(structure.blocks) > 6 else ''}); {_FIX_OTHER_MODEL}"
        for i, block in enumerate(plan.recompute)
        if block not in blocks
    ]


def _check_compile(plan: Plan, structure: ModelStructure) -> list[str]:
    """Compiled blocks are blocks of this model whose parameters can be managed at their boundary:
    the sharded units of one block lie in one gather group (gathered and swapped in by the block's
    own hooks, outside the compiled code), and no offload copy is anchored at a unit inside one
    (the runtime sees the block's boundary only). See [Note: hooks at a compiled block's boundary]
    in autodist/runtime/compiled.py."""
    problems: list[str] = []
    blocks = set(structure.blocks)
    group_of = {un: gi for gi, g in enumerate(plan.gather_groups) for un in g.units}
    block_of = {u.name: u.block for u in structure.units}
    compiled = set(plan.compile)
    if plan.compile and plan.compile_backend not in COMPILE_BACKENDS:
        problems.append(f"compile_backend = {plan.compile_backend!r}; expected one of {', '.join(COMPILE_BACKENDS)}")
    for i, block in enumerate(plan.compile):
        if block not in blocks:
            problems.append(
                f"compile[{i}] = {block!r} is not a block of this model (its blocks: "
                f"{', '.join(structure.blocks[:6])}{', ...' if len(structure.blocks) > 6 else ''}); {_FIX_OTHER_MODEL}"
            )
            continue
        groups = sorted({group_of[u.name] for u in plan.units if block_of.get(u.name) == block and u.name in group_of})
        if len(groups) > 1:
            problems.append(
                f"compile[{i}] = {block!r}: its sharded units are split over gather_groups {groups}; a compiled block is "
                "gathered at its boundary, outside the compiled code, so put its sharded units in one gather group "
                "(or do not compile it)"
            )
    for oi, o in enumerate(plan.offload):
        for key, val in (("out_after", o.out_after), ("back_from", o.back_from)):
            unit = val.partition(":")[2]
            if block_of.get(unit) in compiled:
                problems.append(
                    f"offload[{oi}].{key} = {val!r} is inside compiled block {block_of[unit]!r}, where the runtime sees "
                    "only the block's boundary; anchor it at a unit outside compiled blocks, or at 'step'"
                )
    return problems


def _check_offload(plan: Plan, structure: ModelStructure) -> list[str]:
    """Offload fragments lie within their parameter's optimizer state and move at events of this model."""
    problems: list[str] = []
    params = structure.params
    pplace = plan.placement_of_param
    model_units = {u.name for u in structure.units}
    for oi, o in enumerate(plan.offload):
        if o.param not in params:
            problems.append(f"offload[{oi}] names parameter {o.param!r}, which this model does not have")
        else:
            limit, held = _state_elements(params[o.param], pplace.get(o.param), plan.shard_ranks)
            start, end = o.fragment
            if end > limit:
                problems.append(
                    f"offload[{oi}].fragment = [{start}, {end}] {'starts' if start >= limit else 'ends'} beyond the "
                    f"optimizer state of {o.param!r}: {held}; keep the fragment within [0, {limit}]"
                )
        for key, val, kinds in (("out_after", o.out_after, ("step", "forward")), ("back_from", o.back_from, ("step", "backward"))):
            kind, _, unit = val.partition(":")
            if kind not in kinds or (kind != "step" and unit not in model_units):
                problems.append(
                    f"offload[{oi}].{key} = {val!r}; expected 'step' or '{kinds[1]}:<unit name of this model>'"
                )
    return problems


def _state_elements(info: Any, placement: str | None, shard_ranks: int) -> tuple[int, str]:
    """How many elements of a parameter's optimizer state one rank holds at most, and why."""
    if placement == "shard" and info.shape:
        rows = info.shape[0]
        most = -(-rows // shard_ranks) * (info.numel // rows if rows else 0)
        return most, f"a rank holds at most {most} elements of it (dim-0 shards of {rows} rows over {shard_ranks} ranks)"
    return info.numel, f"it has {info.numel} elements"
