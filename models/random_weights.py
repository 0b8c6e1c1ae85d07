"""Deterministic random weights: a full Hugging Face-format state dict, or this rank's shards directly.

`random_hf_state_dict(config, seed)` draws every checkpoint tensor from a generator seeded by
(seed, tensor name), so the same model comes out at any tensor-parallel size and transformers
can load the very same weights. `init_random_shards(model, seed, ctx)` fills the local shards in
place on their device without ever building a full tensor (big presets, benchmarks); its values
depend on the tensor-parallel layout.

Values: norm weights 1 + 0.1 * N(0, 1) (so norms matter), `e_score_correction_bias`
0.05 * N(0, 1) (comparable to the spread of router scores, so it changes routing), every other
weight 0.02 * N(0, 1). Quantized parameters (FP8 weights, packed INT4 experts) are drawn the same way
in float and quantized with their scales (models/quant/checkpoint.py).
"""

from __future__ import annotations

import zlib

import torch

from fxfuse.models.config import ModelConfig
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.quant.checkpoint import quantize_into, quantized_companion
from fxfuse.models.sharding import shard_dim

WEIGHT_STD = 0.02
NORM_STD = 0.1
BIAS_STD = 0.05


def random_hf_state_dict(config: ModelConfig, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of `config` (per-expert names), deterministic per (seed, name)."""
    state = {}
    for name, shape in config.hf_tensor_shapes().items():
        generator = torch.Generator().manual_seed(_name_seed(seed, name))
        mean, std = _distribution(name)
        state[name] = torch.empty(shape, dtype=torch.float32).normal_(mean, std, generator=generator).to(dtype)
    return state


def init_random_shards(model: torch.nn.Module, seed: int, ctx: ParallelContext) -> None:
    """Fill every parameter of `model` in place with random values drawn on its own device.

    Replicated parameters get the same values on every rank (same seed); split ones are seeded
    per rank. A model with quantized parameters (`model.quant`) gets them quantized from such values. Values depend on the tensor-parallel size; use `random_hf_state_dict` when tp=1
    and tp=N must hold the same model.
    """
    params = dict(model.named_parameters())
    companions = {c for name, param in params.items() if (c := quantized_companion(name, param)) is not None}
    with torch.no_grad():
        for name, param in params.items():
            if name in companions:
                continue  # a quantized weight's scales: filled with that weight
            rank = 0 if shard_dim(param) is None else ctx.rank
            generator = torch.Generator(device=param.device).manual_seed(_name_seed(seed, f"{name}@rank{rank}"))
            mean, std = _distribution(name)
            companion = quantized_companion(name, param)
            if companion is None:
                param.normal_(mean, std, generator=generator)
                continue
            shape = _unpacked_shape(param, params[companion])
            for index in range(shape[0]) if len(shape) == 3 else (None,):  # stacked experts: one at a time
                part = shape[1:] if index is not None else shape
                values = torch.empty(part, dtype=torch.float32, device=param.device).normal_(mean, std, generator=generator)
                target = (param, params[companion]) if index is None else (param[index], params[companion][index])
                quantize_into(*target, values, model.quant)


def _unpacked_shape(param: torch.Tensor, scale: torch.Tensor) -> tuple[int, ...]:
    """The float shape a quantized parameter holds: itself for FP8, 8 values per int32 word for INT4."""
    if param.dtype == torch.int32:
        return (*param.shape[:-1], param.shape[-1] * 8)
    return tuple(param.shape)


def _name_seed(seed: int, name: str) -> int:
    """A generator seed that differs per tensor name and per run seed."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _distribution(name: str) -> tuple[float, float]:
    """(mean, std) of the normal distribution a tensor of this name is drawn from."""
    if name.endswith("norm.weight"):
        return 1.0, NORM_STD
    if name.endswith("e_score_correction_bias"):
        return 0.0, BIAS_STD
    return 0.0, WEIGHT_STD
