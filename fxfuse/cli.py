"""Command-line interface: `fxfuse run`, `report`, `bench`, `plan`, `tune` (and `python -m fxfuse ...`).

Arguments are parsed, and output paths checked, before torch is imported, so `--help` and bad
input answer at once. Each subcommand is one `_add_<name>_parser` function that declares its
options and a handler that imports the heavy modules it needs. Bad input ends in one
`fxfuse: error:` line with exit status 2, a failed rank in one such line with exit status 1
(`--verbose`, before or after the subcommand, adds its traceback).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from fxfuse.command_line import CommandParser, at_least, check_output_file, int_list, write_json
from fxfuse.runner.errors import RankFailed
from fxfuse.models.quant.scheme import WEIGHT_FORMATS
from fxfuse.runner.options import (
    BACKENDS, COMPARE_TARGETS, DEFAULT_WIDTHS, DEVICES, DTYPE_BYTES, MAX_STEP_WIDTH, RunOptions,
)

DTYPE_CHOICES = tuple(DTYPE_BYTES)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `fxfuse` command, with all subcommands."""
    parser = CommandParser(prog="fxfuse", description=__doc__.splitlines()[0], parents=[_common_options(False)])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_run_parser(commands)
    _add_report_parser(commands)
    _add_bench_parser(commands)
    _add_plan_parser(commands)
    _add_tune_parser(commands)
    parser.set_defaults(handler=None, command_parser=parser, missing=f"choose a command: {', '.join(commands.choices)}")
    return parser


