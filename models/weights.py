"""Fill a tensor-parallel model's parameters from a Hugging Face checkpoint, reading only this rank's slices.

Every model parameter carries its checkpoint tensor's name, except stacked routed experts:
`X.experts.{proj}{suffix}` [E, ...] is built from `X.experts.{e}.{proj}.weight{suffix}` for e in
0..E-1 (suffix "" for plain and FP8 weights, `_scale_inv` for FP8 block scales, `_packed` / `_scale`
for INT4). A parameter's `tp_shard_dim` (models/sharding.py) is the dimension of the (per-expert)
checkpoint tensor split evenly across ranks; rank r reads only its `shard_range`. The whole checkpoint
is validated from metadata (names, shapes, dtypes; plus the two-int `weight_shape` of INT4 tensors)
before any weight data is read.

How a parameter is filled depends on what the checkpoint holds and what the model keeps:
- the same precision (bf16 / fp32, FP8 weight and its scales, INT4 packed words and scales): the
  rank's slice, copied (cast to the parameter's dtype where it is a float);
- FP8 in the checkpoint, a float parameter: dequantized on load (models/fp8.py), the CPU path;
- INT4 in the checkpoint (`weight_packed` / `weight_scale` / `weight_shape`, compressed-tensors
  `pack-quantized`), a float parameter: dequantized on load (models/quant/int4.py).
A quantized parameter over an unquantized checkpoint tensor is an error (the model does not quantize).
A multimodal checkpoint whose text model lives under `language_model.` (Kimi-K2.5's
`KimiK25ForConditionalGeneration`) is read through that prefix; its vision tower and projector are
not part of this model.

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
from fxfuse.models.quant.int4 import PACKED_SUFFIX, SHAPE_SUFFIX, packed_shapes, read_dequantized_int4
from fxfuse.models.quant.int4 import SCALE_SUFFIX as INT4_SCALE_SUFFIX
from fxfuse.models.quant.scheme import DEFAULT_INT4_GROUP, checkpoint_format
from fxfuse.models.sharding import shard_dim, shard_range
from fxfuse.models.tensor_sources import CheckpointError, DictSource, SafetensorsSource, TensorSource, text_model_source

__all__ = ["CheckpointError", "DictSource", "SafetensorsSource", "TensorSource", "load_weights", "plan_loads"]

LAYER_PREFIX = re.compile(r"^model\.layers\.(\d+)\.")
STACKED_EXPERTS = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)(?P<suffix>_scale_inv|_packed|_scale)?$"
)
ROTARY_INV_FREQ = ".rotary_emb.inv_freq"
INT4_SUFFIXES = (PACKED_SUFFIX, INT4_SCALE_SUFFIX, SHAPE_SUFFIX)

#: How a checkpoint tensor becomes (part of) a parameter.
RAW, FP8_DEQUANT, INT4_DEQUANT = "raw", "fp8-dequant", "int4-dequant"


@dataclass(frozen=True)
class ParamLoad:
    """How one parameter is filled: its checkpoint tensors (one per expert when stacked), the full
    checkpoint shape the model expects of each, the checkpoint dimension split across ranks, and how
    the tensors are read (`RAW`, `FP8_DEQUANT` or `INT4_DEQUANT`)."""

    name: str
    param: torch.nn.Parameter
    tensors: tuple[str, ...]
    stacked: bool
    expected_shape: tuple[int, ...]
    shard_dim: int | None
    kind: str = RAW


@dataclass(frozen=True)
class _Formats:
    """The checkpoint's FP8 block size and INT4 group size (defaults where it declares none)."""

    block: tuple[int, int]
    group: int


def checkpoint_tensors(param_name: str, param: torch.Tensor) -> tuple[tuple[str, ...], bool]:
    """Checkpoint tensor names that make up parameter `param_name`, and whether it stacks experts."""
    match = STACKED_EXPERTS.match(param_name)
    if match is None:
        return (param_name,), False
    experts, proj, suffix = match["experts"], match["proj"], match["suffix"] or ""
    return tuple(f"{experts}.{e}.{proj}.weight{suffix}" for e in range(param.shape[0])), True


