"""The session's seed of comm models (tests/conftest.py), set or unset in a process: a module of its
own, so that rank processes import it by name without running the conftest."""

import os

VARIABLE = "AUTODIST_COMM_SEED"


def set_seed(value: str | None) -> None:
    """Use the seed at ``value`` in this process (``None``: none)."""
    if value is None:
        os.environ.pop(VARIABLE, None)
    else:
        os.environ[VARIABLE] = value
