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


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1, momentum: float | None = 0.1, inplace: bool = False):
        super().__init__()
        self.inplace = inplace
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout, momentum=momentum)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def zero_init_last(self):
        """As timm's blocks have it: reads ``self.bn2.weight``, never during a forward."""
        nn.init.zeros_(self.bn2.weight)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        shortcut = x if self.down is None else self.down(x)
        if self.inplace:  # as timm and torchvision write it
            h += shortcut
            return F.relu(h)
        return F.relu(h + shortcut)


class TinyResNet(nn.Module):
    """A residual network with BatchNorm in every block (one with a cumulative average, which
    reads its batch counter): recomputing a block must not update the running statistics twice."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(
            ResidualBlock(8, 8, inplace=inplace), ResidualBlock(8, 12, stride=2, momentum=None, inplace=inplace), ResidualBlock(12, 12, inplace=inplace)
        )
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


class LayerScaleBlock(nn.Module):
    """A unit that owns a parameter and calls other units (ConvNeXt's block: its layer scale is
    applied after its MLP)."""

    def __init__(self, d: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), 0.5))
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.gamma * self.fc2(torch.tanh(self.fc1(self.norm(x))))


class NestedMLP(nn.Module):
    """Units inside units: the root owns an input offset used first and an output scale used last
    (as a ViT's root owns its position embedding), and each block owns its layer scale."""

    def __init__(self):
        super().__init__()
        self.offset = nn.Parameter(torch.randn(13) * 0.1)
        self.scale = nn.Parameter(torch.ones(7))
        self.inp = nn.Linear(13, 16)
        self.blocks = nn.ModuleList(LayerScaleBlock(16) for _ in range(3))
        self.out = nn.Linear(16, 7)

    def forward(self, x):
        h = self.inp(x + self.offset)
        for block in self.blocks:
            h = block(h)
        return self.out(h) * self.scale


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


class SparseEmbed(nn.Module):
    """An embedding with sparse gradients (``sparse=True``, as recommender models use) and a head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(53, 12, sparse=True)
        self.head = nn.Linear(12, 7)

    def forward(self, idx):
        return self.head(torch.tanh(self.embed(idx).mean(1)))


class MixtureOfExperts(nn.Module):
    """Top-1 routing over experts kept as separate modules, each run only on the tokens routed to
    it (as mixture-of-experts code written with a loop over an ``nn.ModuleList`` does): an expert
    no token of a rank's batch chose is left out of that rank's forward and backward, while the
    other ranks run it. ``dense``: every expert runs, on no tokens if none chose it (the usual
    workaround under FSDP), so no unit is left out and the outputs are the same."""

    def __init__(self, experts: int = 4, dense: bool = False):
        super().__init__()
        self.dense = dense
        self.inp = nn.Linear(9, 21)
        self.gate = nn.Linear(21, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(21, 17), nn.Tanh(), nn.Linear(17, 21)) for _ in range(experts))
        self.out = nn.Linear(21, 4)
        self.ran: list[list[int]] = []  # the experts each forward ran

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        prob = torch.softmax(self.gate(h), dim=-1)
        choice = prob.argmax(-1)
        y = torch.zeros_like(h)
        ran = []
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(-1)
            if idx.numel() or self.dense:
                ran.append(e)
                y = y.index_add(0, idx, expert(h[idx]) * prob[idx, e : e + 1])
        self.ran.append(ran)
        return self.out(torch.tanh(y + h))


class WeightNormed(nn.Module):
    """torch's deprecated ``nn.utils.weight_norm`` (a forward pre-hook that computes ``weight``
    from the parameters ``weight_g`` and ``weight_v``; audio models keep it) and a spectral-norm
    parametrization (a property computed from ``parametrizations.weight.original``)."""

    def __init__(self):
        super().__init__()
        import warnings

        from torch.nn.utils import parametrizations

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # weight_norm's deprecation
            self.inp = nn.utils.weight_norm(nn.Linear(13, 16))
            self.mid = nn.utils.weight_norm(nn.Linear(16, 16))
        self.out = parametrizations.spectral_norm(nn.Linear(16, 7))

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


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
    """Tied input/output embeddings: ``head.weight`` is ``wte.weight`` (unless ``tied=False``)."""

    def __init__(self, vocab=53, d=24, layers=2, heads=2, seq=8, tied=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class CheckpointedBlock(Block):
    """A block that checkpoints itself the way model code does (``torch.utils.checkpoint``)."""

    def __init__(self, d, heads, mode):
        super().__init__(d, heads)
        self.mode = mode

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        if self.mode == "reentrant":
            return checkpoint(super().forward, x, use_reentrant=True)
        if self.mode == "selective":
            from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

            def policy(ctx, op, *args, **kwargs):
                keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

            return checkpoint(
                super().forward, x, use_reentrant=False,
                context_fn=lambda: create_selective_checkpoint_contexts(policy),
            )
        return checkpoint(super().forward, x, use_reentrant=False)


class CheckpointedGPT(TinyGPT):
    """TinyGPT with activation checkpointing of its blocks, as users write it: ``mode`` is
    ``nonreentrant``/``reentrant``/``selective`` (in the block's forward), or ``wrapper`` (torch's
    ``apply_activation_checkpointing``); ``every`` checkpoints every n-th block only."""

    def __init__(self, mode, every=1, layers=2):
        super().__init__(layers=layers)
        if mode == "wrapper":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                apply_activation_checkpointing,
                checkpoint_wrapper,
            )

            targets = {id(b) for i, b in enumerate(self.blocks) if i % every == 0}
            apply_activation_checkpointing(self, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: id(m) in targets)
            return
        for i, blk in enumerate(self.blocks):
            if i % every == 0:
                new = CheckpointedBlock(blk.qkv.in_features, blk.heads, mode)
                new.load_state_dict(blk.state_dict())
                self.blocks[i] = new


class SkippingGPT(TinyGPT):
    """Block 1 runs only on every other call (the same on every rank): control flow that changes
    between steps over a sharded unit."""

    def __init__(self):
        super().__init__(layers=3)
        self.calls = 0

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for i, blk in enumerate(self.blocks):
            if i != 1 or self.calls % 2:
                x = blk(x)
        self.calls += 1
        return self.head(self.ln_f(x))


class TorchTransformer(nn.Module):
    """PyTorch's own encoder layer: ``nn.MultiheadAttention`` reads ``out_proj.weight`` in its
    forward without calling ``out_proj``."""

    def __init__(self, vocab=53, d=16, layers=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True) for _ in range(layers)
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.wte(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class LateReadLinear(nn.Linear):
    """Its backward reads the full weight after the weight's gradient was produced: the detached
    product is created first, so autograd runs its backward last."""

    def forward(self, x):
        z = F.linear(x, self.weight.detach())
        return F.linear(x, self.weight, self.bias) * torch.tanh(z)


class LateRead(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(9, 16)
        self.mid = LateReadLinear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.mid(torch.tanh(self.inp(x))))


class MixedDtypes(nn.Module):
    """float32, float64 and bfloat16 parameters in one model."""

    def __init__(self, bf16=True):
        super().__init__()
        self.a = nn.Linear(9, 12)
        self.b = nn.Linear(12, 12).double()
        self.c = nn.Linear(12, 4)
        if bf16:
            self.c.bfloat16()

    def forward(self, x):
        h = torch.tanh(self.a(x)).double()
        h = torch.tanh(self.b(h)).to(self.c.weight.dtype)
        return self.c(h).float()


def hf_gpt2() -> nn.Module:
    """A Hugging Face GPT-2 of two layers, dropout off (an optional test dependency: tests that
    use one skip without transformers)."""
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def hf_gpt2_steps(wrapped: nn.Module, ref: nn.Module, steps: int) -> None:
    """``steps`` steps of SGD with momentum on language-model batches: ``wrapped`` on this rank's,
    ``ref`` (one process) on every rank's, its loss averaged over them."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        every = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world)]
        wrapped(input_ids=every[rank], labels=every[rank]).loss.backward()
        (sum(ref(input_ids=x, labels=x).loss for x in every) / world).backward()
        for o in (opt, ropt):
            o.step()
            o.zero_grad()


