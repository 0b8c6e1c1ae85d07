"""Quantized-weight formats: INT4 packing bit for bit as compressed-tensors packs it, group quantization,
the quantization_config of DeepSeek-V3 FP8 and Kimi-K2.5 INT4 checkpoints (and the ones refused), and
the kimi-k2.5 preset against the numbers of its config.json."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from fxfuse.models.config import ModelConfig
from fxfuse.models.presets import PRESETS, get_preset
from fxfuse.models.quant.int4 import dequantize_groups, pack_int4, quantize_groups, unpack_int4
from fxfuse.models.quant.scheme import QuantScheme, checkpoint_format

#: moonshotai/Kimi-K2.5's quantization_config (config.json), as published.
KIMI_K25_QUANTIZATION = {
    "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                  "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32,
                                              "num_bits": 4, "observer": "minmax", "observer_kwargs": {},
                                              "strategy": "group", "symmetric": True, "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}


@pytest.mark.parametrize("cols", [8, 40, 37])
def test_int4_packing_is_compressed_tensors_layout(cols):
    values = torch.randint(-8, 8, (6, cols), dtype=torch.int8, generator=torch.Generator().manual_seed(cols))
    packed = pack_int4(values)
    assert torch.equal(packed, pack_to_int32(values, 4))
    assert torch.equal(unpack_int4(packed, cols), values)
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size([6, cols])), values)


def test_unpack_a_window_that_starts_inside_a_word():
    values = torch.randint(-8, 8, (3, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    packed = pack_int4(values)
    assert torch.equal(unpack_int4(packed[:, 2:6], 21, first=3), values[:, 19:40])


def test_packing_rejects_out_of_range_values():
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([[8]]))


def test_group_quantization_is_symmetric_and_close():
    weight = torch.randn(16, 96, generator=torch.Generator().manual_seed(0))
    values, scale = quantize_groups(weight, 32)
    assert scale.shape == (16, 3) and scale.dtype == torch.bfloat16
    assert values.abs().max() <= 7 and values.min() >= -8
    restored = dequantize_groups(values, scale, 32)
    step = scale.float().repeat_interleave(32, dim=1)
    # round to nearest: at most half a step, plus the bf16 rounding of the scale (2**-8 relative, times 7)
    assert ((restored - weight).abs() <= step * (0.5 + 7 * 2**-8)).all()


def test_checkpoint_formats_are_read_from_config():
    assert checkpoint_format({}) == QuantScheme("bf16")
    fp8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    assert checkpoint_format(fp8) == QuantScheme("fp8", fp8_block=(128, 128))
    assert checkpoint_format({"quantization_config": KIMI_K25_QUANTIZATION}) == QuantScheme("int4", int4_group=32)
    nested = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {"quantization_config": KIMI_K25_QUANTIZATION}}
    assert checkpoint_format(nested).weights == "int4"
    assert checkpoint_format(QuantScheme("int4", int4_group=16).checkpoint_config()) == QuantScheme("int4", int4_group=16)
    assert checkpoint_format(QuantScheme("fp8", fp8_block=(64, 32)).checkpoint_config()) == QuantScheme("fp8", fp8_block=(64, 32))


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "awq"}, "unsupported quantization_config.quant_method 'awq'"),
    ({"format": "nvfp4-pack-quantized"}, "format 'nvfp4-pack-quantized'"),
    ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}},
     "symmetric 4-bit INT"),
    ({"config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}}}},
     "symmetric 4-bit INT"),
    ({"config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 12}}}},
     "not a multiple of 8"),
])
def test_unsupported_quantization_is_named(change, message):
    with pytest.raises(ValueError, match=message):
        checkpoint_format({"quantization_config": {**KIMI_K25_QUANTIZATION, **change}})


def test_kimi_k25_preset_is_the_published_text_model():
    config = get_preset("kimi-k2.5")
    assert "kimi-k2.5" in PRESETS
    expected = dict(vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                    num_hidden_layers=61, num_attention_heads=64, n_routed_experts=384, n_shared_experts=1,
                    num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=1536,
                    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-5,
                    rope_theta=50000.0, routed_scaling_factor=2.827, norm_topk_prob=True, max_position_embeddings=262144,
                    tie_word_embeddings=False)
    assert {name: getattr(config, name) for name in expected} == expected
    yarn = config.rope_scaling
    assert (yarn.factor, yarn.original_max_position_embeddings, yarn.beta_fast, yarn.beta_slow, yarn.mscale, yarn.mscale_all_dim) == (
        64.0, 4096, 32.0, 1.0, 1.0, 1.0)
    assert 1.02e12 < config.num_parameters() < 1.03e12  # "1T total" (1.04T with the vision tower)


def test_multimodal_wrapper_config_reads_its_text_config():
    text = get_preset("kimi-k2.5").to_hf_dict()
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
               "vision_config": {"vt_hidden_size": 1152}, "quantization_config": KIMI_K25_QUANTIZATION}
    assert ModelConfig.from_hf_dict(wrapper) == get_preset("kimi-k2.5")
