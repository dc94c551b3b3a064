"""The GPUs ``autodist plan --device`` can describe: their datasheet peaks, without importing torch
(the command line lists them in ``--help``). The roofline that uses them is in ``device.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Device:
    name: str
    what: str
    bf16_flops: float  # dense tensor-core FLOP/s for bf16 and fp16
    fp32_flops: float  # FLOP/s for float32 (no TF32)
    memory_bytes_s: float  # HBM bandwidth
    memory_bytes: int
    source: str

    def peak(self, dtype: torch.dtype) -> float:
        import torch

        return self.bf16_flops if dtype in (torch.bfloat16, torch.float16) else self.fp32_flops

    def describe(self) -> str:
        return (f"{self.what}: {self.bf16_flops / 1e12:g} TFLOP/s bf16, {self.fp32_flops / 1e12:g} TFLOP/s fp32, "
                f"{self.memory_bytes_s / 1e12:g} TB/s")


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device(
            "h100", "NVIDIA H100 SXM5 80GB", 989.5e12, 67e12, 3.35e12, 80 * 10**9,
            "NVIDIA H100 datasheet (https://www.nvidia.com/en-us/data-center/h100/): BF16 tensor core 1,979 "
            "TFLOPS with sparsity (989.5 dense), FP32 67 TFLOPS, HBM3 3.35 TB/s; the same figures as "
            "torch/_inductor/analysis/device_info.py",
        ),
        Device(
            "h200", "NVIDIA H200 SXM 141GB", 989.5e12, 67e12, 4.8e12, 141 * 10**9,
            "NVIDIA H200 datasheet (https://www.nvidia.com/en-us/data-center/h200/): BF16 tensor core 1,979 "
            "TFLOPS with sparsity (989.5 dense), FP32 67 TFLOPS, HBM3e 4.8 TB/s",
        ),
        Device(
            "a100", "NVIDIA A100 SXM4 80GB", 312e12, 19.5e12, 2.039e12, 80 * 10**9,
            "NVIDIA A100 datasheet (https://www.nvidia.com/en-us/data-center/a100/): BF16 tensor core 312 "
            "TFLOPS dense, FP32 19.5 TFLOPS, HBM2e 2,039 GB/s; as torch/_inductor/analysis/device_info.py",
        ),
    )
}


def describe_devices() -> str:
    return "; ".join(f"{d.name} ({d.describe()})" for d in DEVICES.values())
