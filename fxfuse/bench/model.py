"""`fxfuse bench model`: DeepSeek-V3 verify-step latency, eager vs Inductor vs fxfuse, under CUDA graphs.

The deepseek-v3 preset at full width with `--layers N` (random weights), tensor parallel over
`--tp` GPUs (default: all visible ones; NCCL, one process per GPU). For each batch size and step
width (tokens per sequence) every backend's step is captured in a CUDA graph over the static KV
cache and replayed (`--no-cuda-graphs`: called uncaptured, so each step's host cost counts too, as
in prefill and at widths without a graph); the backends are timed side by side, in interleaved
rounds, and each timing is the median over `--repeats` samples of `--iters` calls (slowest rank).
Every backend's logits are checked against eager on the same inputs and cache (relative L2 error),
within a bound scaled by the model's own sensitivity to rounding (`fxfuse.runner.sensitivity`: an
eager step with its first layer's input perturbed by half a bf16 rounding step). `--dynamic` says how
the compiled backends are compiled: static shapes (`dynamic=False`, one graph per batch x width, what
engines that capture one graph per width compile; the default under CUDA graphs), dynamic shapes (the
default for uncaptured steps), or `both`: each compiled backend measured both ways in one run, a
table per mode (`fxfuse.bench.model_report`). At tp > 1 it also times the collectives alone: the
step's all-reduces ([batch * width, hidden] each, as many as the step does) captured in one graph,
and reports their share of the unfused (Inductor) step. Results go to --out-dir as JSON, markdown
and PNG (see `fxfuse.bench.model_report`).

`--device cpu` is a smoke run of the same code (gloo ranks, no CUDA graphs, wall-clock timing) with defaults
of its own that keep it to a minute or two while every site fuses (`fxfuse.bench.arguments.CPU_SMOKE_RUN`, the
end of `--help`): it checks the benchmark, not the speed. Options and their defaults: `fxfuse.bench.arguments`.
Launch under torchrun to join an existing launch.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time
import traceback
import zlib
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist

from fxfuse.bench.arguments import (
    CPU_TP, DEFAULT_BATCHES, DEFAULT_CONTEXT, DEFAULT_ITERS, DEFAULT_LAYERS, DEFAULT_PRESET, DEFAULT_REPEATS, DEFAULT_TOKENS,
    MODEL_DESCRIPTION, add_model_arguments,
)
from fxfuse.bench.model_report import markdown, write_report
from fxfuse.bench.output import mode_name, package_versions, publish, relative_l2_error, report_header
from fxfuse.command_line import CommandParser, check_output_dir, parsed_or_status
from fxfuse.runner.launch import run_on_ranks
from fxfuse.runner.options import BACKENDS, check_host_memory, resolve_dynamic
from fxfuse.runner.progress import Progress
from fxfuse.runner.sensitivity import SENSITIVITY_FACTOR, TOLERANCE, check_bound, perturbed_input
from fxfuse.runner.step_backends import CompiledStep, compile_step
from fxfuse.runner.torchrun import check_tp_matches_launch, launched_world_size

@dataclass(frozen=True)
class ModelBenchConfig:
    """What one model benchmark measures (identical on all ranks)."""

    preset: str
    layers: int
    tokens: tuple[int, ...]
    batches: tuple[int, ...]
    backends: tuple[str, ...]
    dtype: str
    context: int
    repeats: int
    iters: int
    device: str
    time_budget_s: float | None
    seed: int = 0
    single_rank_collectives: bool = False
    weights: str = "bf16"
    fp8_gemm: str = "w8a16"  # FP8 weights' GEMM (FXFUSE_FP8_GEMM), recorded in the report
    cuda_graphs: bool = True  # on cuda: replay captured steps (else call them uncaptured)
    dynamic: tuple[bool, ...] = (True,)  # the shape modes each compiled backend is measured in (torch.compile's dynamic)


#: A measured variant: (backend, torch.compile's `dynamic`), None for eager; the eager variant.
Variant = tuple[str, bool | None]
EAGER: Variant = ("eager", None)


class BenchInputError(ValueError):
    """A benchmark that cannot start: bad option or machine; the message says which."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse `fxfuse bench model` arguments (a usage error exits with status 2)."""
    p = CommandParser(prog="fxfuse bench model", description=MODEL_DESCRIPTION)
    add_model_arguments(p)
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> tuple[ModelBenchConfig, int]:
    """(benchmark config, tp size) from parsed arguments, machine-dependent defaults resolved;
    raises BenchInputError naming the problem."""
    from fxfuse.models.presets import PRESETS, get_preset

    device = args.device
    tokens = _int_list("--tokens", args.tokens) if args.tokens is not None else DEFAULT_TOKENS[device]
    batches = _int_list("--batch", args.batch) if args.batch is not None else DEFAULT_BATCHES[device]
    backends = tuple(args.backends.split(","))
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise BenchInputError(f"unknown backends {unknown}; choose from {', '.join(BACKENDS)}")
    preset = args.preset or DEFAULT_PRESET[args.device]
    if preset not in PRESETS:
        raise BenchInputError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    config = get_preset(preset)
    layers = args.layers or min(DEFAULT_LAYERS[device], config.num_hidden_layers)
    context = args.context or min(DEFAULT_CONTEXT, config.max_position_embeddings)
    if max(tokens) > 128:
        raise BenchInputError(f"--tokens must be at most 128 per step (got {max(tokens)})")
    if max(tokens) > context:
        raise BenchInputError(f"a step of {max(tokens)} tokens does not fit a KV cache of --context {context}")
    if not 1 <= layers <= config.num_hidden_layers:
        raise BenchInputError(f"--layers must be between 1 and {config.num_hidden_layers} (got {layers})")
    if context > config.max_position_embeddings:
        raise BenchInputError(f"--context {context} exceeds max_position_embeddings {config.max_position_embeddings}")
    tp = _tensor_parallel_size(args)
    from fxfuse.runner.quant_setup import bench_scheme

    try:
        fp8_gemm = bench_scheme(args.weights).fp8_gemm
    except ValueError as exc:  # FXFUSE_FP8_GEMM names no GEMM
        raise BenchInputError(str(exc)) from exc
    model_config = get_preset(preset, layers=layers)
    try:
        model_config.check_tensor_parallel(tp)
        if args.device == "cpu":
            check_host_memory(model_config, args.dtype, 1, "use --preset tiny or fewer --layers")
    except ValueError as exc:
        raise BenchInputError(str(exc)) from exc
    bench = ModelBenchConfig(
        preset=preset, layers=layers, tokens=tuple(sorted(set(tokens))), batches=tuple(sorted(set(batches))),
        backends=tuple(b for b in BACKENDS if b in backends), dtype=args.dtype, context=context,
        repeats=args.repeats or DEFAULT_REPEATS[device], iters=args.iters or DEFAULT_ITERS[device], device=device,
        time_budget_s=args.time_budget_s,
        single_rank_collectives=args.single_rank_collectives, weights=args.weights, fp8_gemm=fp8_gemm,
        cuda_graphs=args.cuda_graphs and args.device == "cuda",
        dynamic=shape_modes(args.dynamic, args.cuda_graphs and args.device == "cuda"),
    )
    return bench, tp


