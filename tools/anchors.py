"""Anchors: a Llama-shaped model planned offline for 8, 64 and 512 described H100s (issue 44, item 5).

    python tools/anchors.py                        # writes benchmarks/anchors.json
    python tools/anchors.py --layers 4 --worlds 8  # a quick look

The model has Llama 3 8B's shapes (vocabulary 128256, width 4096, 32 heads of which 8 key/value
heads, SwiGLU width 14336, RMSNorm, untied output layer, 32 blocks) and trains on sequences of
4096 tokens, one per rank, in bf16 with float32 parameters, gradient reduction and Adam state
(``MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)``; FSDP2's and torchtitan's usual
setting). It is built on the meta device: nothing is allocated and nothing is timed on this
machine. Its profile comes from :func:`autodist.cost.device.described_profile`: each operator of
one forward and backward priced by the H100's roofline, each unit's activations the bytes its
forward saves (see that module's [Note: what a roofline assumes]: the compute is optimistic).

The cluster: nodes of 8 H100s joined by NVLink 4 (``nvlink4``), nodes joined by NDR InfiniBand, one
400 Gb/s NIC per GPU (``ib-ndr``), 80 GiB per rank less the search's headroom. For each world
size the simulator predicts one step of FSDP2's full sharding (``builtin:fsdp``: one gather group
per block, freed after forward), FSDP2's HSDP at node size (the same plan, ``shard_size=8``),
DDP, and the plan AutoDist's search picks (with hybrid shard groups offered), each with its peak and
whether it fits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from autodist.builtins import ddp_plan, fsdp_plan  # noqa: E402
from autodist.cost.budget import format_bytes  # noqa: E402
from autodist.cost.device import DEVICES, described_profile  # noqa: E402
from autodist.cost.simulator import Simulator  # noqa: E402
from autodist.planner.offline import cluster_comm_model, search_within_budget  # noqa: E402
from autodist.sched.search import SearchConfig  # noqa: E402
from autodist.sched.space import hybrid_shard_sizes, space_for  # noqa: E402
from autodist.structure import discover  # noqa: E402

GPUS_PER_NODE = 8


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.wq(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(d)
        self.attention = Attention(d, heads, kv_heads)
        self.ffn_norm = RMSNorm(d)
        self.w1 = nn.Linear(d, ffn, bias=False)
        self.w3 = nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32, help="transformer blocks (default 32, Llama 3 8B's)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per rank (default 4096)")
    ap.add_argument("--worlds", default="8,64,512", help="GPUs, multiples of 8 (default 8,64,512)")
    ap.add_argument("--device", default="h100", choices=list(DEVICES))
    ap.add_argument("--memory-limit-gib", type=float, default=80.0)
    ap.add_argument("--time-budget", type=float, default=10.0, help="seconds per search (default 10, plan=\"auto\"'s)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "anchors.json"))
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    dims = {"vocab": 128256, "d": 4096, "layers": args.layers, "heads": 32, "kv_heads": 8, "ffn": 14336}
    device = DEVICES[args.device]
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Llama(**dims)
    structure = discover(model)
    idx = torch.zeros(1, args.seq, dtype=torch.int64, device="meta")
    # the compute runs in bf16 (the mixed-precision policy's parameter dtype), the parameters are float32
    profile = described_profile(model.to(torch.bfloat16), structure, (idx,), device)
    profile_s = time.perf_counter() - t0
    params = sum(p.numel for p in structure.params.values())
    print(f"{params / 1e9:.2f} B parameters, {len(structure.units)} units; described profile in {profile_s:.1f} s: "
          f"compute {profile.compute_s * 1e3:.1f} ms per step on one {device.name} ({profile.meta['flops'] / 1e12:.1f} TFLOP)")
    budget = int(args.memory_limit_gib * 2**30)
    config = SearchConfig(time_budget_s=args.time_budget)
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        nodes = max(1, world // GPUS_PER_NODE)
        per_node = min(world, GPUS_PER_NODE)
        comm, comm_said = cluster_comm_model(nodes, per_node, "nvlink4", "ib-ndr" if nodes > 1 else None)
        comm = config.calibrated(comm)

        def simulator(b: int | None, comm=comm, world=world) -> Simulator:
            return Simulator(profile, structure, comm, world_size=world, budget_bytes=b,
                             param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

        sim = simulator(budget)
        named = {
            "fsdp2 full sharding": fsdp_plan(structure, world),
            "fsdp2 hsdp (shard_size=8)": replace(fsdp_plan(structure, world), shard_size=per_node if nodes > 1 else None),
            "ddp": ddp_plan(structure, world),
        }
        t = time.perf_counter()
        space = space_for(profile, structure, world, shard_sizes=hybrid_shard_sizes(world, comm.ranks_per_node))
        _, found = search_within_budget(space, simulator, config, budget)
        search_s = time.perf_counter() - t
        named["autodist"] = found.plan
        predicted: dict[str, dict[str, Any]] = {}
        row: dict[str, Any] = {"gpus": world, "nodes": nodes, "comm": comm_said, "search_seconds": round(search_s, 2),
                               "evaluated": found.evaluated, "stopped_by": found.stopped_by, "plans": predicted}
        for name, plan in named.items():
            r = sim.run(plan)
            predicted[name] = {
                "step_ms": round(r.step_s * 1e3, 2), "peak": format_bytes(r.peak_bytes), "peak_bytes": r.peak_bytes,
                "fits": r.feasible, "exposed_comm_ms": round(r.exposed_comm_s * 1e3, 2),
            }
        pick = found.plan
        row["autodist_pick"] = {
            "shard_size": pick.shard_ranks, "hybrid": pick.hybrid,
            "sharded_units": len(pick.sharded_units), "units": len(pick.units),
            "residency": sorted({u.residency for u in pick.sharded_units}),
            "gather_groups": len(pick.gather_groups), "buckets": len(pick.buckets),
            "recomputed_blocks": len(pick.recompute), "offloaded": len(pick.offload),
            "preferred_seed": found.preferred_seed,
        }
        rows.append(row)
        print(f"{world} GPUs ({nodes} node(s)): " + "; ".join(
            f"{n} {p['step_ms']:.1f} ms, {p['peak']}{'' if p['fits'] else ' (over budget)'}" for n, p in predicted.items()
        ) + f". AutoDist: shard_size {pick.shard_ranks}, {len(pick.sharded_units)}/{len(pick.units)} units sharded, "
            f"{len(pick.recompute)} blocks recomputed (search {search_s:.1f} s, {found.evaluated} plans, {found.stopped_by})")
    out = {
        "model": {"shape": "Llama 3 8B", **dims, "seq": args.seq, "batch_per_rank": 1, "parameters": params,
                  "precision": "bf16 compute, float32 parameters, reduction and Adam state"},
        "device": {"name": device.name, "what": device.what, "source": device.source},
        "compute": "roofline of the described device, nothing measured (autodist/cost/device.py)",
        "compute_ms_per_step": round(profile.compute_s * 1e3, 2), "tflop_per_step": round(profile.meta["flops"] / 1e12, 2),
        "memory_limit_gib": args.memory_limit_gib, "gpus_per_node": GPUS_PER_NODE, "links": "nvlink4 within a node, ib-ndr across",
        "seconds": round(time.perf_counter() - t0, 1), "torch": torch.__version__, "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out} in {out['seconds']} s")


if __name__ == "__main__":
    main()
