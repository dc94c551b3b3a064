"""Train an MLP regressor with AutoDist — an ordinary loop with one AutoDist line.

    torchrun --nproc_per_node 2 examples/mlp.py --steps 30
    torchrun --nproc_per_node 2 examples/mlp.py --plan zero2 --width 4096 --depth 4
"""

import argparse
import logging
import time

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
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--memory-limit", default=None)
    ap.add_argument("--log-every", type=int, default=5)
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.manual_seed(0)
    dims = [256] + [args.width] * args.depth + [16]
    model = AutoDist(MLP(dims), plan=args.plan, memory_limit=args.memory_limit)  # the one AutoDist line
    rank = dist.get_rank()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    teacher = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))

    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x = torch.randn(args.batch_size, 256, generator=gen)
        loss = F.mse_loss(model(x), x @ teacher)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dt = time.perf_counter() - t0
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  {dt * 1e3:7.1f} ms", flush=True)
    if rank == 0:
        print(f"plan in force: {model.plan.label}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
