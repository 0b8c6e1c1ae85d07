"""Validation and construction for the runner: what `fxfuse run` checks before any rank starts.

`prepare_run(options)` turns command-line options into a `RunSetup` (resolved config, weight
source, model name, whether and for which widths CUDA graphs are captured) or raises `RunError`
with a message that names the problem: unknown preset, unreadable checkpoint, tp size that does
not divide the model, CUDA asked where there is none, more GPUs asked than present, bad backend or
dtype, CUDA graphs without CUDA, a step width above 128 or a KV cache longer than the model
allows, a weight format the checkpoint is not in, a run that does not fit the GPU (memory plan).
`RunSetup` then builds the model and the comparison reference on each rank.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace

import torch

from fxfuse.models.config import ModelConfig
from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.presets import PRESETS, get_preset
from fxfuse.models.quant.checkpoint import quantize_state_dict
from fxfuse.models.quant.scheme import QuantScheme
from fxfuse.models.random_weights import init_random_shards, random_hf_state_dict
from fxfuse.runner.quant_setup import check_fits, weight_scheme
from fxfuse.runner.step_backends import BACKENDS
from fxfuse.models.weights import DictSource, SafetensorsSource, load_weights

#: Widest step (tokens per sequence) the runner takes, with or without a CUDA graph.
MAX_STEP_WIDTH = 128

#: `--compare` targets and `--dtype` names the runner accepts.
COMPARE_TARGETS = ("none", "eager", "hf")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Above this many parameters, random weights are generated per shard (not as one full state dict).
FULL_RANDOM_STATE_LIMIT = 500_000_000


class RunError(ValueError):
    """A run that cannot start: bad option, model or machine; the message says which."""


@dataclass(frozen=True)
class RunSetup:
    """A validated run: the options, the model config and where the weights come from."""

    options: object
    config: ModelConfig
    model_name: str
    full_random_state: bool
    cuda_graph: bool = False
    graph_widths: tuple[int, ...] = ()
    quant: QuantScheme = QuantScheme()

    @property
    def max_seq_len(self) -> int:
        """KV-cache length: the prompt plus every verify step with one step of slack, and at
        least the widest captured graph (capture writes positions 0..width-1)."""
        return needed_cache_len(self.options, self.graph_widths)

    def build_model(self, ctx: ParallelContext, device: torch.device) -> DeepseekV3ForCausalLM:
        """This rank's shard of the model, weights loaded (checkpoint or deterministic random)."""
        o = self.options
        model = DeepseekV3ForCausalLM(
            self.config, ctx, dtype=_dtype(o.dtype), device=device, max_batch=o.batch, max_seq_len=self.max_seq_len,
            quant=self.quant,
        )
        if o.checkpoint:
            load_weights(model, SafetensorsSource(o.checkpoint), ctx)
        elif self.full_random_state:
            state = quantize_state_dict(random_hf_state_dict(self.config, o.seed), self.quant)
            load_weights(model, DictSource(state, config=self.quant.checkpoint_config()), ctx)
        else:
            init_random_shards(model, o.seed, ctx)
        return model.eval()

    def build_reference(self, ctx: ParallelContext, device: torch.device):
        """The `--compare` target on this rank: an eager copy of the model, or transformers' model."""
        if self.options.compare == "eager":
            return EagerReference(self.build_model(ctx, device))
        return HuggingFaceReference(self, ctx.rank == 0)


def prepare_run(options) -> RunSetup:
    """Validate `options` and resolve the model config; raises RunError naming the problem."""
    _check_choice("backend", options.backend, BACKENDS)
    _check_choice("compare", options.compare, COMPARE_TARGETS)
    _check_choice("dtype", options.dtype, DTYPES)
    _check_choice("device", options.device, ("cpu", "cuda"))
    for name, flag in (("tp", "--tp"), ("batch", "--batch"), ("prompt_len", "--prompt-len"), ("tokens_per_step", "--tokens")):
        if getattr(options, name) < 1:
            raise RunError(f"{flag} must be at least 1 (got {getattr(options, name)})")
    if options.steps < 0:
        raise RunError(f"--steps must be >= 0 (got {options.steps})")
    if options.tokens_per_step > MAX_STEP_WIDTH:
        raise RunError(f"--tokens must be at most {MAX_STEP_WIDTH} (got {options.tokens_per_step})")
    _check_device(options.device, options.tp)
    cuda_graph, graph_widths = _graph_plan(options)
    if bool(options.checkpoint) == bool(options.preset):
        raise RunError("give exactly one of --preset NAME or --checkpoint DIR")
    if options.checkpoint:
        config, name = _checkpoint_config(options.checkpoint), os.path.abspath(options.checkpoint)
        if options.layers is not None:
            config = replace(config, num_hidden_layers=_check_layers(options.layers, config.num_hidden_layers))
    else:
        if options.preset not in PRESETS:
            raise RunError(f"unknown preset {options.preset!r}; choose one of: {', '.join(PRESETS)}")
        config, name = get_preset(options.preset, layers=options.layers), options.preset
    try:
        config.check_tensor_parallel(options.tp)
    except ValueError as exc:
        raise RunError(str(exc)) from exc
    cache_len = needed_cache_len(options, graph_widths)
    if cache_len > config.max_position_embeddings:
        raise RunError(
            f"the KV cache would need {cache_len} positions (prompt {options.prompt_len} + {options.steps} steps of "
            f"{options.tokens_per_step} tokens, or the widest CUDA graph), more than the model's "
            f"max_position_embeddings ({config.max_position_embeddings})"
        )
    full_random = not options.checkpoint and config.num_parameters() <= FULL_RANDOM_STATE_LIMIT
    if options.compare == "hf" and not (options.checkpoint or full_random):
        raise RunError(f"--compare hf needs a checkpoint or a model under {FULL_RANDOM_STATE_LIMIT:,} parameters")
    try:
        quant = weight_scheme(options, config)
        check_fits(options, config, name, quant, graph_widths, cache_len)
    except ValueError as exc:
        raise RunError(str(exc)) from exc
    return RunSetup(
        options=options, config=config, model_name=name, full_random_state=full_random,
        cuda_graph=cuda_graph, graph_widths=graph_widths, quant=quant,
    )


