"""The fused op's public lifecycle calls: `fxfuse.prepare`, `fxfuse.destroy_workspaces`, `fusion_stats`.

`prepare(group, hidden_size, dtype, max_tokens)` is what a CUDA-graph user calls on every rank before
capturing: the ranks agree on settings and topology, create the workspaces the decision table will
pick for 1..max_tokens tokens, resolve launch configurations, compile the fused norm kernel and
install the C++ fallback (`fxfuse.op.runtime.registration.install_native_fallback`), so
that nothing inside a capture needs a collective, an allocation or a compile. `destroy_workspaces`
frees them (collective), refusing to free workspaces that captured graphs may still use unless told
those graphs are gone. `forced_plan` builds one implementation's plan regardless of the table (for
benchmarks and tests that time or check a specific kernel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxfuse.op.decide.agreement import LocalSteps, RankStepFailed, agreed_failure
from fxfuse.op.decide.call_decision import problem_for, thresholds_entry
from fxfuse.op.decide.group_config import config_of
from fxfuse.op.decide.modes import FusionMode
from fxfuse.op.decide.policy import FusionDecision, decide
from fxfuse.op.reference import resolve_group
from fxfuse.op.runtime.cuda_dispatch import forget_plans
from fxfuse.op.runtime.planning import capacities, compile_norm_kernel, compile_one_kernel, ensure_workspace, fused_plan
from fxfuse.op.runtime.plans import PLAIN_NORM, CallPlan, NcclPlan, fusion_stats, reset_fusion_stats
from fxfuse.op.runtime.registration import install_native_fallback
from fxfuse.op.runtime.workspace import ONE_KERNEL, REGISTRIES

__all__ = ["destroy_workspaces", "forced_plan", "fusion_stats", "prepare", "reset_fusion_stats"]


def prepare(
    group: dist.ProcessGroup | None, hidden_size: int, dtype: torch.dtype, max_tokens: int | None = None
) -> bool:
    """Make the fused op ready for (group, hidden_size, dtype) up to `max_tokens` tokens; True if a fused
    all-reduce (TensorRT-LLM, PCIe or the one-kernel PCIe path) will run for some of those token counts.

    Collective: every rank of `group` (None: the world group) calls it with the same arguments,
    outside CUDA-graph capture and before capturing graphs that contain the op. `max_tokens` (default
    $FXFUSE_MAX_TOKENS or 512) bounds the workspaces; larger calls run NCCL + the fused norm. Raises
    `fxfuse.op.decide.agreement.ConfigMismatch` on every rank if the ranks' settings, thresholds, tuning
    files, FlashInfer versions or GPU models differ. Calling it again with more tokens makes new
    workspaces and keeps the old ones alive for graphs captured with them.

    It needs CUDA devices: where torch has none (a CPU machine: gloo groups run the op's CPU reference
    kernel, which has nothing to prepare) it returns False at once. Arguments of the wrong kind raise
    ValueError (TypeError for a group that is not one) before any rank does anything collective.
    """
    _check_prepare_arguments(group, hidden_size, dtype, max_tokens)
    if not torch.cuda.is_available():
        return False  # the CPU reference kernel: no workspace, no kernel to compile
    group = group if group is not None else dist.group.WORLD
    install_native_fallback()
    config = config_of(group)
    max_tokens = max_tokens or config.settings.max_tokens
    entry = thresholds_entry(config, hidden_size, dtype)
    room = capacities(config, hidden_size, dtype, max_tokens)
    wanted = {
        decide(problem_for(config, tokens, hidden_size, dtype, dtype, dtype, **room), config.settings, entry).mode
        for tokens in range(1, max_tokens + 1)
    }
    kinds = {FusionMode.ONESHOT if m.trtllm else m for m in wanted if m is not FusionMode.FALLBACK}
    ready = [ensure_workspace(config, group, kind, hidden_size, dtype, max_tokens) is not None for kind in sorted(kinds)]
    forget_plans(group.group_name)
    for residual_dtype in (dtype, None):  # so that a first call during CUDA-graph capture does not compile
        compile_norm_kernel(hidden_size, dtype, dtype, residual_dtype)
    one_kernel = ONE_KERNEL.lookup(group.group_name, hidden_size, dtype)
    if FusionMode.PCIE_ONE_KERNEL in kinds and one_kernel is not None:  # the same on every rank: both were agreed
        _compile_one_kernel_agreed(group, fused_plan(group, FusionDecision(FusionMode.PCIE_ONE_KERNEL, "prepare"), one_kernel),
                                   dtype)
    return any(ready)


def _compile_one_kernel_agreed(group: dist.ProcessGroup, plan: CallPlan, dtype: torch.dtype) -> None:
    """Compile the one kernel with and without a residual on every rank; `RankStepFailed` on every rank if any failed."""
    steps = LocalSteps()
    for residual_dtype in (dtype, None):
        steps.run("compiling the one-kernel all-reduce + RMSNorm (Triton)", compile_one_kernel, plan, dtype, dtype,
                  residual_dtype, PLAIN_NORM, None)
    reason = agreed_failure(steps.failure, group)
    if reason is not None:
        raise RankStepFailed(f"fxfuse.prepare failed on every rank of process group {group.group_name!r} because of {reason}")


#: The activation dtypes the fused op takes.
PREPARE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_prepare_arguments(group, hidden_size, dtype, max_tokens) -> None:
    """One clear error for an argument of `prepare` that cannot be right."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"fxfuse.prepare: group must be a torch.distributed ProcessGroup or None (the world group), "
                        f"got {type(group).__name__}")
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
        raise ValueError(f"fxfuse.prepare: hidden_size must be a positive int (the model's hidden size), got {hidden_size!r}")
    if dtype not in PREPARE_DTYPES:
        raise ValueError(f"fxfuse.prepare: dtype must be one of {', '.join(map(str, PREPARE_DTYPES))} (a torch.dtype, "
                         f"the activations'), got {dtype!r}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"fxfuse.prepare: max_tokens must be a positive int or None (the FXFUSE_MAX_TOKENS default), "
                         f"got {max_tokens!r}")


