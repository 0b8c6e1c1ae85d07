"""How the GPUs of a process group are connected, as every rank of it agrees.

`Topology` orders the answers from best to worst: `NVSWITCH` (every rank's GPU reaches every other
through NVLink switches, full bandwidth between any pair), `NVLINK` (every pair linked directly by
NVLink bridges, as on H100/H200 NVL parts, where FlashInfer's TensorRT-LLM kernel was measured 10-34x
slower than unfused), `PCIE` (every pair can reach the other's memory over PCIe peer-to-peer, not all
over NVLink), `NONE` (some pair has no peer access, ranks on different hosts, or unknown).

`probe_local_view(...)` is what one rank sees from its own GPU: its link to every other GPU of its
host (NVML where it is installed, else the CUDA runtime's peer-access query to the visible GPUs);
`combine_views(views)` is the conservative answer all ranks take from everyone's view (the worst link
between any two ranks' GPUs decides). The exchange itself happens once per group,
outside CUDA-graph capture, in `fxfuse.op.decide.group_config`. `FXFUSE_TOPOLOGY` overrides the detection
(same value on every rank).
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass
from typing import Iterable


class Topology(str, enum.Enum):
    """The interconnect of a group, best first (see the module docstring)."""

    NVSWITCH = "nvswitch"
    NVLINK = "nvlink"
    PCIE = "pcie"
    NONE = "none"

    @property
    def rank_order(self) -> int:
        """0 for the best interconnect, larger for worse ones."""
        return list(Topology).index(self)


@dataclass(frozen=True)
class LocalView:
    """What one rank measured: its host and GPU, and the best link it found to each peer GPU.

    `links` maps every other GPU of the host that the probe could see, by UUID, to a `Topology`
    member (NVSWITCH / NVLINK / PCIE / NONE); `how` says which probe produced it (for messages).
    """

    host: str
    gpu_uuid: str
    links: tuple[tuple[str, Topology], ...]
    how: str


def combine_views(views: Iterable[LocalView]) -> tuple[Topology, str]:
    """The group's topology from every rank's view, and a sentence saying why.

    Ranks on different hosts, or two ranks on one GPU, give NONE (no peer-to-peer kernel applies);
    otherwise the worst link any rank saw to any peer decides.
    """
    views = list(views)
    if len(views) < 2:
        return Topology.NONE, "a single rank has no peers"
    hosts = {v.host for v in views}
    if len(hosts) > 1:
        return Topology.NONE, f"ranks span {len(hosts)} hosts"
    gpus = [v.gpu_uuid for v in views]
    if len(set(gpus)) < len(gpus):
        return Topology.NONE, "several ranks share one GPU"
    worst, why = Topology.NVSWITCH, "every pair of GPUs is linked through NVSwitch"
    for view in views:
        links = dict(view.links)
        for peer in gpus:
            if peer == view.gpu_uuid:
                continue
            link = links.get(peer, Topology.NONE)
            if link.rank_order > worst.rank_order:
                worst, why = link, f"GPU {view.gpu_uuid[:13]} -> {peer[:13]}: {link.value} ({view.how})"
    return worst, why


def probe_local_view(host: str, gpu_uuid: str, device_index: int) -> LocalView:
    """This rank's links to the other GPUs of its host (NVML if importable, else CUDA peer access)."""
    try:
        pynvml = importlib.import_module("pynvml")
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML here: CUDA peer access is all we can tell
        return LocalView(host, gpu_uuid, _cuda_peer_links(device_index, gpu_uuid), "CUDA peer access")
    try:
        peers = [_uuid_of(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
        return LocalView(host, gpu_uuid, tuple((p, _nvml_link(pynvml, gpu_uuid, p)) for p in peers if p != gpu_uuid), "NVML")
    finally:
        pynvml.nvmlShutdown()


def normalize_uuid(uuid: str) -> str:
    """A GPU UUID without NVML's `GPU-` prefix, lower case (the form torch reports)."""
    return str(uuid).lower().removeprefix("gpu-")


def _uuid_of(pynvml, index: int) -> str:
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
    return normalize_uuid(uuid.decode() if isinstance(uuid, bytes) else uuid)


def _nvml_handle(pynvml, uuid: str):
    return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{normalize_uuid(uuid)}")


def _nvml_link(pynvml, local_uuid: str, peer_uuid: str) -> Topology:
    """The best link NVML reports between two GPUs of this host."""
    try:
        local, peer = _nvml_handle(pynvml, local_uuid), _nvml_handle(pynvml, peer_uuid)
    except Exception:  # noqa: BLE001 - the peer is not a GPU of this host
        return Topology.NONE
    ok = pynvml.NVML_P2P_STATUS_OK
    if pynvml.nvmlDeviceGetP2PStatus(local, peer, pynvml.NVML_P2P_CAPS_INDEX_NVLINK) == ok:
        return Topology.NVSWITCH if _links_all_go_to_switches(pynvml, local) else Topology.NVLINK
    if pynvml.nvmlDeviceGetP2PStatus(local, peer, pynvml.NVML_P2P_CAPS_INDEX_READ) == ok:
        return Topology.PCIE
    return Topology.NONE


def _links_all_go_to_switches(pynvml, handle) -> bool:
    """True when this GPU has active NVLinks and every one of them ends at an NVSwitch."""
    switch = getattr(pynvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    active = 0
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            if pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link) != switch:
                return False
        except Exception:  # noqa: BLE001 - link index not present on this GPU
            continue
        active += 1
    return active > 0


def _cuda_peer_links(device_index: int, gpu_uuid: str) -> tuple[tuple[str, Topology], ...]:
    """PCIE for each visible GPU the CUDA runtime grants peer access to, else NONE (without NVML an
    NVLink cannot be told apart from PCIe, so this never answers better than PCIE)."""
    import torch

    links = []
    for other in range(torch.cuda.device_count()):
        uuid = normalize_uuid(torch.cuda.get_device_properties(other).uuid)
        if uuid != gpu_uuid:
            links.append((uuid, Topology.PCIE if torch.cuda.can_device_access_peer(device_index, other) else Topology.NONE))
    return tuple(links)
