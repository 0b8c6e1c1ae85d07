"""Helpers for the quantized-weight tests: a tiny DeepSeek-V3 whose every split dimension covers whole
FP8 blocks (16 x 16) and INT4 groups (16) at tp=2, its random float weights, and checkpoints of them in
DeepSeek-V3's FP8 layout and in compressed-tensors' INT4 layout (written by compressed-tensors itself)."""

from __future__ import annotations

import json
import re

import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import save_file

from fxfuse.models.config import ModelConfig
from fxfuse.models.fp8 import quantize_blocks
from fxfuse.models.quant.int4 import quantize_groups
from fxfuse.models.quant.scheme import FP8_CHECKPOINT_TENSOR, INT4_CHECKPOINT_TENSOR, QuantScheme
from fxfuse.models.random_weights import random_hf_state_dict

BLOCK = (16, 16)
GROUP = 16
FP8 = QuantScheme("fp8", fp8_block=BLOCK)
FP8_W8A8 = QuantScheme("fp8", fp8_block=BLOCK, fp8_gemm="w8a8")
INT4 = QuantScheme("int4", int4_group=GROUP)

#: Two layers (one dense, one MoE with 4 experts, top 2); at tp=2 every split projection holds whole
#: 16 x 16 blocks (q_b 128 -> 64 rows, o_proj 64 -> 32 columns, MLP 64 -> 32, experts 32 -> 16) and
#: whole INT4 groups (expert down_proj: 16 input features per rank); kv_a_proj's 48 rows are 3 blocks.
TINY_ALIGNED = ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
    first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
    max_position_embeddings=64,
)
EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+_proj)\.weight(?P<suffix>\w*)$")


def float_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 HF-format weights of TINY_ALIGNED."""
    return random_hf_state_dict(TINY_ALIGNED, seed)


def fp8_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 layout: every decoder projection float8_e4m3fn + `weight_scale_inv` per 16x16 block."""
    out = {}
    for name, tensor in state.items():
        if FP8_CHECKPOINT_TENSOR.match(name):
            out[name], out[name + "_scale_inv"] = quantize_blocks(tensor, BLOCK)
        else:
            out[name] = tensor
    return out


def ct_scheme() -> QuantizationScheme:
    """compressed-tensors' symmetric INT4 group scheme (Kimi-K2.5's, with this test's group size)."""
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP))


def int4_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Kimi-K2.5 layout: routed experts packed by compressed-tensors' own compressor, the rest as is."""
    out = {}
    for name, tensor in state.items():
        if not INT4_CHECKPOINT_TENSOR.match(name):
            out[name] = tensor
            continue
        _, scale = quantize_groups(tensor, GROUP)
        module = PackedQuantizationCompressor.compress({"weight": tensor, "weight_scale": scale}, ct_scheme())
        out.update({f"{name}_{key.removeprefix('weight_')}": value for key, value in module.items()})
    return out


def ct_dequantized(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """float32 weights of an INT4 checkpoint, unpacked by compressed-tensors, times the scales in float32."""
    out = {}
    for name, tensor in checkpoint.items():
        if name.endswith(".weight_packed"):
            base = name.removesuffix("_packed")
            shape = torch.Size(checkpoint[base + "_shape"].tolist())
            values = unpack_from_int32(tensor, 4, shape)
            scale = checkpoint[base + "_scale"].float().repeat_interleave(GROUP, dim=1)
            out[base] = values.float() * scale
        elif not name.endswith(("_scale", "_shape")):
            out[name] = tensor
    return out


def fp8_dequantized(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """float32 weights of an FP8 checkpoint: each value times its block's scale (indexing the scale grid)."""
    out = {}
    for name, tensor in checkpoint.items():
        if name.endswith("_scale_inv"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = checkpoint[name + "_scale_inv"]
            rows, cols = torch.arange(tensor.shape[0]) // BLOCK[0], torch.arange(tensor.shape[1]) // BLOCK[1]
            out[name] = tensor.float() * scale[rows][:, cols]
        else:
            out[name] = tensor
    return out


def save_checkpoint(directory, tensors: dict[str, torch.Tensor], scheme: QuantScheme, prefix: str = "", extra=None) -> None:
    """Write `tensors` (names under `prefix`) and a config.json of TINY_ALIGNED with `scheme`'s quantization_config."""
    directory.mkdir(parents=True, exist_ok=True)
    named = {prefix + name: t.contiguous() for name, t in tensors.items()} | dict(extra or {})
    save_file(named, directory / "model.safetensors", metadata={"format": "pt"})
    config = {**TINY_ALIGNED.to_hf_dict(), **scheme.checkpoint_config()}
    if prefix:
        config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": config,
                  **scheme.checkpoint_config()}
    (directory / "config.json").write_text(json.dumps(config))


def expected_slice(checkpoint: dict[str, torch.Tensor], param_name: str, param: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """What a kept-quantized (or plain) parameter holds on `rank`: its checkpoint tensor(s) split, experts stacked."""
    dim = getattr(param, "tp_shard_dim", None)

    def part(tensor):
        return tensor if dim is None else tensor.chunk(world_size, dim=dim)[rank]

    if param_name in checkpoint:
        return part(checkpoint[param_name])
    match = re.match(r"^(?P<experts>.+\.experts)\.(?P<proj>\w+_proj)(?P<suffix>_scale_inv|_packed|_scale)?$", param_name)
    suffix = match["suffix"] or ""
    return torch.stack([part(checkpoint[f"{match['experts']}.{e}.{match['proj']}.weight{suffix}"]) for e in range(param.shape[0])])
