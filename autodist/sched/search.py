"""The search for ``plan="auto"`` (docs/design.md, "Search").

Seeds — the DDP, FSDP and ZeRO-2 conventions, and DeepCompile's greedy passes applied to them
(memory-aware prefetch: widen windows while the budget allows; selective unsharding: keep sharded
groups resident, cheapest communication per byte first) — then DisCo's backtracking search: a
priority queue of plans ordered by simulated step time; from the best unexplored plan, generate
children by applying 1..beta random moves (DisCo applies each move kind 0..beta times; with eleven
kinds that makes every child a large jump, and small refinements rare); keep the best; enqueue children
within ``alpha`` of the best; stop when the best has not improved for ``stall`` evaluations, after
``max_evals``, or when the time budget runs out. Plans over the memory budget never win. The random
generator is seeded and the limits count evaluations, so the same inputs give the same plan (the
time budget is a safety net and is logged when it is what stopped the search).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from dataclasses import dataclass, field, replace

from .._log import logger
from ..cost.comm import CommModel
from ..cost.fidelity import DEFAULT_MEMORY_HEADROOM, DEFAULT_SEED_MARGIN, UNDO, FidelityRecord
from ..cost.simulator import SimResult, Simulator, paused_cycle_collection
from ..plan import Plan
from .space import Genome, PlanSpace

MOVE_KINDS = (
    "bucket_merge", "bucket_split", "group_merge", "group_split", "residency", "window", "inflight", "placement",
    "offload_add", "offload_remove", "offload_shift", "recompute", "accumulate",
)
# the built-in conventions a searched plan must beat by prefer_seed_within to be chosen over them
BUILTIN_SEEDS = ("ddp", "fsdp", "zero2", "hsdp")

# toggling a block's compilation: chosen from only where the profile timed blocks compiled, so the
# moves of a search without (and so its plan, for a given seed) are as they were
COMPILE_MOVE = "compile"


@dataclass
class SearchConfig:
    """Knobs of the search itself (not of the plan). Defaults: DisCo uses alpha 1.05 and a small
    beta; 300 evaluations without improvement and 4000 in all keep a 200-unit model under ~10 s."""

    alpha: float = 1.05
    beta: int = 3
    children: int = 8
    stall: int = 300
    max_evals: int = 4000
    time_budget_s: float = 10.0
    seed: int = 0
    # The greedy passes try the gather groups one at a time up to this many groups; a model with
    # more tries them in runs of consecutive groups (in the pass's order), so that each pass makes
    # at most about this many tries: on 800 units, one at a time is 800 simulations per seed
    # (see [Note: greedy passes at scale]).
    greedy_steps: int = 32
    # A searched plan must be predicted this much faster than the fastest feasible built-in seed
    # (ddp, fsdp, zero2) to be chosen over it; plans are searched within the budget less
    # memory_headroom of it. Both are the simulator's measured error: by default what
    # tools/simcheck.py measured on the zoo models, on a machine `autodist check` has measured its
    # own (see [Note: margins from measured error] in cost/fidelity.py and for_machine). A
    # prefer_seed_within of 0 turns the preference off (the pure optimum of the model).
    prefer_seed_within: float = DEFAULT_SEED_MARGIN
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM
    margin_source: str = "the simulator's error measured by tools/simcheck.py on the zoo models"
    # the comm model's wait calibration fitted by `autodist check` on this machine (None: the one the
    # sweep set; see [Note: the wait calibration] in cost/fidelity.py and calibrated), and the
    # blocked-wait time it was fitted with
    wait_scale: float | None = None
    blocked_wait_s: float | None = None

    @classmethod
    def for_machine(cls, record: FidelityRecord | None) -> SearchConfig:
        """The search's margins from this machine's measured fidelity, else the defaults."""
        if record is None:
            return cls()
        why = record.unusable()
        if why is not None:
            logger.warning(
                "autodist: this machine's fidelity record (autodist check on %s) is not used: %s. Planning with the "
                "default margins; %s.", record.model, why, UNDO,
            )
            return cls()
        return cls(
            prefer_seed_within=record.seed_margin, memory_headroom=record.memory_headroom,
            margin_source=f"the simulator's error measured by {record.source} on {record.model} on this machine",
            wait_scale=record.wait_scale, blocked_wait_s=record.blocked_wait_s,
        )

    def calibrated(self, comm: CommModel) -> CommModel:
        """``comm`` with this machine's wait calibration, where ``autodist check`` fitted one; a
        comm model from a bandwidth and latency (``CommModel.analytic``: a link that was not
        measured here) is left as it is."""
        if self.wait_scale is None or comm.meta.get("source") == "analytic":
            return comm
        if self.blocked_wait_s is None:
            return replace(comm, wait_scale=self.wait_scale)
        return replace(comm, wait_scale=self.wait_scale, blocked_wait_s=self.blocked_wait_s)

    def planning_budget(self, budget: int | None) -> int | None:
        return None if budget is None else int(budget * (1 - self.memory_headroom))


@dataclass
class SearchResult:
    plan: Plan
    genome: Genome
    result: SimResult
    evaluated: int
    seconds: float
    seeds: dict[str, SimResult]
    stopped_by: str
    smallest_peak: tuple[int, Genome] | None = None
    smallest_peak_result: SimResult | None = None
    history: list[tuple[int, float]] = field(default_factory=list)  # (evaluation, best step time)
    # the built-in seed chosen over a searched plan predicted less than prefer_seed_within faster
    preferred_seed: str | None = None
    config: SearchConfig = field(default_factory=SearchConfig)  # what the search ran with
    refined: bool = False  # the finalists were ranked again with another simulator (Searcher.refine)
    inside_headroom: bool = False  # searched within the budget itself: nothing fitted below the headroom


class Searcher:
    def __init__(self, space: PlanSpace, simulator: Simulator, config: SearchConfig = SearchConfig()) -> None:
        self.space = space
        self.sim = simulator
        self.cfg = config
        self._memo: dict[Genome, SimResult] = {}
        self._normal: dict[Genome, Genome] = {}  # genome -> space.normalize(genome)
        self.evaluated = 0
        self.smallest_peak: tuple[int, Genome] | None = None
        self.smallest_peak_result: SimResult | None = None
        self._t0 = time.perf_counter()
        self.time_limited = False  # a time limit cut some work: the result may vary with machine load

    def _time_left(self, fraction: float) -> bool:
        """Whether less than ``fraction`` of the time budget has gone (the greedy passes stop
        refining at their share so the backtracking search keeps its own)."""
        left = time.perf_counter() - self._t0 < fraction * self.cfg.time_budget_s
        if not left:
            self.time_limited = True
        return left

    def _may_evaluate(self, g: Genome, fraction: float) -> bool:
        """Whether a greedy pass may evaluate ``g`` within its share of the time budget (one it
        evaluated before costs nothing: only a new evaluation the budget stops counts as cut)."""
        return g in self._memo or self._time_left(fraction)

    def _runs(self, groups: list[list[int]]) -> list[list[list[int]]]:
        """``groups`` in runs of consecutive groups, at most ``greedy_steps`` runs ([Note: greedy
        passes at scale])."""
        size = max(1, -(-len(groups) // max(1, self.cfg.greedy_steps)))
        return [groups[i:i + size] for i in range(0, len(groups), size)]

    def normalize(self, g: Genome) -> Genome:
        """``space.normalize(g)``, remembered: the search meets the same genomes again and again."""
        n = self._normal.get(g)
        if n is None:
            n = self._normal[g] = self.space.normalize(g)
        return n

    def evaluate(self, g: Genome) -> SimResult:
        g = self.normalize(g)
        r = self._memo.get(g)
        if r is None:
            r = self.sim.run(self.space.to_plan(g, normalized=True))
            self._memo[g] = r
            self.evaluated += 1
            if self.smallest_peak is None or r.peak_bytes < self.smallest_peak[0]:
                self.smallest_peak = (r.peak_bytes, g)
                self.smallest_peak_result = r
        return r

    def cost(self, g: Genome) -> float:
        """Simulated step time; infinite over budget. Offloading costs copies and buys only memory,
        so between equally fast plans the one that offloads less wins (a tie-breaker of 1e-12 s per
        fragment, far below any timing the simulator resolves)."""
        r = self.evaluate(g)
        return r.step_s + 1e-12 * len(g.offload) if r.feasible else math.inf

    # -- DeepCompile's greedy passes -------------------------------------------------------------
    # [Note: greedy passes at scale] Widening prefetch windows and unsharding try the gather groups
    # one at a time, each try a simulation of the whole plan: on a model of G groups a pass costs
    # G simulations of time linear in G. Past ``greedy_steps`` groups, a pass tries runs of
    # consecutive groups (in its own order: forward order for windows, communication time per byte
    # for unsharding) together, so each pass makes about ``greedy_steps`` tries whatever the model's
    # size; the backtracking search's residency and window moves then refine single groups. A
    # model of up to ``greedy_steps`` groups is searched as before. A pass stops only where a new
    # evaluation would pass its share of the time budget (a pass with nothing left to try is not
    # cut), and that is what ``Searcher.time_limited`` reports.
    def widen_windows(self, g: Genome) -> Genome:
        """Memory-aware prefetch: for each gather group in order, the widest window (forward, then
        backward) that lowers the step time and stays within the budget."""
        g = self.normalize(g)
        best = self.cost(g)
        groups = self.space.groups(g)
        # every group at once first (cheap), then group by group (in runs on a large model: [Note:
        # greedy passes at scale]) while time allows
        for w in sorted(self.space.window_choices):
            win = list(g.window)
            for members in groups:
                win[members[0]] = (w, w)
            cand = self.normalize(replace(g, window=tuple(win)))
            c = self.cost(cand)
            if c < best:
                g, best = cand, c
        for run in self._runs(groups):
            firsts = [members[0] for members in run]
            for axis in (0, 1):
                for w in sorted(self.space.window_choices):
                    win = list(g.window)
                    for first in firsts:
                        if w > win[first][axis]:
                            win[first] = (w, win[first][1]) if axis == 0 else (win[first][0], w)
                    if win == list(g.window):
                        continue
                    cand = self.normalize(replace(g, window=tuple(win)))
                    if not self._may_evaluate(cand, 0.3):
                        return g
                    c = self.cost(cand)
                    if c < best:
                        g, best = cand, c
        return g

    def unshard_selectively(self, g: Genome) -> Genome:
        """Selective unsharding: make groups persistent (no re-gather, one refresh per step), the
        ones with the most communication time per byte of memory first, while the budget allows
        and the step gets faster."""
        g = self.normalize(g)
        comm = self.sim.comm
        best = self.cost(g)
        groups = self.space.groups(g)

        def per_byte(members: list[int]) -> float:
            nbytes = sum(self.sim.full_padded_bytes[p] for i in members for p in self.space.unit_params[self.space.units[i]])
            return comm.time("all_gather", nbytes) / max(nbytes, 1)

        for run in self._runs(sorted(groups, key=per_byte, reverse=True)):
            res = list(g.residency)
            for members in run:
                for i in members:
                    res[i] = 2
            cand = self.normalize(replace(g, residency=tuple(res)))
            if not self._may_evaluate(cand, 0.45):
                break
            c = self.cost(cand)
            if c < best:
                g, best = cand, c
        return g

    def recompute_greedily(self, g: Genome) -> Genome:
        """For a plan over the budget: recompute blocks, the ones that free the most activation bytes
        per second of recomputation first, until the plan fits; then give back recomputation that is
        not needed (the least efficient first) while it still fits."""
        sp = self.space
        g = self.normalize(g)
        if self.evaluate(g).feasible or not sp.recompute_blocks:
            return g

        def efficiency(b: int) -> float:
            name = sp.recompute_blocks[b]
            return sp.block_act_bytes.get(name, 0) / max(sp.block_fwd_s.get(name, 0.0), 1e-9)

        order = sorted(set(range(len(sp.recompute_blocks))) - g.recompute, key=efficiency, reverse=True)
        chosen = set(g.recompute)
        for b in order:
            if not self._time_left(0.5):
                break
            chosen.add(b)
            if self.evaluate(sp.with_recompute(g, chosen)).feasible:
                break
        g = self.normalize(sp.with_recompute(g, chosen))
        if not self.evaluate(g).feasible:
            return g
        for b in sorted(chosen, key=efficiency):
            if not self._time_left(0.5):
                break
            cand = self.normalize(sp.with_recompute(g, chosen - {b}))
            if self.evaluate(cand).feasible:
                chosen.discard(b)
                g = cand
        return g

    def offload_adaptively(self, g: Genome) -> Genome:
        """DeepCompile's adaptive offload (its Algorithm 2, in plan terms), for a plan over the
        budget: start from the least device memory offload can give — every optimizer-state tensor
        on the host, copied back only at the step — and if that fits, give back what is not needed:
        drop fragments (smallest first: they save least) while the plan still fits, then start each
        remaining copy-back earlier in the backward (hiding the copy behind compute) while the plan
        fits and gets no slower."""
        g = self.normalize(g)
        if self.evaluate(g).feasible:
            return g
        candidates = sorted(self.space.offload_candidates(g), key=lambda c: c[2])
        for p, state, _ in candidates:
            g = self.space.with_offload(g, p, state, back_unit=-1)
        if not self.evaluate(g).feasible:
            return g  # the smallest footprint offload can reach; still over the budget
        for frag in sorted(g.offload, key=lambda f: f[3] - f[2]):
            if not self._time_left(0.5):
                break
            cand = replace(g, offload=tuple(o for o in g.offload if o != frag))
            if self.evaluate(cand).feasible:
                g = cand
        best = self.cost(g)
        for frag in list(g.offload):
            current = frag
            if not self._time_left(0.5):
                break
            for _ in range(len(self.space.units)):
                cand = self.space.shift_offload(g, current, later=False)
                moved = next(o for o in cand.offload if o[:4] == current[:4])
                c = self.cost(cand)
                if c > best or moved == current:
                    break
                g, best, current = cand, c, moved
        return g

    # -- the search --------------------------------------------------------------------------------
    def seeds(self) -> dict[str, Genome]:
        sp = self.space
        out: dict[str, Genome] = {}
        if sp.fixed is None or all(v == "replicate" for v in sp.fixed.values()):
            out["ddp"] = sp.ddp()
        if sp.fixed is None or any(v == "shard" for v in sp.fixed.values()):
            out["fsdp"] = sp.fsdp()
            out["zero2"] = sp.zero2()
            if sp.shard_sizes:  # FSDP2's HSDP: shard within a node, replicate across nodes
                out["hsdp"] = sp.hybrid(out["fsdp"], sp.shard_sizes[0])
                out["hsdp-zero2"] = sp.hybrid(out["zero2"], sp.shard_sizes[0])
        for seed in [n for n in ("fsdp", "zero2", "hsdp", "hsdp-zero2") if n in out]:
            out[f"{seed}+prefetch"] = self.widen_windows(out[seed])
            out[f"{seed}+unshard"] = self.unshard_selectively(out[f"{seed}+prefetch"])
        if sp.fixed is not None and not out:
            out["fixed"] = self.normalize(sp.ddp())
        if sp.accum_steps > 1:  # FSDP2's default: reduce-scatter in every micro-batch
            for seed in [n for n in ("fsdp", "zero2", "hsdp", "hsdp-zero2") if n in out]:
                g = out[seed]
                out[f"{seed}+sharded-accumulation"] = self.normalize(replace(g, accumulate=tuple(int(s_) for s_ in g.shard)))
        if sp.compile_blocks:  # torchtitan's recipe: every block compiled (DisCo's "fuse all"); "none" is the above
            for base in [n for n in ("ddp", "fsdp", "zero2", "fsdp+prefetch", "zero2+prefetch") if n in out]:
                out[f"{base}+compile-all"] = self.normalize(sp.with_compile(out[base], range(len(sp.compile_blocks))))
        if sp.recompute_blocks:
            every = range(len(sp.recompute_blocks))
            for name in list(out):
                if self.evaluate(out[name]).feasible:
                    continue
                # the hand-tuned choices (checkpoint every block, every other block), and the greedy pass
                out[f"{name}+recompute-all"] = self.normalize(sp.with_recompute(out[name], every))
                out[f"{name}+recompute-alternate"] = self.normalize(sp.with_recompute(out[name], every[::2]))
                out[f"{name}+recompute"] = self.recompute_greedily(out[name])
        if sp.state_names:
            for name in list(out):
                if not self.evaluate(out[name]).feasible:
                    out[f"{name}+offload"] = self.offload_adaptively(out[name])
        return out

    def run(self) -> SearchResult:
        """Seeds, greedy passes and the backtracking search (the module's docstring), with the cycle
        collector paused ([Note: the cycle collector while simulating] in cost/simulator.py: the
        plans and their programs hold no cycles)."""
        with paused_cycle_collection():
            return self._run()

    def _run(self) -> SearchResult:
        cfg = self.cfg
        rng = random.Random(cfg.seed)
        t0 = self._t0 = time.perf_counter()
        seeds = self._seeds = self.seeds()
        seed_results = {name: self.evaluate(g) for name, g in seeds.items()}
        heap: list[tuple[float, int, Genome]] = []
        tie = 0
        best_g, best_c = None, math.inf
        for g in seeds.values():
            c = self.cost(g)
            heapq.heappush(heap, (c, tie, self.normalize(g)))
            tie += 1
            if c < best_c:
                best_g, best_c = self.normalize(g), c
        expanded: set[Genome] = set()
        # the plan-wide shard group and the blocks' compilation are moves only where the space
        # offers hybrid sharding or compiled blocks (otherwise the moves are drawn as they always
        # were, and the search finds the same plans)
        kinds = (MOVE_KINDS + ((COMPILE_MOVE,) if self.space.compile_blocks else ())
                 + (("shard_size",) if self.space.shard_sizes else ()))
        since_improved = 0
        history = [(self.evaluated, best_c)]
        stopped_by = "queue exhausted"
        while heap:
            if self.evaluated >= cfg.max_evals:
                stopped_by = "evaluation limit"
                break
            if since_improved >= cfg.stall:
                stopped_by = "stall"
                break
            if time.perf_counter() - t0 > cfg.time_budget_s:
                stopped_by = "time budget"
                self.time_limited = True
                break
            c, _, g = heapq.heappop(heap)
            if g in expanded:
                continue
            expanded.add(g)
            for _ in range(cfg.children):
                # 1..beta random moves: small steps refine, larger ones escape plateaus
                child = g
                for _ in range(rng.randint(1, cfg.beta)):
                    child = self.space._move_kind(child, rng.choice(kinds), rng)
                child = self.normalize(child)
                if child in self._memo:
                    continue
                before = self.evaluated
                cc = self.cost(child)
                since_improved += self.evaluated - before
                if cc < best_c:
                    best_g, best_c = child, cc
                    since_improved = 0
                    history.append((self.evaluated, best_c))
                if cc <= cfg.alpha * best_c and cc < math.inf:
                    heapq.heappush(heap, (cc, tie, child))
                    tie += 1
        if best_g is not None and best_c < math.inf:
            # the shard group is a plan-wide decision that one random move rarely gets to try on the
            # best plan: the best plan under every shard group the space offers
            for size in (0, *self.space.shard_sizes) if self.space.shard_sizes else ():
                cand = self.normalize(replace(best_g, shard_size=size))
                c = self.cost(cand)
                if c < best_c:
                    best_g, best_c = cand, c
                    history.append((self.evaluated, best_c))
        if best_g is None or best_c == math.inf:
            best_g = self.smallest_peak[1] if self.smallest_peak else next(iter(seeds.values()))
        preferred = None
        if best_c < math.inf and cfg.prefer_seed_within > 0:
            known = [(self.cost(seeds[n]), n) for n in BUILTIN_SEEDS if n in seeds]
            known = [(c, n) for c, n in known if c < math.inf]
            if known:
                c, n = min(known)
                if c <= best_c * (1 + cfg.prefer_seed_within) and self.normalize(seeds[n]) != best_g:
                    best_g, preferred = self.normalize(seeds[n]), n
        result = self.evaluate(best_g)
        plan = self.space.to_plan(best_g)
        return SearchResult(
            plan=plan, genome=best_g, result=result, evaluated=self.evaluated,
            seconds=time.perf_counter() - t0, seeds=seed_results,
            stopped_by=stopped_by + (" (greedy passes cut by the time budget)" if self.time_limited and stopped_by != "time budget" else ""),
            smallest_peak=self.smallest_peak, smallest_peak_result=self.smallest_peak_result, history=history,
            preferred_seed=preferred, config=cfg,
        )

    def refine(self, result: SearchResult, sim: Simulator, *, finalists: int = 16) -> SearchResult:
        """Rank the search's finalists again with ``sim`` (the learned estimator's simulator, too
        slow to evaluate thousands of plans): the ``finalists`` fastest feasible plans this search
        evaluated, the plan it chose and the built-in seeds are simulated with ``sim``, and the
        fastest feasible one wins — a built-in seed still kept unless a plan beats it by more than
        ``prefer_seed_within`` (this search's margin: the analytic simulator's measured error, a
        conservative one for ``sim``). ``sim`` should have the search's budget. Call after :meth:`run`."""
        if not hasattr(self, "_seeds"):
            raise RuntimeError("Searcher.refine ranks the plans a search evaluated: call run() first")
        feasible = [(self.cost(g), i, g) for i, g in enumerate(self._memo) if math.isfinite(self.cost(g))]
        chosen = [g for _, _, g in sorted(feasible)[:finalists]]
        seeds = {name: self.normalize(g) for name, g in self._seeds.items()}
        again: dict[Genome, SimResult] = {}
        for g in [result.genome, *chosen, *seeds.values()]:
            if g not in again:
                again[g] = sim.run(self.space.to_plan(g))

        def cost(g: Genome) -> float:
            r = again[g]
            return r.step_s + 1e-12 * len(g.offload) if r.feasible else math.inf

        best = min(again, key=cost)
        preferred = None
        if math.isfinite(cost(best)) and self.cfg.prefer_seed_within > 0:
            known = [(cost(seeds[n]), n) for n in BUILTIN_SEEDS if n in seeds and math.isfinite(cost(seeds[n]))]
            if known:
                c, n = min(known)
                if c <= cost(best) * (1 + self.cfg.prefer_seed_within) and seeds[n] != best:
                    best, preferred = seeds[n], n
        if not math.isfinite(cost(best)):  # nothing feasible under ``sim``: keep the search's choice
            best = result.genome
        return replace(
            result, plan=self.space.to_plan(best), genome=best, result=again[best],
            seeds={name: again[g] for name, g in seeds.items()}, preferred_seed=preferred, refined=True,
        )
