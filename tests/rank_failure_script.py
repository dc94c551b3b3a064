"""A training loop in which one rank dies mid-step (used by tests/test_hardening.py).

``python rank_failure_script.py WHERE PLAN`` launches two ranks on a plain gloo process group (no
torchrun: nothing kills the survivor for us); under torchrun it runs as one rank. ``WHERE`` is
``forward``, ``backward`` (with collectives in flight) or ``optimizer``: where rank 1 exits with
code 3 at step 2. Every rank prints one line saying how it ended.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time


def train(rank: int, world: int, where: str, plan: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    from autodist import AutoDist

    torch.manual_seed(0)
    model = AutoDist(nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]), plan=plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t0 = time.monotonic()
    try:
        for step in range(5):
            out = model(torch.randn(8, 64))
            dies = step == 2 and rank == 1
            if dies and where == "forward":
                os._exit(3)
            if dies and where == "backward":
                out.register_hook(lambda g: os._exit(3))  # mid-backward: reductions in flight
            out.sum().backward()
            if dies and where == "optimizer":
                os._exit(3)
            opt.step()
            opt.zero_grad()
        print(f"rank {rank}: finished", flush=True)
    except Exception as e:
        print(f"rank {rank}: {type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}", flush=True)
        sys.exit(1)


def main() -> None:
    where, plan = sys.argv[1], sys.argv[2]
    if "RANK" in os.environ:  # under torchrun
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), where, plan)
        return
    if len(sys.argv) > 3:
        train(int(sys.argv[3]), 2, where, plan)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, __file__, where, plan, str(r)], env=env) for r in range(2)]
    for p in procs:
        p.wait()


if __name__ == "__main__":
    main()
