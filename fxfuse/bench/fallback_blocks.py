"""The blocks `fxfuse bench fallback` compiles, their inputs, their float32 reference and its check.

Each block is plain PyTorch user code (it calls nothing of fxfuse): a producer `x = input @ proj` (the
row-parallel GEMM whose output a model all-reduces: dead after the all-reduce, and the same cuBLAS call
in both compiled variants; an Inductor-generated producer such as `2 * input` gets its launch
configuration from Inductor's autotuning at the first size it sees: on the H200 the fxfuse graph's
block cost 176 us at 4096 x 7168 under dynamic shapes when compiled at 16 tokens and 111 us when
compiled at 1024, with the same op, and that difference was charged to the op),
`funcol.all_reduce(x) + residual`, a transformers-style
RMSNorm (float32 upcast, the weight after the cast back), then, per quantization kind, an FP8 e4m3
quantization of the normed output as models and libraries write it:
- `none`: no quantization; returns (normed, residual);
- `group`: per token and group of 128, as models/quant/reference.py `quantize_activations` writes it
  (float32 upcast, view [T, H/128, 128], amax of |x| clamped to 1e-12, / 448, divide, clamp, cast:
  DeepSeek-V3's `act_quant` arithmetic with a floor and a clamp); returns (q [T, H], scales [T, H/128]
  float32, residual);
- `row`: per row with dynamic scales, as torchao's `_choose_scale_float8` and `_quantize_affine_float8`
  compute them for `PerRow` (amax of |x| in the activation dtype, / 448 in that dtype, then float32;
  x in float32 / scale, clamp, cast); returns (q [T, H], scales [T, 1] float32, residual);
- `row_reciprocal`: per row as vLLM's QuantFP8 native forward writes it (the maximum of the bf16 values
  via `.max(dim=-1)`, then float32, / 448, the scale bounded below by 1 / (448 * 512), the values times
  `scale.reciprocal()`, clamp, cast); returns (q [T, H], scales [T, 1], residual);
- `group_ue8m0`: per group of 128 as vLLM's per-group native forward writes it with UE8M0 scales (a bf16
  view of groups, `.max(dim=-1, keepdim=True)[0].float()`, / 448, the lower bound on the scale, then
  `exp2(ceil(log2(s)))`, bf16 groups divided by float32 scales); returns (q [T, H], scales [T, H/128, 1]
  as the code leaves them, residual);
- `tensor`: one static scale, `(x.float() * inv_scale).clamp(-448, 448)` cast, with `inv_scale` a
  0-dim float32 input; returns (q [T, H], residual);
- `clamp_scale`: no quantization but a clamp to +-CLAMP then a multiply by SCALE (pointwise code the
  fused op cannot take: the site goes to tier (b)); returns (out [T, H] bf16, residual);
- `second_rmsnorm`: a second transformers-style RMSNorm of the normed output with its own weight (tier
  (b) as well); returns (out [T, H] bf16, residual).
`fp32_reference` computes the same chain in float32 from the inputs, independently of the blocks;
`check_outputs` compares a block's outputs with it (dequantized values for FP8 outputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed._functional_collectives as funcol

from fxfuse.bench.arguments import FALLBACK_QUANT, QUANT_GROUP
from fxfuse.bench.output import relative_l2_error

EPS = 1e-6
#: Width of the producer GEMM's input (`input` [T, PRODUCER_K] @ `proj` [PRODUCER_K, H]): small, so that
#: the GEMM costs about what writing its output costs.
PRODUCER_K = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = QUANT_GROUP
MIN_AMAX = 1e-12
#: vLLM's lower bound on a dynamic scale (1 / (448 * 512)).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
#: Kinds whose scales are powers of two rounded up: a scale may be up to twice the float32 reference's.
POWER_OF_TWO_KINDS = ("group_ue8m0",)
#: Relative L2 error allowed for bf16 outputs against float32 (bf16 rounding alone gives about 3e-3).
BF16_TOLERANCE = 2e-2
#: One e4m3 step relative to the value (3 mantissa bits), and e4m3's subnormal step (2**-9) in units of
#: the scale: a dequantized value may differ from the float32 one by STEP * |value| + SUBNORMAL * scale.
E4M3_STEP = 2.0**-3
E4M3_SUBNORMAL_STEP = 2.0**-9
#: Relative error allowed for a scale: four bf16 roundings of 2**-8 at most each (residual, norm, weight,
#: row's bf16 divide) come to at most 2**-6; twice that (still a quarter of one e4m3 step).
SCALE_TOLERANCE = 2.0**-5
#: `clamp_scale`'s bound and factor: the clamp cuts the normed values' tails (|x| > 2 is a few per cent of them).
CLAMP = 2.0
SCALE = 0.5
#: Kinds whose output after the norm is bf16 (no FP8 quantization): `none` and the bf16 epilogues.
BF16_OUTPUT_KINDS = ("none", "clamp_scale", "second_rmsnorm")
#: Headroom of the static per-tensor scale over the largest normed value (a calibrated scale's margin).
STATIC_SCALE_HEADROOM = 1.25


def _allreduce_add_rmsnorm(inp, residual, weight, proj, group_name: str):
    x = inp @ proj
    hidden = funcol.all_reduce(x, "sum", group_name) + residual
    h = hidden.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(hidden.dtype)
    return weight * normed, hidden


def block(inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, proj: torch.Tensor, group_name: str):
    """Producer, all-reduce, residual add, RMSNorm: (normed, residual)."""
    return _allreduce_add_rmsnorm(inp, residual, weight, proj, group_name)


def group_block(inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, proj: torch.Tensor, group_name: str):
    """`block`, then per-token-group (128) FP8 quantization: (q, scales [T, H/128], residual)."""
    normed, hidden = _allreduce_add_rmsnorm(inp, residual, weight, proj, group_name)
    rows, cols = normed.shape
    groups = normed.float().view(rows, -1, GROUP)
    scales = groups.abs().amax(dim=-1).clamp_min(MIN_AMAX) / FP8_MAX
    q = (groups / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows, cols), scales, hidden


def row_block(inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, proj: torch.Tensor, group_name: str):
    """`block`, then per-row dynamic FP8 quantization as torchao computes it: (q, scales [T, 1], residual)."""
    normed, hidden = _allreduce_add_rmsnorm(inp, residual, weight, proj, group_name)
    scales = (normed.abs().amax(dim=-1, keepdim=True) / FP8_MAX).to(torch.float32)
    q = (normed.to(torch.float32) / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scales, hidden


def row_reciprocal_block(inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, proj: torch.Tensor,
                         group_name: str):
    """`block`, then vLLM's per-token FP8 quantization (a reciprocal multiply): (q, scales [T, 1], residual)."""
    normed, hidden = _allreduce_add_rmsnorm(inp, residual, weight, proj, group_name)
    maxima, _ = normed.abs().max(dim=-1)
    scales = (maxima.unsqueeze(-1).to(torch.float32) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (normed.to(torch.float32) * scales.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scales, hidden


def group_ue8m0_block(inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, proj: torch.Tensor,
                      group_name: str):
    """`block`, then vLLM's per-group (128) FP8 quantization with UE8M0 scales: (q, scales [T, H/128, 1], residual)."""
    normed, hidden = _allreduce_add_rmsnorm(inp, residual, weight, proj, group_name)
    rows, cols = normed.shape
    groups = normed.view(rows, -1, GROUP)
    maxima = groups.abs().max(dim=-1, keepdim=True)[0].float()
    scales = (maxima / FP8_MAX).clamp(min=MIN_SCALE)
    scales = torch.exp2(torch.ceil(torch.log2(scales)))
    q = (groups / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows, cols), scales, hidden


def tensor_block(inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, proj: torch.Tensor,
                 inv_scale: torch.Tensor, group_name: str):
    """`block`, then static per-tensor FP8 quantization by a 0-dim float32 `inv_scale`: (q, residual)."""
    normed, hidden = _allreduce_add_rmsnorm(inp, residual, weight, proj, group_name)
    q = (normed.float() * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, hidden


def clamp_scale_block(inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, proj: torch.Tensor,
                      group_name: str):
    """`block`, then a clamp and a scale of the normed output: (out, residual)."""
    normed, hidden = _allreduce_add_rmsnorm(inp, residual, weight, proj, group_name)
    return normed.clamp(-CLAMP, CLAMP) * SCALE, hidden


def second_rmsnorm_block(inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, proj: torch.Tensor,
                         group_name: str):
    """`block`, then a second RMSNorm of the normed output (weight `2 - weight`): (out, residual)."""
    normed, hidden = _allreduce_add_rmsnorm(inp, residual, weight, proj, group_name)
    n = normed.float()
    return (2 - weight) * (n * torch.rsqrt(n.pow(2).mean(-1, keepdim=True) + EPS)).to(normed.dtype), hidden


#: Quantization kind (`fxfuse.bench.arguments.FALLBACK_QUANT`) -> its block.
BLOCKS: dict[str, Callable] = {"none": block, "group": group_block, "row": row_block, "tensor": tensor_block,
                               "row_reciprocal": row_reciprocal_block, "group_ue8m0": group_ue8m0_block,
                               "clamp_scale": clamp_scale_block, "second_rmsnorm": second_rmsnorm_block}


@dataclass(frozen=True)
class Reference:
    """The chain in float32: the residual sum, the normed output (for the bf16 epilogue kinds: the epilogue's
    output) and (FP8 kinds) the float32 scales."""

    hidden: torch.Tensor
    normed: torch.Tensor
    scales: torch.Tensor | None


def block_inputs(quant: str, tokens: int, hidden: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Deterministic bf16 (input [T, PRODUCER_K], residual [T, H], weight [H], proj [PRODUCER_K, H]) for
    a point, plus for `tensor` the 0-dim float32 inverse scale, calibrated on the float32 reference (its
    largest normed value / 448, with headroom). The first two are the tensors every call streams; weight,
    proj and the scale are shared. `proj` is a signed selection matrix times 2 (one nonzero per column),
    so the GEMM's output, +-2 times an input column, is exact in bf16 whatever its accumulation order:
    the float32 reference sees the very x the block all-reduces (a rounded x would shift values that
    nearly cancel against the residual by far more than an e4m3 step of their own size)."""
    g = torch.Generator(device="cpu").manual_seed(tokens * 7 + hidden)
    inp = torch.randn(tokens, PRODUCER_K, generator=g).to(device, torch.bfloat16)
    residual = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, torch.bfloat16)
    proj = torch.zeros(PRODUCER_K, hidden)
    signs = torch.randint(0, 2, (hidden,), generator=g) * 4.0 - 2.0
    proj[torch.randint(0, PRODUCER_K, (hidden,), generator=g), torch.arange(hidden)] = signs
    proj = proj.to(device, torch.bfloat16)
    if quant != "tensor":
        return inp, residual, weight, proj
    _, normed = _fp32_norm(inp, residual, weight, proj)
    inv_scale = FP8_MAX / (STATIC_SCALE_HEADROOM * normed.abs().amax())
    return inp, residual, weight, proj, inv_scale.to(torch.float32)


def _fp32_norm(inp, residual, weight, proj):
    hidden = inp.float() @ proj.float() + residual.float()
    return hidden, hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()


def fp32_reference(quant: str, inputs: tuple[torch.Tensor, ...]) -> Reference:
    """The block's chain for `quant` in float32 from its inputs (a one-rank all-reduce is the identity)."""
    hidden, normed = _fp32_norm(*inputs[:4])
    if quant == "none":
        scales = None
    elif quant == "clamp_scale":
        normed, scales = normed.clamp(-CLAMP, CLAMP) * SCALE, None
    elif quant == "second_rmsnorm":
        weight = 2 - inputs[2].float()
        normed, scales = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + EPS) * weight, None
    elif quant == "group":
        scales = normed.view(normed.shape[0], -1, GROUP).abs().amax(-1).clamp_min(MIN_AMAX) / FP8_MAX
    elif quant == "row":
        scales = normed.abs().amax(-1, keepdim=True) / FP8_MAX
    elif quant == "row_reciprocal":
        scales = (normed.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    elif quant == "group_ue8m0":  # before the rounding to a power of two (check_outputs allows up to twice it)
        scales = (normed.view(normed.shape[0], -1, GROUP).abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    elif quant == "tensor":
        scales = 1 / inputs[4]
    else:
        raise ValueError(f"unknown quantization {quant!r}; choose from {', '.join(FALLBACK_QUANT)}")
    return Reference(hidden, normed, scales)


def _expanded(scales: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Scales broadcast to every element they scale: per group of 128 columns, per row or one value."""
    if scales.dim() == 2 and scales.shape[1] not in (1, shape[1]):
        return scales.repeat_interleave(shape[1] // scales.shape[1], dim=1)
    return scales.expand(shape)


def check_outputs(quant: str, outputs: tuple[torch.Tensor, ...], reference: Reference) -> dict:
    """How far a block's outputs are from the float32 reference, and whether that is within bounds.

    Always `residual_rel_err` (relative L2, bound `BF16_TOLERANCE`). For `BF16_OUTPUT_KINDS`,
    `normed_rel_err` (the output after the norm, relative L2, same bound). For FP8 kinds,
    `dequant_err_over_bound`: the largest |q * scale - normed| / (E4M3_STEP * |normed| +
    E4M3_SUBNORMAL_STEP * scale) over the elements (at most 1: within one e4m3 step), and for the dynamic kinds `scale_rel_err`, the largest relative
    error of a scale (bound `SCALE_TOLERANCE`). `ok` says whether every measure is within its bound.
    """
    result = {"residual_rel_err": relative_l2_error(outputs[-1], reference.hidden)}
    if quant in BF16_OUTPUT_KINDS:
        result["normed_rel_err"] = relative_l2_error(outputs[0], reference.normed)
        result["ok"] = all(err <= BF16_TOLERANCE for err in result.values())  # False for NaN too
        return result
    q = outputs[0]
    if q.dtype != FP8 or q.shape != reference.normed.shape:
        raise ValueError(f"the {quant} block returned {q.dtype} {tuple(q.shape)}, not float8_e4m3fn "
                         f"{tuple(reference.normed.shape)}")
    scales = reference.scales if quant == "tensor" else outputs[1]
    if quant != "tensor":
        if scales.numel() != reference.scales.numel():
            raise ValueError(f"the {quant} block returned scales of shape {tuple(scales.shape)}, not "
                             f"{tuple(reference.scales.shape)}")
        scales = scales.float().reshape(reference.scales.shape[0], -1)
        expected = reference.scales.reshape(scales.shape)
        if quant in POWER_OF_TWO_KINDS:  # a power of two in [expected, 2 * expected]: how far outside, relatively
            ratio = scales / expected
            result["scale_power_of_two"] = bool((torch.log2(scales) % 1 == 0).all())
            result["scale_rel_err"] = float(torch.maximum(1 / ratio - 1, ratio / 2 - 1).clamp_min(0).max())
        else:
            result["scale_rel_err"] = float(((scales - expected) / expected).abs().max())
    reference_scales = reference.scales.reshape(scales.shape) if quant != "tensor" else reference.scales
    if quant in POWER_OF_TWO_KINDS:
        reference_scales = 2 * reference_scales
    dequantized = q.float() * _expanded(scales.float(), q.shape)
    bound = E4M3_STEP * reference.normed.abs() + E4M3_SUBNORMAL_STEP * _expanded(reference_scales, q.shape)
    result["dequant_err_over_bound"] = float(((dequantized - reference.normed).abs() / bound).max())
    result["ok"] = (result["residual_rel_err"] <= BF16_TOLERANCE and result["dequant_err_over_bound"] <= 1
                    and result.get("scale_rel_err", 0.0) <= SCALE_TOLERANCE and result.get("scale_power_of_two", True))
    return result

