"""Multi-head latent attention (DeepSeek-V3 MLA) with heads split across ranks and a static cache.

The math is transformers' DeepseekV3Attention. Attention runs in the weight-absorbed form of
DeepSeek's reference inference code: the key up-projection (kv_b_proj's key rows) is folded into
the query and the value up-projection is applied after attending, so every step attends directly
over the cached latents and never expands per-head keys/values. It attends over the whole static
cache with a position mask (key position <= query position), so shapes depend only on the batch
and step width, never on how much of the cache is filled. With an FP8 scheme every projection keeps
FP8 weights except kv_b_proj: its weight is used directly in the absorbed form, so it is held in the
model dtype (dequantized on load).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxfuse.models.config import ModelConfig
from fxfuse.models.kv_cache import MLACache
from fxfuse.models.layers import ColumnParallelLinear, ReplicatedLinear, RMSNorm, RowParallelLinear
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.quant.scheme import QuantScheme
from fxfuse.models.rope import apply_rotary

#: transformers builds q_a_layernorm / kv_a_layernorm with DeepseekV3RMSNorm's default eps, not
#: config.rms_norm_eps; so does DeepSeek's reference code.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """This rank's heads of MLA; returns the o_proj partial sum for the caller to all-reduce."""

    def __init__(
        self, config: ModelConfig, ctx: ParallelContext, *, max_batch: int, max_seq_len: int, dtype: torch.dtype, device=None,
        quant: QuantScheme | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        # a plain float attribute: computing it per forward from the (yarn) config would make dynamic=True
        # branch on symbolic floats, and dynamo would then trace the whole model a second time
        self.softmax_scale = config.softmax_scale
        self.local_heads = ctx.shard(config.num_attention_heads, "num_attention_heads")
        heads, hidden = config.num_attention_heads, config.hidden_size
        factory = dict(dtype=dtype, device=device)
        quantized = dict(factory, quant=quant)
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * config.qk_head_dim, ctx, what="num_attention_heads", **quantized)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, config.q_lora_rank, **quantized)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, **factory)
            self.q_b_proj = ColumnParallelLinear(
                config.q_lora_rank, heads * config.qk_head_dim, ctx, what="num_attention_heads", **quantized
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, config.kv_lora_rank + config.qk_rope_head_dim, **quantized)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS, **factory)
        self.kv_b_proj = ColumnParallelLinear(
            config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim), ctx, what="num_attention_heads", **factory
        )
        self.o_proj = RowParallelLinear(heads * config.v_head_dim, hidden, ctx, what="num_attention_heads", **quantized)
        self.cache = MLACache(max_batch, max_seq_len, config.kv_lora_rank, config.qk_rope_head_dim, **factory)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden], positions [B, T], cos/sin [B, T, rope/2] -> partial o_proj output [B, T, hidden]."""
        cfg = self.config
        batch, width, _ = x.shape
        shared = self.kv_a_proj_with_mqa.quantize_input(x)  # w8a8: x quantized once for both projections reading it
        if cfg.q_lora_rank is None:
            query = self.q_proj(x, shared)
        else:
            query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, shared)))
        query = query.view(batch, width, self.local_heads, cfg.qk_head_dim)
        query_nope, query_rope = query.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        query_rope = apply_rotary(query_rope, cos.unsqueeze(2), sin.unsqueeze(2), cfg.rope_interleave)

        latent, key_rope = self.kv_a_proj_with_mqa(x, shared).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        key_rope = apply_rotary(key_rope, cos, sin, cfg.rope_interleave)
        cached_latent, cached_key_rope = self.cache.update(positions, latent, key_rope)

        # kv_b_proj rows, per local head: [key up-projection (nope) ; value up-projection (v)].
        kv_up = self.kv_b_proj.weight.view(self.local_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        key_up, value_up = kv_up.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
        query_latent = torch.einsum("bthd,hdc->bthc", query_nope, key_up)
        scores = torch.einsum("bthc,bsc->bhts", query_latent, cached_latent)
        scores = scores + torch.einsum("bthr,bsr->bhts", query_rope, cached_key_rope)
        scores = scores * self.softmax_scale

        key_positions = torch.arange(cached_latent.shape[1], device=positions.device)
        visible = key_positions.view(1, 1, 1, -1) <= positions.view(batch, 1, width, 1)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)

        context_latent = torch.einsum("bhts,bsc->bthc", probs, cached_latent)
        context = torch.einsum("bthc,hdc->bthd", context_latent, value_up)
        return self.o_proj(context.reshape(batch, width, self.local_heads * cfg.v_head_dim))