def needed_cache_len(options, graph_widths: tuple[int, ...]) -> int:
    """KV-cache positions a run needs: prompt, every step plus one of slack, the widest graph."""
    steps_len = options.prompt_len + (options.steps + 1) * options.tokens_per_step + 1
    return max(steps_len, max(graph_widths, default=0))


def _graph_plan(options) -> tuple[bool, tuple[int, ...]]:
    """(capture CUDA graphs?, widths to capture): on by default for cuda, refused on cpu."""
    cuda_graph = options.device == "cuda" if options.cuda_graph is None else options.cuda_graph
    if cuda_graph and options.device != "cuda":
        raise RunError("--cuda-graph needs --device cuda (CUDA graphs capture GPU work)")
    widths = tuple(sorted(set(options.graph_widths)))
    if not widths or not all(1 <= w <= MAX_STEP_WIDTH for w in widths):
        raise RunError(f"--graph-widths must be widths between 1 and {MAX_STEP_WIDTH} (got {list(options.graph_widths)})")
    return cuda_graph, widths if cuda_graph else ()


def _dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def _check_choice(what: str, value, choices) -> None:
    if value not in choices:
        raise RunError(f"unknown {what} {value!r}; choose one of: {', '.join(choices)}")


def _check_device(device: str, tp: int) -> None:
    if device != "cuda":
        return
    if not torch.cuda.is_available():
        raise RunError("--device cuda was asked for, but this machine has no CUDA GPU (use --device cpu)")
    present = torch.cuda.device_count()
    if tp > present:
        raise RunError(f"--tp {tp} needs {tp} GPUs (one process per GPU), but only {present} are present")


def _check_layers(layers: int, available: int) -> int:
    if not 1 <= layers <= available:
        raise RunError(f"--layers must be between 1 and {available} (got {layers})")
    return layers


def _checkpoint_config(directory: str) -> ModelConfig:
    if not os.path.isdir(directory):
        raise RunError(f"checkpoint directory {directory!r} does not exist")
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise RunError(f"checkpoint directory {directory!r} has no config.json")
    try:
        return ModelConfig.from_pretrained(directory)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise RunError(f"cannot read {path}: {exc}") from exc


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


class EagerReference:
    """`--compare eager`: the same weights run without compilation, step for step."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @torch.inference_mode()
    def relative_error(self, input_ids, positions, logits) -> float:
        """Error of `logits` against the eager model fed the same step."""
        device = next(self.model.parameters()).device
        expected = self.model(input_ids.to(device), positions.to(device)).float().cpu()
        return relative_error(logits, expected)


class HuggingFaceReference:
    """`--compare hf`: transformers' DeepseekV3ForCausalLM on the same weights, on rank 0 only.

    It recomputes every step from the whole token history (no cache), so it also checks our
    KV cache. Other ranks hold nothing and report None.
    """

    def __init__(self, setup: RunSetup, active: bool):
        self.model = _load_transformers_model(setup) if active else None
        o = setup.options
        self.history = torch.zeros(o.batch, setup.max_seq_len, dtype=torch.long)

    @torch.inference_mode()
    def relative_error(self, input_ids, positions, logits) -> float | None:
        """Error of `logits` against transformers over each sequence's full history."""
        self.history.scatter_(1, positions, input_ids)
        if self.model is None:
            return None
        worst = 0.0
        for b in range(input_ids.shape[0]):
            length = int(positions[b].max()) + 1
            expected = self.model(input_ids=self.history[b : b + 1, :length]).logits[0, positions[b]]
            worst = max(worst, relative_error(logits[b], expected))
        return worst


def _load_transformers_model(setup: RunSetup):
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM as HFDeepseekV3
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    o = setup.options
    kwargs = {"dtype": torch.float32, "attn_implementation": "eager"}
    if o.checkpoint:
        hf_config = DeepseekV3Config.from_pretrained(o.checkpoint)
        hf_config.num_hidden_layers = setup.config.num_hidden_layers
        return HFDeepseekV3.from_pretrained(o.checkpoint, config=hf_config, **kwargs).eval()
    with tempfile.TemporaryDirectory() as directory:
        DeepseekV3Config(**setup.config.to_hf_dict()).save_pretrained(directory)
        state = {k: v.contiguous() for k, v in random_hf_state_dict(setup.config, o.seed).items()}
        save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return HFDeepseekV3.from_pretrained(directory, **kwargs).eval()
