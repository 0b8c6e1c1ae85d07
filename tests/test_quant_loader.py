"""Loading quantized checkpoints: FP8 (DeepSeek-V3 layout) and INT4 (compressed-tensors pack-quantized,
Kimi-K2.5 layout) kept exactly as stored, one rank's slice each; INT4 dequantized on load for a bf16 /
fp32 model; Kimi-K2.5's multimodal naming (`language_model.` prefix, a vision tower to skip); and the
loader's all-problems-at-once errors for quantized tensors."""

from __future__ import annotations

import pytest
import torch

from checkpoint_helpers import fake_rank_context
from quant_helpers import (FP8, INT4, TINY_ALIGNED, ct_dequantized, expected_slice, float_state, fp8_checkpoint,
                           int4_checkpoint, save_checkpoint)
from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
from fxfuse.models.weights import CheckpointError, DictSource, SafetensorsSource, load_weights


def build(scheme, ctx, dtype=torch.float32):
    return DeepseekV3ForCausalLM(TINY_ALIGNED, ctx, dtype=dtype, max_batch=1, max_seq_len=8, quant=scheme)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    state = float_state()
    fp8, int4 = fp8_checkpoint(state), int4_checkpoint(state)
    root = tmp_path_factory.mktemp("quant")
    save_checkpoint(root / "fp8", fp8, FP8)
    save_checkpoint(root / "int4", int4, INT4)
    return {"fp8": (root / "fp8", fp8), "int4": (root / "int4", int4), "root": root}


@pytest.mark.parametrize("fmt, scheme", [("fp8", FP8), ("int4", INT4)])
@pytest.mark.parametrize("world_size", [1, 2])
def test_quantized_tensors_are_kept_as_stored_per_rank(checkpoints, fmt, scheme, world_size):
    directory, checkpoint = checkpoints[fmt]
    kept = set()
    with SafetensorsSource(directory) as source:
        for rank in range(world_size):
            model = build(scheme, fake_rank_context(rank, world_size))
            load_weights(model, source, fake_rank_context(rank, world_size))
            for name, param in model.named_parameters():
                if name.endswith("kv_b_proj.weight") and fmt == "fp8":
                    continue  # held dequantized (tested below)
                expected = expected_slice(checkpoint, name, param, rank, world_size)
                if param.dtype in (torch.float8_e4m3fn, torch.int32):
                    kept.add(name)
                    assert param.dtype == expected.dtype and torch.equal(param.view(torch.uint8), expected.view(torch.uint8)), name
                else:
                    assert torch.equal(param, expected.to(param.dtype)), name
    if fmt == "fp8":  # every decoder projection but kv_b_proj, routed and shared experts included
        assert "model.layers.1.mlp.experts.down_proj" in kept and "model.layers.0.self_attn.q_a_proj.weight" in kept
        assert len(kept) == 2 * 4 + 3 + 3 + 3  # attention (4 per layer), dense MLP, shared expert, routed experts
    else:  # routed experts only
        assert kept == {f"model.layers.1.mlp.experts.{p}_packed" for p in ("gate_proj", "up_proj", "down_proj")}


def test_fp8_kv_b_proj_is_dequantized_on_load(checkpoints):
    _, checkpoint = checkpoints["fp8"]
    model = build(FP8, fake_rank_context(1, 2))
    load_weights(model, DictSource(checkpoint, config=FP8.checkpoint_config()), fake_rank_context(1, 2))
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    weight, scale = checkpoint[name], checkpoint[name + "_scale_inv"]
    full = weight.float() * scale.repeat_interleave(16, 0).repeat_interleave(16, 1)
    assert torch.equal(model.get_parameter(name), full.chunk(2, dim=0)[1])


@pytest.mark.parametrize("world_size", [1, 2])
def test_int4_dequantized_on_load_matches_compressed_tensors(checkpoints, world_size):
    directory, checkpoint = checkpoints["int4"]
    reference = ct_dequantized(checkpoint)
    with SafetensorsSource(directory) as source:
        for rank in range(world_size):
            model = build(None, fake_rank_context(rank, world_size))
            load_weights(model, source, fake_rank_context(rank, world_size))
            for name, param in model.named_parameters():
                if ".experts." in name and "shared" not in name:
                    assert torch.equal(param, expected_slice(reference, name, param, rank, world_size)), name


