"""The reference DeepSeek-V3 against transformers' DeepseekV3ForCausalLM on the same checkpoint.

A tiny random transformers model (norm weights and e_score_correction_bias perturbed so they
matter) is saved with save_pretrained and loaded into our model with the checkpoint loader at
tp=1 and tp=2 (gloo ranks). Both run the same schedule: a 2x12-token prefill, three 1-token
decode steps, then three 4-token verify steps, where row 1 first rolls back two positions
(rejected draft tokens overwritten, as in speculative decoding). transformers recomputes each
row's whole history at every step (no cache), so the comparison also checks our static cache
and position mask.

Relative error of a step = max |ours - transformers| / max |transformers| over its logits.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM as HFDeepseekV3
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

from fxfuse.runner.launch import run_on_ranks
from fxfuse.models.config import ModelConfig
from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.presets import PRESETS, get_preset
from fxfuse.models.rope import inverse_frequencies
from fxfuse.models.weights import SafetensorsSource, load_weights

BATCH, PROMPT_LEN, MAX_SEQ_LEN = 2, 12, 32
FP32_TOLERANCE = 1e-4
VARIANTS = {
    "q_lora": get_preset("tiny"),
    "no_q_lora": replace(get_preset("tiny"), q_lora_rank=None),
    "tied_embeddings": replace(get_preset("tiny"), tie_word_embeddings=True),
}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())


def step_schedule(vocab_size: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, positions) [B, T] per step: prefill, 3 decode steps, 3 verify steps with a rollback."""
    generator = torch.Generator().manual_seed(seed)
    next_position = [PROMPT_LEN, PROMPT_LEN]
    steps = [(torch.randint(vocab_size, (BATCH, PROMPT_LEN), generator=generator), torch.arange(PROMPT_LEN).expand(BATCH, -1))]
    for step, width in enumerate([1, 1, 1, 4, 4, 4]):
        if step == 3:
            next_position[1] -= 2  # row 1 rejected its last two tokens: overwrite them
        positions = torch.stack([torch.arange(p, p + width) for p in next_position])
        next_position = [p + width for p in next_position]
        steps.append((torch.randint(vocab_size, (BATCH, width), generator=generator), positions))
    return steps


def save_transformers_checkpoint(directory, config: ModelConfig, seed: int = 0) -> HFDeepseekV3:
    """Save a random transformers model of `config` (norms/bias perturbed) to `directory`; return it."""
    torch.manual_seed(seed)
    hf_config = DeepseekV3Config(**config.to_hf_dict())
    hf_config._attn_implementation = "eager"
    model = HFDeepseekV3(hf_config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn_like(buffer))
    model.save_pretrained(directory)
    return model


@torch.inference_mode()
def transformers_logits(model: HFDeepseekV3, schedule) -> list[torch.Tensor]:
    """transformers' logits for every step, each row recomputed from its full token history."""
    history = torch.zeros(BATCH, MAX_SEQ_LEN, dtype=torch.long)
    results = []
    for input_ids, positions in schedule:
        history.scatter_(1, positions, input_ids)
        rows = []
        for b in range(BATCH):
            length = int(positions[b].max()) + 1
            rows.append(model(input_ids=history[b : b + 1, :length]).logits[0, positions[b]])
        results.append(torch.stack(rows))
    return results


@torch.inference_mode()
def run_schedule(ctx: ParallelContext, directory, schedule, dtype=torch.float32, expert_impl="auto") -> list[torch.Tensor]:
    """Load the checkpoint at `directory` on this rank and return our logits for every step."""
    config = ModelConfig.from_pretrained(directory)
    model = DeepseekV3ForCausalLM(
        config, ctx, dtype=dtype, device="cpu", max_batch=BATCH, max_seq_len=MAX_SEQ_LEN, expert_impl=expert_impl
    )
    load_weights(model, SafetensorsSource(directory), ctx)
    return [model(input_ids, positions) for input_ids, positions in schedule]


