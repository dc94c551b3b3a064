"""The plan space the search walks: a compact *genome* per plan, conversion to :class:`Plan`, seeds,
random plans and moves.

A genome fixes every decision over two orders measured by the profile: units in forward order and
trainable parameters in gradient-ready order.

* ``shard[i]`` — unit *i* is sharded (else replicated);
* ``residency[i]`` — its residency (0 ``after_forward``, 1 ``after_backward``, 2 ``persistent``);
  every unit of a gather group takes its group's first unit's residency;
* ``group_start`` — indices of sharded units that start a new gather group (groups are runs of
  consecutive sharded units in forward order);
* ``window[i]`` — forward and backward prefetch window of the group that unit *i* starts;
* ``bucket_start`` — positions in the ready order that start a new bucket (a change of op or dtype
  always starts one);
* ``inflight`` — ``max_inflight_buckets`` (-1: no limit);
* ``offload`` — offloaded state as (parameter, state, start, end, back_from unit index): whole state
  tensors, [0, what a rank holds under the placement] (``normalize`` keeps the extent with it);
* ``recompute`` — indices of recomputed blocks (``PlanSpace.blocks``: the model's blocks in forward
  order, less those the model already checkpoints itself);
* ``accumulate`` — per unit, 1 if a sharded unit accumulates sharded gradients over micro-batches
  (reduced in every micro-batch), 0 if unsharded ones (reduced once); every unit of a gather group
  takes its group's first unit's value, and only matters when a step has several micro-batches.
* ``shard_size`` — over how many ranks the sharded units are split, a plan-wide decision (0: the
  whole world; else one of ``PlanSpace.shard_sizes``, e.g. the ranks of one node: hybrid sharding,
  replicated across the groups). A space without ``shard_sizes`` (one node) never changes it;
* ``compile`` — indices of compiled blocks (``PlanSpace.compile_blocks``: the blocks the profile
  timed compiled); a compiled block's sharded units form one gather group (``normalize`` merges
  them, or drops the block when a replicated unit splits them) and no offload copy is anchored
  inside it (moved to the step).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from random import Random

from ..builtins import ddp_plan, fsdp_plan, zero2_plan
from ..cost.profile import Profile
from ..plan import Bucket, GatherGroup, OffloadFragment, Plan, Prefetch, UnitPlan, Window
from ..structure import ModelStructure

RESIDENCIES = ("after_forward", "after_backward", "persistent")
MEMORY_WINDOW = -1  # a window of "memory" (resolved by the simulator, see autodist/sched/search.py)
INFLIGHT_CHOICES = (-1, 0, 1, 2)


@dataclass(frozen=True)
class Genome:
    shard: tuple[bool, ...]
    residency: tuple[int, ...]
    group_start: frozenset[int]
    window: tuple[tuple[int, int], ...]
    bucket_start: frozenset[int]
    inflight: int = -1
    offload: tuple[tuple[str, str, int, int, int], ...] = ()
    recompute: frozenset[int] = frozenset()
    accumulate: tuple[int, ...] = ()
    shard_size: int = 0
    compile: frozenset[int] = frozenset()


def _clamp_window(w: int, n_units: int) -> int:
    """A window gene of at most ``n_units`` (``MEMORY_WINDOW`` stays)."""
    return w if w == MEMORY_WINDOW else min(w, n_units)


def _window_gene(w: Window) -> int:
    """A plan's prefetch window as a gene (``"memory"``: ``MEMORY_WINDOW``)."""
    return MEMORY_WINDOW if w == "memory" else int(w)


