"""The model runner behind `fxfuse run`: build, load, compile, capture and step a tensor-parallel DeepSeek-V3.

`run(options)` validates everything it can in the launching process (preset, checkpoint, tp
size, device, step and graph widths), then starts one process per rank (or joins torchrun), and
on each rank: builds the model, loads weights (checkpoint, or deterministic random weights),
compiles the step with the chosen backend, on CUDA captures one CUDA graph per step-width bucket
(after `fxfuse.prepare` for backend fxfuse), prefills a random prompt and runs greedy speculative
verify steps of `tokens_per_step` tokens. It returns rank 0's summary (the `--json` document).
Rank 0 reports progress of the long phases on stderr.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from fxfuse.runner.launch import run_on_ranks
from fxfuse.runner.cuda_graph_step import DEFAULT_WIDTHS, CudaGraphStep
from fxfuse.models.parallel import ParallelContext
from fxfuse.runner.progress import Progress
from fxfuse.runner.setup import COMPARE_TARGETS, DTYPES, RunSetup, prepare_run
from fxfuse.runner.speculative import accepted_length, next_drafts
from fxfuse.runner.step_backends import BACKENDS, compile_step

__all__ = ["BACKENDS", "COMPARE_TARGETS", "DTYPES", "RunOptions", "run", "run_rank"]



@dataclass(frozen=True)
class RunOptions:
    """Everything `fxfuse run` takes; defaults are the README's built-in job.

    `cuda_graph` None means: on for device cuda, off for cpu. `graph_widths` are the step widths
    (tokens per sequence) that get a captured graph; other widths run uncaptured.
    """

    preset: str | None = "tiny"
    checkpoint: str | None = None
    layers: int | None = None
    tp: int = 2
    device: str = "cpu"
    backend: str = "eager"
    dtype: str = "float32"
    batch: int = 2
    prompt_len: int = 12
    tokens_per_step: int = 1
    steps: int = 4
    compare: str = "none"
    seed: int = 0
    cuda_graph: bool | None = None
    graph_widths: tuple[int, ...] = DEFAULT_WIDTHS
    weights: str = "bf16"


def run(options: RunOptions) -> dict:
    """Run the job described by `options` on `options.tp` ranks and return this process's summary.

    Spawned ranks: rank 0's summary. Under torchrun: this process's own (its `rank` field says which).
    """
    setup = prepare_run(options)
    results = run_on_ranks(run_rank, options.tp, setup, device=options.device)
    return results[0]


@torch.inference_mode()
def run_rank(ctx: ParallelContext, setup: RunSetup) -> dict:
    """One rank's share of `run`: returns this rank's summary dict (rank 0's is the report)."""
    options = setup.options
    progress = Progress(ctx.rank == 0, "fxfuse run")
    device = _rank_device(options.device)
    weights = "checkpoint" if options.checkpoint else "random"
    with progress.phase(f"building {setup.model_name} ({setup.config.num_hidden_layers} layers, {weights} weights) on {device}"):
        model = setup.build_model(ctx, device)
    compiled = compile_step(model, options.backend)
    fused_kernel_ready = _prepare_fused_kernel(ctx, setup, device) if options.backend == "fxfuse" else None
    step = compiled.step
    if setup.cuda_graph:
        with progress.phase(f"{options.backend}: compiling and capturing CUDA graphs for widths {list(setup.graph_widths)}"):
            step = CudaGraphStep(compiled.step, options.batch, setup.graph_widths, device, progress=progress)
    reference = None
    if options.compare != "none":
        with progress.phase(f"building the --compare {options.compare} reference"):
            reference = setup.build_reference(ctx, device)

    generator = torch.Generator().manual_seed(options.seed)
    prompt = torch.randint(0, setup.config.vocab_size, (options.batch, options.prompt_len), generator=generator)
    positions = torch.arange(options.prompt_len).repeat(options.batch, 1)  # contiguous like every step's: no stride recompile
    errors: list[float | None] = []
    with progress.phase(f"prefill of {options.batch} x {options.prompt_len} tokens"):
        logits = _forward(step, prompt, positions, device)
    if reference is not None:
        errors.append(reference.relative_error(prompt, positions, logits))

    width = options.tokens_per_step
    last = logits[:, -1].argmax(-1)
    position = torch.full((options.batch,), options.prompt_len, dtype=torch.long)
    drafts = last.unsqueeze(1).expand(-1, width - 1).clone()
    generated: list[list[int]] = [[int(t)] for t in last]
    step_seconds: list[float] = []
    if options.steps:
        # One untimed call of the first step (it compiles, if that width has not been run yet): it
        # writes the same cache positions with the same values as the real first step after it.
        _forward(step, torch.cat([last.unsqueeze(1), drafts], dim=1), position.unsqueeze(1) + torch.arange(width), device)
    progress.note(f"{options.steps} verify steps of {options.batch} x {width} tokens")
    for _ in range(options.steps):
        input_ids = torch.cat([last.unsqueeze(1), drafts], dim=1)
        step_positions = position.unsqueeze(1) + torch.arange(width)
        logits, seconds = _timed_forward(step, input_ids, step_positions, device)
        step_seconds.append(seconds)
        if reference is not None:
            errors.append(reference.relative_error(input_ids, step_positions, logits))
        predicted = logits.argmax(-1)
        accepted = accepted_length(drafts, predicted)
        for b in range(options.batch):
            k = int(accepted[b])
            generated[b].extend(int(t) for t in drafts[b, :k])
            generated[b].append(int(predicted[b, k]))
        last = predicted.gather(1, accepted.unsqueeze(1)).squeeze(1)
        position = position + accepted + 1
        drafts = next_drafts(predicted, accepted, width)

    step_ms = 1000 * statistics.median(step_seconds) if step_seconds else None
    return {
        "rank": ctx.rank,
        "tp": ctx.world_size,
        "device": options.device,
        "backend": options.backend,
        "dtype": options.dtype,
        "weights": options.weights,
        "model": setup.model_name,
        "layers": setup.config.num_hidden_layers,
        "batch": options.batch,
        "prompt_len": options.prompt_len,
        "tokens_per_step": width,
        "steps": options.steps,
        "cuda_graph": setup.cuda_graph,
        "graph_widths": list(setup.graph_widths),
        "step_replayed": setup.cuda_graph and width in setup.graph_widths,
        "compare": options.compare,
        "max_rel_err": max((e for e in errors if e is not None), default=None),
        "step_ms": step_ms,
        "step_ms_p90": 1000 * _percentile(step_seconds, 0.9) if step_seconds else None,
        "tokens_per_s": options.batch * width * 1000 / step_ms if step_ms else None,
        "peak_gpu_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        **compiled.fusion_summary(),
        "fused_kernel_ready": fused_kernel_ready,
        "tokens": generated[0],
        "options": asdict(options),
    }


def _rank_device(device: str) -> torch.device:
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _prepare_fused_kernel(ctx: ParallelContext, setup: RunSetup, device: torch.device) -> bool | None:
    """`fxfuse.prepare` on CUDA (before any capture), sized for the widest graph and the prefill.

    Returns whether the FlashInfer kernel is ready (False at tp=1 or where it cannot run); None on CPU.
    """
    if device.type != "cuda":
        return None
    import fxfuse

    o = setup.options
    max_tokens = o.batch * max(o.prompt_len, o.tokens_per_step, *setup.graph_widths)
    return fxfuse.prepare(ctx.group, setup.config.hidden_size, DTYPES[o.dtype], max_tokens)


def _percentile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (linear interpolation between order statistics)."""
    ordered = sorted(values)
    index = q * (len(ordered) - 1)
    low = int(index)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (index - low)


def _forward(step, input_ids: torch.Tensor, positions: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One step on `device`; returns float32 logits on the CPU."""
    return _timed_forward(step, input_ids, positions, device)[0]


def _timed_forward(step, input_ids: torch.Tensor, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, float]:
    """One step; returns (float32 logits on the CPU, seconds from the inputs on the device to the
    logits computed there: the copy of the logits back to the host is not timed)."""
    input_ids, positions = input_ids.to(device), positions.to(device)
    _synchronize(device)
    start = time.perf_counter()
    logits = step(input_ids, positions)
    _synchronize(device)
    seconds = time.perf_counter() - start
    return logits.float().cpu(), seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