def run_every_variant(ctx: ParallelContext, cases) -> dict[str, list[torch.Tensor]]:
    """`run_schedule` for each (variant name, directory, schedule) on this rank (one spawn for all)."""
    return {name: run_schedule(ctx, directory, schedule) for name, directory, schedule in cases}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per variant: (checkpoint directory, step schedule, transformers' logits per step)."""
    cases = {}
    for name, config in VARIANTS.items():
        directory = tmp_path_factory.mktemp(name)
        model = save_transformers_checkpoint(directory, config)
        schedule = step_schedule(config.vocab_size)
        cases[name] = (directory, schedule, transformers_logits(model, schedule))
    return cases


def assert_close_to_transformers(ours: list[torch.Tensor], theirs: list[torch.Tensor], tolerance: float) -> None:
    assert len(ours) == len(theirs)
    for step, (actual, expected) in enumerate(zip(ours, theirs)):
        assert actual.dtype == torch.float32 and actual.shape == expected.shape
        error = relative_error(actual, expected)
        assert error <= tolerance, f"step {step}: relative error {error:.3g} > {tolerance}"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.slow
def test_matches_transformers_at_tp1(checkpoints, variant):
    directory, schedule, expected = checkpoints[variant]
    assert_close_to_transformers(run_schedule(ParallelContext(), directory, schedule), expected, FP32_TOLERANCE)


@pytest.mark.slow
def test_matches_transformers_at_tp2(checkpoints):
    cases = [(name, directory, schedule) for name, (directory, schedule, _) in checkpoints.items()]
    rank0, rank1 = run_on_ranks(run_every_variant, 2, cases)
    for name, (_, _, expected) in checkpoints.items():
        assert_close_to_transformers(rank0[name], expected, FP32_TOLERANCE)
        for ours0, ours1 in zip(rank0[name], rank1[name]):
            assert torch.equal(ours0, ours1), "ranks disagree on the gathered logits"


def grouped_mm_runs_on_cpu() -> bool:
    """Whether this torch build runs torch._grouped_mm eagerly on CPU (2.13 does, for fp32 and bf16)."""
    try:
        torch._grouped_mm(torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


needs_cpu_grouped_mm = pytest.mark.skipif(not grouped_mm_runs_on_cpu(), reason="no eager torch._grouped_mm on CPU")


@needs_cpu_grouped_mm
@pytest.mark.slow
def test_grouped_mm_experts_match_transformers(checkpoints):
    """The sorted-token grouped-GEMM expert path (the CUDA bf16 kernel's math) in fp32 on CPU."""
    directory, schedule, expected = checkpoints["q_lora"]
    ours = run_schedule(ParallelContext(), directory, schedule, expert_impl="grouped_mm")
    assert_close_to_transformers(ours, expected, FP32_TOLERANCE)


@pytest.mark.parametrize(
    "dtype, expert_impl, tolerance",
    [
        (torch.bfloat16, "dense", 3e-2),
        pytest.param(torch.bfloat16, "grouped_mm", 3e-2, marks=needs_cpu_grouped_mm),
        (torch.float16, "dense", 1e-2),
    ],
)
@pytest.mark.slow
def test_low_precision_tracks_transformers_fp32(checkpoints, dtype, expert_impl, tolerance):
    """bf16 / fp16 runs stay near transformers' fp32 logits (seen: bf16 ~1.2e-2, fp16 ~1.5e-3)."""
    directory, schedule, expected = checkpoints["q_lora"]
    ours = run_schedule(ParallelContext(), directory, schedule, dtype=dtype, expert_impl=expert_impl)
    assert_close_to_transformers(ours, expected, tolerance)


@pytest.mark.parametrize("preset", PRESETS)
def test_rope_and_softmax_scale_equal_transformers(preset):
    config = get_preset(preset)
    hf_config = DeepseekV3Config(**config.to_hf_dict())
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    assert torch.equal(inverse_frequencies(config), inv_freq)
    assert config.rope_scaling.cos_sin_factor() == attention_factor
    assert config.softmax_scale == yarn_apply_mscale(hf_config.rope_parameters, config.qk_head_dim**-0.5)
