"""Per-step metrics of a wrapped model and the periodic log line (rank 0).

A step runs from one training forward to the next. ``AutoDist(..., log_every=N)`` logs every N steps
one line with step time, throughput (samples per second; tokens per second when the input is a
batch of token ids), peak memory in GiB and as a share of the budget, and the exposed-communication
share (time the compute thread spent blocked on collectives / step time). ``model.metrics()``
returns the last step's values as a dict, for the user's own logger.
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


class StepMeter:
    def __init__(self, stats: CommStats, device: torch.device, budget: int, world: int, rank: int, log_every: int | None) -> None:
        self.stats = stats
        self.meter = MemoryMeter(device)
        self.budget = budget
        self.world = world
        self.rank = rank
        self.log_every = log_every
        self.step = 0
        self.last: StepMetrics | None = None
        self._t: float | None = None
        self._batch: tuple[int, int | None] = (0, None)
        self._wait = 0.0
        self._counts = (0, 0)

    def _counts_now(self) -> tuple[int, int]:
        s = self.stats
        return s.all_gathers, s.all_reduces + s.reduce_scatters

    def on_forward(self, args: tuple, kwargs: dict) -> None:
        now = time.perf_counter()
        if self._t is not None:
            dt = now - self._t
            samples, tokens = self._batch
            g, r = self._counts_now()
            peak = self.meter.peak()
            self.step += 1
            self.last = StepMetrics(
                step=self.step,
                step_seconds=dt,
                samples_per_second=samples * self.world / dt if dt > 0 else 0.0,
                tokens_per_second=tokens * self.world / dt if tokens and dt > 0 else None,
                peak_bytes=peak,
                budget_fraction=peak / self.budget if self.budget else 0.0,
                exposed_comm_share=min(1.0, (self.stats.wait_seconds - self._wait) / dt) if dt > 0 else 0.0,
                all_gathers=g - self._counts[0],
                reductions=r - self._counts[1],
            )
            if self.log_every and self.rank == 0 and self.step % self.log_every == 0:
                m = self.last
                rate = f"{m.tokens_per_second:,.0f} tokens/s" if m.tokens_per_second else f"{m.samples_per_second:,.1f} samples/s"
                logger.info(
                    "autodist: step %d  %.1f ms  %s  peak %.2f GiB (%.0f%% of budget)  exposed comm %.0f%%",
                    m.step, 1e3 * m.step_seconds, rate, m.peak_bytes / 2**30, 100 * m.budget_fraction,
                    100 * m.exposed_comm_share,
                )
            self.meter.reset_peak()
        self._t = now
        self._batch = _batch_size(args, kwargs)
        self._wait = self.stats.wait_seconds
        self._counts = self._counts_now()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self.last) if self.last is not None else {}
