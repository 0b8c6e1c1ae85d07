"""Which FlashInfer is installed and what its version can run, without importing FlashInfer.

`installed_version()` reads the `flashinfer-python` distribution's version from its metadata (no
import, no CUDA); `features(version)` turns it into the gates the decision table uses:
- the TensorRT-LLM all-reduce + RMSNorm kernel: 0.6.3 and later, built for SM 9.x and 10.x; for
  SM 12.x only from 0.6.17 (FlashInfer PR 3903: before it the SM 12.x Lamport kernel had an empty body
  and returned garbage without an error);
- the PCIe IPC all-reduce (`flashinfer.comm.PcieIpcAllReduceWorkspace`): 0.7.2 and later;
- the TensorRT-LLM kernel's `weight_bias` (a constant added to the norm weight in float32, what a
  zero-centred Gemma norm needs): 0.7.2 and later (not in 0.6.3);
- versions outside the range fxfuse was written and tested against (0.6.3 to 0.7.x) get neither.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from dataclasses import dataclass

DISTRIBUTION = "flashinfer-python"
OLDEST = (0, 6, 3)
#: First release fxfuse does not know (exclusive upper bound, as in pyproject's `cuda` extra).
NEWEST_EXCLUSIVE = (0, 8, 0)
TRTLLM_SM12 = (0, 6, 17)
PCIE_IPC = (0, 7, 2)
TRTLLM_WEIGHT_BIAS = (0, 7, 2)


def parse_version(text: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string such as '0.7.2.post1' or '0.6.18rc1'; None if unreadable."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


@functools.cache
def installed_version() -> str | None:
    """The installed flashinfer-python version string, or None when it is not installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class FlashInferFeatures:
    """What the installed FlashInfer offers the fused op. `version` is None when none is installed;
    `why_not` says why no kernel of it is used (not installed, or a version outside the range)."""

    version: str | None
    trtllm: bool
    trtllm_sm12: bool
    pcie: bool
    why_not: str = ""
    trtllm_weight_bias: bool = False

    def trtllm_arch_supported(self, sm: int) -> bool:
        """Whether this FlashInfer builds the TensorRT-LLM fusion kernel for compute capability `sm`."""
        return self.trtllm and (sm // 10 in (9, 10) or (sm // 10 == 12 and self.trtllm_sm12))


def features(version: str | None) -> FlashInferFeatures:
    """The gates for a FlashInfer version string (None: not installed)."""
    if version is None:
        return FlashInferFeatures(None, False, False, False, "flashinfer-python is not installed")
    parsed = parse_version(version)
    if parsed is None or not OLDEST <= parsed < NEWEST_EXCLUSIVE:
        supported = f"{'.'.join(map(str, OLDEST))} to <{'.'.join(map(str, NEWEST_EXCLUSIVE))}"
        return FlashInferFeatures(version, False, False, False, f"flashinfer {version} is outside {supported}")
    return FlashInferFeatures(version, True, parsed >= TRTLLM_SM12, parsed >= PCIE_IPC,
                              trtllm_weight_bias=parsed >= TRTLLM_WEIGHT_BIAS)


def installed_features() -> FlashInferFeatures:
    """`features` of the installed FlashInfer."""
    return features(installed_version())
