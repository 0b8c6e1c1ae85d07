"""At compile time: can any fused implementation of the op ever run for this site? If not, say why.

The fusion pass asks `fused_kernel_unavailable(device_type, dtype, world_size)` for each site it
would rewrite. On CUDA, when no fused all-reduce can run (FlashInfer missing or outside the supported
versions, a dtype or world size none of its kernels takes, a GPU arch it does not build for, or
`FXFUSE_FUSION=off`), replacing the site would only swap Inductor's own all-reduce + add-RMSNorm code
for the op's fallback, so the site is left to Inductor: the simplest way never to lose. The answer
uses only local facts that are the same on every rank of a sanely set-up job (installed FlashInfer
version, GPU arch, settings, the site's dtype and world size) and never runs a collective: ranks may
compile at different times. `fxfuse.prepare` checks that the ranks agree on those facts.

On CPU the op's reference kernel (gloo) always runs: CPU sites are fused (that is how the CPU tests
and the CPU runner exercise the rewrite).
"""

from __future__ import annotations

import torch

from fxfuse.op.flashinfer_version import installed_features
from fxfuse.op.policy import PCIE_WORLD_SIZES, SUPPORTED_DTYPES, TRTLLM_WORLD_SIZES
from fxfuse.op.settings import current_settings


def fused_kernel_unavailable(device_type: str, dtype: torch.dtype, world_size: int) -> str | None:
    """Why no fused all-reduce implementation can ever run a site on `device_type`; None if one may."""
    if device_type != "cuda":
        return None
    if not current_settings().enabled:
        return "FXFUSE_FUSION=off: no fused all-reduce runs, so Inductor keeps its own code"
    features = installed_features()
    if not (features.trtllm or features.pcie):
        return f"no fused all-reduce kernel on this machine ({features.why_not}), so Inductor keeps its own code"
    if dtype not in SUPPORTED_DTYPES:
        return f"{str(dtype).removeprefix('torch.')} activations: the fused all-reduce kernels take bfloat16 or float16"
    sm = _sm()
    trtllm_arch = sm is not None and features.trtllm_arch_supported(sm)
    trtllm = trtllm_arch and world_size in TRTLLM_WORLD_SIZES
    pcie = features.pcie and world_size in PCIE_WORLD_SIZES
    if not (trtllm or pcie):
        return (f"world size {world_size} on this GPU: no fused all-reduce kernel of flashinfer {features.version} "
                "runs it, so Inductor keeps its own code")
    return None


def _sm() -> int | None:
    """This process's GPU arch as an integer (90 for 9.0), None without a GPU (fake CUDA tensors)."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor
