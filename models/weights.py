"""Fill a tensor-parallel model's parameters from a Hugging Face checkpoint, reading only this rank's slices.

Every model parameter carries its checkpoint tensor's name, except stacked routed experts:
`X.experts.{gate_proj,up_proj,down_proj}` [E, ...] is built from `X.experts.{e}.{proj}.weight`
for e in 0..E-1. A parameter's `tp_shard_dim` (models/sharding.py) is the dimension of the
(per-expert) checkpoint tensor split evenly across ranks; rank r reads only its `shard_range`.
FP8 block-quantized tensors are dequantized on load (models/fp8.py). The whole checkpoint is
validated from metadata (names, shapes, dtypes) before any tensor data is read.

Checkpoint tensors that no parameter uses are errors, except these, which are skipped:
- `model.layers.{i}.*` with i >= the model's layer count: DeepSeek-V3's multi-token-prediction
  layer (`num_nextn_predict_layers`, layer 61) and models built with fewer layers (`--layers N`);
- `*.rotary_emb.inv_freq` (the model computes its rotary tables itself);
- `{name}_scale_inv` next to an FP8 tensor `name` (consumed by dequantization).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from fxfuse.models.fp8 import FP8_DTYPE, SCALE_SUFFIX, block_size_from_config, read_dequantized, scale_name, scale_shape
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.sharding import shard_dim, shard_range
from fxfuse.models.tensor_sources import CheckpointError, DictSource, SafetensorsSource, TensorSource

__all__ = ["CheckpointError", "DictSource", "SafetensorsSource", "TensorSource", "load_weights", "plan_loads"]

LAYER_PREFIX = re.compile(r"^model\.layers\.(\d+)\.")
STACKED_EXPERTS = re.compile(r"^(?P<experts>.+\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)$")
ROTARY_INV_FREQ = ".rotary_emb.inv_freq"


@dataclass(frozen=True)
class ParamLoad:
    """How one parameter is filled: its checkpoint tensors (one per expert when stacked), the full
    checkpoint shape the model expects of each, and the checkpoint dimension split across ranks."""

    name: str
    param: torch.nn.Parameter
    tensors: tuple[str, ...]
    stacked: bool
    expected_shape: tuple[int, ...]
    shard_dim: int | None


def checkpoint_tensors(param_name: str, param: torch.Tensor) -> tuple[tuple[str, ...], bool]:
    """Checkpoint tensor names that make up parameter `param_name`, and whether it stacks experts."""
    match = STACKED_EXPERTS.match(param_name)
    if match is None:
        return (param_name,), False
    experts, proj = match["experts"], match["proj"]
    return tuple(f"{experts}.{e}.{proj}.weight" for e in range(param.shape[0])), True


def load_weights(model: torch.nn.Module, source: TensorSource, ctx: ParallelContext, *, strict: bool = True) -> None:
    """Copy this rank's slice of every checkpoint tensor into the matching parameter of `model`.

    Values are cast to each parameter's dtype and copied in place on its device. Raises
    `CheckpointError` listing every problem (missing or unexpected tensor, shape mismatch,
    tensor-parallel size not dividing a split dimension, bad FP8 scales) before reading any data.
    With `strict=False`, missing and unexpected tensors are tolerated: parameters lacking a
    checkpoint tensor keep their values.
    """
    loads = plan_loads(model, source, ctx, strict=strict)
    block = block_size_from_config(source.config)
    with torch.no_grad():
        for load in loads:
            if load.stacked:
                for expert, tensor in enumerate(load.tensors):
                    load.param[expert].copy_(read_shard(source, tensor, load, ctx, block))
            else:
                load.param.copy_(read_shard(source, load.tensors[0], load, ctx, block))


def read_shard(source: TensorSource, tensor: str, load: ParamLoad, ctx: ParallelContext, block: tuple[int, int]) -> torch.Tensor:
    """This rank's slice of checkpoint `tensor` (FP8 dequantized to float32 on the parameter's device)."""
    slices = [slice(0, size) for size in load.expected_shape]
    if load.shard_dim is not None:
        slices[load.shard_dim] = slice(*shard_range(load.expected_shape[load.shard_dim], ctx.rank, ctx.world_size))
    if source.dtype(tensor) == FP8_DTYPE:
        return read_dequantized(source, tensor, tuple(slices), block, load.param.device)
    return source.read(tensor, tuple(slices))


def plan_loads(model: torch.nn.Module, source: TensorSource, ctx: ParallelContext, *, strict: bool = True) -> list[ParamLoad]:
    """Match every parameter of `model` to its checkpoint tensors and validate them from metadata only.

    Returns the loads to perform (parameters whose tensors are missing are left out when
    `strict=False`); raises `CheckpointError` listing every problem found.
    """
    problems: list[str] = []
    available = set(source.keys())
    try:
        block = block_size_from_config(source.config)
    except ValueError as exc:
        problems.append(f"config.json: {exc}")
        block = (1, 1)
    loads: list[ParamLoad] = []
    used: set[str] = set()
    for load in _parameter_loads(model, ctx, problems):
        used.update(load.tensors)
        missing = [t for t in load.tensors if t not in available]
        if missing:
            if strict:
                problems.extend(f"missing tensor {t} (for parameter {load.name})" for t in missing)
            continue
        for tensor in load.tensors:
            problems.extend(_tensor_problems(source, available, tensor, load, ctx.world_size, block))
        loads.append(load)
    if strict:
        ignorable = _ignorable(available, source, _layer_count(model))
        problems.extend(f"unexpected tensor {t}: no model parameter uses it" for t in sorted(available - used - ignorable))
    if problems:
        raise CheckpointError(problems)
    return loads


def _parameter_loads(model: torch.nn.Module, ctx: ParallelContext, problems: list[str]) -> list[ParamLoad]:
    """One `ParamLoad` per parameter, with the full per-tensor shape its local shape implies."""
    loads = []
    for name, param in model.named_parameters():
        tensors, stacked = checkpoint_tensors(name, param)
        dim = shard_dim(param)
        expected = list(param.shape[1:] if stacked else param.shape)
        if dim is not None:
            if not 0 <= dim < len(expected):
                problems.append(f"parameter {name}: tp_shard_dim {dim} is out of range for shape {tuple(expected)}")
                continue
            expected[dim] *= ctx.world_size
        loads.append(ParamLoad(name, param, tensors, stacked, tuple(expected), dim))
    return loads


def _tensor_problems(
    source: TensorSource, available: set[str], tensor: str, load: ParamLoad, world_size: int, block: tuple[int, int]
) -> list[str]:
    """What is wrong with checkpoint `tensor` as the source of `load` (shape, tp divisibility, FP8 scales)."""
    shape = source.shape(tensor)
    dim = load.shard_dim
    if dim is not None and dim < len(shape) and shape[dim] % world_size:
        return [
            f"tensor {tensor}: tensor-parallel size {world_size} does not divide dim {dim} "
            f"(size {shape[dim]}) of its shape {shape}"
        ]
    if shape != load.expected_shape:
        split = f", dim {dim} split over {world_size} ranks" if dim is not None and world_size > 1 else ""
        return [f"tensor {tensor}: checkpoint shape {shape} does not match the model's {load.expected_shape} (parameter {load.name}{split})"]
    stored = source.dtype(tensor)
    if stored.is_floating_point and stored.itemsize == 1 and stored != FP8_DTYPE:
        return [f"tensor {tensor}: stored as {stored}; only {FP8_DTYPE} block-quantized weights can be dequantized"]
    if stored != FP8_DTYPE:
        return []
    scales = scale_name(tensor)
    if len(shape) != 2:
        return [f"tensor {tensor}: FP8 block dequantization needs a 2-D weight, got shape {shape}"]
    if scales not in available:
        return [f"tensor {tensor} is FP8 but the checkpoint has no {scales}"]
    if source.shape(scales) != scale_shape(shape, block):
        return [f"tensor {scales}: shape {source.shape(scales)} does not match {scale_shape(shape, block)} ({block[0]}x{block[1]} blocks of {shape})"]
    return []


def _layer_count(model: torch.nn.Module) -> int:
    """Number of decoder layers the model has (highest `model.layers.{i}` parameter index + 1)."""
    indices = [int(m[1]) for name, _ in model.named_parameters() if (m := LAYER_PREFIX.match(name))]
    return max(indices, default=-1) + 1


def _ignorable(available: set[str], source: TensorSource, layer_count: int) -> set[str]:
    """Checkpoint tensors that may go unused (see the module docstring for why each is skipped)."""
    skipped = set()
    for name in available:
        layer = LAYER_PREFIX.match(name)
        if layer is not None and int(layer[1]) >= layer_count:
            skipped.add(name)
        elif name.endswith(ROTARY_INV_FREQ):
            skipped.add(name)
        elif name.endswith(SCALE_SUFFIX):
            weight = name.removesuffix(SCALE_SUFFIX)
            if weight in available and source.dtype(weight) == FP8_DTYPE:
                skipped.add(name)
    return skipped
