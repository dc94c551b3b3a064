"""The clock a profile times units and optimizer steps with."""

from __future__ import annotations

import time
from typing import Any

import torch


class Clock:
    """CUDA events on CUDA (resolved after the pass; each mark also holds the host's wall time,
    :meth:`host_seconds`). On the CPU, with one intra-op thread (as every
    rank under torchrun computes), the thread's CPU time: it counts the computation and not the
    time the thread waited — for a core another process held, or for a collective — so a busy host
    does not inflate the profile (see [Note: timing on a noisy host] in autodist/measure/trace.py);
    with several threads, wall time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._now = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
        self._cycles_per_s: float | None = None  # CUDA: torch.cuda._sleep's cycles per second (lead)

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e, time.perf_counter()
        return self._now()

    def seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return a[0].elapsed_time(b[0]) / 1e3
        return b - a

    def lead(self, seconds: float) -> None:
        """On CUDA, hold the device for about ``seconds`` before the work issued next, so that the
        host has issued that much before the device begins it: the device's intervals are then its
        own time, not the host's pace ([Note: device and host times of a unit] in
        autodist/measure/trace.py). Elsewhere nothing."""
        if not self.cuda or seconds <= 0:
            return
        if self._cycles_per_s is None:
            self._cycles_per_s = _sleep_rate()
        torch.cuda._sleep(int(seconds * self._cycles_per_s))

    def host_view(self) -> Clock:
        """This clock read on the host's side (:meth:`host_seconds` as :meth:`seconds`)."""
        return _HostView(self)

    def host_seconds(self, a: Any, b: Any) -> float:
        """The issuing thread's wall time between two marks: on CUDA what the host took to issue the
        work between them (it runs ahead of the device where the device sets the pace, and the
        device waits for it where the host does); elsewhere :meth:`seconds`."""
        if self.cuda:
            return b[1] - a[1]
        return b - a


class _HostView(Clock):
    """A CUDA clock's marks read on the host's side."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock.device)
        self.cuda = clock.cuda

    def seconds(self, a: Any, b: Any) -> float:
        return self.host_seconds(a, b)


def _sleep_rate(cycles: int = 10_000_000) -> float:  # pragma: no cover - CUDA only
    """``torch.cuda._sleep``'s cycles per second on the current device, timed once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # the first launch loads the kernel
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end) / 1e3, 1e-6)
