"""How each implementation of the fused op runs a call on CUDA: the plans, and the call counters.

A plan is made once per call shape (`fxfuse.op.runtime.planning`) and called for every call of it:
- `TrtllmPlan`: FlashInfer's TensorRT-LLM kernel, one-shot or two-shot (one launch);
- `PciePlan`: FlashInfer's PCIe IPC all-reduce, then the fused add-RMSNorm kernel;
- `PcieOneKernelPlan`: fxfuse's one-shot all-reduce over CUDA IPC with the add-RMSNorm (+ FP8) in the same
  launch (`fxfuse.op.kernels.one_shot_all_reduce_norm`);
- `NcclPlan`: the group's all-reduce (`_c10d_functional.all_reduce_`, as Inductor issues it), then the
  fused add-RMSNorm kernel. When the caller donated `x` (the op's `donate_x` overloads, which the
  backend emits where Inductor can prove `x` is dead), the all-reduce runs in x's memory unless the
  residual or weight shares it; otherwise on a copy.
Each has an `fp8` form for the FP8 variant, whose quantization (`Fp8Epilogue`) runs in the kernel after
the all-reduce, and an `all_reduce` form for the all-reduce-only op of tier (b)
(`fxfuse.op.all_reduce_schema`): the same all-reduce with nothing after it (FlashInfer's TensorRT-LLM
kernel with its kAllReduce pattern). Inputs that are not 16-byte aligned or contiguous are copied first:
a copy is the same on every rank, where falling back on one rank only would hang the others. Calls are counted per plan
(`fusion_stats`).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxfuse.op.decide.modes import FusionMode
from fxfuse.op.decide.policy import FusionDecision
from fxfuse.op.fp8_recipe import FP8_DTYPE, Fp8Limits, Fp8Recipe, scale_shape
from fxfuse.op.kernels.add_rmsnorm_fp8_kernel import add_rmsnorm_fp8_into, quantize_fp8_into
from fxfuse.op.kernels.add_rmsnorm_kernel import add_rmsnorm_into
from fxfuse.op.kernels.native_fallback import all_reduce_calls, calls_by_reason, reset_counts
from fxfuse.op.kernels.one_shot_all_reduce_norm import Epilogue, Fp8Outputs
from fxfuse.op.reference import writable_in_place
from fxfuse.op.runtime.workspace import ONE_KERNEL, PCIE, TRTLLM, FusionWorkspace

ALL_REDUCE_ = torch.ops._c10d_functional.all_reduce_.default
WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
KERNEL_ALIGNMENT = 16

#: Calls by implementation: {(group, mode, hidden, dtype): n} for fused ones and {reason: n} for the
#: rest. Counted when Python issues the call (eagerly, or once while a CUDA graph is captured; graph
#: replays are not counted). Read with `fusion_stats()`.
_FUSED_CALLS: collections.Counter = collections.Counter()
_FALLBACK_CALLS: collections.Counter = collections.Counter()
#: Calls of the all-reduce-only op, by {(group, mode, hidden, dtype): n}, every implementation.
_ALL_REDUCE_CALLS: collections.Counter = collections.Counter()

#: How the plain op applies its weight: (weight offset, weight in float32) = transformers' order.
PLAIN_NORM = (0.0, False)


def fusion_stats() -> dict[str, dict]:
    """A snapshot of the call counters: {"fused": {(group, mode, hidden, dtype): n}, "fallback": {reason: n}}
    for the fused ops (fallback calls the C++ path ran included), and "all_reduce": {(group, mode, hidden,
    dtype): n} for the all-reduce-only op (mode "fallback" for NCCL)."""
    return {"fused": dict(_FUSED_CALLS), "fallback": dict(_FALLBACK_CALLS + calls_by_reason()),
            "all_reduce": dict(_ALL_REDUCE_CALLS + all_reduce_calls())}


def reset_fusion_stats() -> None:
    """Zero the call counters."""
    for counter in (_FUSED_CALLS, _FALLBACK_CALLS, _ALL_REDUCE_CALLS):
        counter.clear()
    reset_counts()


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` if it is contiguous and 16-byte aligned, else a fresh contiguous copy (which is)."""
    if t.is_contiguous() and t.data_ptr() % KERNEL_ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


