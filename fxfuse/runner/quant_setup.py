"""The weight format of a run (`--weights bf16|fp8|int4`) and its memory check, decided before any rank starts.

`weight_scheme(options, config)` returns the `QuantScheme` the model is built with: bf16 always works
(quantized checkpoints are dequantized on load); fp8 / int4 need a checkpoint in that format (its
block or group size is used) or random weights (quantized from random floats); the FP8 GEMM comes from
FXFUSE_FP8_GEMM ("w8a16", the default, or "w8a8"). `check_fits` builds the memory plan
(fxfuse/runner/memory_plan.py; the model on the meta device, so a quantized layout that tp cannot
split is refused here) and raises when it exceeds GPU 0's memory on CUDA, or on CPU the memory this
machine has available for all ranks together, saying what would fit. Both raise ValueError with a
message for the user.
"""

from __future__ import annotations

import json
import os

import torch

from fxfuse.models.config import ModelConfig
from fxfuse.models.quant.scheme import FP8_GEMMS, WEIGHT_FORMATS, QuantScheme, checkpoint_format
from fxfuse.op.decide.environment import env_setting
from fxfuse.runner.memory_plan import PlanInputs, device_memory_bytes, plan_memory

#: Environment variable choosing the FP8 GEMM (see models/quant/scheme.py).
FP8_GEMM_ENV = "FXFUSE_FP8_GEMM"


def weight_scheme(options, config: ModelConfig) -> QuantScheme:
    """The QuantScheme for `options.weights` (and the checkpoint's quantization, if any)."""
    weights = getattr(options, "weights", "bf16")
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weights!r}; choose one of: {', '.join(WEIGHT_FORMATS)}")
    gemm = bench_scheme("bf16").fp8_gemm
    stored = QuantScheme()
    if options.checkpoint:
        with open(os.path.join(options.checkpoint, "config.json")) as f:
            stored = checkpoint_format(json.load(f))
        if weights != "bf16" and stored.weights != weights:
            raise ValueError(f"--weights {weights} keeps the checkpoint's {weights} weights, but {options.checkpoint} is "
                             f"{stored.weights}: use --weights {stored.weights} or bf16")
    if weights != "bf16" and options.compare == "hf":
        raise ValueError("--compare hf runs transformers on unquantized weights; with --weights fp8 or int4 use --compare eager")
    return QuantScheme(weights, fp8_block=stored.fp8_block, int4_group=stored.int4_group, fp8_gemm=gemm)


def bench_scheme(weights: str) -> QuantScheme:
    """The QuantScheme of random `weights` for `fxfuse bench model` (default block / group, FXFUSE_FP8_GEMM)."""
    gemm = env_setting(FP8_GEMM_ENV) or "w8a16"
    if gemm not in FP8_GEMMS:
        raise ValueError(f"{FP8_GEMM_ENV}={gemm!r}; choose one of: {', '.join(FP8_GEMMS)}")
    return QuantScheme(weights, fp8_gemm=gemm)


def check_fits(options, config: ModelConfig, name: str, quant: QuantScheme, graph_widths: tuple[int, ...], cache_len: int,
               interconnect: str = "nvlink", host_available: int | None = None) -> None:
    """Raise ValueError if the model cannot be built this way, or (with what would fit) if the memory plan
    exceeds GPU 0's memory on CUDA, or `host_available` bytes for all ranks on CPU (unchecked if None).
    `interconnect` says which fused-op workspace to count (`fxfuse.runner.op_settings.INTERCONNECTS`)."""
    inputs = PlanInputs(
        tp=options.tp, weights=quant.weights, dtype=getattr(torch, options.dtype), batch=options.batch, context=cache_len,
        step_tokens=max(options.prompt_len, options.tokens_per_step, *graph_widths), graph_widths=graph_widths,
        fused_workspace=options.backend == "fxfuse", fp8_block=quant.fp8_block, int4_group=quant.int4_group,
        device=options.device, interconnect=interconnect, reference_copy=options.compare == "eager",
    )
    plan = plan_memory(config, inputs, name)
    available = device_memory_bytes() if options.device == "cuda" else host_available
    if available is not None:
        plan.check(available, config)
