"""The memory budget: how many bytes a plan may use per rank.

``memory_limit`` may be an integer number of bytes, a string with a binary or decimal unit
("24GiB", "512MB", "1.5G"), or a percentage ("80%") of the device's capacity. Without one, the budget
is what the device can give: on CUDA its capacity minus what is used outside torch minus a margin;
on CPU the available host memory shared by the local ranks, minus a margin.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    import torch

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}


@dataclass(frozen=True)
class BudgetPolicy:
    """Margins kept free when the budget comes from the device.

    ``margin_fraction`` and ``min_margin_bytes``: headroom for allocator fragmentation, the CUDA
    context, and host-side Python objects (FSDP/DeepSpeed users typically leave 5-10%).
    """

    margin_fraction: float = 0.10
    min_margin_bytes: int = 512 * 1024**2


def device_capacity(device: torch.device) -> int:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().total


def _local_world_size() -> int:
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def default_budget(device: torch.device, policy: BudgetPolicy = BudgetPolicy(), *, local_ranks: int | None = None) -> int:
    """The budget per rank without ``memory_limit``. On the CPU the ranks of one host share its
    memory: ``local_ranks`` of them (default: torchrun's ``LOCAL_WORLD_SIZE``, else 1)."""
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        outside_torch = total - free - torch.cuda.memory_reserved(device)
        avail = total - max(0, outside_torch)
    else:
        avail = psutil.virtual_memory().available // (local_ranks or _local_world_size())
    margin = max(policy.min_margin_bytes, int(avail * policy.margin_fraction))
    return max(0, avail - margin)


def parse_memory_limit(limit: int | float | str | None, device: torch.device) -> int:
    """Bytes per rank for ``limit`` (see module docstring); ``None`` means the device default."""
    if limit is None:
        return default_budget(device)
    if isinstance(limit, bool):
        raise ValueError(f"memory_limit must be bytes, a size string or a percentage, got {limit!r}")
    if isinstance(limit, (int, float)):
        if not math.isfinite(limit):
            raise ValueError(
                f"memory_limit={limit!r} is not a number of bytes; pass a finite size (bytes, '24GiB' or '80%'), "
                "or leave it None to use what the device has free"
            )
        if limit < 1:
            raise ValueError(f"memory_limit must be at least 1 byte, got {limit!r}")
        return int(limit)
    text = str(limit).strip().lower().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)%", text)
    if m:
        pct = float(m.group(1))
        if not 0 < pct <= 100:
            raise ValueError(f"memory_limit percentage must be in (0, 100], got {limit!r}")
        cap = device_capacity(device)
        if device.type == "cpu":
            cap //= _local_world_size()
        return int(cap * pct / 100)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", text)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(
            f"cannot parse memory_limit {limit!r}; use bytes (8000000000), a size such as '24GiB' or "
            "'512MB', or a percentage of the device such as '80%'"
        )
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if value < 1:
        raise ValueError(f"memory_limit must be at least 1 byte, got {limit!r}")
    return int(value)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