@dataclass
class CallPlan:
    """How every call of one key runs; `decision` says which implementation and why."""

    group: dist.ProcessGroup
    decision: FusionDecision
    #: Whether the plan serves the all-reduce-only op (its calls are counted apart).
    only_all_reduce: bool = field(default=False, kw_only=True)
    #: The group's name, read once (the kernels pass it on every call).
    group_name: str = field(init=False)
    #: (counter, key) this plan's calls are counted under, made on the first call (a plan serves one
    #: hidden size and dtype).
    _tally: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.group_name = self.group.group_name

    def count(self, hidden: int, dtype: torch.dtype) -> None:
        """Count one call of this plan (see fusion_stats)."""
        tally = self._tally
        if tally is None:
            if self.only_all_reduce:
                tally = (_ALL_REDUCE_CALLS, (self.group_name, self.decision.mode.value, hidden, str(dtype)))
            elif self.decision.fused:
                tally = (_FUSED_CALLS, (self.group_name, self.decision.mode.value, hidden, str(dtype)))
            else:
                tally = (_FALLBACK_CALLS, self.decision.reason)
            self._tally = tally
        tally[0][tally[1]] += 1


@dataclass(frozen=True)
class Fp8Epilogue:
    """The FP8 quantization a call of `allreduce_residual_rmsnorm_fp8` adds after the norm."""

    recipe: Fp8Recipe
    static_scale: torch.Tensor | None
    return_normed: bool
    limits: Fp8Limits = Fp8Limits()

    def run(self, reduced, residual, weight, eps, residual_out, norm: tuple) -> tuple:
        """The add, norm (`norm`: weight offset, weight in float32) and quantization of all-reduced
        `reduced` in one kernel: (quantized, scales, residual_out, normed or an empty tensor)."""
        quantized, scales, normed = self.outputs(reduced)
        add_rmsnorm_fp8_into(reduced, None if residual is None else aligned(residual), aligned(weight), eps, self.recipe,
                             self.static_scale, residual_out, normed if self.return_normed else None, quantized, scales, *norm,
                             limits=self.limits)
        return quantized, scales, residual_out, normed

    def quantize(self, normed) -> tuple:
        """(quantized, scales, normed or an empty tensor) of an already normed output."""
        quantized, scales, _ = self.outputs(normed)
        quantize_fp8_into(normed, self.recipe, self.static_scale, quantized, scales, self.limits)
        return quantized, scales, normed if self.return_normed else normed.new_empty(0)

    def outputs(self, like: torch.Tensor) -> tuple:
        """Fresh (quantized, scales, normed) buffers for rows shaped like `like` (normed empty unless returned)."""
        return (torch.empty_like(like, dtype=FP8_DTYPE), like.new_empty(scale_shape(like.shape, self.recipe), dtype=torch.float32),
                torch.empty_like(like) if self.return_normed else like.new_empty(0))


@dataclass
class NcclPlan(CallPlan):
    """The group's all-reduce (in x's memory when donated), then the fused add-RMSNorm kernel (with the
    FP8 quantization, for the FP8 variant).

    Works on the tensors in their own shape (no reshapes or views: each costs microseconds of host
    time per call, and this runs at every site of every uncaptured step)."""

    def __call__(self, x, residual, weight, eps, x_donated, norm: tuple = PLAIN_NORM):
        reduced, residual_out = self._all_reduce(x, residual, weight, x_donated)
        normed = torch.empty_like(reduced)
        add_rmsnorm_into(reduced, None if residual is None else aligned(residual), aligned(weight), eps, residual_out, normed,
                         *norm)
        self.count(x.shape[-1], x.dtype)
        return normed, residual_out

    def fp8(self, x, residual, weight, eps, x_donated, epilogue: Fp8Epilogue, norm: tuple = PLAIN_NORM):
        reduced, residual_out = self._all_reduce(x, residual, weight, x_donated)
        self.count(x.shape[-1], x.dtype)
        return epilogue.run(reduced, residual, weight, eps, residual_out, norm)

    def all_reduce(self, x, in_place: bool):
        """The all-reduce-only op: Inductor's own calls (`all_reduce_` and `wait_tensor`) on `x` itself
        (`in_place`: the caller owns x) or on a contiguous copy; returns the reduced tensor."""
        target = x if in_place and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
        ALL_REDUCE_(target, "sum", self.group_name)
        WAIT_TENSOR(target)
        if in_place and target is not x:
            x.copy_(target)
        self.count(x.shape[-1], x.dtype)
        return x if in_place else target

    def _all_reduce(self, x, residual, weight, x_donated):
        """(the all-reduced x, the buffer residual_out goes to: a fresh one when x's own memory was reduced
        or the residual has another dtype)."""
        donated_in_place = writable_in_place(x, x_donated, residual, weight) and x.data_ptr() % KERNEL_ALIGNMENT == 0
        reduced = x if donated_in_place else x.clone(memory_format=torch.contiguous_format)
        ALL_REDUCE_(reduced, "sum", self.group_name)
        WAIT_TENSOR(reduced)
        if residual is not None and residual.dtype != reduced.dtype:
            return reduced, torch.empty_like(reduced, dtype=residual.dtype)
        return reduced, torch.empty_like(reduced) if donated_in_place else reduced


