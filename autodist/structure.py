"""What AutoDist knows about a model before running it: parameters, units and blocks.

A **unit** is a module that directly owns parameters; its parameters are managed together and hooks
are installed per unit. A parameter registered on several modules (tied weights) belongs to the unit
of the first module that registers it; the other modules are extra *sites* of that parameter, and
their forward hooks make sure the owning unit is gathered too.

A **block** is one repeated element of the model (a transformer layer, a ResNet BasicBlock): the
children of the shallowest ``nn.ModuleList``/``nn.Sequential`` containers that hold two or more
parameter-bearing children. Blocks are what ``fully_shard`` is applied to by convention, and the
built-in ``fsdp`` plan groups gathers by them.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from .runtime.precision import keeps_dtype

ROOT_UNIT = "(root)"


def unit_name(module_name: str) -> str:
    return module_name if module_name else ROOT_UNIT


def module_name_of_unit(name: str) -> str:
    return "" if name == ROOT_UNIT else name


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    sites: tuple[tuple[str, str], ...]  # (module name, attribute) for every registration
    # computed in its own dtype under mixed precision ([Note: batch norm keeps its dtype])
    keeps_dtype: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class UnitInfo:
    name: str
    module_name: str
    params: list[str]
    module_type: str
    block: str | None = None  # name of the block this unit lies in, if any


@dataclass
class ModelStructure:
    """Parameters (registration order), units (registration order) and blocks of a model."""

    params: dict[str, ParamInfo]
    units: list[UnitInfo]
    blocks: list[str]
    module_types: dict[str, str] = field(default_factory=dict)
    # module name -> units (of its descendants) whose parameters its own code reads directly
    functional_uses: dict[str, list[str]] = field(default_factory=dict)

    def unit(self, name: str) -> UnitInfo:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)

    @property
    def unit_of_param(self) -> dict[str, str]:
        return {p: u.name for u in self.units for p in u.params}

    @property
    def trainable(self) -> list[str]:
        return [n for n, p in self.params.items() if p.requires_grad]

    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.params.values())

    def fingerprint(self) -> str:
        """Hash of parameter names, shapes, dtypes, trainability and module types."""
        payload = {
            "params": [
                [p.name, list(p.shape), str(p.dtype), p.requires_grad, [list(s) for s in p.sites]]
                for p in self.params.values()
            ],
            "modules": sorted(self.module_types.items()),
        }
        blob = json.dumps(payload, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def find_blocks(model: nn.Module) -> list[str]:
    """Names of the model's repeated blocks (see module docstring), in registration order."""
    blocks: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            bearing = [(n, c) for n, c in module.named_children() if _has_params(c)]
            if len(bearing) >= 2:
                blocks.extend(f"{prefix}{n}" for n, _ in bearing)
                return
        for n, c in module.named_children():
            visit(c, f"{prefix}{n}.")

    visit(model, "")
    if not blocks:  # no repeated structure: each parameter-bearing top-level child is a block
        blocks = [n for n, c in model.named_children() if _has_params(c)]
    return blocks


_ATTR_CHAIN = re.compile(r"\bself((?:\.[A-Za-z_]\w*)+)")


_NOT_FORWARD = {"extra_repr", "__setstate__", "__repr__"}


def _initialiser(method: str) -> bool:
    """Whether a method is not run by a forward: constructors and initialisers by name
    (``__init__``, ``reset_parameters``, ``init_weights``, timm's ``zero_init_last``, which reads
    ``self.bn2.weight``: taken for a use, it held BatchNorm's gathered weight across the whole
    residual block and gathered it again on demand in every backward), and a few dunders."""
    lowered = method.lower()
    return method in _NOT_FORWARD or "init" in lowered or lowered.lstrip("_").startswith("reset")


def _class_source(cls: type, cache: dict[type, str]) -> str:
    """The source of the methods of ``cls`` and its bases up to ``nn.Module`` that can run during a
    forward (constructors and initialisers excluded); empty where it is unavailable."""
    if cls in cache:
        return cache[cls]
    parts = []
    for base in cls.__mro__:
        if base is nn.Module or base is object:
            break
        for name, fn in vars(base).items():
            if _initialiser(name) or not inspect.isfunction(fn):
                continue
            try:
                parts.append(inspect.getsource(fn))
            except (OSError, TypeError):
                continue
    cache[cls] = "\n".join(parts)
    return cache[cls]


def find_functional_uses(model: nn.Module, owned: dict[str, list[str]]) -> dict[str, list[str]]:
    """Modules whose own code reads a descendant's parameter directly (``self.out_proj.weight`` in
    ``nn.MultiheadAttention.forward``, a head computed as ``x @ self.embed.weight.T``) instead of
    calling the descendant: that descendant's unit must be gathered (and cast) while the module
    runs. Found by reading each module class's source for ``self.<path>.<parameter>`` where
    ``<path>`` names a descendant that owns ``<parameter>``; a reference that is never executed only
    gathers a little early. ``owned``: module name -> names of the parameters it owns (units)."""
    cache: dict[type, str] = {}
    out: dict[str, list[str]] = {}
    owner_attr = {(m, p.rsplit(".", 1)[-1]) for m, ps in owned.items() for p in ps}
    for mname, module in model.named_modules():
        if not any(True for _ in module.children()):
            continue
        src = _class_source(type(module), cache)
        if not src:
            continue
        found: list[str] = []
        for chain in _ATTR_CHAIN.findall(src):
            names = chain.lstrip(".").split(".")
            for cut in range(1, len(names)):
                path, attr = ".".join(names[:cut]), names[cut]
                sub = f"{mname}.{path}" if mname else path
                if (sub, attr) in owner_attr:
                    unit = unit_name(sub)
                    if unit not in found:
                        found.append(unit)
                    break
        if found:
            out[mname] = found
    return out


def discover(model: nn.Module) -> ModelStructure:
    """Inspect ``model`` without running it."""
    sites: dict[int, list[tuple[str, str]]] = {}
    keeps: dict[int, bool] = {}
    first: dict[int, tuple[str, nn.Parameter]] = {}
    module_types: dict[str, str] = {}
    owner_order: list[str] = []
    owned: dict[str, list[str]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        module_types.setdefault(mname, type(module).__name__)
        for attr, p in module._parameters.items():
            if p is None:
                continue
            pname = f"{mname}.{attr}" if mname else attr
            sites.setdefault(id(p), []).append((mname, attr))
            keeps[id(p)] = keeps.get(id(p), False) or keeps_dtype(module)
            if id(p) not in first:
                first[id(p)] = (pname, p)
                if mname not in owned:
                    owned[mname] = []
                    owner_order.append(mname)
                owned[mname].append(pname)
    params: dict[str, ParamInfo] = {}
    for pid, (pname, p) in first.items():
        params[pname] = ParamInfo(
            name=pname,
            shape=tuple(p.shape),
            dtype=p.dtype,
            requires_grad=p.requires_grad,
            sites=tuple(sites[pid]),
            keeps_dtype=keeps[pid],
        )
    blocks = find_blocks(model)
    units = []
    for mname in owner_order:
        block = next((b for b in blocks if mname == b or mname.startswith(b + ".")), None)
        units.append(
            UnitInfo(
                name=unit_name(mname),
                module_name=mname,
                params=owned[mname],
                module_type=module_types[mname],
                block=block,
            )
        )
    return ModelStructure(
        params=params, units=units, blocks=blocks, module_types=module_types,
        functional_uses=find_functional_uses(model, owned),
    )
