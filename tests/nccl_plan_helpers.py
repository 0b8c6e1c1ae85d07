"""Shared by the tests that run the fused op's CUDA dispatch on CPU tensors (gloo ranks, Triton's
interpreter): a group config whose decision table picks the NCCL plan for every call."""

from __future__ import annotations


def use_nccl_plans(ctx) -> str:
    """Give `ctx.group` a config (PCIe topology, no PCIe all-reduce available) that makes every call an
    NCCL plan, without the collective exchange a real first call does; returns the group's name."""
    from fxfuse.op.decide.flashinfer_version import features
    from fxfuse.op.decide.group_config import GroupConfig, install_config
    from fxfuse.op.decide.settings import FusionSettings
    from fxfuse.op.decide.thresholds import ThresholdTable
    from fxfuse.op.decide.topology import Topology

    name = ctx.group.group_name
    install_config(ctx.group, GroupConfig(name, ctx.world_size, "cpu test", 90, Topology.PCIE, "test",
                                          features(None), FusionSettings(), ThresholdTable()))
    return name
