"""Command-line interface: `fxfuse run`, `report`, `bench`, `plan`, `tune` (and `python -m fxfuse ...`).

Arguments are parsed, and output paths checked, before torch is imported, so `--help` and bad
input answer at once. Each subcommand is one `_add_<name>_parser` function that declares its
options and a handler that imports the heavy modules it needs. Bad input ends in one
`fxfuse: error:` line with exit status 2, a failed rank in one such line with exit status 1
(`--verbose`, before or after the subcommand, adds its traceback; a rank killed for memory is told what
to lower), a run whose logits leave the `--compare` check's bound in one such line after its summary,
with exit status 1, Ctrl-C in one line with exit status 130 and SIGTERM in one line with exit status
143, in both cases after the rank processes were stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import threading
from typing import Iterator

from fxfuse.command_line import (
    WEIGHT_SPELLINGS, CommandParser, add_dtype_option, at_least, check_output_dir, check_output_file, int_list,
    positive_float, spelled, write_json,
)
from fxfuse.models.presets import PRESETS
from fxfuse.models.quant.scheme import WEIGHT_FORMATS
from fxfuse.runner.errors import RankFailed, Terminated
from fxfuse.runner.options import (
    BACKENDS, BF16_WHY, COMPARE_TARGETS, DEFAULT_DTYPE, DEFAULT_INNER, DEFAULT_WIDTHS, DEVICES, DTYPE_BYTES, DYNAMIC_CHOICES,
    INNER_COMPILERS, MAX_STEP_WIDTH, RunOptions,
)

DTYPE_CHOICES = tuple(DTYPE_BYTES)
#: Exit statuses of a command stopped by Ctrl-C (SIGINT) or SIGTERM: 128 + the signal number, as shells report.
INTERRUPTED_STATUS = 128 + signal.SIGINT
TERMINATED_STATUS = 128 + signal.SIGTERM
#: How the summary says what the weights are held as, beside the run's dtype.
WEIGHT_DESCRIPTIONS = {"bf16": "weights not quantized (held in {dtype})", "fp8": "weights in FP8 blocks",
                       "int4": "routed experts in INT4 (the rest in {dtype})"}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `fxfuse` command, with all subcommands."""
    parser = CommandParser(prog="fxfuse", description=__doc__.splitlines()[0], parents=[_common_options(False)])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_run_parser(commands)
    _add_report_parser(commands)
    _add_bench_parser(commands)
    _add_plan_parser(commands)
    _add_tune_parser(commands)
    parser.set_defaults(handler=None, command_parser=parser, missing=f"choose a command: {', '.join(commands.choices)}",
                        memory_advice=None)
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
deterministic random weights, tensor parallel over 2 CPU processes (gloo), compiled with the fxfuse
backend (its fusion passes, then eager) and checked step by step against the uncompiled model; the
summary says how many all-reduce sites were fused, what the fused op ran, and whether the logits stayed
within the check's bound (exit status 1 if not).
On --device cuda (NCCL, one process per GPU) the step is captured in one CUDA graph per width
bucket (--graph-widths) and replayed; other widths run uncaptured.
"""


def _add_run_parser(commands) -> None:
    d = RunOptions()
    p = _subcommand(commands, "run", _run_command, help="run the model (default: tiny preset, tp=2 on CPU)",
                    description=RUN_DESCRIPTION)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", default=None, help=f"built-in model config: {', '.join(PRESETS)} (default {d.preset})")
    source.add_argument("--checkpoint", metavar="DIR", help="Hugging Face DeepSeek-V3-format checkpoint directory (default: none)")
    p.add_argument("--layers", type=at_least(1), default=None, metavar="N",
                   help="keep full width but only the first N layers (default: all)")
    p.add_argument("--tp", type=at_least(1), default=None,
                   help=f"tensor parallel size = number of processes (default {d.tp}; under torchrun its WORLD_SIZE, "
                        "which a given --tp must match)")
    p.add_argument("--device", choices=DEVICES, default=d.device, help=f"cpu (gloo) or cuda (NCCL, one GPU per rank) (default {d.device})")
    p.add_argument("--backend", choices=BACKENDS, default=d.backend, help=f"how the step is compiled (default {d.backend})")
    p.add_argument("--inner", choices=INNER_COMPILERS, default=None,
                   help="what compiles the graph after the fxfuse passes, with --backend fxfuse (default: "
                        + ", ".join(f"{inner} on {device}" for device, inner in DEFAULT_INNER.items()) + ")")
    add_dtype_option(p, DTYPE_CHOICES, None, "weights and activations (default: "
                     + "; ".join(f"{dtype} on {device}, {why}" for device, (dtype, why) in DEFAULT_DTYPE.items()) + ")")
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
    p.add_argument("--graph-widths", type=int_list(1, MAX_STEP_WIDTH), default=None, metavar="W,W,...",
                   help="step widths (tokens per sequence) that get a CUDA graph, with CUDA graphs only "
                        f"(default {','.join(map(str, DEFAULT_WIDTHS))})")
    p.add_argument("--dynamic", choices=DYNAMIC_CHOICES, default=d.dynamic,
                   help="compile the step for dynamic shapes (on) or one graph per shape (off); auto: static shapes "
                        "when the verify step replays a CUDA graph or no CUDA graphs are captured, dynamic when "
                        f"graphs are captured but not for the verify width (default {d.dynamic})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of the random weights and prompt (default {d.seed})")
    p.add_argument("--weights", type=spelled(WEIGHT_SPELLINGS), choices=WEIGHT_FORMATS, default=d.weights,
                   help="keep weights in bf16 (also spelled bfloat16; dequantized on load), FP8 blocks or INT4 experts; "
                        f"see `fxfuse plan` (default {d.weights})")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON to PATH (default: none)")
    p.set_defaults(memory_advice=RUN_MEMORY_ADVICE)


#: What `fxfuse run` can lower when a rank was killed for memory (`RankFailed.killed_for_memory`).
RUN_MEMORY_ADVICE = ("to need less memory: a smaller --batch, fewer --layers, a smaller --tp (fewer processes on this "
                     "machine), or --compare none (no eager copy of the model)")


def _run_command(args) -> int:
    from fxfuse.runner.options import prepare_run

    if args.json is not None:
        check_output_file(args.json, "--json")
    from fxfuse.runner.torchrun import launched_world_size

    preset = args.preset if (args.preset or args.checkpoint) else RunOptions().preset
    tp = args.tp or launched_world_size() or RunOptions().tp  # under torchrun each process is one rank
    options = RunOptions(
        preset=preset, checkpoint=args.checkpoint, layers=args.layers, tp=tp, device=args.device,
        backend=args.backend, inner=args.inner, dtype=args.dtype, batch=args.batch, prompt_len=args.prompt_len,
        tokens_per_step=args.tokens_per_step, steps=args.steps, compare=args.compare, seed=args.seed,
        cuda_graph=args.cuda_graph, graph_widths=args.graph_widths, weights=args.weights, dynamic=args.dynamic,
    )
    setup = prepare_run(options)  # every check that needs no rank, before any rank starts

    from fxfuse.runner.run import run_prepared

    summary = run_prepared(setup)
    if summary["rank"] != 0:  # a torchrun rank other than 0: rank 0 reports
        return 0
    print(format_run_summary(summary))
    if args.json is not None:
        write_json(args.json, summary)
    if summary["compare_ok"] is False:
        print(f"fxfuse: error: the logits differ from --compare {summary['compare']}'s by more than the bound "
              "(the summary's last line)", file=sys.stderr)
        return 1
    return 0


COMPARE_DESCRIPTIONS = {"eager": "the same model uncompiled, step for step", "hf": "transformers' DeepseekV3ForCausalLM"}


def format_run_summary(summary: dict) -> str:
    """A few human-readable lines for a run summary dict."""
    graphs = f"CUDA graphs for widths {summary['graph_widths']}" if summary["cuda_graph"] else "no CUDA graphs"
    backend = summary["backend"]
    if summary["inner_compiler"] is not None:
        backend += f" (fusion passes, then {summary['inner_compiler']})"
    steps, width = summary["steps"], summary["tokens_per_step"]
    lines = [
        f"model {summary['model']} ({summary['layers']} layers), tp={summary['tp']} on {summary['device']}, {summary['dtype']} "
        f"activations, {WEIGHT_DESCRIPTIONS[summary['weights']].format(dtype=summary['dtype'])}, backend {backend}, {graphs}",
    ]
    if summary["fused_sites"] is not None:
        lines.append(_fusion_line(summary))
    verified = summary.get("verified_tokens_per_s")
    lines.append(f"batch {summary['batch']}, prompt {summary['prompt_len']}, {_count(steps, 'step')} of "
                 f"{_count(width, 'token')}: step {summary['step_ms']:.2f} ms median, "
                 f"{summary['step_ms_p90']:.2f} ms p90, {summary['tokens_per_s']:,.0f} tokens/s generated"
                 + (f" ({verified:,.0f} tokens/s verified, drafts included)" if width > 1 and verified else ""))
    if summary["peak_gpu_mem_gb"] is not None:
        lines.append(f"peak GPU memory (rank 0): {summary['peak_gpu_mem_gb']:.2f} GB")
    lines.append(f"tokens (sequence 0): {summary['tokens']}")
    lines.append(_drafts_line(summary))
    if summary["compare"] != "none":
        lines.append(_compare_line(summary))
    return "\n".join(lines)


def _fusion_line(summary: dict) -> str:
    """What backend fxfuse did with the all-reduce sites, and what its op ran (or why nothing was fused)."""
    if not summary["allreduce_sites"]:
        why = "at tp=1 the model issues no collective" if summary["tp"] == 1 else "the compiled step issues none"
        return f"fxfuse found no all-reduce to fuse ({why})"
    sites = f"{summary['fused_sites']} of {summary['allreduce_sites']} all-reduce sites"
    if summary["fxfuse_fusion"] == "off":  # the passes still fuse (they never read the settings); the op does not
        from fxfuse.op.decide.settings import FusionSettings, what_fused_sites_run

        line = f"fxfuse replaced {sites} with its fused op, but {what_fused_sites_run(FusionSettings(enabled=False))}"
    else:
        line = f"fxfuse fused {sites}"
    fast = summary.get("fast_all_reduces") or 0
    if fast:
        line += f" ({fast} more on its fast all-reduce, add and norm left to Inductor: tier b)"
    return f"{line}; the fused op ran {summary['fused_op'] or 'nothing (no site fused)'}"


def _compare_line(summary: dict) -> str:
    """The `--compare` check with its verdict: the largest error against the bound the model benchmark
    uses (`fxfuse.runner.sensitivity.check_bound`)."""
    import torch

    from fxfuse.runner.sensitivity import SENSITIVITY_FACTOR, TOLERANCE, tolerance

    compare, bound, sensitivity = summary["compare"], summary["max_rel_err_bound"], summary["eager_sensitivity"]
    verdict = "ok, within" if summary["compare_ok"] else "FAILED, above"
    if sensitivity is None:
        rule = f"a fixed {TOLERANCE:g}; the model's sensitivity is measured with --compare eager only"
    else:
        rule = (f"the larger of {tolerance(getattr(torch, summary['dtype'])):.2g} and {SENSITIVITY_FACTOR:g} x the model's own "
                f"sensitivity to a half rounding step of {summary['dtype']}, {sensitivity:.1e}")
    broken = summary.get("reference_nonfinite") or 0
    note = (f" (the uncompiled reference's own logits are NaN or infinite at up to {broken} places per step, and the "
            "compiled run's at the same places: the weights or inputs are broken, not the compile; the error is over "
            "the finite logits)") if broken and summary["compare_ok"] else ""
    return (f"max relative error vs {compare} ({COMPARE_DESCRIPTIONS[compare]}): {summary['max_rel_err']:.3e}: "
            f"{verdict} the bound {bound:.3g} ({rule}){note}")


def _count(n: int, noun: str) -> str:
    """`1 token`, `4 tokens`."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


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
    source.add_argument("--preset", default=None, help=f"built-in model config: {', '.join(PRESETS)} (default tiny)")
    source.add_argument("--checkpoint", metavar="DIR",
                        help="Hugging Face DeepSeek-V3-format checkpoint directory, config.json only (default: none)")
    p.add_argument("--layers", type=at_least(1), default=None, metavar="N",
                   help="keep full width but only the first N layers (default: all)")
    p.add_argument("--tp", type=at_least(1), default=2, help="tensor parallel size to trace for (default 2)")
    add_dtype_option(p, DTYPE_CHOICES, "bfloat16", f"weights and activations (default bfloat16, as on GPUs: {BF16_WHY}; "
                     "`fxfuse run` on CPU uses float32)")
    p.add_argument("--weights", type=spelled(WEIGHT_SPELLINGS), choices=("bf16", "fp8"), default="bf16",
                   help="weight format traced: bf16 (default) or fp8 (FP8 blocks; with FXFUSE_FP8_GEMM=w8a8 each GEMM "
                        "quantizes its input, and the report shows which quantizations fold into the fused op)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH (default: none)")


