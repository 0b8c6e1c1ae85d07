"""The fused ops' CUDA kernels: look up the plan cached for the call's shape, then run it.

A call reads in one direction: its key (`plan_key`: group, tokens, hidden size, dtypes, norm
arguments, FP8 recipe), the plan cached under it, then the plan's launch (`fxfuse.op.runtime.plans`).
The first call of a key makes its plan (`fxfuse.op.runtime.planning.plan_call`: the decision of
`fxfuse.op.decide` over values every rank agrees on, the workspace it needs, one agreement round);
later calls only look it up and run it, so the host cost per call is a dict lookup plus the kernels'
own launches. Where the C++ fallback is installed (`fxfuse.op.kernels.native_fallback`), an
`NcclPlan`'s shape is registered with it and its later calls run the same steps in C++, never reaching
Python. Plans remember their process group: a call whose group name now means another group
(destroyed and re-created) drops all state of that name and decides anew. Plans are dropped when a
group's workspaces change (a new `fxfuse.prepare`).

Importing this module never imports FlashInfer or touches CUDA, so it is safe on CPU-only machines.
"""

from __future__ import annotations

import torch

from fxfuse.op.decide.group_config import forget_group, when_group_forgotten
from fxfuse.op.fp8_recipe import Fp8Limits, Fp8Recipe, check_fp8_arguments
from fxfuse.op.kernels.native_fallback import forget_shapes, native_installed, register_all_reduce_shape, register_shape
from fxfuse.op.reference import check_arguments, resolve_group
from fxfuse.op.runtime.planning import plan_all_reduce, plan_call
from fxfuse.op.runtime.plans import PLAIN_NORM, CallPlan, Fp8Epilogue, NcclPlan
from fxfuse.op.runtime.workspace import REGISTRIES

PlanKey = tuple  # (group name, tokens, hidden, x / weight / residual dtypes, weight offset, weight in fp32[, FP8 recipe])
#: The last element of the all-reduce-only op's keys: (group name, tokens, hidden, dtype, ALL_REDUCE_ONLY).
ALL_REDUCE_ONLY = "all_reduce"
_PLANS: dict[PlanKey, CallPlan] = {}


def forget_plans(group_name: str | None = None) -> None:
    """Drop the cached plans of `group_name` (all if None): the next call of each shape decides anew."""
    for key in [k for k in _PLANS if group_name is None or k[0] == group_name]:
        del _PLANS[key]
    forget_shapes(group_name)


def _forget_group_state(group_name: str) -> None:
    """All of the runtime's state of a group name that now means another group: plans, C++ shapes, and
    workspaces (retired: captured graphs may still replay them; never used for the new group)."""
    forget_plans(group_name)
    for registry in REGISTRIES:
        registry.forget_group(group_name)


when_group_forgotten(_forget_group_state)


def plan_key(group_name: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             norm: tuple = PLAIN_NORM, recipe: Fp8Recipe | None = None) -> PlanKey:
    """The key a call's plan is cached under (`PlanKey`)."""
    hidden = x.shape[-1]
    key = (group_name, x.numel() // hidden if hidden else 0, hidden, x.dtype, weight.dtype,
           None if residual is None else residual.dtype, *norm)
    return key if recipe is None else (*key, recipe)


def _plan_for(key: tuple, group_name: str) -> CallPlan:
    """The cached plan of `key` (`PlanKey`), made by agreement on its first call, or again when the
    group name now means another group."""
    plan = _PLANS.get(key)
    group = resolve_group(group_name)
    if plan is None or plan.group is not group:
        if plan is not None:  # the name now means another group: nothing decided for the old one holds
            forget_group(group_name)
        if key[-1] == ALL_REDUCE_ONLY:
            plan = _PLANS[key] = plan_all_reduce(group, *key[1:-1])
            if type(plan) is NcclPlan and native_installed():
                register_all_reduce_shape(*key[:-1])  # later calls of this shape stay in C++
            return plan
        plan = _PLANS[key] = plan_call(group, *key[1:])
        runs_in_cpp = len(key) == 8 and key[6:] == PLAIN_NORM and key[5] in (None, key[3])  # the plain norm only
        if type(plan) is NcclPlan and native_installed() and runs_in_cpp:
            register_shape(*key[:6], plan.decision.reason)  # later calls of this shape stay in C++
    return plan


def all_reduce_cuda(x: torch.Tensor, group_name: str, in_place: bool) -> torch.Tensor:
    """The all-reduce-only op on a CUDA tensor (`fxfuse.op.all_reduce_schema`): the plan cached for its
    shape; returns the sum (`x` itself when `in_place`)."""
    hidden = x.shape[-1]
    key = (group_name, x.numel() // hidden if hidden else 0, hidden, x.dtype, ALL_REDUCE_ONLY)
    return _plan_for(key, group_name).all_reduce(x, in_place)


def allreduce_residual_rmsnorm_cuda(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, group_name: str, x_donated: bool = False,
    weight_offset: float = 0.0, weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on CUDA tensors: look up (or build) the plan for this shape and run it.

    `x_donated`: the caller allows x's memory to be overwritten (the `donate_x` overloads).
    """
    check_arguments(x, residual, weight, weight_in_fp32)
    norm = (weight_offset, weight_in_fp32)
    return _plan_for(plan_key(group_name, x, residual, weight, norm), group_name)(x, residual, weight, eps, x_donated, norm)


def allreduce_residual_rmsnorm_fp8_cuda(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, group_name: str, recipe: Fp8Recipe,
    static_scale: torch.Tensor | None, return_normed: bool, x_donated: bool = False, weight_offset: float = 0.0,
    weight_in_fp32: bool = False, limits: Fp8Limits = Fp8Limits(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 variant on CUDA tensors (`fxfuse.op.fp8_schema`): the same plans, with the quantization
    after the norm; (quantized, scales, residual_out, normed or an empty tensor)."""
    check_arguments(x, residual, weight, weight_in_fp32)
    check_fp8_arguments(x.shape, recipe, static_scale, x.device)
    limits.bounds(recipe)  # before any rank all-reduces: a bound the recipe takes from the graph must be given
    norm = (weight_offset, weight_in_fp32)
    epilogue = Fp8Epilogue(recipe, static_scale, return_normed, limits)
    plan = _plan_for(plan_key(group_name, x, residual, weight, norm, recipe), group_name)
    return plan.fp8(x, residual, weight, eps, x_donated, epilogue, norm)
