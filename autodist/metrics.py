"""Per-step metrics of a wrapped model and the periodic log line (rank 0).

A step ends when an optimizer (a ``torch.optim.Optimizer``) that holds this model's parameters
finishes its ``step()``, and runs from the end of the previous step (the first step: from its first
training forward). With gradient accumulation a step spans every micro-batch before the optimizer
step, and its throughput counts all of them. With several optimizers over the model, the first
one to step after a training forward ends the step. A loop that updates the parameters without a
``torch.optim`` optimizer gets steps that end at the next synchronising training forward (the last
such step is never reported).

``AutoDist(..., log_every=N)`` logs every N steps one line with step time, throughput (samples per
second; tokens per second when the input is a batch of token ids), peak tensor memory and its share
of the budget, resident memory, and the exposed-communication share (time the compute
thread spent blocked on collectives / step time; on CUDA not measured, ``None``: waiting for an
NCCL collective makes the compute stream wait and returns at once, so the thread's blocked time
reads about 0 whatever the device waited); the last step is logged too, when the model is
closed (``close()``), garbage-collected, or at interpreter exit, whichever comes first.
``model.metrics()`` returns the last completed step's values as a dict, for the user's own logger.

Memory (see [Note: what peak memory means] in ``autodist/measure/memory.py``): ``peak_bytes`` is tensor
memory, measured on step ``peak_step`` (CUDA: every step; CPU: with ``log_every`` set, steps 1, 2,
4, 8, ...; without it, never: ``None``); ``peak_scope`` says whether it is that step's own peak or, on CUDA without ``log_every``,
the process's peak so far (the allocator's counter is reset only when per-step figures are asked
for, so a ``torch.cuda.max_memory_allocated`` of the user's is never clobbered otherwise).
``host_state_bytes`` is the optimizer state offloaded to host memory, measured from the buffers that
hold it; on the CPU, where host and device are one pool, it is part of ``peak_bytes`` and
``budget_fraction`` compares the peak without it (what the device would hold) with the budget.
``resident_bytes`` is the process's resident set (torch alone is about 0.5 GiB of it), read when
the step is logged or its metrics are asked for, not at every step: reading it costs a system call
and a parse, which a step of small layers feels. A measured peak above the budget logs one warning
per model.

[Note: the step-end hook] The meter registers no hook of its own: the runtime already watches
optimizer steps (process-wide only until it has seen optimizers over all of the model's trainable
parameters, then on those optimizers alone; see ``watch`` in autodist/runtime/optimizers.py) and calls
:meth:`StepMeter.on_optimizer_step` after each step of an optimizer over this model's parameters.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ._log import OnceLogger, announce
from .cost.budget import format_bytes
from .measure.memory import PeakReading, TensorPeakProbe, resident_bytes, storage_bytes
from .runtime.comm import CommStats


@dataclass
class StepMetrics:
    step: int
    step_seconds: float
    samples_per_second: float
    tokens_per_second: float | None
    peak_bytes: int | None  # tensor memory (see the module docstring)
    peak_step: int | None  # the step it was measured on
    peak_scope: str | None  # "step" | "process"
    host_state_bytes: int  # optimizer state offloaded to host memory (its buffers)
    budget_bytes: int
    budget_fraction: float | None  # (peak, less host-resident state on the CPU) / budget
    resident_bytes: int | None  # the process's resident set (None until read: see the module docstring)
    exposed_comm_share: float | None  # None on CUDA (see the module docstring)
    all_gathers: int
    reductions: int


def _batch_size(args: tuple, kwargs: dict) -> tuple[int, int | None]:
    """(samples, tokens or None) of one rank's batch: the first tensor's leading dimension; tokens
    when it is an integer tensor of shape (batch, sequence)."""
    for x in tree_flatten((args, kwargs))[0]:
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            tokens = x.shape[0] * x.shape[1] if x.dim() == 2 and not x.is_floating_point() else None
            return x.shape[0], tokens
    return 0, None


def format_step(m: StepMetrics) -> str:
    """The log line of one step."""
    rate = f"{m.tokens_per_second:,.0f} tokens/s" if m.tokens_per_second else f"{m.samples_per_second:,.1f} samples/s"
    if m.peak_bytes is None:
        peak = "peak tensors not measured"
    else:
        where = "" if m.peak_step == m.step else f" at step {m.peak_step}"
        scope = ", process peak" if m.peak_scope == "process" else ""
        host = f"; {format_bytes(m.host_state_bytes)} of it optimizer state on the host" if m.host_state_bytes else ""
        share = (
            f"{100 * m.budget_fraction:.0f}% of budget" if m.budget_fraction is not None
            else f"budget {format_bytes(m.budget_bytes)}"  # a zero budget has no fraction
        )
        peak = f"peak tensors {format_bytes(m.peak_bytes)}{where} ({share}{scope}{host})"
    resident = "not read" if m.resident_bytes is None else format_bytes(m.resident_bytes)
    exposed = "not measured" if m.exposed_comm_share is None else f"{100 * m.exposed_comm_share:.0f}%"
    return (
        f"autodist: step {m.step}  {1e3 * m.step_seconds:.1f} ms  {rate}  {peak}  resident {resident}  "
        f"exposed comm {exposed}"
    )


def _with_resident(m: StepMetrics) -> StepMetrics:
    """``m``, with the resident set read now if it was not yet."""
    if m.resident_bytes is None:
        m.resident_bytes = resident_bytes()
    return m


class StepMeter:
    """Measures the steps of one wrapped model (see the module docstring for what a step is)."""

    def __init__(
        self,
        stats: CommStats,
        device: torch.device,
        budget: int,
        world: int,
        rank: int,
        log_every: int | None,
        *,
        live: Callable[[], Iterable[torch.Tensor]] = tuple,
        host_state: Callable[[], Iterable[torch.Tensor]] = tuple,
        predicted_peak: Callable[[], int | None] = lambda: None,
    ) -> None:
        """``live``: the tensors the model holds between steps (parameters, gradients, buffers; the
        optimizers' state is added here); ``host_state``: the buffers of offloaded optimizer state;
        ``predicted_peak``: the plan's prediction, for the warning."""
        self.stats = stats
        self.device = device
        # per-step figures were asked for: the allocator's peak counter may be reset at each step
        self.probe = TensorPeakProbe(device, reset=log_every is not None)
        self.live = live
        self.host_state = host_state
        self.predicted_peak = predicted_peak
        self.optimizers: weakref.WeakSet = weakref.WeakSet()
        self.once = OnceLogger()
        self.peak: PeakReading | None = None
        self.peak_step: int | None = None
        self.budget = budget
        self.world = world
        self.rank = rank
        self.log_every = log_every
        self.step = 0
        self.last: StepMetrics | None = None
        self._logged = 0  # the last step logged
        self._start: float | None = None  # when the current step began; None before the first forward
        self._open = False  # a training forward ran since the last step ended
        self._optimizer_seen = False
        self._last_forward_synced = False
        self._samples = 0
        self._tokens: int | None = 0
        self._wait = 0.0
        self._counts = (0, 0)
        self._closed = False

    def _counts_now(self) -> tuple[int, int]:
        s = self.stats
        return s.all_gathers, s.all_reduces + s.reduce_scatters

    def _begin(self, now: float) -> None:
        self._start = now
        self._samples, self._tokens = 0, 0
        self._wait = self.stats.wait_seconds
        self._counts = self._counts_now()

    def _measured(self, step: int) -> bool:
        """Whether step ``step``'s tensor peak is measured: every step on CUDA; on the CPU, where it
        costs two profiled steps (see ``autodist/measure/memory.py``) and a profiler session the user's own
        profiler cannot start during, only when per-step figures were asked for (``log_every``):
        steps 1, 2, 4, 8, ..."""
        if self.device.type == "cuda":
            return True
        return bool(self.log_every) and step & (step - 1) == 0

    def _recorded(self, step: int) -> bool:
        """Whether step ``step`` runs under the probe: the measured steps, and on the CPU the step
        before each (so the measured step sees the frees of what it allocated)."""
        return self._measured(step) or (self.device.type == "cpu" and self._measured(step + 1))

    def _live(self) -> list[torch.Tensor]:
        state = [t for opt in list(self.optimizers) for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
        return [t for t in (*self.live(), *state) if t is not None]

    def on_forward(self, args: tuple, kwargs: dict, *, sync: bool, joins: bool = False) -> None:
        """A training forward (gradients enabled); ``sync``: its backward reduces gradients;
        ``joins``: it joins the step of the forward before it, whose backward has not run (its
        samples count; it ends no step)."""
        now = time.perf_counter()
        if self._open and not self._optimizer_seen and self._last_forward_synced and not joins:
            self._end(now)  # no torch.optim optimizer steps this model: a synchronised forward-backward is a step
        if self._start is None:
            self._begin(now)
        if not self._open and not self._closed and self._recorded(self.step + 1):
            self.probe.start(self._live)  # the step's memory window opens at its first forward
        self._open = True
        self._last_forward_synced = sync
        samples, tokens = _batch_size(args, kwargs)
        self._samples += samples
        self._tokens = None if tokens is None or self._tokens is None else self._tokens + tokens

    def on_optimizer_step(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer over this model's parameters finished a step (the engine tells)."""
        if not self._open:
            return
        self.optimizers.add(opt)
        self._optimizer_seen = True
        self._end(time.perf_counter())

    def _end(self, now: float) -> None:
        dt = now - (self._start if self._start is not None else now)
        g, r = self._counts_now()
        self.step += 1
        reading = self.probe.stop()
        if not self._measured(self.step):
            reading = None  # recorded only so that the next step's figure is right
        if reading is not None:
            self.peak, self.peak_step = reading, self.step
        host = storage_bytes(self.host_state())
        peak = self.peak.nbytes if self.peak is not None else None
        # on the CPU the offloaded state is in the same pool: the device's share is the peak without it
        on_device = None if peak is None else peak - (host if self.device.type == "cpu" else 0)
        self.last = StepMetrics(
            step=self.step,
            step_seconds=dt,
            samples_per_second=self._samples * self.world / dt if dt > 0 else 0.0,
            tokens_per_second=self._tokens * self.world / dt if self._tokens and dt > 0 else None,
            peak_bytes=peak,
            peak_step=self.peak_step,
            peak_scope=self.peak.scope if self.peak is not None else None,
            host_state_bytes=host,
            budget_bytes=self.budget,
            budget_fraction=on_device / self.budget if on_device is not None and self.budget else None,
            resident_bytes=None,
            exposed_comm_share=None if self.device.type == "cuda" else (
                min(1.0, (self.stats.wait_seconds - self._wait) / dt) if dt > 0 else 0.0),
            all_gathers=g - self._counts[0],
            reductions=r - self._counts[1],
        )
        if reading is not None and reading.new_high and on_device is not None and on_device > self.budget:
            predicted = self.predicted_peak()
            self.once.warning(
                "over budget",
                "autodist: measured peak tensor memory %s at step %d on rank %d is above the budget %s (%s%s%s). "
                "To fit: a smaller batch, more ranks, or a plan that shards or offloads more (plan='auto' plans "
                "within memory_limit)",
                format_bytes(on_device), self.step, self.rank, format_bytes(self.budget),
                f"{100 * on_device / self.budget:.0f}%" if self.budget > 0 else "no budget at all",
                "; the process's peak so far" if reading.scope == "process" else "",
                f"; the plan predicted {format_bytes(predicted)}" if predicted else "",
            )
        self._open = False
        if self.log_every and self.step % self.log_every == 0:
            self._log()
        self._begin(now)

    def _log(self) -> None:
        last = self.last
        if self.rank == 0 and last is not None and self._logged != last.step:
            announce("%s", format_step(_with_resident(last)))
        self._logged = last.step if last is not None else 0

    def close(self) -> None:
        """Stop listening to optimizers; log the last step if ``log_every`` is set and it was not logged."""
        if self._closed:
            return
        self._closed = True
        self.probe.stop()
        if self.log_every:
            self._log()

    def abandon(self) -> None:
        """Stop listening without logging anything more: training ended at a fatal error, and a
        step line after it would read as if training went on."""
        self._closed = True
        self.log_every = None
        self.probe.stop()

    def as_dict(self) -> dict[str, Any]:
        return asdict(_with_resident(self.last)) if self.last is not None else {}
