"""Command-line interface: `fxfuse run`, `fxfuse report`, `fxfuse bench`, `fxfuse plan` (and `python -m fxfuse ...`).

Each subcommand validates its input before starting any process and exits non-zero with a
one-line message on bad input or a failed rank (the full traceback is printed only with
`--verbose`).
"""

from __future__ import annotations

import argparse
import json
import sys

from fxfuse.runner.launch import RankFailed

RUN_DESCRIPTION = """\
Run a tensor-parallel DeepSeek-V3: prefill a random prompt, then greedy speculative-verify steps
of --tokens tokens per sequence, and print a summary. With no arguments: the tiny preset with
deterministic random weights, tensor parallel over 2 CPU processes (gloo), eager backend.
On --device cuda (NCCL, one process per GPU) the step is captured in one CUDA graph per width
bucket (--graph-widths) and replayed; other widths run uncaptured.
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `fxfuse` command, with all subcommands."""
    parser = argparse.ArgumentParser(prog="fxfuse", description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="print full tracebacks on failure")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_parser(commands)
    _add_report_parser(commands)
    _add_bench_parser(commands)
    _add_plan_parser(commands)
    return parser


REPORT_DESCRIPTION = """\
Trace one step of a tensor-parallel DeepSeek-V3 through the fxfuse pass with fake tensors and a fake
process group (no weights in memory, no GPU, no other processes) and print one row per all-reduce
site: layer, block, fused or not and why not. Default: the tiny preset at tp=2.
"""


def _add_report_parser(commands) -> None:
    p = commands.add_parser("report", help="which all-reduce sites the fusion pass fuses (no weights, no GPU)",
                            description=REPORT_DESCRIPTION)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", default=None, help="built-in model config: tiny, deepseek-v3, kimi-k2 (default: tiny)")
    source.add_argument("--checkpoint", metavar="DIR", help="Hugging Face DeepSeek-V3-format checkpoint directory (config.json only)")
    p.add_argument("--layers", type=int, default=None, metavar="N", help="keep full width but only the first N layers")
    p.add_argument("--tp", type=int, default=2, help="tensor parallel size to trace for (default 2)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="weights and activations (default bfloat16)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.set_defaults(handler=_report_command)


def _report_command(args) -> int:
    import torch

    from fxfuse.inspect.site_report import load_config, report_model

    if args.tp < 1 or (args.layers is not None and args.layers < 1):
        raise ValueError("--tp and --layers must be at least 1")
    config, name = load_config(args.preset or (None if args.checkpoint else "tiny"), args.checkpoint, args.layers)
    report = report_model(config, args.tp, name=name, dtype=getattr(torch, args.dtype))
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=2)
    return 0


BENCHMARKS = {
    "kernel": ("fxfuse.bench.kernel", "fused op vs unfused all-reduce + add-RMSNorm, per token count (CUDA)"),
    "model": ("fxfuse.bench.model", "DeepSeek-V3 verify-step latency: eager vs inductor vs fxfuse, CUDA graphs"),
}


def _add_bench_parser(commands) -> None:
    lines = "\n".join(f"  {name:8s} {text}" for name, (_, text) in BENCHMARKS.items())
    p = commands.add_parser(
        "bench",
        help="benchmarks (CUDA): " + ", ".join(BENCHMARKS),
        description=f"Benchmarks; `fxfuse bench NAME --help` lists each one's options.\n{lines}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("benchmark", choices=tuple(BENCHMARKS), help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="options of that benchmark")
    p.set_defaults(handler=_bench_command)


def _bench_command(args) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[args.benchmark][0])
    return module.main(args.args)


