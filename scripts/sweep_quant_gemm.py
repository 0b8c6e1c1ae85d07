"""Tile sweep of the quantized Triton GEMM (dense FP8, 128 x 128 blocks, w8a16 and w8a8) on one GPU.

A development tool: for DeepSeek-V3 layer shapes and 1 / 8 / 64 / 256 rows it times every tile shape
(BLOCK_M, BLOCK_N, warps, stages, split-K auto or 1) with `triton.testing.do_bench_cudagraph`, prints
the best per point next to bf16 `F.linear`, and writes every timing to OUT_DIR/sweep.json. The
tile table in models/quant/triton_gemm.py (`tile_shape`) was chosen from its output
(bench/results/gpu_check_20261201b/gemm_tile_sweep.md). Points past the time budget are skipped.

Usage: python3 scripts/sweep_quant_gemm.py OUT_DIR [BUDGET_SECONDS, default 200]
"""
import itertools, json, os, sys, time
import torch
from triton.testing import do_bench_cudagraph
from fxfuse.models.fp8 import FP8_DTYPE
from fxfuse.models.quant.triton_gemm import quant_matmul, split_k_for, processor_count
from fxfuse.models.quant.reference import quantize_activations
import torch.nn.functional as F

budget = float(sys.argv[2]) if len(sys.argv) > 2 else 200
began = time.time()
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
shapes = {"o_proj": (7168, 16384), "q_a_proj": (1536, 7168), "expert_gate": (2048, 7168), "kv_b_proj": (32768, 512)}
rows_list = [1, 8, 64, 256]
out = []
for name, (n, k) in shapes.items():
    w = (torch.randn(n, k, device=dev, generator=g) * 0.5).to(FP8_DTYPE)
    s = torch.rand(-(-n // 128), -(-k // 128), device=dev, generator=g) * 0.02 + 0.01
    wb = torch.randn(n, k, device=dev, generator=g).to(torch.bfloat16)
    for rows in rows_list:
        x = torch.randn(rows, k, device=dev, generator=g).to(torch.bfloat16)
        q, qs = quantize_activations(x, 128)
        ids = torch.arange(rows, device=dev, dtype=torch.int32)
        bf16_us = do_bench_cudagraph(lambda: F.linear(x, wb), rep=20) * 1000
        out.append(dict(name=name, n=n, k=k, rows=rows, variant="bf16", us=bf16_us))
        for gemm in ("w8a16", "w8a8"):
            a, a_s = (x, None) if gemm == "w8a16" else (q, qs)
            best = None
            for bm, bn, warps, stages, split in itertools.product((16, 64, 128), (64, 128), (4, 8), (3, 4), ("auto", 1)):
                if bm > max(16, 1 << (rows - 1).bit_length()) or time.time() - began > budget:
                    continue
                if (bm == 16 and warps == 8) or (split == 1 and rows > 8):
                    continue
                res = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
                sk = split_k_for(-(-rows // bm), -(-n // bn), -(-k // 128), processor_count(0)) if split == "auto" else 1
                fn = lambda: quant_matmul(a, a_s, w, s, None, None, res, int4=False, scale_block=(128, 128), block_m=bm,
                                          split_k=sk, block_n=bn, num_warps=warps, num_stages=stages)
                try:
                    fn(); torch.cuda.synchronize()
                    us = do_bench_cudagraph(fn, rep=20) * 1000
                except Exception as e:  # out of shared memory etc.
                    us = None
                row = dict(name=name, n=n, k=k, rows=rows, variant=gemm, bm=bm, bn=bn, warps=warps, stages=stages, split=sk, us=us)
                out.append(row)
                if us is not None and (best is None or us < best["us"]):
                    best = row
            if best:
                print(f"{name} {n}x{k} rows {rows} {gemm}: best {best['us']:.1f} us (bf16 {bf16_us:.1f}) "
                      f"bm {best['bm']} bn {best['bn']} w {best['warps']} st {best['stages']} split {best['split']}", flush=True)
    del w, s, wb
json.dump(out, open(os.path.join(sys.argv[1], "sweep.json"), "w"), indent=0)
print("elapsed", time.time() - began)
