"""Making the plan for one call shape on CUDA: decide, then make what the decision needs, then agree.

`decide_plan` asks `fxfuse.op.decide.call_decision` what runs the shape on its group, telling it how
many tokens each workspace holds (or would hold, if made now); a fused decision then gets its workspace
(`fxfuse.op.runtime.workspace`: created collectively, outside CUDA-graph capture), and a workspace that
some rank could not make means deciding again without it, on every rank alike. `plan_call` then,
outside capture, runs one agreement: each rank compiles the kernel the plan runs after its all-reduce
as a local step, and one exchange carries every rank's outcome and plan, so a failed compile or a plan
that differs between ranks raises the same `RankStepFailed` on every rank instead of leaving one rank
in a collective the others skip.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxfuse.op.decide.agreement import LocalSteps, RankStepFailed, agreed_failure
from fxfuse.op.decide.call_decision import decide_call, problem_for
from fxfuse.op.decide.group_config import GroupConfig, config_of
from fxfuse.op.decide.modes import FusionMode
from fxfuse.op.decide.policy import FusionDecision, trtllm_token_cap
from fxfuse.op.fp8_recipe import WARM_UP_LIMITS, Fp8Recipe
from fxfuse.op.kernels.add_rmsnorm_kernel import add_rmsnorm_into
from fxfuse.op.kernels.one_shot_all_reduce_norm import Epilogue, Fp8Outputs, all_reduce_norm_into
from fxfuse.op.runtime.one_kernel_pcie import ONE_KERNEL_MAX_TOKENS
from fxfuse.op.runtime.plans import (
    PLAIN_NORM, CallPlan, Fp8Epilogue, NcclPlan, PcieOneKernelPlan, PciePlan, TrtllmPlan, residual_out_buffer,
)
from fxfuse.op.runtime.workspace import ONE_KERNEL, PCIE, REGISTRIES, TRTLLM, WorkspaceRegistry


def trtllm_capacity(config: GroupConfig, hidden: int, dtype: torch.dtype, wanted_tokens: int) -> int:
    """Tokens the group's TensorRT-LLM workspace holds (existing), or would hold if created now; 0 if failed."""
    existing = TRTLLM.lookup(config.group_name, hidden, dtype)
    if existing is not None:
        return existing.max_tokens
    if TRTLLM.failure(config.group_name, hidden, dtype) is not None:
        return 0
    return min(wanted_tokens, trtllm_token_cap(config.world_size, hidden))


def pcie_capacity(config: GroupConfig, hidden: int, dtype: torch.dtype, wanted_tokens: int) -> int:
    """Tokens the group's PCIe workspace holds (existing), or would hold if created now; 0 if failed."""
    existing = PCIE.lookup(config.group_name, hidden, dtype)
    if existing is not None:
        return existing.max_tokens
    return 0 if PCIE.failure(config.group_name, hidden, dtype) is not None else wanted_tokens


def one_kernel_capacity(config: GroupConfig, hidden: int, dtype: torch.dtype, wanted_tokens: int) -> int:
    """Tokens the group's one-kernel PCIe workspace holds (existing), or would hold if created now (at most
    ONE_KERNEL_MAX_TOKENS); 0 if failed."""
    existing = ONE_KERNEL.lookup(config.group_name, hidden, dtype)
    if existing is not None:
        return existing.max_tokens
    return 0 if ONE_KERNEL.failure(config.group_name, hidden, dtype) is not None else min(wanted_tokens, ONE_KERNEL_MAX_TOKENS)


def capacities(config: GroupConfig, hidden: int, dtype: torch.dtype, wanted_tokens: int) -> dict[str, int]:
    """Every fused implementation's workspace capacity, as `problem_for`'s keyword arguments."""
    return {"trtllm_max_tokens": trtllm_capacity(config, hidden, dtype, wanted_tokens),
            "pcie_max_tokens": pcie_capacity(config, hidden, dtype, wanted_tokens),
            "one_kernel_max_tokens": one_kernel_capacity(config, hidden, dtype, wanted_tokens)}


def workspace_failures(group_name: str, hidden: int, dtype: torch.dtype) -> list[str]:
    """Why each of the group's workspaces for (hidden, dtype) that could not be made was not."""
    return [f"the {registry.name} workspace could not be made: {failure}"
            for registry in REGISTRIES if (failure := registry.failure(group_name, hidden, dtype))]


def registry_for(mode: FusionMode) -> WorkspaceRegistry:
    """The registry of the workspaces a fused `mode` runs on."""
    if mode.trtllm:
        return TRTLLM
    return ONE_KERNEL if mode is FusionMode.PCIE_ONE_KERNEL else PCIE


