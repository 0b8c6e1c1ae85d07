"""The decision for one call shape: the decision table's question for a call on a group, and its answer.

`problem_for` states a call (tokens, hidden size, dtypes, weight offset) on a group as the table's
`FusionProblem`, from the group's agreed facts (`fxfuse.op.decide.group_config`) and the token capacity
of each fused implementation's workspace, which the caller (the runtime, which owns the workspaces)
gives. `decide_call` asks the table (`fxfuse.op.decide.policy.decide`) with the thresholds entry of the
group's GPU, world size, hidden size, dtype and topology, and ends a fallback's reason with what a
user needs to know (why a workspace could not be made, why the group's topology is what it is). Pure:
equal arguments give equal decisions, on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fxfuse.op.decide.group_config import GroupConfig
from fxfuse.op.decide.modes import FusionMode
from fxfuse.op.decide.policy import FusionDecision, FusionProblem, decide
from fxfuse.op.decide.thresholds import ThresholdEntry
from fxfuse.op.decide.topology import Topology


def problem_for(config: GroupConfig, tokens: int, hidden: int, dtype, weight_dtype, residual_dtype, trtllm_max_tokens: int,
                pcie_max_tokens: int, weight_offset: float = 0.0, one_kernel_max_tokens: int = 0) -> FusionProblem:
    """The decision table's input for one call shape on this group, whose TensorRT-LLM, PCIe and one-kernel
    PCIe workspaces hold (or would hold, if made now) `trtllm_max_tokens` / `pcie_max_tokens` /
    `one_kernel_max_tokens` tokens."""
    return FusionProblem(
        sm=config.sm, world_size=config.world_size, dtype=dtype, hidden_size=hidden, num_tokens=tokens,
        weight_dtype=weight_dtype, residual_dtype=residual_dtype, topology=config.topology,
        flashinfer=config.flashinfer, weight_offset=weight_offset,
        trtllm_max_tokens=trtllm_max_tokens, pcie_max_tokens=pcie_max_tokens, one_kernel_max_tokens=one_kernel_max_tokens,
    )


def thresholds_entry(config: GroupConfig, hidden: int, dtype: torch.dtype) -> ThresholdEntry | None:
    """The thresholds table's entry for this group's GPU, world size and topology at (hidden, dtype), if any."""
    return config.thresholds.lookup(config.gpu, config.world_size, hidden, dtype, config.topology.value)


def decide_call(config: GroupConfig, problem: FusionProblem, workspace_failures: Sequence[str] = ()) -> FusionDecision:
    """What runs `problem` on this group; a fallback's reason ends with `fallback_context`
    (`workspace_failures`: why each workspace that could not be made was not)."""
    decision = decide(problem, config.settings, thresholds_entry(config, problem.hidden_size, problem.dtype))
    if decision.fused:
        return decision
    return FusionDecision(FusionMode.FALLBACK, decision.reason + fallback_context(config, workspace_failures))


def fallback_context(config: GroupConfig, workspace_failures: Sequence[str]) -> str:
    """What a fallback's reason should also say: why a workspace could not be made, or why the
    group's topology is what it is (a failed link probe, several hosts)."""
    failures = list(workspace_failures)
    if config.topology in (Topology.NONE, Topology.NVLINK) and config.world_size > 1:
        failures.append(config.topology_reason)
    return f" ({'; '.join(failures)})" if failures else ""
