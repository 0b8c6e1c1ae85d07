"""The model runner behind `fxfuse run`: build, load, compile and step a tensor-parallel DeepSeek-V3.

`run(options)` validates everything it can in the launching process (preset, checkpoint, tp
size, device), then starts one process per rank (or joins torchrun), and on each rank: builds the
model, loads weights (checkpoint, or deterministic random weights), compiles the step with the
chosen backend, prefills a random prompt and runs greedy speculative verify steps of
`tokens_per_step` tokens. It returns rank 0's summary (the `--json` document).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from fxfuse.launch import run_on_ranks
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.run_setup import RunSetup, prepare_run
from fxfuse.models.speculative import accepted_length, next_drafts

BACKENDS = ("eager", "inductor", "fxfuse")
COMPARE_TARGETS = ("none", "eager", "hf")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunOptions:
    """Everything `fxfuse run` takes; defaults are the README's built-in job."""

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


def run(options: RunOptions) -> dict:
    """Run the job described by `options` on `options.tp` ranks and return rank 0's summary."""
    setup = prepare_run(options)
    results = run_on_ranks(run_rank, options.tp, setup, device=options.device)
    return results[0]


def run_rank(ctx: ParallelContext, setup: RunSetup) -> dict:
    """One rank's share of `run`: returns this rank's summary dict (rank 0's is the report)."""
    options = setup.options
    device = _rank_device(options.device)
    model = setup.build_model(ctx, device)
    step = _compile(model, options.backend)
    reference = setup.build_reference(ctx, device) if options.compare != "none" else None

    generator = torch.Generator().manual_seed(options.seed)
    prompt = torch.randint(0, setup.config.vocab_size, (options.batch, options.prompt_len), generator=generator)
    positions = torch.arange(options.prompt_len).expand(options.batch, -1)
    errors: list[float | None] = []
    logits = _forward(step, prompt, positions, device)
    if reference is not None:
        errors.append(reference.relative_error(prompt, positions, logits))

    width = options.tokens_per_step
    last = logits[:, -1].argmax(-1).cpu()
    position = torch.full((options.batch,), options.prompt_len, dtype=torch.long)
    drafts = last.unsqueeze(1).expand(-1, width - 1).clone()
    generated: list[list[int]] = [[int(t)] for t in last]
    step_seconds: list[float] = []
    for _ in range(options.steps):
        input_ids = torch.cat([last.unsqueeze(1), drafts], dim=1)
        step_positions = position.unsqueeze(1) + torch.arange(width)
        start = time.perf_counter()
        logits = _forward(step, input_ids, step_positions, device)
        step_seconds.append(time.perf_counter() - start)
        if reference is not None:
            errors.append(reference.relative_error(input_ids, step_positions, logits))
        predicted = logits.argmax(-1).cpu()
        accepted = accepted_length(drafts, predicted)
        for b in range(options.batch):
            k = int(accepted[b])
            generated[b].extend(int(t) for t in drafts[b, :k])
            generated[b].append(int(predicted[b, k]))
        last = predicted.gather(1, accepted.unsqueeze(1)).squeeze(1)
        position = position + accepted + 1
        drafts = next_drafts(predicted, accepted, width)

    return {
        "rank": ctx.rank,
        "tp": ctx.world_size,
        "device": options.device,
        "backend": options.backend,
        "dtype": options.dtype,
        "model": setup.model_name,
        "layers": setup.config.num_hidden_layers,
        "batch": options.batch,
        "prompt_len": options.prompt_len,
        "tokens_per_step": width,
        "steps": options.steps,
        "compare": options.compare,
        "max_rel_err": max((e for e in errors if e is not None), default=None),
        "step_ms": 1000 * statistics.median(step_seconds) if step_seconds else None,
        "tokens": generated[0],
        "options": asdict(options),
    }


def _rank_device(device: str) -> torch.device:
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _compile(model: torch.nn.Module, backend: str):
    if backend == "eager":
        return model
    return torch.compile(model, backend=backend, fullgraph=True, dynamic=True)


@torch.inference_mode()
def _forward(step, input_ids: torch.Tensor, positions: torch.Tensor, device: torch.device) -> torch.Tensor:
    logits = step(input_ids.to(device), positions.to(device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return logits.float().cpu()
