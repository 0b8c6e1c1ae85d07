"""`fxfuse bench gemm`: the quantized GEMMs against bf16 at DeepSeek-V3 / Kimi-K2.5 shapes, one GPU.

Each point times one GEMM (a dense projection, or a whole routed-expert block: gate, up, SiLU, down and
the weighted combine) at a token count, captured `--iters` times in a CUDA graph and replayed in
interleaved rounds, median (p25-p75) of `--repeats` samples in microseconds per call:
- dense, DeepSeek-V3's projections at tp=1: `bf16` (F.linear on the dequantized weight, cuBLAS),
  `fp8-w8a16` (the `fxfuse_quant::fp8_linear` op, the Triton kernel) and `fp8-w8a8` (what an uncompiled
  w8a8 linear runs: the one-kernel activation quantization of models/quant/act_quant.py, then the
  `fxfuse_quant::fp8_linear_quantized` op: cuBLAS block-scaled `torch._scaled_mm` where it works here,
  else the Triton kernel);
- experts (hidden 7168, intermediate 2048, top 8): DeepSeek-V3's 256 FP8 experts and Kimi-K2.5's 384
  INT4 group-32 experts (`fxfuse_quant::quant_experts`) against the same experts dequantized to bf16
  through `torch._grouped_mm` (what `--weights bf16` runs).
Weights are random FP8 / INT4 codes with random scales; every variant is checked against the
dequantized weights (relative L2 error, reported). Ratios are quantized / bf16 (below 1: faster).

Writes bench/results/gemm_<gpu>_<stamp>.json (fields gpu, versions, date, command, results:
[{kind, name, n, k, tokens, variant, us, p25, p75, ratio_vs_bf16, rel_err}]) and .md.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from fxfuse.bench.arguments import GEMM_DESCRIPTION, add_gemm_arguments
from fxfuse.bench.output import gpu_slug, header_lines, one_gpu_arguments, report_header, package_versions, publish, relative_l2_error, write_result_files
from fxfuse.bench.replay import replay_timings

#: DeepSeek-V3's dense FP8 projections at tp=1: name -> (N, K).
DENSE_SHAPES = {
    "q_a_proj": (1536, 7168), "kv_a_proj": (576, 7168), "q_b_proj": (24576, 1536), "kv_b_proj": (32768, 512),
    "o_proj": (7168, 16384), "mlp_gate_up": (18432, 7168), "mlp_down": (7168, 18432),
}
#: Routed-expert blocks: name -> (experts, format).
EXPERT_SHAPES = {"deepseek-v3 experts": (256, "fp8"), "kimi-k2.5 experts": (384, "int4")}
HIDDEN, INTERMEDIATE, TOP_K, FP8_BLOCK, INT4_GROUP = 7168, 2048, 8, 128, 32


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on the current GPU, write its files, return the exit status."""
    args, status = one_gpu_arguments(argv, "fxfuse bench gemm", GEMM_DESCRIPTION, add_gemm_arguments)
    if status is not None:
        return status
    report = run(args.tokens, args.repeats, args.iters, args.parts)
    publish(report, "gemm", argv, lambda r: write_result_files(args.out_dir / file_stem(r), r, markdown(r), lambda path: False),
            markdown)
    return 0


def file_stem(report: dict) -> str:
    """gemm_<gpu>_<stamp>."""
    return f"gemm_{gpu_slug(report['gpu'])}_{report['stamp']}"


@torch.no_grad()
def run(tokens: list[int], repeats: int, iters: int, parts: list[str]) -> dict:
    """Time every (shape, token count, variant) of the chosen parts ("dense", "experts")."""
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator(device=device).manual_seed(0)
    results = []
    if "dense" in parts:
        for name, (n, k) in DENSE_SHAPES.items():
            variants, reference_weight = _dense_variants(n, k, device, generator)
            for count in tokens:
                x = torch.randn(count, k, device=device, dtype=torch.bfloat16, generator=generator)
                expected = x.float() @ reference_weight.t()
                results += _points("dense", name, n, k, count, {v: (lambda fn=fn: fn(x)) for v, fn in variants.items()},
                                   expected, repeats, iters)
            del variants, reference_weight
    if "experts" in parts:
        for name, (experts, fmt) in EXPERT_SHAPES.items():
            variants = _expert_variants(experts, fmt, device, generator)
            for count in tokens:
                x = torch.randn(count, HIDDEN, device=device, dtype=torch.bfloat16, generator=generator)
                ids = torch.rand(count, experts, device=device, generator=generator).topk(TOP_K, dim=-1).indices
                weights = torch.rand(count, TOP_K, device=device, generator=generator)
                calls = {v: (lambda fn=fn: fn(x, ids, weights)) for v, fn in variants.items()}
                expected = calls["bf16"]().float()
                results += _points("experts", name, INTERMEDIATE, HIDDEN, count, calls, expected, repeats, iters)
            del variants
            torch.cuda.empty_cache()
    return {
        **report_header("fxfuse bench gemm", torch.cuda.get_device_name()), "versions": package_versions(("triton",)),
        "iters": iters, "repeats": repeats, "results": results,
    }


