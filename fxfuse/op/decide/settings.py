"""The user's settings for the fused op, read from the environment once per process.

Every rank of a group must use the same settings: `fxfuse.op.decide.group_config` exchanges them once per
group, outside CUDA-graph capture, and raises the same error on every rank when they differ.

Environment variables (an empty value counts as unset):
- `FXFUSE_FUSION`: `auto` (default: the decision table picks), `oneshot` / `twoshot` (force that
  algorithm of FlashInfer's TensorRT-LLM kernel wherever it can run at all, whatever the topology:
  the explicit opt-in for PCIe or NVLink-bridge groups), `pcie` (force FlashInfer's PCIe all-reduce
  where it can run), `pcie_one_kernel` (force fxfuse's one-kernel all-reduce + norm over CUDA IPC where it
  can run, else the PCIe two-kernel path; normally a thresholds file chooses it where measured faster, see
  `fxfuse tune pcie --one-kernel`),
  `off` (never fused: NCCL all-reduce + the fused add-RMSNorm kernel).
- `FXFUSE_MAX_TOKENS`: token capacity of workspaces created implicitly (default 512).
- `FXFUSE_TOPOLOGY`: `auto` (default: detected) or `nvswitch` / `nvlink` / `pcie` / `none`.
- `FXFUSE_PCIE_PROFILE`: FlashInfer PCIe interconnect label (`rootcplx` or `pcieswitch`), instead
  of FlashInfer's own probe.
- `FXFUSE_PCIE_TUNE_CACHE`: the file FlashInfer's PCIe all-reduce reads its tuned launch
  configurations from (written by `fxfuse tune pcie`); default: FlashInfer's own path.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Mapping

from fxfuse.op.decide.environment import env_setting
from fxfuse.op.decide.modes import FusionMode
from fxfuse.op.decide.thresholds import ThresholdTable
from fxfuse.op.decide.topology import Topology

#: Workspace size (tokens) when a workspace is created implicitly on first call, and the most it may be set to.
DEFAULT_MAX_TOKENS = 512
MAX_WORKSPACE_TOKENS = 1 << 19

ENV_FUSION = "FXFUSE_FUSION"
ENV_MAX_TOKENS = "FXFUSE_MAX_TOKENS"
ENV_TOPOLOGY = "FXFUSE_TOPOLOGY"
ENV_PCIE_PROFILE = "FXFUSE_PCIE_PROFILE"
ENV_PCIE_TUNE_CACHE = "FXFUSE_PCIE_TUNE_CACHE"

FUSION_CHOICES = ("auto", "oneshot", "twoshot", "pcie", "pcie_one_kernel", "off")
PCIE_PROFILES = ("rootcplx", "pcieswitch")


@dataclass(frozen=True)
class FusionSettings:
    """User choices that steer the decision; they must be identical on all ranks.

    `enabled` False always runs NCCL + the fused norm. `force_mode` (one-shot, two-shot, PCIe or PCIe one-kernel)
    overrides the thresholds table, the topology and FlashInfer's heuristic wherever that
    implementation can run. `max_tokens` sizes a workspace created implicitly on first call.
    `topology` replaces the detected topology when set. `pcie_profile` and `pcie_tune_cache` are
    handed to FlashInfer's PCIe workspace.
    """

    enabled: bool = True
    force_mode: FusionMode | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    topology: Topology | None = None
    pcie_profile: str | None = None
    pcie_tune_cache: str | None = None

    @property
    def fusion(self) -> str:
        """The `FXFUSE_FUSION` value these settings stand for: auto, oneshot, twoshot, pcie, pcie_one_kernel or off."""
        if not self.enabled:
            return "off"
        return "auto" if self.force_mode is None else self.force_mode.value

    def __post_init__(self) -> None:
        if self.force_mode is FusionMode.FALLBACK:
            raise ValueError("force_mode must be oneshot, twoshot, pcie or pcie_one_kernel; use enabled=False to always fall back")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.pcie_profile is not None and self.pcie_profile not in PCIE_PROFILES:
            raise ValueError(f"pcie_profile must be one of {PCIE_PROFILES}, got {self.pcie_profile!r}")


def what_fused_sites_run(settings: FusionSettings, table: ThresholdTable | None = None) -> str:
    """One sentence: what a fused site runs under `settings` (the same in `fxfuse report` as in a run), and
    where the thresholds `table` (FXFUSE_THRESHOLDS, written by `fxfuse tune pcie`) chooses the one-kernel
    PCIe path."""
    tuned = one_kernel_choices(table) if table is not None and settings.enabled and settings.force_mode is None else ""
    return _what_runs(settings) + (f"; the thresholds file chooses fxfuse's one-kernel PCIe path for {tuned}" if tuned else "")


def one_kernel_choices(table: ThresholdTable) -> str:
    """The entries of `table` that choose the one-kernel PCIe path, and their token counts, in words ("" if none)."""
    choices = []
    for entry in table.entries.values():
        counts = [f"{first}-{last}" if first < last else str(first)
                  for first, last, mode in entry.spans() if mode is FusionMode.PCIE_ONE_KERNEL]
        if counts:
            choices.append(f"{entry.gpu} x{entry.world_size}, hidden {entry.hidden_size} {entry.dtype}: "
                           f"{', '.join(counts)} tokens")
    return "; ".join(choices)


def _what_runs(settings: FusionSettings) -> str:
    if not settings.enabled:
        return (f"{ENV_FUSION}=off: every fused site runs the NCCL all-reduce + the fused add-RMSNorm kernel "
                "(gloo + the reference norm on CPU), never a fused all-reduce kernel")
    if settings.force_mode is not None:
        return (f"{ENV_FUSION}={settings.force_mode.value}: fused sites run {settings.force_mode.value} wherever it can run, "
                "else NCCL + the fused add-RMSNorm kernel")
    return ("fused sites run what the ranks agree on at the first call: FlashInfer's TensorRT-LLM kernel on NVSwitch "
            "GPUs, its PCIe all-reduce + the fused norm on PCIe GPUs (fxfuse's one-kernel PCIe path where a thresholds "
            "file measured it faster), else NCCL + the fused norm (gloo + the reference norm on CPU)")


def settings_from_env(environ: Mapping[str, str]) -> FusionSettings:
    """Settings from the FXFUSE_* variables (see the module docstring); an empty one counts as unset
    (`fxfuse.op.decide.environment.env_setting`).

    Raises ValueError naming the variable when a value is not understood.
    """
    fusion = (env_setting(ENV_FUSION, environ) or "auto").lower()
    if fusion not in FUSION_CHOICES:
        raise ValueError(f"{ENV_FUSION}={fusion!r}: expected one of {', '.join(FUSION_CHOICES)}")
    raw_tokens = env_setting(ENV_MAX_TOKENS, environ) or str(DEFAULT_MAX_TOKENS)
    try:
        max_tokens = int(raw_tokens)
    except ValueError:
        max_tokens = 0
    if max_tokens < 1:
        raise ValueError(f"{ENV_MAX_TOKENS}={raw_tokens!r}: expected a positive integer")
    if max_tokens > MAX_WORKSPACE_TOKENS:
        raise ValueError(f"{ENV_MAX_TOKENS}={raw_tokens!r}: at most {MAX_WORKSPACE_TOKENS} (a workspace buffer is "
                         "kept under 1 GiB, which even hidden 1024 in bfloat16 reaches there); larger calls run NCCL "
                         "and the fused norm anyway")
    topology = (env_setting(ENV_TOPOLOGY, environ) or "auto").lower()
    if topology != "auto" and topology not in {t.value for t in Topology}:
        raise ValueError(f"{ENV_TOPOLOGY}={topology!r}: expected auto, {', '.join(t.value for t in Topology)}")
    profile = env_setting(ENV_PCIE_PROFILE, environ)
    profile = profile and profile.lower()
    if profile is not None and profile not in PCIE_PROFILES:
        raise ValueError(f"{ENV_PCIE_PROFILE}={profile!r}: expected one of {', '.join(PCIE_PROFILES)}")
    return FusionSettings(
        enabled=fusion != "off",
        force_mode=FusionMode(fusion) if fusion not in ("auto", "off") else None,
        max_tokens=max_tokens,
        topology=None if topology == "auto" else Topology(topology),
        pcie_profile=profile,
        pcie_tune_cache=env_setting(ENV_PCIE_TUNE_CACHE, environ),
    )


@functools.cache
def current_settings() -> FusionSettings:
    """This process's settings, from its environment (read once)."""
    return settings_from_env(os.environ)