def shape_modes(choice: str, cuda_graphs: bool) -> tuple[bool, ...]:
    """The `dynamic` values the compiled backends are measured with for a `--dynamic` choice: both
    (static first) for "both"; for "auto" static shapes when every width is captured in a CUDA graph
    (one compile per batch x width, as engines that capture one graph per width compile), dynamic
    shapes when the steps run uncaptured (one graph for every width)."""
    if choice == "both":
        return (False, True)
    return (resolve_dynamic(choice, when_auto=not cuda_graphs),)


def _int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise BenchInputError(f"{flag} takes comma-separated integers (got {text!r})") from None
    if min(values) < 1:
        raise BenchInputError(f"{flag} values must be at least 1 (got {text!r})")
    return values


def _tensor_parallel_size(args: argparse.Namespace) -> int:
    """--tp, or its default: under torchrun the launch's world size (a different --tp is refused), else all
    visible GPUs on cuda and `CPU_TP` gloo processes on cpu."""
    launched = launched_world_size()
    if launched is not None and args.tp is not None:
        check_tp_matches_launch(args.tp)
    if args.device == "cpu":
        return launched or args.tp or CPU_TP
    if not torch.cuda.is_available():
        raise BenchInputError("fxfuse bench model needs CUDA GPUs (use --device cpu for a smoke run of the code)")
    gpus = torch.cuda.device_count()
    if launched is not None:
        return launched
    tp = args.tp or gpus
    if tp > gpus:
        raise BenchInputError(f"--tp {tp} needs {tp} GPUs (one process per GPU), but only {gpus} are present")
    return tp


