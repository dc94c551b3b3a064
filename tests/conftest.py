import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# One pass per comm sweep (the default is three; autodist/measure/sweep.py [Note: a sweep in passes]):
# the passes' combination is tested on its own (tests/test_comm_model.py). Ranks and launched scripts
# inherit it.
os.environ.setdefault("AUTODIST_SWEEP_PASSES", "1")
# The comm models of this session's machines ([Note: a seed of comm models] in autodist/planner/
# online.py): every test's fresh cache starts from them. The session's seed starts from the ones
# committed under tests/comm-seed/ (tests/comm_seed.py: world sizes 2 and 4, every collective at
# every size), so no test that plans with plan="auto" sweeps; where they hold nothing for this
# machine (another torch), a comm model is measured once per session and world size (and extended
# when a later test's model needs larger messages). Tests whose subject is the sweep are marked
# `sweeps` and run without the seed. Set before any rank or launched script starts: they inherit it.
_SEED = tempfile.mkdtemp(prefix="autodist-comm-seed-")
os.environ["AUTODIST_COMM_SEED"] = _SEED

from comm_seed import set_seed, start  # noqa: E402

start(_SEED)

from harness import RankPool  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "sweeps: the test's subject is the comm sweep; it runs without the session's "
                                       "seed of comm models (AUTODIST_COMM_SEED), from an empty cache")


def pytest_unconfigure(config):
    shutil.rmtree(_SEED, ignore_errors=True)


@pytest.fixture(autouse=True)
def _unseeded_where_the_sweep_is_the_subject(request):
    """A test marked ``sweeps`` runs without the seed, here and in the ranks of the pools it uses."""
    if request.node.get_closest_marker("sweeps") is None:
        yield
        return
    pools = [request.getfixturevalue(name) for name in ("world2", "world4") if name in request.fixturenames]
    set_seed(None)
    for pool in pools:
        pool.run(set_seed, None)
    try:
        yield
    finally:
        set_seed(_SEED)
        for pool in pools:
            if pool.alive:
                pool.run(set_seed, _SEED)


@pytest.fixture(scope="session")
def world2():
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def world4():
    pool = RankPool(4)
    yield pool
    pool.close()
