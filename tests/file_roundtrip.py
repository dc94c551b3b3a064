"""Checkpoints written the way DDP code writes them, run on a rank pool: ``torch.save`` of state
dicts, one file from rank 0 or one per rank, loaded under another plan with the plain
``load_state_dict`` calls. Each function trains the test MLP, saves, loads into a differently
seeded model, and reports how far the loaded run is from the saving one, or what was refused."""

import copy
import io

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import models
from autodist import AutoDist
from autodist.errors import AutoDistError
from parity import make_plan, train_mlp

GLOBAL_BATCH = 8


def build(plan, seed):
    spec = make_plan(models.make("mlp"), dist.get_world_size(), **plan) if isinstance(plan, dict) else plan
    m = AutoDist(models.make("mlp", seed=seed), plan=spec)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def _full(sd):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in sd.items()}


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loaded(blob: bytes):
    return torch.load(io.BytesIO(blob), weights_only=True)


def _file(blob: bytes, per_rank: bool) -> bytes:
    """What a rank reads back: its own file, or rank 0's (``if rank == 0: torch.save(...)``)."""
    if per_rank:
        return blob
    box = [blob if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    return box[0]


def _saving_run(plan, module_sd: bool):
    """Train 3 steps under ``plan`` and checkpoint; returns (what was saved, the model's full state
    at the save and after 2 more steps)."""
    m, opt = build(plan, 0)
    gen = torch.Generator().manual_seed(7)
    train_mlp(m, opt, gen, 3, GLOBAL_BATCH)
    saved = {"model": m.module.state_dict() if module_sd else m.state_dict(), "optim": opt.state_dict()}
    at_save = _full(m.state_dict())
    blob = _bytes(saved)  # pickled now, before the training below moves the tensors it holds
    train_mlp(m, opt, gen, 2, GLOBAL_BATCH)
    final = _full(m.state_dict())
    m.close()
    return blob, at_save, final


def resume(src, dst, per_rank: bool, loaded_after_a_step: bool):
    """Save the model's full state dict and ``opt.state_dict()`` under ``src`` (rank 0's file, or
    each rank's own with ``per_rank``), load both with ``load_state_dict`` under ``dst`` (after a
    step of its own if ``loaded_after_a_step``: the optimizer's load hook, not its first step, then
    sees the state), continue the saving run's data stream for 2 steps. Returns the largest
    differences from the saving run, or the error the first step after loading raised."""
    blob, at_save, final = _saving_run(src, module_sd=False)
    blob = _file(blob, per_rank)
    m, opt = build(dst, 123)
    if loaded_after_a_step:
        train_mlp(m, opt, torch.Generator().manual_seed(99), 1, GLOBAL_BATCH)
    ckpt = _loaded(blob)
    m.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optim"])
    out: dict[str, object] = {"loaded": max((_full(m.state_dict())[k] - v).abs().max().item() for k, v in at_save.items())}
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        models.batch("mlp", GLOBAL_BATCH, gen)  # the saving run's data stream
    try:
        train_mlp(m, opt, gen, 2, GLOBAL_BATCH)
        got = _full(m.state_dict())
        out["continued"] = max((got[k] - v).abs().max().item() for k, v in final.items())
    except AutoDistError as e:
        after = _full(m.state_dict())
        out["refused"] = {"message": str(e), "every_rank": getattr(e, "raised_on_every_rank", False),
                          "changed": max((after[k] - v).abs().max().item() for k, v in at_save.items())}
    m.close()
    return out


def one_ranks_shards(plan):
    """``torch.save`` of ``model.module.state_dict()`` (this rank's DTensor shards) by rank 0 alone,
    loaded on every rank under ``plan``; and each rank's own file, loaded the same way. Returns
    what loading rank 0's file raised, how far each rank's own file loaded from the saved state,
    and how far ``copy.deepcopy`` of ``model.module.state_dict()`` is from it."""
    blob, at_save, _ = _saving_run(plan, module_sd=True)
    m, _ = build(plan, 0)
    held = m.module.state_dict()
    copied = copy.deepcopy(held)  # failed as the pickling did
    again = _loaded(_bytes(_loaded(blob)["model"]))  # DTensors loaded from the file save again
    out: dict[str, object] = {"deepcopy": max((_local(copied[k]) - _local(v)).abs().max().item() for k, v in held.items()),
                              "deepcopy_types": sorted({type(v).__name__ for v in copied.values()}),
                              "saved_again": sorted({type(v).__name__ for v in copy.deepcopy(again).values()}),
                              "module_copy": sorted({type(p).__name__ for p in copy.deepcopy(m.module).parameters()})}
    m.close()
    for per_rank in (False, True):
        data = _file(blob, per_rank)
        m, _ = build(plan, 123)
        try:
            m.load_state_dict(_loaded(data)["model"])
            out[f"per_rank={per_rank}"] = max((_full(m.state_dict())[k] - v).abs().max().item() for k, v in at_save.items())
        except AutoDistError as e:
            out[f"per_rank={per_rank}"] = {"error": type(e).__name__, "message": str(e),
                                           "every_rank": getattr(e, "raised_on_every_rank", False)}
        m.close()
    m, _ = build(plan, 123)
    try:  # the module's own load_state_dict (not a collective): each rank sees what it can
        m.module.load_state_dict(_loaded(_file(blob, False))["model"])
        out["module"] = None
    except RuntimeError as e:
        out["module"] = str(e)
    m.close()
    return out


def hugging_face_save_pretrained(directory: str, plan: str) -> dict[str, object]:
    """A GPT-2 trained 2 steps under ``plan``, saved with ``model.save_pretrained(directory)`` on
    every rank; returns how far ``from_pretrained`` is from a one-process reference trained on
    the same data, and which files were written."""
    import os

    import transformers

    torch.manual_seed(0)
    model = models.hf_gpt2()
    ref = copy.deepcopy(model)
    m = AutoDist(model, plan=plan)
    models.hf_gpt2_steps(m, ref, 2)
    m.save_pretrained(directory)
    m.close()
    dist.barrier()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(directory).state_dict()
    want = ref.state_dict()
    return {"worst": max((loaded[k] - v).abs().max().item() for k, v in want.items()), "files": sorted(os.listdir(directory))}


class _ScaledSGD(torch.optim.Optimizer):
    """SGD keeping state of other shapes than its parameters': a learnt 1-element scale made at
    construction, and per-row statistics (a factored optimizer's) made at the first step."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["scale"] = torch.ones(1)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["scale"].mul_(0.99)
                if p.dim() == 2:
                    rows = st.setdefault("rows", torch.zeros_like(p[:, :1]))
                    rows.mul_(0.9).add_(p.grad.square().mean(1, keepdim=True), alpha=0.1)
                p.add_(p.grad, alpha=-group["lr"] * st["scale"].item())


def state_of_other_shapes(plan):
    """An optimizer whose state is not shaped like its parameters steps under ``plan``, and
    reloading its own state dict changes nothing: the largest difference from a run without the
    reload after 3 steps, or the error raised."""
    finals = []
    for reload in (False, True):
        m = AutoDist(models.make("mlp", seed=0), plan=make_plan(models.make("mlp"), dist.get_world_size(), **plan)
                     if isinstance(plan, dict) else plan)
        opt = _ScaledSGD(m.parameters())
        gen = torch.Generator().manual_seed(7)
        try:
            train_mlp(m, opt, gen, 2, GLOBAL_BATCH)
            if reload:
                opt.load_state_dict(opt.state_dict())
            train_mlp(m, opt, gen, 1, GLOBAL_BATCH)
        except AutoDistError as e:
            m.close()
            return str(e)
        finals.append(_full(m.state_dict()))
        m.close()
    return max((finals[1][k] - v).abs().max().item() for k, v in finals[0].items())
