"""How far a model's logits move when its arithmetic rounds differently: the yardstick for compiled-vs-eager checks
(`fxfuse bench model`'s, and `fxfuse run --compare eager`'s verdict).

A compiled step never rounds exactly as eager does (Inductor fuses elementwise work and keeps float32
intermediates), so its logits differ from eager's by what the model does to tiny perturbations. That
is small for bf16 weights, but FP8 activations ("w8a8") turn one-step bf16 differences into e4m3 steps
and MoE routing flips: the same difference grows 5x (measured on DeepSeek-V3 layers, see
BENCHMARKS.md). `perturbed_input` perturbs the first decoder layer's input by about half a bf16 rounding
step per element; the distance of that eager run from the plain one is the model's sensitivity, and a
backend's logits pass when they are within `check_bound(sensitivity)` of eager's.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

#: Relative noise (the standard deviation) put on each element of the first decoder layer's input by the model
#: benchmark, whose models run in bf16: 2**-9, a quarter of bf16's machine epsilon.
PERTURBATION = 2.0 ** -9
#: A backend may differ from eager by this many times the model's own sensitivity...
SENSITIVITY_FACTOR = 3.0
#: ...or by this much, whichever is larger (catches broken outputs, errors of order 1), for 16-bit runs and where
#: no sensitivity was measured: in 16-bit, one rounding step can flip a MoE routing choice;
TOLERANCE = 0.1
#: in float32, where a run can tell far smaller differences, by 16 float32 rounding steps.
FLOAT32_TOLERANCE = 16 * float(torch.finfo(torch.float32).eps)


def perturbation(dtype: torch.dtype) -> float:
    """The noise `fxfuse run --compare eager` measures a run in `dtype` with: half of `dtype`'s machine epsilon
    (2**-8 for bf16, twice the model benchmark's `PERTURBATION`)."""
    return float(torch.finfo(dtype).eps) / 2


@contextlib.contextmanager
def perturbed_input(model: torch.nn.Module, seed: int = 0, size: float = PERTURBATION) -> Iterator[None]:
    """Within the block, `model` (a DeepseekV3ForCausalLM, eager) multiplies its first decoder layer's
    input by (1 + size * N(0, 1)) per element, from a generator seeded with `seed` on entry."""
    first_layer = model.model.layers[0]
    generator: torch.Generator | None = None

    def perturb(_module, inputs):
        nonlocal generator
        hidden = inputs[0]
        if generator is None:
            generator = torch.Generator(device=hidden.device).manual_seed(seed)
        noise = torch.randn(hidden.shape, generator=generator, device=hidden.device, dtype=torch.float32)
        return ((hidden.float() * (1 + size * noise)).to(hidden.dtype), *inputs[1:])

    handle = first_layer.register_forward_pre_hook(perturb)
    try:
        yield
    finally:
        handle.remove()


def tolerance(dtype: torch.dtype | None) -> float:
    """The least bound of a check of a run in `dtype` (None: a 16-bit one's)."""
    return FLOAT32_TOLERANCE if dtype == torch.float32 else TOLERANCE


def check_bound(sensitivity: float | None, dtype: torch.dtype | None = None) -> float:
    """The largest relative distance from eager's logits that a backend's logits may have: SENSITIVITY_FACTOR
    times the model's sensitivity (measured with half a rounding step of the run's dtype), at least
    `tolerance(dtype)`; TOLERANCE where no sensitivity was measured."""
    return TOLERANCE if sensitivity is None else max(tolerance(dtype), SENSITIVITY_FACTOR * sensitivity)
