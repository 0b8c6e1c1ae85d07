"""What every rank of a group agrees on before the fused op decides anything: one exchange per group.

`agree_group_config(group, local)` gathers each rank's `LocalReport` (GPU name and arch, FlashInfer
version, settings, thresholds-table checksum, PCIe tuning-file checksum, and its view of the GPU
links) in one `all_gather_object`, outside CUDA-graph capture, and returns the same `GroupConfig` on
every rank: the conservative topology (the worst link between any two ranks' GPUs, unless
`FXFUSE_TOPOLOGY` sets it) and the values all decisions use. If ranks differ in anything that must
be equal, every rank raises the same `ConfigMismatch` naming the values by rank, instead of one rank
running a fused kernel while another runs NCCL (a hang).

`local_report(...)` reads this rank's facts; it touches CUDA and NVML but never FlashInfer (the
tuning file's checksum aside, which needs FlashInfer's default path only when the PCIe all-reduce is
available).
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fxfuse.op.agreement import ConfigMismatch, gather_objects, mismatches
from fxfuse.op.flashinfer_version import FlashInferFeatures
from fxfuse.op.settings import FusionSettings
from fxfuse.op.thresholds import ThresholdTable
from fxfuse.op.topology import LocalView, Topology, combine_views, normalize_uuid, probe_local_view

#: Fields of `LocalReport` that must be identical on every rank.
MUST_MATCH = ("gpu", "sm", "flashinfer_version", "settings", "thresholds_digest", "pcie_tune_digest")


@dataclass(frozen=True)
class LocalReport:
    """One rank's facts, exchanged once per group (every field picklable)."""

    gpu: str
    sm: int
    flashinfer_version: str | None
    settings: str
    thresholds_digest: str
    pcie_tune_digest: str
    view: LocalView


@dataclass(frozen=True)
class GroupConfig:
    """The agreed facts of one group: identical on every rank after `agree_group_config`."""

    group_name: str
    world_size: int
    gpu: str
    sm: int
    topology: Topology
    topology_reason: str
    flashinfer: FlashInferFeatures
    settings: FusionSettings
    thresholds: ThresholdTable


def local_report(
    settings: FusionSettings, thresholds: ThresholdTable, features: FlashInferFeatures, device: torch.device,
    world_size: int,
) -> LocalReport:
    """This rank's facts on CUDA `device`, in a group of `world_size` ranks."""
    major, minor = torch.cuda.get_device_capability(device)
    uuid = normalize_uuid(torch.cuda.get_device_properties(device).uuid)
    view = probe_local_view(socket.gethostname(), uuid, device.index)
    return LocalReport(
        gpu=torch.cuda.get_device_name(device),
        sm=major * 10 + minor,
        flashinfer_version=features.version,
        settings=repr(settings),
        thresholds_digest=thresholds.digest(),
        pcie_tune_digest=pcie_tune_digest(settings, features, world_size),
        view=view,
    )


def pcie_tune_digest(settings: FusionSettings, features: FlashInferFeatures, world_size: int) -> str:
    """'<path>:<sha256 prefix>' of the PCIe tuning file FlashInfer will read ('<path>:absent' if none;
    '' when the PCIe all-reduce is not available): a rank that reads another file picks another kernel."""
    if not features.pcie:
        return ""
    path = settings.pcie_tune_cache
    if path is None:
        from flashinfer.comm.pcie_ipc_tuning import default_cache_path

        path = default_cache_path(world_size)
    try:
        with open(path, "rb") as f:
            return f"{path}:{hashlib.sha256(f.read()).hexdigest()[:16]}"
    except OSError:
        return f"{path}:absent"


def combine_reports(
    reports: list[LocalReport], group_name: str, settings: FusionSettings, thresholds: ThresholdTable,
    features: FlashInferFeatures,
) -> GroupConfig:
    """The `GroupConfig` every rank derives from the same gathered `reports`; raises ConfigMismatch."""
    differ = mismatches([r.__dict__ for r in reports], MUST_MATCH)
    if differ:
        details = "; ".join(f"{key}: " + ", ".join(f"rank {i}={v!r}" for i, v in enumerate(values)) for key, values in differ.items())
        raise ConfigMismatch(
            f"the ranks of process group {group_name!r} disagree on what the fused all-reduce + RMSNorm op must "
            f"see the same everywhere ({details}); give every rank the same FXFUSE_* settings, thresholds and "
            "PCIe tuning files, FlashInfer version and GPU model"
        )
    if settings.topology is not None:
        topology, why = settings.topology, f"set by FXFUSE_TOPOLOGY={settings.topology.value}"
    else:
        topology, why = combine_views(r.view for r in reports)
    return GroupConfig(
        group_name=group_name,
        world_size=len(reports),
        gpu=reports[0].gpu,
        sm=reports[0].sm,
        topology=topology,
        topology_reason=why,
        flashinfer=features,
        settings=settings,
        thresholds=thresholds,
    )


def agree_group_config(
    group: dist.ProcessGroup, local: LocalReport, settings: FusionSettings, thresholds: ThresholdTable,
    features: FlashInferFeatures,
) -> GroupConfig:
    """Exchange `local` with every rank of `group` (collective, outside capture) and combine."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"the fused all-reduce + RMSNorm op's ranks of group {group.group_name!r} have not agreed on their "
            "settings and topology yet, and cannot during CUDA-graph capture: call fxfuse.prepare(group, "
            "hidden_size, dtype, max_tokens) on every rank before capturing (or run one step eagerly first)"
        )
    return combine_reports(gather_objects(local, group), group.group_name, settings, thresholds, features)
