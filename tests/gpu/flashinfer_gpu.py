"""Skip markers shared by the GPU tests, and their common input helpers.

- `CUDA_GPU_MARKS`: a CUDA GPU (the fallback kernel and the one-rank NCCL tests need nothing else);
- `FLASHINFER_GPU_MARKS`: also flashinfer-python, on an arch its TensorRT-LLM fusion kernel is built for;
- `PCIE_GPU_MARKS`: also flashinfer-python >= 0.7.2 (its PCIe IPC all-reduce); `NEEDS_PCIE` is that last
  condition alone, for a test of a module whose other tests need less.
The norm variants (issue 24) every path is checked with: `NORM_VARIANTS`, `variant_arguments` and
`trtllm_takes`. `build_flashinfer_kernels` JIT-builds FlashInfer's kernels in the test process, before ranks
are spawned; `DeviceMemoryPeak` samples the GPU's used memory while they run.
"""

import importlib
import threading
import time
import zlib

import pytest
import torch

from fxfuse.op.decide.flashinfer_version import installed_features

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
NEEDS_PCIE = pytest.mark.skipif(not _FEATURES.pcie, reason=f"needs flashinfer-python >= 0.7.2 for its PCIe all-reduce ({_FEATURES.version})")
PCIE_GPU_MARKS = CUDA_GPU_MARKS + [NEEDS_PCIE]
EPS = 1e-6
#: The norm variants: (weight offset, weight applied in float32, float32 weight, float32 residual) per name.
NORM_VARIANTS = {
    "gemma": (1.0, True, False, False),
    "weight_in_fp32": (0.0, True, False, False),
    "fp32_weight": (0.0, True, True, False),
    "fp32_residual": (0.0, True, False, True),
    "fp32_residual_gemma": (1.0, True, False, True),
}


def inputs(rank: int, world_size: int, tokens: int, seed: int, device, hidden: int, dtype=torch.bfloat16):
    """(this rank's x, every rank's x, residual, weight): deterministic, the same on every rank."""
    def randn(*shape, salt):
        g = torch.Generator().manual_seed(zlib.crc32(repr((seed, tokens, hidden, salt)).encode()))
        return torch.randn(*shape, generator=g).to(device, dtype)

    xs = [randn(tokens, hidden, salt=r) for r in range(world_size)]
    weight = (1 + 0.1 * randn(hidden, salt="w").float()).to(dtype)
    return xs[rank].clone(), xs, randn(tokens, hidden, salt="res"), weight


def reference(xs, residual, weight, weight_offset: float = 0.0):
    """fp32 all-reduce + residual add + RMSNorm * (weight + weight_offset)."""
    residual_out = torch.stack([x.float() for x in xs]).sum(0)
    if residual is not None:
        residual_out = residual_out + residual.float()
    normed = residual_out * torch.rsqrt(residual_out.pow(2).mean(-1, keepdim=True) + EPS) * (weight.float() + weight_offset)
    return normed, residual_out


def variant_arguments(variant: str, residual, weight):
    """(residual, weight, norm) a plan gets for `NORM_VARIANTS[variant]`: the residual and weight in float32
    where the variant says so, and the norm argument (weight offset, weight applied in float32)."""
    offset, in_fp32, fp32_weight, fp32_residual = NORM_VARIANTS[variant]
    return residual.float() if fp32_residual else residual, weight.float() if fp32_weight else weight, (offset, in_fp32)


def trtllm_takes(variant: str, features) -> bool:
    """Whether the dispatch ever gives the TensorRT-LLM kernel this variant (`policy.trtllm_unsupported`):
    16-bit residual and weight only, and a weight offset only from FlashInfer 0.7.2 (its `weight_bias`)."""
    offset, _, fp32_weight, fp32_residual = NORM_VARIANTS[variant]
    return not (fp32_weight or fp32_residual or (offset and not features.trtllm_weight_bias))


def rel_errs(out, ref) -> tuple[float, float]:
    """Relative L2 errors of (normed, residual_out) against the fp32 reference."""
    return tuple(((o.float().reshape(r.shape) - r).norm() / r.norm()).item() for o, r in zip(out, ref))


def fused_calls() -> dict:
    """{mode: calls} of the fused op's fused implementations so far in this process."""
    from fxfuse.op.runtime.plans import fusion_stats

    counts: dict = {}
    for (_, mode, _, _), n in fusion_stats()["fused"].items():
        counts[mode] = counts.get(mode, 0) + n
    return counts


def build_flashinfer_kernels() -> float:
    """Build (JIT, about 5 minutes on a fresh machine; later a load from FlashInfer's cache) the kernels the
    fused paths use, in this process: the TensorRT-LLM fusion kernel and, from FlashInfer 0.7.2, the PCIe
    all-reduce. Ranks spawned afterwards load them from the cache, so that a spawn's timeout bounds its own
    work rather than the JIT's. Raises FlashInferUnavailable (saying why) if the kernel cannot be built.
    Returns the seconds it took."""
    from fxfuse.op.runtime.trtllm_kernels import TrtllmFusionKernels

    started = time.monotonic()
    TrtllmFusionKernels().load()
    if _FEATURES.pcie:
        importlib.import_module("flashinfer.comm.pcie_ipc_ar").get_pcie_ipc_comm_module()
    return time.monotonic() - started


class DeviceMemoryPeak:
    """The GPU's used memory (every process's on it, as cudaMemGetInfo reports it) before a `with` block
    (`before`) and its highest value while the block runs (`peak`), sampled every `interval_s` seconds in a
    background thread: what spawned ranks sharing the GPU take is `peak - before`."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.before = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="device-memory-peak", daemon=True)

    @staticmethod
    def used() -> int:
        """Bytes in use on the current GPU now."""
        free, total = torch.cuda.mem_get_info()
        return total - free

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.used())

    def __enter__(self) -> "DeviceMemoryPeak":
        self.before = self.peak = self.used()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