def _dense_variants(n: int, k: int, device, generator) -> tuple[dict, torch.Tensor]:
    from fxfuse.models.fp8 import FP8_DTYPE
    from fxfuse.models.quant.act_quant import quantize_activations
    from fxfuse.models.quant.ops import fp8_linear, fp8_linear_quantized
    from fxfuse.models.quant.reference import dequantize_fp8_blocks

    block = (FP8_BLOCK, FP8_BLOCK)
    weight = (torch.randn(n, k, device=device, generator=generator) * 0.5).to(FP8_DTYPE)
    scale = torch.rand(-(-n // FP8_BLOCK), -(-k // FP8_BLOCK), device=device, generator=generator) * 0.02 + 0.01
    dequantized = dequantize_fp8_blocks(weight, scale, block)
    bf16 = dequantized.to(torch.bfloat16)
    return {
        "bf16": lambda x: F.linear(x, bf16),
        "fp8-w8a16": lambda x: fp8_linear(x, weight, scale, *block),
        "fp8-w8a8": lambda x: fp8_linear_quantized(*quantize_activations(x, FP8_BLOCK), weight, scale, *block, x.dtype),
    }, dequantized


def _expert_variants(experts: int, fmt: str, device, generator) -> dict:
    from fxfuse.models.expert_math import grouped_experts
    from fxfuse.models.fp8 import FP8_DTYPE
    from fxfuse.models.quant.int4 import pack_int4
    from fxfuse.models.quant.ops import quant_experts
    from fxfuse.models.quant.reference import dequantize_fp8_blocks, dequantize_int4_packed

    stacked, bf16 = [], []
    for rows, cols in ((INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)):
        if fmt == "fp8":
            weight = (torch.randn(experts, rows, cols, device=device, generator=generator) * 0.5).to(FP8_DTYPE)
            scale = torch.rand(experts, rows // FP8_BLOCK, cols // FP8_BLOCK, device=device, generator=generator) * 0.02 + 0.01
            dequantized = [dequantize_fp8_blocks(weight[e], scale[e], (FP8_BLOCK, FP8_BLOCK)) for e in range(experts)]
        else:
            weight = torch.stack([pack_int4(torch.randint(-8, 8, (rows, cols), device=device, generator=generator))
                                  for _ in range(experts)])
            scale = (torch.rand(experts, rows, cols // INT4_GROUP, device=device, generator=generator) * 0.002 + 0.001).to(torch.bfloat16)
            dequantized = [dequantize_int4_packed(weight[e], scale[e], INT4_GROUP) for e in range(experts)]
        bf16.append(torch.stack([w.to(torch.bfloat16) for w in dequantized]))
        stacked += [weight, scale]
    block = (FP8_BLOCK, FP8_BLOCK) if fmt == "fp8" else (1, INT4_GROUP)
    variants = {"bf16": lambda x, ids, w: grouped_experts(x, ids, w, *bf16)}
    gemms = ("w8a16", "w8a8") if fmt == "fp8" else ("w8a16",)
    for gemm in gemms:
        label = f"fp8-{gemm}" if fmt == "fp8" else "int4-w4a16"
        variants[label] = lambda x, ids, w, gemm=gemm: quant_experts(x, ids, w, *stacked, fmt, *block, gemm)
    return variants


def _points(kind: str, name: str, n: int, k: int, tokens: int, calls: dict, expected: torch.Tensor, repeats: int, iters: int) -> list[dict]:
    """One row per variant: timing, ratio to bf16, error against the dequantized weights."""
    errors = {variant: relative_l2_error(call(), expected) for variant, call in calls.items()}
    timings = replay_timings(calls, repeats, iters)
    rows = []
    for variant, (median, q1, q3) in timings.items():
        rows.append({"kind": kind, "name": name, "n": n, "k": k, "tokens": tokens, "variant": variant, "us": median,
                     "p25": q1, "p75": q3, "ratio_vs_bf16": median / timings["bf16"][0], "rel_err": errors[variant]})
    return rows


def markdown(report: dict) -> str:
    """The report as a markdown table."""
    lines = header_lines(f"fxfuse bench gemm: {report['gpu']}, quantized GEMMs vs bf16", report) + [
        f"- timing: CUDA-graph replay of {report['iters']} calls, median (p25-p75) of {report['repeats']} samples, "
        "microseconds per call; variants interleaved; ratio = variant / bf16",
        "- rel err: relative L2 error against the dequantized weights in float32",
        "",
        "| kind | name | N x K | tokens | variant | us | ratio vs bf16 | rel err |",
        "|---|---|---|---:|---|---:|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(f"| {r['kind']} | {r['name']} | {r['n']}x{r['k']} | {r['tokens']} | {r['variant']} | "
                     f"{r['us']:.1f} ({r['p25']:.1f}-{r['p75']:.1f}) | {r['ratio_vs_bf16']:.2f} | {r['rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
