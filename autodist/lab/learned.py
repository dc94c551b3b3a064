"""The learned estimator: a graph network over a compiled step that corrects the analytic durations
the simulator gets wrong (docs/design.md, "Learned estimator"; docs/estimator.md; DisCo's GNN
estimator).

**The graph** (:func:`schedule_graph`) is built from a plan's compiled program
(:meth:`Simulator.compile <autodist.cost.simulator.Simulator.compile>`) and its analytic timing,
as plain tensors (no graph library needed). Nodes are the step's actions:

* one *compute section* per hook position (``Program.sections``: the forward's start, each unit's
  forward, the loss, the loss's backward, each unit's backward with its recomputation, the end of
  backward, the optimizer step), holding every compute instruction the runtime runs there (the
  unit's computation, gather bookkeeping, receive-buffer copy-outs, bucket copy-ins);
* one node per collective and per offload copy.

Edges, by relation: ``next``/``prev`` (order on the compute thread, and on each queue), ``issue``
(a section → the operation it issues) and ``issued`` (back), ``wait`` (an operation → the section
that first waits for it) and ``waited`` (back), and ``overlap`` (a section and an operation that
run at the same time in the analytic timeline, both ways).

Node features (``FEATURES``, schema ``FEATURE_SCHEMA``): the node's kind; its analytic duration as
timed (with the comm model's contention) and as given (the profile's or the comm model's, before
contention); message bytes; what a section's time is made of (computation, bookkeeping, copies,
recomputation); how much of it the analytic timeline overlaps with gathers, reductions and copies,
and how many bytes those move; for an operation, how much compute overlaps it, how long it queued
and how much of it the compute thread waited for; for a unit's section, its parameters (how many,
how large) and how the plan holds them (sharded, persistent, freed after forward); its position in
the step; and the plan's analytic step time and compute share. Nothing names the model, so the
estimator can be used on models it never saw (and is evaluated on such: ``tools/train_estimator.py``).

**The target** of a node is ``log(measured / analytic)`` (clipped to ±``CLIP``): the wall-clock
duration a step on this machine took (``autodist/lab/steptrace.py``) over the duration the
analytic simulator gave it (at least ``FLOOR_S``, so that a section the analytic model thinks
free — the end of backward — can still be corrected).

**The correction** (:meth:`Estimator.corrections`): each node takes ``exp(prediction) *
max(analytic, FLOOR_S)`` — a compute section's instructions scaled together, an operation's
duration scaled — after which the simulator times the step again with its usual rules. Node kinds
the training data never measured keep their analytic duration.

The network (``torch_geometric``, the ``gnn`` extra) is a few relation-wise GraphSAGE layers with
residual connections and an MLP head, over features normalised by the training data's and clamped
to ``FEATURE_CLAMP`` deviations. Everything else here — the graph, the targets, the cache entry —
works without it.

**Carrying over to other models** (:func:`fit`): a correction learnt on some models can be wrong on
the next one. Before the final training, the network is trained without each training model in
turn and predicts it; the share of the correction (``SHRINK_GRID``, 0 being the analytic model)
whose worst such model's step times erred least is the share the estimator applies. Whether the
estimator is then used at all is decided on step times of models held out of everything
(``HELPS_RULE``).
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..cost.fidelity import SIMULATOR_VERSION
from ..cost.simulator import Program, SimResult, Simulator
from .graph import (
    CLIP,
    FEATURE_SCHEMA,
    FEATURES,
    FLOOR_S,
    KINDS,
    RELATIONS,
    ScheduleGraph,
    corrected_durations,
    schedule_graph,
)

# 2: shrink (the share of the correction applied), features clamped to FEATURE_CLAMP
ENTRY_SCHEMA = 2


# ------------------------------------------------------------------------------------------------
# the network (torch_geometric)
# ------------------------------------------------------------------------------------------------
def gnn_available() -> bool:
    try:
        import torch_geometric  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class NetConfig:
    """The network's shape. Defaults: three layers reach a collective's issuing, waiting and
    overlapping sections and their neighbours; 48 units are plenty for ~40 features and train in
    seconds on a CPU."""

    hidden: int = 48
    layers: int = 3
    relations: tuple[str, ...] = RELATIONS
    features: int = len(FEATURES)


def build_net(config: NetConfig) -> nn.Module:
    """The graph network (needs ``torch_geometric``: ``pip install 'autodist[gnn]'``)."""
    try:
        from torch_geometric.nn import SAGEConv
    except ImportError as e:
        raise ImportError("the learned estimator needs torch_geometric: pip install 'autodist[gnn]'") from e

    class ScheduleNet(nn.Module):
        """Relation-wise GraphSAGE (mean of neighbours per relation, summed, plus the node's own
        transform), residual, then an MLP head predicting each node's log(measured/analytic)."""

        def __init__(self) -> None:
            super().__init__()
            h = config.hidden
            self.inp = nn.Sequential(nn.Linear(config.features, h), nn.ReLU())
            self.convs = nn.ModuleList(
                nn.ModuleDict({r: SAGEConv(h, h, root_weight=False) for r in config.relations}) for _ in range(config.layers)
            )
            self.own = nn.ModuleList(nn.Linear(h, h) for _ in range(config.layers))
            self.head = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 1))

        def forward(self, x: torch.Tensor, edges: dict[str, torch.Tensor]) -> torch.Tensor:
            h = self.inp(x)
            for convs, own in zip(self.convs, self.own):
                m = own(h)
                for r, conv in convs.items():  # type: ignore[operator]  # nn.Module.__getattr__ types convs as a Tensor
                    m = m + conv(h, edges[r])
                h = h + torch.relu(m)
            return self.head(h).squeeze(-1)

    return ScheduleNet()


