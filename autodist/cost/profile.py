"""What was measured about one model and input signature, as plain data (docs/design.md, "Profile
and comm model").

A profile is measured on one device without communication, so it does not depend on the plan: the
simulator combines it with a plan and a comm model. Times are per step on this rank's batch.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

# Raised whenever what a profile holds changes (what each schema added: docs/CHANGELOG.md). Profiles
# of the readable schemas load with the newer fields at their defaults (no contention sensitivity,
# no block saving after its last unit), as the committed records hold them; the cache measures a
# model of an older schema again.
PROFILE_SCHEMA_VERSION = 10
READABLE_PROFILE_SCHEMAS = (3, 4, 5, 6, 7, 8, 9, 10)


@dataclass
class UnitProfile:
    """One unit, in forward order.

    ``fwd_s``/``bwd_s``: compute time attributed to the unit (glue between units goes to the unit
    that ran last). ``act_bytes``: tensors saved for backward while the unit ran (parameters
    excluded), alive from the end of its forward to the end of its backward. ``out_bytes``: its
    outputs. ``fwd_peak_bytes``/``bwd_peak_bytes``: transient memory above what was live when the
    segment started. ``ready``: parameters whose gradients became ready during its backward.
    """

    name: str
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    act_bytes: int = 0
    out_bytes: int = 0
    fwd_peak_bytes: int = 0
    bwd_peak_bytes: int = 0
    ready: list[str] = field(default_factory=list)
    # whether the unit's forward receives a tensor that requires grad (then the end of its backward is
    # signalled by its inputs' gradients; else by its parameters' — see runtime/backward.py)
    input_requires_grad: bool = True
    # on an asynchronous device (CUDA): the host's time to issue the unit's forward and backward
    # ([Note: device and host times of a unit] in autodist/measure/trace.py); 0 on the CPU, whose
    # ``fwd_s``/``bwd_s`` count the issuing already
    fwd_host_s: float = 0.0
    bwd_host_s: float = 0.0


@dataclass
class OptimizerProfile:
    """The optimizer step: ``step_s = fixed_s + per_tensor_s * tensors + per_byte_s * bytes`` over
    the local parameters it updates; ``state_factor`` bytes of state per parameter byte (Adam 2,
    SGD with momentum 1). ``measured``: from the user's optimizer (False: the Adam assumption).
    ``dtensor_refused``: it cannot step DTensor parameters at all (a plan shards nothing);
    ``shard_refused``: it cannot step sharded ones (the units holding what it trains stay
    replicated; autodist/runtime/optimizers.py [Note: optimizers DTensor cannot step])."""

    kind: str = "Adam"
    state_factor: float = 2.0
    state_names: list[str] = field(default_factory=lambda: ["exp_avg", "exp_avg_sq"])
    transient_factor: float = 1.0  # temporary bytes during the step per parameter byte
    fixed_s: float = 0.0
    per_tensor_s: float = 0.0
    per_byte_s: float = 0.0
    measured: bool = False
    dtensor_refused: bool = False
    shard_refused: bool = False

    def step_seconds(self, tensors: int, nbytes: int) -> float:
        return self.fixed_s + self.per_tensor_s * tensors + self.per_byte_s * nbytes


@dataclass
class CompiledBlockProfile:
    """One block (``structure.blocks``) timed alone on the inputs it got in the profiled forward,
    compiled (``fwd_s``/``bwd_s``: ``torch.compile`` with the profile's ``compile_backend``) and
    eager (``eager_fwd_s``/``eager_bwd_s``), on the same clock as the units. ``compile_s``: the
    one-off wall time of compiling it (its first compiled forward and backward less a later one);
    about 0 for a block that reuses the code compiled for an identical block before it
    (``same_as``)."""

    fwd_s: float
    bwd_s: float
    eager_fwd_s: float
    eager_bwd_s: float
    compile_s: float = 0.0
    same_as: str = ""  # the earlier block of the same class, parameter shapes and input signature
    # on an asynchronous device: the host's time to issue the compiled and the eager block (0: not
    # measured, on the CPU, whose times count the issuing)
    host_fwd_s: float = 0.0
    host_bwd_s: float = 0.0
    eager_host_fwd_s: float = 0.0
    eager_host_bwd_s: float = 0.0

    @property
    def fwd_scale(self) -> float:
        """Compiled over eager forward time (the factor the simulator scales the block's units by)."""
        return self.fwd_s / self.eager_fwd_s if self.eager_fwd_s > 0 else 1.0

    @property
    def bwd_scale(self) -> float:
        return self.bwd_s / self.eager_bwd_s if self.eager_bwd_s > 0 else 1.0

    @property
    def host_fwd_scale(self) -> float:
        """Compiled over eager time to issue the forward (the device's ratio where not measured)."""
        return self.host_fwd_s / self.eager_host_fwd_s if self.host_fwd_s > 0 and self.eager_host_fwd_s > 0 else self.fwd_scale

    @property
    def host_bwd_scale(self) -> float:
        return self.host_bwd_s / self.eager_host_bwd_s if self.host_bwd_s > 0 and self.eager_host_bwd_s > 0 else self.bwd_scale


@dataclass
class Profile:
    units: list[UnitProfile]
    ready_order: list[str]
    pre_fwd_s: float = 0.0  # before the first unit (e.g. input handling in the root forward)
    post_fwd_s: float = 0.0  # after the last unit, including the loss
    pre_bwd_s: float = 0.0  # backward before the first unit's (the loss's backward)
    post_bwd_s: float = 0.0
    # on an asynchronous device: the host's time to issue the three above (see UnitProfile.fwd_host_s)
    pre_fwd_host_s: float = 0.0
    post_fwd_host_s: float = 0.0
    pre_bwd_host_s: float = 0.0
    batch_signature: str = ""
    device: str = "cpu"
    optimizer: OptimizerProfile = field(default_factory=OptimizerProfile)
    site_after: dict[str, str] = field(default_factory=dict)  # module reusing others' params -> unit it follows
    # The loss (everything between the model's forward and the first unit's backward): bytes it
    # saves for backward, and the transient peaks of its forward and backward above what was live.
    # ``loss_source`` "measured" (the real loss ran) or "estimated" (profiled with a surrogate loss
    # at wrap time: sized as a cross-entropy on the model's floating-point outputs, see
    # :func:`estimated_loss_memory`).
    loss_act_bytes: int = 0
    loss_fwd_peak_bytes: int = 0
    loss_bwd_peak_bytes: int = 0
    loss_source: str = "measured"
    # Activation checkpointing the model does itself: each unit whose forward ran again during
    # backward, and the unit whose backward was running then (its *anchor*; "" = the start of
    # backward). Its times and bytes above were measured as they are: with the recomputation.
    recompute_anchor: dict[str, str] = field(default_factory=dict)
    # per block (structure.blocks): bytes of the tensors its forward takes as inputs (what a
    # recomputed block keeps from its forward to its backward)
    block_input_bytes: dict[str, int] = field(default_factory=dict)
    # blocks whose forward saves a tensor for backward after its last unit has finished (a residual
    # block's final ReLU): recomputed, such a block runs again before any of its units' backward
    # begins (autodist/schedule.py [Note: where a recomputation begins])
    block_tail_saves: list[str] = field(default_factory=list)
    # micro-batches per optimizer step observed while profiling (1 when not observed)
    grad_accum_steps: int = 1
    # how many times longer this model's forward and backward take, in wall-clock time, while a
    # train of collectives runs on every rank (None: not measured; the simulator then uses the comm
    # model's figures for a reference computation; see [Note: the model's own contention] in
    # autodist/measure/contention.py)
    contended_slowdown: float | None = None
    # how many times more that is than the slowdown of the comm sweep's reference computation under
    # the same train, measured in the same rounds: what the simulator scales the sweep's compute
    # slowdowns by (None: not measured; see [Note: the model's own contention])
    contention_sensitivity: float | None = None
    # CUDA: bytes the caching allocator holds for the math libraries' workspaces once the model has
    # run forward and backward (cuBLAS/cuBLASLt keep one per thread handle and stream; 0 on the CPU;
    # see [Note: what the allocator holds for libraries] in autodist/measure/unit_memory.py)
    library_bytes: int = 0
    # blocks timed compiled and eager (``profile_model(compile_backend=...)``; empty: not measured,
    # the simulator then times a compiled block as eager, its gradients still ready at its end)
    compiled_blocks: dict[str, CompiledBlockProfile] = field(default_factory=dict)
    compile_backend: str = ""
    # modules the user compiled already (``torch.compile``d or ``.compile()``d): measured as they run
    user_compiled: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    schema_version: int = PROFILE_SCHEMA_VERSION

    def unit(self, name: str) -> UnitProfile:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)

    @property
    def compute_s(self) -> float:
        """Forward + backward compute of one step, without the optimizer."""
        return (
            self.pre_fwd_s + self.post_fwd_s + self.pre_bwd_s + self.post_bwd_s
            + sum(u.fwd_s + u.bwd_s for u in self.units)
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if d.get("schema_version") not in READABLE_PROFILE_SCHEMAS:
            raise ValueError(f"profile schema_version {d.get('schema_version')!r} is not one of {READABLE_PROFILE_SCHEMAS}")
        d = dict(d)
        # written until simulator version 8, which found every gradient written into fresh memory
        # ([Note: gradients are fresh memory] in autodist/cost/sim/reductions.py): nothing to read
        d.pop("fresh_gradients", None)
        d["units"] = [UnitProfile(**u) for u in d["units"]]
        d["optimizer"] = OptimizerProfile(**d.get("optimizer", {}))
        d["compiled_blocks"] = {b: CompiledBlockProfile(**c) for b, c in d.get("compiled_blocks", {}).items()}
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        return cls.from_dict(json.loads(text))


def estimated_loss_memory(output_fp32_bytes: int) -> tuple[int, int, int]:
    """(saved, forward peak, backward peak) bytes of a loss AutoDist has not seen, sized as
    ``cross_entropy`` on outputs of ``output_fp32_bytes`` bytes in float32 (the common and the
    largest case: logits): it saves its log-softmax (1x) and its backward holds the gradients of
    the log-softmax and of the logits at once (2x). A smaller loss (a mean, MSE on a few outputs)
    only makes the estimate cautious."""
    return output_fp32_bytes, 0, 2 * output_fp32_bytes


def slowest(profiles: list[Profile]) -> Profile:
    """One profile for all ranks: each time and size the largest any rank measured (the slowest
    rank sets the step time). Orders come from the first."""
    base = profiles[0]
    out = Profile.from_json(base.to_json())
    for other in profiles[1:]:
        by_name = {u.name: u for u in other.units}
        for u in out.units:
            o = by_name.get(u.name)
            if o is None:
                continue
            u.fwd_s, u.bwd_s = max(u.fwd_s, o.fwd_s), max(u.bwd_s, o.bwd_s)
            u.fwd_host_s, u.bwd_host_s = max(u.fwd_host_s, o.fwd_host_s), max(u.bwd_host_s, o.bwd_host_s)
            u.act_bytes = max(u.act_bytes, o.act_bytes)
            u.fwd_peak_bytes = max(u.fwd_peak_bytes, o.fwd_peak_bytes)
            u.bwd_peak_bytes = max(u.bwd_peak_bytes, o.bwd_peak_bytes)
        for key in (
            "pre_fwd_s", "post_fwd_s", "pre_bwd_s", "post_bwd_s", "loss_act_bytes", "loss_fwd_peak_bytes", "loss_bwd_peak_bytes",
            "library_bytes", "pre_fwd_host_s", "post_fwd_host_s", "pre_bwd_host_s",
        ):
            setattr(out, key, max(getattr(out, key), getattr(other, key)))
        out.optimizer.per_byte_s = max(out.optimizer.per_byte_s, other.optimizer.per_byte_s)
        for b, n in other.block_input_bytes.items():
            out.block_input_bytes[b] = max(out.block_input_bytes.get(b, 0), n)
        out.optimizer.per_tensor_s = max(out.optimizer.per_tensor_s, other.optimizer.per_tensor_s)
        for b, c in out.compiled_blocks.items():
            theirs = other.compiled_blocks.get(b)
            if theirs is not None:
                for key in ("fwd_s", "bwd_s", "eager_fwd_s", "eager_bwd_s", "compile_s", "host_fwd_s", "host_bwd_s",
                            "eager_host_fwd_s", "eager_host_bwd_s"):
                    setattr(c, key, max(getattr(c, key), getattr(theirs, key)))
        for key in ("contended_slowdown", "contention_sensitivity"):
            if getattr(other, key) is not None:
                setattr(out, key, max(getattr(out, key) or 0.0, getattr(other, key)))
    return out


def typical(profiles: list[Profile]) -> Profile:
    """One profile from several of the same model taken at different times: each time the median
    of the profiles' (a host whose speed drifts: see [Note: a host whose speed drifts] in
    ``autodist/measure/fidelity.py``). Sizes, orders and everything else come from the first."""
    base = profiles[0]
    out = Profile.from_json(base.to_json())
    units = [{u.name: u for u in p.units} for p in profiles]
    for u in out.units:
        seen = [by[u.name] for by in units if u.name in by]
        u.fwd_s = statistics.median(x.fwd_s for x in seen)
        u.bwd_s = statistics.median(x.bwd_s for x in seen)
        # host times: over the profiles that kept them (a CUDA profile whose host waited for the
        # device keeps none: [Note: device and host times of a unit])
        u.fwd_host_s = _median_of_measured([x.fwd_host_s for x in seen])
        u.bwd_host_s = _median_of_measured([x.bwd_host_s for x in seen])
    for key in ("pre_fwd_s", "post_fwd_s", "pre_bwd_s", "post_bwd_s"):
        setattr(out, key, statistics.median(getattr(p, key) for p in profiles))
    for key in ("pre_fwd_host_s", "post_fwd_host_s", "pre_bwd_host_s"):
        setattr(out, key, _median_of_measured([getattr(p, key) for p in profiles]))
    for key in ("per_tensor_s", "per_byte_s", "fixed_s"):
        setattr(out.optimizer, key, statistics.median(getattr(p.optimizer, key) for p in profiles))
    for key in ("contended_slowdown", "contention_sensitivity"):
        measured = [getattr(p, key) for p in profiles if getattr(p, key) is not None]
        setattr(out, key, statistics.median(measured) if measured else None)
    out.meta = dict(out.meta, profiles=len(profiles))
    return out


def _median_of_measured(values: list[float]) -> float:
    """The median of the values that were measured (nonzero); 0 where none was."""
    measured = [v for v in values if v > 0]
    return statistics.median(measured) if measured else 0.0


def static_profile(structure: Any) -> Profile:
    """A profile with no compute time and no activations: what a plan needs before any input is
    seen (its parameters, gathered copies, gradients and optimizer state), for a check at wrap
    time. Assumes Adam's state (two tensors per parameter), as a profile does before the
    optimizer is seen."""
    units = []
    ready_order = list(reversed(structure.trainable))
    unit_of = structure.unit_of_param
    for u in reversed(structure.units):
        units.append(UnitProfile(u.name, ready=[p for p in ready_order if unit_of[p] == u.name]))
    return Profile(units=list(reversed(units)), ready_order=ready_order, meta={"source": "static (no activations)"})
