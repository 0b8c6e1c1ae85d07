"""How one fused-op call runs: the modes the decision table chooses among and the thresholds table records.

Its own module so that the pure decision (`fxfuse.op.policy`) and the thresholds table
(`fxfuse.op.thresholds`) can both name the modes without importing each other.
"""

from __future__ import annotations

import enum


class FusionMode(str, enum.Enum):
    """How one all-reduce + residual add + RMSNorm call runs."""

    ONESHOT = "oneshot"  # every rank reads all peers' data (Lamport buffers): lowest latency, small inputs
    TWOSHOT = "twoshot"  # reduce-scatter then all-gather inside one kernel: larger inputs
    FALLBACK = "fallback"  # not fused: NCCL all-reduce, then add + RMSNorm
