"""Which weights a model keeps quantized, and how a checkpoint says it is quantized.

Weight formats (`--weights`):
- "bf16": every weight in the model dtype; quantized checkpoints are dequantized on load.
- "fp8": DeepSeek-V3's format, kept on the GPU: every projection of a decoder layer (attention,
  dense MLP, shared and routed experts) is `float8_e4m3fn` with one float32 `weight_scale_inv` per
  block (128x128 in DeepSeek-V3). Exception: `kv_b_proj`, which MLA uses in weight-absorbed form
  (folded into the query and the attention output, models/mla_attention.py), is dequantized on load.
- "int4": Kimi-K2.5's format: routed experts only, symmetric INT4 in groups of 32 along the input
  dimension, packed 8 per int32 (compressed-tensors `pack-quantized`); everything else (attention,
  shared expert, the dense layer, embeddings) stays in the model dtype.
Embeddings, norms, the router and the lm_head are never quantized.

`checkpoint_format(config)` reads a config.json's `quantization_config`: DeepSeek's `quant_method:
fp8` (+ `weight_block_size`) or compressed-tensors `pack-quantized` INT4 (+ group size); anything
else quantized is a ValueError naming what was found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

#: `--weights` choices.
WEIGHT_FORMATS = ("bf16", "fp8", "int4")

#: FP8 GEMM implementations (FXFUSE_FP8_GEMM): bf16 activations with in-kernel weight dequantization
#: (Triton), or per-token-group (1 x block) FP8 activations with cuBLAS block-scaled `torch._scaled_mm`
#: where this torch and GPU support it, else a Triton kernel (dense linears quantize their input before
#: the GEMM op, in the compiled graph; routed experts inside theirs).
FP8_GEMMS = ("w8a16", "w8a8")

DEFAULT_FP8_BLOCK = (128, 128)
DEFAULT_INT4_GROUP = 32

#: Checkpoint tensors DeepSeek-V3 stores as FP8 (every projection of a decoder layer).
FP8_CHECKPOINT_TENSOR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(gate_proj|up_proj|down_proj)|mlp\.shared_experts\.(gate|up|down)_proj"
    r"|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$"
)
#: Checkpoint tensors Kimi-K2.5 stores as packed INT4 (routed experts only).
INT4_CHECKPOINT_TENSOR = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


@dataclass(frozen=True)
class QuantScheme:
    """How a model holds its weights: the format, its block / group size and the FP8 GEMM."""

    weights: str = "bf16"
    fp8_block: tuple[int, int] = DEFAULT_FP8_BLOCK
    int4_group: int = DEFAULT_INT4_GROUP
    fp8_gemm: str = "w8a16"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {self.weights!r}; choose one of: {', '.join(WEIGHT_FORMATS)}")
        if self.fp8_gemm not in FP8_GEMMS:
            raise ValueError(f"unknown FP8 GEMM {self.fp8_gemm!r}; choose one of: {', '.join(FP8_GEMMS)}")
        if self.int4_group % 8:
            raise ValueError(f"INT4 group size must be a multiple of 8 (8 values per packed int32), got {self.int4_group}")

    @property
    def fp8_dense(self) -> bool:
        """Attention, dense-MLP and shared-expert projections are FP8."""
        return self.weights == "fp8"

    @property
    def experts(self) -> str:
        """Format of the routed experts: "bf16", "fp8" or "int4"."""
        return self.weights

    def checkpoint_config(self) -> dict[str, Any]:
        """The `quantization_config` a checkpoint in this format carries (empty dict for bf16)."""
        if self.weights == "fp8":
            return {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": list(self.fp8_block)}}
        if self.weights == "int4":
            weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                       "group_size": self.int4_group, "dynamic": False}
            return {"quantization_config": {
                "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
                "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
            }}
        return {}


def checkpoint_format(config: Mapping[str, Any]) -> QuantScheme:
    """The weight format a checkpoint's config.json declares (bf16 when it has no quantization_config).

    Reads the top level and, for multimodal wrappers (Kimi-K2.5), `text_config`. Raises ValueError for
    a quantization this model cannot read (another method, asymmetric or non-4-bit INT, activation
    quantization, a group size that is not a multiple of 8).
    """
    quantization = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not quantization:
        return QuantScheme("bf16")
    method = quantization.get("quant_method")
    if method == "fp8":
        block = quantization.get("weight_block_size") or DEFAULT_FP8_BLOCK
        if quantization.get("fmt", "e4m3") != "e4m3" or len(block) != 2 or min(block) < 1:
            raise ValueError(f"unsupported FP8 quantization_config {dict(quantization)} (need fmt e4m3 and a 2-d weight_block_size)")
        return QuantScheme("fp8", fp8_block=(int(block[0]), int(block[1])))
    if method == "compressed-tensors":
        return QuantScheme("int4", int4_group=_compressed_tensors_group(quantization))
    raise ValueError(f"unsupported quantization_config.quant_method {method!r} (this loader reads 'fp8' and "
                     "compressed-tensors 'pack-quantized' INT4)")


def _compressed_tensors_group(quantization: Mapping[str, Any]) -> int:
    """Group size of a compressed-tensors pack-quantized symmetric INT4 weight-only scheme."""
    fmt = quantization.get("format")
    groups = quantization.get("config_groups") or {}
    if fmt != "pack-quantized" or len(groups) != 1:
        raise ValueError(f"unsupported compressed-tensors checkpoint: format {fmt!r} with {len(groups)} config group(s) "
                         "(this loader reads one 'pack-quantized' group)")
    group = next(iter(groups.values()))
    weights = group.get("weights") or {}
    wanted = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    wrong = {k: weights.get(k) for k, v in wanted.items() if weights.get(k) != v}
    if wrong or group.get("input_activations") or not weights.get("group_size"):
        raise ValueError(f"unsupported compressed-tensors weights {dict(weights)}: this loader reads symmetric 4-bit INT "
                         "weights in groups, without activation quantization")
    size = int(weights["group_size"])
    if size % 8:
        raise ValueError(f"compressed-tensors group_size {size} is not a multiple of 8")
    return size
