"""Tensor-parallel building blocks: RMSNorm, vocab-parallel embedding, replicated/column/row linears.

Each layer owns only this rank's slice of its weight, tagged with `mark_shard` by the checkpoint
dimension it is cut along, so the loader can fill it. Weights are created uninitialized
(`torch.empty`) and never require grad: this is an inference model that a checkpoint or
`random_weights` fills. Row-parallel outputs are partial sums; the caller adds them up with its
one `ctx.all_reduce`, so each block decides where its single reduction happens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxfuse.models.parallel import ParallelContext
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


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole weight [out, in] on every rank."""

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.weight = empty_parameter((out_features, in_features), None, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T: this rank's rows of the weight, i.e. its slice of the output features."""

    def __init__(
        self, in_features: int, out_features: int, ctx: ParallelContext, *, what: str, dtype: torch.dtype, device=None
    ) -> None:
        super().__init__()
        local_out = ctx.shard(out_features, what)
        self.weight = empty_parameter((local_out, in_features), 0, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """Partial y = x_local W_local^T over this rank's input features; the caller all-reduces it."""

    def __init__(
        self, in_features: int, out_features: int, ctx: ParallelContext, *, what: str, dtype: torch.dtype, device=None
    ) -> None:
        super().__init__()
        local_in = ctx.shard(in_features, what)
        self.weight = empty_parameter((out_features, local_in), 1, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


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