def fused_plan(group: dist.ProcessGroup, decision: FusionDecision, workspace) -> CallPlan:
    """The plan of a fused decision on its workspace."""
    if decision.mode.trtllm:
        return TrtllmPlan(group, decision, workspace)
    return (PcieOneKernelPlan if decision.mode is FusionMode.PCIE_ONE_KERNEL else PciePlan)(group, decision, workspace)


def ensure_workspace(config: GroupConfig, group: dist.ProcessGroup, mode: FusionMode, hidden: int, dtype, max_tokens: int):
    """The workspace `mode` needs for (hidden, dtype) with `max_tokens`, created collectively if absent."""
    rank, world_size = dist.get_rank(group), config.world_size
    if mode.trtllm:
        tokens = min(max_tokens, trtllm_token_cap(world_size, hidden))
        return TRTLLM.ensure(group, hidden, dtype, tokens, lambda k: k.create_workspace(group, rank, world_size, tokens, hidden, dtype))
    if mode is FusionMode.PCIE_ONE_KERNEL:
        tokens = min(max_tokens, ONE_KERNEL_MAX_TOKENS)
        return ONE_KERNEL.ensure(group, hidden, dtype, tokens, lambda k: k.create_workspace(group, tokens, hidden))
    settings = config.settings
    return PCIE.ensure(
        group, hidden, dtype, max_tokens,
        lambda k: k.create_workspace(group, max_tokens, hidden, dtype, settings.pcie_profile, settings.pcie_tune_cache),
    )


def decide_plan(group: dist.ProcessGroup, tokens: int, hidden: int, dtype, weight_dtype, residual_dtype,
                weight_offset: float = 0.0) -> CallPlan:
    """Decide (and create the workspace for, outside capture) one call shape on this group."""
    config = config_of(group)
    wanted = config.settings.max_tokens
    problem = problem_for(config, tokens, hidden, dtype, weight_dtype, residual_dtype, weight_offset=weight_offset,
                          **capacities(config, hidden, dtype, wanted))
    decision = decide_call(config, problem, workspace_failures(group.group_name, hidden, dtype))
    if not decision.fused:
        return NcclPlan(group, decision)
    existing = registry_for(decision.mode).lookup(group.group_name, hidden, dtype)
    workspace = existing or ensure_workspace(config, group, decision.mode, hidden, dtype, wanted)
    if workspace is None:  # creation failed on some rank, on all ranks alike: decide again without it
        return decide_plan(group, tokens, hidden, dtype, weight_dtype, residual_dtype, weight_offset)
    if decision.mode is FusionMode.PCIE and not PCIE.kernels.supports(workspace.handle, tokens):
        return NcclPlan(group, FusionDecision(FusionMode.FALLBACK, f"the PCIe kernels do not run {tokens} tokens"))
    return fused_plan(group, decision, workspace)  # the table checked the one kernel's capacity, its workspace's


def plan_call(group: dist.ProcessGroup, tokens: int, hidden: int, dtype, weight_dtype, residual_dtype,
              weight_offset: float = 0.0, weight_in_fp32: bool = False, recipe: Fp8Recipe | None = None) -> CallPlan:
    """`decide_plan`, then (outside capture) one exchange in which every rank reports whether it
    compiled the kernel the plan runs after its all-reduce (for `recipe`: the FP8 one) and which plan
    it made: raises `RankStepFailed` on every rank if any rank failed or planned differently."""
    plan = decide_plan(group, tokens, hidden, dtype, weight_dtype, residual_dtype, weight_offset)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return plan  # prepare() compiled the kernels; the plan is a function of agreed values only
    norm = (weight_offset, weight_in_fp32)
    steps = LocalSteps()
    if isinstance(plan, PcieOneKernelPlan):
        steps.run("compiling the one-kernel all-reduce + RMSNorm (Triton)", compile_one_kernel, plan, dtype, weight_dtype,
                  residual_dtype, norm, recipe)
    elif recipe is not None:
        steps.run("compiling the add-RMSNorm + FP8 kernel (Triton)", compile_fp8_kernel, hidden, dtype, weight_dtype,
                  residual_dtype, norm, recipe, not isinstance(plan, TrtllmPlan))
    elif not isinstance(plan, TrtllmPlan):  # the others run the add-RMSNorm kernel after their all-reduce
        steps.run("compiling the add-RMSNorm kernel (Triton)", compile_norm_kernel, hidden, dtype, weight_dtype,
                  residual_dtype, norm)
    agreed = (type(plan).__name__, plan.decision.mode.value, tokens, hidden, str(dtype), str(weight_dtype), str(residual_dtype),
              norm, recipe)
    reason = agreed_failure(steps.failure, group, agreed)
    if reason is not None:
        raise RankStepFailed(f"planning the fused all-reduce + RMSNorm op for {tokens} tokens x hidden {hidden} failed "
                             f"on every rank of process group {group.group_name!r} because of {reason}")
    return plan


