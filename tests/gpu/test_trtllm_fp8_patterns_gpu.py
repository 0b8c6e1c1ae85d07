"""Why the TensorRT-LLM path quantizes to FP8 in a second kernel rather than in FlashInfer's fused one (issue 31).

FlashInfer 0.7.x (not 0.6.3) has all-reduce + residual + RMSNorm patterns that also quantize the norm's
output per token to FP8 e4m3: `kARResidualRMSNormDynamicFP8Quant` (10) and `...OutDynamicFP8Quant` (11, the
normed bf16 output too). The fused op may run such a pattern only where its codes and scales equal, bit for
bit, those of the quantization the model's own code does (`fxfuse.op.fp8_recipe.quantize_fp8`). This test
pins down the kernel's arithmetic on two ranks sharing the GPU (fxfuse's CUDA-IPC workspace), on random rows
spread over 20 binades (so that the scales take many exponents) and all-zero rows, one-shot and two-shot:
- its normed output is the plain pattern's, bit for bit;
- its scale is `max(amax / 448, 1 / (448 * 512))` in IEEE float32 arithmetic: vLLM's per-token scale;
- its codes are `clamp(x * rcp.approx(scale), -448, 448)` cast to e4m3 (the build's `-use_fast_math` turns
  `x / scale` into the hardware's approximate reciprocal, `rcp.approx.ftz.f32`, times x), bit for bit;
- and so they are NOT those of any spelling the unfused code has (`x / scale`, or vLLM's
  `x * scale.reciprocal()`, which rounds the reciprocal correctly): a few codes in ten million differ by one
  step (the hardware reciprocal itself differs from IEEE `1 / s` for 13% of float32 values: last test).
  The fused op therefore keeps its exact two-kernel path. Should a FlashInfer release divide
  exactly, this test fails and the one-kernel path can be enabled for the recipe it then matches.
Run with `pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from flashinfer_gpu import FLASHINFER_GPU_MARKS

from fxfuse.op.decide.flashinfer_version import installed_features
from fxfuse.runner.launch import run_on_ranks

try:
    import triton
    import triton.language as tl
except ImportError:  # a machine without Triton has no GPU to run these tests on either
    triton = None

if triton is not None:
    @triton.jit
    def _approximate_reciprocal_kernel(source, target, count, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < count
        value = tl.load(source + offsets, mask=mask, other=1.0)
        result = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [value], dtype=tl.float32, is_pure=True, pack=1)
        tl.store(target + offsets, result, mask=mask)

pytestmark = FLASHINFER_GPU_MARKS + [
    pytest.mark.skipif(not installed_features().pcie,
                       reason="FlashInfer's dynamic FP8 patterns: checked in 0.7.2 (0.6.3 lacks them)"),
]

HIDDEN = 7168
MIN_SCALE = 1 / (448 * 512)
#: (tokens, one-shot) points; two-shot at 128 and 2048 tokens.
POINTS = ((1, True), (7, True), (128, True), (128, False), (2048, False))


def _rows(rank: int, tokens: int, seed: int, device):
    """(x on this rank, residual, weight): bf16 rows scaled by 2**-10 .. 2**9; a quarter all-zero for seed 2."""
    def randn(salt):
        g = torch.Generator().manual_seed(zlib.crc32(repr((seed, tokens, salt)).encode()))
        return (torch.randn(tokens, HIDDEN, generator=g) * 2.0 ** torch.randint(-10, 10, (tokens, 1), generator=g)).to(device, torch.bfloat16)

    x, residual = randn(rank), randn("residual")
    weight = (1 + 0.5 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed))).to(device, torch.bfloat16)
    if seed == 2:
        x[: max(1, tokens // 4)] = 0
        residual[: max(1, tokens // 4)] = 0
    return x, residual, weight


def _approximate_reciprocal(values: torch.Tensor) -> torch.Tensor:
    """`rcp.approx.ftz.f32` of each float32 value, through Triton's inline PTX."""
    values = values.contiguous()
    out = torch.empty_like(values)
    _approximate_reciprocal_kernel[(triton.cdiv(values.numel(), 1024),)](values, out, values.numel(), BLOCK=1024)
    return out