@dataclass
class MeasuredStep:
    """What times a sample's step again under a correction: the simulator and the program it
    compiled, and the step time measured."""

    sim: Simulator
    program: Program
    measured_s: float

    def timed(self, graph: ScheduleGraph, log_ratio: torch.Tensor | None, kinds: Sequence[str],
              nodes: torch.Tensor | None = None) -> float:
        """The step with ``log_ratio`` applied to the nodes of ``kinds`` (and ``nodes``, as
        :func:`corrected_durations` takes them); None: the analytic step. The sample's own targets
        and mask replay the durations measured."""
        from ..cost.simulator import scaled

        if log_ratio is None:  # the program's own durations (timing sets its operations' start and end: fresh copies)
            prog, ops = scaled(self.program, {}, [op.seconds for op in self.program.ops])
        else:
            prog, ops = scaled(self.program, *corrected_durations(graph, self.program, log_ratio, kinds, nodes))
        return self.sim._execute(prog, ops, self.program.static, False).step_s


@dataclass
class Sample:
    """One measured step: its graph, targets and mask, where it came from, and (``step``) what
    times it again with the step time measured."""

    graph: ScheduleGraph
    y: torch.Tensor
    mask: torch.Tensor
    model: str = ""
    plan: str = ""
    step: MeasuredStep | None = None


