"""End to end on CPU: a tp=2 model keeping FP8 (DeepSeek-V3 layout) or INT4 (Kimi-K2.5 layout, written by
compressed-tensors) weights quantized, run through the quantized ops' CPU path, against transformers'
DeepseekV3ForCausalLM on the dequantized weights: prefill logits within 1e-4 relative, float32.

The INT4 reference weights are dequantized with compressed-tensors' own unpacking (times the scales in
float32). transformers 5.24 with compressed-tensors 0.20.1 does not apply the INT4 scheme to
DeepseekV3's experts itself (they are fused 3-D parameters, not Linear modules: it reports applying the
config to no module), so transformers gets the dequantized checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from quant_helpers import FP8, INT4, TINY_ALIGNED, ct_dequantized, float_state, fp8_checkpoint, fp8_dequantized, int4_checkpoint, save_checkpoint
from fxfuse.runner.launch import run_on_ranks

TOLERANCE = 1e-4


def _logits_on_rank(ctx, directories, input_ids):
    """Rank body: for each (directory, format), our model keeping that format, prefill logits (as numpy)."""
    from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
    from fxfuse.models.quant.scheme import QuantScheme
    from fxfuse.models.weights import SafetensorsSource, load_weights

    batch, length = input_ids.shape
    out = {}
    for fmt, (directory, scheme) in directories.items():
        model = DeepseekV3ForCausalLM(TINY_ALIGNED, ctx, dtype=torch.float32, max_batch=batch, max_seq_len=length, quant=scheme)
        with SafetensorsSource(directory) as source:
            load_weights(model, source, ctx)
        kept = {p.dtype for p in model.parameters()} & {torch.float8_e4m3fn, torch.int32}
        assert kept, f"{fmt}: nothing kept quantized"
        assert isinstance(scheme, QuantScheme)
        with torch.no_grad():
            out[fmt] = model(input_ids, torch.arange(length).expand(batch, length)).numpy()
    return out


def _transformers_logits(directory, tensors, input_ids):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    directory.mkdir()
    DeepseekV3Config(**TINY_ALIGNED.to_hf_dict()).save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors", metadata={"format": "pt"})
    model = DeepseekV3ForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids).logits.float()


@pytest.mark.slow
def test_quantized_tp2_matches_transformers_on_dequantized_weights(tmp_path):
    state = float_state(seed=3)
    fp8, int4 = fp8_checkpoint(state), int4_checkpoint(state)
    save_checkpoint(tmp_path / "fp8", fp8, FP8)
    save_checkpoint(tmp_path / "int4", int4, INT4)
    input_ids = torch.randint(0, TINY_ALIGNED.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    ours = run_on_ranks(_logits_on_rank, 2, {"fp8": (tmp_path / "fp8", FP8), "int4": (tmp_path / "int4", INT4)}, input_ids)
    expected = {"fp8": _transformers_logits(tmp_path / "fp8-hf", fp8_dequantized(fp8), input_ids),
                "int4": _transformers_logits(tmp_path / "int4-hf", ct_dequantized(int4), input_ids)}
    for rank in ours:
        for fmt, logits in rank.items():
            logits = torch.from_numpy(logits)
            assert logits.shape == expected[fmt].shape
            error = float((logits - expected[fmt]).abs().max() / expected[fmt].abs().max())
            assert error <= TOLERANCE, f"{fmt}: relative error {error:.3g}"