def _report_command(args) -> int:
    from fxfuse.runner.op_settings import checked_op_settings
    from fxfuse.runner.options import check_tp, resolve_model

    if args.json is not None:
        check_output_file(args.json, "--json")
    config, name = resolve_model(args.preset or (None if args.checkpoint else "tiny"), args.checkpoint, args.layers)
    check_tp(config, args.tp)
    checked_op_settings()  # the passes consult the op's settings as they trace

    import torch

    from fxfuse.inspect.site_report import report_model
    from fxfuse.runner.progress import Progress, watch_layers

    progress = Progress(True, "fxfuse report")
    tracing = f"tracing {name} ({config.num_hidden_layers} layers, tp={args.tp}) on fake tensors: dynamo, AOT autograd, fxfuse passes"
    from fxfuse.runner.quant_setup import bench_scheme

    quant = None if args.weights == "bf16" else bench_scheme(args.weights)
    with progress.phase(tracing, heartbeat_s=15):
        report = report_model(config, args.tp, name=name, dtype=getattr(torch, args.dtype), quant=quant,
                              on_build=lambda model: watch_layers(progress, model.model.layers, "dynamo traced layer"))
    print(report.table())
    if args.json is not None:
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


#: `fxfuse plan`'s default KV-cache length (cut to the model's max_position_embeddings) and tensor-parallel
#: size (cut to the largest size that splits the model).
PLAN_CONTEXT = 4096
PLAN_TP = 8
PLAN_DESCRIPTION = """\
Per-rank memory plan of a run on GPUs (no weights loaded, no GPU needed), in GB (1e9 bytes): weights,
KV cache, the fused op's workspace, activations (an estimate), CUDA-graph outputs and a fixed reserve.
Exits 2 with what would fit when the total exceeds --gpu-memory-gb (default: GPU 0's memory, if any;
without a GPU and without --gpu-memory-gb it gives no verdict).
"""
#: What `fxfuse plan` says when it has no GPU memory to check the plan against.
NO_VERDICT = ("- no verdict: this machine has no GPU and --gpu-memory-gb was not given; give --gpu-memory-gb G "
              "(one GPU's memory in GB) to check the plan against it")


