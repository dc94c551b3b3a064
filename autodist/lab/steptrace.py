"""Measure training steps of a wrapped model the way the simulator describes them: the wall-clock
time of each section of the compute thread (``"forward"``, ``"fwd <unit>"``, ``"loss"``, ``"loss
backward"``, ``"bwd <unit>"``, ``"backward"``, ``"optimizer"``: the names of
``autodist.cost.simulator.Program.sections``) and the duration of each collective. The learned
estimator (``autodist/lab/learned.py``) trains on these; ``tools/collect_timelines.py`` collects them.

[Note: measured sections] A section is what the compute thread does from one hook position to the
next, as the simulator's program cuts it: a unit's forward section starts *before* AutoDist's own
pre-forward hook (its gather waits and prefetch issues belong to it), a unit's backward section
before AutoDist's pre-backward hook; time between sections is attributed as the profile attributes
it (``autodist.measure.trace._attribute``: glue after a unit belongs to it; the tail after the last
unit is the loss's). Each section counts wall-clock time minus the time the thread was blocked in a
collective's ``wait()`` — the simulator models those waits itself, from the collectives' durations.
Wall clock, not the profile's thread CPU time (see [Note: timing on a noisy host] in trace.py): the
estimator predicts what a step takes, and on a CPU host compute is slowed precisely by the
communication threads that take its cores — thread time would hide that. Thread CPU time is kept
beside it (``thread``) to tell contention from computation.

A collective's duration is the simulator's: from when it could start — issued, and the previous
collective done (one queue) — to when the backend completed it (``CollectiveTiming``: the
backend's completion callback, or the end of a wait that blocked; a collective without a callback,
gloo's list reduce-scatter, that completed before anyone waited is found done at the next mark,
so its completion is known to within one section). Copies of offloaded state are not measured
(their waits count in the sections where they block).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from ..measure.clock import Clock
from ..measure.trace import _attribute, _Pass
from ..runtime.backward import in_backward
from ..runtime.comm import CollectiveTiming, CommStats
from ..structure import ModelStructure

_Mark = tuple[float, float, float]  # (perf_counter, cumulative collective wait seconds, thread CPU time)


class _Busy(Clock):
    """Seconds between two of the tracer's marks (taken on the host), less the time spent blocked on
    collectives: a clock :func:`~autodist.measure.trace._attribute` reads marks with."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def seconds(self, a: _Mark, b: _Mark) -> float:
        return max(0.0, (b[0] - a[0]) - (b[1] - a[1]))


class _Thread(_Busy):
    """The thread's CPU time between two of the tracer's marks."""

    def seconds(self, a: _Mark, b: _Mark) -> float:
        return b[2] - a[2]


@dataclass
class StepMeasurement:
    """One step on one rank: section -> seconds (wall minus waits, and thread CPU), the collectives
    as ``(kind, ident, occurrence)`` -> seconds, and the step's wall-clock time."""

    sections: dict[str, float]
    thread: dict[str, float]
    collectives: dict[tuple[str, str, int], float]
    step_s: float
    waits_s: float
    raw: list[dict[str, Any]] = field(default_factory=list)  # the collectives as recorded, relative to the step start


def collective_key(label: str) -> tuple[str, str]:
    """``("all_gather", first unit)`` or ``(kind, "bucket<i>")`` from a runtime label such as
    ``"all_gather(layers.0..layers.3)"`` or ``"reduce_scatter(bucket2)"``."""
    kind, _, rest = label.partition("(")
    ident = rest.rstrip(")")
    if kind == "all_gather":
        ident = ident.split("..")[0]
    return kind, ident


def collective_durations(timings: list[CollectiveTiming]) -> dict[tuple[str, str, int], float]:
    """Each collective's duration in one queue, in issue order: from ``max(issued, the previous ones'
    completion)`` to its completion (zero when it completed before those, on its own process group)."""
    out: dict[tuple[str, str, int], float] = {}
    seen: dict[tuple[str, str], int] = {}
    free_at = -float("inf")
    for t in sorted(timings, key=lambda t: t.issued):
        if t.done is None:
            continue
        key = collective_key(t.label)
        n = seen.get(key, 0)
        seen[key] = n + 1
        start = max(t.issued, free_at)
        out[(*key, n)] = max(0.0, t.done - start)
        free_at = max(free_at, t.done)
    return out