def timm_model(name: str, **kwargs) -> nn.Module:
    """A timm model as timm builds it (an optional test dependency: tests that use one skip
    without timm), small enough for the CPU, classifying 32x32 images into 5 classes."""
    import timm

    return timm.create_model(name, pretrained=False, num_classes=5, **kwargs)


MODELS = {
    "mlp": MLP,
    "nested": NestedMLP,
    "convbn": ConvBN,
    "resnet": TinyResNet,
    "resnet-inplace": lambda: TinyResNet(inplace=True),
    "timm-resnet": lambda: timm_model("resnet10t"),
    "timm-vit": lambda: timm_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2),
    "timm-convnext": lambda: timm_model("convnext_atto"),
    "unused": WithUnused,
    "branchy": Branchy,
    "frozen": Frozen,
    "sparse": SparseEmbed,
    "weight-norm": WeightNormed,
    "moe": MixtureOfExperts,
    "moe-dense": lambda: MixtureOfExperts(dense=True),
    "gpt": TinyGPT,
    "gpt-untied": lambda: TinyGPT(tied=False),
    "gpt-ckpt-nonreentrant": lambda: CheckpointedGPT("nonreentrant"),
    "gpt-ckpt-reentrant": lambda: CheckpointedGPT("reentrant"),
    "gpt-ckpt-selective": lambda: CheckpointedGPT("selective"),
    "gpt-ckpt-wrapper": lambda: CheckpointedGPT("wrapper"),
    "gpt-ckpt-alternate": lambda: CheckpointedGPT("nonreentrant", every=2),
    "gpt-skip": SkippingGPT,
    "torch-transformer": TorchTransformer,
    "late-read": LateRead,
    "dtypes": MixedDtypes,
    "dtypes-exact": lambda: MixedDtypes(bf16=False),
}


