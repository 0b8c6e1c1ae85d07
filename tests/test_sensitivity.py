"""CPU tests of `fxfuse.runner.sensitivity`: the perturbation moves the tiny model's logits by a small,
reproducible amount and is gone after its block; the check's bound scales with the sensitivity."""

from __future__ import annotations

import pytest
import torch

from fxfuse.bench.output import relative_l2_error
from fxfuse.runner.sensitivity import SENSITIVITY_FACTOR, TOLERANCE, check_bound, perturbed_input
from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.presets import get_preset
from fxfuse.models.random_weights import init_random_shards


@torch.inference_mode()
def test_the_perturbation_is_small_reproducible_and_removed_after_its_block():
    config = get_preset("tiny", layers=2)
    ctx = ParallelContext()
    model = DeepseekV3ForCausalLM(config, ctx, dtype=torch.bfloat16, device="cpu", max_batch=2, max_seq_len=16).eval()
    init_random_shards(model, 0, ctx)
    ids = torch.randint(0, config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(4).expand(2, -1).contiguous()

    def logits():
        model.reset_cache()
        return model(ids, positions).float()

    plain = logits()
    with perturbed_input(model, seed=3):
        first = logits()
    with perturbed_input(model, seed=3):
        second = logits()
    with perturbed_input(model, seed=4):
        other_seed = logits()
    after = logits()
    sensitivity = relative_l2_error(first, plain)
    assert 1e-4 < sensitivity < 0.05, sensitivity  # bf16-rounding sized, not zero, not broken
    assert torch.equal(first, second) and not torch.equal(first, other_seed)
    assert torch.equal(after, plain) and not model.model.layers[0]._forward_pre_hooks


def test_the_bound_is_the_tolerance_or_a_multiple_of_the_sensitivity():
    assert check_bound(None) == TOLERANCE == check_bound(0.0) == check_bound(None, torch.float32)
    assert check_bound(0.02) == TOLERANCE  # bf16-like sensitivity: the fixed tolerance
    assert check_bound(0.104) == pytest.approx(SENSITIVITY_FACTOR * 0.104)  # w8a8 DeepSeek-V3 layers on the H200
