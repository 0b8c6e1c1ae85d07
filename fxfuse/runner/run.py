"""The model runner behind `fxfuse run`: build, load, compile, capture and step a tensor-parallel DeepSeek-V3.

`run(options)` validates everything it can in the launching process (preset, checkpoint, tp
size, device, step and graph widths, the op's settings, the memory plan), then starts one process
per rank (or joins torchrun), and on each rank: builds the model, loads weights (checkpoint, or
deterministic random weights), compiles the step with the chosen backend, on CUDA captures one CUDA
graph per step-width bucket (after `fxfuse.prepare` for backend fxfuse), prefills a random prompt and
runs greedy speculative verify steps of `tokens_per_step` tokens. It returns rank 0's summary (the
`--json` document), which for backend fxfuse says how many all-reduce sites were fused and what the
fused op ran (its `fused_op` field), and, with `--compare`, whether the logits stayed within the
bound the model benchmark uses (`fxfuse.runner.sensitivity.check_bound` of the eager model's own
sensitivity). Rank 0 reports progress of the long phases on stderr.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

import torch

from fxfuse.models.parallel import ParallelContext
from fxfuse.op.decide.settings import current_settings
from fxfuse.runner.cuda_graph_step import CudaGraphStep
from fxfuse.runner.launch import run_on_ranks
from fxfuse.runner.options import RunOptions, RunSetup, prepare_run
from fxfuse.runner.progress import Progress, watch_layers
from fxfuse.runner.sensitivity import check_bound
from fxfuse.runner.setup import DTYPES, build_model, build_reference
from fxfuse.runner.speculative import accepted_length, next_drafts
from fxfuse.runner.step_backends import compile_step

__all__ = ["RunOptions", "compare_verdict", "run", "run_prepared", "run_rank"]

#: Seconds between "still running" lines of a long phase (loading, compiling, capturing).
HEARTBEAT_S = 15.0


def run(options: RunOptions) -> dict:
    """Run the job described by `options` on `options.tp` ranks and return this process's summary.

    Spawned ranks: rank 0's summary. Under torchrun: this process's own (its `rank` field says which).
    """
    return run_prepared(prepare_run(options))


def run_prepared(setup: RunSetup) -> dict:
    """`run` for options already validated by `prepare_run`."""
    return run_on_ranks(run_rank, setup.options.tp, setup, device=setup.options.device)[0]


@torch.inference_mode()
def run_rank(ctx: ParallelContext, setup: RunSetup) -> dict:
    """One rank's share of `run`: returns this rank's summary dict (rank 0's is the report)."""
    options = setup.options
    progress = Progress(ctx.rank == 0, "fxfuse run")
    device = _rank_device(options.device)
    weights = "checkpoint" if options.checkpoint else "random"
    with progress.phase(f"building {setup.model_name} ({setup.config.num_hidden_layers} layers, {weights} weights) on {device}", heartbeat_s=HEARTBEAT_S):
        model = build_model(setup, ctx, device)
    compiled = compile_step(model, options.backend, inner=options.inner or "inductor", dynamic=setup.dynamic_shapes)
    fused_kernel_ready = _prepare_fused_kernel(ctx, setup, device) if options.backend == "fxfuse" else None
    generator = torch.Generator().manual_seed(options.seed)
    prompt = torch.randint(0, setup.config.vocab_size, (options.batch, options.prompt_len), generator=generator)
    positions = torch.arange(options.prompt_len).repeat(options.batch, 1)  # contiguous like every step's: no stride recompile
    width = options.tokens_per_step
    if options.backend != "eager":
        watch_layers(progress, model.model.layers, f"{options.backend}: dynamo traced layer")
        _compile_uncaptured_shapes(compiled.step, setup, prompt, positions, device, progress)
    step = compiled.step
    if setup.cuda_graph:
        with progress.phase(f"{options.backend}: compiling and capturing CUDA graphs for widths {list(setup.graph_widths)}",
                            heartbeat_s=HEARTBEAT_S):
            step = CudaGraphStep(compiled.step, options.batch, setup.graph_widths, device, progress=progress)
    reference = None
    if options.compare != "none":
        with progress.phase(f"building the --compare {options.compare} reference", heartbeat_s=HEARTBEAT_S):
            reference = build_reference(setup, ctx, device)

    checks: list[tuple[float | None, float | None]] = []  # per step: (error, the reference's sensitivity)
    with progress.phase(f"prefill of {options.batch} x {options.prompt_len} tokens", heartbeat_s=HEARTBEAT_S):
        logits = _forward(step, prompt, positions, device)
    if reference is not None:
        checks.append(reference.check(prompt, positions, logits))

    last = logits[:, -1].argmax(-1)
    position = torch.full((options.batch,), options.prompt_len, dtype=torch.long)
    drafts = last.unsqueeze(1).expand(-1, width - 1).clone()
    generated: list[list[int]] = [[int(t)] for t in last]
    accepted_per_step: list[list[int]] = []
    step_seconds: list[float] = []
    # One untimed call of the first step (first-call costs; a compile if that width was not run
    # yet): it writes the same cache positions with the same values as the real first step after it.
    _forward(step, torch.cat([last.unsqueeze(1), drafts], dim=1), position.unsqueeze(1) + torch.arange(width), device)
    for index in range(options.steps):
        progress.count(f"verify steps of {options.batch} x {width} tokens:", index + 1, options.steps)
        input_ids = torch.cat([last.unsqueeze(1), drafts], dim=1)
        step_positions = position.unsqueeze(1) + torch.arange(width)
        logits, seconds = _timed_forward(step, input_ids, step_positions, device)
        step_seconds.append(seconds)
        if reference is not None:
            checks.append(reference.check(input_ids, step_positions, logits))
        predicted = logits.argmax(-1)
        accepted = accepted_length(drafts, predicted)
        accepted_per_step.append([int(k) for k in accepted])
        for b in range(options.batch):
            k = int(accepted[b])
            generated[b].extend(int(t) for t in drafts[b, :k])
            generated[b].append(int(predicted[b, k]))
        last = predicted.gather(1, accepted.unsqueeze(1)).squeeze(1)
        position = position + accepted + 1
        drafts = next_drafts(predicted, accepted, width)

    step_ms = 1000 * statistics.median(step_seconds)
    fusion = compiled.fusion_summary()
    return {
        "rank": ctx.rank,
        "tp": ctx.world_size,
        "device": options.device,
        "backend": options.backend,
        "inner_compiler": options.inner,
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
        **compare_verdict(checks, getattr(torch, options.dtype)),
        "reference_nonfinite": None if reference is None else reference.nonfinite,
        "step_ms": step_ms,
        "step_ms_p90": 1000 * _percentile(step_seconds, 0.9),
        # generated tokens (each step's accepted drafts + 1 per sequence), per second of the median step
        "tokens_per_s": statistics.mean(sum(k + 1 for k in step) for step in accepted_per_step) * 1000 / step_ms,
        "verified_tokens_per_s": options.batch * width * 1000 / step_ms,  # every token a step reads, drafts too
        "peak_gpu_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        **fusion,
        "fused_op": fused_op_ran(device.type, fusion["fused_sites"]),
        "fxfuse_fusion": current_settings().fusion if options.backend == "fxfuse" else None,
        "fused_kernel_ready": fused_kernel_ready,
        "tokens": generated[0],
        "accepted_drafts": accepted_per_step,
        "options": asdict(options),
    }


def _compile_uncaptured_shapes(step, setup: RunSetup, prompt, positions, device, progress: Progress) -> None:
    """Compile the step, each in its own progress phase, for the shapes it will run outside CUDA
    graphs: the prefill and the verify step (unless their width has a graph, which captures it).

    Each warm-up call writes KV-cache positions that the real call of that shape overwrites
    before anything reads them (the prefill: 0..prompt_len-1, the first verify step: the next
    `tokens_per_step`), so the run's results do not change.
    """
    o = setup.options
    verify_positions = o.prompt_len + torch.arange(o.tokens_per_step).repeat(o.batch, 1)
    shapes = [("prefill", prompt, positions), ("verify step", torch.zeros_like(verify_positions), verify_positions)]
    shapes = [shape for shape in shapes if shape[1].shape[1] not in setup.graph_widths]
    stages = f"dynamo, then AOT autograd, the fxfuse passes and {o.inner}" if o.backend == "fxfuse" else "dynamo, then Inductor"
    for count, (what, ids, pos) in enumerate(shapes, 1):
        message = f"{o.backend}: compiling the {what}, {o.batch} x {ids.shape[1]} tokens ({count}/{len(shapes)}; {stages})"
        with progress.phase(message, heartbeat_s=HEARTBEAT_S):
            _forward(step, ids, pos, device)


def _rank_device(device: str) -> torch.device:
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _prepare_fused_kernel(ctx: ParallelContext, setup: RunSetup, device: torch.device) -> bool | None:
    """`fxfuse.prepare` on CUDA (before any capture), sized for what the CUDA graphs replay
    (`RunSetup.fused_kernel_tokens`); a larger prefill runs the op's fallback.

    Returns whether the FlashInfer kernel is ready (False at tp=1 or where it cannot run); None on CPU.
    """
    if device.type != "cuda":
        return None
    import fxfuse

    return fxfuse.prepare(ctx.group, setup.config.hidden_size, DTYPES[setup.options.dtype], setup.fused_kernel_tokens)


#: What the fused op runs on CPU (`fxfuse.op.schema`'s CPU kernel).
CPU_KERNEL = "the CPU reference kernel: gloo all-reduce + float32 RMSNorm"
#: How `fused_op_ran` names each implementation of the fused op on CUDA (`fxfuse.op.decide.modes.FusionMode` values).
CUDA_IMPLEMENTATIONS = {
    "oneshot": "FlashInfer's TensorRT-LLM kernel (one-shot)",
    "twoshot": "FlashInfer's TensorRT-LLM kernel (two-shot)",
    "pcie": "FlashInfer's PCIe all-reduce + fused add-RMSNorm",
    "pcie_one_kernel": "fxfuse's one-kernel PCIe all-reduce + add-RMSNorm (one launch)",
}


def fused_op_ran(device_type: str, fused_sites: int | None) -> str | None:
    """What the fused op ran in this process, in words: None without fused sites; on CPU its reference
    kernel; on CUDA each implementation with its call count, from `fxfuse.prepare`'s `fusion_stats()`."""
    if not fused_sites:
        return None
    if device_type != "cuda":
        return CPU_KERNEL
    from fxfuse.op.runtime.prepare import fusion_stats

    return describe_fusion_stats(fusion_stats())


def describe_fusion_stats(stats: dict) -> str:
    """`fusion_stats()` in words: each implementation and its calls (issued from Python: CUDA-graph
    replays are not counted), the NCCL fallback by reason."""
    calls: dict[str, int] = {}
    for (_group, mode, _hidden, _dtype), count in stats["fused"].items():
        name = CUDA_IMPLEMENTATIONS.get(mode, mode)
        calls[name] = calls.get(name, 0) + count
    for reason, count in stats["fallback"].items():
        calls[f"NCCL all-reduce + fused add-RMSNorm ({reason})"] = count
    if not calls:
        return "no call yet"
    listed = "; ".join(f"{name}: {count} call{'s' if count != 1 else ''}" for name, count in calls.items())
    return f"{listed} (calls issued from Python; CUDA-graph replays are not counted)"


def compare_verdict(checks: list[tuple[float | None, float | None]], dtype: torch.dtype | None = None) -> dict:
    """The summary's check fields from each step's (error, sensitivity) (`build_reference(...).check`):
    `max_rel_err` (the largest error), `eager_sensitivity` (the largest sensitivity over the steps, the
    model's over the run, as the largest error is the run's; None without one), `max_rel_err_bound`
    (`check_bound` of it for a run in `dtype`) and `compare_ok` (the largest error within that bound); all None
    without a comparison (`--compare none`, or `--compare hf` off rank 0)."""
    errors = [e for e, _ in checks if e is not None]
    if not errors:
        return {"max_rel_err": None, "eager_sensitivity": None, "max_rel_err_bound": None, "compare_ok": None}
    sensitivity = max((s for _, s in checks if s is not None), default=None)
    bound = check_bound(sensitivity, dtype)
    return {"max_rel_err": max(errors), "eager_sensitivity": sensitivity, "max_rel_err_bound": bound,
            "compare_ok": max(errors) <= bound}


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
