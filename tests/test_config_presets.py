"""ModelConfig and presets: published numbers, layer override, config.json round trips, tp checks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import DeepseekV3Config

from fxfuse.models.config import ModelConfig, YarnScaling
from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.presets import PRESETS, get_preset

#: deepseek-ai/DeepSeek-V3 config.json as published (old rope spelling), minus the FP8 quantization block.
DEEPSEEK_V3_CONFIG_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def test_deepseek_v3_preset_is_the_published_model():
    config = get_preset("deepseek-v3")
    assert config == ModelConfig.from_hf_dict(DEEPSEEK_V3_CONFIG_JSON)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (61, 7168, 18432)
    assert (config.moe_intermediate_size, config.n_routed_experts, config.n_shared_experts) == (2048, 256, 1)
    assert (config.num_experts_per_tok, config.n_group, config.topk_group, config.first_k_dense_replace) == (8, 8, 4, 3)
    assert (config.q_lora_rank, config.kv_lora_rank) == (1536, 512)
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (128, 64, 128)
    assert (config.num_attention_heads, config.vocab_size, config.max_position_embeddings) == (128, 129280, 163840)
    assert config.rope_scaling == YarnScaling(40.0, 4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    assert (config.rope_theta, config.routed_scaling_factor, config.norm_topk_prob, config.rms_norm_eps) == (10000.0, 2.5, True, 1e-6)
    assert round(config.num_parameters() / 1e9) == 671  # the published 671B, without the MTP layer


def test_kimi_k2_preset_numbers():
    config = get_preset("kimi-k2")
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (61, 7168, 64)
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_shared_experts) == (384, 8, 1)
    assert (config.n_group, config.topk_group, config.first_k_dense_replace) == (1, 1, 1)
    assert (config.vocab_size, config.rope_theta, config.routed_scaling_factor) == (163840, 50000.0, 2.827)
    assert config.rope_scaling == YarnScaling(32.0, 4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    assert config.max_position_embeddings == 131072
    assert round(config.num_parameters() / 1e12, 2) == 1.03  # "1T total parameters"


def test_tiny_preset_exercises_every_path_and_fits_tp_2_and_4():
    config = get_preset("tiny")
    assert config.num_hidden_layers >= 4 and config.first_k_dense_replace >= 1 and config.num_moe_layers >= 2
    assert config.n_group > 1 and config.q_lora_rank is not None
    assert config.rope_scaling is not None
    assert config.rope_scaling.cos_sin_factor() != 1.0 and config.softmax_scale != config.qk_head_dim**-0.5
    assert 256 <= config.vocab_size <= 512 and config.hidden_size == 64
    for tp in (1, 2, 4):
        config.check_tensor_parallel(tp)
    assert config.num_parameters() < 1_000_000


def test_layers_override_keeps_full_width():
    full, short = get_preset("deepseek-v3"), get_preset("deepseek-v3", layers=4)
    assert short.num_hidden_layers == 4
    assert replace(short, num_hidden_layers=61) == full
    assert "model.layers.3.mlp.experts.255.down_proj.weight" in short.hf_tensor_shapes()
    assert "model.layers.4.input_layernorm.weight" not in short.hf_tensor_shapes()


def test_unknown_preset_lists_the_names():
    with pytest.raises(ValueError) as error:
        get_preset("llama")
    for name in PRESETS:
        assert name in str(error.value)


@pytest.mark.parametrize("preset", PRESETS)
def test_config_json_round_trip_through_transformers(preset, tmp_path):
    config = get_preset(preset)
    DeepseekV3Config(**config.to_hf_dict()).save_pretrained(tmp_path)
    assert ModelConfig.from_pretrained(tmp_path) == config


def test_round_trip_without_q_lora_and_without_rope_scaling(tmp_path):
    config = replace(get_preset("tiny"), q_lora_rank=None, rope_scaling=None, tie_word_embeddings=True)
    hf_config = DeepseekV3Config(**config.to_hf_dict())
    assert hf_config.q_lora_rank is None and hf_config.rope_parameters["rope_type"] == "default"
    hf_config.save_pretrained(tmp_path)
    assert ModelConfig.from_pretrained(tmp_path) == config
    assert "lm_head.weight" not in config.hf_tensor_shapes()


def test_old_and_transformers5_rope_spellings_read_the_same():
    yarn = {"factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    new_spelling = {k: v for k, v in DEEPSEEK_V3_CONFIG_JSON.items() if k not in ("rope_scaling", "rope_theta")}
    new_spelling["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, **yarn}
    assert ModelConfig.from_hf_dict(new_spelling) == ModelConfig.from_hf_dict(DEEPSEEK_V3_CONFIG_JSON)


def test_model_shard_shapes_at_real_width_on_meta_device():
    config = get_preset("deepseek-v3", layers=4)
    model = DeepseekV3ForCausalLM(config, ParallelContext(), dtype=torch.bfloat16, device="meta", max_seq_len=16)
    params = dict(model.named_parameters())
    assert params["model.layers.3.mlp.experts.gate_proj"].shape == (256, 2048, 7168)
    assert params["model.layers.3.mlp.experts.down_proj"].shape == (256, 7168, 2048)
    assert params["model.layers.3.mlp.gate.weight"].dtype == torch.float32  # router math in fp32, as transformers
    assert sum(p.numel() for p in params.values()) == config.num_parameters()


@pytest.mark.parametrize(
    "preset, tp, culprits, innocent",
    [
        ("tiny", 3, ["num_attention_heads (4)", "intermediate_size (128)", "moe_intermediate_size (32)"], "vocab_size"),
        ("deepseek-v3", 3, ["num_attention_heads (128)", "vocab_size (129280)", "moe_intermediate_size (2048)"], "18432"),
    ],
)
def test_tensor_parallel_size_that_does_not_divide_is_named(preset, tp, culprits, innocent):
    with pytest.raises(ValueError) as error:
        get_preset(preset).check_tensor_parallel(tp)
    for culprit in culprits:
        assert culprit in str(error.value)
    assert innocent not in str(error.value)


def test_real_presets_fit_eight_way_tensor_parallel():
    for preset in ("deepseek-v3", "kimi-k2"):
        get_preset(preset).check_tensor_parallel(8)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        ({"num_key_value_heads": 16}, "num_key_value_heads"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"n_group": 3}, "n_group 3 does not divide"),
    ],
)
def test_unsupported_configs_are_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict({**DEEPSEEK_V3_CONFIG_JSON, **change})


LLAMA_CONFIG_JSON = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128}


def test_a_config_of_another_model_type_is_refused_naming_the_supported_ones():
    """Issue 41: a Llama config.json (its 4 KV heads equal its 4 heads) used to be read as a DeepSeek-V3 it made up."""
    with pytest.raises(ValueError, match=r"config.json is of model_type 'llama' \(architectures LlamaForCausalLM\): fxfuse's "
                                         r"reference model is DeepSeek-V3's, and reads model_type deepseek_v3 or kimi_k2"):
        ModelConfig.from_hf_dict(LLAMA_CONFIG_JSON)
    kimi = {**DEEPSEEK_V3_CONFIG_JSON, "model_type": "kimi_k2"}
    assert ModelConfig.from_hf_dict(kimi) == ModelConfig.from_hf_dict(DEEPSEEK_V3_CONFIG_JSON)


@pytest.mark.parametrize("command", ["report", "run"])
def test_report_and_run_refuse_another_model_type_in_one_line(command, tmp_path, capsys):
    import json

    from fxfuse.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_CONFIG_JSON))
    assert main([command, "--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json is of model_type 'llama'" in err, err

