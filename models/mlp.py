"""SwiGLU feed-forward block split across ranks by its intermediate dimension.

Used for the dense layers (the first `first_k_dense_replace`) and for the MoE shared experts.
Returns this rank's partial sum; the owner of the block all-reduces it. With an FP8 scheme its three
projections keep FP8 weights (models/layers.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxfuse.models.layers import ColumnParallelLinear, RowParallelLinear
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.quant.scheme import QuantScheme


class ParallelGatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate/up column-parallel and down row-parallel (partial sum)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        ctx: ParallelContext,
        *,
        what: str,
        dtype: torch.dtype,
        device=None,
        quant: QuantScheme | None = None,
    ) -> None:
        super().__init__()
        linear = dict(what=what, dtype=dtype, device=device, quant=quant)
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, ctx, **linear)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, ctx, **linear)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, ctx, **linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] (replicated) -> this rank's partial sum [..., hidden]."""
        shared = self.gate_proj.quantize_input(x)  # w8a8: x quantized once for gate and up
        return self.down_proj(F.silu(self.gate_proj(x, shared)) * self.up_proj(x, shared))
