"""Routed experts kept quantized: stacked FP8 block-scaled or packed INT4 weights, one op per forward.

Parameter names follow the checkpoint with the experts stacked (the loader maps
`experts.{proj}{suffix}` to `experts.{e}.{proj}.weight{suffix}`):
- FP8: `gate_proj`/`up_proj` float8_e4m3fn [E, I/tp, H] and `*_scale_inv` float32 [E, I/tp/bn, H/bk];
  `down_proj` [E, H, I/tp] and `down_proj_scale_inv` [E, H/bn, I/tp/bk];
- INT4: `gate_proj_packed`/`up_proj_packed` int32 [E, I/tp, H/8] and `*_scale` bf16 [E, I/tp, H/group];
  `down_proj_packed` [E, H, I/tp/8] and `down_proj_scale` [E, H, I/tp/group].
Split dims are those of the bf16 experts (0 for gate/up, 1 for down); each rank's slice must cover
whole blocks / groups, else construction raises ValueError saying so.
"""

from __future__ import annotations

import torch
from torch import nn

from fxfuse.models.config import ModelConfig
from fxfuse.models.fp8 import FP8_DTYPE
from fxfuse.models.layers import empty_parameter
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.quant.int4 import VALUES_PER_WORD
from fxfuse.models.quant.ops import quant_experts
from fxfuse.models.quant.scheme import QuantScheme

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
INT4_SCALE_DTYPE = torch.bfloat16


class QuantizedRoutedExperts(nn.Module):
    """A rank's slice of every routed expert, FP8 or INT4 (scheme.experts), multiplied without dequantizing."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, scheme: QuantScheme, *, device=None) -> None:
        super().__init__()
        self.fmt = scheme.experts
        if self.fmt not in ("fp8", "int4"):
            raise ValueError(f"quantized experts need format fp8 or int4, got {self.fmt!r}")
        self.gemm = scheme.fp8_gemm
        self.block = scheme.fp8_block if self.fmt == "fp8" else (1, scheme.int4_group)
        experts, hidden = config.n_routed_experts, config.hidden_size
        local = ctx.shard(config.moe_intermediate_size, "moe_intermediate_size")
        shapes = {"gate_proj": ((local, hidden), 0), "up_proj": ((local, hidden), 0), "down_proj": ((hidden, local), 1)}
        for proj, ((rows, cols), dim) in shapes.items():
            self._check_alignment(proj, (rows, cols), dim, ctx.world_size)
            if self.fmt == "fp8":
                bn, bk = self.block
                self.register_parameter(proj, empty_parameter((experts, rows, cols), dim, FP8_DTYPE, device))
                grid = (experts, -(-rows // bn), -(-cols // bk))
                self.register_parameter(f"{proj}_scale_inv", empty_parameter(grid, dim, torch.float32, device))
            else:
                group = self.block[1]
                self.register_parameter(f"{proj}_packed", empty_parameter((experts, rows, cols // VALUES_PER_WORD), dim, torch.int32, device))
                self.register_parameter(f"{proj}_scale", empty_parameter((experts, rows, cols // group), dim, INT4_SCALE_DTYPE, device))

    def _check_alignment(self, proj: str, local: tuple[int, int], dim: int, world_size: int) -> None:
        """Raise if this rank's slice of `proj` cuts a quantization block or group (or INT4 rows are ragged)."""
        if self.fmt == "int4" and local[1] % self.block[1]:
            raise ValueError(f"cannot keep routed {proj} INT4: each rank's {local[1]} input features are not whole groups "
                             f"of {self.block[1]} at tensor-parallel size {world_size} (use --weights bf16)")
        if self.fmt == "fp8" and world_size > 1 and local[dim] % self.block[dim]:
            raise ValueError(f"cannot keep routed {proj} FP8 at tensor-parallel size {world_size}: each rank's {local[dim]} "
                             f"{'rows' if dim == 0 else 'columns'} do not fill whole {self.block[0]}x{self.block[1]} blocks "
                             "(use --weights bf16)")

    def stacked(self) -> list[torch.Tensor]:
        """(weight, scale) of gate, up and down, flattened in that order (the op's argument order)."""
        suffixes = ("", "_scale_inv") if self.fmt == "fp8" else ("_packed", "_scale")
        return [getattr(self, proj + suffix) for proj in PROJECTIONS for suffix in suffixes]

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, hidden], expert ids / fp32 weights [N, k] -> this rank's partial output [N, hidden]."""
        return quant_experts(x, expert_ids, weights, *self.stacked(), self.fmt, *self.block, self.gemm)
