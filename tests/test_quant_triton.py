"""The quantized Triton GEMMs in Triton's CPU interpreter (TRITON_INTERPRET=1, float32 and float16; the
interpreter computes bfloat16 wrongly): dense FP8 with bf16-style activations (w8a16) and with
per-token-group FP8 activations (w8a8), dense INT4, the grouped routed-expert path in both formats,
against the dequantizing reference; and the fixed-size tile table of rows sorted by expert.

Shapes are small and ragged (rows, N and K not multiples of the tiles; experts with no rows, one row,
several tiles) so masking and the tile table are exercised."""

from __future__ import annotations

import pytest
import torch

from fxfuse.models.fp8 import quantize_blocks
from fxfuse.models.quant import reference
from fxfuse.models.quant.int4 import pack_int4, quantize_groups
from fxfuse.models.quant.ops import triton_experts, triton_fp8_linear
from fxfuse.models.quant.triton_gemm import MAX_SPLIT_K, expert_tiles, quant_matmul, split_k_for

#: Relative error (max |diff| / max |ref|) of the kernel against the float32 reference: float32
#: accumulates in another order (~1e-7 seen); float16 rounds activations, weights and the output
#: (2**-11 each, ~4e-4 seen).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
#: float16 w8a8 experts also FP8-round the float16 hidden state where the reference rounds float32 (~4e-3 seen).
W8A8_FP16_EXPERTS = 1e-2


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


