"""How one fused-op call runs: the implementations the decision table chooses among, which the
thresholds table also records.

Its own module so that the pure decision (`fxfuse.op.decide.policy`) and the thresholds table
(`fxfuse.op.decide.thresholds`) can both name the modes without importing each other.
"""

from __future__ import annotations

import enum


class FusionMode(str, enum.Enum):
    """Which implementation one all-reduce + residual add + RMSNorm call runs."""

    ONESHOT = "oneshot"  # FlashInfer TensorRT-LLM kernel, one-shot (Lamport buffers): lowest latency, small inputs
    TWOSHOT = "twoshot"  # the same kernel, reduce-scatter then all-gather inside one launch: larger inputs
    PCIE = "pcie"  # FlashInfer's PCIe IPC all-reduce, then the fused add + RMSNorm kernel
    PCIE_ONE_KERNEL = "pcie_one_kernel"  # fxfuse's one-shot all-reduce + add + RMSNorm (+ FP8) in one launch, over CUDA IPC
    FALLBACK = "fallback"  # NCCL all-reduce, then the fused add + RMSNorm kernel

    @property
    def trtllm(self) -> bool:
        """True for the TensorRT-LLM kernel's two algorithms."""
        return self in (FusionMode.ONESHOT, FusionMode.TWOSHOT)