def _add_plan_parser(commands) -> None:
    """`fxfuse plan`: the per-rank memory plan of a run (fxfuse/runner/memory_plan.py), no GPU needed."""
    p = commands.add_parser("plan", help="per-rank memory of a run: weights, KV cache, workspaces, activations",
                            description="Per-rank memory plan of a run (no weights loaded, no GPU needed). Exits 2 "
                                        "with what would fit when it does not fit --gpu-memory-gb.")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", default=None, help="built-in model config (default: deepseek-v3)")
    source.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (config.json only)")
    p.add_argument("--layers", type=int, default=None, metavar="N", help="keep full width but only the first N layers")
    p.add_argument("--tp", type=int, default=8, help="tensor parallel size (default 8)")
    p.add_argument("--weights", choices=("bf16", "fp8", "int4"), default=None,
                   help="weight format (default: the checkpoint's, bf16 for presets)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16", help="activations and unquantized weights")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--context", type=int, default=4096, help="KV-cache positions per sequence (default 4096)")
    p.add_argument("--tokens", type=int, default=128, help="widest step, tokens per sequence (default 128)")
    p.add_argument("--graph-widths", type=_int_list, default=(1, 2, 4, 8, 16, 32, 64, 128), metavar="W,W,...",
                   help="captured CUDA-graph widths (default 1,...,128; empty for none)")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="memory per GPU (default: GPU 0's, if any)")
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON to PATH")
    p.set_defaults(handler=_plan_command)


def _plan_command(args) -> int:
    import dataclasses
    import os

    import torch

    from fxfuse.models.config import ModelConfig
    from fxfuse.models.presets import get_preset
    from fxfuse.models.quant.scheme import checkpoint_format
    from fxfuse.runner.memory_plan import PlanError, PlanInputs, device_memory_bytes, plan_memory

    if args.checkpoint:
        path = os.path.join(args.checkpoint, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint directory {args.checkpoint!r} has no config.json")
        with open(path) as f:
            hf = json.load(f)
        config, name, stored = ModelConfig.from_hf_dict(hf), args.checkpoint, checkpoint_format(hf)
        if args.layers is not None:
            config = dataclasses.replace(config, num_hidden_layers=args.layers)
    else:
        name = args.preset or "deepseek-v3"
        config, stored = get_preset(name, layers=args.layers), checkpoint_format({})
    config.check_tensor_parallel(args.tp)
    inputs = PlanInputs(tp=args.tp, weights=args.weights or stored.weights, dtype=getattr(torch, args.dtype), batch=args.batch,
                        context=args.context, step_tokens=args.tokens, graph_widths=tuple(args.graph_widths),
                        fused_workspace=True, fp8_block=stored.fp8_block, int4_group=stored.int4_group)
    plan = plan_memory(config, inputs, name)
    available = int(args.gpu_memory_gb * 1e9) if args.gpu_memory_gb else (device_memory_bytes() if torch.cuda.is_available() else None)
    print(plan.table(available))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": name, **{k: str(v) if k == "dtype" else v for k, v in dataclasses.asdict(inputs).items()},
                       "parts_bytes": plan.parts, "total_bytes": plan.total_bytes, "available_bytes": available}, f, indent=2)
    if available is not None:
        try:
            plan.check(available, config)
        except PlanError as exc:
            print(f"fxfuse: error: {exc}", file=sys.stderr)
            return 2
    return 0