def _checked_config(argv: list[str] | None) -> tuple[argparse.Namespace, ModelBenchConfig, int]:
    """(parsed arguments, benchmark config, tp size) with --out-dir checked (ValueError naming a problem)."""
    args = parse_args(argv)
    check_output_dir(args.out_dir, "--out-dir")
    return (args, *config_from_args(args))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (spawning ranks or joining torchrun), write the reports, return the exit status."""
    checked, status = parsed_or_status(lambda: _checked_config(argv))
    if status is not None:
        return status
    args, config, tp = checked
    report = run_on_ranks(bench_rank, tp, config, device=config.device, timeout_s=1800)[0]
    if report is None:  # a non-zero torchrun rank: rank 0 reports
        return 0
    try:
        publish(report, "model", argv, lambda r: write_report(r, args.out_dir), markdown)
    except OSError as exc:  # the measurement is not lost: print it, then the error
        print(markdown(report))
        print(f"fxfuse: error: cannot write the results to {args.out_dir}: {exc}", file=sys.stderr)
        return 2
    failed = [r for r in report["results"] if r["status"] == "failed"]
    if failed:
        print(f"FAILED: {len(failed)} point(s) differ from eager by more than max({TOLERANCE:g}, {SENSITIVITY_FACTOR:g} x "
              "the eager step's own sensitivity)", file=sys.stderr)
        return 1
    return 0


@torch.inference_mode()
def bench_rank(ctx, config: ModelBenchConfig) -> dict | None:
    """One rank's part: build, compile, capture and time every point; rank 0 returns the report."""
    from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
    from fxfuse.models.presets import get_preset
    from fxfuse.models.random_weights import init_random_shards

    progress = Progress(ctx.rank == 0, "fxfuse bench model")
    if config.single_rank_collectives:
        ctx = dataclasses.replace(ctx, collectives_at_one_rank=True)
    device = torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, config.dtype)
    model_config = get_preset(config.preset, layers=config.layers)
    from fxfuse.models.quant.scheme import QuantScheme

    with progress.phase(f"building {config.preset} ({config.layers} layers, random {config.weights} weights) on {device}"):
        model = DeepseekV3ForCausalLM(
            model_config, ctx, dtype=dtype, device=device, max_batch=max(config.batches), max_seq_len=config.context,
            quant=QuantScheme(config.weights, fp8_gemm=config.fp8_gemm),
        )
        init_random_shards(model, config.seed, ctx)
        model.eval()
    compiled = compiled_variants(model, config)
    fused_kernel_ready = None
    if "fxfuse" in config.backends and device.type == "cuda":
        import fxfuse

        max_tokens = max(config.batches) * max(config.tokens)
        fused_kernel_ready = fxfuse.prepare(ctx.group, model_config.hidden_size, dtype, max_tokens)

    clock = _AgreedClock(ctx, config.time_budget_s)
    rows, collective_rows = [], []
    for batch in config.batches:
        rows += _bench_batch(ctx, config, model, compiled, batch, device, clock, progress)
        if ctx.world_size > 1:
            collective_rows += _time_collectives(ctx, config, model_config, batch, device, clock)
    if ctx.rank != 0:
        return None
    fxfuse_steps = [step for (backend, _), step in compiled.items() if backend == "fxfuse"]
    fusion = (fxfuse_steps[0] if fxfuse_steps else compile_step(model, "eager")).fusion_summary()
    report = _report(config, ctx.world_size, device, rows, collective_rows, fusion, fused_kernel_ready)
    report["weight_gb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    report["peak_gpu_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return report


def compiled_variants(model, config: ModelBenchConfig) -> dict[Variant, CompiledStep]:
    """Every (backend, dynamic) the benchmark measures: eager once (dynamic None), each compiled backend
    once per shape mode of `config.dynamic`, in report order."""
    variants: dict[Variant, CompiledStep] = {}
    for backend in config.backends:
        for dynamic in (None,) if backend == "eager" else config.dynamic:
            variants[(backend, dynamic)] = compile_step(model, backend, config.single_rank_collectives,
                                                        dynamic=bool(dynamic))
    return variants


def variant_name(variant: Variant, config: ModelBenchConfig) -> str:
    """The backend, with its shape mode where the run measures both."""
    backend, dynamic = variant
    if dynamic is None or len(config.dynamic) == 1:
        return backend
    return f"{backend} ({mode_name(dynamic)})"


def _bench_batch(ctx, config, model, compiled: dict[Variant, CompiledStep], batch: int, device, clock, progress) -> list[dict]:
    """One batch size: prepare every variant (compile, capture), check it vs eager, time all side by side."""
    inputs = {w: _step_inputs(config, model.config.vocab_size, batch, w, device) for w in config.tokens}
    runners: dict[Variant, Callable] = {}
    outputs: dict[tuple[Variant, int], torch.Tensor] = {}
    problems: dict[Variant, tuple[str, str]] = {}
    for variant, step in compiled.items():
        name = variant_name(variant, config)
        if clock.over_budget():
            problems[variant] = ("skipped", "time budget spent before this backend was captured")
            continue
        with progress.phase(f"batch {batch}: {name}: compiling, capturing and checking widths {list(config.tokens)}"):
            runner, error = _prepare_runner(model, step.step, batch, config, inputs, device, outputs, variant, progress)
        if not _all_ranks_ok(ctx, error is None):
            problems[variant] = ("error", error or "failed on another rank")
            progress.note(f"batch {batch}: {name}: FAILED: {problems[variant][1]}")
            continue
        runners[variant] = runner
    sensitivity = _eager_sensitivity(ctx, model, compiled, runners, inputs, outputs, config.tokens)
    progress.note(f"batch {batch}: timing {len(runners)} variant(s) x {len(config.tokens)} widths, {config.repeats} rounds")
    samples = _interleaved_samples(ctx, config, runners, inputs, device)
    rows = []
    for variant in compiled:
        backend, dynamic = variant
        for width in config.tokens:
            row = {"batch": batch, "tokens": width, "backend": backend, "dynamic": dynamic, "status": "ok", "step_ms": None,
                   "step_ms_p90": None, "rel_err_vs_eager": None, "eager_sensitivity": sensitivity.get(width), "note": ""}
            if variant in problems:
                row["status"], row["note"] = problems[variant]
            else:
                times = samples[(variant, width)]
                row["step_ms"], row["step_ms_p90"] = _max_over_ranks(ctx, [statistics.median(times), _p90(times)])
                if EAGER in runners and variant != EAGER:
                    err = relative_l2_error(outputs[(variant, width)], outputs[(EAGER, width)])
                    row["rel_err_vs_eager"] = _max_over_ranks(ctx, [err])[0]
                    row["status"] = "ok" if row["rel_err_vs_eager"] <= check_bound(sensitivity.get(width)) else "failed"
                progress.note(f"  batch {batch} width {width:3d} {variant_name(variant, config):18s} {row['step_ms']:9.3f} ms")
            rows.append(row)
    del runners, outputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _prepare_runner(model, step, batch, config, inputs, device, outputs, variant, progress) -> tuple[Callable | None, str | None]:
    """The step as it is timed (CUDA graphs captured where `config.cuda_graphs`, else the plain step)
    and its first call per width into `outputs`, each on a freshly zeroed KV cache so every backend
    sees the same cache. Returns (runner, None), or (None, a one-line error) if compiling, capturing
    or running failed."""
    try:
        runner = _captured(step, batch, config.tokens, device, progress) if config.cuda_graphs else step
        for width in config.tokens:
            model.reset_cache()
            outputs[(variant, width)] = runner(*inputs[width]).float().clone()
        return runner, None
    except Exception as exc:  # noqa: BLE001 - a backend that fails is reported, the others still run
        traceback.print_exc()
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def _eager_sensitivity(ctx, model, compiled, runners, inputs, outputs, widths) -> dict[int, float]:
    """Per width: the relative L2 distance of an eager step with its first layer's input perturbed
    (`fxfuse.runner.sensitivity.perturbed_input`) from the eager step's logits, on the same zeroed KV
    cache (the plain, uncaptured module: hooks do not run in a replayed graph); empty without eager."""
    if EAGER not in runners:
        return {}
    sensitivity = {}
    for width in widths:
        model.reset_cache()
        with perturbed_input(model):
            perturbed = compiled[EAGER].step(*inputs[width]).float()
        sensitivity[width] = _max_over_ranks(ctx, [relative_l2_error(perturbed, outputs[(EAGER, width)])])[0]
    return sensitivity


def _all_ranks_ok(ctx, ok: bool) -> bool:
    """True on every rank iff `ok` on every rank (so all ranks skip a failed backend together)."""
    return _max_over_ranks(ctx, [0.0 if ok else 1.0])[0] == 0.0


def _step_inputs(config: ModelBenchConfig, vocab_size: int, batch: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic token ids and the last `width` positions of the cache, the same on every rank."""
    generator = torch.Generator().manual_seed(zlib.crc32(repr((config.seed, batch, width)).encode()))
    ids = torch.randint(0, vocab_size, (batch, width), generator=generator).to(device)
    positions = (config.context - width + torch.arange(width)).expand(batch, -1).contiguous().to(device)
    return ids, positions


def _captured(step: Callable, batch: int, widths: tuple[int, ...], device: torch.device, progress: Progress) -> Callable:
    """The step with one CUDA graph per width captured (compiling first where needed); calls replay."""
    from fxfuse.runner.cuda_graph_step import CudaGraphStep

    return CudaGraphStep(step, batch, widths, device, progress=progress)


def _interleaved_samples(ctx, config: ModelBenchConfig, runners: dict[Variant, Callable], inputs, device) -> dict:
    """Milliseconds per step, `repeats` samples per (variant, width); variants alternate within each round."""
    samples: dict[tuple[Variant, int], list[float]] = {(v, w): [] for v in runners for w in config.tokens}
    order = list(runners)
    if ctx.world_size > 1:
        dist.barrier(group=ctx.group)
    for round_index in range(config.repeats):
        rotated = order[round_index % len(order):] + order[: round_index % len(order)] if order else []
        for variant in rotated:
            for width in config.tokens:
                samples[(variant, width)].append(_time_calls(runners[variant], inputs[width], config.iters, device))
    return samples


def _time_calls(call: Callable, args: tuple, iters: int, device: torch.device) -> float:
    """Milliseconds per call of `call(*args)`, averaged over `iters` back-to-back calls."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call(*args)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    began = time.perf_counter()
    for _ in range(iters):
        call(*args)
    return (time.perf_counter() - began) * 1000 / iters


def _time_collectives(ctx, config: ModelBenchConfig, model_config, batch: int, device, clock) -> list[dict]:
    """Per width: the step's all-reduces alone ([batch * width, hidden], 2 * layers + 1 of them), in ms."""
    count = 2 * model_config.num_hidden_layers + 1
    rows = []
    for width in config.tokens:
        if clock.over_budget():
            break
        buffer = torch.zeros(batch * width, model_config.hidden_size, dtype=getattr(torch, config.dtype), device=device)

        def all_reduces(buffer=buffer):
            for _ in range(count):
                dist.all_reduce(buffer, group=ctx.group)

        call = all_reduces
        if device.type == "cuda":
            all_reduces()  # NCCL sets up its channels outside capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                all_reduces()
            call = graph.replay
        dist.barrier(group=ctx.group)
        times = [_time_calls(call, (), config.iters, device) for _ in range(config.repeats)]
        median_ms = _max_over_ranks(ctx, [statistics.median(times)])[0]
        rows.append({"batch": batch, "tokens": width, "allreduces": count, "allreduce_ms": median_ms})
    return rows


class _AgreedClock:
    """Wall-clock budget checks that every rank answers the same way (one all-reduce per check)."""

    def __init__(self, ctx, budget_s: float | None):
        self.ctx, self.budget_s, self.start = ctx, budget_s, time.monotonic()

    def over_budget(self) -> bool:
        """True on every rank once any rank has used up the budget (never without a budget)."""
        if self.budget_s is None:
            return False
        return _max_over_ranks(self.ctx, [time.monotonic() - self.start])[0] > self.budget_s


def _max_over_ranks(ctx, values: list[float]) -> list[float]:
    """Element-wise maximum of `values` over the group (the values themselves at tp=1)."""
    if ctx.world_size == 1:
        return list(values)
    from fxfuse.op.decide.agreement import collective_device

    t = torch.tensor(values, dtype=torch.float64, device=collective_device(ctx.group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return t.tolist()


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def _timing_text(config: ModelBenchConfig, cuda: bool) -> str:
    """How the steps were timed, for the report."""
    samples = f"median of {config.repeats} samples of {config.iters}"
    if config.cuda_graphs:
        return f"CUDA-graph replay; {samples} replays, slowest rank"
    if cuda:
        return (f"uncaptured compiled steps (no CUDA graphs: host cost included); {samples} back-to-back calls "
                "between CUDA events, slowest rank")
    return f"CPU smoke run, wall clock; {samples} calls"


def _report(config, world_size, device, rows, collective_rows, fusion: dict, fused_kernel_ready) -> dict:
    cuda = device.type == "cuda"
    gpu = torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.processor() or platform.machine()})"
    return {
        **report_header("fxfuse bench model", gpu),
        "world_size": world_size,
        "single_rank_collectives": config.single_rank_collectives,
        "device": device.type,
        "cuda_graphs": config.cuda_graphs,
        "timing": _timing_text(config, cuda),
        "versions": package_versions(("flashinfer-python", "triton", "fxfuse")),
        "config": asdict(config),
        "allreduce_sites": fusion["allreduce_sites"],
        "fused_sites": fusion["fused_sites"],
        "fused_kernel_ready": fused_kernel_ready,
        "tolerance": TOLERANCE,
        "sensitivity_factor": SENSITIVITY_FACTOR,
        "results": rows,
        "collectives": collective_rows,
    }


if __name__ == "__main__":
    raise SystemExit(main())