def pattern_checks(ctx) -> dict:
    """On each rank: patterns 1, 10 and 11 on the same inputs; counts of values where they and the candidate
    arithmetics differ."""
    os.environ["FXFUSE_TOPOLOGY"] = "nvswitch"
    torch.cuda.set_device(ctx.rank % torch.cuda.device_count())
    from fxfuse.op.fp8_recipe import FP8_DTYPE, Fp8Recipe, quantize_fp8
    from fxfuse.op.runtime.trtllm_kernels import TrtllmFusionKernels

    device = torch.device("cuda", torch.cuda.current_device())
    kernels = TrtllmFusionKernels()
    workspace = kernels.create_workspace(ctx.group, ctx.rank, ctx.world_size, max(t for t, _ in POINTS), HIDDEN, torch.bfloat16)
    patterns = kernels._comm.AllReduceFusionPattern
    vllm = Fp8Recipe("per_row", min_scale=MIN_SCALE, reciprocal=True)
    divide = Fp8Recipe("per_row", min_scale=MIN_SCALE)
    counts: dict = {"values": 0}

    def add(name, differing):
        counts[name] = counts.get(name, 0) + int(differing.sum())

    for tokens, oneshot in POINTS:
        for seed in (0, 1, 2):
            x, residual, weight = _rows(ctx.rank, tokens, seed, device)
            outputs = {}
            for name, pattern in (("plain", patterns.kARResidualRMSNorm), ("fp8_out", patterns.kARResidualRMSNormOutDynamicFP8Quant),
                                  ("fp8", patterns.kARResidualRMSNormDynamicFP8Quant)):
                normed, residual_out = torch.empty_like(x), torch.empty_like(x)
                codes = torch.empty(tokens, HIDDEN, dtype=FP8_DTYPE, device=device)
                scales = torch.full((tokens,), -1.0, device=device)
                tensors = {"norm_out": normed} if name != "fp8" else {}
                if name != "plain":
                    tensors.update(quant_out=codes, scale_out=scales)
                kernels._launch(workspace, x.clone(), pattern, oneshot, residual_in=residual, residual_out=residual_out,
                                rms_gamma=weight, rms_eps=1e-6, **tensors)
                outputs[name] = normed, codes, scales
            torch.cuda.synchronize()
            normed, codes, scales = outputs["fp8_out"]
            counts["values"] += codes.numel()
            add("normed_vs_plain_pattern", normed.view(torch.int16) != outputs["plain"][0].view(torch.int16))
            add("pattern_10_vs_11_codes", outputs["fp8"][1].view(torch.uint8) != codes.view(torch.uint8))
            add("pattern_10_vs_11_scales", outputs["fp8"][2] != scales)
            amax = normed.float().abs().amax(-1)
            add("scale_vs_ieee", scales != (amax / 448).clamp_min(MIN_SCALE))
            column = scales.unsqueeze(-1).expand(tokens, HIDDEN)
            approximate = (normed.float() * _approximate_reciprocal(column)).clamp(-448, 448).to(FP8_DTYPE)
            add("codes_vs_approximate_reciprocal", approximate.view(torch.uint8) != codes.view(torch.uint8))
            for recipe_name, recipe in (("vllm_reciprocal", vllm), ("divide", divide)):
                recipe_codes, recipe_scales = quantize_fp8(normed, recipe)
                add(f"codes_vs_{recipe_name}_recipe", recipe_codes.view(torch.uint8) != codes.view(torch.uint8))
                add(f"scales_vs_{recipe_name}_recipe", recipe_scales.view(-1) != scales)
    kernels.destroy_workspace(workspace, ctx.group)
    return counts


@pytest.fixture(scope="module")
def counts():
    """Rank 0's counts (both ranks see the same sums)."""
    from flashinfer_gpu import build_flashinfer_kernels

    build_flashinfer_kernels()
    return run_on_ranks(pattern_checks, 2, timeout_s=600)[0]


def test_the_fused_fp8_patterns_norm_and_scale_as_the_exact_code_does(counts):
    print(counts)
    assert counts["values"] == 3 * HIDDEN * sum(t for t, _ in POINTS)
    for name in ("normed_vs_plain_pattern", "pattern_10_vs_11_codes", "pattern_10_vs_11_scales", "scale_vs_ieee",
                 "scales_vs_vllm_reciprocal_recipe", "scales_vs_divide_recipe"):
        assert counts[name] == 0, (name, counts)


def test_the_fused_fp8_patterns_codes_come_from_an_approximate_reciprocal(counts):
    assert counts["codes_vs_approximate_reciprocal"] == 0, counts
    # Not the unfused code's: a few codes in ten million differ (6 and 19 of 35M when this was written).
    assert 0 < counts["codes_vs_vllm_reciprocal_recipe"] < counts["values"] * 1e-5, counts
    assert 0 < counts["codes_vs_divide_recipe"] < counts["values"] * 1e-5, counts


def test_the_approximate_reciprocal_differs_from_ieee_for_many_scales():
    """The hardware reciprocal against IEEE `1 / s` for every float32 in [2**-18, 2**20), the range of the scales
    of rows of bf16 activations: on the H200 42,123,836 of 318,767,104 values (13%) differ, so any code that
    quantizes with it differs from the unfused code's wherever a product lands near a rounding boundary."""
    low, high = (int(torch.tensor(2.0**e).view(torch.int32)) for e in (-18, 20))
    differing = 0
    for start in range(low, high, 1 << 26):
        values = torch.arange(start, min(start + (1 << 26), high), dtype=torch.int32, device="cuda").view(torch.float32)
        differing += int((_approximate_reciprocal(values) != values.reciprocal()).sum())
    assert 0.05 < differing / (high - low) < 0.3, differing

