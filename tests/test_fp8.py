"""FP8 block-quantized checkpoints (DeepSeek-V3 format): quantize/dequantize, and load_weights
dequantizing exactly each rank's slice from the weight and the scale blocks that cover it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from checkpoint_helpers import expected_shard, fake_rank_context, sharded_module_tree
from fxfuse.models.fp8 import dequantize_window, quantize_blocks
from fxfuse.models.weights import CheckpointError, DictSource, SafetensorsSource, load_weights

#: Weights with dims above 128 (several blocks) and not multiples of 128 (partial last blocks),
#: split so that tp=2 and tp=4 slices start inside a block.
FLOAT_SHAPES = {
    "model.layers.0.self_attn.q_b_proj.weight": (300, 64),
    "model.layers.0.self_attn.o_proj.weight": (200, 300),
    "model.layers.0.mlp.experts.0.gate_proj.weight": (260, 200),
    "model.layers.0.mlp.experts.1.gate_proj.weight": (260, 200),
    "model.layers.0.mlp.experts.0.down_proj.weight": (200, 260),
    "model.layers.0.mlp.experts.1.down_proj.weight": (200, 260),
}
NORM = "model.layers.0.input_layernorm.weight"


def independent_dequant(weight: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """Full-tensor dequantization written independently of models/fp8.py: index the scale grid."""
    rows = torch.arange(weight.shape[0]) // block[0]
    cols = torch.arange(weight.shape[1]) // block[1]
    return weight.float() * scale_inv[rows][:, cols]


def fp8_checkpoint(block, seed=0):
    """(float weights, FP8 checkpoint tensors incl. `*_scale_inv`, dequantized full weights)."""
    generator = torch.Generator().manual_seed(seed)
    floats = {name: torch.randn(shape, generator=generator) for name, shape in FLOAT_SHAPES.items()}
    checkpoint, dequantized = {NORM: torch.randn(200, generator=generator)}, {}
    for name, weight in floats.items():
        quantized, scale_inv = quantize_blocks(weight, block)
        checkpoint[name], checkpoint[name + "_scale_inv"] = quantized, scale_inv
        dequantized[name] = independent_dequant(quantized, scale_inv, block)
    dequantized[NORM] = checkpoint[NORM]
    return floats, checkpoint, dequantized


def quantization_config(block):
    return {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}}


def model_for(world_size, dtype=torch.float32):
    shapes = {**FLOAT_SHAPES, NORM: (200,)}
    return sharded_module_tree(shapes, world_size, dtype=dtype)


def test_quantize_blocks_follows_deepseek_layout():
    weight = torch.randn(300, 200)
    quantized, scale_inv = quantize_blocks(weight, (128, 128))
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == weight.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (3, 2)
    assert torch.allclose(scale_inv[2, 1], weight[256:, 128:].abs().max() / 448)
    restored = independent_dequant(quantized, scale_inv, (128, 128))
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus the subnormal step near zero.
    step = scale_inv[torch.arange(300) // 128][:, torch.arange(200) // 128] * 2.0**-9
    assert ((restored - weight).abs() <= weight.abs() * 2.0**-4 + step).all()


@pytest.mark.parametrize("window", [(0, 0, 300, 200), (150, 0, 150, 200), (37, 100, 200, 57), (255, 129, 45, 71)])
def test_dequantize_window_matches_full_dequant(window):
    row, col, rows, cols = window
    block = (128, 128)
    quantized, scale_inv = quantize_blocks(torch.randn(300, 200), block)
    covering = scale_inv[row // 128 : -(-(row + rows) // 128), col // 128 : -(-(col + cols) // 128)]
    part = dequantize_window(quantized[row : row + rows, col : col + cols], covering, block, row, col)
    assert torch.equal(part, independent_dequant(quantized, scale_inv, block)[row : row + rows, col : col + cols])


@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_load_dequantizes_each_ranks_slice_exactly(tmp_path, block, world_size):
    floats, checkpoint, dequantized = fp8_checkpoint(block)
    save_file(checkpoint, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(quantization_config(block)))
    with SafetensorsSource(tmp_path) as source:
        for rank in range(world_size):
            model = model_for(world_size)
            load_weights(model, source, fake_rank_context(rank, world_size))
            for name, param in model.named_parameters():
                assert torch.equal(param, expected_shard(dequantized, name, param, rank, world_size)), name
                original = expected_shard({**floats, NORM: checkpoint[NORM]}, name, param, rank, world_size)
                assert torch.allclose(param, original, rtol=2.0**-4, atol=0.02), name


def test_load_casts_dequantized_weights_to_parameter_dtype():
    _, checkpoint, dequantized = fp8_checkpoint((128, 128))
    model = model_for(2, dtype=torch.bfloat16)
    load_weights(model, DictSource(checkpoint), fake_rank_context(1, 2))
    for name, param in model.named_parameters():
        assert torch.equal(param, expected_shard(dequantized, name, param, 1, 2).bfloat16()), name


class RecordingSource(DictSource):
    """A DictSource that records the shape of every read."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads: dict[str, list[tuple[int, ...]]] = {}

    def read(self, name, slices):
        part = super().read(name, slices)
        self.reads.setdefault(name, []).append(tuple(part.shape))
        return part


