"""On the GPU, from disk: a DeepSeek-V3-format FP8 checkpoint and a Kimi-K2.5-format INT4 checkpoint
at full width (hidden 7168, the real attention, dense-MLP and expert sizes; 2 layers, one dense and
one MoE, 16 routed experts, a 8192-token vocabulary so the files stay small), written by this test
and run by `fxfuse run --checkpoint DIR --tp 1 --device cuda --backend fxfuse --weights fp8|int4
--compare eager`: loaded with the weights kept quantized, compiled with fxfuse, replayed in CUDA
graphs, and every step's logits checked against the eager model of the same weights. The FP8 checkpoint
runs with both FP8 GEMMs (FXFUSE_FP8_GEMM=w8a16, and w8a8, whose dense linears' activation
quantization Inductor then compiles from the graph's plain ops).

Kept quantized is checked by memory: the run holds two copies of the weights (the compiled model
and the eager reference), and its peak GPU memory stays below what two dequantized (bf16) copies
alone would take. Results also go to $FXFUSE_GPU_RESULTS (JSON lines) when it is set. The writer here packs INT4 with fxfuse's own `pack_int4` (the
device has no compressed-tensors; the layout is checked against compressed-tensors' compressor on
CPU, tests/test_quant_formats.py). Needs a CUDA GPU of SM 8.9+ and Triton; no FlashInfer.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import save_file

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                       reason="FP8 tensor cores need SM 8.9+"),
]

#: Logits vs the eager model of the same quantized weights, max |diff| / max |logit| over the steps: the
#: compiled bf16 model rounds differently from eager and flips near-tied MoE routing of random weights,
#: and unquantized bf16 spreads alike (`fxfuse bench model`, bf16 and FP8: 1.6e-2 to 9.2e-2,
#: bench/results/quant_20261201/; this test measured 0.074 to 0.125 on an H200). A dequantization or
#: layout error gives O(1).
LOGITS_TOLERANCE = 0.25
#: Peak memory of the run as a share of two bf16 copies of the same weights: below 1 only if kept
#: quantized (expected about 0.55 for FP8, 0.65 for INT4 experts with bf16 attention and dense layers).
MEMORY_SHARE = 0.8


def full_width_config(preset: str):
    from fxfuse.models.presets import get_preset

    return dataclasses.replace(get_preset(preset), num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=16,
                               n_group=1, topk_group=1, vocab_size=8192)


def quantized_checkpoint(config, weights: str) -> tuple[dict[str, torch.Tensor], int]:
    """(checkpoint tensors in the format's layout, bytes of the same weights in bf16)."""
    from fxfuse.models.fp8 import quantize_blocks
    from fxfuse.models.quant.int4 import pack_int4, quantize_groups
    from fxfuse.models.quant.scheme import FP8_CHECKPOINT_TENSOR, INT4_CHECKPOINT_TENSOR
    from fxfuse.models.random_weights import random_hf_state_dict

    quantized = FP8_CHECKPOINT_TENSOR if weights == "fp8" else INT4_CHECKPOINT_TENSOR
    out, bf16_bytes = {}, 0
    for name, tensor in random_hf_state_dict(config, seed=0).items():
        bf16_bytes += tensor.numel() * 2
        if not quantized.match(name):
            out[name] = tensor.to(torch.bfloat16)
        elif weights == "fp8":
            fp8, scale_inv = quantize_blocks(tensor.cuda(), (128, 128))
            out[name], out[name + "_scale_inv"] = fp8.cpu(), scale_inv.cpu()
        else:
            values, scale = quantize_groups(tensor.cuda(), 32)
            out[name + "_packed"], out[name + "_scale"] = pack_int4(values).cpu(), scale.cpu()
            out[name + "_shape"] = torch.tensor(list(tensor.shape), dtype=torch.int32)
    return out, bf16_bytes


def write_checkpoint(directory, config, weights: str) -> int:
    """Write model.safetensors + config.json (DeepSeek-V3 FP8, or Kimi-K2.5's wrapper with INT4); return bf16 bytes."""
    from fxfuse.models.quant.scheme import QuantScheme

    tensors, bf16_bytes = quantized_checkpoint(config, weights)
    scheme = QuantScheme(weights) if weights == "fp8" else QuantScheme("int4", int4_group=32)
    text = {**config.to_hf_dict(), **scheme.checkpoint_config()}
    if weights == "int4":  # Kimi-K2.5: the text model under `language_model.`, its config under text_config
        tensors = {f"language_model.{name}": t for name, t in tensors.items()}
        text = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
                **scheme.checkpoint_config()}
    directory.mkdir(parents=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(text))
    return bf16_bytes


@pytest.mark.parametrize("preset, weights, gemm", [("deepseek-v3", "fp8", "w8a16"), ("deepseek-v3", "fp8", "w8a8"),
                                                   ("kimi-k2.5", "int4", "w8a16")])
def test_quantized_checkpoint_from_disk_runs_compiled_in_cuda_graphs(tmp_path, monkeypatch, preset, weights, gemm):
    from fxfuse.cli import main
    from fxfuse.runner.quant_setup import FP8_GEMM_ENV

    monkeypatch.setenv(FP8_GEMM_ENV, gemm)

    directory = tmp_path / f"{preset}-{weights}"
    bf16_bytes = write_checkpoint(directory, full_width_config(preset), weights)
    torch.cuda.empty_cache()
    summary_path = tmp_path / "summary.json"
    argv = ["run", "--checkpoint", str(directory), "--tp", "1", "--device", "cuda", "--backend", "fxfuse",
            "--dtype", "bfloat16", "--weights", weights, "--batch", "2", "--prompt-len", "8", "--tokens", "4",
            "--steps", "3", "--graph-widths", "4", "--compare", "eager", "--json", str(summary_path)]
    assert main(argv) == 0
    summary = json.loads(summary_path.read_text())
    record = {"test": "checkpoint_from_disk", "preset": preset, "weights": weights, "gemm": gemm, "max_rel_err": summary["max_rel_err"],
              "peak_gpu_mem_gb": summary["peak_gpu_mem_gb"], "bf16_weights_gb": bf16_bytes / 1e9, "step_ms": summary["step_ms"]}
    print(json.dumps(record))
    if os.environ.get("FXFUSE_GPU_RESULTS"):
        with open(os.environ["FXFUSE_GPU_RESULTS"], "a") as f:
            f.write(json.dumps(record) + "\n")
    assert summary["weights"] == weights and summary["cuda_graph"] and summary["step_replayed"]
    assert summary["max_rel_err"] is not None and summary["max_rel_err"] <= LOGITS_TOLERANCE
    assert summary["peak_gpu_mem_gb"] * 1e9 < MEMORY_SHARE * 2 * bf16_bytes, record
