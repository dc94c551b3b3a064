import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

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