def _add_plan_parser(commands) -> None:
    from fxfuse.runner.op_settings import INTERCONNECTS

    p = _subcommand(commands, "plan", _plan_command,
                    help="per-rank memory of a run: weights, KV cache, workspaces, activations (no GPU needed)",
                    description=PLAN_DESCRIPTION)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", default=None, help=f"built-in model config: {', '.join(PRESETS)} (default deepseek-v3)")
    source.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (config.json only; default: none)")
    p.add_argument("--layers", type=at_least(1), default=None, metavar="N", help="keep full width but only the first N layers (default: all)")
    p.add_argument("--tp", type=at_least(1), default=None,
                   help=f"tensor parallel size (default {PLAN_TP}, one node of {PLAN_TP} GPUs, or the largest size below "
                        "it that splits the model: 4 for tiny)")
    p.add_argument("--weights", type=spelled(WEIGHT_SPELLINGS), choices=WEIGHT_FORMATS, default=None,
                   help="weight format: bf16 (also spelled bfloat16), fp8 or int4 (default: the checkpoint's, bf16 for presets)")
    add_dtype_option(p, DTYPE_CHOICES, "bfloat16", f"activations and unquantized weights (default bfloat16, as on GPUs: {BF16_WHY})")
    p.add_argument("--batch", type=at_least(1), default=8, help="sequences per step (default 8)")
    p.add_argument("--context", type=at_least(1), default=None,
                   help=f"KV-cache positions per sequence, at most the model's max_position_embeddings (default "
                        f"{PLAN_CONTEXT}, or the model's max_position_embeddings if smaller)")
    p.add_argument("--tokens", type=at_least(1), default=128, help="widest step, tokens per sequence (default 128)")
    p.add_argument("--graph-widths", type=int_list(1, MAX_STEP_WIDTH), default=DEFAULT_WIDTHS, metavar="W,W,...",
                   help=f"captured CUDA-graph widths (default {','.join(map(str, DEFAULT_WIDTHS))})")
    p.add_argument("--interconnect", choices=INTERCONNECTS, default="nvlink",
                   help="whose workspace the fused op holds: FlashInfer's TensorRT-LLM kernel (nvlink: NVLink / NVSwitch "
                        "GPUs) or its PCIe all-reduce (pcie: PCIe-only GPUs) (default nvlink)")
    p.add_argument("--gpu-memory-gb", type=positive_float, default=None, help="memory per GPU in GB (default: GPU 0's, if any)")
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON to PATH (default: none)")


