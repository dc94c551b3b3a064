"""Issue 43: an impossible budget found at the switch, buffers in evaluation after training, and a
model with nothing to plan."""


import pytest
import torch
import torch.distributed as dist

import models
from autodist import AutoDist

# ---- buffers follow DDP's broadcast rule, in evaluation too ---------------------------------------


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _eval_after_train_vs_ddp(plan):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    ddp = DDP(models.make("convbn"))
    ours = AutoDist(models.make("convbn"), plan=plan)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ddp, ours)]
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data: its statistics differ
    batches = [models.batch("convbn", 4, gen) for _ in range(6)]

    def train_step(m, opt, micro):
        for i, (x, y) in enumerate(micro):
            if i + 1 < len(micro):  # accumulate locally, as DDP's no_sync
                with m.no_sync():
                    models.loss_fn("convbn", m(x), y).backward()
            else:
                models.loss_fn("convbn", m(x), y).backward()
        opt.step()
        opt.zero_grad()

    out = {}
    for name, m, opt in (("ddp", ddp, opts[0]), ("ours", ours, opts[1])):
        m.train()
        for b in batches[:3]:
            train_step(m, opt, [b])
        train_step(m, opt, batches[3:5])  # a no_sync micro-batch, then a synchronised one
        m.eval()
        with torch.no_grad():
            evals = [m(x) for x, _ in (batches[5], batches[0], batches[1])]
        bn = (ddp.module if name == "ddp" else ours.module).bn
        params = dict((ddp.module if name == "ddp" else ours).named_parameters())
        out[name] = {
            "evals": evals, "mean": bn.running_mean.clone(), "var": bn.running_var.clone(),
            "batches": bn.num_batches_tracked.item(), "params": {k: _full(v).detach().clone() for k, v in params.items()},
        }
    ours.close()
    d, o = out["ddp"], out["ours"]
    return {
        "eval": max((a - b).abs().max().item() for a, b in zip(d["evals"], o["evals"])),
        "running_mean": (d["mean"] - o["mean"]).abs().max().item(),
        "running_var": (d["var"] - o["var"]).abs().max().item(),
        "num_batches_tracked": (d["batches"], o["batches"]),
        "params": max((d["params"][k] - o["params"][k]).abs().max().item() for k in d["params"]),
    }


@pytest.mark.parametrize("plan", ["ddp", "fsdp", "zero2"])
def test_eval_after_training_equals_ddp_outputs_and_buffers(world2, plan):
    for rank, r in enumerate(world2.run(_eval_after_train_vs_ddp, plan)):
        assert r["params"] <= 1e-6, (rank, r)
        assert r["running_mean"] <= 1e-6 and r["running_var"] <= 1e-6, (rank, r)
        assert r["num_batches_tracked"][0] == r["num_batches_tracked"][1], (rank, r)
        assert r["eval"] <= 1e-6, (rank, r)
