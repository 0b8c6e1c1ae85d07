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

Split-K: small steps (decode, verify) give few output tiles (a 1-token [1536, 7168] projection is 24
programs on a 132-SM GPU), so the K loop is split over `split_k` programs per tile, each writing a
float32 partial product; the partials are then summed in a fixed order (deterministic). `split_k_for`
picks the split that gives about eight programs per SM (small tiles are latency bound: more programs
in flight per SM hide it).

The kernel is JIT-decorated on first use (`_kernel()`), so `TRITON_INTERPRET=1` set before that
first use runs it in Triton's CPU interpreter (float32 / float16 tests; not bfloat16).
"""

from __future__ import annotations

import functools
import os

import torch

#: Tile heights: steps of up to SMALL_M_ROWS rows (decode, verify) use the smallest tile tl.dot allows.
SMALL_BLOCK_M, LARGE_BLOCK_M, SMALL_M_ROWS = 16, 64, 16
#: Tile widths; wide ones for FP8 x FP8 on small steps and for every large step (fxfuse bench gemm
#: and scripts/sweep_quant_gemm.py on an H200: within 1.1x of the best of 48 tile shapes, except
#: 256-row FP8 x FP8 at 1.33x).
NARROW_BLOCK_N, WIDE_BLOCK_N, WIDE_N_ROWS = 64, 128, 128
INT4_BLOCK_K = 64
#: Split-K targets: programs per SM, and the most splits of one tile's K loop.
PROGRAMS_PER_PROCESSOR, MAX_SPLIT_K = 8, 16


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
        stride_om, stride_on, stride_split, split_k, dense_rows,
        DENSE: tl.constexpr, WEIGHT_INT4: tl.constexpr, ACT_FP8: tl.constexpr,
        SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        tile = tl.program_id(0)
        pid_n = tl.program_id(1)
        split = tl.program_id(2)
        if DENSE:  # every row in order, one expert: no tile table
            expert = tl.full((), 0, tl.int32)
            start = tile * BLOCK_M
            end = dense_rows
        else:
            expert = tl.load(tile_expert_ptr + tile)
            start = tl.load(tile_start_ptr + tile)
            end = tl.load(tile_end_ptr + tile)
        if expert >= 0:
            rows = start + tl.arange(0, BLOCK_M)
            row_mask = rows < end
            if DENSE:
                src = rows.to(tl.int64)
            else:
                src = tl.load(row_ids_ptr + rows, mask=row_mask, other=0).to(tl.int64)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
            w_base = w_ptr + expert.to(tl.int64) * stride_we
            s_base = w_scale_ptr + expert.to(tl.int64) * stride_se
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), split_k) * BLOCK_K
            k_begin = split * k_per_split
            for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < K
                a = tl.load(a_ptr + src[:, None] * stride_am + offs_k[None, :] * stride_ak,
                            mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                w_mask = n_mask[:, None] & k_mask[None, :]
                if WEIGHT_INT4:
                    # one [BLOCK_N, BLOCK_K / 8] tile of packed words and one [BLOCK_N, BLOCK_K / group] tile of
                    # scales (contiguous loads), unpacked and scaled in registers
                    offs_word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
                    words = tl.load(w_base + offs_n[:, None] * stride_wn + offs_word[None, :] * stride_wk,
                                    mask=n_mask[:, None] & (offs_word[None, :] < tl.cdiv(K, 8)), other=0)
                    nibbles = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
                    offs_group = k0 // SCALE_BLOCK_K + tl.arange(0, BLOCK_K // SCALE_BLOCK_K)
                    scale = tl.load(s_base + offs_n[:, None] * stride_sn + offs_group[None, :] * stride_sk,
                                    mask=n_mask[:, None] & (offs_group[None, :] < tl.cdiv(K, SCALE_BLOCK_K)), other=0.0)
                    values = tl.reshape((nibbles - 8).to(tl.float32), (BLOCK_N, BLOCK_K // SCALE_BLOCK_K, SCALE_BLOCK_K))
                    w = tl.reshape(values * scale.to(tl.float32)[:, :, None], (BLOCK_N, BLOCK_K)).to(a.dtype)
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
            out = out_ptr + split * stride_split + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])

    return triton.jit(quant_matmul)


def tile_shape(rows: int, act_fp8: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for a GEMM whose tiles hold about `rows` rows (per expert for grouped ones)."""
    if rows <= SMALL_M_ROWS:
        return SMALL_BLOCK_M, WIDE_BLOCK_N if act_fp8 else NARROW_BLOCK_N
    return LARGE_BLOCK_M, WIDE_BLOCK_N if rows > WIDE_N_ROWS else NARROW_BLOCK_N


