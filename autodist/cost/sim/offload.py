"""Offload copies in a compiled step (``autodist/runtime/offload.py``): each offloaded optimizer-state
tensor is copied out after the optimizer step (or when a forward unit begins) and back before the
next step (or when a backward unit begins), on the copy queue, at the anchors
:func:`~autodist.schedule.offload_anchors` gives ([Note: offload anchors] in autodist/schedule.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...plan import Plan
from ...schedule import StateKey, offload_anchors
from .program import ISSUE, MEM, OPTIMIZER, WAIT, CommOp, ProgramBuilder

if TYPE_CHECKING:
    from ..simulator import Simulator


class OffloadCopies:
    """The plan's offloaded state tensors, their state (``"resident"``, ``"out"``: copying out,
    ``"offloaded"``, ``"back"``: copying back) and the managed bytes at each sync point
    (``log``: what ``SimResult.offload_log`` reports)."""

    def __init__(self, sim: Simulator, plan: Plan, out: ProgramBuilder) -> None:
        self.sim = sim
        self.out = out
        anchors = offload_anchors(plan.offload)
        placement = {p: u.placement for u in plan.units for p in u.params}
        self.entries = self._entries(anchors.ranges, placement)
        # a fragment of a parameter the model does not have is not simulated
        self.out_at = {a: [k for k in keys if k in self.entries] for a, keys in anchors.out_at.items()}
        self.back_at = {a: [k for k in keys if k in self.entries] for a, keys in anchors.back_at.items()}
        self.state = {k: "resident" for k in self.entries}
        self.copy_ops: dict[StateKey, int] = {}
        self.log: list[tuple[str, int]] = []
        self.managed = sum(n for n, _ in self.entries.values())

    def _entries(self, ranges: dict[StateKey, list[tuple[int, int]]],
                 placement: dict[str, str]) -> dict[StateKey, tuple[int, int]]:
        """(param, state) -> (bytes of the local state tensor on rank 0, bytes offloaded)."""
        sim = self.sim
        result = {}
        for key, given in ranges.items():
            p = key[0]
            if p not in sim.numel:
                continue
            numel = sim._local_numel(p) if placement.get(p) == "shard" else sim.numel[p]
            merged: list[list[int]] = []
            for a, b in sorted((max(0, a), min(b, numel)) for a, b in given):
                if a >= b:
                    continue
                if merged and a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            item = sim.itemsize[p]
            result[key] = (numel * item, sum(b - a for a, b in merged) * item)
        return result

    def copy_out(self, keys: list[StateKey]) -> None:
        out, comm = self.out, self.sim.comm
        started = False
        for k in keys:
            if self.state.get(k) != "resident":
                continue
            n, r = self.entries[k]
            kept = n - r
            out.emit((MEM, kept, OPTIMIZER))
            self.managed += kept
            # the kept part goes to a fresh buffer (runtime/offload.py copy_out): its pages are new
            secs = comm.time("d2h", r) + comm.memcpy(kept) + comm.first_touch_s(kept)
            self.copy_ops[k] = out.add_op(CommOp("copy_out", f"{k[0]}/{k[1]}", r, secs, 0, end_bytes=-n, stream=1))
            out.emit((ISSUE, self.copy_ops[k]))
            self.state[k] = "out"
            out.log.add("copy_out", f"{k[0]}/{k[1]}")
            started = True
        if started:
            self.log.append(("copy-out start", self.managed))

    def finish_out(self) -> None:
        released = False
        for k, st in self.state.items():
            if st == "out":
                self.out.emit((WAIT, self.copy_ops[k]))
                self.managed -= self.entries[k][0]
                self.state[k] = "offloaded"
                released = True
        if released:
            self.log.append(("copy-out done", self.managed))

    def copy_back(self, keys: list[StateKey]) -> None:
        self.finish_out()
        out, comm = self.out, self.sim.comm
        started = False
        for k in keys:
            if self.state.get(k) != "offloaded":
                continue
            n, r = self.entries[k]
            out.emit((MEM, n, OPTIMIZER))
            self.managed += n
            # the whole tensor's storage is allocated again and written (copy_back): fresh pages
            secs = comm.time("h2d", r) + comm.memcpy(n - r) + comm.first_touch_s(n)
            self.copy_ops[k] = out.add_op(CommOp("copy_back", f"{k[0]}/{k[1]}", r, secs, 0, end_bytes=0, stream=1))
            out.emit((ISSUE, self.copy_ops[k]))
            self.state[k] = "back"
            out.log.add("copy_back", f"{k[0]}/{k[1]}")
            started = True
        if started:
            self.log.append(("copy-back start", self.managed))

    def finish_back(self) -> None:
        """The sync point before the optimizer step: every offloaded tensor is back (those whose
        copy-back no backward unit started are copied back now)."""
        late = [k for k, st in self.state.items() if st in ("out", "offloaded")]
        if late:
            self.copy_back(late)
        done = False
        for k, st in self.state.items():
            if st == "back":
                self.out.emit((WAIT, self.copy_ops[k]))
                kept = self.entries[k][0] - self.entries[k][1]
                self.out.emit((MEM, -kept, OPTIMIZER))
                self.managed -= kept
                self.state[k] = "resident"
                done = True
        if done:
            self.log.append(("copy-back done", self.managed))