@dataclass
class TrtllmPlan(CallPlan):
    """FlashInfer's TensorRT-LLM kernel: all-reduce, residual add and RMSNorm in one launch (the FP8
    variant then quantizes its norm output in one more kernel: FlashInfer's own FP8 patterns, static and
    (0.7.x) dynamic per token, multiply the norm by an approximate reciprocal of the scale, which rounds
    some values to another code than the unfused code's division or reciprocal; docs/FP8.md)."""

    workspace: FusionWorkspace | None = None

    def __call__(self, x, residual, weight, eps, x_donated, norm: tuple = PLAIN_NORM):
        hidden = x.shape[-1]
        x2d = aligned(x.reshape(-1, hidden))
        handle = self.workspace.handle
        residual2d = handle.zero_residual_for(x2d.shape[0]) if residual is None else aligned(residual.reshape(-1, hidden))
        normed, residual_out = torch.empty_like(x2d), torch.empty_like(x2d)
        TRTLLM.note_use(self.workspace)
        TRTLLM.kernels.allreduce_residual_rmsnorm(
            handle, x2d, residual2d, aligned(weight), eps, normed, residual_out,
            oneshot=self.decision.mode is FusionMode.ONESHOT, weight_offset=norm[0],
        )
        self.count(hidden, x.dtype)
        return normed.view(x.shape), residual_out.view(x.shape)

    def all_reduce(self, x, in_place: bool):
        """The all-reduce-only op: the kernel's kAllReduce pattern, into `x` itself when `in_place` (the kernel
        reads each input element once, in the thread that then writes that output element, before it
        writes: FlashInfer 0.6.3-0.7.x, one-shot and two-shot) and x is contiguous and aligned, else into a
        fresh buffer (copied into `x` when `in_place`); returns the reduced tensor."""
        x2d = aligned(x.reshape(-1, x.shape[-1]))
        direct = in_place and x2d.data_ptr() == x.data_ptr() and x.is_contiguous()
        reduced = x2d if direct else torch.empty_like(x2d)
        TRTLLM.note_use(self.workspace)
        TRTLLM.kernels.all_reduce(self.workspace.handle, x2d, reduced, oneshot=self.decision.mode is FusionMode.ONESHOT)
        self.count(x.shape[-1], x.dtype)
        return x if direct else copied_back(x, reduced, in_place)

    def fp8(self, x, residual, weight, eps, x_donated, epilogue: Fp8Epilogue, norm: tuple = PLAIN_NORM):
        normed, residual_out = self(x, residual, weight, eps, x_donated, norm)
        quantized, scales, normed = epilogue.quantize(normed)
        return quantized, scales, residual_out, normed


@dataclass
class PciePlan(CallPlan):
    """FlashInfer's PCIe IPC all-reduce into a fresh buffer, then the fused add-RMSNorm kernel (with the
    FP8 quantization, for the FP8 variant) in it."""

    workspace: FusionWorkspace | None = None

    def __call__(self, x, residual, weight, eps, x_donated, norm: tuple = PLAIN_NORM):
        reduced, residual2d = self._all_reduce(x, residual)
        normed, residual_out = torch.empty_like(reduced), residual_out_buffer(reduced, residual2d)
        add_rmsnorm_into(reduced, residual2d, aligned(weight), eps, residual_out, normed, *norm)
        self.count(x.shape[-1], x.dtype)
        return normed.view(x.shape), residual_out.view(x.shape)

    def fp8(self, x, residual, weight, eps, x_donated, epilogue: Fp8Epilogue, norm: tuple = PLAIN_NORM):
        reduced, residual2d = self._all_reduce(x, residual)
        self.count(x.shape[-1], x.dtype)
        return fp8_results_shaped_like(x, *epilogue.run(reduced, residual2d, weight, eps,
                                                        residual_out_buffer(reduced, residual2d), norm))

    def all_reduce(self, x, in_place: bool):
        """The all-reduce-only op: the PCIe all-reduce into a fresh buffer (copied into `x` when `in_place`);
        returns the reduced tensor."""
        reduced, _ = self._all_reduce(x, None)
        self.count(x.shape[-1], x.dtype)
        return copied_back(x, reduced, in_place)

    def _all_reduce(self, x, residual):
        """(x all-reduced over the group into a fresh [tokens, hidden] buffer, the residual as [tokens, hidden])."""
        x2d, residual2d = as_rows(x, residual)
        reduced = torch.empty_like(x2d)
        PCIE.note_use(self.workspace)
        PCIE.kernels.all_reduce(self.workspace.handle, x2d, reduced)
        return reduced, residual2d


