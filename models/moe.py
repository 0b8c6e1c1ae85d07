"""DeepSeek-V3 mixture of experts: replicated router, experts split by intermediate dim, shared expert.

Routing is transformers' DeepseekV3TopkRouter in fp32: sigmoid scores, `e_score_correction_bias`
added for the choice only, top groups by the sum of their two best scores, top-k experts within
those groups, weights from the unbiased scores, optionally renormalized, times
`routed_scaling_factor`. Every rank routes identically and holds a 1/tp slice of every expert's
intermediate dimension, so each rank's routed output is a partial sum; the shared-expert partial
is added to it and the caller does the block's single all-reduce.

Expert compute has fixed shapes for any routing (compile- and CUDA-graph-friendly), in one of two
exact forms chosen from dtype and device only:
- "grouped_mm": the T*top_k (token, expert) rows sorted by expert and multiplied with
  `torch._grouped_mm` (bf16; used on CUDA): work proportional to the active experts.
- "dense": every expert on every token, combined with zero weights for unchosen experts: simple
  and exact, used on CPU and for fp16/fp32 (torch's grouped mm traces only for bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxfuse.models.config import ModelConfig
from fxfuse.models.expert_math import dense_experts, grouped_experts
from fxfuse.models.layers import empty_parameter
from fxfuse.models.mlp import ParallelGatedMLP
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.quant.experts import QuantizedRoutedExperts
from fxfuse.models.quant.scheme import QuantScheme

EXPERT_IMPLS = ("auto", "grouped_mm", "dense")


class TopkRouter(nn.Module):
    """Replicated router: fp32 `weight` [E, hidden] and `e_score_correction_bias` [E]."""

    def __init__(self, config: ModelConfig, *, device=None) -> None:
        super().__init__()
        self.config = config
        experts = config.n_routed_experts
        self.weight = empty_parameter((experts, config.hidden_size), None, torch.float32, device)
        self.e_score_correction_bias = empty_parameter((experts,), None, torch.float32, device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (expert ids [N, k] int64, fp32 combine weights [N, k])."""
        cfg = self.config
        tokens, experts, groups = x.shape[0], cfg.n_routed_experts, cfg.n_group
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        group_scores = choice.view(tokens, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
        top_groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0).bool()
        expert_mask = group_mask.unsqueeze(-1).expand(tokens, groups, experts // groups).reshape(tokens, experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        expert_ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, expert_ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return expert_ids, weights * cfg.routed_scaling_factor


class RoutedExperts(nn.Module):
    """All routed experts' SwiGLU weights, stacked, each split by its intermediate dimension.

    `gate_proj`/`up_proj` [E, I/tp, hidden] (checkpoint `experts.{e}.*_proj.weight` [I, hidden],
    split on dim 0); `down_proj` [E, hidden, I/tp] (checkpoint [hidden, I], split on dim 1).
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, *, impl: str, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        if impl not in EXPERT_IMPLS:
            raise ValueError(f"unknown expert implementation {impl!r}; choose one of {EXPERT_IMPLS}")
        self.impl = impl
        experts, hidden = config.n_routed_experts, config.hidden_size
        local = ctx.shard(config.moe_intermediate_size, "moe_intermediate_size")
        self.gate_proj = empty_parameter((experts, local, hidden), 0, dtype, device)
        self.up_proj = empty_parameter((experts, local, hidden), 0, dtype, device)
        self.down_proj = empty_parameter((experts, hidden, local), 1, dtype, device)

    def resolved_impl(self, x: torch.Tensor) -> str:
        """Which implementation runs for activations like `x` ("grouped_mm" or "dense")."""
        if self.impl != "auto":
            return self.impl
        return "grouped_mm" if x.is_cuda and x.dtype == torch.bfloat16 else "dense"

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, hidden], expert ids / fp32 weights [N, k] -> this rank's partial output [N, hidden]."""
        if self.resolved_impl(x) == "grouped_mm":
            return self._grouped(x, expert_ids, weights)
        return self._dense(x, expert_ids, weights)

    def _dense(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return dense_experts(x, expert_ids, weights, self.gate_proj, self.up_proj, self.down_proj)

    def _grouped(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return grouped_experts(x, expert_ids, weights, self.gate_proj, self.up_proj, self.down_proj)


class MoE(nn.Module):
    """Routed experts plus shared experts; returns this rank's partial sum (caller all-reduces once)."""

    def __init__(
        self, config: ModelConfig, ctx: ParallelContext, *, expert_impl: str, dtype: torch.dtype, device=None,
        quant: QuantScheme | None = None,
    ) -> None:
        super().__init__()
        self.gate = TopkRouter(config, device=device)
        if quant is not None and quant.experts != "bf16":
            self.experts = QuantizedRoutedExperts(config, ctx, quant, device=device)
        else:
            self.experts = RoutedExperts(config, ctx, impl=expert_impl, dtype=dtype, device=device)
        self.shared_experts = ParallelGatedMLP(
            config.hidden_size,
            config.moe_intermediate_size * config.n_shared_experts,
            ctx,
            what="moe_intermediate_size * n_shared_experts",
            dtype=dtype,
            device=device,
            quant=quant,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> partial [B, T, hidden] (routed + shared)."""
        flat = x.reshape(-1, x.shape[-1])
        expert_ids, weights = self.gate(flat)
        routed = self.experts(flat, expert_ids, weights).view_as(x)
        return routed + self.shared_experts(x)
