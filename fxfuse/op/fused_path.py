"""The FlashInfer path of `torch.ops.fxfuse.allreduce_residual_rmsnorm` on CUDA.

`try_allreduce_residual_rmsnorm(x, residual, weight, eps, group_name)` runs FlashInfer's fused
TensorRT-LLM kernel (one-shot or two-shot) and returns `(normed, residual_out)`, or returns None
when the call is not fused here, so the caller runs its NCCL fallback. Whether to fuse is
decided by `fusion_policy.decide` from values equal on all ranks; workspaces come from the
process-wide `REGISTRY` (see fxfuse/workspace.py for their lifecycle). FlashInfer is imported
only on first fused use; if it cannot load or build, every rank falls back together and one
warning says why.

A call without a residual adds the workspace's all-zero buffer: x + 0 == x exactly, so
residual_out is the plain all-reduced sum, as the op's contract says, and the same kernel runs.
Non-contiguous inputs are copied to contiguous ones. Outputs have x's shape and dtype.
Numerics: the all-reduce and the norm accumulate in fp32; the kernel multiplies by the weight in
fp32 and rounds once, where the op's reference rounds the normalized value to x's dtype first, so
`normed` can differ from the reference by one rounding step of that dtype.

Settings come from FXFUSE_FUSION / FXFUSE_MAX_TOKENS and the thresholds table from
FXFUSE_THRESHOLDS, read once per process; all ranks must see the same values (a mismatch is
detected when the workspace is created and makes every rank fall back).
"""

from __future__ import annotations

import collections
import functools
import os

import torch
import torch.distributed as dist

from fxfuse.op.policy import FusionDecision, FusionMode, FusionProblem, FusionSettings, decide, settings_from_env
from fxfuse.op.policy import unsupported_reason
from fxfuse.op.thresholds import ThresholdTable, load_thresholds
from fxfuse.op.workspace import WorkspaceRegistry, fingerprint


@functools.cache
def current_settings() -> FusionSettings:
    """This process's fusion settings, from the environment (read once)."""
    return settings_from_env(os.environ)


@functools.cache
def current_thresholds() -> ThresholdTable:
    """This process's thresholds table: default file merged with $FXFUSE_THRESHOLDS (read once)."""
    return load_thresholds()


@functools.cache
def _kernels():
    from fxfuse.op.trtllm_kernels import TrtllmFusionKernels  # no FlashInfer import until load()

    return TrtllmFusionKernels()


def _gpu_identity(device: torch.device | None = None) -> tuple[str, int]:
    """(GPU name, compute capability as an integer such as 90) of the current or given device."""
    major, minor = torch.cuda.get_device_capability(device)
    return torch.cuda.get_device_name(device), major * 10 + minor


def _config_fingerprint(group: dist.ProcessGroup, hidden_size: int, dtype: torch.dtype, max_tokens: int) -> int:
    gpu, sm = _gpu_identity()
    entry = current_thresholds().lookup(gpu, dist.get_world_size(group), hidden_size, dtype)
    return fingerprint(gpu, sm, current_settings(), entry, hidden_size, dtype, max_tokens)


#: This process's workspaces, one per (group name, hidden size, dtype). See fxfuse/workspace.py.
REGISTRY = WorkspaceRegistry(_kernels, _config_fingerprint)

#: Calls that ran the FlashInfer kernel, by (group name, mode, hidden size, dtype); and calls
#: that fell back, by reason. Counted when Python issues the call (eagerly, or once while a CUDA
#: graph is captured; graph replays are not counted). Read with `fusion_stats()`.
_FUSED_CALLS: collections.Counter = collections.Counter()
_FALLBACK_CALLS: collections.Counter = collections.Counter()


def fusion_stats() -> dict[str, dict]:
    """A snapshot of the call counters: {"fused": {(group, mode, hidden, dtype): n}, "fallback": {reason: n}}."""
    return {"fused": dict(_FUSED_CALLS), "fallback": dict(_FALLBACK_CALLS)}


def reset_fusion_stats() -> None:
    """Zero the call counters."""
    _FUSED_CALLS.clear()
    _FALLBACK_CALLS.clear()


