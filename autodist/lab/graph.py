"""The schedule graph the learned estimator reads (``learned.py``; docs/estimator.md): a plan's
compiled step as nodes (compute sections, operations) with features and relation-wise edges, the
targets a measured step gives each node, and the durations a correction gives the simulator. The
module docstring of ``learned.py`` describes the graph, the targets and the correction.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..cost.sim.program import COMPUTE, ISSUE, WAIT
from ..cost.simulator import Program, SimResult, Simulator
from ..plan import Plan

# 2: the unit parameter features (unit_*), and targets and ln_queued relative to a 100 us floor
FEATURE_SCHEMA = 2
# The least duration a target is taken relative to (the analytic side of the ratio) and an error
# is judged against (the measured side, event_errors): 100 us. A unit's hooks alone take tens of
# microseconds on a CPU; relative errors of shorter events say little.
FLOOR_S = 1e-4
CLIP = 4.0  # targets and predictions are clipped to [-CLIP, CLIP] in log space (a factor of ~55)

SECTION_KINDS = ("forward", "fwd", "loss", "loss backward", "bwd", "backward", "optimizer")
OP_KINDS = ("all_gather", "refresh", "all_reduce", "reduce_scatter", "copy_out", "copy_back")
KINDS = SECTION_KINDS + OP_KINDS
RELATIONS = ("next", "prev", "issue", "issued", "wait", "waited", "overlap")
NUMERIC = (
    "ln_ms_analytic", "ln_ms_given", "contention", "ln_mib", "share_compute", "share_bookkeeping",
    "share_copy_out", "share_copy_in", "share_recompute", "ln_issues", "ln_waits", "waited_share",
    "overlap_gather", "overlap_reduce", "overlap_copy", "ln_mib_concurrent", "ln_ops_concurrent",
    "overlap_compute", "ln_queued", "exposed_share", "start", "end",
    "unit_ln_params", "unit_ln_mib", "unit_sharded", "unit_persistent", "unit_after_forward",
    "plan_ln_ms_step", "plan_compute_share", "plan_ln_ops",
)
FEATURES = tuple(f"kind={k}" for k in KINDS) + NUMERIC
MIB = float(1 << 20)


def _ln_ms(seconds: float) -> float:
    return math.log(max(seconds, 1e-6) * 1e3)


def _section_kind(name: str) -> str:
    base = name.split(" @m")[0]
    if base.startswith("fwd "):
        return "fwd"
    if base.startswith("bwd "):
        return "bwd"
    return base


def _op_kind(kind: str, label: str) -> str:
    return "refresh" if kind == "all_gather" and label.startswith("refresh ") else kind


def collective_name(kind: str, ident: str, occurrence: int) -> str:
    """The node name of an operation: ``"all_gather layers.0"``, ``"all_reduce bucket3 #1"`` for
    the second of its kind and ident in a step."""
    return f"{kind} {ident}" + (f" #{occurrence}" if occurrence else "")


def op_ident(kind: str, label: str) -> str:
    """What a simulated operation's runtime counterpart is called: the first unit of a gather group,
    ``bucket<i>``, or the offloaded state."""
    if kind == "all_gather":
        return label.split(" ", 1)[1]
    return label


@dataclass
class ScheduleGraph:
    """One compiled step as a graph. Per node: ``names`` (a section's name, or ``"<kind> <ident>"``
    with ``" #<n>"`` for the n-th repeat), ``kinds`` (``KINDS``), ``x`` (``FEATURES``), ``analytic_s``
    (the analytic duration, timed), ``instructions`` (a section's compute instructions, indices into
    ``program.prog``) and ``op`` (an operation's index into ``program.ops``, else -1)."""

    names: list[str]
    kinds: list[str]
    x: torch.Tensor
    edges: dict[str, torch.Tensor]
    analytic_s: torch.Tensor
    instructions: list[list[int]]
    op: list[int]
    step_s: float
    start_s: list[float] = field(default_factory=list)  # when each node starts and ends, analytically
    end_s: list[float] = field(default_factory=list)

    @property
    def num_nodes(self) -> int:
        return len(self.names)


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def schedule_graph(program: Program, analytic: SimResult) -> ScheduleGraph:
    """The graph of ``program`` timed as ``analytic`` (a ``Simulator._execute`` result with
    ``record=True``: its compute events are the program's compute instructions of positive
    duration, in order; its operations' ``start``/``end`` are set)."""
    builder = _GraphBuilder(program, analytic)
    builder.add_sections()
    builder.add_unit_features()
    builder.add_operations()
    builder.add_overlaps()
    builder.add_order()
    return builder.graph()


class _GraphBuilder:
    """:func:`schedule_graph` in stages: nodes (sections, then operations) with their feature rows,
    then the edges between them. Each stage reads what the previous ones added."""

    def __init__(self, program: Program, analytic: SimResult) -> None:
        self.program, self.analytic = program, analytic
        self.step = max(analytic.step_s, 1e-9)
        self.names: list[str] = []
        self.kinds: list[str] = []
        self.rows: list[dict[str, float]] = []
        self.instructions: list[list[int]] = []
        self.op_of: list[int] = []
        self.analytic_s: list[float] = []
        self.start_s: list[float] = []
        self.end_s: list[float] = []
        self.busy_spans: list[list[tuple[float, float]]] = []
        self.issued_by: dict[int, int] = {}
        self.waited_by: dict[int, int] = {}
        self.issue_time: dict[int, float] = {}
        self.wait_time: dict[int, float] = {}
        self.edges: dict[str, list[tuple[int, int]]] = {r: [] for r in RELATIONS}
        self.n_sections = 0
        self.span, self.at = self._replay()

    def _replay(self) -> tuple[dict[int, tuple[float, float]], list[float]]:
        """The compute thread's clock, replayed: each timed instruction's span, and when each
        instruction starts (one more entry: the end)."""

        prog, ops = self.program.prog, self.program.ops
        compute_events = iter([e for e in self.analytic.events if e.stream == "compute"])
        t = 0.0
        span: dict[int, tuple[float, float]] = {}
        at: list[float] = []
        for i, ins in enumerate(prog):
            at.append(t)
            if ins[0] == COMPUTE and ins[1] > 0:
                ev = next(compute_events)
                span[i] = (ev.start, ev.end)
                t = ev.end
            elif ins[0] == WAIT:
                t = max(t, ops[ins[1]].end)
        at.append(t)
        return span, at

    def add_sections(self) -> None:
        """One node per compute section; the preamble (a persistent refresh, a copy-out the previous
        step started) joins the first section."""
        prog = self.program.prog
        bounds = [(0 if k == 0 else i, name) for k, (i, name) in enumerate(self.program.sections)] + [(len(prog), "")]
        for (i0, name), (i1, _) in zip(bounds, bounds[1:]):
            self._add_section(i0, i1, name)
        self.n_sections = len(self.names)

    def _add_section(self, i0: int, i1: int, name: str) -> None:

        prog, at = self.program.prog, self.at
        node = len(self.names)
        parts = {"compute": 0.0, "bookkeeping": 0.0, "copy_out": 0.0, "copy_in": 0.0, "recompute": 0.0}
        mine, spans, issues, waits = [], [], 0, 0
        for i in range(i0, i1):
            ins = prog[i]
            if ins[0] == COMPUTE:
                mine.append(i)
                label = ins[2]
                part = (
                    "bookkeeping" if label == "gather bookkeeping" else "copy_out" if label == "copy-out"
                    else "copy_in" if label == "bucket copy-in" else "recompute" if label.startswith("recompute ")
                    else "compute"
                )
                parts[part] += max(ins[1], 0.0)
                if i in self.span:
                    spans.append(self.span[i])
            elif ins[0] == ISSUE:
                issues += 1
                self.issued_by.setdefault(ins[1], node)
                self.issue_time.setdefault(ins[1], at[i])
            elif ins[0] == WAIT:
                waits += 1
                if ins[1] not in self.waited_by:
                    self.waited_by[ins[1]] = node
                    self.wait_time[ins[1]] = at[i]
        given = sum(parts.values())
        busy = sum(b - a for a, b in spans)
        elapsed = at[i1] - at[i0]
        self.names.append(name)
        self.kinds.append(_section_kind(name))
        self.instructions.append(mine)
        self.op_of.append(-1)
        self.analytic_s.append(busy)
        self.start_s.append(at[i0])
        self.end_s.append(at[i1])
        self.busy_spans.append(spans)
        self.rows.append({
            "ln_ms_analytic": _ln_ms(busy), "ln_ms_given": _ln_ms(given),
            "contention": min(busy / given - 1.0, 5.0) if given > 0 else 0.0,
            **{f"share_{k}": (v / given if given > 0 else 0.0) for k, v in parts.items()},
            "ln_issues": math.log1p(issues), "ln_waits": math.log1p(waits),
            "waited_share": (elapsed - busy) / elapsed if elapsed > 0 else 0.0,
            "start": at[i0] / self.step, "end": at[i1] / self.step,
        })

    def add_unit_features(self) -> None:
        """The unit a section belongs to: its parameters and how the plan holds them."""
        program = self.program
        if program.plan is None:
            return
        units = {u.name: u for u in program.plan.units}
        for name, row in zip(self.names, self.rows):
            base = name.split(" @m")[0]
            u = units.get(base.split(" ", 1)[1]) if base.startswith(("fwd ", "bwd ")) else None
            if u is None:
                continue
            row["unit_ln_params"] = math.log1p(len(u.params))
            row["unit_ln_mib"] = math.log1p(sum(program.param_bytes.get(p, 0) for p in u.params) / MIB)
            row["unit_sharded"] = float(u.placement == "shard")
            row["unit_persistent"] = float(u.placement == "shard" and u.residency == "persistent")
            row["unit_after_forward"] = float(u.placement == "shard" and u.residency == "after_forward")

    def add_operations(self) -> None:
        """One node per operation, named by what the runtime calls it."""
        seen: dict[tuple[str, str], int] = {}
        for k, op in enumerate(self.program.ops):
            ident = op_ident(op.kind, op.label)
            n = seen.get((op.kind, ident), 0)
            seen[(op.kind, ident)] = n + 1
            self.names.append(collective_name(op.kind, ident, n))
            self.kinds.append(_op_kind(op.kind, op.label))
            self.instructions.append([])
            self.op_of.append(k)
            dur = max(op.end - op.start, 0.0)
            self.analytic_s.append(dur)
            self.start_s.append(op.start)
            self.end_s.append(op.end)
            issued = self.issue_time.get(k, op.start)
            waited = self.wait_time.get(k)
            exposed = _overlap(waited, max(waited, op.end), op.start, op.end) if waited is not None else 0.0
            self.rows.append({
                "ln_ms_analytic": _ln_ms(dur), "ln_ms_given": _ln_ms(op.seconds),
                "contention": min(dur / op.seconds - 1.0, 5.0) if op.seconds > 0 else 0.0,
                "ln_mib": math.log1p(op.nbytes / MIB),
                "ln_queued": math.log1p(max(op.start - issued, 0.0) / max(dur, FLOOR_S)),
                "exposed_share": exposed / dur if dur > 0 else 0.0,
                "start": op.start / self.step, "end": op.end / self.step,
            })

    def add_overlaps(self) -> None:
        """What runs at the same time in the analytic timeline: sections' busy spans against
        operations (features and ``overlap`` edges), and operations against each other."""
        ops, rows, n_sections = self.program.ops, self.rows, self.n_sections
        all_spans = sorted((a, b, node) for node, spans in enumerate(self.busy_spans) for a, b in spans)
        starts = [s[0] for s in all_spans]
        group = {"all_gather": "overlap_gather", "all_reduce": "overlap_reduce", "reduce_scatter": "overlap_reduce",
                 "copy_out": "overlap_copy", "copy_back": "overlap_copy"}
        concurrent_bytes = [0.0] * n_sections
        concurrent_ops = [0] * n_sections
        for k, op in enumerate(ops):
            node = n_sections + k
            if op.end <= op.start:
                continue
            covered = 0.0
            touched: set[int] = set()
            j = max(0, bisect.bisect_right(starts, op.start) - 1)
            while j < len(all_spans) and all_spans[j][0] < op.end:
                a, b, sec = all_spans[j]
                ov = _overlap(a, b, op.start, op.end)
                if ov > 0:
                    covered += ov
                    touched.add(sec)
                    row = rows[sec]
                    row[group[op.kind]] = row.get(group[op.kind], 0.0) + ov / max(self.analytic_s[sec], 1e-12)
                    concurrent_bytes[sec] += op.nbytes * ov / (op.end - op.start)
                j += 1
            rows[node]["overlap_compute"] = covered / (op.end - op.start)
            for sec in sorted(touched):
                concurrent_ops[sec] += 1
                self.edges["overlap"] += [(sec, node), (node, sec)]
        for sec in range(n_sections):
            rows[sec]["ln_mib_concurrent"] = math.log1p(concurrent_bytes[sec] / MIB)
            rows[sec]["ln_ops_concurrent"] = math.log1p(concurrent_ops[sec])
        # operations overlapping each other (a collective and an offload copy, on their two queues)
        copies = [o for o in ops if o.stream == 1]
        for k, op in enumerate(ops):
            others = [o for o in (copies if op.stream == 0 else ops) if o.stream != op.stream and _overlap(o.start, o.end, op.start, op.end) > 0]
            rows[n_sections + k]["ln_ops_concurrent"] = math.log1p(len(others))

    def add_order(self) -> None:
        """Order (the compute thread's sections; each queue's operations) and dependencies (which
        section issues an operation, which first waits for it)."""
        ops, edges, n_sections = self.program.ops, self.edges, self.n_sections
        for sec in range(1, n_sections):
            edges["next"].append((sec - 1, sec))
            edges["prev"].append((sec, sec - 1))
        for stream in (0, 1):
            queue = sorted((op.start, k) for k, op in enumerate(ops) if op.stream == stream)
            for (_, a), (_, b) in zip(queue, queue[1:]):
                edges["next"].append((n_sections + a, n_sections + b))
                edges["prev"].append((n_sections + b, n_sections + a))
        for k, sec in self.issued_by.items():
            edges["issue"].append((sec, n_sections + k))
            edges["issued"].append((n_sections + k, sec))
        for k, sec in self.waited_by.items():
            edges["wait"].append((n_sections + k, sec))
            edges["waited"].append((sec, n_sections + k))

    def graph(self) -> ScheduleGraph:
        """The nodes' features (with the plan's own on every node) and edges, as tensors."""
        analytic = self.analytic
        plan_row = {
            "plan_ln_ms_step": _ln_ms(analytic.step_s),
            "plan_compute_share": analytic.compute_s / self.step,
            "plan_ln_ops": math.log1p(len(self.program.ops)),
        }
        x = torch.zeros(len(self.names), len(FEATURES), dtype=torch.float32)
        col = {f: i for i, f in enumerate(FEATURES)}
        for i, (kind, row) in enumerate(zip(self.kinds, self.rows)):
            x[i, col[f"kind={kind}"]] = 1.0
            for key, v in {**row, **plan_row}.items():
                x[i, col[key]] = float(v)
        return ScheduleGraph(
            names=self.names, kinds=self.kinds, x=x,
            edges={r: torch.tensor(e, dtype=torch.long).reshape(-1, 2).t().contiguous() for r, e in self.edges.items()},
            analytic_s=torch.tensor(self.analytic_s, dtype=torch.float64), instructions=self.instructions, op=self.op_of,
            step_s=analytic.step_s, start_s=self.start_s, end_s=self.end_s,
        )


def graph_of(sim: Simulator, plan: Plan) -> tuple[Program, SimResult, ScheduleGraph]:
    """``plan`` compiled by ``sim``, timed analytically (whatever estimator ``sim`` has), and its graph."""
    program = sim.compile(plan)
    analytic = sim._execute(program.prog, program.ops, program.static, True)
    return program, analytic, schedule_graph(program, analytic)


def targets(graph: ScheduleGraph, measured: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, mask)``: ``log(measured / max(analytic, FLOOR_S))`` clipped to ±CLIP for the nodes
    ``measured`` names (seconds), and which nodes have one."""
    y = torch.zeros(graph.num_nodes, dtype=torch.float32)
    mask = torch.zeros(graph.num_nodes, dtype=torch.bool)
    for i, name in enumerate(graph.names):
        m = measured.get(name)
        if m is None or not math.isfinite(m):
            continue
        ratio = max(m, 1e-6) / max(float(graph.analytic_s[i]), FLOOR_S)
        y[i] = max(-CLIP, min(CLIP, math.log(ratio)))
        mask[i] = True
    return y, mask


def corrected_durations(graph: ScheduleGraph, program: Program, log_ratio: torch.Tensor, kinds: Sequence[str],
                        nodes: torch.Tensor | None = None) -> tuple[dict[int, float], list[float]]:
    """The durations to time ``program`` with: each node of a kind in ``kinds`` (and, given
    ``nodes``, a boolean per node, among those) gets ``exp(log_ratio) * max(analytic, FLOOR_S)``;
    other nodes keep theirs. With the measured targets as ``log_ratio`` and their mask as ``nodes``
    this is the *replay*: the simulator timing the durations a run measured."""

    keep = set(kinds)
    durations: dict[int, float] = {}
    op_seconds = [op.seconds for op in program.ops]
    for i in range(graph.num_nodes):
        if graph.kinds[i] not in keep or (nodes is not None and not bool(nodes[i])):
            continue
        r = math.exp(max(-CLIP, min(CLIP, float(log_ratio[i]))))
        analytic = float(graph.analytic_s[i])
        if graph.op[i] >= 0:
            k = graph.op[i]
            op_seconds[k] = program.ops[k].seconds * r if analytic >= FLOOR_S else max(program.ops[k].seconds, FLOOR_S) * r
            continue
        mine = [j for j in graph.instructions[i] if program.prog[j][0] == COMPUTE]
        if not mine:
            continue
        for j in mine:
            durations[j] = max(program.prog[j][1], 0.0) * r
        if analytic < FLOOR_S:  # too small to scale: the section takes what was predicted for FLOOR_S
            durations[mine[-1]] += r * (FLOOR_S - analytic)
    return durations, op_seconds
