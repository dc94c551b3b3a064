"""Run test functions on N gloo ranks that are spawned once and reused.

``RankPool(world_size)`` starts ``world_size`` worker processes that form a gloo process group and
then wait for work. ``pool.run(fn, *args)`` runs ``fn(*args)`` on every rank at once (``fn`` must be
importable: a module-level function of a test module) and returns the per-rank results, rank order.

Failures are reported by rank with the rank's own traceback. If a rank fails, the others get a short
grace period to finish (they may be blocked in a collective waiting for it); ranks that do not finish
in time — or a run that exceeds its timeout — are killed and the pool restarts on the next ``run``.
A timeout guards against a hang only: it stretches with the machine's load (:func:`load_factor`), so
a run that is slow because the machine is busy is not taken for one that hangs.
Workers exit when the pool closes, when the parent process dies, or at interpreter exit: nothing is
left behind.

Tests that launch commands of their own (torchrun, the CLI, a script) use :func:`run_commands`: the
same guard, stretched the same way, and a command that outlives it is killed with every process it
started.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

DEFAULT_TIMEOUT_S = 180.0  # each is a guard against a hang, stretched by load_factor()
START_TIMEOUT_S = 120.0
FAILURE_GRACE_S = 15.0
COLLECTIVE_TIMEOUT_S = 90.0


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


def load_factor() -> float:
    """How many times over the machine's cores are asked for: the one-minute load average per core,
    at least 1 (on an idle machine a guard is what it says)."""
    try:
        return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    except OSError:  # no load average on this platform
        return 1.0


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repo_env(**overrides: str) -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH`` (a command run from a
    test imports the autodist under test) and ``overrides`` set."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **overrides}


def run_commands(cmds: Sequence[Sequence[object]], *, timeout: float, env: dict[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None, merge_stderr: bool = False,
                 ) -> list[subprocess.CompletedProcess[str]]:
    """Start every command at once and wait for all, their output captured as text.

    ``timeout`` guards against a hang only, stretched by :func:`load_factor` as the pool's is: a
    command still running at ``timeout * stretch`` seconds is stopped with its process group
    (:func:`_kill_group`) and :class:`subprocess.TimeoutExpired` raised with what it printed. Output
    goes to files, not pipes, so a command that prints much never blocks on a reader that waits for
    another command first. ``merge_stderr`` puts stderr into stdout, in order.
    """
    procs: list[tuple[subprocess.Popen[bytes], Any, Any]] = []
    try:
        for cmd in cmds:
            out = tempfile.TemporaryFile()
            err = out if merge_stderr else tempfile.TemporaryFile()
            procs.append((subprocess.Popen([str(a) for a in cmd], env=env, cwd=cwd, stdout=out, stderr=err,
                                           **_OWN_PROCESS_GROUP), out, err))
        start, stretch = time.monotonic(), load_factor()
        while any(p.poll() is None for p, _, _ in procs):
            stretch = max(stretch, load_factor())
            if time.monotonic() - start > timeout * stretch:
                late = next(p for p, _, _ in procs if p.poll() is None)
                _kill_group(late)
                _, out, err = procs[[p for p, _, _ in procs].index(late)]
                raise subprocess.TimeoutExpired(late.args, timeout * stretch, output=_read(out), stderr=_read(err))
            time.sleep(0.1)
        return [subprocess.CompletedProcess(p.args, p.returncode, _read(out), "" if merge_stderr else _read(err))
                for p, out, err in procs]
    finally:
        for p, out, err in procs:
            if p.poll() is None:
                _kill_group(p)
            out.close()
            err.close()


def run_command(cmd: Sequence[object], *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """:func:`run_commands` for one command."""
    return run_commands([cmd], timeout=timeout, **kwargs)[0]


# A process group of its own, so that a command past its guard is killed with what it started, in
# this session: a session of its own is a scheduling group of its own under Linux's autogroup, and on
# the 2-core development host, running the suite beside two CPU-burning processes of its session
# (load average about 14), such a group got next to no CPU: 0.2 s of work took 41 s in a new session,
# 0.6 s in this one (alike when idle, or with the burners in sessions of their own). torchrun starts
# each worker in a session of its own: its tests are the slowest there (tests/test_hybrid.py's
# two-node launch 977 s against 18 s idle).
_OWN_PROCESS_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
)


def _kill_group(p: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """Stop ``p``'s process group: SIGTERM first (torchrun then stops its workers, which are in
    sessions of their own), SIGKILL after ``grace_s``."""
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        p.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(p.pid, signal.SIGKILL)  # whatever of the group is left
    except ProcessLookupError:
        pass
    p.wait()


def _read(f: Any) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch_parent(parent_pid: int) -> None:
    """Exit once the process that owns the pool is gone (a rank from the fork server is not its child)."""
    while True:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except PermissionError:  # alive, and not ours to signal
            pass
        time.sleep(1.0)


def _worker(rank: int, world_size: int, port: int, conn: Any, parent_pid: int, sys_path: list[str],
            environ: dict[str, str]) -> None:
    sys.path[:] = sys_path
    os.environ.clear()  # the parent's environment as it is now, as a spawned process would have it
    os.environ.update(environ)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            result = fn(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # report everything, including assertion errors
            conn.send(("err", traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _context() -> Any:
    """Where ranks start from: a fork server that has imported torch, where there is one (a rank
    then starts in a fraction of a second: each spawned one imported torch afresh, about 1.7 s of
    CPU, 13 s of wall time for a pool of 8 on 2 cores); else a fresh interpreter. The fork server
    runs no torch operation before it forks (no thread pool, no device), and a rank takes the
    parent's environment and ``sys.path`` as they are when it starts (:func:`_worker`), not the
    server's."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


class RankPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list[mp.Process] = []
        self._conns: list[Any] = []

    # -- lifecycle --------------------------------------------------------------------------------
    def _start(self) -> None:
        ctx = _context()
        port = _free_port()
        self._procs, self._conns = [], []
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(rank, self.world_size, port, child, os.getpid(), list(sys.path), dict(os.environ)),
                daemon=True,
                name=f"autodist-test-rank{rank}",
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        start, stretch = time.monotonic(), load_factor()
        for rank, c in enumerate(self._conns):
            while not c.poll(1.0):
                stretch = max(stretch, load_factor())
                if time.monotonic() - start > START_TIMEOUT_S * stretch:
                    self.kill()
                    raise RuntimeError(f"rank {rank} of the test pool did not start within "
                                       f"{START_TIMEOUT_S * stretch:.0f} s (load factor {stretch:.1f})")
            c.recv()

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for p in self._procs:
            p.join(timeout=10)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=10)
        self.kill()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    # -- running --------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        if not self.alive:
            self.kill()
            self._start()
        for c in self._conns:
            c.send((fn, args, kwargs))
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))
        start, stretch, grace_ends = time.monotonic(), load_factor(), float("inf")
        while pending:
            now = time.monotonic()
            stretch = max(stretch, load_factor())  # the largest seen: a load that eased leaves work behind
            if errors:
                grace_ends = min(grace_ends, now + FAILURE_GRACE_S * stretch)
            if now >= min(start + timeout * stretch, grace_ends):
                break
            for rank in sorted(pending):
                c = self._conns[rank]
                if c.poll(0.02):
                    try:
                        status, payload = c.recv()
                    except EOFError:
                        status, payload = "err", f"rank {rank} died (exit code {self._procs[rank].exitcode})"
                    pending.discard(rank)
                    if status == "ok":
                        results[rank] = payload
                    else:
                        errors[rank] = payload
                elif not self._procs[rank].is_alive():
                    pending.discard(rank)
                    errors[rank] = f"rank {rank} died (exit code {self._procs[rank].exitcode})"
        if pending:
            self.kill()  # stuck ranks: the process group is unusable, start afresh next time
        if errors or pending:
            parts = [f"--- rank {r} failed ---\n{tb}" for r, tb in sorted(errors.items())]
            if pending:
                why = ("after another rank failed" if errors else
                       f"within {timeout * stretch:.0f} s ({timeout:.0f} s, stretched by the load factor {stretch:.1f})")
                parts.append(f"--- ranks {sorted(pending)} did not finish {why}; the pool was killed ---")
            raise RankFailure(f"{fn.__module__}.{fn.__qualname__} on {self.world_size} ranks:\n" + "\n".join(parts))
        return results