def plan_call(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, group_name: str, settings: FusionSettings
) -> FusionDecision:
    """The decision for this call (identical on all ranks); no side effects besides reading caches."""
    group = dist.distributed_c10d._resolve_process_group(group_name)
    world_size = dist.get_world_size(group)
    gpu, sm = _gpu_identity(x.device)
    hidden_size = x.shape[-1]
    existing = REGISTRY.lookup(group_name, hidden_size, x.dtype)
    problem = FusionProblem(
        sm=sm,
        world_size=world_size,
        dtype=x.dtype,
        hidden_size=hidden_size,
        num_tokens=x.numel() // hidden_size if hidden_size else 0,
        workspace_max_tokens=existing.max_tokens if existing else settings.max_tokens,
        weight_dtype=weight.dtype,
        residual_dtype=None if residual is None else residual.dtype,
    )
    failure = REGISTRY.failure(group_name, hidden_size, x.dtype)
    if failure is not None:
        return FusionDecision(FusionMode.FALLBACK, f"workspace unavailable: {failure}")
    return decide(problem, settings, current_thresholds().lookup(gpu, world_size, hidden_size, x.dtype))


def try_allreduce_residual_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group_name: str,
    settings: FusionSettings | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Fused all-reduce(x) + residual, RMSNorm * weight on CUDA via FlashInfer, or None to fall back.

    Returns (normed, residual_out) shaped like x. `settings` replaces the process's settings for
    this call (benchmarks and tests force one-shot or two-shot this way; it must be the same on
    all ranks). Raises `fxfuse.op.workspace.WorkspaceNotPrepared` if the workspace would have to be
    created during CUDA-graph capture.
    """
    settings = settings or current_settings()
    if not x.is_cuda or x.dim() == 0 or weight.shape != x.shape[-1:]:
        _FALLBACK_CALLS["not a CUDA [..., hidden] input with a [hidden] weight"] += 1
        return None
    if residual is not None and residual.shape != x.shape:
        _FALLBACK_CALLS["residual shape differs from x"] += 1
        return None
    decision = plan_call(x, residual, weight, group_name, settings)
    if not decision.fused:
        _FALLBACK_CALLS[decision.reason] += 1
        return None
    hidden_size = x.shape[-1]
    workspace = REGISTRY.for_call(group_name, hidden_size, x.dtype, settings.max_tokens)
    if workspace is None:
        _FALLBACK_CALLS["workspace unavailable"] += 1
        return None

    x2d = x.reshape(-1, hidden_size).contiguous()
    num_tokens = x2d.shape[0]
    residual2d = workspace.zero_residual_for(num_tokens) if residual is None else residual.reshape(-1, hidden_size).contiguous()
    norm_out = torch.empty_like(x2d)
    residual_out = torch.empty_like(x2d)
    _kernels().allreduce_residual_rmsnorm(
        workspace.handle, x2d, residual2d, weight.contiguous(), eps, norm_out, residual_out,
        oneshot=decision.mode is FusionMode.ONESHOT,
    )
    _FUSED_CALLS[(group_name, decision.mode.value, hidden_size, str(x.dtype))] += 1
    return norm_out.view(x.shape), residual_out.view(x.shape)


def prepare(
    group: dist.ProcessGroup | None, hidden_size: int, dtype: torch.dtype, max_tokens: int | None = None
) -> bool:
    """Create the fused kernel's workspace for (group, hidden_size, dtype) now; True if fusion is ready.

    Collective: every rank of `group` (None: the world group) calls it with the same
    arguments, before capturing CUDA graphs that contain the fused op. `max_tokens` (default
    $FXFUSE_MAX_TOKENS or 512) bounds the token count of fused calls; larger calls fall back.
    Returns False, on every rank, when this configuration is never fused (settings, world size,
    dtype, GPU arch, alignment) or the workspace could not be created on some rank.
    """
    group = group if group is not None else dist.group.WORLD
    settings = current_settings()
    max_tokens = max_tokens or settings.max_tokens
    gpu, sm = _gpu_identity()
    problem = FusionProblem(sm, dist.get_world_size(group), dtype, hidden_size, max_tokens, max_tokens, dtype, dtype)
    if unsupported_reason(problem, settings) is not None:
        return False
    return REGISTRY.prepare(group, hidden_size, dtype, max_tokens) is not None


def destroy_workspaces(group: dist.ProcessGroup | None = None) -> None:
    """Free the fused kernel's workspaces of `group` (all if None); collective over each group.

    Call it on every rank before `dist.destroy_process_group`; workspaces not freed this way are
    dropped at interpreter exit without talking to peers.
    """
    REGISTRY.destroy(group)
