"""At compile time: can any fused implementation of the op ever run this site? If not, say why.

The fusion pass asks `fused_kernel_unavailable(device_type, dtype, world_size)` for each site it would
rewrite. The answer must be the same on every rank, whatever each rank's environment: a rank that
kept Inductor's all-reduce while its peers called the op would issue other collectives than they do
(a hang), and no collective may run at compile time (ranks compile at different times, and a cache
hit skips the passes on some ranks). So it uses only facts of the graph: the site's device, dtype
and the group's world size. CUDA sites whose dtype or world size no fused all-reduce kernel takes
(float32; world sizes other than 2, 4, 8 and 16) are left to Inductor, whose own code is then as good
as anything the op could run.

Everything that depends on the machine or the user (the FXFUSE_* settings, the installed FlashInfer,
the GPU arch, the topology) is decided when the op first runs, by all ranks together
(`fxfuse.op.decide.group_config`): ranks that differ get the same error, and a site where no fused kernel
runs gets the op's fallback (NCCL + the fused add-RMSNorm kernel), measured no slower than what
Inductor compiles for the unfused chain (`fxfuse bench fallback`).

On CPU the op's reference kernel (gloo) always runs: CPU sites are fused (that is how the CPU tests
and the CPU runner exercise the rewrite).
"""

from __future__ import annotations

import torch

from fxfuse.op.decide.policy import PCIE_WORLD_SIZES, SUPPORTED_DTYPES, TRTLLM_WORLD_SIZES

#: World sizes some fused all-reduce kernel runs.
FUSED_WORLD_SIZES = tuple(sorted(set(TRTLLM_WORLD_SIZES) | set(PCIE_WORLD_SIZES)))


def fused_kernel_unavailable(device_type: str, dtype: torch.dtype, world_size: int) -> str | None:
    """Why no fused all-reduce implementation can ever run a site on `device_type`; None if one may.

    Depends on its arguments only (graph facts, equal on every rank), never on this process's
    environment."""
    if device_type != "cuda":
        return None
    if dtype not in SUPPORTED_DTYPES:
        return f"{str(dtype).removeprefix('torch.')} activations: the fused all-reduce kernels take bfloat16 or float16, so Inductor keeps its own code"
    if world_size not in FUSED_WORLD_SIZES:
        return (f"world size {world_size}: no fused all-reduce kernel runs it (they run {', '.join(map(str, FUSED_WORLD_SIZES))} "
                "ranks), so Inductor keeps its own code")
    return None
