"""Train an MLP regressor with AutoDist — an ordinary loop with one AutoDist line.

    torchrun --nproc_per_node 2 examples/mlp.py --steps 30
    torchrun --nproc_per_node 2 examples/mlp.py --plan zero2 --width 4096 --depth 4

The data is synthetic: each rank holds a fixed set of random inputs, and the targets are a fixed
smooth function of them (tanh of a random linear map, the same on every rank), so the loss goes
down as the model fits it.
"""

import argparse
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autodist import AutoDist
from autodist.zoo import MLP


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="auto", help="auto | ddp | fsdp | zero2 | path/to/plan.json (default: auto)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32, help="samples per rank")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4, help="hidden layers")
    ap.add_argument("--samples", type=int, default=256, help="size of each rank's dataset")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--memory-limit", default=None)
    ap.add_argument("--log-every", type=int, default=5)
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.manual_seed(0)
    dims = [256] + [args.width] * args.depth + [16]
    model = AutoDist(MLP(dims), plan=args.plan, memory_limit=args.memory_limit, log_every=args.log_every)  # the one AutoDist line
    rank = dist.get_rank()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1000 + rank)
    inputs = torch.randn(args.samples, 256, generator=gen)
    teacher = torch.randn(256, 16, generator=torch.Generator().manual_seed(0)) / 16
    targets = torch.tanh(2 * inputs @ teacher)

    for step in range(1, args.steps + 1):
        idx = torch.randint(0, args.samples, (args.batch_size,), generator=gen)
        loss = F.mse_loss(model(inputs[idx]), targets[idx])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    if rank == 0:
        print(f"plan in force: {model.plan.label}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
