"""Named model configurations: a tiny CPU test model and the published DeepSeek-V3, Kimi-K2 and Kimi-K2.5 shapes.

`get_preset(name, layers=None)` returns a `ModelConfig`; `layers` keeps the full width but
changes the depth (benchmarks on fewer GPUs, quick traces of the real shapes). `PRESETS` names them
all (the command line's help lists them from it); `TEXT_OF_MULTIMODAL` those that are the text model
of a multimodal checkpoint.
"""

from __future__ import annotations

from dataclasses import replace

from fxfuse.models.config import ModelConfig, YarnScaling

#: Small enough for CPU tests in seconds, yet every code path of the real model runs: dense and
#: MoE layers, grouped routing (n_group > 1), the q LoRA path, YaRN with both mscale corrections
#: (mscale != mscale_all_dim, so cos/sin and the softmax scale are both adjusted), and every
#: split dimension divisible by tensor-parallel sizes 1, 2 and 4.
TINY = ModelConfig(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=YarnScaling(
        factor=4.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707
    ),
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=256,
)

#: deepseek-ai/DeepSeek-V3 config.json (https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json).
#: Its num_nextn_predict_layers=1 multi-token-prediction layer (checkpoint `model.layers.61.*`) is not
#: part of this model.
DEEPSEEK_V3 = ModelConfig(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=3,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=YarnScaling(
        factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
    ),
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=163840,
)

#: moonshotai/Kimi-K2-Instruct config.json (https://huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/config.json),
#: model_type kimi_k2 on the DeepseekV3ForCausalLM architecture. The file itself was not reachable
#: from here; every number is cross-checked against published copies of it:
#: - NVIDIA Megatron-Bridge `KimiK2Provider` API docs: 61 layers, hidden 7168, ffn 18432,
#:   384 experts, moe ffn 2048 (shared 2048 = 1 shared expert), 64 heads, rotary base 50000,
#:   top-8, 1 group with group top-1, routed scaling 2.827;
#: - hyper-accel/tiny-random-kimi-k2 config.json (K2's config with shrunken widths):
#:   first_k_dense_replace 1, n_group 1, max_position_embeddings 131072, rms_norm_eps 1e-6,
#:   yarn factor 32, beta_fast 1.0, beta_slow 1.0, vocab ids up to 163840;
#: - ParagEkbote/hf-model-inspector report for moonshotai/Kimi-K2-Instruct-0905: yarn mscale 1.0,
#:   mscale_all_dim 1.0, original_max_position_embeddings 4096, beta 1.0/1.0, rope_theta 50000,
#:   vocab 163840 (0905 differs from the original only in factor 64 / 262144 positions);
#: - Kimi-K2.x text_config copies: q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64,
#:   v_head 128, 1 shared expert.
#: Note beta_fast is 1.0 here, not DeepSeek's 32.
KIMI_K2 = ModelConfig(
    vocab_size=163840,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=64,
    n_routed_experts=384,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=50000.0,
    rope_scaling=YarnScaling(
        factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
    ),
    routed_scaling_factor=2.827,
    norm_topk_prob=True,
    max_position_embeddings=131072,
)

#: moonshotai/Kimi-K2.5 (https://huggingface.co/moonshotai/Kimi-K2.5), the text model: `text_config` of its
#: config.json (KimiK25ForConditionalGeneration wraps a DeepseekV3ForCausalLM; the vision tower and
#: projector are not part of this model). Source used: a dump of that config.json as transformers 5.7
#: read it from a local copy of the checkpoint (`KimiK25Config {...}` printed in full, with the
#: checkpoint's 64 files / 554.3 GB tensor list), found with the code-search tool. Its text_config:
#: rms_norm_eps 1e-05, rope_theta 50000.0, rope yarn factor 64.0 over original_max_position_embeddings
#: 4096 with beta_fast 32.0, beta_slow 1.0, mscale 1.0, mscale_all_dim 1.0, max_position_embeddings
#: 262144, vocab 163840, 61 layers (first_k_dense_replace 1), 64 heads, 384 routed experts, top 8,
#: 1 shared, n_group 1, topk_group 1, routed_scaling_factor 2.827, norm_topk_prob true, sigmoid /
#: noaux_tc, num_nextn_predict_layers 0, tie_word_embeddings false. A second copy (mlx-community's
#: Kimi-K2.5 config slice, quoted in a test of another project) agrees on rms_norm_eps 1e-05, rope_theta
#: 50000 and yarn factor 64. Third-party copies that disagree (rms_norm_eps 1e-6, rope_theta 10000) are
#: small test configs, not the checkpoint's. Note beta_fast is 32 here, where Kimi-K2 had 1.0.
#: Quantization (not part of ModelConfig): compressed-tensors pack-quantized, symmetric INT4, group 32,
#: ignore = lm_head, self_attn, shared_experts and the dense layer's mlp: the routed experts only.
KIMI_K25 = replace(
    KIMI_K2,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    rope_scaling=YarnScaling(
        factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
    ),
    max_position_embeddings=262144,
)

_CONFIGS = {"tiny": TINY, "deepseek-v3": DEEPSEEK_V3, "kimi-k2": KIMI_K2, "kimi-k2.5": KIMI_K25}

#: Names `get_preset` accepts.
PRESETS = tuple(_CONFIGS)
#: The weight formats each model's published checkpoints come in (besides bf16, which any can be dequantized to):
#: DeepSeek-V3 and Kimi-K2 ship FP8 blocks, Kimi-K2.5 INT4 routed experts; the tiny test model any format.
PUBLISHED_FORMATS = {"tiny": ("fp8", "int4"), "deepseek-v3": ("fp8",), "kimi-k2": ("fp8",), "kimi-k2.5": ("int4",)}
#: Presets that are the text model of a multimodal checkpoint: their vision encoder is no part of the
#: config, so nothing built from them (the model, the memory plan) holds or counts it.
TEXT_OF_MULTIMODAL = frozenset({"kimi-k2.5"})


def get_preset(name: str, layers: int | None = None) -> ModelConfig:
    """The named preset's config; `layers` overrides the depth (number of decoder layers) only."""
    if name not in _CONFIGS:
        raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
    config = _CONFIGS[name]
    return config if layers is None else replace(config, num_hidden_layers=layers)
