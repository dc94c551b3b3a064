"""The cache's keys: what identifies a machine, a model's profile, a plan and a placement.

A key is a short digest of the facts that decide an entry (:func:`digest`); two launches that agree
on those facts share the entry, and a launch that differs in any of them (another budget, another
torch) measures or plans again. The machine's facts (:func:`machine`) are built here only: the comm
model, the fidelity record and the learned estimator of a machine are stored under
:func:`machine_key`, and the plan key holds them too, so ``plan="auto"``, ``autodist plan`` and
``autodist check`` find one another's entries.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten


def digest(parts: dict[str, Any]) -> str:
    """A stable short key for a dict of identifying facts."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def device_name(device: torch.device) -> str:
    """What tells one device of a type from another in a key: the GPU's name; ``"cpu"`` on the CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def default_backend(device: torch.device) -> str:
    """The backend a process group on ``device`` uses by default (gloo on the CPU, NCCL on CUDA)."""
    return "gloo" if device.type == "cpu" else str(dist.get_default_backend_for_device(device))


def machine_facts(world: int, device_type: str, name: str, backend: str) -> dict[str, Any]:
    """The facts of a machine a comm model, fidelity record or estimator holds for: world size, device
    type and name, backend and torch version."""
    return {"world": world, "device": device_type, "device_name": name, "backend": backend, "torch": torch.__version__}


def machine(world: int, device: torch.device, backend: str | None = None) -> dict[str, Any]:
    """:func:`machine_facts` of ``world`` ranks on ``device`` with ``backend`` (default: the device's)."""
    return machine_facts(world, device.type, device_name(device), backend or default_backend(device))


def machine_key(facts: dict[str, Any]) -> str:
    """The key of a machine's comm model, fidelity record and learned estimator."""
    return digest(facts)


def comm_cache_key(world: int, device_type: str, name: str, backend: str) -> str:
    """:func:`machine_key` from the facts themselves (the tools and tests, which name them)."""
    return machine_key(machine_facts(world, device_type, name, backend))


def input_signature(tree: Any) -> str:
    """The shapes and dtypes of a forward's inputs (its ``(args, kwargs)``), as a key part."""
    leaves = tree_flatten(tree)[0]
    parts = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append(f"{tuple(x.shape)}:{str(x.dtype).replace('torch.', '')}")
        else:
            parts.append(type(x).__name__)
    return ";".join(parts)


def profile_cache_key(structure: Any, sig: str, name: str, **more: Any) -> str:
    """The key of a model's profile in the cache: the model's structure, the input signature
    (:func:`input_signature`), the device's name and torch version, and ``more`` (``autodist plan``
    keeps its single-process profiles apart from a job's, which are merged over ranks; a profile taken
    under a mixed-precision policy is apart from the full-precision one, and one with its blocks
    also timed compiled apart from one without)."""
    return digest({"model": structure.fingerprint(), "input": sig, "device": name, "torch": torch.__version__, **more})


def plan_cache_key(profile_key: str, facts: dict[str, Any], **decided_by: Any) -> str:
    """The key of a searched plan: its profile's key, the machine's facts, and everything else that
    decides the plan (``decided_by``: budget, optimizer kind, plan schema, micro-batches, margins,
    calibration, mixed precision and, only where they are used, the learned estimator and the
    backend blocks may be compiled with: ``AutoDist(compile=...)``)."""
    return digest({"profile": profile_key, **facts, **decided_by})


def placement_key(structure: Any, facts: dict[str, Any], budget: Any) -> str:
    """The key of the placement stored for a model on a machine under a budget."""
    return digest({"model": structure.fingerprint(), **facts, "budget": budget})
