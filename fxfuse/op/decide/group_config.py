"""What every rank of a group agrees on before the fused op decides anything: one exchange per group.

`agreed_config(group, device)` runs once per process group (the op's first call on it, or
`fxfuse.prepare`), on CPU and CUDA alike, outside CUDA-graph capture. Each rank reads its facts as
local steps that never raise (`fxfuse.op.decide.agreement.LocalSteps`): its FXFUSE_* settings, the thresholds
table, the FlashInfer version, on CUDA its GPU model and arch, the PCIe tuning file's checksum and its
view of the GPU links. One `all_gather_object` then gives every rank every report, and every rank
derives the same outcome:
- a rank failed a step (a bad setting, an unreadable thresholds file, a failing FlashInfer import for
  the tuning file's path, a GPU query that raised): every rank raises the same `RankStepFailed` naming
  the rank and the step;
- the ranks differ in something that must be equal (settings, thresholds, tuning file, FlashInfer
  version, GPU model): every rank raises the same `ConfigMismatch` naming the values by rank;
- otherwise the same `GroupConfig`: the conservative topology (the worst link between any two ranks'
  GPUs, unless `FXFUSE_TOPOLOGY` sets it; a rank whose link probe failed counts as having no links, so
  no peer-to-peer kernel is chosen) and the values all decisions use.
So no rank ever runs a fused kernel while another runs NCCL, and no rank waits in a collective that
another skipped.

Configs are cached by group name and checked against the group object itself: torch reuses a name
after `destroy_process_group` + `init_process_group`, and a config (with everything keyed by the name
in other modules, which register with `when_group_forgotten`) must not outlive its group.
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from fxfuse.op.decide.agreement import ConfigMismatch, LocalSteps, exchange, mismatches
from fxfuse.op.decide.flashinfer_version import FlashInferFeatures, installed_features
from fxfuse.op.decide.settings import FusionSettings, current_settings
from fxfuse.op.decide.thresholds import ThresholdTable, current_thresholds
from fxfuse.op.decide.topology import LocalView, Topology, combine_views, normalize_uuid, probe_local_view

#: Fields of `LocalReport` that must be identical on every rank.
MUST_MATCH = ("gpu", "sm", "flashinfer_version", "settings", "thresholds_digest", "pcie_tune_digest")
#: What the exchange sets up, as error messages name it.
SETUP = "setting up the fused all-reduce + RMSNorm op"


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
    """The agreed facts of one group: identical on every rank after `agreed_config`."""

    group_name: str
    world_size: int
    gpu: str
    sm: int
    topology: Topology
    topology_reason: str
    flashinfer: FlashInferFeatures
    settings: FusionSettings
    thresholds: ThresholdTable


@dataclass(frozen=True)
class DeviceFacts:
    """This rank's GPU as the report names it: model, arch as an integer (90 for 9.0), UUID."""

    gpu: str
    sm: int
    uuid: str


def device_facts(device: torch.device) -> DeviceFacts:
    """The model, arch and UUID of CUDA `device` (a CPU device: "cpu", arch 0)."""
    if device.type != "cuda":
        return DeviceFacts("cpu", 0, "cpu")
    major, minor = torch.cuda.get_device_capability(device)
    uuid = normalize_uuid(torch.cuda.get_device_properties(device).uuid)
    return DeviceFacts(torch.cuda.get_device_name(device), major * 10 + minor, uuid)


def local_view(facts: DeviceFacts, device: torch.device) -> LocalView:
    """This rank's links to the other GPUs of its host; a probe that raises gives a view with no
    links (so the group's topology is NONE: only NCCL runs), saying why."""
    host = socket.gethostname()
    if facts.gpu == "cpu":
        return LocalView(host, facts.uuid, (), "CPU tensors")
    try:
        return probe_local_view(host, facts.uuid, device.index)
    except Exception as exc:  # noqa: BLE001 - an unknown link is a slower link, never an error
        return LocalView(host, facts.uuid, (), f"link probe failed: {type(exc).__name__}: {exc}")