def dense(a, a_scale, weight, scale, rows, dtype, *, int4, block, split_k=None):
    out = torch.empty(rows, weight.shape[0], dtype=dtype)
    quant_matmul(a, a_scale, weight, scale, None, None, out, int4=int4, scale_block=block, block_m=16, split_k=split_k)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_fp8_w8a16_and_w8a8(dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(19, 96, generator=generator).to(dtype)
    fp8, scale_inv = quantize_blocks(torch.randn(72, 96, generator=generator), (16, 32))  # N = 72: a partial scale row
    # the dense Triton paths of fxfuse_quant::fp8_linear (w8a16) and fp8_linear_quantized (w8a8, quantized by the caller)
    for gemm, (a, a_scale) in (("w8a16", (x, None)), ("w8a8", reference.quantize_activations(x, 32))):
        out = triton_fp8_linear(a, a_scale, fp8, scale_inv, (16, 32), dtype)
        assert out.dtype == dtype
        assert relative(out, reference.fp8_linear_reference(x.float(), fp8, scale_inv, (16, 32), gemm)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_int4(dtype):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(21, 80, generator=generator).to(dtype)  # K = 80: a partial 64-wide K tile
    values, scale = quantize_groups(torch.randn(40, 80, generator=generator), 16, torch.float32)
    out = dense(x, None, pack_int4(values), scale, 21, dtype, int4=True, block=(1, 16))
    expected = x.float() @ reference.dequantize_int4_packed(pack_int4(values), scale, 16).t()
    assert relative(out, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("split_k", [2, 5])  # 5 > the 3 K blocks (or 2 INT4 K tiles): some splits get no K
def test_split_k_sums_the_same_product(split_k):
    """Split-K (the small-step path on CUDA) gives the unsplit product, FP8 (both activation kinds) and INT4,
    with a ragged K."""
    generator = torch.Generator().manual_seed(3)
    rows = 5
    x = torch.randn(rows, 96, generator=generator)
    fp8, scale_inv = quantize_blocks(torch.randn(40, 96, generator=generator), (16, 32))
    quantized, act_scale = reference.quantize_activations(x, 32)
    for a, a_scale in ((x, None), (quantized, act_scale)):
        whole = dense(a, a_scale, fp8, scale_inv, rows, torch.float32, int4=False, block=(16, 32), split_k=1)
        split = dense(a, a_scale, fp8, scale_inv, rows, torch.float32, int4=False, block=(16, 32), split_k=split_k)
        assert relative(split, whole) <= TOLERANCE[torch.float32]
    values, scale = quantize_groups(torch.randn(40, 96, generator=generator), 16, torch.float32)
    whole, split = (dense(x, None, pack_int4(values), scale, rows, torch.float32, int4=True, block=(1, 16), split_k=s)
                    for s in (1, split_k))
    assert relative(split, whole) <= TOLERANCE[torch.float32]


def test_split_k_choice():
    assert split_k_for(busy_tiles=8, n_blocks=32, k_blocks=112, processors=132) == 5  # 1056 programs wanted
    assert split_k_for(busy_tiles=1, n_blocks=24, k_blocks=56, processors=132) == MAX_SPLIT_K
    assert split_k_for(busy_tiles=1, n_blocks=9, k_blocks=4, processors=132) == 4  # at least one K block each
    assert split_k_for(busy_tiles=4, n_blocks=384, k_blocks=12, processors=132) == 1  # already enough programs


def stacked_weights(fmt: str, experts: int, hidden: int, inter: int, generator):
    shapes = ((experts, inter, hidden), (experts, inter, hidden), (experts, hidden, inter))
    stacked = []
    for shape in shapes:
        weight = torch.randn(*shape, generator=generator) * 0.1
        if fmt == "fp8":
            parts = [quantize_blocks(weight[e], (16, 16)) for e in range(experts)]
            stacked.append((torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])))
        else:
            values, scale = quantize_groups(weight, 16, torch.float32)
            stacked.append((pack_int4(values), scale))
    return stacked


@pytest.mark.parametrize("fmt, gemm", [("fp8", "w8a16"), ("fp8", "w8a8"), ("int4", "w8a16")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_experts_match_reference(fmt, gemm, dtype):
    generator = torch.Generator().manual_seed(2)
    experts, hidden, inter, tokens, top_k = 6, 64, 32, 13, 2
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    # expert 0: 13 rows (a full tile and a partial one), expert 5: none, the rest a few
    ids = torch.stack([torch.tensor([0, 1 + t % 4]) for t in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    stacked = stacked_weights(fmt, experts, hidden, inter, generator)
    got = triton_experts(x, ids, weights, stacked, fmt, (16, 16), gemm)
    expected = reference.quant_experts_reference(x.float(), ids, weights, stacked, fmt, (16, 16), gemm)
    bound = W8A8_FP16_EXPERTS if (gemm, dtype) == ("w8a8", torch.float16) else TOLERANCE[dtype]
    assert got.dtype == dtype and relative(got, expected) <= bound


def test_expert_tile_table_covers_every_row_once():
    rows_per_expert = torch.tensor([13, 0, 1, 16, 17, 0], dtype=torch.int32)
    total, block_m = int(rows_per_expert.sum()), 16
    experts, starts, ends = expert_tiles(rows_per_expert, total, block_m)
    assert experts.shape == (-(-total // block_m) + 6,)  # fixed size for any routing of `total` rows
    covered = []
    for expert, start, end in zip(experts.tolist(), starts.tolist(), ends.tolist()):
        if expert < 0:
            continue
        rows = list(range(start, min(start + block_m, end)))
        assert rows, "a used tile has rows"
        begin = int(rows_per_expert[:expert].sum())
        assert all(begin <= r < begin + int(rows_per_expert[expert]) for r in rows)
        covered += rows
    assert covered == list(range(total))
    assert experts.tolist().count(-1) == experts.shape[0] - (1 + 1 + 1 + 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_activation_quantization_kernel_gives_the_reference_scales(dtype):
    """The one-kernel per-token-group FP8 quantization computes the reference's scales (here bit for bit), with a
    ragged last group, an all-zero group and values spanning e4m3's range. (Its e4m3 codes are compared
    on the GPU, tests/gpu/test_quantized_gemm.py: Triton's CPU interpreter rounds float8 wrongly when
    rounding carries into the exponent, e.g. -7.8 -> -4.)"""
    from fxfuse.models.quant.act_quant import quantize_activations_triton

    x = activation_sample(dtype)
    quantized, scale = quantize_activations_triton(x, 32)
    assert quantized.shape == x.shape and quantized.dtype == torch.float8_e4m3fn
    assert torch.equal(scale, reference.quantize_activations(x, 32)[1])


def activation_sample(dtype) -> torch.Tensor:
    """6 x 80 activations (groups of 32, the last ragged) from 1e-3 to 1e2, one all-zero group."""
    generator = torch.Generator().manual_seed(4)
    x = (torch.randn(6, 80, generator=generator) * torch.logspace(-3, 2, 80)).to(dtype)
    x[2, 32:64] = 0
    return x
