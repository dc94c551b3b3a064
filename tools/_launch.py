"""Shared by the tools: re-run a script under torchrun with the environment measurements need."""

from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from autodist.memory import MALLOC_ENV  # noqa: E402


def relaunch(script: str, nproc: int, args: list[str]) -> int:
    """Run ``script args`` on ``nproc`` ranks (one thread each, glibc's mmap threshold fixed)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", **MALLOC_ENV)
    return subprocess.run(cmd, env=env).returncode


def max_over_ranks(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
