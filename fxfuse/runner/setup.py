"""Build what one rank of `fxfuse run` needs from a validated `RunSetup`: the model and its reference.

`build_model(setup, ctx, device)` is this rank's shard of the model with its weights (checkpoint, or
deterministic random weights); `build_reference(setup, ctx, device)` the `--compare` target, an
eager copy of the model or transformers' model on the same weights, whose `check` gives a step's
error and the reference's own sensitivity to rounding (the eager copy's; None for transformers). Validation happens before any
rank starts, in `fxfuse.runner.options`.
"""

from __future__ import annotations

import os
import tempfile

import torch

from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.quant.checkpoint import quantize_state_dict
from fxfuse.models.random_weights import init_random_shards, random_hf_state_dict
from fxfuse.models.weights import DictSource, SafetensorsSource, load_weights
from fxfuse.runner.options import RunSetup
from fxfuse.runner.sensitivity import perturbation, perturbed_input

#: `--dtype` names -> torch dtypes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(setup: RunSetup, ctx: ParallelContext, device: torch.device) -> DeepseekV3ForCausalLM:
    """This rank's shard of the model in the run's weight format, weights loaded (checkpoint, or
    deterministic random weights, quantized when the format asks for it)."""
    o = setup.options
    model = DeepseekV3ForCausalLM(
        setup.config, ctx, dtype=DTYPES[o.dtype], device=device, max_batch=o.batch, max_seq_len=setup.max_seq_len,
        quant=setup.quant,
    )
    if o.checkpoint:
        load_weights(model, SafetensorsSource(o.checkpoint), ctx)
    elif setup.full_random_state:
        state = quantize_state_dict(random_hf_state_dict(setup.config, o.seed), setup.quant)
        load_weights(model, DictSource(state, config=setup.quant.checkpoint_config()), ctx)
    else:
        init_random_shards(model, o.seed, ctx)
    return model.eval()


def build_reference(setup: RunSetup, ctx: ParallelContext, device: torch.device):
    """The `--compare` target on this rank: an eager copy of the model, or transformers' model."""
    if setup.options.compare == "eager":
        return EagerReference(build_model(setup, ctx, device))
    return HuggingFaceReference(setup, ctx.rank == 0)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| over the values `expected` has finite, in float64; inf when the
    two are not NaN or infinite at the same places (the compiled run broke, or mended, values)."""
    actual, expected = actual.double(), expected.double()
    finite = torch.isfinite(expected)
    if not torch.equal(finite, torch.isfinite(actual)) or not torch.equal(actual[~finite].nan_to_num(1.0),
                                                                          expected[~finite].nan_to_num(1.0)):
        return float("inf")
    if not finite.any():
        return 0.0
    return float((actual - expected)[finite].abs().max() / expected[finite].abs().max().clamp_min(1e-30))


def nonfinite(values: torch.Tensor) -> int:
    """How many of `values` are NaN or infinite."""
    return int((~torch.isfinite(values)).sum())


class EagerReference:
    """`--compare eager`: the same weights run without compilation, step for step."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.nonfinite = 0  # the most NaN or infinite logits the model itself gave in one step

    @torch.inference_mode()
    def check(self, input_ids, positions, logits) -> tuple[float, float]:
        """(error of `logits` against the eager model fed the same step, the eager model's own sensitivity
        at this step: the error of its logits when its first layer's input is perturbed by half a rounding
        step of the activations' dtype, `fxfuse.runner.sensitivity.perturbed_input`). The perturbed step runs first: the
        plain one then overwrites the KV-cache positions it wrote."""
        device = next(self.model.parameters()).device
        input_ids, positions = input_ids.to(device), positions.to(device)
        dtype = self.model.model.embed_tokens.weight.dtype  # the activations'
        with perturbed_input(self.model, size=perturbation(dtype)):
            perturbed = self.model(input_ids, positions).float().cpu()
        expected = self.model(input_ids, positions).float().cpu()
        self.nonfinite = max(self.nonfinite, nonfinite(expected))
        return relative_error(logits, expected), relative_error(perturbed, expected)


class HuggingFaceReference:
    """`--compare hf`: transformers' DeepseekV3ForCausalLM on the same weights, on rank 0 only.

    It recomputes every step from the whole token history (no cache), so it also checks our
    KV cache. Other ranks hold nothing and report None.
    """

    def __init__(self, setup: RunSetup, active: bool):
        self.model = _load_transformers_model(setup) if active else None
        self.nonfinite = 0  # the most NaN or infinite logits transformers' model gave in one step
        o = setup.options
        self.history = torch.zeros(o.batch, setup.max_seq_len, dtype=torch.long)

    @torch.inference_mode()
    def check(self, input_ids, positions, logits) -> tuple[float | None, None]:
        """(error of `logits` against transformers over each sequence's full history, None: no
        sensitivity is measured, so the check's bound is `fxfuse.runner.sensitivity.TOLERANCE`)."""
        self.history.scatter_(1, positions, input_ids)
        if self.model is None:
            return None, None
        worst = 0.0
        for b in range(input_ids.shape[0]):
            length = int(positions[b].max()) + 1
            expected = self.model(input_ids=self.history[b : b + 1, :length]).logits[0, positions[b]]
            self.nonfinite = max(self.nonfinite, nonfinite(expected))
            worst = max(worst, relative_error(logits[b], expected))
        return worst, None


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