def load_weights(model: torch.nn.Module, source: TensorSource, ctx: ParallelContext, *, strict: bool = True) -> None:
    """Copy this rank's slice of every checkpoint tensor into the matching parameter of `model`.

    Values are cast to each parameter's dtype and copied in place on its device. Raises
    `CheckpointError` listing every problem (missing or unexpected tensor, shape mismatch,
    tensor-parallel size not dividing a split dimension, bad FP8 scales or INT4 tensors, a quantized
    parameter over an unquantized tensor) before reading any data. With `strict=False`, missing and
    unexpected tensors are tolerated: parameters lacking a checkpoint tensor keep their values.
    """
    source = text_model_source(source)
    loads = plan_loads(model, source, ctx, strict=strict)
    formats = _formats(source, [])
    with torch.no_grad():
        for load in loads:
            if load.stacked:
                for expert, tensor in enumerate(load.tensors):
                    load.param[expert].copy_(read_shard(source, tensor, load, ctx, formats))
            else:
                load.param.copy_(read_shard(source, load.tensors[0], load, ctx, formats))


def read_shard(source: TensorSource, tensor: str, load: ParamLoad, ctx: ParallelContext, formats: _Formats) -> torch.Tensor:
    """This rank's slice of checkpoint `tensor`, as stored (`RAW`) or dequantized to float32 on the parameter's device."""
    slices = [slice(0, size) for size in load.expected_shape]
    if load.shard_dim is not None:
        slices[load.shard_dim] = slice(*shard_range(load.expected_shape[load.shard_dim], ctx.rank, ctx.world_size))
    if load.kind == FP8_DEQUANT:
        return read_dequantized(source, tensor, tuple(slices), formats.block, load.param.device)
    if load.kind == INT4_DEQUANT:
        return read_dequantized_int4(source, tensor, load.expected_shape, tuple(slices), formats.group, load.param.device)
    return source.read(tensor, tuple(slices))


def plan_loads(model: torch.nn.Module, source: TensorSource, ctx: ParallelContext, *, strict: bool = True) -> list[ParamLoad]:
    """Match every parameter of `model` to its checkpoint tensors and validate them from metadata only.

    Returns the loads to perform (parameters whose tensors are missing are left out when
    `strict=False`); raises `CheckpointError` listing every problem found.
    """
    source = text_model_source(source)
    problems: list[str] = []
    available = set(source.keys())
    formats = _formats(source, problems)
    loads: list[ParamLoad] = []
    used: set[str] = set()
    for load in _parameter_loads(model, ctx, problems):
        kind = _read_kind(load, source, available)
        load = ParamLoad(**{**load.__dict__, "kind": kind})
        wanted = [t + INT4_SUFFIXES[0] for t in load.tensors] if kind == INT4_DEQUANT else list(load.tensors)
        used.update(load.tensors)
        missing = [t for t in wanted if t not in available]
        if missing:
            if strict:
                problems.extend(_missing_problem(t, load, source, available) for t in missing)
            continue
        for tensor in load.tensors:
            if kind == INT4_DEQUANT:
                problems.extend(_int4_problems(source, available, tensor, load, ctx.world_size, formats.group))
                used.update(tensor + suffix for suffix in INT4_SUFFIXES)
            else:
                problems.extend(_tensor_problems(source, available, tensor, load, ctx.world_size, formats.block))
                if tensor.endswith(PACKED_SUFFIX):
                    problems.extend(_packed_shape_problems(source, available, tensor, load))
                    used.add(tensor.removesuffix(PACKED_SUFFIX) + SHAPE_SUFFIX)
        loads.append(load)
    if strict:
        ignorable = _ignorable(available, source, _layer_count(model))
        problems.extend(f"unexpected tensor {t}: no model parameter uses it" for t in sorted(available - used - ignorable))
    if problems:
        raise CheckpointError(problems)
    return loads


def _formats(source: TensorSource, problems: list[str]) -> _Formats:
    """FP8 block and INT4 group size of the checkpoint; config problems go to `problems`."""
    block, group = (1, 1), DEFAULT_INT4_GROUP
    try:
        block = block_size_from_config(source.config)
        scheme = checkpoint_format(source.config)
        group = scheme.int4_group
    except ValueError as exc:
        problems.append(f"config.json: {exc}")
    return _Formats(block, group)


