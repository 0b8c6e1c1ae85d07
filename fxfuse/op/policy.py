"""Pure decision: fused one-shot, fused two-shot, or fall back to NCCL all-reduce + add + RMSNorm.

`decide(problem, settings, entry)` looks only at values that are equal on every rank of a
tensor-parallel group: GPU arch, world size, dtypes, hidden size, token count, workspace size,
the thresholds-table entry and the settings. It never looks at per-rank state (rank, device
index, whether a library imported), so every rank takes the same branch and no rank waits in a
collective that the others skipped. It has no side effects and needs neither CUDA nor FlashInfer.

The limits below are those of FlashInfer's TensorRT-LLM fusion kernel
(`include/flashinfer/comm/trtllm_allreduce_fusion.cuh`, `flashinfer/comm/trtllm_ar.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from fxfuse.op.modes import FusionMode
from fxfuse.op.thresholds import ThresholdEntry


#: World sizes the fusion kernel is instantiated for.
SUPPORTED_WORLD_SIZES = (2, 4, 8, 16)
#: Activation dtypes fxfuse fuses (the kernel's fp32 variant needs another workspace layout).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
#: The kernel moves 16 bytes per access: the hidden size must be a multiple of 16 bytes.
KERNEL_ACCESS_BYTES = 16
#: One token is handled by at most a cluster of 8 blocks of 1024 threads, one access each.
MAX_ACCESSES_PER_TOKEN = 8 * 1024
#: Largest thread-block cluster the kernel launches (the portable maximum on Hopper and Blackwell).
MAX_CLUSTER_SIZE = 8
#: The kernel grows blocks to at least this many threads before it stops shrinking the cluster.
MIN_THREADS_PER_BLOCK = 128
#: The kernel's RMSNorm block reduction (FlashInfer <= 0.6.x) assumes every warp is full.
WARP_SIZE = 32
#: Largest one-shot (Lamport) exchange FlashInfer accepts: INT32_MAX rounded down to 2 MiB.
MAX_ONESHOT_COMM_BYTES = 2147483647 & ~((1 << 21) - 1)
#: FlashInfer's own one-shot heuristic (`_use_oneshot_heuristics`, measured on B200): one-shot while
#: tokens * hidden * 2 * world_size * itemsize stays within this many MiB.
FLASHINFER_ONESHOT_MAX_MIB = {2: 512, 4: 64, 8: 42}
#: The kernel's own one-shot token limit, used for world sizes that heuristic does not list.
KERNEL_ONESHOT_MAX_TOKENS = 128
#: Workspace size (tokens) when a workspace is created implicitly on first call.
DEFAULT_MAX_TOKENS = 512


@dataclass(frozen=True)
class FusionSettings:
    """User choices that steer the decision; they must be identical on all ranks.

    `enabled` False always falls back. `force_mode` (one-shot or two-shot) overrides the
    thresholds table and FlashInfer's heuristic where that algorithm can run. `max_tokens` sizes
    a workspace created implicitly on first call. `supported_sm_majors` lists the GPU
    architecture generations (compute capability majors) FlashInfer builds this kernel for.
    """

    enabled: bool = True
    force_mode: FusionMode | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    supported_sm_majors: tuple[int, ...] = (9, 10)

    def __post_init__(self) -> None:
        if self.force_mode is FusionMode.FALLBACK:
            raise ValueError("force_mode must be oneshot or twoshot; use enabled=False to always fall back")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")


#: Environment variables read by `settings_from_env`.
ENV_FUSION = "FXFUSE_FUSION"  # auto (default) | oneshot | twoshot | off
ENV_MAX_TOKENS = "FXFUSE_MAX_TOKENS"  # workspace size for implicit creation


def settings_from_env(environ: Mapping[str, str]) -> FusionSettings:
    """Settings from `FXFUSE_FUSION` (auto|oneshot|twoshot|off) and `FXFUSE_MAX_TOKENS`.

    Raises ValueError naming the variable when a value is not understood.
    """
    fusion = environ.get(ENV_FUSION, "auto").strip().lower()
    if fusion not in ("auto", "oneshot", "twoshot", "off"):
        raise ValueError(f"{ENV_FUSION}={fusion!r}: expected auto, oneshot, twoshot or off")
    raw_tokens = environ.get(ENV_MAX_TOKENS, str(DEFAULT_MAX_TOKENS))
    try:
        max_tokens = int(raw_tokens)
    except ValueError:
        raise ValueError(f"{ENV_MAX_TOKENS}={raw_tokens!r}: expected a positive integer") from None
    if max_tokens < 1:
        raise ValueError(f"{ENV_MAX_TOKENS}={raw_tokens!r}: expected a positive integer")
    return FusionSettings(
        enabled=fusion != "off",
        force_mode=FusionMode(fusion) if fusion in ("oneshot", "twoshot") else None,
        max_tokens=max_tokens,
    )


@dataclass(frozen=True)
class FusionProblem:
    """One call's shape, as every rank of the group sees it.

    `sm` is the compute capability as an integer (90 for 9.0). `residual_dtype` is None when the
    call has no residual. `workspace_max_tokens` is the token capacity of the group's workspace.
    """

    sm: int
    world_size: int
    dtype: torch.dtype
    hidden_size: int
    num_tokens: int
    workspace_max_tokens: int
    weight_dtype: torch.dtype
    residual_dtype: torch.dtype | None


@dataclass(frozen=True)
class FusionDecision:
    """The chosen mode and a sentence saying why."""

    mode: FusionMode
    reason: str

    @property
    def fused(self) -> bool:
        """True when the fused kernel runs (one-shot or two-shot)."""
        return self.mode is not FusionMode.FALLBACK


def unsupported_reason(problem: FusionProblem, settings: FusionSettings) -> str | None:
    """Why this configuration can never be fused, ignoring the token count; None if it can."""
    if not settings.enabled:
        return "fusion disabled by settings"
    if problem.world_size not in SUPPORTED_WORLD_SIZES:
        return f"world size {problem.world_size} not supported (kernel runs on {SUPPORTED_WORLD_SIZES})"
    if problem.dtype not in SUPPORTED_DTYPES:
        return f"dtype {problem.dtype} not supported (bfloat16 or float16)"
    if problem.weight_dtype != problem.dtype:
        return f"norm weight dtype {problem.weight_dtype} differs from activations ({problem.dtype})"
    if problem.residual_dtype is not None and problem.residual_dtype != problem.dtype:
        return f"residual dtype {problem.residual_dtype} differs from activations ({problem.dtype})"
    if problem.sm // 10 not in settings.supported_sm_majors:
        return f"GPU arch sm_{problem.sm} not supported (needs compute capability major in {settings.supported_sm_majors})"
    elems_per_access = KERNEL_ACCESS_BYTES // problem.dtype.itemsize
    if problem.hidden_size % elems_per_access:
        return f"hidden size {problem.hidden_size} is not a multiple of {elems_per_access} elements (16 bytes)"
    if problem.hidden_size // elems_per_access > MAX_ACCESSES_PER_TOKEN:
        return f"hidden size {problem.hidden_size} too large for the kernel's launch shape"
    threads = kernel_threads_per_block(problem.hidden_size // elems_per_access)
    if threads % WARP_SIZE:
        return (
            f"hidden size {problem.hidden_size} gives {threads}-thread blocks; the kernel's norm reduction "
            f"needs whole warps of {WARP_SIZE}"
        )
    return None


def kernel_threads_per_block(accesses_per_token: int) -> int:
    """Threads per block of the fusion kernel's launch for one token of `accesses_per_token` accesses.

    Mirrors the kernel's launch shape: the largest power-of-two cluster (<= 8 blocks) that divides
    the token's accesses, then fewer, larger blocks until a block has at least 128 threads.
    """
    cluster = MAX_CLUSTER_SIZE
    while accesses_per_token % cluster and cluster > 1:
        cluster //= 2
    threads = accesses_per_token // cluster
    while threads < MIN_THREADS_PER_BLOCK and cluster >= 2:
        threads, cluster = threads * 2, cluster // 2
    return threads


def feasible_modes(problem: FusionProblem) -> tuple[FusionMode, ...]:
    """The fused algorithms the kernel can run for this token count (one-shot first)."""
    modes = []
    comm_bytes = problem.num_tokens * problem.hidden_size * problem.dtype.itemsize * problem.world_size
    if comm_bytes <= MAX_ONESHOT_COMM_BYTES:
        modes.append(FusionMode.ONESHOT)
    if problem.num_tokens > problem.world_size:  # two-shot splits tokens across ranks
        modes.append(FusionMode.TWOSHOT)
    return tuple(modes)


def flashinfer_prefers_oneshot(problem: FusionProblem) -> bool:
    """FlashInfer's default choice between one-shot and two-shot for this problem."""
    limit_mib = FLASHINFER_ONESHOT_MAX_MIB.get(problem.world_size)
    if limit_mib is None:
        return problem.num_tokens <= KERNEL_ONESHOT_MAX_TOKENS
    comm_mib = problem.num_tokens * problem.hidden_size * 2 * problem.world_size * problem.dtype.itemsize / 2**20
    return comm_mib <= limit_mib