@dataclass
class PcieOneKernelPlan(CallPlan):
    """The one-kernel PCIe path: the all-reduce and the add-RMSNorm (+ FP8) in one launch, into fresh buffers."""

    workspace: FusionWorkspace | None = None

    def __call__(self, x, residual, weight, eps, x_donated, norm: tuple = PLAIN_NORM):
        x2d, residual2d = as_rows(x, residual)
        normed, residual_out = torch.empty_like(x2d), self._residual_out(x2d, residual2d)
        self._run(x2d, Epilogue.NORM, residual=residual2d, weight=aligned(weight), eps=eps, residual_out=residual_out,
                  normed=normed, weight_offset=norm[0], weight_in_fp32=norm[1])
        self.count(x.shape[-1], x.dtype)
        return normed.view(x.shape), residual_out.view(x.shape)

    def fp8(self, x, residual, weight, eps, x_donated, epilogue: Fp8Epilogue, norm: tuple = PLAIN_NORM):
        x2d, residual2d = as_rows(x, residual)
        quantized, scales, normed = epilogue.outputs(x2d)
        residual_out = self._residual_out(x2d, residual2d)
        self._run(x2d, Epilogue.FP8, residual=residual2d, weight=aligned(weight), eps=eps, residual_out=residual_out,
                  normed=normed if epilogue.return_normed else None, weight_offset=norm[0], weight_in_fp32=norm[1],
                  fp8=Fp8Outputs(epilogue.recipe, epilogue.static_scale, quantized, scales, epilogue.limits))
        self.count(x.shape[-1], x.dtype)
        return fp8_results_shaped_like(x, quantized, scales, residual_out, normed)

    def all_reduce(self, x, in_place: bool):
        """The all-reduce-only op: the kernel with no epilogue into a fresh buffer (copied into `x` when `in_place`)."""
        x2d, _ = as_rows(x, None)
        reduced = torch.empty_like(x2d)
        self._run(x2d, Epilogue.ALL_REDUCE, normed=reduced)
        self.count(x.shape[-1], x.dtype)
        return copied_back(x, reduced, in_place)

    @staticmethod
    def _residual_out(x2d, residual2d):
        return torch.empty_like(x2d, dtype=x2d.dtype if residual2d is None else residual2d.dtype)

    def _run(self, x2d, epilogue: Epilogue, **arguments) -> None:
        ONE_KERNEL.note_use(self.workspace)
        ONE_KERNEL.kernels.run(self.workspace.handle, x2d, epilogue, **arguments)


def as_rows(x: torch.Tensor, residual: torch.Tensor | None) -> tuple:
    """(x, residual or None) as contiguous, aligned [tokens, hidden] tensors, what the PCIe kernels take."""
    hidden = x.shape[-1]
    return aligned(x.reshape(-1, hidden)), None if residual is None else aligned(residual.reshape(-1, hidden))


def fp8_results_shaped_like(x: torch.Tensor, quantized, scales, residual_out, normed) -> tuple:
    """The FP8 variant's results of a call on [tokens, hidden] rows, viewed in x's shape (scales per row in x's
    leading shape; empty scales or normed, which nothing reads, as they are)."""
    shape = x.shape
    return (quantized.view(shape), scales.view(*shape[:-1], -1) if scales.numel() else scales, residual_out.view(shape),
            normed.view(shape) if normed.numel() else normed)


def copied_back(x: torch.Tensor, reduced: torch.Tensor, in_place: bool) -> torch.Tensor:
    """The all-reduce-only op's result from a [tokens, hidden] buffer: written into `x` (`in_place`) or
    viewed in x's shape."""
    if in_place:
        x.copy_(reduced.view(x.shape))
        return x
    return reduced.view(x.shape)


def residual_out_buffer(reduced: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """Where residual_out goes after an out-of-place all-reduce: the reduced buffer itself, or a fresh
    one of the residual's dtype when that differs (a float32 residual stream)."""
    if residual is not None and residual.dtype != reduced.dtype:
        return torch.empty_like(reduced, dtype=residual.dtype)
    return reduced
