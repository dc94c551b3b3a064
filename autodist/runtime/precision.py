"""Mixed precision: the policy (:class:`MixedPrecision`, as FSDP2's ``MixedPrecisionPolicy``) and
the cast of the root forward's floating-point inputs to its compute dtype (:func:`cast_floats`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn
from torch.torch_version import TorchVersion

T = TypeVar("T")


# torch 2.15 changed FSDP2's MixedPrecisionPolicy(reduce_dtype=None) from reducing in param_dtype to
# reducing in the parameter's own dtype (see its docstring's "versionchanged")
_FSDP2_REDUCES_IN_ORIGINAL_DTYPE = TorchVersion(torch.__version__) >= "2.15"


@dataclass
class MixedPrecision:
    """Compute and reduction dtypes, as FSDP2's ``MixedPrecisionPolicy``.

    ``param_dtype``: dtype of the full parameters used in forward/backward (and of all-gathers);
    master parameters and optimizer state keep their own dtype. ``reduce_dtype``: dtype gradients
    are reduced in (default: ``param_dtype``, as FSDP2 before torch 2.15; a torch policy passed instead
    keeps its own default, see ``coerce``). ``cast_forward_inputs``: cast floating-point inputs of
    the root forward to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    # [Note: batch norm keeps its dtype] BatchNorm's kernels (CPU and cuDNN) take an input of a
    # lower precision than the layer's parameters and running statistics, but not parameters of a
    # dtype other than the statistics' ("Expected running_mean to have type BFloat16 but got
    # Float"): casting its weight and bias to ``param_dtype`` while the statistics stay float32 fails
    # the first forward, and casting the statistics too would accumulate them in bf16. So the
    # parameters of BatchNorm layers keep their own dtype under a policy (as FSDP1's
    # ``MixedPrecision`` did by default and torch.autocast does): the runtime makes no compute copy
    # of them, the profile measures them so, and the simulator sizes them in their dtype. Their
    # gradients are reduced in ``reduce_dtype`` like every other.

    @classmethod
    def coerce(cls, policy: object, module: nn.Module | None = None) -> MixedPrecision | None:
        """``policy`` as a ``MixedPrecision``. torch's ``MixedPrecisionPolicy`` keeps its own meaning of
        ``reduce_dtype=None``: from torch 2.15 FSDP2 reduces each gradient in its parameter's dtype
        (before, in ``param_dtype``, as ``MixedPrecision`` does), so it is resolved against
        ``module``'s trainable floating-point parameters (frozen ones have no gradient to reduce)."""
        if policy is None or isinstance(policy, MixedPrecision):
            return policy
        if hasattr(policy, "param_dtype") and hasattr(policy, "reduce_dtype"):
            reduce_dtype = policy.reduce_dtype
            if reduce_dtype is None and policy.param_dtype is not None and module is not None and _FSDP2_REDUCES_IN_ORIGINAL_DTYPE:
                dtypes = {p.dtype for p in module.parameters() if p.is_floating_point() and p.requires_grad}
                if len(dtypes) > 1:
                    raise ValueError(
                        f"torch's MixedPrecisionPolicy with reduce_dtype=None reduces each gradient in its parameter's "
                        f"dtype (torch >= 2.15), and this model's parameters have several ({sorted(map(str, dtypes))}); "
                        "AutoDist reduces in one dtype: set reduce_dtype explicitly"
                    )
                reduce_dtype = dtypes.pop() if dtypes else None
            return cls(
                param_dtype=policy.param_dtype,
                reduce_dtype=reduce_dtype,
                cast_forward_inputs=getattr(policy, "cast_forward_inputs", True),
            )
        raise TypeError(
            f"mixed_precision must be autodist.MixedPrecision or torch's MixedPrecisionPolicy, got {type(policy).__name__}"
        )


def keeps_dtype(module: nn.Module) -> bool:
    """Whether ``module``'s parameters keep their dtype under a mixed-precision policy
    ([Note: batch norm keeps its dtype])."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def cast_by_policy(module: nn.Module, dtype: torch.dtype) -> list[nn.Parameter]:
    """The parameters of ``module`` a policy computing in ``dtype`` makes copies of: the
    floating-point ones of another dtype, but those of modules that keep theirs (:func:`keeps_dtype`)."""
    own = {id(p) for m in module.modules() if keeps_dtype(m) for p in m.parameters(recurse=False)}
    return [p for p in module.parameters() if p.is_floating_point() and p.dtype != dtype and id(p) not in own]


def cast_floats(tree: T, dtype: torch.dtype) -> T:
    """``tree`` with its floating-point tensors in ``dtype`` (the same containers)."""
    from torch.utils._pytree import tree_map

    def cast(x: object) -> object:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    out: T = tree_map(cast, tree)
    return out
