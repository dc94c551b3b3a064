"""Train a torchvision ResNet with AutoDist — an ordinary loop with one AutoDist line.

    torchrun --nproc_per_node 2 examples/resnet.py --steps 20
    torchrun --nproc_per_node 2 examples/resnet.py --arch resnet50 --image-size 64 --plan fsdp

Needs torchvision (pip install 'autodist[vision]'). The images are synthetic.
BatchNorm statistics follow DDP: broadcast from rank 0 at the start of each forward.
"""

import argparse
import logging
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision

from autodist import AutoDist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="auto", help="auto | ddp | fsdp | zero2 | path/to/plan.json (default: auto)")
    ap.add_argument("--arch", default="resnet18", help="a torchvision.models ResNet (default: resnet18)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=16, help="images per rank")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--memory-limit", default=None)
    ap.add_argument("--log-every", type=int, default=5)
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.arch)(num_classes=args.classes)
    model = AutoDist(model, plan=args.plan, memory_limit=args.memory_limit)  # the one AutoDist line
    rank = dist.get_rank()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    gen = torch.Generator().manual_seed(1000 + rank)

    model.train()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen)
        labels = torch.randint(0, args.classes, (args.batch_size,), generator=gen)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dt = time.perf_counter() - t0
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            ips = args.batch_size * dist.get_world_size() / dt
            print(f"step {step:4d}  loss {loss.item():.4f}  {dt * 1e3:7.1f} ms  {ips:,.1f} images/s", flush=True)
    if rank == 0:
        print(f"plan in force: {model.plan.label}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