def _common_options(default) -> argparse.ArgumentParser:
    """Options every (sub)command takes. Subcommands declare them with a suppressed default, so a
    flag given before the subcommand is not reset by the subcommand's parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--verbose", action="store_true", default=default,
                        help="print a failed rank's full traceback")
    return common


def _subcommand(commands, name: str, handler, **kwargs) -> argparse.ArgumentParser:
    p = commands.add_parser(name, parents=[_common_options(argparse.SUPPRESS)], **kwargs)
    p.set_defaults(handler=handler, command_parser=p)
    return p


RUN_DESCRIPTION = """\
Run a tensor-parallel DeepSeek-V3: prefill a random prompt, then greedy speculative-verify steps
of --tokens tokens per sequence, and print a summary. With no arguments: the tiny preset with
deterministic random weights, tensor parallel over 2 CPU processes (gloo), eager backend.
On --device cuda (NCCL, one process per GPU) the step is captured in one CUDA graph per width
bucket (--graph-widths) and replayed; other widths run uncaptured.
"""


def _add_run_parser(commands) -> None:
    d = RunOptions()
    p = _subcommand(commands, "run", _run_command, help="run the model (default: tiny preset, tp=2 on CPU)",
                    description=RUN_DESCRIPTION)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", default=None, help=f"built-in model config: tiny, deepseek-v3, kimi-k2 (default {d.preset})")
    source.add_argument("--checkpoint", metavar="DIR", help="Hugging Face DeepSeek-V3-format checkpoint directory (default: none)")
    p.add_argument("--layers", type=at_least(1), default=None, metavar="N",
                   help="keep full width but only the first N layers (default: all)")
    p.add_argument("--tp", type=at_least(1), default=d.tp, help=f"tensor parallel size = number of processes (default {d.tp})")
    p.add_argument("--device", choices=DEVICES, default=d.device, help=f"cpu (gloo) or cuda (NCCL, one GPU per rank) (default {d.device})")
    p.add_argument("--backend", choices=BACKENDS, default=d.backend, help=f"how the step is compiled (default {d.backend})")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=d.dtype, help=f"weights and activations (default {d.dtype})")
    p.add_argument("--batch", type=at_least(1), default=d.batch, help=f"sequences per step (default {d.batch})")
    p.add_argument("--prompt-len", type=at_least(1), default=d.prompt_len, help=f"prompt tokens per sequence (default {d.prompt_len})")
    p.add_argument("--tokens", type=at_least(1), default=d.tokens_per_step, dest="tokens_per_step", metavar="TOKENS",
                   help=f"tokens per sequence in each decode/verify step, at most {MAX_STEP_WIDTH} (default {d.tokens_per_step})")
    p.add_argument("--steps", type=at_least(1), default=d.steps, help=f"decode/verify steps after the prefill (default {d.steps})")
    p.add_argument("--compare", choices=COMPARE_TARGETS, default=d.compare,
                   help="check logits of every step against: the eager model, or transformers' "
                        f"DeepseekV3ForCausalLM (default {d.compare})")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the step in CUDA graphs and replay them (default: on for --device cuda)")
    p.add_argument("--graph-widths", type=int_list(1, MAX_STEP_WIDTH), default=d.graph_widths, metavar="W,W,...",
                   help=f"step widths (tokens per sequence) that get a CUDA graph (default {','.join(map(str, DEFAULT_WIDTHS))})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of the random weights and prompt (default {d.seed})")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default=d.weights,
                   help="keep weights in bf16 (dequantized on load), FP8 blocks or INT4 experts; see `fxfuse plan` "
                        f"(default {d.weights})")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON to PATH (default: none)")


def _run_command(args) -> int:
    from fxfuse.runner.options import prepare_run

    if args.json:
        check_output_file(args.json, "--json")
    preset = args.preset if (args.preset or args.checkpoint) else RunOptions().preset
    options = RunOptions(
        preset=preset, checkpoint=args.checkpoint, layers=args.layers, tp=args.tp, device=args.device,
        backend=args.backend, dtype=args.dtype, batch=args.batch, prompt_len=args.prompt_len,
        tokens_per_step=args.tokens_per_step, steps=args.steps, compare=args.compare, seed=args.seed,
        cuda_graph=args.cuda_graph, graph_widths=args.graph_widths, weights=args.weights,
    )
    setup = prepare_run(options)  # every check that needs no rank, before torch is imported

    from fxfuse.runner.run import run_prepared

    summary = run_prepared(setup)
    if summary["rank"] != 0:  # a torchrun rank other than 0: rank 0 reports
        return 0
    print(format_run_summary(summary))
    if args.json:
        write_json(args.json, summary)
    return 0


def format_run_summary(summary: dict) -> str:
    """A few human-readable lines for a run summary dict."""
    graphs = f"CUDA graphs for widths {summary['graph_widths']}" if summary["cuda_graph"] else "no CUDA graphs"
    lines = [
        f"model {summary['model']} ({summary['layers']} layers), tp={summary['tp']} on {summary['device']}, "
        f"backend {summary['backend']}, {summary['dtype']}, {graphs}",
        f"batch {summary['batch']}, prompt {summary['prompt_len']}, {summary['steps']} steps of "
        f"{summary['tokens_per_step']} tokens: step {summary['step_ms']:.2f} ms median, "
        f"{summary['step_ms_p90']:.2f} ms p90, {summary['tokens_per_s']:,.0f} tokens/s",
    ]
    if summary["peak_gpu_mem_gb"] is not None:
        lines.append(f"peak GPU memory (rank 0): {summary['peak_gpu_mem_gb']:.2f} GB")
    if summary["fused_sites"] is not None:
        kernel = {True: "FlashInfer kernel ready", False: "FlashInfer kernel not used", None: "CPU reference kernel"}
        lines.append(f"fused sites {summary['fused_sites']} of {summary['allreduce_sites']} all-reduce sites "
                     f"({kernel[summary['fused_kernel_ready']]})")
    lines.append(f"tokens (sequence 0): {summary['tokens']}")
    lines.append(_drafts_line(summary))
    if summary["compare"] != "none":
        lines.append(f"max relative error vs {summary['compare']}: {summary['max_rel_err']:.3e}")
    return "\n".join(lines)


def _drafts_line(summary: dict) -> str:
    """How many of each step's drafts were accepted: each step adds them plus one token."""
    drafts = summary["tokens_per_step"] - 1
    if drafts == 0:
        return "1-token steps: no drafts, one new token per step"
    per_step = summary["accepted_drafts"]
    first = ", ".join(str(step[0]) for step in per_step)
    mean = sum(map(sum, per_step)) / (len(per_step) * summary["batch"])
    return (f"drafts accepted per step (sequence 0, of {drafts}): {first}; mean over all sequences {mean:.2f} "
            f"(each step adds the accepted drafts + 1 token)")


REPORT_DESCRIPTION = """\
Trace one step of a tensor-parallel DeepSeek-V3 through the fxfuse pass with fake tensors and a fake
process group (no weights in memory, no GPU, no other processes) and print one row per all-reduce
site: layer, block, fused or not and why not. Default: the tiny preset at tp=2.
"""