class PlanSpace:
    """Genomes for one model and world size, given the measured orders."""

    def __init__(
        self,
        structure: ModelStructure,
        world_size: int,
        unit_order: Sequence[str],
        ready_order: Sequence[str],
        *,
        fixed_placement: dict[str, str] | None = None,
        state_names: Sequence[str] = (),
        grad_accum_steps: int = 1,
        user_recomputed: Sequence[str] = (),
        block_act_bytes: dict[str, int] | None = None,
        block_fwd_s: dict[str, float] | None = None,
        shard_sizes: Sequence[int] = (),
        compile_blocks: Sequence[str] = (),
        compile_backend: str = "inductor",
        required_shard_size: int = 0,
        replicated_units: Sequence[str] = (),
    ) -> None:
        """``shard_sizes``: the shard groups smaller than the world a plan may shard over (hybrid
        sharding; each divides the world; none: only the whole world). ``required_shard_size``: the
        shard groups every plan runs on (the user's 2-D mesh or ``shard_size``; 0: none required):
        a plan sharding anything shards over them, and one sharding nothing carries them too, so
        that the runtime can switch between any two plans of the space. ``state_names``: the optimizer's per-parameter state tensors (offload candidates; none:
        no offload moves). ``grad_accum_steps``: micro-batches per step. ``user_recomputed``: units
        the model recomputes itself (their blocks are not recomputed again). ``block_act_bytes`` /
        ``block_fwd_s``: what recomputing each block saves and costs (for the greedy pass).
        ``compile_blocks``: blocks that may be compiled with ``compile_backend`` (none: no compile
        moves). ``replicated_units``: units no plan may shard (the optimizer cannot step them as
        shards: autodist/runtime/optimizers.py [Note: optimizers DTensor cannot step])."""
        self.structure = structure
        self.state_names = tuple(state_names)
        self.world = world_size
        known = set(unit_order)
        self.units = list(unit_order) + [u.name for u in structure.units if u.name not in known]
        self.index = {u: i for i, u in enumerate(self.units)}
        self.unit_params = {u.name: list(u.params) for u in structure.units}
        trainable = structure.trainable
        seen = set(ready_order)
        self.ready = [p for p in ready_order if p in set(trainable)] + [p for p in reversed(trainable) if p not in seen]
        unit_of = self.unit_of_param = structure.unit_of_param
        self.fingerprint = structure.fingerprint()
        self.unit_of_ready = [self.index[unit_of[p]] for p in self.ready]
        self.ready_nbytes = [structure.params[p].nbytes for p in self.ready]
        self.ready_dtype = [structure.params[p].dtype for p in self.ready]
        kept = set(replicated_units)
        self.shardable = tuple(
            u not in kept and all(len(structure.params[p].shape) > 0 for p in self.unit_params[u]) for u in self.units
        )
        self.fixed = fixed_placement  # placement can no longer change (the user holds the parameters)
        # the values moves choose from (a search over a small space can narrow them)
        # (a window counts units: one longer than the model is refused by the plan's validation)
        self.window_choices: tuple[int, ...] = tuple(w for w in (0, 1, 2, 3) if w <= len(self.units))
        self.inflight_choices: tuple[int, ...] = INFLIGHT_CHOICES
        self.blocks = [next((u.block for u in structure.units if u.name == name), None) for name in self.units]
        self.accum_steps = max(1, grad_accum_steps)
        skip = {u.block for u in structure.units if u.name in set(user_recomputed)}
        self.recompute_blocks = [b for b in dict.fromkeys(x for x in self.blocks if x is not None) if b not in skip]
        self.block_act_bytes = dict(block_act_bytes or {})
        self.block_fwd_s = dict(block_fwd_s or {})
        self.shard_sizes: tuple[int, ...] = tuple(sorted({
            int(x) for x in shard_sizes if 1 < x < world_size and world_size % x == 0}))
        if required_shard_size and (not 1 <= required_shard_size < world_size or world_size % required_shard_size):
            raise ValueError(f"required_shard_size {required_shard_size} does not split {world_size} ranks into groups")
        self.required_shard_size = required_shard_size
        self.compile_blocks = [b for b in dict.fromkeys(x for x in self.blocks if x is not None) if b in set(compile_blocks)]
        self.compile_backend = compile_backend
        self.block_unit_index = {b: [i for i, x in enumerate(self.blocks) if x == b] for b in self.compile_blocks}

    # ---- conversion ------------------------------------------------------------------------
    def normalize(self, g: Genome) -> Genome:
        """Enforce invariants: fixed/unshardable placement, group starts only on sharded units
        (and on the first sharded unit of every run), one residency per group, offloaded state
        as large as the placement makes it."""
        shard = list(g.shard)
        for i, u in enumerate(self.units):
            if not self.shardable[i]:
                shard[i] = False
            if self.fixed is not None:
                shard[i] = self.fixed[u] == "shard"
        starts = set()
        prev_sharded = False
        for i, s in enumerate(shard):
            if s and (not prev_sharded or i in g.group_start):
                starts.add(i)
            prev_sharded = s
        compiled = self._one_group_per_compiled_block(g.compile, shard, starts)
        res = list(g.residency)
        n_units = len(self.units)
        win = list(g.window)
        if any(f > n_units or b > n_units for f, b in win):
            win = [(_clamp_window(f, n_units), _clamp_window(b, n_units)) for f, b in win]
        current = 0
        for i, s in enumerate(shard):
            if s:
                if i in starts:
                    current = res[i]
                else:
                    win[i] = (0, 0)
                res[i] = current
            else:
                res[i] = 0
                win[i] = (0, 0)
        acc = list(g.accumulate) if len(g.accumulate) == len(shard) else [0] * len(shard)
        cur_acc = 0
        for i, s_ in enumerate(shard):
            if not s_ or self.accum_steps == 1:
                acc[i] = 0
            elif i in starts:
                cur_acc = acc[i]
            else:
                acc[i] = cur_acc
        # bucket breaks the op/dtype/accumulation would force anyway are dropped, so equal plans have
        # equal genomes
        bstarts = frozenset(k for k in g.bucket_start
                            if 0 < k < len(self.ready) and self._bucket_key(shard, acc, k) == self._bucket_key(shard, acc, k - 1))
        recompute = frozenset(b for b in g.recompute if 0 <= b < len(self.recompute_blocks))
        # the genome offloads whole state tensors: a placement move since one was offloaded changes
        # how much of it a rank holds (a shard's rows, or all of them), and the fragment follows
        size = self.required_shard_size or (g.shard_size if g.shard_size in self.shard_sizes and any(shard) else 0)
        inside = {self.compile_blocks[c] for c in compiled}
        offload = tuple(sorted({
            (p, state, 0, self._state_numel(shard, p, size), -1 if bu >= 0 and self.blocks[bu] in inside else bu)
            for p, state, _, _, bu in g.offload
        }))
        return replace(
            g, shard=tuple(shard), residency=tuple(res), group_start=frozenset(starts), window=tuple(win),
            bucket_start=bstarts, recompute=recompute, accumulate=tuple(acc), offload=offload, shard_size=size,
            compile=compiled,
        )

    def _one_group_per_compiled_block(self, compile_: frozenset[int], shard: Sequence[bool], starts: set[int]) -> frozenset[int]:
        """The compiled blocks that can be, each block's sharded units made one gather group (group
        starts inside it dropped from ``starts``); a block whose sharded units a replicated unit
        splits is not compiled."""
        out = set()
        for c in compile_:
            if not 0 <= c < len(self.compile_blocks):
                continue
            sharded = [i for i in self.block_unit_index[self.compile_blocks[c]] if shard[i]]
            if sharded and not all(shard[i] for i in range(sharded[0], sharded[-1] + 1)):
                continue
            starts.difference_update(sharded[1:])
            out.add(c)
        return frozenset(out)

    def _bucket_key(self, shard: Sequence[bool], acc: Sequence[int], k: int) -> tuple:
        i = self.unit_of_ready[k]
        return (shard[i], self.ready_dtype[k], acc[i] if acc else 0)

    def groups(self, g: Genome) -> list[list[int]]:
        out: list[list[int]] = []
        for i, s in enumerate(g.shard):
            if not s:
                continue
            if i in g.group_start or not out:
                out.append([i])
            else:
                out[-1].append(i)
        return out

    def buckets(self, g: Genome) -> list[list[int]]:
        """Bucket partition of the ready order (indices into ``self.ready``)."""
        out: list[list[int]] = []
        prev_key = None
        shard, acc, starts, dtype = g.shard, g.accumulate, g.bucket_start, self.ready_dtype
        for k, i in enumerate(self.unit_of_ready):
            key = (shard[i], dtype[k], acc[i] if acc else 0)  # _bucket_key(shard, acc, k)
            if not out or k in starts or key != prev_key:
                out.append([k])
            else:
                out[-1].append(k)
            prev_key = key
        return out

    def to_plan(self, g: Genome, *, provenance: dict | None = None, normalized: bool = False) -> Plan:
        """The plan of ``g`` (``normalized``: ``g`` is :meth:`normalize`'s output already)."""
        if not normalized:
            g = self.normalize(g)
        units = [
            UnitPlan(
                u, list(self.unit_params[u]), "shard" if g.shard[i] else "replicate", RESIDENCIES[g.residency[i]],
                accumulate="sharded" if g.accumulate and g.accumulate[i] else "unsharded",
            )
            for i, u in enumerate(self.units)
        ]
        groups = []
        for members in self.groups(g):
            fw, bw = g.window[members[0]]
            groups.append(
                GatherGroup(
                    [self.units[i] for i in members],
                    Prefetch("memory" if fw == MEMORY_WINDOW else fw, "memory" if bw == MEMORY_WINDOW else bw),
                )
            )
        buckets = [
            Bucket(
                [self.ready[k] for k in ks],
                "reduce_scatter" if g.shard[self.unit_of_ready[ks[0]]] else "all_reduce",
                nbytes=sum(self.ready_nbytes[k] for k in ks),
            )
            for ks in self.buckets(g)
        ]
        offload = [
            OffloadFragment(p, state, (a, b), "step", f"backward:{self.units[bu]}" if bu >= 0 else "step")
            for p, state, a, b, bu in g.offload
        ]
        return Plan(
            world_size=self.world,
            units=units,
            gather_groups=groups,
            buckets=buckets,
            offload=offload,
            max_inflight_buckets=None if g.inflight < 0 else g.inflight,
            recompute=[self.recompute_blocks[b] for b in sorted(g.recompute)],
            compile=[self.compile_blocks[c] for c in sorted(g.compile)],
            compile_backend=self.compile_backend,
            grad_accum_steps=self.accum_steps,
            fingerprint=self.fingerprint,
            provenance=dict(provenance or {}),
            shard_size=g.shard_size or None,
        )

    # ---- seeds -----------------------------------------------------------------------------
    def genome_of(self, plan: Plan) -> Genome:
        """The genome of a plan (built-in plans are the seeds: their rules live in builtins.py)."""
        n = len(self.units)
        up = {u.name: u for u in plan.units}
        shard = tuple(up[u].placement == "shard" for u in self.units)
        residency = tuple(RESIDENCIES.index(up[u].residency) for u in self.units)
        starts: set[int] = set()
        window = [(0, 0)] * n
        for g in plan.gather_groups:
            first = min(self.index[u] for u in g.units)
            starts.add(first)
            window[first] = (_window_gene(g.prefetch.forward), _window_gene(g.prefetch.backward))
        position = {p: k for k, p in enumerate(self.ready)}
        bstarts = {min(position[p] for p in b.params if p in position) for b in plan.buckets if any(p in position for p in b.params)}
        recompute = frozenset(self.recompute_blocks.index(b) for b in plan.recompute if b in self.recompute_blocks)
        return self.normalize(Genome(
            shard, residency, frozenset(starts), tuple(window), frozenset(bstarts),
            -1 if plan.max_inflight_buckets is None else plan.max_inflight_buckets, (), recompute,
            tuple(int(up[u].accumulate == "sharded") for u in self.units),
            plan.shard_size if plan.shard_size is not None and plan.shard_size < self.world else 0,
            frozenset(self.compile_blocks.index(b) for b in plan.compile if b in self.compile_blocks),
        ))

    def ddp(self) -> Genome:
        return self.genome_of(ddp_plan(self.structure, self.world, ready_order=self.ready))

    def fsdp(self) -> Genome:
        return self.genome_of(fsdp_plan(self.structure, self.world, unit_order=self.units))

    def zero2(self) -> Genome:
        return self.genome_of(zero2_plan(self.structure, self.world, unit_order=self.units))

    def hybrid(self, g: Genome, shard_size: int) -> Genome:
        """``g`` sharding over groups of ``shard_size`` ranks (one of ``shard_sizes``; 0: the whole world)."""
        return self.normalize(replace(g, shard_size=shard_size))

    # ---- offload -----------------------------------------------------------------------------
    def _state_numel(self, shard: Sequence[bool], p: str, shard_size: int = 0) -> int:
        """Elements of ``p``'s optimizer state a rank holds under the placement ``shard``, sharded
        over groups of ``shard_size`` ranks (0: the world)."""
        info = self.structure.params[p]
        if shard[self.index[self.unit_of_param[p]]] and info.shape:
            rows = info.shape[0]
            return -(-rows // (shard_size or self.world)) * (info.numel // rows if rows else 1)
        return info.numel

    def offload_candidates(self, g: Genome) -> list[tuple[str, str, int]]:
        """(param, state, bytes) of whole state tensors not offloaded yet."""
        have = {(o[0], o[1]) for o in g.offload}
        out = []
        for p in self.ready:
            for state in self.state_names:
                if (p, state) not in have:
                    out.append((p, state, self._state_numel(g.shard, p, g.shard_size) * self.structure.params[p].dtype.itemsize))
        return out

    def with_offload(self, g: Genome, p: str, state: str, *, back_unit: int | None = None) -> Genome:
        """Offload a whole state tensor, copied back when its unit's backward starts (or at
        ``back_unit``; -1: at the step)."""
        unit = self.index[self.unit_of_param[p]] if back_unit is None else back_unit
        frag = (p, state, 0, self._state_numel(g.shard, p, g.shard_size), unit)
        return replace(g, offload=tuple(sorted(g.offload + (frag,))))

    def shift_offload(self, g: Genome, frag: tuple, *, later: bool) -> Genome:
        """Move a fragment's copy-back one unit later (nearer the step) or earlier in backward order
        (units run in reverse in backward, so later = a smaller unit index; -1 = at the step)."""
        p, state, a, b, unit = frag
        if later:
            unit = unit - 1 if unit > 0 else -1
        else:
            unit = min(unit + 1, len(self.units) - 1)  # from "at the step" (-1) to the last backward unit (0)
        new = (p, state, a, b, unit)
        return replace(g, offload=tuple(sorted(o if o != frag else new for o in g.offload)))

    # ---- random plans and moves ------------------------------------------------------------
    def random(self, rng: Random) -> Genome:
        n = len(self.units)
        shard = tuple(rng.random() < 0.6 for _ in range(n))
        residency = tuple(rng.randrange(3) for _ in range(n))
        starts = frozenset(i for i in range(n) if rng.random() < 0.4)
        window = tuple((rng.choice(self.window_choices), rng.choice(self.window_choices)) for _ in range(n))
        bstarts = frozenset(k for k in range(len(self.ready)) if rng.random() < 0.3)
        inflight = rng.choice(self.inflight_choices)
        recompute = frozenset(b for b in range(len(self.recompute_blocks)) if rng.random() < 0.3)
        accumulate = tuple(int(rng.random() < 0.5) for _ in range(n))
        size = rng.choice((0, *self.shard_sizes)) if self.shard_sizes else 0
        # drawn only where there is something to compile: the draws of a space without stay as they were
        compile_ = frozenset(c for c in range(len(self.compile_blocks)) if rng.random() < 0.5) if self.compile_blocks else frozenset()
        return self.normalize(Genome(shard, residency, starts, window, bstarts, inflight, (), recompute, accumulate, size, compile_))

    def mutate(self, g: Genome, rng: Random, moves: int = 1) -> Genome:
        """Apply ``moves`` random moves (bucket merge/split, group merge/split, residency, window,
        placement when free, in-flight bound)."""
        for _ in range(moves):
            g = self._move(g, rng)
        return self.normalize(g)

    def with_recompute(self, g: Genome, blocks: Iterable[int]) -> Genome:
        return replace(g, recompute=frozenset(blocks))

    def with_compile(self, g: Genome, blocks: Iterable[int]) -> Genome:
        return replace(g, compile=frozenset(blocks))

    def _move(self, g: Genome, rng: Random) -> Genome:
        kinds = ["bucket_merge", "bucket_split", "residency", "window", "inflight", "group_merge", "group_split"]
        if self.shard_sizes:
            kinds.append("shard_size")
        if self.fixed is None:
            kinds.append("placement")
        return self._move_kind(g, rng.choice(kinds), rng)

    def _move_kind(self, g: Genome, kind: str, rng: Random) -> Genome:
        """One move of the given kind (a no-op when it does not apply)."""
        n = len(self.units)
        sharded = [i for i in range(n) if g.shard[i]]
        if kind == "bucket_merge" and g.bucket_start:
            k = rng.choice(sorted(g.bucket_start))
            return replace(g, bucket_start=g.bucket_start - {k})
        if kind == "bucket_split" and len(self.ready) > 1:
            k = rng.randrange(1, len(self.ready))
            return replace(g, bucket_start=g.bucket_start | {k})
        if kind == "group_merge":
            candidates = [i for i in g.group_start if i > 0 and g.shard[i - 1]]
            if candidates:
                return replace(g, group_start=g.group_start - {rng.choice(sorted(candidates))})
        if kind == "group_split" and sharded:
            return replace(g, group_start=g.group_start | {rng.choice(sharded)})
        if kind == "residency" and sharded:
            members = rng.choice(self.groups(g))
            r = rng.randrange(3)
            res = list(g.residency)
            for i in members:
                res[i] = r
            return replace(g, residency=tuple(res))
        if kind == "window" and sharded:
            first = rng.choice(self.groups(g))[0]
            fw, bw = g.window[first]
            if rng.random() < 0.5:
                fw = rng.choice(self.window_choices)
            else:
                bw = rng.choice(self.window_choices)
            w = list(g.window)
            w[first] = (fw, bw)
            return replace(g, window=tuple(w))
        if kind == "inflight":
            return replace(g, inflight=rng.choice(self.inflight_choices))
        if kind == "offload_add" and self.state_names:
            cands = self.offload_candidates(g)
            if cands:
                p, state, _ = rng.choice(cands)
                return self.with_offload(g, p, state)
        if kind == "offload_remove" and g.offload:
            drop = rng.choice(g.offload)
            return replace(g, offload=tuple(o for o in g.offload if o != drop))
        if kind == "offload_shift" and g.offload:
            return self.shift_offload(g, rng.choice(g.offload), later=rng.random() < 0.5)
        if kind == "recompute" and self.recompute_blocks:
            b = rng.randrange(len(self.recompute_blocks))
            return replace(g, recompute=g.recompute ^ {b})
        if kind == "compile" and self.compile_blocks:  # the fusion / gradient-readiness trade-off, per block
            c = rng.randrange(len(self.compile_blocks))
            return replace(g, compile=g.compile ^ {c})
        if kind == "accumulate" and sharded and self.accum_steps > 1:
            first = rng.choice(self.groups(g))[0]
            acc = list(g.accumulate) if g.accumulate else [0] * n
            acc[first] = 1 - acc[first]
            return replace(g, accumulate=tuple(acc))
        if kind == "shard_size" and self.shard_sizes:
            return replace(g, shard_size=rng.choice([x for x in (0, *self.shard_sizes) if x != g.shard_size]))
        if kind == "placement" and self.fixed is None and n:  # a model without units has nothing to place
            i = rng.randrange(n)
            shard = list(g.shard)
            shard[i] = not shard[i]
            return replace(g, shard=tuple(shard), group_start=g.group_start | {i})
        return g


def space_for(
    profile: Profile,
    structure: ModelStructure,
    world_size: int,
    *,
    fixed_placement: dict[str, str] | None = None,
    grad_accum_steps: int | None = None,
    shard_sizes: Sequence[int] = (),
    required_shard_size: int = 0,
) -> PlanSpace:
    """The plan space for a measured model: orders, optimizer state, micro-batches (given, else as
    observed while profiling), and what recomputing each block saves (its units' activations less
    the inputs it keeps) and costs (its forward again). ``shard_sizes``: the hybrid shard groups a
    plan may use (:func:`hybrid_shard_sizes`; none on one node); ``required_shard_size``: the
    shard groups every plan must use (see :class:`PlanSpace`)."""
    acts: dict[str, int] = {}
    fwd: dict[str, float] = {}
    block_of = {u.name: u.block for u in structure.units}
    for up in profile.units:
        b = block_of.get(up.name)
        if b is not None:
            acts[b] = acts.get(b, 0) + up.act_bytes
            fwd[b] = fwd.get(b, 0.0) + up.fwd_s
    saves = {b: max(0, a - profile.block_input_bytes.get(b, 0)) for b, a in acts.items()}
    return PlanSpace(
        structure, world_size, [u.name for u in profile.units], profile.ready_order,
        fixed_placement=fixed_placement, state_names=profile.optimizer.state_names,
        grad_accum_steps=grad_accum_steps or profile.grad_accum_steps,
        user_recomputed=list(profile.recompute_anchor), block_act_bytes=saves, block_fwd_s=fwd,
        shard_sizes=shard_sizes,
        required_shard_size=required_shard_size,
        compile_blocks=[
            b for b in profile.compiled_blocks
            if not any(u == b or u.startswith(b + ".") or b.startswith(u + ".") for u in profile.user_compiled)
        ],
        compile_backend=profile.compile_backend or "inductor",
        replicated_units=optimizer_replicated_units(profile, structure),
    )


def optimizer_replicated_units(profile: Profile, structure: ModelStructure) -> list[str]:
    """The units the profiled optimizer cannot step sharded: every unit when it cannot step DTensors
    at all (one sharded unit makes every parameter a DTensor), else those holding a parameter it
    trains when it cannot step shards."""
    opt = profile.optimizer
    if opt.dtensor_refused:
        return [u.name for u in structure.units]
    if not opt.shard_refused:
        return []
    return [u.name for u in structure.units if any(structure.params[p].requires_grad for p in u.params)]


def hybrid_shard_sizes(world_size: int, ranks_per_node: int | None) -> tuple[int, ...]:
    """The shard groups smaller than the world the search offers on ``world_size`` ranks of
    ``ranks_per_node`` to a node: the node, and multiples of it up to half the world (HSDP's
    usual choice and ZeRO++'s secondary shard per node; groups of several nodes trade memory for
    network traffic). None on one node, or when the nodes are not known."""
    if ranks_per_node is None or ranks_per_node >= world_size or world_size % ranks_per_node:
        return ()
    nodes = world_size // ranks_per_node
    return tuple(ranks_per_node * k for k in range(1, nodes) if nodes % k == 0)
