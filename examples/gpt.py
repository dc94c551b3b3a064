"""Train a small GPT-style language model with AutoDist — an ordinary loop with one AutoDist line.

    torchrun --nproc_per_node 2 examples/gpt.py --steps 30
    torchrun --nproc_per_node 2 examples/gpt.py --plan fsdp --layers 8 --d-model 512
    torchrun --nproc_per_node 2 examples/gpt.py --save-plan my_plan.json   # saves the plan "auto" chose
    torchrun --nproc_per_node 2 examples/gpt.py --plan my_plan.json        # runs that plan

``--save-plan`` calls ``autodist.save_plan(model.plan, path)`` after training; ``autodist plan --model
autodist.zoo:gpt --input-shape 8,128 --input-dtype int64 --world-size 2 --out my_plan.json`` searches
one offline instead (it needs the comm model a first run here with ``--plan auto`` caches).

The data is synthetic (random tokens), so the loss goes down only as far as the model memorises it.
"""

import argparse
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autodist import AutoDist, save_plan
from autodist.zoo import GPT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="auto", help="auto | ddp | fsdp | zero2 | path/to/plan.json (default: auto)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--memory-limit", default=None, help="per-rank budget, e.g. 2GiB or 80%%")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--save-plan", metavar="PATH", help="write the plan in force after training as JSON (for --plan PATH)")
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.manual_seed(0)
    model = GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq)
    model = AutoDist(model, plan=args.plan, memory_limit=args.memory_limit, log_every=args.log_every)  # the one AutoDist line
    rank = dist.get_rank()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    data = torch.Generator().manual_seed(1000 + rank)
    fixed = torch.randint(0, args.vocab, (args.batch_size * 4, args.seq + 1), generator=data)

    for step in range(1, args.steps + 1):
        batch = fixed[torch.randint(0, fixed.shape[0], (args.batch_size,), generator=data)]
        x, y = batch[:, :-1], batch[:, 1:]
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    if rank == 0:
        p, m = model.plan, model.metrics()
        exposed = "not measured" if m["exposed_comm_share"] is None else f"{m['exposed_comm_share']:.0%}"  # None on CUDA
        print(f"plan in force: {p.label} ({len(p.sharded_units)} of {len(p.units)} units sharded, "
              f"{len(p.buckets)} buckets, {len(p.offload)} offload fragments, {len(p.recompute)} blocks recomputed)")
        print(f"last step ({m['step']}): {m['step_seconds'] * 1e3:.1f} ms, {m['tokens_per_second']:,.0f} tokens/s, "
              f"peak tensor memory {m['peak_bytes'] / 2**30:.2f} GiB (measured at step {m['peak_step']}), "
              f"resident {m['resident_bytes'] / 2**30:.2f} GiB, exposed communication {exposed}")
        if args.save_plan:
            save_plan(model.plan, args.save_plan)
            print(f"saved the plan in force to {args.save_plan}; run it with --plan {args.save_plan}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
