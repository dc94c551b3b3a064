"""The switch behind which ``plan="auto"`` consults the learned estimator (``autodist/lab/learned.py``).

[Note: when plan="auto" uses the learned estimator] The switch is an estimator stored for the
machine (``estimators/<machine key>.json``, written by ``tools/train_estimator.py``). None stored,
the default: the lab is not imported, the search uses the analytic simulator alone and the plan key
holds no estimator. One stored: it is read and checked; it is used only where its held-out
validation met ``HELPS_RULE`` (``autodist/lab/learned.py``) and torch_geometric is installed, and
then only to rank the search's finalists: the analytic simulator searches (thousands of plans), the
corrected one chooses among the best of them and the built-in seeds, under the same budget and
margins. A plan it ranked is cached apart (the plan key holds a digest of the estimator's
provenance); an unhelpful or unusable one is reported once and planning goes on as without one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..cost.simulator import DurationEstimator
from .cache import Cache
from .keys import digest


def switched_on(cache: Cache, key: str) -> bool:
    """Whether an estimator is stored for the machine of ``key`` (:func:`~.keys.machine_key`)."""
    return cache.path("estimators", key).is_file()


def entry_parser(facts: dict[str, Any]) -> Callable[[str], Any]:
    """The parser of a stored estimator entry for the machine of ``facts`` (imports the lab when called)."""

    def parse(text: str) -> Any:
        from ..lab.learned import estimator_entry

        return estimator_entry(text, facts)

    return parse


def stored_estimator(
    cache: Cache, key: str, facts: dict[str, Any],
) -> tuple[DurationEstimator | None, str | None]:
    """The estimator ``plan="auto"`` may rank with on this machine, and what tells it from another (a
    digest of its provenance); ``(None, None)`` when the switch is off or the stored one may not be used."""
    if not switched_on(cache, key):
        return None, None
    found = cache.get("estimators", key, entry_parser(facts))  # checked even where it cannot be used
    if found is None:
        return None, None
    entry, estimator = found
    if not entry.helps:
        cache.once.info(
            "estimator-unhelpful",
            "autodist: the learned estimator stored for this machine did not beat the analytic simulator on "
            "held-out models; planning with the analytic simulator",
        )
        return None, None
    if estimator is None:
        cache.once.info(
            "estimator-no-gnn",
            "autodist: a learned estimator is stored for this machine; pip install 'autodist[gnn]' to plan with it",
        )
        return None, None
    return estimator, digest(entry.provenance)