def _plan_command(args) -> int:
    from fxfuse.models.presets import TEXT_OF_MULTIMODAL
    from fxfuse.models.quant.scheme import checkpoint_format
    from fxfuse.runner.options import check_tp, resolve_model, tp_sizes

    if args.json is not None:
        check_output_file(args.json, "--json")
    if args.checkpoint:
        config, name = resolve_model(None, args.checkpoint, args.layers)
        with open(os.path.join(args.checkpoint, "config.json")) as f:
            hf = json.load(f)
        stored, multimodal = checkpoint_format(hf), "text_config" in hf
    else:
        name = args.preset or "deepseek-v3"
        config, _ = resolve_model(name, None, args.layers)
        stored, multimodal = checkpoint_format({}), name in TEXT_OF_MULTIMODAL
    tp = args.tp or max(size for size in tp_sizes(config) if size <= PLAN_TP)
    check_tp(config, tp)
    widest = max(args.tokens, *args.graph_widths)
    context = min(PLAN_CONTEXT, config.max_position_embeddings) if args.context is None else args.context
    if context > config.max_position_embeddings:
        raise ValueError(f"--context {context} is more than the model's max_position_embeddings ({config.max_position_embeddings})")
    if widest > context:
        raise ValueError(f"--context {context} is shorter than the widest step ({widest} tokens of --tokens or --graph-widths)")

    import dataclasses

    import torch

    from fxfuse.runner.memory_plan import GB, PlanError, PlanInputs, device_memory_bytes, plan_memory

    inputs = PlanInputs(tp=tp, weights=args.weights or stored.weights, dtype=getattr(torch, args.dtype), batch=args.batch,
                        context=context, step_tokens=args.tokens, graph_widths=tuple(args.graph_widths),
                        fused_workspace=True, fp8_block=stored.fp8_block, int4_group=stored.int4_group,
                        interconnect=args.interconnect)
    plan = plan_memory(config, inputs, name)
    available = (int(args.gpu_memory_gb * GB) if args.gpu_memory_gb is not None
                 else device_memory_bytes() if torch.cuda.is_available() else None)
    print(plan.table(available))
    if available is None:
        print(NO_VERDICT)
    if multimodal:
        print(f"- {name} is the text model of a multimodal checkpoint: its vision encoder is neither loaded by `fxfuse run` nor counted here")
    if args.json is not None:
        write_json(args.json, {"model": name, **{k: str(v) if k == "dtype" else v for k, v in dataclasses.asdict(inputs).items()},
                               "parts_bytes": plan.parts, "total_bytes": plan.total_bytes, "available_bytes": available,
                               "workspace_tokens": plan.workspace_tokens, "assumptions": plan.assumptions(),
                               "vision_encoder_counted": False if multimodal else None})
    if available is not None:
        try:
            plan.check(available, config)
        except PlanError as exc:
            print(f"fxfuse: error: {exc}", file=sys.stderr)
            return 2
    return 0