def _batch(graphs: Sequence[ScheduleGraph]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The disjoint union of ``graphs``: stacked features and offset edges."""
    xs: list[torch.Tensor] = []
    edges: dict[str, list[torch.Tensor]] = {r: [] for r in RELATIONS}
    offset = 0
    for g in graphs:
        xs.append(g.x)
        for r in RELATIONS:
            edges[r].append(g.edges[r] + offset)
        offset += g.num_nodes
    return torch.cat(xs), {r: torch.cat(e, dim=1) for r, e in edges.items()}


# Normalised features are clamped to this many standard deviations of the training data: a model
# the network never saw (a step ten times longer, a unit of another size) saturates the inputs
# instead of extrapolating the network linearly into corrections of a factor of fifty.
FEATURE_CLAMP = 3.0
# The shares of the network's correction that validation chooses among (:func:`fit`): 0 is the
# analytic model itself.
SHRINK_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class TrainConfig:
    """Training knobs. Adam with a little weight decay on a Huber loss in log space (robust to the
    few events a disturbed host stretched), each node weighted by ``weighting``, full batch; the
    seed fixes initialisation and order."""

    epochs: int = 400
    lr: float = 3e-3
    weight_decay: float = 1e-4
    huber_delta: float = 0.3
    seed: int = 0
    # each node's weight in the loss (:func:`_weights`): its share of the step, so that the events
    # the step time is made of count most (docs/estimator.md)
    weighting: str = "duration"
    net: NetConfig = field(default_factory=NetConfig)


@dataclass
class Trained:
    """A trained network with what it needs to be applied: its config, the feature normalisation,
    and the node kinds it was trained on (the only ones it corrects)."""

    net: nn.Module
    config: NetConfig
    mean: torch.Tensor
    std: torch.Tensor
    kinds: list[str]
    losses: list[float] = field(default_factory=list)
    # the share of the network's correction applied (chosen by :func:`fit`; 1 from :func:`train`)
    shrink: float = 1.0
    # how it was chosen: per share, each validation model's error (see :func:`fit`)
    shrink_scores: dict[str, list[float]] = field(default_factory=dict)

    def predict(self, graph: ScheduleGraph) -> torch.Tensor:
        return self.shrink * self.raw(graph)

    def raw(self, graph: ScheduleGraph) -> torch.Tensor:
        """The network's correction before ``shrink``."""
        with torch.no_grad():
            out = self.net(_normalise(graph.x, self.mean, self.std), graph.edges)
        return out.clamp(-CLIP, CLIP)


def _normalise(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return ((x - mean) / std).clamp(-FEATURE_CLAMP, FEATURE_CLAMP)


def train(samples: Sequence[Sample], config: TrainConfig | None = None) -> Trained:
    """Fit a network to ``samples`` (deterministic for a given seed and inputs)."""
    cfg = config or TrainConfig()
    if not samples:
        raise ValueError("no training samples")
    x, edges = _batch([s.graph for s in samples])
    y = torch.cat([s.y for s in samples])
    mask = torch.cat([s.mask for s in samples])
    if not mask.any():
        raise ValueError("the training samples have no measured node")
    mean = x.mean(0)
    std = x.std(0).clamp_min(1e-3)
    xn = _normalise(x, mean, std)
    kinds = sorted({s.graph.kinds[i] for s in samples for i in range(s.graph.num_nodes) if s.mask[i]})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        net = build_net(cfg.net)
        opt = torch.optim.Adam(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        loss_fn = nn.HuberLoss(delta=cfg.huber_delta, reduction="none")
        w = _weights(samples, cfg.weighting)[mask]
        losses = []
        for _ in range(cfg.epochs):
            opt.zero_grad()
            loss = (loss_fn(net(xn, edges)[mask], y[mask]) * w).sum() / w.sum()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    net.eval()
    return Trained(net, cfg.net, mean, std, kinds, losses)


WEIGHTINGS = ("duration", "events")


def _weights(samples: Sequence[Sample], weighting: str) -> torch.Tensor:
    """Each node's weight in the loss: its measured duration's share of all its step's measured
    durations (``"duration"``), or 1 (``"events"``)."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting {weighting!r} is not one of {WEIGHTINGS}")
    out = []
    for s in samples:
        if weighting == "events":
            out.append(torch.ones(s.graph.num_nodes))
            continue
        measured = s.graph.analytic_s.clamp_min(FLOOR_S).float() * s.y.exp()
        out.append(measured / max(float(measured[s.mask].sum()), 1e-12))
    return torch.cat(out)


def fit(samples: Sequence[Sample], config: TrainConfig | None = None) -> Trained:
    """:func:`train` on every sample, its correction shrunk as far as validation on models it did
    not see says. Where the samples come from two models or more, a network is first trained
    without each model in turn and predicts that model's plans; each share in ``SHRINK_GRID`` of
    those predictions is scored on each such model by the median relative error of the step times
    the simulator then gives against the measured ones, as ``HELPS_RULE`` judges the estimator
    (samples without a ``step``: the median absolute error of the events in log space). The share
    whose worst model erred least is kept, the smaller on a tie; share 0 is the analytic model. A
    network that does not carry over to unseen models so ends at share 0, and corrects nothing."""
    models = sorted({s.model for s in samples})
    scores: dict[str, list[float]] = {}
    shrink = 1.0
    if len(models) >= 2:
        residuals: dict[float, list[float]] = {a: [] for a in SHRINK_GRID}
        for m in models:
            inner = train([s for s in samples if s.model != m], config)
            held = [s for s in samples if s.model == m]
            raw = [inner.raw(s.graph) for s in held]  # once per sample, scaled for each share
            for a in SHRINK_GRID:
                residuals[a].append(_validation_error(held, raw, a, inner.kinds))
        scores = {f"{a:g}": v for a, v in residuals.items()}
        shrink = min(SHRINK_GRID, key=lambda a: (max(residuals[a]), a))
    trained = train(samples, config)
    trained.shrink = shrink
    trained.shrink_scores = scores
    return trained


def _validation_error(held: Sequence[Sample], raw: Sequence[torch.Tensor], share: float, kinds: Sequence[str]) -> float:
    """How far ``share`` of a network's corrections ``raw`` (one per sample, of ``kinds``) leaves
    ``held`` (one model's samples) from what was measured: see :func:`fit`."""
    if all(s.step is not None for s in held):
        errors = []
        for s, r in zip(held, raw):
            measured = s.step
            assert measured is not None  # every sample of ``held`` has one (checked above)
            step = measured.timed(s.graph, share * r if share else None, kinds)
            errors.append(abs(step - measured.measured_s) / measured.measured_s)
        return float(torch.tensor(errors).median()) if errors else 0.0
    err = torch.cat([(share * r[s.mask] - s.y[s.mask]).abs() for s, r in zip(held, raw)])
    return float(err.median()) if err.numel() else 0.0


# ------------------------------------------------------------------------------------------------
# the estimator the simulator uses
# ------------------------------------------------------------------------------------------------
class Estimator:
    """``Simulator(..., estimator=Estimator(trained))``: corrects each compiled step's durations
    (see :class:`autodist.cost.simulator.DurationEstimator`)."""

    def __init__(self, trained: Trained) -> None:
        self.trained = trained

    def corrections(self, program: Program, analytic: SimResult) -> tuple[dict[int, float], list[float]]:
        if self.trained.shrink == 0:  # validation kept none of the correction: the analytic durations
            return {}, [op.seconds for op in program.ops]
        graph = schedule_graph(program, analytic)
        return corrected_durations(graph, program, self.trained.predict(graph), self.trained.kinds)


# ------------------------------------------------------------------------------------------------
# evaluation
# ------------------------------------------------------------------------------------------------
def event_errors(graph: ScheduleGraph, y: torch.Tensor, mask: torch.Tensor, log_ratio: torch.Tensor | None) -> list[float]:
    """Relative errors |predicted - measured| / max(measured, FLOOR_S) of the measured nodes
    (``y`` from :func:`targets`): of the analytic durations (``log_ratio`` None) or of the corrected
    ones. Events measured shorter than ``FLOOR_S`` are judged against ``FLOOR_S``: a collective
    that completed while another ran (on the other process group) measures ~0 in one queue."""
    out = []
    for i in torch.nonzero(mask).flatten().tolist():
        analytic = float(graph.analytic_s[i])
        base = max(analytic, FLOOR_S)
        measured = base * math.exp(float(y[i]))
        predicted = analytic if log_ratio is None else base * math.exp(float(log_ratio[i]))
        out.append(abs(predicted - measured) / max(measured, FLOOR_S))
    return out


def quantile(values: Sequence[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def error_summary(errors: Sequence[float]) -> dict[str, float]:
    """Median, 90th percentile, and share within 14% (DisCo's figure: 90% of events within 14%)."""
    return {
        "events": len(errors),
        "median_pct": 100 * quantile(errors, 0.5),
        "p90_pct": 100 * quantile(errors, 0.9),
        "within_14pct": (sum(e <= 0.14 for e in errors) / len(errors)) if errors else float("nan"),
    }


# ------------------------------------------------------------------------------------------------
# the cache entry: weights, provenance, validation (stored beside the comm model, per machine)
# ------------------------------------------------------------------------------------------------
HELPS_RULE = (
    "used by plan='auto' only if, in leave-one-model-out validation, it lowered the median absolute "
    "step-time error on every held-out model and lowered no held-out model's Spearman by more than 0.05"
)


def helps(validation: dict[str, dict[str, Any]]) -> bool:
    """The rule ``plan="auto"`` applies (``HELPS_RULE``) to the held-out results ``validation``:
    model -> {"analytic": {"median_abs_pct_error_time", "spearman"}, "estimator": {...}}."""
    if not validation:
        return False
    for r in validation.values():
        a, e = r["analytic"], r["estimator"]
        if not e["median_abs_pct_error_time"] < a["median_abs_pct_error_time"]:
            return False
        if math.isfinite(a["spearman"]) and not e["spearman"] >= a["spearman"] - 0.05:
            return False
    return True


def _encode(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().to(torch.float32).contiguous()
    return {"shape": list(t.shape), "data": base64.b64encode(t.numpy().tobytes()).decode("ascii")}


def _decode(d: Any, where: str) -> torch.Tensor:
    if not isinstance(d, dict) or not isinstance(d.get("shape"), list) or not isinstance(d.get("data"), str):
        raise ValueError(f"{where} is not a tensor ({{shape, data}})")
    shape = d["shape"]
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ValueError(f"{where}.shape = {shape!r:.60} is not a list of sizes")
    raw = base64.b64decode(d["data"].encode("ascii"), validate=True)
    if len(raw) != 4 * math.prod(shape):
        raise ValueError(f"{where} holds {len(raw)} bytes, not {4 * math.prod(shape)} for shape {shape}")
    t = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape).clone()
    if not torch.isfinite(t).all():
        raise ValueError(f"{where} holds values that are not finite")
    return t


@dataclass
class EstimatorEntry:
    """What the cache stores: the trained network's weights and everything needed to apply and to
    trust it — its config, normalisation, kinds and shrink, the machine it was measured on, provenance
    (training models, plans, events, date, torch / torch_geometric versions, feature schema) and
    the held-out validation with the verdict of ``HELPS_RULE``."""

    config: NetConfig
    mean: list[float]
    std: list[float]
    kinds: list[str]
    weights: dict[str, torch.Tensor]
    shrink: float
    machine: dict[str, Any]
    provenance: dict[str, Any]
    validation: dict[str, Any]
    helps: bool
    feature_schema: int = FEATURE_SCHEMA
    schema_version: int = ENTRY_SCHEMA
    # the analytic simulator whose durations it corrects: another version's corrections are stale
    simulator: int = SIMULATOR_VERSION

    @classmethod
    def of(cls, trained: Trained, *, machine: dict[str, Any], provenance: dict[str, Any], validation: dict[str, Any]) -> EstimatorEntry:
        return cls(
            config=trained.config, mean=trained.mean.tolist(), std=trained.std.tolist(), kinds=list(trained.kinds),
            weights={k: v.detach().clone() for k, v in trained.net.state_dict().items()}, shrink=trained.shrink, machine=dict(machine),
            provenance=dict(provenance), validation=dict(validation), helps=helps(validation),
        )

    def to_json(self) -> str:
        return json.dumps({
            "schema_version": self.schema_version, "feature_schema": self.feature_schema,
            "simulator": self.simulator, "features": list(FEATURES),
            "config": {"hidden": self.config.hidden, "layers": self.config.layers, "relations": list(self.config.relations),
                       "features": self.config.features},
            "mean": self.mean, "std": self.std, "kinds": self.kinds, "shrink": self.shrink,
            "weights": {k: _encode(v) for k, v in sorted(self.weights.items())},
            "machine": self.machine, "provenance": self.provenance, "validation": self.validation,
            "helps": self.helps, "rule": HELPS_RULE,
        }, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EstimatorEntry:
        """Parse and check an entry; anything unexpected raises ``ValueError`` (or ``TypeError``)."""
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("an estimator entry is a JSON object")
        if d.get("schema_version") != ENTRY_SCHEMA:
            raise ValueError(f"estimator schema_version {d.get('schema_version')!r} is not {ENTRY_SCHEMA}")
        if d.get("simulator") != SIMULATOR_VERSION:
            raise ValueError(
                f"estimator trained against simulator version {d.get('simulator')!r}, not {SIMULATOR_VERSION}: its "
                "corrections are of durations this simulator no longer predicts (train it again: tools/train_estimator.py)"
            )
        if d.get("feature_schema") != FEATURE_SCHEMA or d.get("features") != list(FEATURES):
            raise ValueError(f"estimator features (schema {d.get('feature_schema')!r}) are not this version's ({FEATURE_SCHEMA})")
        c = d.get("config")
        if not isinstance(c, dict):
            raise ValueError("estimator config is not an object")
        for k in ("hidden", "layers", "features"):
            if not isinstance(c.get(k), int) or isinstance(c.get(k), bool) or c[k] <= 0:
                raise ValueError(f"estimator config.{k} = {c.get(k)!r} is not a positive integer")
        if c["features"] != len(FEATURES):
            raise ValueError(f"estimator config.features = {c['features']} is not {len(FEATURES)}")
        relations = c.get("relations")
        if not isinstance(relations, list) or not relations or not set(relations) <= set(RELATIONS):
            raise ValueError(f"estimator config.relations = {relations!r:.80} are not among {RELATIONS}")
        config = NetConfig(hidden=c["hidden"], layers=c["layers"], relations=tuple(relations), features=c["features"])
        vectors = {}
        for k in ("mean", "std"):
            v = d.get(k)
            if not isinstance(v, list) or len(v) != len(FEATURES) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v
            ):
                raise ValueError(f"estimator {k} is not {len(FEATURES)} finite numbers")
            vectors[k] = [float(x) for x in v]
        if min(vectors["std"]) <= 0:
            raise ValueError("estimator std has a value that is not positive")
        kinds = d.get("kinds")
        if not isinstance(kinds, list) or not set(kinds) <= set(KINDS):
            raise ValueError(f"estimator kinds = {kinds!r:.80} are not among {KINDS}")
        shrink = d.get("shrink")
        if not isinstance(shrink, (int, float)) or isinstance(shrink, bool) or not 0.0 <= shrink <= 1.0:
            raise ValueError(f"estimator shrink = {shrink!r:.40} is not a number from 0 to 1")
        w = d.get("weights")
        if not isinstance(w, dict) or not w:
            raise ValueError("estimator weights are missing")
        weights = {k: _decode(v, f"estimator weights.{k}") for k, v in w.items()}
        for k in ("machine", "provenance", "validation"):
            if not isinstance(d.get(k), dict):
                raise ValueError(f"estimator {k} is not an object")
        if not isinstance(d.get("helps"), bool):
            raise ValueError(f"estimator helps = {d.get('helps')!r} is not true or false")
        return cls(
            config=config, mean=vectors["mean"], std=vectors["std"], kinds=kinds, weights=weights, shrink=float(shrink), machine=d["machine"],
            provenance=d["provenance"], validation=d["validation"], helps=d["helps"],
        )

    def trained(self) -> Trained:
        """The network with these weights (needs torch_geometric). Weights that do not fit the
        network this config builds raise ``ValueError``."""
        net = build_net(self.config)
        try:
            net.load_state_dict(self.weights, strict=True)
        except RuntimeError as e:
            raise ValueError(f"estimator weights do not fit its network: {' '.join(str(e).split())[:200]}") from e
        net.eval()
        return Trained(net, self.config, torch.tensor(self.mean), torch.tensor(self.std), list(self.kinds), shrink=self.shrink)


def estimator_entry(text: str, machine: dict[str, Any]) -> tuple[EstimatorEntry, Estimator | None]:
    """A cached estimator entry checked for this machine (``machine``: world, backend, device_name),
    and the estimator built from it where torch_geometric is installed (else None). The cache's
    parser: anything wrong raises, so the entry is reported once and ignored."""
    entry = EstimatorEntry.from_json(text)
    here = {k: machine[k] for k in ("world", "backend", "device_name")}
    there = {k: entry.machine.get(k) for k in here}
    if there != here:
        raise ValueError(f"estimator measured on {there}, not {here}")
    return entry, Estimator(entry.trained()) if gnn_available() else None