def test_kimi_k25_naming_prefix_and_vision_tower(checkpoints):
    _, checkpoint = checkpoints["int4"]
    directory = checkpoints["root"] / "multimodal"
    vision = {"vision_tower.patch_embed.proj.weight": torch.ones(4, 3), "mm_projector.proj.0.weight": torch.ones(2, 2)}
    save_checkpoint(directory, checkpoint, INT4, prefix="language_model.", extra=vision)
    plain, wrapped = build(INT4, fake_rank_context(0, 2)), build(INT4, fake_rank_context(0, 2))
    load_weights(plain, DictSource(checkpoint, config=INT4.checkpoint_config()), fake_rank_context(0, 2))
    with SafetensorsSource(directory) as source:
        assert "language_model.model.embed_tokens.weight" in source.keys()
        load_weights(wrapped, source, fake_rank_context(0, 2))
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters(), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_quantized_model_over_an_unquantized_checkpoint_is_refused():
    state = float_state()
    with pytest.raises(CheckpointError) as info:
        load_weights(build(FP8, fake_rank_context(0, 2)), DictSource(state), fake_rank_context(0, 2))
    text = str(info.value)
    assert "q_a_proj.weight: stored as torch.float32, but the model keeps it FP8" in text
    assert "missing tensor model.layers.0.self_attn.q_a_proj.weight_scale_inv" in text
    with pytest.raises(CheckpointError, match=r"the checkpoint stores model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight as "
                                              r"torch\.float32, but the model keeps it quantized"):
        load_weights(build(INT4, fake_rank_context(0, 2)), DictSource(state), fake_rank_context(0, 2))


def test_int4_problems_are_listed_together(checkpoints):
    _, checkpoint = checkpoints["int4"]
    broken = dict(checkpoint)
    experts = "model.layers.1.mlp.experts"
    del broken[f"{experts}.0.gate_proj.weight_shape"]  # kept packed: its shape tensor is required
    broken[f"{experts}.1.up_proj.weight_shape"] = torch.tensor([32, 48], dtype=torch.int32)  # declares the wrong shape
    broken[f"{experts}.2.down_proj.weight_packed"] = broken[f"{experts}.2.down_proj.weight_packed"][:, :2]  # truncated
    source = DictSource(broken, config=INT4.checkpoint_config())
    with pytest.raises(CheckpointError) as kept:
        load_weights(build(INT4, fake_rank_context(0, 2)), source, fake_rank_context(0, 2))
    assert len(kept.value.problems) == 3, kept.value.problems
    assert "has no model.layers.1.mlp.experts.0.gate_proj.weight_shape" in str(kept.value)
    assert "experts.1.up_proj.weight_shape: (32, 48) does not fit" in str(kept.value)
    with pytest.raises(CheckpointError) as dequantized:
        load_weights(build(None, fake_rank_context(0, 2)), source, fake_rank_context(0, 2))
    assert len(dequantized.value.problems) == 3, dequantized.value.problems
    assert "experts.2.down_proj.weight_packed: shape (64, 2) does not match (64, 4)" in str(dequantized.value)


def test_unreadable_quantization_config_is_a_checkpoint_problem(checkpoints):
    _, checkpoint = checkpoints["int4"]
    config = {"quantization_config": {"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {}}}
    with pytest.raises(CheckpointError, match=r"config\.json: unsupported compressed-tensors checkpoint: format 'marlin-24'"):
        load_weights(build(INT4, fake_rank_context(0, 2)), DictSource(checkpoint, config=config), fake_rank_context(0, 2))


def test_splits_that_cut_blocks_or_groups_are_refused_when_building():
    with pytest.raises(ValueError, match=r"cannot keep routed down_proj INT4: each rank's 8 input features are not whole groups of 16"):
        build(INT4, fake_rank_context(0, 4))
    with pytest.raises(ValueError, match=r"cannot keep routed gate_proj FP8 at tensor-parallel size 4: each rank's 8 rows do "
                                         r"not fill whole 16x16 blocks"):
        build(FP8, fake_rank_context(0, 4))
