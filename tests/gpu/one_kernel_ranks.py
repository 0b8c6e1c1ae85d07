"""Helpers of the one-kernel PCIe path's GPU tests: ranks as streams of one process, inputs, and the
two-kernel path's answer.

`StreamRanks(world_size, capacity, hidden)` gives each of `world_size` simulated ranks its own receive
buffer (torch memory of this process, set to the protocol's empty value), its own flags and its own
CUDA stream; every rank's `PeerBuffers` names every buffer, as the CUDA IPC workspace does across
processes. The kernels of the ranks then run concurrently on one GPU, as they would on eight, without
the time-slicing that ranks in separate processes sharing a GPU pay: that is what lets a test replay
100,000+ calls. Each rank's launch has at most `SMs // world_size` programs, so every rank's programs are
resident together (the kernel's rule: all programs of a call resident at once), and the process must start
with CUDA_DEVICE_MAX_CONNECTIONS above the world size, so that no two ranks' streams share a hardware queue.

`two_kernel_answer` is what the two-kernel path computes from the same inputs: the all-reduce (summed in
float32 in rank order, rounded to the dtype: what the one kernel sums; on small-integer data, exactly the
sum NCCL and FlashInfer's PCIe all-reduce give), then fxfuse's fused add-RMSNorm (+ FP8) kernel.
"""

from __future__ import annotations

import os
import zlib

import torch

from fxfuse.op.fp8_recipe import FP8_DTYPE, Fp8Limits, scale_shape
from fxfuse.op.kernels.add_rmsnorm_fp8_kernel import add_rmsnorm_fp8_into
from fxfuse.op.kernels.add_rmsnorm_kernel import add_rmsnorm_into
from fxfuse.op.kernels.one_shot_all_reduce_norm import (
    FLAG_WORDS, Epilogue, Fp8Outputs, PeerBuffers, all_reduce_norm_into, receive_buffer_bytes,
)

#: Norm variants: name -> (weight offset, weight applied in float32, float32 weight, float32 residual, residual given).
NORMS = {
    "plain": (0.0, False, False, False, True),
    "no_residual": (0.0, False, False, False, False),
    "gemma": (1.0, True, False, False, True),
    "weight_in_fp32": (0.0, True, False, False, True),
    "fp32_weight": (0.0, True, True, False, True),
    "fp32_residual": (0.0, True, False, True, True),
    "fp32_residual_gemma": (1.0, True, False, True, True),
}
EPS = 1e-6


