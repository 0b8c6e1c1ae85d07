"""The fused op's FXFUSE_* settings, checked in the launching process before any rank starts.

The op reads its settings (`fxfuse.op.decide.settings`) and its thresholds file (`fxfuse.op.decide.thresholds`) on
each rank when it first runs: a bad value found there ends a run late, on every rank at once, or not at
all where the op never reads it (the CPU kernel). `check_op_settings(environ)` parses them up front with
the op's own parsers and raises RunError naming the variable and what is wrong. Importing this module
imports no torch; the check imports it (through the thresholds parser) only when FXFUSE_THRESHOLDS is set.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping

from fxfuse.op.decide.environment import env_setting
from fxfuse.runner.errors import RunError

if TYPE_CHECKING:
    from fxfuse.op.decide.settings import FusionSettings

#: What the fused op's workspace is planned for (`fxfuse.runner.memory_plan`): FlashInfer's TensorRT-LLM
#: kernel on NVLink / NVSwitch GPUs, or its PCIe all-reduce on PCIe-only GPUs.
INTERCONNECTS = ("nvlink", "pcie")
#: The variable naming the thresholds file (`fxfuse.op.decide.thresholds.ENV_THRESHOLDS`, whose module imports torch).
THRESHOLDS_ENV = "FXFUSE_THRESHOLDS"


def checked_op_settings(environ: Mapping[str, str] = os.environ, tune_cache_written: bool = False) -> FusionSettings:
    """The op's settings from `environ`; RunError if FXFUSE_FUSION, FXFUSE_MAX_TOKENS, FXFUSE_TOPOLOGY,
    FXFUSE_PCIE_PROFILE or FXFUSE_NATIVE holds a value the op does not understand, FXFUSE_PCIE_TUNE_CACHE
    names no file (unless `tune_cache_written`: `fxfuse tune pcie` writes it), or FXFUSE_THRESHOLDS names
    a file that is missing or not a thresholds table."""
    from fxfuse.op.decide.environment import switch_setting
    from fxfuse.op.decide.settings import ENV_PCIE_TUNE_CACHE, settings_from_env

    try:
        settings = settings_from_env(environ)
        switch_setting("FXFUSE_NATIVE", True, environ)
    except ValueError as exc:
        raise RunError(f"bad setting {exc}") from None
    tune_cache = settings.pcie_tune_cache
    if tune_cache is not None and not tune_cache_written and not os.path.isfile(tune_cache):
        raise RunError(f"bad setting {ENV_PCIE_TUNE_CACHE}={tune_cache!r}: no such file (FlashInfer's PCIe all-reduce "
                       "reads its tuning from it: run `fxfuse tune pcie` to write it, or unset the variable)")
    if env_setting(THRESHOLDS_ENV, environ):
        from fxfuse.op.decide.thresholds import load_thresholds

        try:
            load_thresholds(environ=environ)
        except ValueError as exc:  # ThresholdsError: names the file and what is wrong with it
            raise RunError(f"bad setting {THRESHOLDS_ENV}: {exc}") from None
    return settings


def planned_interconnect(settings: FusionSettings) -> str:
    """The workspace the memory plan counts for `settings`: "pcie" (FlashInfer's PCIe all-reduce) when
    they name PCIe (FXFUSE_TOPOLOGY=pcie, FXFUSE_FUSION=pcie or pcie_one_kernel), else "nvlink" (the TensorRT-LLM
    kernel)."""
    pcie = (settings.topology is not None and settings.topology.value == "pcie") or (
        settings.force_mode is not None and settings.force_mode.value in ("pcie", "pcie_one_kernel"))
    return "pcie" if pcie else "nvlink"