def _add_tune_parser(commands) -> None:
    from fxfuse.bench.tune_pcie import add_tune_pcie_arguments

    p = _subcommand(commands, "tune", None, help="tune FlashInfer's PCIe all-reduce, then time one kernel against two (CUDA)",
                    description="Tune once per machine; `fxfuse tune pcie --help` says how.")
    p.set_defaults(missing="choose what to tune: pcie")
    names = p.add_subparsers(dest="tuned", metavar="WHAT")
    pcie = _subcommand(names, "pcie", _tune_command, help="FlashInfer's PCIe IPC all-reduce (FlashInfer >= 0.7.2)",
                       description="Measure FlashInfer's PCIe all-reduce launch configurations on this machine and "
                                   "write its tuning file, then time fxfuse's one-kernel PCIe path against the two-kernel "
                                   "path per token count and write a thresholds file choosing the faster (collective over "
                                   "one GPU per rank).")
    add_tune_pcie_arguments(pcie)


def _tune_command(args) -> int:
    from fxfuse.runner.op_settings import checked_op_settings
    from fxfuse.bench.tune_pcie import main as tune_main

    checked_op_settings(tune_cache_written=True)  # FXFUSE_PCIE_PROFILE and the others the workspace is made with
    start = args.argv.index("pcie", args.argv.index("tune") + 1) + 1
    return tune_main([a for a in args.argv[start:] if a != "--verbose"])


