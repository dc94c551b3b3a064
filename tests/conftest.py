import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# One pass per comm sweep (the default is three; autodist/measure/sweep.py [Note: a sweep in passes]):
# the suite sweeps in many tests, each from a fresh cache. The passes' combination is tested on its
# own (tests/test_comm_model.py). Ranks and launched scripts inherit it.
os.environ.setdefault("AUTODIST_SWEEP_PASSES", "1")

from harness import RankPool  # noqa: E402


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
