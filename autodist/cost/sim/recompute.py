"""Recomputation in a compiled step: the plan's recomputed blocks and the model's own checkpointing,
where each is recomputed in backward (its *anchor*: [Note: where a recomputation begins] in
``autodist/schedule.py``), and what a recomputation costs and gathers there."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...plan import Plan
from ...schedule import TriggerCursor, backward_positions, block_anchor
from .gathers import Gathers
from .program import ACTIVATIONS, COMPUTE, MEM, ProgramBuilder

if TYPE_CHECKING:
    from ..simulator import Simulator

Recomputations = tuple[list[str], list[str]]  # (units gathered for a recomputation, blocks recomputed)


class Recomputation:
    """Where each recomputation happens: ``before[a]`` / ``after[a]`` are what is recomputed at
    unit ``a``'s backward, before it runs and after it has ended; ``need`` each unit's backward
    prefetch position (a recomputed unit's is its anchor's)."""

    def __init__(self, sim: Simulator, plan: Plan, out: ProgramBuilder, gathers: Gathers, bstart: Sequence[str]) -> None:
        self.sim = sim
        self.out = out
        self.gathers = gathers
        prof = sim.profile
        self.blocks = sim._recomputed_blocks(plan)
        recomputed = self.blocks
        tail = set(prof.block_tail_saves)
        anchors = {b: block_anchor(units, sim.module_of, bstart if b in tail else None) for b, units in recomputed.items()}
        anchor_of: dict[str, str] = {}  # unit -> the unit whose backward first needs it again
        for u, a in prof.recompute_anchor.items():
            if u in sim.uses:
                anchor_of[u] = a if a in sim.uses else bstart[0]
        after_anchor: set[str] = set()  # recomputed once the anchor's backward has ended
        for b, units in recomputed.items():
            for u in units:
                anchor_of[u] = anchors[b]
            if b in tail and anchors[b] not in units:
                after_anchor.update(units)
        # anchor -> (units gathered for a recomputation there, the plan's blocks recomputed there),
        # before the anchor's own backward and after it has ended
        self.before: dict[str, Recomputations] = {}
        self.after: dict[str, Recomputations] = {}
        for u, a in anchor_of.items():
            (self.after if u in after_anchor else self.before).setdefault(a, ([], []))[0].append(u)
        for b, units in recomputed.items():
            (self.after if units[0] in after_anchor else self.before).setdefault(anchors[b], ([], []))[1].append(b)
        self.block_first = {units[0]: b for b, units in recomputed.items()}  # forward: where its input is kept
        self.block_last_bwd = {units[0]: b for b, units in recomputed.items()}
        self.in_recomputed = {u for units in recomputed.values() for u in units}
        self.need = backward_positions(sim.order, anchor_of, gathers.gathering, sim.module_of, backward=bstart)

    def run(self, at: dict[str, Recomputations], u: str, cursor: TriggerCursor) -> None:
        """Recomputations at unit ``u``'s backward (``at``: :attr:`before` or :attr:`after`): each
        recomputed unit's forward runs again and needs its parameters (the runtime's recomputed
        forward fires prefetch at its anchor); a block the plan recomputes costs its units'
        forward again."""
        units, blocks = at.get(u, ([], []))
        sim, out = self.sim, self.out
        logged: set[str] = set()
        for r in units:
            compiled = sim.compiled_unit_block.get(r)
            if compiled is None:
                out.log.add("recompute", r)
            elif compiled not in logged:  # the runtime sees the block's one site, named by its last unit
                logged.add(compiled)
                out.log.add("recompute", [x for x in sim.order if sim.compiled_unit_block.get(x) == compiled][-1])
            self.gathers.ensure_owners(sim.uses[r])
            self.gathers.fire(cursor, self.need[r])
        for b in blocks:
            ups = [sim.uprof[x] for x in self.blocks[b] if x in sim.uprof]
            out.emit((COMPUTE, sum(x.fwd_s for x in ups), f"recompute {b}", max((x.fwd_peak_bytes for x in ups), default=0),
                      0.0, sum(x.fwd_host_s for x in ups)))
            out.emit((MEM, sum(x.act_bytes for x in ups), ACTIVATIONS))