def split_k_for(busy_tiles: int, n_blocks: int, k_blocks: int, processors: int) -> int:
    """K splits giving about `PROGRAMS_PER_PROCESSOR` programs per SM for `busy_tiles` x `n_blocks`
    output tiles, at most `MAX_SPLIT_K` and never more splits than K blocks."""
    programs = max(1, busy_tiles * n_blocks)
    wanted = -(-PROGRAMS_PER_PROCESSOR * processors // programs)
    return max(1, min(wanted, MAX_SPLIT_K, k_blocks))


@functools.cache
def processor_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device `device_index`."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


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


def quant_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    row_ids: torch.Tensor | None,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    out: torch.Tensor,
    *,
    int4: bool,
    scale_block: tuple[int, int],
    block_m: int,
    busy_tiles: int | None = None,
    split_k: int | None = None,
    block_n: int = NARROW_BLOCK_N,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """Fill out [R, N] with a[row_ids] @ W[expert of the row's tile]^T (see the module docstring).

    a [M, K] (bf16/fp16/fp32, or FP8 with `a_scale` [M, ceil(K / bk)]); weight [E, N, K] FP8 or
    [E, N, K / 8] int32; weight_scale [E, ceil(N / bn), ceil(K / bk)] (FP8) or [E, N, K / group] (INT4,
    scale_block = (1, group)); row_ids int32 [R] and tiles from `expert_tiles`, or both None for a dense
    GEMM (row r of out is row r of a, expert 0).
    `split_k`: K splits (None: `split_k_for` on CUDA, from `busy_tiles`, the tiles that have rows at
    most, default all; 1 elsewhere).
    """
    if weight.dim() == 2:
        weight, weight_scale = weight.unsqueeze(0), weight_scale.unsqueeze(0)
    n = weight.shape[1]
    k = a.shape[1]
    act_fp8 = a_scale is not None
    if int4 and (scale_block[1] & (scale_block[1] - 1) or scale_block[1] < 8):
        raise ValueError(f"the INT4 GPU kernel needs a power-of-two group size of at least 8, got {scale_block[1]}")
    block_k = max(INT4_BLOCK_K, scale_block[1]) if int4 else scale_block[1]
    a_scale_arg = a_scale if act_fp8 else weight_scale
    a_scale_strides = a_scale.stride() if act_fp8 else (0, 0)
    n_blocks = -(-n // block_n)
    dense = tiles is None
    row_tiles = -(-out.shape[0] // block_m) if dense else tiles[0].shape[0]
    if split_k is None:
        split_k = 1
        if out.is_cuda:
            busy = row_tiles if busy_tiles is None else busy_tiles
            split_k = split_k_for(busy, n_blocks, -(-k // block_k), processor_count(out.device.index))
    target = out if split_k == 1 else torch.empty(split_k, *out.shape, dtype=torch.float32, device=out.device)
    grid = (row_tiles, n_blocks, split_k)
    unused = out  # a pointer for the tile-table arguments a dense GEMM never reads
    _kernel(os.environ.get("TRITON_INTERPRET"))[grid](
        a, a_scale_arg, weight, weight_scale, target,
        *((unused,) * 4 if dense else (row_ids, *tiles)),
        n, k,
        a.stride(0), a.stride(1), *a_scale_strides,
        *weight.stride(), *weight_scale.stride(),
        target.stride(-2), target.stride(-1),
        target.stride(0) if split_k > 1 else 0, split_k, out.shape[0],
        DENSE=dense, WEIGHT_INT4=int4, ACT_FP8=act_fp8,
        SCALE_BLOCK_N=scale_block[0], SCALE_BLOCK_K=scale_block[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split_k > 1:  # every row of out lies in some tile, so every partial row was written
        out.copy_(target.sum(dim=0))
    return out