#: Benchmarks that run the fused op: the op's settings are checked before they start.
BENCHMARKS_WITH_THE_OP = ("kernel", "fallback", "model")


def _bench_command(args) -> int:
    check_output_dir(args.out_dir, "--out-dir")  # every benchmark has one; checked before torch is imported
    if args.benchmark in BENCHMARKS_WITH_THE_OP and (args.benchmark != "model" or "fxfuse" in args.backends.split(",")):
        from fxfuse.runner.op_settings import checked_op_settings

        checked_op_settings()
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
        with _sigterm_raises():
            return args.handler(args)
    except ValueError as exc:  # bad input (RunError, a config the model cannot run) or a failed write
        print(f"fxfuse: error: {exc}", file=sys.stderr)
        return 2
    except RankFailed as exc:
        advice = f"; {args.memory_advice}" if exc.killed_for_memory and args.memory_advice else ""
        print(f"fxfuse: error: rank {exc.rank} failed: {exc.error}{advice}", file=sys.stderr)
        if args.verbose:
            print(exc.traceback, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the launcher has stopped the ranks on the way here
        print("fxfuse: error: interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED_STATUS
    except Terminated:
        print("fxfuse: error: terminated (SIGTERM)", file=sys.stderr)
        return TERMINATED_STATUS


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While the block runs (in the main thread), SIGTERM raises `Terminated` once, so every `finally` on
    the way out runs (the launcher's stops the ranks); a second SIGTERM during that clean-up is ignored.
    The previous handler is restored afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _raise_terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()
