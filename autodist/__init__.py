"""AutoDist: drop-in data parallelism for PyTorch that plans its own communication.

``model = AutoDist(model, plan="auto")`` replaces ``DistributedDataParallel`` / ``fully_shard``.
"""

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
from .runtime.engine import MixedPrecision
from .wrapper import AutoDist

__version__ = "0.1.0"

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
