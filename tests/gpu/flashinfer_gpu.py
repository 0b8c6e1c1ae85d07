"""Skip markers shared by the GPU tests, and their common input helpers.

- `CUDA_GPU_MARKS`: a CUDA GPU (the fallback kernel and the one-rank NCCL tests need nothing else);
- `FLASHINFER_GPU_MARKS`: also flashinfer-python, on an arch its TensorRT-LLM fusion kernel is built for;
- `PCIE_GPU_MARKS`: also flashinfer-python >= 0.7.2 (its PCIe IPC all-reduce).
"""

import zlib

import pytest
import torch

from fxfuse.op.flashinfer_version import installed_features

_FEATURES = installed_features()
_SM = torch.cuda.get_device_capability()[0] * 10 + torch.cuda.get_device_capability()[1] if torch.cuda.is_available() else 0

CUDA_GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)"),
]
FLASHINFER_GPU_MARKS = CUDA_GPU_MARKS + [
    pytest.mark.skipif(not _FEATURES.trtllm, reason=f"needs flashinfer-python 0.6.3 to 0.7.x ({_FEATURES.why_not})"),
    pytest.mark.skipif(
        torch.cuda.is_available() and not _FEATURES.trtllm_arch_supported(_SM),
        reason=f"FlashInfer {_FEATURES.version} builds its all-reduce fusion kernel for SM 9.x/10.x (12.x from 0.6.17) only",
    ),
]
PCIE_GPU_MARKS = CUDA_GPU_MARKS + [
    pytest.mark.skipif(not _FEATURES.pcie, reason=f"needs flashinfer-python >= 0.7.2 for its PCIe all-reduce ({_FEATURES.version})"),
]
EPS = 1e-6


def inputs(rank: int, world_size: int, tokens: int, seed: int, device, hidden: int, dtype=torch.bfloat16):
    """(this rank's x, every rank's x, residual, weight): deterministic, the same on every rank."""
    def randn(*shape, salt):
        g = torch.Generator().manual_seed(zlib.crc32(repr((seed, tokens, hidden, salt)).encode()))
        return torch.randn(*shape, generator=g).to(device, dtype)

    xs = [randn(tokens, hidden, salt=r) for r in range(world_size)]
    weight = (1 + 0.1 * randn(hidden, salt="w").float()).to(dtype)
    return xs[rank].clone(), xs, randn(tokens, hidden, salt="res"), weight


def reference(xs, residual, weight):
    """fp32 all-reduce + residual add + RMSNorm * weight."""
    residual_out = torch.stack([x.float() for x in xs]).sum(0)
    if residual is not None:
        residual_out = residual_out + residual.float()
    normed = residual_out * torch.rsqrt(residual_out.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
    return normed, residual_out


def rel_errs(out, ref) -> tuple[float, float]:
    """Relative L2 errors of (normed, residual_out) against the fp32 reference."""
    return tuple(((o.float().reshape(r.shape) - r).norm() / r.norm()).item() for o, r in zip(out, ref))


def fused_calls() -> dict:
    """{mode: calls} of the fused op's fused implementations so far in this process."""
    from fxfuse.op.cuda_dispatch import fusion_stats

    counts: dict = {}
    for (_, mode, _, _), n in fusion_stats()["fused"].items():
        counts[mode] = counts.get(mode, 0) + n
    return counts
