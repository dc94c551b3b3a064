"""The engine's gradient buckets: built for a plan (:func:`build_buckets`), installed with the
gradients the old buckets held moved into the new ones (:func:`install_reducer`), and rebuilt once
from the observed gradient-ready order when the plan asks for it (:func:`maybe_rebuild_buckets`).
Each function takes the :class:`~autodist.runtime.engine.Engine` whose buckets they are."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from .._log import logger
from ..plan import Plan
from .reducer import BucketRuntime, Reducer

if TYPE_CHECKING:
    from .engine import Engine


def install_reducer(engine: Engine, plan: Plan) -> None:
    """New buckets for ``plan``; gradients held in the old buckets move into the new ones."""
    old_buffers = {b.buffer.untyped_storage().data_ptr() for b in engine.reducer.buckets}
    kept = {}
    for mp in engine.params.values():
        g = mp.local_grad()
        if g is not None and g.layout is torch.strided and g.untyped_storage().data_ptr() in old_buffers:
            kept[mp.name] = g.detach().clone()
    engine.reducer.reset()
    engine.reducer = Reducer(
        build_buckets(engine, plan), max_inflight=plan.max_inflight_buckets,
        launch_on_ready=engine.launch_policy == "ready", settled=engine._settled,
    )
    for b in engine.reducer.buckets:
        b.record = engine._record
    if not kept:
        return
    with torch.no_grad():
        for b in engine.reducer.buckets:
            for slot, mp in enumerate(b.params):
                if mp.name in kept:
                    obj = b.grad_obj(slot)
                    if obj is not None:
                        b.views[slot].copy_(kept.pop(mp.name))
                        mp.visible.grad = obj
        for name, g in kept.items():  # params no longer in any bucket keep a private copy
            engine.params[name].set_local_grad(g)


def build_buckets(engine: Engine, plan: Plan) -> list[BucketRuntime]:
    sharded_accumulation = {p for u in plan.units if u.placement == "shard" and u.accumulate == "sharded" for p in u.params}
    buckets = []
    for bi, b in enumerate(plan.buckets):
        mps = [engine.params[p] for p in b.params]
        rd = {engine.reduce_dtype(mp) for mp in mps}
        if len(rd) != 1:
            raise ValueError(f"bucket {bi} would reduce in several dtypes {rd}; split it by dtype")
        bucket = BucketRuntime(bi, b.op, mps, reduce_dtype=rd.pop(), comm=engine.comm, device=engine.device)
        bucket.every = b.op == "reduce_scatter" and all(p in sharded_accumulation for p in b.params)
        buckets.append(bucket)
    return buckets


def maybe_rebuild_buckets(engine: Engine, ready_order: list[str]) -> None:
    rb = engine.plan.rebuild_buckets
    if rb is None:
        return
    from ..builtins import bucket_by_size

    # Rank 0's observed order wins, so every rank builds identical buckets.
    order = engine.comm.broadcast_object(list(dict.fromkeys(ready_order)))
    seen = set(order)
    trainable = [p for p in reversed(engine.structure.trainable) if p not in seen]
    order = [p for p in order if p in engine.params and engine.params[p].requires_grad] + trainable
    by_op: dict[str, list[str]] = {}
    for p in order:
        by_op.setdefault("reduce_scatter" if engine.params[p].sharded else "all_reduce", []).append(p)
    buckets = []
    for op, names in by_op.items():
        buckets.extend(
            bucket_by_size(names, engine.structure, cap_bytes=rb.cap_bytes, first_cap_bytes=rb.first_cap_bytes, op=op)
        )
    position = {p: i for i, p in enumerate(order)}
    buckets.sort(key=lambda b: min(position[p] for p in b.params))

    engine.plan = replace(engine.plan, buckets=buckets, rebuild_buckets=None)
    install_reducer(engine, engine.plan)
    if engine.comm.rank == 0:
        logger.info("autodist: rebuilt %d gradient buckets from the observed gradient-ready order", len(buckets))