def destroy_workspaces(group: dist.ProcessGroup | None = None, graphs_released: bool = False) -> None:
    """Free the fused op's workspaces of `group` (all groups if None); collective over each group.

    Call it on every rank before `dist.destroy_process_group`. Raises RuntimeError on every rank,
    freeing nothing of that group, if on any rank a workspace of it was used while capturing a CUDA
    graph, unless `graphs_released=True` says those graphs were destroyed: replaying one after the
    free would write through freed memory. Cached plans are dropped in every case, so no call uses a
    freed workspace. Workspaces not freed this way are released locally at interpreter exit.
    """
    names = [group.group_name] if group is not None else sorted(set().union(*(r.group_names() for r in REGISTRIES)))
    try:
        for name in names:
            _destroy_group_workspaces(group if group is not None else resolve_group(name), graphs_released)
    finally:
        forget_plans(None if group is None else group.group_name)


def _destroy_group_workspaces(group: dist.ProcessGroup, graphs_released: bool) -> None:
    """Agree that no rank refuses (a captured workspace), then free every registry's workspaces of `group`."""
    steps = LocalSteps()
    for registry in REGISTRIES:
        steps.run(f"checking the {registry.name} workspaces", registry.check_destroyable, group.group_name, graphs_released)
    refusal = agreed_failure(steps.failure, group)
    if refusal is not None:
        raise RuntimeError(f"fxfuse.destroy_workspaces freed nothing of process group {group.group_name!r}: {refusal}")
    for registry in REGISTRIES:
        registry.destroy(group)


def forced_plan(group: dist.ProcessGroup, mode: FusionMode, hidden_size: int, dtype: torch.dtype, max_tokens: int) -> CallPlan | None:
    """A plan that runs `mode` for every call it gets (creating its workspace collectively), or None
    if that implementation cannot run here. Call it with `(x, residual, weight, eps, x_donated)`."""
    config = config_of(group)
    decision = FusionDecision(mode, "forced by the caller")
    if mode is FusionMode.FALLBACK:
        return NcclPlan(group, decision)
    workspace = ensure_workspace(config, group, mode, hidden_size, dtype, max_tokens)
    if workspace is None:
        return None
    return fused_plan(group, decision, workspace)
