"""Time the fused add-RMSNorm + FP8 kernel alone against Inductor's code for the same add + norm +
quantization (no all-reduce), per warp count, under CUDA-graph replay: how the kernel's launch shape
should depend on the row width and the token count. One GPU; writes a markdown table to stdout and,
with --out, bench/results-style files.

Usage: python scripts/probe_fp8_kernel.py [--hidden 7168] [--tokens 1,16,128,1024,4096] [--warps 4,8,16]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from fxfuse.bench.replay import replay_timings
from fxfuse.op.fp8_recipe import Fp8Recipe, scale_shape
from fxfuse.op.kernels import add_rmsnorm_fp8_kernel as kernel

RECIPES = {"group": Fp8Recipe("per_group", 128, 1e-12), "row": Fp8Recipe("per_row", 0, 0.0, torch.bfloat16),
           "tensor": Fp8Recipe("static_mul")}
FP8 = torch.float8_e4m3fn


def unfused(recipe: Fp8Recipe):
    """The add, norm and quantization as user code (Inductor compiles it into its own kernels)."""
    def chain(x, residual, weight, inv_scale):
        hidden = x + residual
        h = hidden.float()
        normed = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(hidden.dtype)
        if recipe.scaling == "per_group":
            grouped = normed.float().view(normed.shape[0], -1, 128)
            scale = grouped.abs().amax(-1).clamp_min(1e-12) / 448.0
            return (grouped / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(FP8).view(normed.shape), scale, hidden
        if recipe.scaling == "per_row":
            scale = (normed.abs().amax(-1, keepdim=True) / 448.0).float()
            return (normed.float() / scale).clamp(-448.0, 448.0).to(FP8), scale, hidden
        return (normed.float() * inv_scale).clamp(-448.0, 448.0).to(FP8), inv_scale, hidden
    return chain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--tokens", default="1,16,128,1024,4096")
    parser.add_argument("--warps", default="4,8,16")
    parser.add_argument("--out", default=None, help="also write the rows as JSON to this path")
    args = parser.parse_args()
    device, hidden = torch.device("cuda"), args.hidden
    rows = []
    for name, recipe in RECIPES.items():
        torch._dynamo.reset()  # one chain code object for every recipe: a fresh recompile budget each
        compiled = torch.compile(unfused(recipe), fullgraph=True, dynamic=False)
        for tokens in map(int, args.tokens.split(",")):
            x, residual = (torch.randn(tokens, hidden, device=device).bfloat16() for _ in range(2))
            weight = (1 + 0.1 * torch.randn(hidden, device=device)).bfloat16()
            inv_scale = torch.tensor(40.0, device=device)
            static = None if recipe.dynamic else inv_scale
            outs = (torch.empty_like(x), torch.empty(tokens, hidden, device=device, dtype=FP8),
                    torch.empty(scale_shape(x.shape, recipe), device=device))
            calls = {"inductor": lambda: compiled(x, residual, weight, inv_scale)}
            for warps in map(int, args.warps.split(",")):
                def fused(warps=warps):
                    kernel.num_warps_for = lambda block: warps  # the probe's knob: the launch's warp count
                    kernel._DIRECT.clear()
                    kernel.add_rmsnorm_fp8_into(x, residual, weight, 1e-6, recipe, static, outs[0], None, outs[1], outs[2])
                fused()  # compiles this warp count outside the capture
                calls[f"fused_w{warps}"] = fused
            timings = {label: replay_timings({label: call}, 15, 20)[label][0] for label, call in calls.items()}
            row = {"quant": name, "tokens": tokens, "hidden": hidden, **{k: round(v, 2) for k, v in timings.items()}}
            rows.append(row)
            print(row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(statistics.mean(r["inductor"] for r in rows))


if __name__ == "__main__":
    main()