def decide(
    problem: FusionProblem, settings: FusionSettings, entry: ThresholdEntry | None = None
) -> FusionDecision:
    """Choose one-shot, two-shot or fallback for `problem`.

    Order: configuration limits (settings, world size, dtypes, arch, alignment), then the token
    count against the workspace, then the preferred mode (forced by settings, else the thresholds
    table entry for this GPU/world size/hidden/dtype, else FlashInfer's heuristic), finally
    whether that mode can run at this token count (otherwise the other fused mode, if it can).
    """
    reason = unsupported_reason(problem, settings)
    if reason is not None:
        return FusionDecision(FusionMode.FALLBACK, reason)
    if problem.num_tokens < 1:
        return FusionDecision(FusionMode.FALLBACK, "no tokens")
    if problem.num_tokens > problem.workspace_max_tokens:
        return FusionDecision(
            FusionMode.FALLBACK,
            f"{problem.num_tokens} tokens exceed the workspace ({problem.workspace_max_tokens} tokens)",
        )
    feasible = feasible_modes(problem)
    if not feasible:
        return FusionDecision(FusionMode.FALLBACK, f"no fused algorithm runs {problem.num_tokens} tokens")

    if settings.force_mode is not None:
        wanted, why = settings.force_mode, "forced by settings"
    elif entry is not None:
        wanted, why = entry.mode_for(problem.num_tokens), f"thresholds table ({entry.source or 'no source'})"
        if wanted is FusionMode.FALLBACK:
            return FusionDecision(FusionMode.FALLBACK, f"{why}: unfused is faster at {problem.num_tokens} tokens")
    else:
        oneshot = flashinfer_prefers_oneshot(problem)
        wanted, why = (FusionMode.ONESHOT if oneshot else FusionMode.TWOSHOT), "FlashInfer heuristic"

    if wanted in feasible:
        return FusionDecision(wanted, why)
    return FusionDecision(feasible[0], f"{why} chose {wanted.value}, which cannot run here; using {feasible[0].value}")