def plan_all_reduce(group: dist.ProcessGroup, tokens: int, hidden: int, dtype) -> CallPlan:
    """The plan of the all-reduce-only op for one call shape: the fused op's decision for it (no residual,
    a weight of x's dtype: nothing of the norm limits the all-reduce), then (outside capture) one exchange
    of every rank's plan, which raises `RankStepFailed` on every rank if they differ."""
    plan = decide_plan(group, tokens, hidden, dtype, dtype, None)
    plan.only_all_reduce = True
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return plan
    steps = LocalSteps()
    if isinstance(plan, PcieOneKernelPlan):
        steps.run("compiling the one-kernel all-reduce (Triton)", compile_one_kernel, plan, dtype, dtype, None, PLAIN_NORM,
                  None, True)
    agreed = (type(plan).__name__, plan.decision.mode.value, tokens, hidden, str(dtype), "all_reduce")
    reason = agreed_failure(steps.failure, group, agreed)
    if reason is not None:
        raise RankStepFailed(f"planning the all-reduce-only op for {tokens} tokens x hidden {hidden} failed on every "
                             f"rank of process group {group.group_name!r} because of {reason}")
    return plan


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _one_row(hidden: int, dtype, weight_dtype, residual_dtype) -> tuple:
    """(row, residual or None, weight, residual_out) of one token, for a compiling call."""
    row = torch.ones(1, hidden, dtype=dtype, device=_device())
    residual = None if residual_dtype is None else torch.ones(1, hidden, dtype=residual_dtype, device=row.device)
    return row, residual, torch.ones(hidden, dtype=weight_dtype, device=row.device), residual_out_buffer(row, residual).clone()


def compile_norm_kernel(hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype, residual_dtype,
                        norm: tuple = PLAIN_NORM) -> None:
    """Compile (once per key) the add-RMSNorm kernel for rows of `hidden` with these dtypes and `norm`
    (weight offset, weight in float32), on a one-row call."""
    row, residual, weight, residual_out = _one_row(hidden, dtype, weight_dtype, residual_dtype)
    add_rmsnorm_into(row, residual, weight, 1e-6, residual_out, torch.empty_like(row), *norm)


def compile_fp8_kernel(hidden: int, dtype: torch.dtype, weight_dtype, residual_dtype, norm: tuple, recipe: Fp8Recipe,
                       normalize: bool) -> None:
    """Compile (once per key) the add-RMSNorm + FP8 kernel (`normalize`) or its quantize-only form, on a one-row call."""
    row, residual, weight, residual_out = _one_row(hidden, dtype, weight_dtype, residual_dtype)
    epilogue = _warm_up_epilogue(recipe, row.device)
    if normalize:
        epilogue.run(row, residual, weight, 1e-6, residual_out, norm)
    else:
        epilogue.quantize(row)


def _warm_up_epilogue(recipe: Fp8Recipe, device: torch.device) -> Fp8Epilogue:
    """The FP8 epilogue a compiling call runs: any values (the kernel takes them as it runs), the norm not returned."""
    return Fp8Epilogue(recipe, None if recipe.dynamic else torch.ones((), device=device), False, WARM_UP_LIMITS)


def compile_one_kernel(plan: PcieOneKernelPlan, dtype: torch.dtype, weight_dtype, residual_dtype, norm: tuple,
                       recipe: Fp8Recipe | None, only_all_reduce: bool = False) -> None:
    """Compile (without launching: a launch is a collective) the one kernel with these dtypes, `norm` and `recipe`
    (the add-RMSNorm + FP8 epilogue), or with no epilogue (`only_all_reduce`), on a one-row call: the kernel
    specializes on no token count."""
    x, residual, weight, residual_out = _one_row(plan.workspace.handle.peers.hidden, dtype, weight_dtype, residual_dtype)
    fp8 = None
    if only_all_reduce:
        epilogue = Epilogue.ALL_REDUCE
    elif recipe is None:
        epilogue = Epilogue.NORM
    else:
        epilogue = Epilogue.FP8
        warm_up = _warm_up_epilogue(recipe, x.device)
        quantized, scales, _ = warm_up.outputs(x)
        fp8 = Fp8Outputs(recipe, warm_up.static_scale, quantized, scales, warm_up.limits)
    normed = None if epilogue is Epilogue.FP8 else torch.empty_like(x)  # as the plan's first call: the norm not returned
    all_reduce_norm_into(plan.workspace.handle.peers, x, epilogue, residual, weight, 1e-6, residual_out, normed, norm[0],
                         norm[1], fp8, compile_only=True)
