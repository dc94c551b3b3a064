"""Models used by the examples, the benchmark and the simulator check.

Each entry builds a model and makes batches for it, so every tool runs the same workloads:
``ZOO[name](size).build()``, ``.batch(n, generator)`` → ``(inputs, targets)``, ``.loss(out, target)``.
The GPT here is a plain single-device model written for this project (tied input/output
embeddings, pre-norm blocks); the ResNet comes from torchvision (the ``vision`` extra).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


# ----------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT-2-style decoder; ``head.weight`` is tied to ``wte.weight``."""

    def __init__(self, vocab: int = 8192, d: int = 256, layers: int = 4, heads: int = 4, seq: int = 128) -> None:
        super().__init__()
        self.seq = seq
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if name.endswith("out.weight") or name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
            elif p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ----------------------------------------------------------------------------------------------
# workloads
# ----------------------------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    default_batch: int  # per rank
    unit: str = "samples"  # what a throughput number counts
    tokens_per_sample: int = 1


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def mlp_workload(name: str, dims: list[int], batch: int) -> Workload:
    def make_batch(n: int, g: torch.Generator):
        return torch.randn(n, dims[0], generator=g), torch.randn(n, dims[-1], generator=g)

    return Workload(name, lambda: MLP(dims), make_batch, _mse, batch)


def gpt_workload(name: str, *, vocab: int, d: int, layers: int, heads: int, seq: int, batch: int) -> Workload:
    def make_batch(n: int, g: torch.Generator):
        idx = torch.randint(0, vocab, (n, seq + 1), generator=g)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    return Workload(
        name, lambda: GPT(vocab, d, layers, heads, seq), make_batch, _ce, batch, unit="tokens", tokens_per_sample=seq
    )


def resnet_workload(name: str, arch: str, image: int, classes: int, batch: int) -> Workload:
    def build() -> nn.Module:
        try:
            import torchvision
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                f"the {name} workload needs torchvision: pip install 'autodist[vision]'"
            ) from e
        return getattr(torchvision.models, arch)(num_classes=classes)

    def make_batch(n: int, g: torch.Generator):
        return torch.randn(n, 3, image, image, generator=g), torch.randint(0, classes, (n,), generator=g)

    return Workload(name, build, make_batch, _ce, batch, unit="images")


def zoo(size: str = "default") -> dict[str, Workload]:
    """The named workloads. ``size="tiny"`` shrinks everything for tests; ``"gpu"`` has the two GPTs
    and resnet18 at one GPU's scale."""
    if size == "tiny":
        return {
            "wide-mlp": mlp_workload("wide-mlp", [64, 256, 256, 64], 8),
            "deep-mlp": mlp_workload("deep-mlp", [32] + [48] * 8 + [16], 8),
            "resnet18": resnet_workload("resnet18", "resnet18", 16, 10, 2),
            "gpt": gpt_workload("gpt", vocab=256, d=32, layers=2, heads=2, seq=16, batch=2),
            "gpt-deep": gpt_workload("gpt-deep", vocab=256, d=32, layers=6, heads=2, seq=8, batch=2),
        }
    if size == "gpu":
        # one GPU's scale: a GPT of large layers (d=1024 x 12) and one of many small layers, as in
        # the first GPU runs; resnet18 on ImageNet-sized images
        return {
            "resnet18": resnet_workload("resnet18", "resnet18", 224, 1000, 64),
            "gpt": gpt_workload("gpt", vocab=32768, d=1024, layers=12, heads=16, seq=512, batch=8),
            "gpt-deep": gpt_workload("gpt-deep", vocab=8192, d=256, layers=24, heads=4, seq=256, batch=8),
        }
    if size != "default":
        raise ValueError(f"zoo size must be 'default', 'tiny' or 'gpu'; got {size!r}")
    return {
        "wide-mlp": mlp_workload("wide-mlp", [1024, 4096, 4096, 4096, 1024], 32),
        "deep-mlp": mlp_workload("deep-mlp", [256] + [256] * 32 + [64], 64),
        "resnet18": resnet_workload("resnet18", "resnet18", 32, 10, 16),
        "gpt": gpt_workload("gpt", vocab=8192, d=256, layers=4, heads=4, seq=128, batch=4),
        # dispatch-bound: 48 layers so small that a step's time goes to per-layer CPU work (kernel
        # launches, hooks), not arithmetic — where a wrapper's per-step overhead shows
        "gpt-deep": gpt_workload("gpt-deep", vocab=256, d=32, layers=48, heads=2, seq=8, batch=2),
    }


def gpt(vocab: int = 8192, d: int = 256, layers: int = 4, heads: int = 4, seq: int = 128) -> GPT:
    """Factory for ``autodist plan --model autodist.zoo:gpt``."""
    return GPT(vocab, d, layers, heads, seq)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (what ``fully_shard`` is applied to), by AutoDist's own definition."""
    from .structure import find_blocks

    return [model.get_submodule(name) for name in find_blocks(model)]