class StepTracer:
    """Hooks on a wrapped model's units that cut each step into the simulator's sections.

    Call, per step: :meth:`begin` (before the model's forward), :meth:`forward_end` with the loss,
    the backward, :meth:`optimizer_start` / :meth:`optimizer_end` around the optimizer step, then
    :meth:`finish`. Collective timing is turned on in ``stats`` while the tracer lives."""

    def __init__(self, module: nn.Module, structure: ModelStructure, stats: CommStats) -> None:
        self.stats = stats
        self.units = [u.name for u in structure.units]
        if stats.timeline is None:
            stats.timeline = []
        self._handles: list[Any] = []
        for u in structure.units:
            sub = module.get_submodule(u.module_name)
            self._handles.append(sub.register_forward_pre_hook(self._enter(u.name), prepend=True))
            self._handles.append(sub.register_forward_hook(self._arm_backward(u.name), prepend=True))
            self._handles.append(sub.register_forward_hook(self._exit(u.name), always_call=True))
        self._pass = _Pass()
        self._marks: dict[str, _Mark] = {}
        self._opt_index = 0  # the first collective of the current step in stats.timeline
        self._poll_from = 0  # collectives before this one need no polling
        self._step_collectives: list[CollectiveTiming] = []

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.stats.timeline = None

    def _mark(self) -> _Mark:
        now = time.perf_counter()
        self._poll(now)
        return (now, self.stats.wait_seconds, time.thread_time())

    def _poll(self, now: float) -> None:
        """Collectives without a completion callback: completed by ``now`` if their work says so."""
        timeline = self.stats.timeline or []
        while self._poll_from < len(timeline) and timeline[self._poll_from].work is None:
            self._poll_from += 1
        for t in timeline[self._poll_from :]:
            if t.work is not None and t.work.is_completed():
                t.completed(now)

    # -- hooks -----------------------------------------------------------------------------------
    def _enter(self, unit: str):
        def hook(module: nn.Module, args: tuple) -> None:
            if not in_backward():  # a recomputation belongs to the backward section it runs in
                self._pass.fwd.append((self._mark(), "enter", unit))

        return hook

    def _exit(self, unit: str):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if not in_backward():
                self._pass.fwd.append((self._mark(), "exit", unit))

        return hook

    def _arm_backward(self, unit: str):
        """Registered before AutoDist's own post-forward hook, so this unit's pre-backward mark is
        taken before AutoDist's pre-backward hook runs (see [Note: measured sections])."""

        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if in_backward() or not torch.is_grad_enabled():
                return
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, self._pre_backward(unit), mode="any")

        return hook

    def _pre_backward(self, unit: str):
        def hook(grads: object) -> None:
            if unit not in self._pass.pre_seen:
                self._pass.pre_seen.add(unit)
                self._pass.bwd.append((self._mark(), "pre", unit))

        return hook

    # -- one step --------------------------------------------------------------------------------
    def begin(self) -> None:
        self._pass = _Pass()
        self._marks = {"start": self._mark()}

    def forward_end(self, loss: torch.Tensor) -> None:
        """The loss is computed. Its gradient hook queues the mark that ends the units' backward:
        queued first, it runs before AutoDist's end-of-backward callback (the flush)."""
        self._marks["forward_end"] = self._mark()

        def units_done() -> None:
            self._marks["units_end"] = self._mark()

        def on_loss_grad(grad: torch.Tensor) -> None:
            torch.autograd.Variable._execution_engine.queue_callback(units_done)

        if loss.requires_grad:
            loss.register_hook(on_loss_grad)

    def optimizer_start(self) -> None:
        self._marks["backward_end"] = self._mark()
        timeline = self.stats.timeline or []
        self._step_collectives = timeline[self._opt_index :]
        self._opt_index = len(timeline)
        self._marks["optimizer_start"] = self._mark()

    def optimizer_end(self) -> None:
        self._marks["optimizer_end"] = self._mark()

    def finish(self) -> StepMeasurement:
        """This step's measurement. Its collectives are those issued from the previous step's
        optimizer step up to this one's (a persistent refresh, at this step's forward start, among them)."""
        m = self._marks
        units_end = m.get("units_end", m["backward_end"])
        sections: dict[str, float] = {}
        thread: dict[str, float] = {}
        for clock, out in ((_Busy(), sections), (_Thread(), thread)):
            attr = _attribute(self._pass, clock, m["start"], m["forward_end"], units_end, self.units)
            out["forward"] = attr["pre_fwd"]
            out["loss"] = attr["post_fwd"]
            out["loss backward"] = attr["pre_bwd"]
            for u in self.units:
                if any(kind == "enter" and x == u for _, kind, x in self._pass.fwd):
                    out[f"fwd {u}"] = attr["fwd"][u]
                if u in self._pass.pre_seen:
                    out[f"bwd {u}"] = attr["bwd"][u]
            out["backward"] = clock.seconds(units_end, m["backward_end"])
            out["optimizer"] = clock.seconds(m["optimizer_start"], m["optimizer_end"])
        t0 = m["start"][0]
        raw = [
            {"label": t.label, "bytes": t.nbytes, "issued": t.issued - t0, "done": None if t.done is None else t.done - t0}
            for t in self._step_collectives
        ]
        return StepMeasurement(
            sections=sections, thread=thread, collectives=collective_durations(self._step_collectives),
            step_s=m["optimizer_end"][0] - t0, waits_s=m["optimizer_end"][1] - m["start"][1], raw=raw,
        )
