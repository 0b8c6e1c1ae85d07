"""The fused op's C++ fallback, Python side: what it is told (shapes, compiled norm kernels) and counts.

Outside CUDA graphs every call of the fused op costs host time, and the NCCL fallback in Python
(`fxfuse.op.runtime.plans.NcclPlan`) costs more than the unfused all-reduce + norm Inductor compiles: the
dispatcher's conversion into a Python kernel, the plan lookup, and a Python-to-C++ crossing for each
tensor operation. `fxfuse.op.runtime.registration.install_native_fallback()` (called by `fxfuse.prepare` and by
the backend when it compiles a graph with fused sites on CUDA) builds `native_fallback.cpp`
(`fxfuse.op.kernels.native_build`) and makes its kernel the public overloads' CUDA kernel; this module holds
what the C++ path is told and counts:
- shapes Python decided to run as the NCCL fallback (`register_shape`, called by
  `fxfuse.op.runtime.cuda_dispatch` when it makes an `NcclPlan`) run in C++: the all-reduce, wait, allocations and
  alignment copies, then the Triton add-RMSNorm kernel, launched from C++ once its compiled kernel
  is registered (`offer_norm_kernel`, called when the kernel is first compiled), else through
  `fxfuse::add_rmsnorm_into`;
- every other call goes to `fxfuse::allreduce_residual_rmsnorm_planned`, the Python kernel that
  decides, makes plans and runs FlashInfer's kernels, as before;
- the all-reduce-only ops (`fxfuse.op.all_reduce_schema`) likewise: shapes registered with
  `register_all_reduce_shape` issue Inductor's `all_reduce_` and `wait_tensor` from C++, others go to
  `fxfuse::all_reduce_planned` / `all_reduce_planned_`.
Both compute the same values with the same kernels. Calls the C++ path runs are counted in C++ and
reported by `fusion_stats` under the reason of the plan they came from.
"""

from __future__ import annotations

import collections

import torch

from fxfuse.op.kernels.triton_launch import driver_launch, launch_hooks_installed

#: Reason of each fused-op shape registered with the C++ path, by its counter's index.
_REASONS: dict[int, str] = {}
#: Key of each all-reduce-only shape registered with the C++ path, by its counter's index: (group, "fallback",
#: hidden, dtype), as `fxfuse.op.runtime.plans.fusion_stats` counts them.
_ALL_REDUCE_KEYS: dict[int, tuple] = {}
#: Whether the C++ kernel serves the public overloads' CUDA calls ([] until installed).
_INSTALLED: list[bool] = []
#: Compiled add-RMSNorm kernels offered so far, by their key (registered with C++ once installed).
_NORM_KERNELS: dict[tuple, tuple] = {}


def native_installed() -> bool:
    """Whether the C++ kernel serves the fused op's CUDA calls in this process."""
    return bool(_INSTALLED) and _INSTALLED[0]


def installation_decided() -> bool:
    """Whether this process already tried to install the C++ kernel (`fxfuse.op.runtime.registration.install_native_fallback`)."""
    return bool(_INSTALLED)


def record_installation(installed: bool) -> None:
    """Note the outcome of the one installation attempt; once installed, the add-RMSNorm kernels
    compiled so far are registered with the C++ path."""
    _INSTALLED.append(installed)
    if installed:
        for key, (compiled, parameter_types) in _NORM_KERNELS.items():
            _register_norm_kernel(key, compiled, parameter_types)


def register_shape(group_name: str, tokens: int, hidden: int, dtype, weight_dtype, residual_dtype, reason: str) -> None:
    """Tell the C++ path that calls of this shape run the NCCL fallback (Python decided so, for `reason`)."""
    index = torch.ops.fxfuse_native.register_nccl(group_name, tokens, hidden, dtype, weight_dtype, residual_dtype)
    _REASONS[index] = reason


def register_all_reduce_shape(group_name: str, tokens: int, hidden: int, dtype) -> None:
    """Tell the C++ path that all-reduce-only calls of this shape run NCCL (Python decided so)."""
    index = torch.ops.fxfuse_native.register_all_reduce(group_name, tokens, hidden, dtype)
    _ALL_REDUCE_KEYS[index] = (group_name, "fallback", hidden, str(dtype))


def offer_norm_kernel(key: tuple, compiled, parameter_types: list[str]) -> None:
    """A newly compiled add-RMSNorm kernel (`fxfuse.op.kernels.add_rmsnorm_kernel`'s `key`: device, hidden,
    has residual, the five tensors' dtypes, weight offset, weight in float32): the C++ path launches it
    itself from now on (or from its installation on) if it is the plain norm (weight in the dtype, no
    offset, x's dtype throughout: what the C++ path allocates and runs), and its launch is the plain
    one (`triton_launch.driver_launch` with `parameter_types`). Not while a profiler's Triton launch
    hooks are installed: those launches must stay visible to it."""
    _NORM_KERNELS[key] = (compiled, parameter_types)
    if native_installed():
        _register_norm_kernel(key, compiled, parameter_types)


def _register_norm_kernel(key: tuple, compiled, parameter_types: list[str]) -> None:
    device, hidden, has_residual, x_dtype, residual_dtype, weight_dtype, out_dtype, normed_dtype, offset, weight_in_fp32 = key
    plain = not offset and not weight_in_fp32 and residual_dtype == x_dtype  # the only norm the C++ path runs
    if not plain or out_dtype != x_dtype or normed_dtype != x_dtype or launch_hooks_installed():
        return
    launch = driver_launch(compiled, parameter_types)
    if launch is not None:
        torch.ops.fxfuse_native.register_norm_launch(device, hidden, x_dtype, weight_dtype,
                                                     residual_dtype if has_residual else None, *launch)


def forget_shapes(group_name: str | None) -> None:
    """Drop the registered shapes of `group_name` (all if None): their next call goes through Python again."""
    if _REASONS or _ALL_REDUCE_KEYS:
        torch.ops.fxfuse_native.forget(group_name)


def calls_by_reason() -> collections.Counter:
    """Fused-op calls the C++ path ran, by the reason of the fallback they came from."""
    return _counted(_REASONS)


def all_reduce_calls() -> collections.Counter:
    """All-reduce-only calls the C++ path ran, by (group, "fallback", hidden, dtype)."""
    return _counted(_ALL_REDUCE_KEYS)


def _counted(keys: dict[int, object]) -> collections.Counter:
    """The C++ call counters of the registrations in `keys` (index -> what to count them under)."""
    counts: collections.Counter = collections.Counter()
    if keys:
        for index, calls in enumerate(torch.ops.fxfuse_native.call_counts()):
            if calls and index in keys:
                counts[keys[index]] += calls
    return counts


def reset_counts() -> None:
    """Zero the C++ path's call counters."""
    if _REASONS or _ALL_REDUCE_KEYS:
        torch.ops.fxfuse_native.reset_counts()