def _add_report_parser(commands) -> None:
    p = _subcommand(commands, "report", _report_command,
                    help="which all-reduce sites the fusion pass fuses (no weights, no GPU)", description=REPORT_DESCRIPTION)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", default=None, help="built-in model config: tiny, deepseek-v3, kimi-k2 (default tiny)")
    source.add_argument("--checkpoint", metavar="DIR",
                        help="Hugging Face DeepSeek-V3-format checkpoint directory, config.json only (default: none)")
    p.add_argument("--layers", type=at_least(1), default=None, metavar="N",
                   help="keep full width but only the first N layers (default: all)")
    p.add_argument("--tp", type=at_least(1), default=2, help="tensor parallel size to trace for (default 2)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="weights and activations (default bfloat16)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH (default: none)")


def _report_command(args) -> int:
    from fxfuse.runner.options import resolve_model

    if args.json:
        check_output_file(args.json, "--json")
    config, name = resolve_model(args.preset or (None if args.checkpoint else "tiny"), args.checkpoint, args.layers)
    config.check_tensor_parallel(args.tp)

    import torch

    from fxfuse.inspect.site_report import report_model
    from fxfuse.runner.progress import Progress, watch_layers

    progress = Progress(True, "fxfuse report")
    tracing = f"tracing {name} ({config.num_hidden_layers} layers, tp={args.tp}) on fake tensors: dynamo, AOT autograd, fxfuse passes"
    with progress.phase(tracing, heartbeat_s=15):
        report = report_model(config, args.tp, name=name, dtype=getattr(torch, args.dtype),
                              on_build=lambda model: watch_layers(progress, model.model.layers, "dynamo traced layer"))
    print(report.table())
    if args.json:
        write_json(args.json, report.to_json())
    return 0


#: Benchmark name -> (module, one-line description, the `fxfuse.bench.arguments` function declaring its options).
BENCHMARKS = {
    "kernel": ("fxfuse.bench.kernel", "fused op vs unfused all-reduce + add-RMSNorm, per token count (CUDA)", "add_kernel_arguments"),
    "model": ("fxfuse.bench.model", "DeepSeek-V3 verify-step latency: eager vs inductor vs fxfuse, CUDA graphs", "add_model_arguments"),
    "fallback": ("fxfuse.bench.fallback", "the fused op's NCCL fallback vs Inductor's unfused code, one GPU (CUDA)",
                 "add_fallback_arguments"),
    "gemm": ("fxfuse.bench.quant_gemm", "quantized FP8 / INT4 GEMMs vs bf16 at DeepSeek-V3 / Kimi-K2.5 shapes, one GPU (CUDA)",
             "add_gemm_arguments"),
    "compile": ("fxfuse.bench.compile_time", "cold and warm compile time, Inductor vs fxfuse: Inductor's caches (CPU)",
                "add_compile_arguments"),
}


def _add_bench_parser(commands) -> None:
    from fxfuse.bench import arguments

    lines = "\n".join(f"  {name:8s} {text}" for name, (_, text, _) in BENCHMARKS.items())
    p = _subcommand(commands, "bench", None, help="benchmarks (CUDA): " + ", ".join(BENCHMARKS),
                    description=f"Benchmarks; `fxfuse bench NAME --help` lists each one's options.\n{lines}",
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(missing=f"choose a benchmark: {', '.join(BENCHMARKS)}")  # `fxfuse bench` alone
    names = p.add_subparsers(dest="benchmark", metavar="NAME")
    for name, (_, text, declare) in BENCHMARKS.items():
        bench = _subcommand(names, name, _bench_command, help=text, description=text)
        getattr(arguments, declare)(bench)


def _add_plan_parser(commands) -> None:
    p = _subcommand(commands, "plan", _plan_command,
                    help="per-rank memory of a run: weights, KV cache, workspaces, activations (no GPU needed)",
                    description="Per-rank memory plan of a run (no weights loaded, no GPU needed). Exits 2 with what "
                                "would fit when it does not fit --gpu-memory-gb (default: GPU 0's memory, if any).")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", default=None, help="built-in model config (default deepseek-v3)")
    source.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (config.json only; default: none)")
    p.add_argument("--layers", type=at_least(1), default=None, metavar="N", help="keep full width but only the first N layers (default: all)")
    p.add_argument("--tp", type=at_least(1), default=8, help="tensor parallel size (default 8)")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default=None,
                   help="weight format (default: the checkpoint's, bf16 for presets)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="bfloat16", help="activations and unquantized weights (default bfloat16)")
    p.add_argument("--batch", type=at_least(1), default=8, help="sequences per step (default 8)")
    p.add_argument("--context", type=at_least(1), default=4096, help="KV-cache positions per sequence (default 4096)")
    p.add_argument("--tokens", type=at_least(1), default=128, help="widest step, tokens per sequence (default 128)")
    p.add_argument("--graph-widths", type=int_list(1, MAX_STEP_WIDTH), default=DEFAULT_WIDTHS, metavar="W,W,...",
                   help=f"captured CUDA-graph widths (default {','.join(map(str, DEFAULT_WIDTHS))})")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="memory per GPU (default: GPU 0's, if any)")
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON to PATH (default: none)")


def _plan_command(args) -> int:
    import dataclasses

    import torch

    from fxfuse.models.presets import get_preset
    from fxfuse.models.quant.scheme import checkpoint_format
    from fxfuse.runner.memory_plan import PlanError, PlanInputs, device_memory_bytes, plan_memory
    from fxfuse.runner.options import resolve_model

    if args.json:
        check_output_file(args.json, "--json")
    if args.checkpoint:
        config, name = resolve_model(None, args.checkpoint, args.layers)
        with open(os.path.join(args.checkpoint, "config.json")) as f:
            stored = checkpoint_format(json.load(f))
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
        write_json(args.json, {"model": name, **{k: str(v) if k == "dtype" else v for k, v in dataclasses.asdict(inputs).items()},
                               "parts_bytes": plan.parts, "total_bytes": plan.total_bytes, "available_bytes": available})
    if available is not None:
        try:
            plan.check(available, config)
        except PlanError as exc:
            print(f"fxfuse: error: {exc}", file=sys.stderr)
            return 2
    return 0


def _add_tune_parser(commands) -> None:
    from fxfuse.runner.tune_pcie import add_tune_pcie_arguments

    p = _subcommand(commands, "tune", None, help="measure FlashInfer's PCIe all-reduce launch configurations (CUDA)",
                    description="Tune once per machine; `fxfuse tune pcie --help` says how.")
    p.set_defaults(missing="choose what to tune: pcie")
    names = p.add_subparsers(dest="tuned", metavar="WHAT")
    pcie = _subcommand(names, "pcie", _tune_command, help="FlashInfer's PCIe IPC all-reduce (FlashInfer >= 0.7.2)",
                       description="Measure FlashInfer's PCIe all-reduce launch configurations on this machine and "
                                   "write its tuning file (collective over one GPU per rank).")
    add_tune_pcie_arguments(pcie)


def _tune_command(args) -> int:
    from fxfuse.runner.tune_pcie import main as tune_main

    start = args.argv.index("pcie", args.argv.index("tune") + 1) + 1
    return tune_main([a for a in args.argv[start:] if a != "--verbose"])


def _bench_command(args) -> int:
    module = importlib.import_module(BENCHMARKS[args.benchmark][0])
    return module.main(_benchmark_argv(args.argv, args.benchmark))


def _benchmark_argv(argv: list[str], name: str) -> list[str]:
    """The arguments after `bench NAME` in `argv`, without the command's own `--verbose`."""
    start = argv.index(name, argv.index("bench") + 1) + 1
    return [a for a in argv[start:] if a != "--verbose"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `fxfuse` command; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra:
            args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.handler is None:
            args.command_parser.error(args.missing)
    except SystemExit as exc:  # --help (0), or a usage error already printed (2)
        return int(exc.code or 0)
    args.argv = argv
    try:
        return args.handler(args)
    except ValueError as exc:  # bad input (RunError, a config the model cannot run) or a failed write
        print(f"fxfuse: error: {exc}", file=sys.stderr)
        return 2
    except RankFailed as exc:
        print(f"fxfuse: error: rank {exc.rank} failed: {exc.error}", file=sys.stderr)
        if args.verbose:
            print(exc.traceback, file=sys.stderr)
        return 1
