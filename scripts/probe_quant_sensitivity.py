"""Is a quantized model's compiled-vs-eager logits gap a bug, or the model's sensitivity to rounding?

For each weight format (bf16, FP8 with bf16 activations "w8a16", FP8 with FP8 activations "w8a8") one
model with the same random weights, tp=1, one verify step: the relative L2 distance of its eager
logits to (a) a second eager run (determinism), (b) an eager run whose first decoder layer's input
is perturbed by about half a bf16 rounding step per element (`fxfuse.runner.sensitivity`), and (c)
the step compiled by Inductor. If (c) is of the size of (b), the compiled gap is what any rounding
difference does to this model; if it is much larger, compiled code computes something else.

    python scripts/probe_quant_sensitivity.py [--device cuda|cpu] [--preset deepseek-v3] [--layers 2] [--out F]
Prints a markdown table and writes it with the run's command, machine, versions and date to --out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import torch

from fxfuse.bench.output import package_versions, relative_l2_error, report_header
from fxfuse.runner.sensitivity import perturbed_input
from fxfuse.runner.launch import run_on_ranks

FORMATS = (("bf16", "w8a16"), ("fp8", "w8a16"), ("fp8", "w8a8"))


@torch.inference_mode()
def probe_rank(ctx, args) -> list[dict]:
    """Build each format's model, run the four steps, return their distances."""
    from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
    from fxfuse.models.presets import get_preset
    from fxfuse.models.quant.scheme import QuantScheme
    from fxfuse.models.random_weights import init_random_shards

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    config = get_preset(args.preset, layers=args.layers)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.tokens), generator=generator).to(device)
    positions = (args.context - args.tokens + torch.arange(args.tokens)).expand(args.batch, -1).contiguous().to(device)
    rows = []
    for weights, gemm in FORMATS:
        model = DeepseekV3ForCausalLM(config, ctx, dtype=torch.bfloat16, device=device, max_batch=args.batch,
                                      max_seq_len=args.context, quant=QuantScheme(weights, fp8_gemm=gemm))
        init_random_shards(model, 0, ctx)
        model.eval()

        def run(step):
            model.reset_cache()
            return step(ids, positions).float().clone()

        eager = run(model)
        again = run(model)
        with perturbed_input(model):
            perturbed = run(model)
        compiled = run(torch.compile(model, backend="inductor", fullgraph=True, dynamic=True))
        rows.append({"weights": weights, "gemm": gemm if weights == "fp8" else None,
                     "eager_vs_eager": relative_l2_error(again, eager),
                     "eager_vs_perturbed": relative_l2_error(perturbed, eager),
                     "eager_vs_compiled": relative_l2_error(compiled, eager)})
        del model
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    """Parse the options, run the probe on one rank, print its table (and write it to --out)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--preset", default="deepseek-v3")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--out", help="also write the table and the run's facts to this file")
    args = p.parse_args()
    (rows,) = run_on_ranks(probe_rank, 1, args, device=args.device, timeout_s=1200)
    machine = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    header = {**report_header("probe_quant_sensitivity", machine), "versions": package_versions(("triton",)),
              "command": shlex.join(["python", *sys.argv])}
    lines = [f"- {key}: {json.dumps(value) if isinstance(value, dict) else value}" for key, value in header.items()]
    lines += [f"- model: {args.preset}, {args.layers} layers, batch {args.batch} x {args.tokens} tokens, "
              f"KV cache {args.context}, tp=1, random weights", "",
              "| weights | gemm | eager vs eager | eager vs perturbed | eager vs compiled (Inductor) |",
              "|---|---|---:|---:|---:|"]
    lines += [f"| {r['weights']} | {r['gemm'] or '-'} | {r['eager_vs_eager']:.2e} | {r['eager_vs_perturbed']:.3f} | "
              f"{r['eager_vs_compiled']:.3f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
