"""Shared by the tools: re-run a script under torchrun with the environment measurements need."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any, NoReturn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from autodist.measure.fidelity import max_over_ranks  # noqa: E402,F401  (the tools' import of it)
from autodist.measure.memory import MALLOC_ENV  # noqa: E402


def relaunch(script: str, nproc: int, args: list[str], *, resident: bool = False) -> int:
    """Run ``script args`` on ``nproc`` ranks, one thread each, as ``torchrun`` runs training.

    ``resident``: the tool measures resident memory, so glibc's mmap threshold is fixed (freed
    tensors leave the process; see [Note: glibc and freed tensors] in ``autodist/measure/memory.py``).
    That also makes every allocation of 128 KiB or more fault its pages in afresh, which slows
    steps that allocate large tensors (gathered parameters, bucket buffers) by up to 40% on a CPU
    host: tools that time steps against the simulator run without it, as users train."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(MALLOC_ENV if resident else {}))
    return subprocess.run(cmd, env=env).returncode


def run_tool(script: str, nproc: int, worker_args: list[str], table: Callable[[dict], str], json_path: str | None,
             extra: Callable[[dict, str], None] | None = None, *, resident: bool = False) -> int:
    """The parent side of a tool: run ``script --worker --out F worker_args`` on ``nproc`` ranks
    (``worker_args`` may name ``{tmp}``, a scratch folder), read the JSON the workers wrote to F,
    let ``extra`` add to it, print ``table`` of it and save it to ``json_path`` when given.
    ``resident``: see :func:`relaunch`."""
    name = os.path.basename(script).removesuffix(".py")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        rc = relaunch(
            os.path.abspath(script), nproc, ["--worker", "--out", out, *(a.replace("{tmp}", d) for a in worker_args)],
            resident=resident,
        )
        if rc != 0:
            print(f"{name}: the ranks failed (exit code {rc})", file=sys.stderr)
            return rc
        with open(out) as f:
            payload: dict[str, Any] = json.load(f)
    if extra is not None:
        extra(payload, name)
    print(table(payload))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


def exit_rank() -> NoReturn:
    """End a tool's rank process once its results are written, skipping the interpreter's
    finalisation.

    [Note: a rank's exit after torch's DDP] torch's DDP issues its all-reduces inside
    ``loss.backward()``, where torch has stashed a Python object in thread-local state; each work
    captures it, and gloo's worker thread may drop the last reference as the interpreter finalises,
    and abort the process taking the GIL ("terminate called without an active exception"; see [Note:
    a collective issued in backward outliving the interpreter] in ``autodist/runtime/comm.py``,
    which keeps AutoDist's own collectives free of it). The tool had written its results by then,
    yet its launch failed: 4 of 32 launches of ``tools/bench.py --models gpt-deep --contenders
    compute,ddp,autodist:ddp --passes 4`` on 2 CPU ranks, always after the last model's results."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def report(text: str, payload: Any, path: str | None) -> None:
    """Print a tool's table and, where ``path`` is given (``--json``), save its payload there."""
    print(text)
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)
