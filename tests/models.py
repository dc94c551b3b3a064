"""Small models that exercise the runtime's corner cases. Shapes are deliberately uneven so that
dim-0 shards differ in size across 2 and 4 ranks (and some ranks get no rows at all)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, dims=(13, 37, 29, 7)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class ConvBN(nn.Module):
    """BatchNorm: buffers follow DDP's broadcast-from-rank-0 semantics."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.head = nn.Linear(6, 5)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        return self.head(x.mean(dim=(2, 3)))


class WithUnused(nn.Module):
    """``unused`` never takes part in the loss; ``sometimes`` only on even steps (caller's flag)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(11, 19)
        self.unused = nn.Linear(19, 3)
        self.sometimes = nn.Linear(19, 19)
        self.b = nn.Linear(19, 5)
        self.use_sometimes = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.use_sometimes:
            h = torch.tanh(self.sometimes(h))
        return self.b(h)


class Branchy(nn.Module):
    """Takes a different branch on alternate calls (same on every rank)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(9, 21)
        self.left = nn.Linear(21, 21)
        self.right = nn.Sequential(nn.Linear(21, 15), nn.Tanh(), nn.Linear(15, 21))
        self.out = nn.Linear(21, 4)
        self.calls = 0

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = self.left(h) if self.calls % 2 == 0 else self.right(h)
        self.calls += 1
        return self.out(torch.tanh(h))


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(10, 23)
        self.embed.requires_grad_(False)
        self.body = nn.Linear(23, 23)
        self.head = nn.Linear(23, 6)

    def forward(self, x):
        return self.head(torch.tanh(self.body(torch.tanh(self.embed(x)))))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """Tied input/output embeddings: ``head.weight`` is ``wte.weight``."""

    def __init__(self, vocab=53, d=24, layers=2, heads=2, seq=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def make(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {
        "mlp": MLP,
        "convbn": ConvBN,
        "unused": WithUnused,
        "branchy": Branchy,
        "frozen": Frozen,
        "gpt": TinyGPT,
    }[name]()


def batch(name: str, n: int, generator: torch.Generator):
    """(inputs, targets) for ``n`` samples of model ``name``."""
    if name == "mlp":
        return torch.randn(n, 13, generator=generator), torch.randn(n, 7, generator=generator)
    if name == "convbn":
        return torch.randn(n, 3, 6, 6, generator=generator), torch.randn(n, 5, generator=generator)
    if name == "unused":
        return torch.randn(n, 11, generator=generator), torch.randn(n, 5, generator=generator)
    if name == "branchy":
        return torch.randn(n, 9, generator=generator), torch.randn(n, 4, generator=generator)
    if name == "frozen":
        return torch.randn(n, 10, generator=generator), torch.randn(n, 6, generator=generator)
    if name == "gpt":
        idx = torch.randint(0, 53, (n, 8), generator=generator)
        return idx, torch.randint(0, 53, (n, 8), generator=generator)
    raise KeyError(name)


def loss_fn(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "gpt":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return F.mse_loss(out, target)


__all__ = ["make", "batch", "loss_fn", "MLP", "ConvBN", "WithUnused", "Branchy", "Frozen", "TinyGPT", "math"]
