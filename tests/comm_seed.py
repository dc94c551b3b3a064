"""The session's seed of comm models (tests/conftest.py), set or unset in a process: a module of its
own, so that rank processes import it by name without running the conftest.

The seed starts from the comm models committed under ``tests/comm-seed/`` (a cache directory: one
per world size the suite plans on, measured in full on 2 CPU ranks of the development host), so the
suite plans with ``plan="auto"`` without sweeping; a model that needs more than they hold measures
what is missing into the session's copy ([Note: a seed of comm models] in autodist/planner/online.py).
They are keyed by world size, device, backend and torch version: under another torch the seed holds
nothing for the machine and the suite measures its comm models once per session, as it would
without them. Made again (after a change to what the sweep measures, or a new torch) with

    python tests/comm_seed.py            # world sizes 2 and 4, about 5 minutes on 2 CPU cores
"""

import os
import shutil
import subprocess
import sys

VARIABLE = "AUTODIST_COMM_SEED"
COMMITTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "comm-seed")
WORLDS = (2, 4)  # the suite's rank pools (tests/conftest.py world2, world4)


def set_seed(value: str | None) -> None:
    """Use the seed at ``value`` in this process (``None``: none)."""
    if value is None:
        os.environ.pop(VARIABLE, None)
    else:
        os.environ[VARIABLE] = value


def start(directory: str) -> None:
    """Copy the committed comm models into ``directory``, the session's seed (which the session may add to)."""
    committed = os.path.join(COMMITTED, "comm")
    if os.path.isdir(committed):
        shutil.copytree(committed, os.path.join(directory, "comm"), dirs_exist_ok=True)


def _measure(directory: str) -> None:
    """On every rank of a torchrun job: sweep every collective at every size, store it in ``directory``."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from autodist.measure.sweep import sweep
    from autodist.planner import keys
    from autodist.planner.cache import Cache

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    device = torch.device("cpu")
    group = dist.group.WORLD
    assert group is not None  # the default group, just made
    model = sweep(group, device)
    if dist.get_rank() == 0:
        key = keys.machine_key(keys.machine(dist.get_world_size(), device, "gloo"))
        Cache(directory).put("comm", key, model.to_json())
        print(f"world {dist.get_world_size()}: {key} in {model.meta['sweep_seconds']:.0f} s "
              f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    dist.destroy_process_group()


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        _measure(sys.argv[2])
        return 0
    env = {k: v for k, v in os.environ.items() if k not in (VARIABLE, "AUTODIST_SWEEP_PASSES")}
    env["OMP_NUM_THREADS"] = "1"
    shutil.rmtree(os.path.join(COMMITTED, "comm"), ignore_errors=True)
    for world in WORLDS:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               os.path.abspath(__file__), "--worker", COMMITTED]
        rc = subprocess.run(cmd, env=env).returncode
        if rc != 0:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
