"""The clock a profile times units and optimizer steps with."""

from __future__ import annotations

import time
from typing import Any

import torch


class Clock:
    """CUDA events on CUDA (resolved after the pass). On the CPU, with one intra-op thread (as every
    rank under torchrun computes), the thread's CPU time: it counts the computation and not the
    time the thread waited — for a core another process held, or for a collective — so a busy host
    does not inflate the profile (see [Note: timing on a noisy host] in autodist/measure/trace.py);
    with several threads, wall time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._now = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return self._now()

    def seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a
