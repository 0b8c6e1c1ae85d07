"""Quantize full-precision weights into the checkpoint formats: HF state dicts and a rank's own shards.

`quantize_state_dict(state, scheme)` turns a Hugging Face-format float state dict into what a
DeepSeek-V3 FP8 checkpoint (every decoder projection `float8_e4m3fn` + `weight_scale_inv`, models/fp8.py)
or a Kimi-K2.5 INT4 checkpoint (routed experts as compressed-tensors `weight_packed` / `weight_scale` /
`weight_shape`, models/quant/int4.py) holds: random-weight runs then load through the same code as real
checkpoints. `quantize_into(weight_param, companion, values, scheme)` fills a quantized parameter and
its scales from float values (random shards of big presets, built on the GPU).
"""

from __future__ import annotations

import torch

from fxfuse.models.fp8 import FP8_DTYPE, quantize_blocks, scale_name
from fxfuse.models.quant.int4 import pack_checkpoint_tensors, pack_int4, quantize_groups
from fxfuse.models.quant.scheme import FP8_CHECKPOINT_TENSOR, INT4_CHECKPOINT_TENSOR, QuantScheme


def quantize_state_dict(state: dict[str, torch.Tensor], scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """`state` with the tensors `scheme`'s checkpoint format quantizes replaced by their quantized form."""
    if scheme.weights == "bf16":
        return dict(state)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if scheme.weights == "fp8" and FP8_CHECKPOINT_TENSOR.match(name):
            out[name], out[scale_name(name)] = quantize_blocks(tensor, scheme.fp8_block)
        elif scheme.weights == "int4" and INT4_CHECKPOINT_TENSOR.match(name):
            out.update(pack_checkpoint_tensors(name, tensor, scheme.int4_group))
        else:
            out[name] = tensor
    return out


def quantized_companion(name: str, param: torch.Tensor) -> str | None:
    """Name of the scale parameter filled together with quantized parameter `name` (None if not quantized)."""
    if param.dtype == FP8_DTYPE:
        return name + "_scale_inv"
    if name.endswith("_packed"):
        return name.removesuffix("_packed") + "_scale"
    return None


def quantize_into(weight: torch.Tensor, scale: torch.Tensor, values: torch.Tensor, scheme: QuantScheme) -> None:
    """Quantize float `values` [..., N, K] (stacked experts: one at a time) into `weight` and its `scale` in place."""
    if values.dim() == 3:
        for expert in range(values.shape[0]):
            quantize_into(weight[expert], scale[expert], values[expert], scheme)
        return
    if weight.dtype == FP8_DTYPE:
        quantized, scale_inv = quantize_blocks(values, scheme.fp8_block)
        weight.copy_(quantized)
        scale.copy_(scale_inv)
    else:
        ints, group_scale = quantize_groups(values, scheme.int4_group, scale.dtype)
        weight.copy_(pack_int4(ints))
        scale.copy_(group_scale)