def make(name: str, seed: int = 0, *, meta: bool = False) -> nn.Module:
    """Model ``name`` built after ``torch.manual_seed(seed)``; ``meta``: on the meta device."""
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return MODELS[name]()
    return MODELS[name]()


def _family(name: str) -> str:
    if name.startswith("gpt") or name == "torch-transformer":
        return "gpt"
    return {"late-read": "branchy", "dtypes": "branchy", "dtypes-exact": "branchy", "resnet": "convbn", "resnet-inplace": "convbn", "nested": "mlp", "weight-norm": "mlp", "moe": "branchy", "moe-dense": "branchy"}.get(name, "image" if name.startswith("timm-") else name)


def batch(name: str, n: int, generator: torch.Generator):
    """(inputs, targets) for ``n`` samples of model ``name``."""
    name = _family(name)
    if name == "mlp":
        return torch.randn(n, 13, generator=generator), torch.randn(n, 7, generator=generator)
    if name == "convbn":
        return torch.randn(n, 3, 6, 6, generator=generator), torch.randn(n, 5, generator=generator)
    if name == "image":
        return torch.randn(n, 3, 32, 32, generator=generator), torch.randn(n, 5, generator=generator)
    if name == "unused":
        return torch.randn(n, 11, generator=generator), torch.randn(n, 5, generator=generator)
    if name == "branchy":
        return torch.randn(n, 9, generator=generator), torch.randn(n, 4, generator=generator)
    if name == "frozen":
        return torch.randn(n, 10, generator=generator), torch.randn(n, 6, generator=generator)
    if name == "sparse":
        return torch.randint(0, 53, (n, 5), generator=generator), torch.randn(n, 7, generator=generator)
    if name == "gpt":
        idx = torch.randint(0, 53, (n, 8), generator=generator)
        return idx, torch.randint(0, 53, (n, 8), generator=generator)
    raise KeyError(name)


def loss_fn(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if _family(name) == "gpt":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return F.mse_loss(out, target)


__all__ = ["make", "batch", "loss_fn", "MLP", "NestedMLP", "ConvBN", "TinyResNet", "WithUnused", "Branchy", "Frozen", "SparseEmbed", "WeightNormed", "MixtureOfExperts", "TinyGPT", "math"]