def test_reads_only_the_slice_and_its_covering_scales():
    _, checkpoint, _ = fp8_checkpoint((128, 128))
    source = RecordingSource(checkpoint, config=quantization_config((128, 128)))
    load_weights(model_for(2), source, fake_rank_context(1, 2))
    # o_proj [200, 300] split on dim 1: rank 1 holds cols 150..299 -> scale cols 1..2 of 3.
    assert source.reads["model.layers.0.self_attn.o_proj.weight"] == [(200, 150)]
    assert source.reads["model.layers.0.self_attn.o_proj.weight_scale_inv"] == [(2, 2)]
    # q_b_proj [300, 64] split on dim 0: rank 1 holds rows 150..299 -> scale rows 1..2 of 3.
    assert source.reads["model.layers.0.self_attn.q_b_proj.weight_scale_inv"] == [(2, 1)]
    assert source.reads["model.layers.0.mlp.experts.1.down_proj.weight"] == [(200, 130)]


def test_fp8_tensor_without_scales_is_reported():
    _, checkpoint, _ = fp8_checkpoint((128, 128))
    del checkpoint["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    with pytest.raises(CheckpointError, match=r"o_proj\.weight is FP8 but the checkpoint has no .*o_proj\.weight_scale_inv"):
        load_weights(model_for(2), DictSource(checkpoint), fake_rank_context(0, 2))


def test_scale_grid_of_wrong_shape_is_reported():
    _, checkpoint, _ = fp8_checkpoint((128, 128))
    with pytest.raises(CheckpointError, match=r"o_proj\.weight_scale_inv: shape \(2, 3\) does not match \(4, 10\)") as info:
        load_weights(model_for(2), DictSource(checkpoint, config=quantization_config((64, 32))), fake_rank_context(0, 2))
    assert len(info.value.problems) == len(FLOAT_SHAPES)


def test_other_8_bit_float_formats_are_rejected():
    _, checkpoint, _ = fp8_checkpoint((128, 128))
    name = "model.layers.0.self_attn.o_proj.weight"
    checkpoint[name] = checkpoint[name].to(torch.float8_e5m2)
    with pytest.raises(CheckpointError, match=r"o_proj\.weight: stored as torch\.float8_e5m2; only torch\.float8_e4m3fn"):
        load_weights(model_for(2), DictSource(checkpoint), fake_rank_context(0, 2))


# ---- end to end: our tp=2 model from an FP8 checkpoint vs transformers on the dequantized weights ----

#: Block size for the tiny end-to-end model: smaller than its dims and not dividing them, so that
#: weights have several blocks, partial last blocks, and tp=2 slices that start inside a block.
E2E_BLOCK = (24, 24)


def fp8_model_checkpoints(tmp_path):
    """Write a tiny HF DeepSeek-V3 as an FP8 checkpoint (every 2-D projection block-quantized) and
    as a float32 checkpoint of exactly the dequantized weights; returns both directories."""
    from checkpoint_helpers import save_tiny_hf_checkpoint

    float_dir, fp8_dir, dequant_dir = tmp_path / "float", tmp_path / "fp8", tmp_path / "dequant"
    full = save_tiny_hf_checkpoint(float_dir)
    config = json.loads((float_dir / "config.json").read_text())
    fp8, dequantized = {}, {}
    for name, tensor in full.items():
        if name.endswith("_proj.weight"):
            quantized, scale_inv = quantize_blocks(tensor, E2E_BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = quantized, scale_inv
            dequantized[name] = independent_dequant(quantized, scale_inv, E2E_BLOCK)
        else:
            fp8[name] = dequantized[name] = tensor
    for directory, tensors, extra in ((fp8_dir, fp8, quantization_config(E2E_BLOCK)), (dequant_dir, dequantized, {})):
        directory.mkdir()
        save_file(tensors, directory / "model.safetensors")
        (directory / "config.json").write_text(json.dumps({**config, **extra}))
    return fp8_dir, dequant_dir


def _fp8_logits_on_rank(ctx, directory, input_ids):
    """Rank body: our model from the FP8 checkpoint, prefill logits for `input_ids` (as numpy: a
    torch tensor would travel back as shared memory that dies with the rank's process)."""
    from fxfuse.models.config import ModelConfig
    from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM

    batch, length = input_ids.shape
    model = DeepseekV3ForCausalLM(
        ModelConfig.from_pretrained(directory), ctx, dtype=torch.float32, device="cpu", max_batch=batch, max_seq_len=length
    )
    with SafetensorsSource(directory) as source:
        load_weights(model, source, ctx)
    with torch.no_grad():
        return model(input_ids, torch.arange(length).expand(batch, length)).numpy()


@pytest.mark.slow
def test_fp8_checkpoint_tp2_matches_transformers_on_dequantized_weights(tmp_path):
    from transformers import DeepseekV3ForCausalLM as HFDeepseekV3

    from fxfuse.runner.launch import run_on_ranks

    fp8_dir, dequant_dir = fp8_model_checkpoints(tmp_path)
    input_ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    ours = run_on_ranks(_fp8_logits_on_rank, 2, fp8_dir, input_ids)
    reference = HFDeepseekV3.from_pretrained(dequant_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(input_ids).logits.float()
    for logits in map(torch.from_numpy, ours):
        assert logits.shape == expected.shape
        assert (logits - expected).abs().max() / expected.abs().max() <= 1e-4
