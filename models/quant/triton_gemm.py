"""Triton GEMMs that read quantized weights directly: FP8 block-scaled and INT4 group-packed, dense or
grouped by expert.

One kernel, `_quant_matmul_kernel`, computes `out[r] = a[row_ids[r]] @ W[e]^T` for the rows r of a
row tile, every tile belonging to one expert e (a dense linear is one expert with every row). The
weight is dequantized in the kernel:
- FP8 [E, N, K] with float32 block scales [E, ceil(N / bn), ceil(K / bk)] (BLOCK_K = bk): with bf16
  activations ("w8a16") the FP8 tile is widened to the activation dtype (exact) and the block scale
  multiplies the tile's partial product; with FP8 activations ("w8a8", per-token-group scales from
  `quantize_activations`) the FP8 x FP8 product is scaled by both scales;
- INT4 [E, N, K / 8] int32 words with group scales [E, N, K / group]: nibbles are unpacked and
  multiplied by their group's scale in float32, rounded to the activation dtype, then multiplied.
Accumulation is in float32. `expert_tiles` builds the tile table with fixed shapes from the rows per
expert (no host synchronization), so the launch can be captured in a CUDA graph.

The kernel is JIT-decorated on first use (`_kernel()`), so `TRITON_INTERPRET=1` set before that
first use runs it in Triton's CPU interpreter (float32 / float16 tests; not bfloat16).
"""

from __future__ import annotations

import functools
import os

import torch

#: Row tile heights: small steps (decode, verify) use the smallest tile tl.dot allows.
SMALL_BLOCK_M, LARGE_BLOCK_M = 16, 64
#: Rows above which the large tile is used.
LARGE_M_ROWS = 256
BLOCK_N = 64
INT4_BLOCK_K = 64


