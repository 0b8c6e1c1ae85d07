"""Tensor-parallel building blocks: RMSNorm, vocab-parallel embedding, replicated/column/row linears.

Each layer owns only this rank's slice of its weight, tagged with `mark_shard` by the checkpoint
dimension it is cut along, so the loader can fill it. Given a `QuantScheme` whose format is "fp8",
a linear keeps its weight as `float8_e4m3fn` with its `weight_scale_inv` block grid (the checkpoint's
names and layout) and multiplies with `fxfuse_quant::fp8_linear` ("w8a16": bf16 activations), or
("w8a8") quantizes its input per token group in plain torch ops, which torch.compile traces into the
graph next to the op that produced the input (an RMSNorm, for most), then multiplies with
`fxfuse_quant::fp8_linear_quantized`. Linears reading one input share one quantization of it
(`quantize_input`, then `forward(x, quantized)`). Weights are created uninitialized
(`torch.empty`) and never require grad: this is an inference model that a checkpoint or
`random_weights` fills. Row-parallel outputs are partial sums; the caller adds them up with its
one `ctx.all_reduce`, so each block decides where its single reduction happens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxfuse.models.fp8 import FP8_DTYPE, scale_shape
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.quant.act_quant import quantize_linear_input
from fxfuse.models.quant.ops import fp8_linear, fp8_linear_quantized
from fxfuse.models.quant.scheme import QuantScheme
from fxfuse.models.sharding import mark_shard


def empty_parameter(shape, shard_dim: int | None, dtype: torch.dtype, device) -> nn.Parameter:
    """An uninitialized, frozen parameter tagged with the checkpoint dimension it is split along."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    return mark_shard(param, shard_dim)


class RMSNorm(nn.Module):
    """RMSNorm as transformers' DeepseekV3RMSNorm: fp32 statistics, cast back, then `weight * x`."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter((dim,), None, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)


class QuantizableLinear(nn.Module):
    """y = x W^T for a weight of local shape [out, in] split along checkpoint dim `shard_dim`.

    With an FP8 `quant` scheme the weight is FP8 with per-block float32 `weight_scale_inv`; every
    rank's slice must then cover whole blocks (ValueError otherwise, naming `what`). With the "w8a8" GEMM the
    input is quantized per token and group of block_k inputs before the GEMM op, outside it.
    """

    def __init__(self, out_features: int, in_features: int, shard_dim: int | None, *, world_size: int, what: str,
                 dtype: torch.dtype, device=None, quant: QuantScheme | None = None) -> None:
        super().__init__()
        self.fp8_block = quant.fp8_block if quant is not None and quant.fp8_dense else None
        if self.fp8_block is None:
            self.weight = empty_parameter((out_features, in_features), shard_dim, dtype, device)
            return
        self.fp8_gemm = quant.fp8_gemm
        local = (out_features, in_features)
        if shard_dim is not None and world_size > 1 and local[shard_dim] % self.fp8_block[shard_dim]:
            raise ValueError(
                f"cannot keep FP8 weights split by {what} at tensor-parallel size {world_size}: each rank's {local[shard_dim]} "
                f"{'rows' if shard_dim == 0 else 'columns'} do not fill whole {self.fp8_block[0]}x{self.fp8_block[1]} "
                "blocks (use --weights bf16 to dequantize on load)"
            )
        self.weight = empty_parameter(local, shard_dim, FP8_DTYPE, device)
        self.weight_scale_inv = empty_parameter(scale_shape(local, self.fp8_block), shard_dim, torch.float32, device)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x [..., K] as this linear's w8a8 GEMM reads it: (float8_e4m3fn [M, K], float32 scales [M, K / block_k]),
        M the rows of x; None for any other format. Give it to every linear of the same scheme that reads x
        (`forward(x, quantized)`), so x is quantized once."""
        if self.fp8_block is None or self.fp8_gemm != "w8a8":
            return None
        return quantize_linear_input(x.reshape(-1, x.shape[-1]), self.fp8_block[1])

    def forward(self, x: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]; `quantized`: x's `quantize_input` (w8a8 only; None: quantized here)."""
        if self.fp8_block is None:
            return F.linear(x, self.weight)
        if self.fp8_gemm != "w8a8":
            return fp8_linear(x, self.weight, self.weight_scale_inv, *self.fp8_block)
        values, scale = quantized if quantized is not None else self.quantize_input(x)
        out = fp8_linear_quantized(values, scale, self.weight, self.weight_scale_inv, *self.fp8_block, x.dtype)
        return out.view(*x.shape[:-1], self.weight.shape[0])


class ReplicatedLinear(QuantizableLinear):
    """y = x W^T with the whole weight [out, in] on every rank."""

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype, device=None, quant: QuantScheme | None = None) -> None:
        super().__init__(out_features, in_features, None, world_size=1, what="replicated", dtype=dtype, device=device, quant=quant)


class ColumnParallelLinear(QuantizableLinear):
    """y_local = x W_local^T: this rank's rows of the weight, i.e. its slice of the output features."""

    def __init__(
        self, in_features: int, out_features: int, ctx: ParallelContext, *, what: str, dtype: torch.dtype, device=None,
        quant: QuantScheme | None = None,
    ) -> None:
        local_out = ctx.shard(out_features, what)
        super().__init__(local_out, in_features, 0, world_size=ctx.world_size, what=what, dtype=dtype, device=device, quant=quant)


class RowParallelLinear(QuantizableLinear):
    """Partial y = x_local W_local^T over this rank's input features; the caller all-reduces it."""

    def __init__(
        self, in_features: int, out_features: int, ctx: ParallelContext, *, what: str, dtype: torch.dtype, device=None,
        quant: QuantScheme | None = None,
    ) -> None:
        local_in = ctx.shard(in_features, what)
        super().__init__(out_features, local_in, 1, world_size=ctx.world_size, what=what, dtype=dtype, device=device, quant=quant)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks; returns the full (all-reduced) rows.

    Each rank looks up the ids in its vocabulary slice, writes zeros for the others, and one
    `ctx.all_reduce` assembles every row.
    """

    def __init__(self, vocab_size: int, dim: int, ctx: ParallelContext, *, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.ctx = ctx
        self.local_vocab = ctx.shard(vocab_size, "vocab_size")
        self.vocab_start = ctx.rank * self.local_vocab
        self.weight = empty_parameter((self.local_vocab, dim), 0, dtype, device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        in_slice = (local_ids >= 0) & (local_ids < self.local_vocab)
        rows = F.embedding(torch.where(in_slice, local_ids, 0), self.weight)
        rows = rows.masked_fill(~in_slice.unsqueeze(-1), 0)
        return self.ctx.all_reduce(rows)
