"""Where the time of `fxfuse bench fallback`'s compiled blocks goes, kernel by kernel, at chosen points.

For each (hidden, quantization, tokens) point, static shapes (or dynamic with --dynamic): both variants of
the benchmark (`inductor`, `fxfuse` with the op on its one-rank NCCL fallback) are compiled and checked,
replayed in CUDA graphs (interleaved, medians) with the calls cycling through copies of the inputs as the
benchmark does (--input-sets), and profiled uncaptured with torch.profiler: every GPU kernel each variant
launches per call, with its mean device time. Then (no quantization, static shapes) the parts, each call
starting with the producer GEMM into one buffer: the in-place NCCL all-reduce, the op's add-RMSNorm kernel
at 4/8/16/32 warps, the same kernel with other cache hints (rows' loads evict-first or not, residual
store streaming or not, 8 or 16 warps) and Inductor's add + RMSNorm without the all-reduce; the op's
compiled kernels' registers, spills and warps. One GPU; prints JSON lines and, with --out, writes them
all to one JSON file.

Usage: python scripts/probe_fallback_block.py [--hidden 4096,7168] [--quant none,tensor] [--tokens 1024] [--dynamic]
       [--input-sets 0]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from collections import defaultdict

import torch

from fxfuse.bench.fallback import Variants, checked_point, cycling_call, input_set_count, l2_cache_bytes
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


@functools.cache
def _hinted_kernel():
    """The op's add-RMSNorm row kernel (plain norm) with the cache hints of the rows' loads and of the
    residual's store as constexprs, to try other hints against the op's own (evict-first, `.cs`)."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_rmsnorm_rows_hinted(reduced_ptr, residual_ptr, weight_ptr, residual_out_ptr, normed_ptr, hidden, eps,
                                BLOCK: tl.constexpr, LOAD_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        offsets = row * hidden + cols
        reduced = tl.load(reduced_ptr + offsets, mask=mask, other=0.0, eviction_policy=LOAD_EVICT)
        residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0, eviction_policy=LOAD_EVICT)
        summed = reduced + residual
        tl.store(residual_out_ptr + offsets, summed, mask=mask, cache_modifier=STORE_CACHE)
        h = summed.to(tl.float32)
        variance = tl.sum(h * h, axis=0) / hidden
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        tl.store(normed_ptr + offsets, weight * (h * tl.rsqrt(variance + eps)).to(summed.dtype), mask=mask)

    return add_rmsnorm_rows_hinted


def parts(tokens: int, hidden: int, group, input_sets) -> dict:
    """Replay medians (us) of the fallback's parts at this point, each call cycling through `input_sets`
    and starting with the producer GEMM into one buffer x, as the compiled blocks do."""
    from fxfuse.op import add_rmsnorm_kernel as kernel

    weight, proj = input_sets[0][2], input_sets[0][3]
    x = input_sets[0][0] @ proj
    residual_out, normed = torch.empty_like(x), torch.empty_like(x)
    block = kernel.next_power_of_2(hidden)

    def cycling(body):
        turn = itertools.count()

        def call():
            inp, residual = input_sets[next(turn) % len(input_sets)][:2]
            torch.mm(inp, proj, out=x)
            body(residual)
        return call

    calls = {"gemm_nccl_all_reduce_inplace": cycling(lambda residual: torch.distributed.all_reduce(x, group=group))}
    original = kernel.num_warps_for
    for warps in (4, 8, 16, 32):
        def norm(residual, warps=warps):
            kernel.num_warps_for = lambda block: warps
            kernel._DIRECT.clear()
            kernel.add_rmsnorm_into(x, residual, weight, EPS, residual_out, normed)
        calls[f"gemm_op_norm_w{warps}"] = cycling(norm)
    for evict in ("evict_first", ""):
        for store in (".cs", ""):
            for warps in (8, 16):
                def hinted(residual, evict=evict, store=store, warps=warps):
                    _hinted_kernel()[(tokens,)](x, residual, weight, residual_out, normed, hidden, EPS,
                                                block, evict, store, num_warps=warps)
                calls[f"gemm_hinted_{evict or 'none'}_{store or 'none'}_w{warps}"] = cycling(hinted)

    def chain(x, residual, weight):
        h = x + residual
        f = h.float()
        return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype), h

    torch._dynamo.reset()
    compiled = torch.compile(chain, fullgraph=True, dynamic=False)
    calls["gemm_inductor_add_norm"] = cycling(lambda residual: compiled(x, residual, weight))
    try:
        for call in calls.values():
            call()
        timings = {name: round(t[0], 2) for name, t in replay_timings(calls, 15, 20).items()}
        timings["op_norm_kernels"] = kernels_per_call(calls["gemm_op_norm_w16"], CALLS_PROFILED)
        timings["inductor_add_norm_kernels"] = kernels_per_call(calls["gemm_inductor_add_norm"], CALLS_PROFILED)
    finally:
        kernel.num_warps_for = original
        kernel._DIRECT.clear()
        kernel.add_rmsnorm_into(x, input_sets[0][1], weight, EPS, residual_out, normed)  # re-offer the default kernel
    from fxfuse.op.native_fallback import _NORM_KERNELS
    timings["op_kernel_registers"] = {str(key[1]): [compiled.n_regs, compiled.n_spills, compiled.metadata.num_warps]
                                      for key, (compiled, _) in _NORM_KERNELS.items()}
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
                count = input_set_count(inputs, options["input_sets"], 20, l2_cache_bytes(device))
                input_sets = [inputs] + [tuple(t.clone() for t in inputs[:2]) + tuple(inputs[2:]) for _ in range(count - 1)]
                row["input_sets"] = count
                calls = {name: cycling_call(fn, input_sets, group_name) for name, fn in variants.current.items()}
                timings = replay_timings(calls, 15, 20)
                row["replay_us"] = {name: round(t[0], 2) for name, t in timings.items()}
                row["kernels"] = {name: kernels_per_call(call, CALLS_PROFILED) for name, call in calls.items()}
                if quant == "none" and not options["dynamic"]:
                    row["parts_us"] = parts(tokens, hidden, ctx.group, input_sets)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="4096,7168")
    parser.add_argument("--quant", default="none,tensor")
    parser.add_argument("--tokens", default="1024")
    parser.add_argument("--dynamic", action="store_true", help="compile both variants with dynamic=True")
    parser.add_argument("--input-sets", type=int, default=0,
                        help="copies of input and residual the calls cycle through (0: enough to cover twice L2, as the benchmark)")
    parser.add_argument("--out", default=None, help="also write every row to this JSON file")
    args = parser.parse_args()
    options = {"hidden": [int(h) for h in args.hidden.split(",")], "quant": args.quant.split(","),
               "tokens": [int(t) for t in args.tokens.split(",")], "dynamic": args.dynamic, "input_sets": args.input_sets}
    rows = run_on_ranks(probe_rank, 1, options, device="cuda", timeout_s=900)[0]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
