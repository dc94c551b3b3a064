"""Transparent profiling: the first training steps of a wrapped model, recorded with profiling hooks
and turned into a :class:`~autodist.cost.profile.Profile` (``plan="auto"`` without example inputs,
and a model on the meta device; ``online.py``).

The engine calls the recorder around the root forward (:meth:`StepRecorder.forward_context`,
:meth:`~StepRecorder.forward_end`) and at the end of backward (:meth:`~StepRecorder.backward_end`);
the optimizer's global step hooks time its step and size its state. The first recorded step warms up;
the profile holds the median of the others.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.optim.optimizer as optim_hooks

from ..cost.profile import OptimizerProfile, Profile, UnitProfile
from ..measure.clock import Clock
from ..measure.memory import storage_bytes
from ..measure.trace import UnitTracer, _attribute, _Pass, float_output_bytes, loss_fields
from ..runtime.optimizers import dtensor_limit


class StepRecorder:
    """Records passes of ``module`` (its units ``structure.units``) on ``device`` until :meth:`close`.
    ``params``: the trained parameters' (name, full tensor); ``ours``: the ids of the tensors the
    optimizer steps that belong to this model (other models' steps are not recorded)."""

    def __init__(
        self, module: torch.nn.Module, structure: Any, device: torch.device, params: list[tuple[str, torch.Tensor]],
        ours: Callable[[], set[int]],
    ) -> None:
        self.structure = structure
        self.device = device
        self._ours = ours
        self.tracer = UnitTracer(module, structure, Clock(device), params=params, free_grads=False)
        self.recorded: list[dict[str, Any]] = []
        self._pass: _Pass | None = None
        self._marks: dict[str, Any] = {}
        self._opt_samples: list[tuple[str, float, int, int, int]] = []
        self._opt_t0 = 0.0
        self._state_names: list[str] = []
        self._refused = (False, False)  # what the optimizers cannot step as DTensors (OptimizerProfile's fields)
        self.out_fp32 = 0  # float32 bytes of the outputs of the last recorded forward
        self._handles = [
            optim_hooks.register_optimizer_step_pre_hook(self._opt_pre),
            optim_hooks.register_optimizer_step_post_hook(self._opt_post),
        ]

    # ---- passes -----------------------------------------------------------------------------------
    def begin_pass(self) -> None:
        self._pass = _Pass()
        self._marks = {"t0": self.tracer.clock.mark()}
        self.tracer.start(self._pass)

    def finish_pass(self) -> None:
        self.tracer.stop()
        if self._pass is not None and "bwd" in self._marks:
            units = [u.name for u in self.structure.units]
            m = self._marks
            self.recorded.append({"attr": _attribute(self._pass, self.tracer.clock, m["t0"], m["fwd"], m["bwd"], units), "pass": self._pass})
        self._pass = None

    def close(self) -> None:
        self.tracer.close()
        for h in self._handles:
            h.remove()

    # ---- called by the engine ---------------------------------------------------------------------
    def forward_context(self) -> Any:
        return self.tracer.saving()

    def paused(self) -> Any:
        """Context for a forward without gradients while a pass is recorded (an evaluation, a
        pseudo-label or teacher pass of the same model): its operations are not the training
        step's, and recorded they counted as the step's forward (gpt with three evaluation
        forwards a step: the searched plan's step predicted 10.1 ms for 7.9, its backward 0)."""
        return self.tracer.paused()

    def forward_end(self, out: Any) -> None:
        if self._pass is not None:
            self._marks["fwd"] = self.tracer.clock.mark()
            # the loss runs in the user's code, outside what is recorded: it is sized from the outputs
            self.out_fp32 = float_output_bytes(out)

    def backward_end(self) -> None:
        if self._pass is not None and "fwd" in self._marks:
            self._marks["bwd"] = self.tracer.clock.mark()

    # ---- the optimizer's step ---------------------------------------------------------------------
    def _opt_pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self._opt_t0 = time.perf_counter()

    def _opt_post(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        ours = self._ours()
        params = [p for g in opt.param_groups for p in g["params"] if id(p) in ours]
        if not params:
            return
        local = storage_bytes(p for p in params)
        tensors = [(k, t) for p in params for k, t in opt.state.get(p, {}).items() if torch.is_tensor(t) and t.dim() > 0]
        state = storage_bytes(t for _, t in tensors)
        self._state_names = sorted({k for k, _ in tensors})
        limit = dtensor_limit(opt)
        if limit is not None:  # over every optimizer of the model's parameters (two: the union)
            dtensor, shard = self._refused
            self._refused = (dtensor or limit.scope == "dtensor", shard or limit.scope == "shard")
        self._opt_samples.append((type(opt).__name__, time.perf_counter() - self._opt_t0, local, state, len(params)))

    # ---- the profile ------------------------------------------------------------------------------
    def profile(self, sig: str, grad_accum_steps: int) -> Profile:
        """The profile of the recorded steps (the first warms up, unless it is the only one), for
        inputs of signature ``sig`` and ``grad_accum_steps`` micro-batches per optimizer step."""
        measured = self.recorded[1:] or self.recorded
        last = measured[-1]
        units_order = list(dict.fromkeys(u for _, kind, u in last["pass"].fwd if kind == "enter"))
        units_order += [u.name for u in self.structure.units if u.name not in set(units_order)]
        return Profile(
            units=[self._unit(u, measured) for u in units_order],
            ready_order=last["attr"]["order"],
            pre_fwd_s=_median(r["attr"]["pre_fwd"] for r in measured),
            post_fwd_s=_median(r["attr"]["post_fwd"] for r in measured),
            pre_bwd_s=_median(r["attr"]["pre_bwd"] for r in measured),
            batch_signature=sig,
            device=self.device.type,
            optimizer=self._optimizer(),
            site_after=dict(self.tracer.site_after),
            recompute_anchor=dict(last["pass"].recompute),
            block_input_bytes=dict(last["pass"].block_inputs),
            grad_accum_steps=max(1, grad_accum_steps),
            meta={"source": "first training steps", "steps": len(measured), "torch": torch.__version__},
            **loss_fields(0, (0, 0), self.out_fp32, "estimated"),
        )

    def _unit(self, u: str, measured: list[dict[str, Any]]) -> UnitProfile:
        last = measured[-1]
        ready = last["attr"]["ready"].get(u, [])
        return UnitProfile(
            name=u,
            fwd_s=_median(r["attr"]["fwd"][u] for r in measured),
            bwd_s=_median(r["attr"]["bwd"][u] for r in measured),
            act_bytes=last["pass"].saved.get(u, 0),
            out_bytes=last["pass"].out.get(u, 0),
            fwd_peak_bytes=last["pass"].out.get(u, 0),
            bwd_peak_bytes=sum(self.structure.params[p].nbytes for p in ready),
            ready=ready,
            input_requires_grad=last["pass"].input_grad.get(u, True),
        )

    def _optimizer(self) -> OptimizerProfile:
        if not self._opt_samples:
            return OptimizerProfile()
        samples = self._opt_samples[1:] or self._opt_samples
        kind, _, local, state, _ = samples[-1]
        step = _median(s[1] for s in samples)
        return OptimizerProfile(
            kind=kind, state_factor=state / max(local, 1), state_names=list(self._state_names),
            transient_factor=1.0, per_byte_s=step / max(local, 1), measured=True,
            dtensor_refused=self._refused[0], shard_refused=self._refused[1],
        )


def _median(values: Iterable[float]) -> float:
    return statistics.median(list(values))