class StreamRanks:
    """`world_size` ranks of one process, each with its receive buffer, flags and stream (module docstring)."""

    def __init__(self, world_size: int, capacity: int, hidden: int, device: str = "cuda"):
        self.world_size, self.capacity, self.hidden = world_size, capacity, hidden
        elements = receive_buffer_bytes(world_size, capacity, hidden) // 2
        self.buffers = tuple(torch.full((elements,), -1, dtype=torch.int16, device=device) for _ in range(world_size))
        self.peers = [PeerBuffers(self.buffers, torch.zeros(FLAG_WORDS, dtype=torch.int32, device=device), rank, capacity, hidden)
                      for rank in range(world_size)]
        self.streams = [torch.cuda.Stream() for _ in range(world_size)]
        self.programs = max(1, torch.cuda.get_device_properties(device).multi_processor_count // world_size)
        if int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")) <= world_size:
            raise RuntimeError("stream ranks need CUDA_DEVICE_MAX_CONNECTIONS > world size, set before CUDA starts")

    def launch(self, call) -> None:
        """`call(rank, peers, programs)` on every rank's stream, after the current stream's work; the current
        stream then waits for all of them."""
        current = torch.cuda.current_stream()
        for stream in self.streams:
            stream.wait_stream(current)
        for rank, stream in enumerate(self.streams):
            with torch.cuda.stream(stream):
                call(rank, self.peers[rank], self.programs)
        for stream in self.streams:
            current.wait_stream(stream)

    def generations(self) -> list[int]:
        """Every rank's current generation (0-2)."""
        return [int(p.flags[0]) for p in self.peers]


def rank_inputs(world_size: int, tokens: int, hidden: int, dtype, seed: int, small_integers: bool, device="cuda"):
    """(every rank's x, residual, weight): small integers (sums and norms exact in any order) or normal values."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((world_size, tokens, hidden, str(dtype), seed, small_integers)).encode()))

    def draw(*shape):
        if small_integers:
            return torch.randint(-3, 4, shape, generator=g).to(device, dtype)
        return torch.randn(*shape, generator=g).to(device, dtype)

    xs = [draw(tokens, hidden) for _ in range(world_size)]
    weight = (1 + 0.25 * torch.randint(-2, 3, (hidden,), generator=g)).to(device, dtype) if small_integers else \
        (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
    return xs, draw(tokens, hidden), weight


def summed(xs: list[torch.Tensor]) -> torch.Tensor:
    """The all-reduce the one kernel computes: float32 in rank order, rounded to the dtype."""
    total = xs[0].float()
    for x in xs[1:]:
        total = total + x.float()
    return total.to(xs[0].dtype)


def norm_arguments(norm: str, residual: torch.Tensor, weight: torch.Tensor) -> tuple:
    """(residual or None, weight, weight offset, weight in float32) of NORMS[norm]."""
    offset, in_fp32, fp32_weight, fp32_residual, with_residual = NORMS[norm]
    residual = (residual.float() if fp32_residual else residual) if with_residual else None
    return residual, weight.float() if fp32_weight else weight, offset, in_fp32


def outputs_like(x: torch.Tensor, residual: torch.Tensor | None, recipe=None) -> dict:
    """Fresh NaN-filled outputs of one call: residual_out (the residual's dtype), normed, and for `recipe` the
    e4m3 codes and scales."""
    out = {"residual_out": torch.full_like(x, float("nan"), dtype=x.dtype if residual is None else residual.dtype),
           "normed": torch.full_like(x, float("nan"))}
    if recipe is not None:
        out["quantized"] = torch.empty_like(x, dtype=FP8_DTYPE)
        out["scales"] = torch.full(scale_shape(x.shape, recipe), float("nan"), device=x.device)
    return out


def two_kernel_answer(xs, residual, weight, offset, in_fp32, recipe=None, static_scale=None, limits=Fp8Limits()) -> dict:
    """The two-kernel path's outputs for these inputs: `summed(xs)`, then fxfuse's fused norm (+ FP8) kernel."""
    reduced = summed(xs)
    out = outputs_like(reduced, residual, recipe)
    if recipe is None:
        add_rmsnorm_into(reduced, residual, weight, EPS, out["residual_out"], out["normed"], offset, in_fp32)
    else:
        add_rmsnorm_fp8_into(reduced, residual, weight, EPS, recipe, static_scale, out["residual_out"], out["normed"],
                             out["quantized"], out["scales"], offset, in_fp32, limits)
    return out


def one_kernel_call(peers, x, residual, weight, offset, in_fp32, out: dict, programs: int, recipe=None, static_scale=None,
                    limits=Fp8Limits()) -> None:
    """The one kernel's call writing `out` (as `outputs_like` made it): the norm, or the norm and FP8."""
    fp8 = None if recipe is None else Fp8Outputs(recipe, static_scale, out["quantized"], out["scales"], limits)
    all_reduce_norm_into(peers, x, Epilogue.NORM if recipe is None else Epilogue.FP8, residual, weight, EPS,
                         out["residual_out"], out["normed"], offset, in_fp32, fp8, programs)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values with NaN where NaN (e4m3 codes compared as bytes, any NaN as 0x7f)."""
    if a.dtype == FP8_DTYPE:
        a, b = (torch.where(t.float().isnan(), 0x7F, t.view(torch.uint8).int()) for t in (a, b))
        return torch.equal(a, b)
    return a.shape == b.shape and torch.equal(a.nan_to_num(12345.0), b.nan_to_num(12345.0))