def _add_run_parser(commands) -> None:
    from fxfuse.runner.run import BACKENDS, COMPARE_TARGETS, DTYPES, RunOptions

    d = RunOptions()
    p = commands.add_parser("run", help="run the model (default: tiny preset, tp=2 on CPU)", description=RUN_DESCRIPTION)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", default=None, help=f"built-in model config: tiny, deepseek-v3, kimi-k2 (default: {d.preset})")
    source.add_argument("--checkpoint", metavar="DIR", help="Hugging Face DeepSeek-V3-format checkpoint directory")
    p.add_argument("--layers", type=int, default=None, metavar="N", help="keep full width but only the first N layers")
    p.add_argument("--tp", type=int, default=d.tp, help=f"tensor parallel size = number of processes (default {d.tp})")
    p.add_argument("--device", choices=("cpu", "cuda"), default=d.device, help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    p.add_argument("--backend", choices=BACKENDS, default=d.backend, help=f"how the step is compiled (default {d.backend})")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=d.dtype, help=f"weights and activations (default {d.dtype})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"sequences per step (default {d.batch})")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help=f"prompt tokens per sequence (default {d.prompt_len})")
    p.add_argument("--tokens", type=int, default=d.tokens_per_step, dest="tokens_per_step",
                   help=f"tokens per sequence in each decode/verify step (default {d.tokens_per_step})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"decode/verify steps after the prefill (default {d.steps})")
    p.add_argument("--compare", choices=COMPARE_TARGETS, default=d.compare,
                   help="check logits of every step against: the eager model, or transformers' DeepseekV3ForCausalLM")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the step in CUDA graphs and replay them (default: on for --device cuda)")
    p.add_argument("--graph-widths", type=_int_list, default=d.graph_widths, metavar="W,W,...",
                   help=f"step widths (tokens per sequence) that get a CUDA graph (default {','.join(map(str, d.graph_widths))})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random weights and prompt")
    p.add_argument("--weights", choices=("bf16", "fp8", "int4"), default=d.weights,
                   help="keep weights in bf16 (dequantize on load; default), FP8 blocks or INT4 experts (see `fxfuse plan`)")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON to PATH")
    p.set_defaults(handler=_run_command)


def _run_command(args) -> int:
    from fxfuse.runner.run import RunOptions, run

    preset = args.preset if (args.preset or args.checkpoint) else RunOptions().preset
    options = RunOptions(
        preset=preset, checkpoint=args.checkpoint, layers=args.layers, tp=args.tp, device=args.device,
        backend=args.backend, dtype=args.dtype, batch=args.batch, prompt_len=args.prompt_len,
        tokens_per_step=args.tokens_per_step, steps=args.steps, compare=args.compare, seed=args.seed,
        cuda_graph=args.cuda_graph, graph_widths=args.graph_widths, weights=args.weights,
    )
    summary = run(options)
    if summary["rank"] != 0:  # a torchrun rank other than 0: rank 0 reports
        return 0
    print(format_run_summary(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


def format_run_summary(summary: dict) -> str:
    """A few human-readable lines for a run summary dict."""
    step, p90, rate = summary["step_ms"], summary["step_ms_p90"], summary["tokens_per_s"]
    graphs = f"CUDA graphs for widths {summary['graph_widths']}" if summary["cuda_graph"] else "no CUDA graphs"
    timing = "-" if step is None else f"{step:.2f} ms median, {p90:.2f} ms p90, {rate:,.0f} tokens/s"
    lines = [
        f"model {summary['model']} ({summary['layers']} layers), tp={summary['tp']} on {summary['device']}, "
        f"backend {summary['backend']}, {summary['dtype']}, {graphs}",
        f"batch {summary['batch']}, prompt {summary['prompt_len']}, {summary['steps']} steps of "
        f"{summary['tokens_per_step']} tokens: step {timing}",
    ]
    if summary["peak_gpu_mem_gb"] is not None:
        lines.append(f"peak GPU memory (rank 0): {summary['peak_gpu_mem_gb']:.2f} GB")
    if summary["fused_sites"] is not None:
        kernel = {True: "FlashInfer kernel ready", False: "FlashInfer kernel not used", None: "CPU reference kernel"}
        lines.append(f"fused sites {summary['fused_sites']} of {summary['allreduce_sites']} all-reduce sites "
                     f"({kernel[summary['fused_kernel_ready']]})")
    lines.append(f"tokens (sequence 0): {summary['tokens']}")
    if summary["compare"] != "none":
        lines.append(f"max relative error vs {summary['compare']}: {summary['max_rel_err']:.3e}")
    return "\n".join(lines)


def _int_list(text: str) -> tuple[int, ...]:
    """Parse `1,2,4` into (1, 2, 4) for argparse."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `fxfuse` command; returns the process exit code."""
    from fxfuse.runner.setup import RunError

    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (RunError, ValueError) as exc:
        print(f"fxfuse: error: {exc}", file=sys.stderr)
        return 2
    except RankFailed as exc:
        print(f"fxfuse: error: rank {exc.rank} failed: {exc.error}", file=sys.stderr)
        if args.verbose:
            print(exc.traceback, file=sys.stderr)
        return 1