@functools.cache
def _kernel(interpret: str | None):
    """The Triton kernel, decorated now (so the interpreter setting of this moment applies)."""
    import triton
    import triton.language as tl

    def quant_matmul(
        a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr,
        row_ids_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
        N, K,
        stride_am, stride_ak, stride_asm, stride_ask,
        stride_we, stride_wn, stride_wk,
        stride_se, stride_sn, stride_sk,
        stride_om, stride_on,
        WEIGHT_INT4: tl.constexpr, ACT_FP8: tl.constexpr,
        SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        tile = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(tile_expert_ptr + tile)
        if expert >= 0:
            start = tl.load(tile_start_ptr + tile)
            end = tl.load(tile_end_ptr + tile)
            rows = start + tl.arange(0, BLOCK_M)
            row_mask = rows < end
            src = tl.load(row_ids_ptr + rows, mask=row_mask, other=0).to(tl.int64)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
            w_base = w_ptr + expert.to(tl.int64) * stride_we
            s_base = w_scale_ptr + expert.to(tl.int64) * stride_se
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < K
                a = tl.load(a_ptr + src[:, None] * stride_am + offs_k[None, :] * stride_ak,
                            mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                w_mask = n_mask[:, None] & k_mask[None, :]
                if WEIGHT_INT4:
                    words = tl.load(w_base + offs_n[:, None] * stride_wn + (offs_k[None, :] // 8) * stride_wk,
                                    mask=w_mask, other=0)
                    nibble = (words >> ((offs_k[None, :] % 8) * 4)) & 0xF
                    scale = tl.load(s_base + offs_n[:, None] * stride_sn + (offs_k[None, :] // SCALE_BLOCK_K) * stride_sk,
                                    mask=w_mask, other=0.0)
                    w = ((nibble - 8).to(tl.float32) * scale.to(tl.float32)).to(a.dtype)
                    acc += tl.dot(a, tl.trans(w))
                else:
                    w = tl.load(w_base + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk, mask=w_mask, other=0.0)
                    scale = tl.load(s_base + (offs_n // SCALE_BLOCK_N) * stride_sn + (k0 // SCALE_BLOCK_K) * stride_sk,
                                    mask=n_mask, other=0.0)
                    if ACT_FP8:
                        a_scale = tl.load(a_scale_ptr + src * stride_asm + (k0 // SCALE_BLOCK_K) * stride_ask,
                                          mask=row_mask, other=0.0)
                        acc += tl.dot(a, tl.trans(w)) * a_scale[:, None] * scale[None, :]
                    else:
                        acc += tl.dot(a, tl.trans(w.to(a.dtype))) * scale[None, :]
            out = out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])

    return triton.jit(quant_matmul)


def block_m_for(rows: int) -> int:
    """Row-tile height for a GEMM over `rows` rows."""
    return LARGE_BLOCK_M if rows > LARGE_M_ROWS else SMALL_BLOCK_M


def expert_tiles(rows_per_expert: torch.Tensor, total_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert, first row, end row) int32 per row tile, over rows sorted by expert; unused tiles get expert -1.

    `rows_per_expert` [E] (int32) counts each expert's rows; the table has the fixed length
    ceil(total_rows / block_m) + E, an upper bound of the tiles any routing needs.
    """
    experts = rows_per_expert.shape[0]
    counts = rows_per_expert.to(torch.int64)
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles_per_expert, dim=0)
    row_starts = torch.cumsum(counts, dim=0) - counts
    tile = torch.arange(-(-total_rows // block_m) + experts, device=counts.device)
    owner = torch.searchsorted(tile_ends, tile, right=True)
    valid = owner < experts
    owner = owner.clamp(max=experts - 1)
    first_tile = tile_ends[owner] - tiles_per_expert[owner]
    start = row_starts[owner] + (tile - first_tile) * block_m
    end = row_starts[owner] + counts[owner]
    return torch.where(valid, owner, -1).to(torch.int32), start.to(torch.int32), end.to(torch.int32)


def dense_tiles(rows: int, block_m: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tile table of a dense GEMM: every tile expert 0, tiles of `block_m` consecutive rows."""
    tiles = -(-rows // block_m)
    start = torch.arange(tiles, device=device, dtype=torch.int32) * block_m
    return torch.zeros(tiles, device=device, dtype=torch.int32), start, torch.full_like(start, rows)


def quant_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    row_ids: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    *,
    int4: bool,
    scale_block: tuple[int, int],
    block_m: int,
) -> torch.Tensor:
    """Fill out [R, N] with a[row_ids] @ W[expert of the row's tile]^T (see the module docstring).

    a [M, K] (bf16/fp16/fp32, or FP8 with `a_scale` [M, ceil(K / bk)]); weight [E, N, K] FP8 or
    [E, N, K / 8] int32; weight_scale [E, ceil(N / bn), ceil(K / bk)] (FP8) or [E, N, K / group] (INT4,
    scale_block = (1, group)); row_ids int32 [R]; tiles from `expert_tiles` / `dense_tiles`.
    """
    if weight.dim() == 2:
        weight, weight_scale = weight.unsqueeze(0), weight_scale.unsqueeze(0)
    n = weight.shape[1]
    k = a.shape[1]
    act_fp8 = a_scale is not None
    block_k = INT4_BLOCK_K if int4 else scale_block[1]
    a_scale_arg = a_scale if act_fp8 else weight_scale
    a_scale_strides = a_scale.stride() if act_fp8 else (0, 0)
    grid = (tiles[0].shape[0], -(-n // BLOCK_N))
    _kernel(os.environ.get("TRITON_INTERPRET"))[grid](
        a, a_scale_arg, weight, weight_scale, out,
        row_ids, *tiles,
        n, k,
        a.stride(0), a.stride(1), *a_scale_strides,
        *weight.stride(), *weight_scale.stride(),
        out.stride(0), out.stride(1),
        WEIGHT_INT4=int4, ACT_FP8=act_fp8,
        SCALE_BLOCK_N=scale_block[0], SCALE_BLOCK_K=scale_block[1],
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
    )
    return out
