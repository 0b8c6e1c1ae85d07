"""Where the time of `fxfuse bench fallback`'s compiled blocks goes, kernel by kernel, at chosen points.

For each (hidden, quantization, tokens) point, static shapes (or dynamic with --dynamic): both variants of the benchmark
(`inductor`, `fxfuse` with the op on its one-rank NCCL fallback) are compiled and checked, replayed in
CUDA graphs (interleaved, medians), and profiled uncaptured with torch.profiler: every GPU kernel each
variant launches per call, with its mean device time. Then the parts alone, replayed in CUDA graphs:
the in-place NCCL all-reduce, the op's add-RMSNorm kernel at 4/8/16/32 warps (no quantization points
with static shapes only) and Inductor's add + RMSNorm without the all-reduce. One GPU; prints JSON lines and, with --out,
writes them all to one JSON file.

Usage: python scripts/probe_fallback_block.py [--hidden 4096,7168] [--quant none,tensor] [--tokens 1024] [--dynamic]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from fxfuse.bench.fallback import Variants, checked_point
from fxfuse.bench.fallback_blocks import EPS
from fxfuse.bench.replay import replay_timings
from fxfuse.runner.launch import run_on_ranks

CALLS_PROFILED = 20


def kernels_per_call(fn, calls: int) -> list[dict]:
    """The GPU kernels `calls` uncaptured calls of `fn` launch: name, launches per call, mean us each."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals, counts = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time
            counts[event.name] += 1
    return [{"kernel": name[:120], "per_call": counts[name] / calls, "mean_us": round(totals[name] / counts[name], 2)}
            for name in sorted(totals, key=totals.get, reverse=True)]


def parts(tokens: int, hidden: int, group, inputs) -> dict:
    """Replay medians (us) of the fallback's parts alone at this point."""
    from fxfuse.op import add_rmsnorm_kernel as kernel

    inp, residual, weight, proj = inputs[:4]
    x = inp @ proj
    calls = {"nccl_all_reduce_inplace": lambda: torch.distributed.all_reduce(x, group=group)}
    residual_out, normed = torch.empty_like(x), torch.empty_like(x)
    original = kernel.num_warps_for
    for warps in (4, 8, 16, 32):
        def norm(warps=warps):
            kernel.num_warps_for = lambda block: warps
            kernel._DIRECT.clear()
            kernel.add_rmsnorm_into(x, residual, weight, EPS, residual_out, normed)
        norm()
        calls[f"op_norm_w{warps}"] = norm

    def chain(x, residual, weight):
        h = x + residual
        f = h.float()
        return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype), h

    torch._dynamo.reset()
    compiled = torch.compile(chain, fullgraph=True, dynamic=False)
    calls["inductor_add_norm"] = lambda: compiled(x, residual, weight)
    try:
        timings = {name: replay_timings({name: call}, 15, 20)[name][0] for name, call in calls.items()}
    finally:
        kernel.num_warps_for = original
        kernel._DIRECT.clear()
    timings["op_norm_kernels"] = kernels_per_call(calls["op_norm_w8"], CALLS_PROFILED)
    timings["inductor_add_norm_kernels"] = kernels_per_call(calls["inductor_add_norm"], CALLS_PROFILED)
    return timings


@torch.no_grad()
def probe_rank(ctx, options: dict) -> list[dict]:
    """Every point's replay timings, kernels per variant and (quantization none) parts."""
    import fxfuse

    device = torch.device("cuda", torch.cuda.current_device())
    group_name = ctx.group.group_name
    rows = []
    for hidden in options["hidden"]:
        fxfuse.prepare(ctx.group, hidden, torch.bfloat16, max(options["tokens"]))
        for quant in options["quant"]:
            variants = Variants(quant, dynamic=options["dynamic"])
            for tokens in options["tokens"]:
                row, inputs = checked_point(variants, tokens, hidden, device, group_name)
                calls = {name: (lambda fn=fn: fn(*inputs, group_name)) for name, fn in variants.current.items()}
                timings = replay_timings(calls, 15, 20)
                row["replay_us"] = {name: round(t[0], 2) for name, t in timings.items()}
                row["kernels"] = {name: kernels_per_call(call, CALLS_PROFILED) for name, call in calls.items()}
                if quant == "none" and not options["dynamic"]:
                    row["parts_us"] = parts(tokens, hidden, ctx.group, inputs)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="4096,7168")
    parser.add_argument("--quant", default="none,tensor")
    parser.add_argument("--tokens", default="1024")
    parser.add_argument("--dynamic", action="store_true", help="compile both variants with dynamic=True")
    parser.add_argument("--out", default=None, help="also write every row to this JSON file")
    args = parser.parse_args()
    options = {"hidden": [int(h) for h in args.hidden.split(",")], "quant": args.quant.split(","),
               "tokens": [int(t) for t in args.tokens.split(",")], "dynamic": args.dynamic}
    rows = run_on_ranks(probe_rank, 1, options, device="cuda", timeout_s=900)[0]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
