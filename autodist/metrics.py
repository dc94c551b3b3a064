"""Per-step metrics of a wrapped model and the periodic log line (rank 0).

A step ends when an optimizer (a ``torch.optim.Optimizer``) that holds this model's parameters
finishes its ``step()``, and runs from the end of the previous step (the first step: from its first
training forward). With gradient accumulation a step spans every micro-batch before the optimizer
step, and its throughput counts all of them. With several optimizers over the model, the first
one to step after a training forward ends the step. A loop that updates the parameters without a
``torch.optim`` optimizer gets steps that end at the next synchronising training forward (the last
such step is never reported).

``AutoDist(..., log_every=N)`` logs every N steps one line with step time, throughput (samples per
second; tokens per second when the input is a batch of token ids), peak memory in GiB and as a
share of the budget, and the exposed-communication share (time the compute thread spent blocked on
collectives / step time); the last step is logged too, when the model is closed (``close()``),
garbage-collected, or at interpreter exit, whichever comes first. ``model.metrics()`` returns the
last completed step's values as a dict, for the user's own logger.

[Note: the step-end hook] The meter registers no hook of its own: the runtime already watches
optimizer steps (process-wide only until it has seen optimizers over all of the model's trainable
parameters, then on those optimizers alone; see ``Engine._watch``) and calls
:meth:`StepMeter.on_optimizer_step` after each step of an optimizer over this model's parameters.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ._log import logger
from .memory import MemoryMeter
from .runtime.comm import CommStats


@dataclass
class StepMetrics:
    step: int
    step_seconds: float
    samples_per_second: float
    tokens_per_second: float | None
    peak_bytes: int
    budget_fraction: float
    exposed_comm_share: float
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
    return (
        f"autodist: step {m.step}  {1e3 * m.step_seconds:.1f} ms  {rate}  peak {m.peak_bytes / 2**30:.2f} GiB "
        f"({100 * m.budget_fraction:.0f}% of budget)  exposed comm {100 * m.exposed_comm_share:.0f}%"
    )


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
    ) -> None:
        self.stats = stats
        self.meter = MemoryMeter(device)
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
        self.meter.reset_peak()

    def on_forward(self, args: tuple, kwargs: dict, *, sync: bool) -> None:
        """A training forward (gradients enabled); ``sync``: its backward reduces gradients."""
        now = time.perf_counter()
        if self._open and not self._optimizer_seen and self._last_forward_synced:
            self._end(now)  # no torch.optim optimizer steps this model: a synchronised forward-backward is a step
        if self._start is None:
            self._begin(now)
        self._open = True
        self._last_forward_synced = sync
        samples, tokens = _batch_size(args, kwargs)
        self._samples += samples
        self._tokens = None if tokens is None or self._tokens is None else self._tokens + tokens

    def on_optimizer_step(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer over this model's parameters finished a step (the engine tells)."""
        if not self._open:
            return
        self._optimizer_seen = True
        self._end(time.perf_counter())

    def _end(self, now: float) -> None:
        dt = now - (self._start if self._start is not None else now)
        peak = self.meter.peak()
        g, r = self._counts_now()
        self.step += 1
        self.last = StepMetrics(
            step=self.step,
            step_seconds=dt,
            samples_per_second=self._samples * self.world / dt if dt > 0 else 0.0,
            tokens_per_second=self._tokens * self.world / dt if self._tokens and dt > 0 else None,
            peak_bytes=peak,
            budget_fraction=peak / self.budget if self.budget else 0.0,
            exposed_comm_share=min(1.0, (self.stats.wait_seconds - self._wait) / dt) if dt > 0 else 0.0,
            all_gathers=g - self._counts[0],
            reductions=r - self._counts[1],
        )
        self._open = False
        if self.log_every and self.step % self.log_every == 0:
            self._log()
        self._begin(now)

    def _log(self) -> None:
        if self.rank == 0 and self.last is not None and self._logged != self.last.step:
            logger.info(format_step(self.last))
        self._logged = self.last.step if self.last is not None else 0

    def close(self) -> None:
        """Stop listening to optimizers; log the last step if ``log_every`` is set and it was not logged."""
        if self._closed:
            return
        self._closed = True
        if self.log_every:
            self._log()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self.last) if self.last is not None else {}
