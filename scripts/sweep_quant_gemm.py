"""Tile sweep of the quantized Triton GEMM (dense FP8, 128 x 128 blocks, w8a16 and w8a8) on one GPU.

A development tool: for DeepSeek-V3 layer shapes and 1 / 8 / 64 / 256 rows it times every tile shape
(BLOCK_M, BLOCK_N, warps, stages, split-K auto or 1) with `triton.testing.do_bench_cudagraph`, prints
the best per point next to bf16 `F.linear`, and writes every timing to OUT_DIR/sweep.json. The
tile table in models/quant/triton_gemm.py (`tile_shape`) was chosen from its output
(bench/results/gpu_check_20261201b/gemm_tile_sweep.md). Points past the time budget are skipped.

When to run it: after a change to the quantized GEMM kernel (models/quant/triton_gemm.py) or to pick tiles
for another GPU than the H200: copy the best tiles into `tile_shape`. One GPU, no FlashInfer.
Usage: python3 scripts/sweep_quant_gemm.py OUT_DIR [BUDGET_SECONDS, default 200]
"""
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from fxfuse.models.fp8 import FP8_DTYPE
from fxfuse.models.quant.reference import quantize_activations
from fxfuse.models.quant.triton_gemm import processor_count, quant_matmul, split_k_for

#: DeepSeek-V3 layer shapes (N, K) swept, and the row counts.
SHAPES = {"o_proj": (7168, 16384), "q_a_proj": (1536, 7168), "expert_gate": (2048, 7168), "kv_b_proj": (32768, 512)}
ROWS = (1, 8, 64, 256)
#: Candidate (BLOCK_M, BLOCK_N, warps, stages, split-K); 8 warps only with BLOCK_M >= 64, split 1 only up to 8 rows.
CANDIDATES = [c for c in itertools.product((16, 64, 128), (64, 128), (4, 8), (3, 4), ("auto", 1))
              if not (c[0] == 16 and c[2] == 8)]


def sweep(budget_s: float) -> list[dict]:
    """Every timing, one dict per (shape, rows, variant, tile shape); candidates past the budget are skipped."""
    began, device = time.time(), torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    out = []
    for name, (n, k) in SHAPES.items():
        weight = (torch.randn(n, k, device=device, generator=generator) * 0.5).to(FP8_DTYPE)
        scale = torch.rand(-(-n // 128), -(-k // 128), device=device, generator=generator) * 0.02 + 0.01
        bf16_weight = torch.randn(n, k, device=device, generator=generator).to(torch.bfloat16)
        for rows in ROWS:
            x = torch.randn(rows, k, device=device, generator=generator).to(torch.bfloat16)
            bf16_us = do_bench_cudagraph(lambda: F.linear(x, bf16_weight), rep=20) * 1000
            out.append(dict(name=name, n=n, k=k, rows=rows, variant="bf16", us=bf16_us))
            for gemm, (a, a_scale) in (("w8a16", (x, None)), ("w8a8", quantize_activations(x, 128))):
                timed = [time_candidate(a, a_scale, weight, scale, rows, n, k, candidate)
                         for candidate in CANDIDATES
                         if candidate[0] <= max(16, 1 << (rows - 1).bit_length()) and not (candidate[4] == 1 and rows > 8)
                         and time.time() - began < budget_s]
                rows_out = [dict(name=name, n=n, k=k, rows=rows, variant=gemm, **t) for t in timed]
                out += rows_out
                done = [r for r in rows_out if r["us"] is not None]
                if done:
                    best = min(done, key=lambda r: r["us"])
                    print(f"{name} {n}x{k} rows {rows} {gemm}: best {best['us']:.1f} us (bf16 {bf16_us:.1f}) bm {best['bm']} "
                          f"bn {best['bn']} w {best['warps']} st {best['stages']} split {best['split']}", flush=True)
    return out


def time_candidate(a, a_scale, weight, scale, rows: int, n: int, k: int, candidate: tuple) -> dict:
    """Microseconds of one tile shape (None where it does not compile or launch, e.g. out of shared memory)."""
    block_m, block_n, warps, stages, split = candidate
    out = torch.empty(rows, n, device=a.device, dtype=torch.bfloat16)
    split_k = split_k_for(-(-rows // block_m), -(-n // block_n), -(-k // 128), processor_count(0)) if split == "auto" else 1

    def call():
        quant_matmul(a, a_scale, weight, scale, None, None, out, int4=False, scale_block=(128, 128), block_m=block_m,
                     split_k=split_k, block_n=block_n, num_warps=warps, num_stages=stages)

    try:
        call()
        torch.cuda.synchronize()
        us = do_bench_cudagraph(call, rep=20) * 1000
    except Exception:  # noqa: BLE001 - a tile shape Triton cannot build here is a result, not a failure
        us = None
    return dict(bm=block_m, bn=block_n, warps=warps, stages=stages, split=split_k, us=us)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python3 scripts/sweep_quant_gemm.py OUT_DIR [BUDGET_SECONDS]")
    started = time.time()
    results = sweep(float(sys.argv[2]) if len(sys.argv) > 2 else 200)
    with open(os.path.join(sys.argv[1], "sweep.json"), "w") as f:
        json.dump(results, f, indent=0)
    print("elapsed", time.time() - started)