def local_report(steps: LocalSteps, device: torch.device, world_size: int) -> LocalReport | None:
    """This rank's facts on `device` in a group of `world_size` ranks, each read as a step of
    `steps` (None once one failed)."""
    settings = steps.run("reading the FXFUSE_* settings", current_settings)
    thresholds = steps.run("reading the thresholds table (FXFUSE_THRESHOLDS)", current_thresholds)
    features = steps.run("reading the FlashInfer version", installed_features)
    facts = steps.run("reading the GPU model and arch", device_facts, device)
    tune = steps.run("reading the PCIe tuning file", pcie_tune_digest, settings, features, world_size)
    if steps.failure is not None:
        return None
    return LocalReport(
        gpu=facts.gpu,
        sm=facts.sm,
        flashinfer_version=features.version,
        settings=repr(settings),
        thresholds_digest=thresholds.digest(),
        pcie_tune_digest=tune,
        view=local_view(facts, device),
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
    elif reports[0].gpu == "cpu":
        topology, why = Topology.NONE, "CPU tensors: the op's CPU kernel (gloo all-reduce + float32 norm) runs"
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


def agree_group_config(group: dist.ProcessGroup, device: torch.device) -> GroupConfig:
    """Read this rank's facts, exchange them with every rank of `group` (collective, outside capture)
    and combine; raises `RankStepFailed` or `ConfigMismatch` identically on every rank."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"the fused all-reduce + RMSNorm op's ranks of group {group.group_name!r} have not agreed on their "
            "settings and topology yet, and cannot during CUDA-graph capture: call fxfuse.prepare(group, "
            "hidden_size, dtype, max_tokens) on every rank before capturing (or run one step eagerly first)"
        )
    steps = LocalSteps()
    report = local_report(steps, device, dist.get_world_size(group))
    reports = exchange(report, steps, group, SETUP)
    return combine_reports(reports, group.group_name, current_settings(), current_thresholds(), installed_features())


#: Agreed configs by group name, with the group object they belong to.
_AGREED: dict[str, tuple[dist.ProcessGroup, GroupConfig]] = {}
#: Functions that drop another module's state of a group name (`when_group_forgotten`).
_FORGET_HOOKS: list[Callable[[str], None]] = []


def agreed_config(group: dist.ProcessGroup, device: torch.device) -> GroupConfig:
    """`group`'s agreed config, exchanged on its first use (collective); a config cached for another
    group of the same name (destroyed and re-created) is forgotten first, with all state of the name."""
    entry = _AGREED.get(group.group_name)
    if entry is not None and entry[0] is group:
        return entry[1]
    if entry is not None:
        forget_group(group.group_name)
    config = agree_group_config(group, device)
    _AGREED[group.group_name] = (group, config)
    return config


def config_of(group: dist.ProcessGroup) -> GroupConfig:
    """`group`'s agreed config on this rank's current CUDA device (the CPU without CUDA), exchanged on its
    first use (collective, outside capture)."""
    return agreed_config(group, torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                         else torch.device("cpu"))


def install_config(group: dist.ProcessGroup, config: GroupConfig) -> None:
    """Use `config` for `group` without an exchange (tests that drive the CUDA path on CPU tensors)."""
    _AGREED[group.group_name] = (group, config)


def when_group_forgotten(hook: Callable[[str], None]) -> None:
    """Call `hook(group_name)` whenever the state of a group name is dropped (`forget_group`)."""
    _FORGET_HOOKS.append(hook)


def forget_group(group_name: str) -> None:
    """Drop the agreed config of `group_name` and, through the registered hooks, every other module's
    state of that name (plans, workspaces, the C++ fallback's shapes)."""
    _AGREED.pop(group_name, None)
    for hook in _FORGET_HOOKS:
        hook(group_name)
