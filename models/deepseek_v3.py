"""Reference tensor-parallel DeepSeek-V3 (and Kimi-K2) causal LM with a static MLA cache.

Same math as transformers' DeepseekV3ForCausalLM; parameter names are the Hugging Face checkpoint
names, except the routed experts, which are stacked per layer (see docs/ARCHITECTURE.md).
Communication is explicit and minimal: one `ctx.all_reduce` after the vocab-parallel embedding,
one after attention (o_proj), one per dense-MLP / MoE block (routed + shared partials added
first), and one all-gather of the column-parallel lm_head logits. So every layer shows the
`all_reduce -> residual add -> RMSNorm` pattern twice: into post_attention_layernorm, and into
the next layer's input_layernorm (or the final norm).

`forward(input_ids [B, T], positions [B, T])` writes the cache at `positions` and returns fp32
logits [B, T, vocab]. One forward serves prefill and 1..128-token decode/verify steps; shapes
depend only on (B, T), so a step compiles with fullgraph=True and can be CUDA-graph captured.
"""

from __future__ import annotations

import torch
from torch import nn

from fxfuse.models.config import ModelConfig
from fxfuse.models.layers import ColumnParallelLinear, RMSNorm, VocabParallelEmbedding
from fxfuse.models.mla_attention import MLAttention
from fxfuse.models.mlp import ParallelGatedMLP
from fxfuse.models.moe import MoE
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.quant.scheme import QuantScheme
from fxfuse.models.rope import cos_sin_tables


class DecoderLayer(nn.Module):
    """Pre-norm MLA attention and dense-MLP or MoE block, each followed by one all-reduce."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        ctx: ParallelContext,
        *,
        max_batch: int,
        max_seq_len: int,
        expert_impl: str,
        dtype: torch.dtype,
        device=None,
        quant: QuantScheme | None = None,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        factory = dict(dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = MLAttention(config, ctx, max_batch=max_batch, max_seq_len=max_seq_len, quant=quant, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        if config.is_moe_layer(layer_idx):
            self.mlp = MoE(config, ctx, expert_impl=expert_impl, quant=quant, **factory)
        else:
            self.mlp = ParallelGatedMLP(
                config.hidden_size, config.intermediate_size, ctx, what="intermediate_size", quant=quant, **factory
            )

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, hidden] (replicated) -> the layer's output [B, T, hidden] (replicated)."""
        residual = hidden
        attn = self.self_attn(self.input_layernorm(hidden), positions, cos, sin)
        hidden = residual + self.ctx.all_reduce(attn)
        residual = hidden
        mlp = self.mlp(self.post_attention_layernorm(hidden))
        return residual + self.ctx.all_reduce(mlp)


class DeepseekV3Model(nn.Module):
    """Embedding, decoder layers and final norm (checkpoint prefix `model.`)."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: ParallelContext,
        *,
        max_batch: int,
        max_seq_len: int,
        expert_impl: str,
        dtype: torch.dtype,
        device=None,
        quant: QuantScheme | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(
                config, i, ctx, max_batch=max_batch, max_seq_len=max_seq_len, expert_impl=expert_impl, dtype=dtype,
                device=device, quant=quant,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        cos, sin = cos_sin_tables(config, max_seq_len)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [B, T, hidden] (full, replicated on every rank)."""
        hidden = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(hidden.dtype)
        sin = self.rope_sin[positions].to(hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, positions, cos, sin)
        return self.norm(hidden)


class DeepseekV3ForCausalLM(nn.Module):
    """Tensor-parallel DeepSeek-V3 causal LM over an explicit `ParallelContext`, with a static cache.

    `max_batch` and `max_seq_len` size the cache: a forward takes B <= max_batch rows and
    positions < max_seq_len. `expert_impl` picks the routed-expert kernel ("auto": grouped mm for
    bf16 on CUDA, dense otherwise; see models/moe.py). `quant` keeps weights quantized ("fp8":
    DeepSeek-V3's block FP8 in every decoder projection but kv_b_proj; "int4": Kimi-K2.5's packed routed
    experts; see models/quant/scheme.py); None or "bf16" holds everything in `dtype`. Weights start
    uninitialized: fill them with `fxfuse.models.weights.load_weights` or
    `fxfuse.models.random_weights.init_random_shards`.
    """

    def __init__(
        self,
        config: ModelConfig,
        ctx: ParallelContext,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        max_batch: int = 1,
        max_seq_len: int = 4096,
        expert_impl: str = "auto",
        quant: QuantScheme | None = None,
    ) -> None:
        super().__init__()
        config.check_tensor_parallel(ctx.world_size)
        if max_seq_len > config.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds max_position_embeddings {config.max_position_embeddings}")
        self.config = config
        self.ctx = ctx
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.quant = quant or QuantScheme()
        self.model = DeepseekV3Model(
            config, ctx, max_batch=max_batch, max_seq_len=max_seq_len, expert_impl=expert_impl, dtype=dtype, device=device,
            quant=self.quant,
        )
        if config.tie_word_embeddings:
            self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, ctx, what="vocab_size", device="meta", dtype=dtype)
            self.lm_head.weight = self.model.embed_tokens.weight  # same [V/tp, hidden] slice, same split
        else:
            self.lm_head = ColumnParallelLinear(
                config.hidden_size, config.vocab_size, ctx, what="vocab_size", dtype=dtype, device=device
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Write the cache at `positions` [B, T] and return fp32 logits [B, T, vocab_size]."""
        if input_ids.shape != positions.shape or input_ids.dim() != 2:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must both be [B, T]")
        if input_ids.shape[0] > self.max_batch:
            raise ValueError(f"batch {input_ids.shape[0]} exceeds max_batch {self.max_batch}")
        hidden = self.model(input_ids, positions)
        return self.ctx.all_gather_last_dim(self.lm_head(hidden)).float()

    def reset_cache(self) -> None:
        """Forget every cached position in every layer."""
        for layer in self.model.layers:
            layer.self_attn.cache.reset()