def _read_kind(load: ParamLoad, source: TensorSource, available: set[str]) -> str:
    """How `load`'s tensors are read: dequantized when the checkpoint is quantized and the parameter is a float."""
    if not load.param.is_floating_point() or load.param.dtype == FP8_DTYPE:
        return RAW
    first = load.tensors[0]
    if first in available:
        return FP8_DEQUANT if source.dtype(first) == FP8_DTYPE else RAW
    return INT4_DEQUANT if first + PACKED_SUFFIX in available else RAW


def _missing_problem(tensor: str, load: ParamLoad, source: TensorSource, available: set[str]) -> str:
    """The message for a missing checkpoint tensor; says so when the model wants a quantized form the checkpoint lacks."""
    for suffix in (PACKED_SUFFIX, INT4_SCALE_SUFFIX, SCALE_SUFFIX):
        base = tensor.removesuffix(suffix)
        if tensor.endswith(suffix) and base in available:
            return (f"missing tensor {tensor} (for parameter {load.name}): the checkpoint stores {base} as "
                    f"{source.dtype(base)}, but the model keeps it quantized; load it with --weights bf16")
    return f"missing tensor {tensor} (for parameter {load.name})"


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
    if load.param.dtype == FP8_DTYPE and stored != FP8_DTYPE:
        return [f"tensor {tensor}: stored as {stored}, but the model keeps it FP8 (parameter {load.name}): --weights fp8 "
                "needs an FP8 block-quantized checkpoint; use --weights bf16 for this one"]
    if tensor.endswith(PACKED_SUFFIX) and stored != torch.int32:
        return [f"tensor {tensor}: packed INT4 words must be int32, got {stored}"]
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



def _int4_problems(source: TensorSource, available: set[str], tensor: str, load: ParamLoad, world_size: int, group: int) -> list[str]:
    """What is wrong with INT4 weight `tensor` (its `_packed`, `_scale`, `_shape` tensors) as the source of `load`."""
    missing = [tensor + s for s in INT4_SUFFIXES[1:] if tensor + s not in available]
    if missing:
        return [f"tensor {tensor + PACKED_SUFFIX} is packed INT4 but the checkpoint has no {m}" for m in missing]
    declared = _declared_shape(source, tensor)
    dim = load.shard_dim
    if declared != load.expected_shape:
        if dim is not None and len(declared) == len(load.expected_shape) and declared[dim] % world_size:
            return [f"tensor {tensor}: tensor-parallel size {world_size} does not divide dim {dim} (size {declared[dim]}) "
                    f"of its shape {declared}"]
        return [f"tensor {tensor}: weight_shape {declared} does not match the model's {load.expected_shape} (parameter {load.name})"]
    expected = packed_shapes(declared, group)
    problems = [
        f"tensor {tensor + suffix}: shape {source.shape(tensor + suffix)} does not match {shape} (INT4 {declared}, groups of {group})"
        for suffix, shape in expected.items() if source.shape(tensor + suffix) != shape
    ]
    if source.dtype(tensor + PACKED_SUFFIX) != torch.int32:
        problems.append(f"tensor {tensor + PACKED_SUFFIX}: packed INT4 words must be int32, got {source.dtype(tensor + PACKED_SUFFIX)}")
    return problems


def _packed_shape_problems(source: TensorSource, available: set[str], packed: str, load: ParamLoad) -> list[str]:
    """The `_shape` tensor next to packed INT4 words kept as they are: present, and the logical shape they imply."""
    base = packed.removesuffix(PACKED_SUFFIX)
    if base + SHAPE_SUFFIX not in available:
        return [f"tensor {packed} is packed INT4 but the checkpoint has no {base + SHAPE_SUFFIX}"]
    rows, words = load.expected_shape
    declared = _declared_shape(source, base)
    if len(declared) != 2 or declared[0] != rows or not (words - 1) * 8 < declared[1] <= words * 8:
        return [f"tensor {base + SHAPE_SUFFIX}: {declared} does not fit the model's packed {load.expected_shape} (parameter {load.name})"]
    return []


def _declared_shape(source: TensorSource, weight: str) -> tuple[int, ...]:
    """The logical [out, in] an INT4 weight's `_shape` tensor declares (two ints read from the checkpoint)."""
    shape = source.read(weight + SHAPE_SUFFIX, (slice(None),))
    return tuple(int(v) for v in shape.tolist())


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
