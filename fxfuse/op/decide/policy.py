"""Pure decision table: which implementation one fused-op call runs on CUDA.

`decide(problem, settings, entry)` returns a `FusionDecision` (a `FusionMode` and a sentence saying
why) from values that are equal on every rank of a tensor-parallel group: GPU arch, the agreed
topology, the agreed FlashInfer version's features, world size, dtypes, hidden size, token count,
the capacities of the group's workspaces, the thresholds-table entry and the settings. It never
looks at per-rank state (rank, device index, whether a library imported here), so every rank takes
the same branch and no rank waits in a collective that the others skipped. It has no side effects
and needs neither CUDA nor FlashInfer.

The table, in order:
1. settings off, or no tokens: NCCL all-reduce + the fused add-RMSNorm kernel (`FALLBACK`);
2. a forced implementation (`FXFUSE_FUSION=oneshot|twoshot|pcie|pcie_one_kernel`) wherever it can run at all;
3. a thresholds-table entry for this GPU / topology / world size / hidden / dtype: its mode for the
   token count (measured, so it may pick the TensorRT-LLM kernel off NVSwitch, e.g. SM 12.x PCIe);
4. otherwise: the TensorRT-LLM kernel (one-shot or two-shot by FlashInfer's heuristic) when every
   pair of GPUs is linked through NVSwitch and FlashInfer builds it for the arch; FlashInfer's PCIe
   all-reduce + the fused norm when the group is PCIe-only and FlashInfer >= 0.7.2; else FALLBACK.
A chosen implementation also needs room in its workspace; otherwise the other TensorRT-LLM
algorithm, else FALLBACK. The one-kernel PCIe path (`PCIE_ONE_KERNEL`: fxfuse's own one-shot all-reduce with
the norm in the same launch) runs only where it is forced or a thresholds entry (`fxfuse tune pcie`) chose it
for the token count; where it cannot run the call (world size, dtype, width, or more tokens than its
workspace holds), the PCIe two-kernel path runs instead, else FALLBACK.

The limits are those of FlashInfer's kernels (`include/flashinfer/comm/trtllm_allreduce_fusion.cuh`,
`flashinfer/comm/trtllm_ar.py`, `flashinfer/comm/pcie_ipc_ar.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxfuse.op.decide.flashinfer_version import FlashInferFeatures
from fxfuse.op.decide.modes import FusionMode
from fxfuse.op.decide.settings import FusionSettings
from fxfuse.op.decide.thresholds import ThresholdEntry
from fxfuse.op.decide.topology import Topology

#: World sizes the TensorRT-LLM fusion kernel is instantiated for.
TRTLLM_WORLD_SIZES = (2, 4, 8, 16)
#: World sizes FlashInfer's PCIe IPC all-reduce supports.
PCIE_WORLD_SIZES = (2, 4, 8)
#: Activation dtypes the fused implementations take (the kernels' fp32 variants need other layouts).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
#: The kernels move 16 bytes per access: a token's row must be a multiple of 16 bytes.
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
#: The kernel addresses a Lamport buffer at `clear_offset * comm_size` in 32-bit arithmetic, with
#: clear_offset up to 2: comm_size (world_size * tokens * hidden * 2 bytes) must stay below 1 GiB.
MAX_LAMPORT_COMM_BYTES = (2**31 - 1) // 2
#: FlashInfer's own one-shot heuristic (`_use_oneshot_heuristics`, measured on B200): one-shot while
#: tokens * hidden * 2 * world_size * itemsize stays within this many MiB.
FLASHINFER_ONESHOT_MAX_MIB = {2: 512, 4: 64, 8: 42}
#: The kernel's own one-shot token limit, used for world sizes that heuristic does not list.
KERNEL_ONESHOT_MAX_TOKENS = 128
#: World sizes the one-kernel PCIe path is tested at (its receive buffers hold one slot per rank).
ONE_KERNEL_WORLD_SIZES = (2, 4, 8)
#: Widest row the one-kernel path takes: one program sums a row over every rank in registers.
ONE_KERNEL_MAX_HIDDEN = 16384


@dataclass(frozen=True)
class FusionProblem:
    """One call's shape and the group it runs on, as every rank of the group sees it.

    `sm` is the compute capability as an integer (90 for 9.0). `residual_dtype` is None when the call
    has no residual. `weight_offset` is added to the norm weight in float32 (Gemma's `1 + weight`).
    `trtllm_max_tokens` / `pcie_max_tokens` / `one_kernel_max_tokens` are the token capacities of the group's
    TensorRT-LLM, PCIe and one-kernel PCIe workspaces for this hidden size and dtype (0: none, or creation failed).
    """

    sm: int
    world_size: int
    dtype: torch.dtype
    hidden_size: int
    num_tokens: int
    weight_dtype: torch.dtype
    residual_dtype: torch.dtype | None
    topology: Topology
    flashinfer: FlashInferFeatures
    trtllm_max_tokens: int = 0
    pcie_max_tokens: int = 0
    weight_offset: float = 0.0
    one_kernel_max_tokens: int = 0


@dataclass(frozen=True)
class FusionDecision:
    """The chosen mode and a sentence saying why."""

    mode: FusionMode
    reason: str

    @property
    def fused(self) -> bool:
        """True when a fused all-reduce runs (FlashInfer's TensorRT-LLM one-shot / two-shot or PCIe, or the one kernel)."""
        return self.mode is not FusionMode.FALLBACK


def _common_unsupported(problem: FusionProblem) -> str | None:
    """Limits every fused all-reduce shares: the activations' dtype and 16-byte rows (the norm after the
    PCIe all-reduce is fxfuse's own kernel, which takes a float32 residual or weight too)."""
    if problem.dtype not in SUPPORTED_DTYPES:
        return f"dtype {problem.dtype} not supported (bfloat16 or float16)"
    elems_per_access = KERNEL_ACCESS_BYTES // problem.dtype.itemsize
    if problem.hidden_size % elems_per_access:
        return f"hidden size {problem.hidden_size} is not a multiple of {elems_per_access} elements (16 bytes)"
    return None


def trtllm_unsupported(problem: FusionProblem) -> str | None:
    """Why FlashInfer's TensorRT-LLM kernel can never run this configuration (any token count); None if it can."""
    if not problem.flashinfer.trtllm:
        return f"TensorRT-LLM kernel unavailable: {problem.flashinfer.why_not}"
    if not problem.flashinfer.trtllm_arch_supported(problem.sm):
        needs = "0.6.17" if problem.sm // 10 == 12 else "a build for it"
        return f"GPU arch sm_{problem.sm} not supported by flashinfer {problem.flashinfer.version} (needs {needs})"
    if problem.world_size not in TRTLLM_WORLD_SIZES:
        return f"world size {problem.world_size} not supported (kernel runs on {TRTLLM_WORLD_SIZES})"
    reason = _common_unsupported(problem)
    if reason is not None:
        return reason
    if problem.weight_dtype != problem.dtype:
        return f"norm weight dtype {problem.weight_dtype} differs from activations ({problem.dtype})"
    if problem.residual_dtype is not None and problem.residual_dtype != problem.dtype:
        return f"residual dtype {problem.residual_dtype} differs from activations ({problem.dtype})"
    if problem.weight_offset and not problem.flashinfer.trtllm_weight_bias:
        return f"the norm weight's offset {problem.weight_offset:g} needs flashinfer 0.7.2 (weight_bias), not {problem.flashinfer.version}"
    accesses = problem.hidden_size // (KERNEL_ACCESS_BYTES // problem.dtype.itemsize)
    if accesses > MAX_ACCESSES_PER_TOKEN:
        return f"hidden size {problem.hidden_size} too large for the kernel's launch shape"
    threads = kernel_threads_per_block(accesses)
    if threads % WARP_SIZE:
        return (
            f"hidden size {problem.hidden_size} gives {threads}-thread blocks; the kernel's norm reduction "
            f"needs whole warps of {WARP_SIZE}"
        )
    return None


def pcie_unsupported(problem: FusionProblem) -> str | None:
    """Why FlashInfer's PCIe IPC all-reduce can never run this configuration; None if it can."""
    if not problem.flashinfer.pcie:
        why = problem.flashinfer.why_not or f"flashinfer {problem.flashinfer.version} is older than 0.7.2"
        return f"PCIe all-reduce unavailable: {why}"
    if problem.world_size not in PCIE_WORLD_SIZES:
        return f"world size {problem.world_size} not supported by the PCIe all-reduce ({PCIE_WORLD_SIZES})"
    return _common_unsupported(problem)


def one_kernel_unsupported(problem: FusionProblem) -> str | None:
    """Why the one-kernel PCIe path can never run this configuration; None if it can (it needs no FlashInfer)."""
    if problem.world_size not in ONE_KERNEL_WORLD_SIZES:
        return f"world size {problem.world_size} not supported by the one-kernel path ({ONE_KERNEL_WORLD_SIZES})"
    if problem.hidden_size > ONE_KERNEL_MAX_HIDDEN:
        return f"hidden size {problem.hidden_size} is wider than the one-kernel path's {ONE_KERNEL_MAX_HIDDEN}"
    return _common_unsupported(problem)


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


def trtllm_token_cap(world_size: int, hidden_size: int) -> int:
    """Most tokens a TensorRT-LLM workspace may hold: its Lamport exchange (world_size * tokens * hidden
    * 2 bytes) must stay below 1 GiB, or the kernel's 32-bit buffer offsets wrap (tp=8, hidden 7168:
    9362 tokens)."""
    return MAX_LAMPORT_COMM_BYTES // (world_size * hidden_size * 2)


def feasible_trtllm_modes(problem: FusionProblem) -> tuple[FusionMode, ...]:
    """The TensorRT-LLM algorithms that can run this token count in the group's workspace (one-shot first)."""
    if not 1 <= problem.num_tokens <= problem.trtllm_max_tokens:
        return ()
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


def _run_trtllm(problem: FusionProblem, wanted: FusionMode, why: str) -> FusionDecision:
    """`wanted` (one-shot or two-shot) if it fits; else the other algorithm if it fits; else fallback."""
    reason = trtllm_unsupported(problem)
    if reason is not None:
        return FusionDecision(FusionMode.FALLBACK, f"{why}, but {reason}")
    feasible = feasible_trtllm_modes(problem)
    if wanted in feasible:
        return FusionDecision(wanted, why)
    if feasible:
        return FusionDecision(feasible[0], f"{why} chose {wanted.value}, which cannot run here; using {feasible[0].value}")
    return FusionDecision(
        FusionMode.FALLBACK,
        f"{why}: {problem.num_tokens} tokens do not fit the TensorRT-LLM workspace ({problem.trtllm_max_tokens} tokens)",
    )


def _run_pcie(problem: FusionProblem, why: str) -> FusionDecision:
    """The PCIe all-reduce if it can run and the tokens fit its workspace, else fallback."""
    reason = pcie_unsupported(problem)
    if reason is not None:
        return FusionDecision(FusionMode.FALLBACK, f"{why}, but {reason}")
    if not 1 <= problem.num_tokens <= problem.pcie_max_tokens:
        return FusionDecision(
            FusionMode.FALLBACK,
            f"{why}: {problem.num_tokens} tokens do not fit the PCIe workspace ({problem.pcie_max_tokens} tokens)",
        )
    return FusionDecision(FusionMode.PCIE, why)


def _run_one_kernel(problem: FusionProblem, why: str) -> FusionDecision:
    """The one-kernel PCIe path if it can run and the tokens fit its workspace, else the PCIe two-kernel path
    (else fallback)."""
    reason = one_kernel_unsupported(problem)
    if reason is None and not 1 <= problem.num_tokens <= problem.one_kernel_max_tokens:
        reason = f"{problem.num_tokens} tokens do not fit its workspace ({problem.one_kernel_max_tokens} tokens)"
    if reason is None:
        return FusionDecision(FusionMode.PCIE_ONE_KERNEL, why)
    return _run_pcie(problem, f"{why} chose the one kernel, which cannot run here ({reason}); the PCIe two-kernel path")


def preferred_implementation(problem: FusionProblem, settings: FusionSettings, entry: ThresholdEntry | None) -> tuple[FusionMode, str]:
    """What the table wants for this problem before workspace capacity is considered, and why."""
    if not settings.enabled:
        return FusionMode.FALLBACK, "fusion disabled by settings"
    if problem.num_tokens < 1:
        return FusionMode.FALLBACK, "no tokens"
    if settings.force_mode is not None:
        return settings.force_mode, "forced by settings"
    if entry is not None:
        wanted, why = entry.mode_for(problem.num_tokens), f"thresholds table ({entry.source or 'no source'})"
        if wanted is FusionMode.FALLBACK:
            return wanted, f"{why}: unfused is faster at {problem.num_tokens} tokens"
        return wanted, why
    if problem.topology is Topology.NVSWITCH and trtllm_unsupported(problem) is None:
        oneshot = flashinfer_prefers_oneshot(problem)
        return (FusionMode.ONESHOT if oneshot else FusionMode.TWOSHOT), "NVSwitch group: FlashInfer heuristic"
    if problem.topology is Topology.PCIE and pcie_unsupported(problem) is None:
        return FusionMode.PCIE, "PCIe group"
    return FusionMode.FALLBACK, _why_unfused_by_default(problem)


def _why_unfused_by_default(problem: FusionProblem) -> str:
    if problem.world_size == 1:
        return "a one-rank group: no fused all-reduce applies"
    if problem.topology is Topology.NVSWITCH:
        return f"NVSwitch group, but {trtllm_unsupported(problem)}"
    if problem.topology is Topology.PCIE:
        return f"PCIe group, but {pcie_unsupported(problem)}"
    if problem.topology is Topology.NVLINK:
        return "NVLink-bridge group (no NVSwitch): the TensorRT-LLM kernel is slower than NCCL there unless measured"
    return "no peer-to-peer topology (ranks on several hosts or GPUs, or unknown)"


def decide(problem: FusionProblem, settings: FusionSettings, entry: ThresholdEntry | None = None) -> FusionDecision:
    """Choose the implementation for `problem` (see the module docstring for the table)."""
    wanted, why = preferred_implementation(problem, settings, entry)
    if wanted is FusionMode.FALLBACK:
        return FusionDecision(FusionMode.FALLBACK, why)
    if wanted is FusionMode.PCIE:
        return _run_pcie(problem, why)
    if wanted is FusionMode.PCIE_ONE_KERNEL:
        return _run_one_kernel(problem, why)
    return _run_trtllm(problem, wanted, why)
