"""AutoDist: drop-in data parallelism for PyTorch that plans its own communication.

``model = AutoDist(model, plan="auto")`` replaces ``DistributedDataParallel`` / ``fully_shard``.

The public names are imported on first use (PEP 562), so ``import autodist`` — and the ``autodist``
command's help, version and cache subcommands — do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "AutoDist": ".wrapper",
    "AutoDistError": ".errors",
    "BudgetError": ".errors",
    "PlanError": ".errors",
    "RankMismatchError": ".errors",
    "Bucket": ".plan",
    "BucketRebuild": ".plan",
    "GatherGroup": ".plan",
    "OffloadFragment": ".plan",
    "Plan": ".plan",
    "Prefetch": ".plan",
    "UnitPlan": ".plan",
    "load_plan": ".plan",
    "save_plan": ".plan",
    "validate_plan": ".plan",
    "MixedPrecision": ".runtime.precision",
}

__all__ = [
    "AutoDist",
    "AutoDistError",
    "Bucket",
    "BucketRebuild",
    "BudgetError",
    "GatherGroup",
    "MixedPrecision",
    "OffloadFragment",
    "Plan",
    "PlanError",
    "Prefetch",
    "RankMismatchError",
    "UnitPlan",
    "load_plan",
    "save_plan",
    "validate_plan",
    "__version__",
]

if TYPE_CHECKING:
    from .errors import AutoDistError, BudgetError, PlanError, RankMismatchError
    from .plan import (
        Bucket,
        BucketRebuild,
        GatherGroup,
        OffloadFragment,
        Plan,
        Prefetch,
        UnitPlan,
        load_plan,
        save_plan,
        validate_plan,
    )
    from .runtime.precision import MixedPrecision
    from .wrapper import AutoDist


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autodist' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
