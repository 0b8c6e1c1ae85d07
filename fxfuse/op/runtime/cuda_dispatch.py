"""The CUDA kernel of `fxfuse::allreduce_residual_rmsnorm`: pick an implementation once per shape, then run it.

The first call for a (group, tokens, hidden, dtypes) builds a `CallPlan` from the decision table
(`fxfuse.op.decide.policy.decide`) over values every rank agrees on (`fxfuse.op.decide.group_config`); later
calls with that key only look the plan up and run it, so the host cost per call is a dict lookup
plus the kernels' own launches. The plans:
- `TrtllmPlan`: FlashInfer's TensorRT-LLM kernel, one-shot or two-shot (one launch);
- `PciePlan`: FlashInfer's PCIe IPC all-reduce, then the fused add-RMSNorm kernel;
- `NcclPlan`: the group's all-reduce (`_c10d_functional.all_reduce_`, as Inductor issues it), then the
  fused add-RMSNorm kernel. When the caller donated `x` (the op's `donate_x` overloads, which the
  backend emits where Inductor can prove `x` is dead), the all-reduce runs in x's memory unless the
  residual or weight shares it; otherwise on a copy. Where the C++ fallback is installed
  (`fxfuse.op.kernels.native_fallback`), the shape is registered with it and its later calls run the same
  steps in C++, never reaching Python.
A new plan is made outside CUDA-graph capture by agreement: each rank compiles the plan's norm kernel
as a local step, then one exchange carries every rank's outcome and plan, so a failed compile or a
plan that differs between ranks raises the same `RankStepFailed` on every rank instead of leaving one
rank in a collective the others skip. Plans remember their process group: a call whose group name
now means another group (destroyed and re-created) drops all state of that name and decides anew.
Plans are dropped when a group's workspaces change (a new `fxfuse.prepare`). Inputs that are not
16-byte aligned or contiguous are copied first: a copy is the same decision on every rank, where
falling back on one rank only would hang the others.

Importing this module never imports FlashInfer or touches CUDA, so it is safe on CPU-only machines.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxfuse.op.decide.agreement import LocalSteps, RankStepFailed, agreed_failure
from fxfuse.op.decide.group_config import GroupConfig, agreed_config, forget_group, when_group_forgotten
from fxfuse.op.decide.modes import FusionMode
from fxfuse.op.decide.policy import FusionDecision, FusionProblem, decide, trtllm_token_cap
from fxfuse.op.decide.topology import Topology
from fxfuse.op.fp8_recipe import FP8_DTYPE, FP8_MAX, Fp8Recipe, check_fp8_arguments, scale_shape
from fxfuse.op.kernels.add_rmsnorm_fp8_kernel import add_rmsnorm_fp8_into, quantize_fp8_into
from fxfuse.op.kernels.add_rmsnorm_kernel import add_rmsnorm_into
from fxfuse.op.kernels.native_fallback import calls_by_reason, forget_shapes, native_installed, register_shape, reset_counts
from fxfuse.op.reference import check_arguments, resolve_group, writable_in_place
from fxfuse.op.runtime.pcie_kernels import PcieAllReduceKernels, pcie_workspace_bytes
from fxfuse.op.runtime.trtllm_kernels import TrtllmFusionKernels
from fxfuse.op.runtime.workspace import FusionWorkspace, WorkspaceRegistry, workspace_bytes

ALL_REDUCE_ = torch.ops._c10d_functional.all_reduce_.default
WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
KERNEL_ALIGNMENT = 16

#: This process's TensorRT-LLM and PCIe workspaces (see fxfuse/op/runtime/workspace.py for their lifecycle).
TRTLLM = WorkspaceRegistry("TensorRT-LLM", TrtllmFusionKernels, workspace_bytes)
PCIE = WorkspaceRegistry("PCIe", PcieAllReduceKernels, pcie_workspace_bytes)

#: Calls by implementation: {(group, mode, hidden, dtype): n} for fused ones and {reason: n} for the
#: rest. Counted when Python issues the call (eagerly, or once while a CUDA graph is captured; graph
#: replays are not counted). Read with `fusion_stats()`.
_FUSED_CALLS: collections.Counter = collections.Counter()
_FALLBACK_CALLS: collections.Counter = collections.Counter()

PlanKey = tuple  # (group name, tokens, hidden, x / weight / residual dtypes, weight offset, weight in fp32[, FP8 recipe])
#: How the plain op applies its weight: (weight offset, weight in float32) = transformers' order.
PLAIN_NORM = (0.0, False)
_PLANS: dict[PlanKey, "CallPlan"] = {}


def group_config(group: dist.ProcessGroup) -> GroupConfig:
    """The agreed config of `group` on this rank's GPU, exchanged on first use (collective, outside capture)."""
    return agreed_config(group, torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                         else torch.device("cpu"))


def fusion_stats() -> dict[str, dict]:
    """A snapshot of the call counters: {"fused": {(group, mode, hidden, dtype): n}, "fallback": {reason: n}}
    (fallback calls the C++ path ran included)."""
    return {"fused": dict(_FUSED_CALLS), "fallback": dict(_FALLBACK_CALLS + calls_by_reason())}


def reset_fusion_stats() -> None:
    """Zero the call counters."""
    _FUSED_CALLS.clear()
    _FALLBACK_CALLS.clear()
    reset_counts()


def forget_plans(group_name: str | None = None) -> None:
    """Drop the cached plans of `group_name` (all if None): the next call of each shape decides anew."""
    for key in [k for k in _PLANS if group_name is None or k[0] == group_name]:
        del _PLANS[key]
    forget_shapes(group_name)


def _forget_group_state(group_name: str) -> None:
    """All this module's state of a group name that now means another group: plans, C++ shapes, and
    workspaces (retired: captured graphs may still replay them; never used for the new group)."""
    forget_plans(group_name)
    for registry in (TRTLLM, PCIE):
        registry.forget_group(group_name)


when_group_forgotten(_forget_group_state)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` if it is contiguous and 16-byte aligned, else a fresh contiguous copy (which is)."""
    if t.is_contiguous() and t.data_ptr() % KERNEL_ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


@dataclass
class CallPlan:
    """How every call of one key runs; `decision` says which implementation and why."""

    group: dist.ProcessGroup
    decision: FusionDecision
    #: The group's name, read once (the kernels pass it on every call).
    group_name: str = field(init=False)
    #: (counter, key) this plan's calls are counted under, made on the first call (a plan serves one
    #: hidden size and dtype).
    _tally: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.group_name = self.group.group_name

    def count(self, hidden: int, dtype: torch.dtype) -> None:
        """Count one call of this plan (see fusion_stats)."""
        tally = self._tally
        if tally is None:
            if self.decision.fused:
                tally = (_FUSED_CALLS, (self.group_name, self.decision.mode.value, hidden, str(dtype)))
            else:
                tally = (_FALLBACK_CALLS, self.decision.reason)
            self._tally = tally
        tally[0][tally[1]] += 1


@dataclass(frozen=True)
class Fp8Epilogue:
    """The FP8 quantization a call of `allreduce_residual_rmsnorm_fp8` adds after the norm."""

    recipe: Fp8Recipe
    static_scale: torch.Tensor | None
    return_normed: bool
    divisor: float = FP8_MAX

    def run(self, reduced, residual, weight, eps, residual_out, norm: tuple) -> tuple:
        """The add, norm (`norm`: weight offset, weight in float32) and quantization of all-reduced
        `reduced` in one kernel: (quantized, scales, residual_out, normed or an empty tensor)."""
        quantized, scales, normed = self.outputs(reduced)
        add_rmsnorm_fp8_into(reduced, None if residual is None else aligned(residual), aligned(weight), eps, self.recipe,
                             self.static_scale, residual_out, normed if self.return_normed else None, quantized, scales, *norm,
                             divisor=self.divisor)
        return quantized, scales, residual_out, normed

    def quantize(self, normed) -> tuple:
        """(quantized, scales, normed or an empty tensor) of an already normed output."""
        quantized, scales, _ = self.outputs(normed)
        quantize_fp8_into(normed, self.recipe, self.static_scale, quantized, scales, self.divisor)
        return quantized, scales, normed if self.return_normed else normed.new_empty(0)

    def outputs(self, like: torch.Tensor) -> tuple:
        """Fresh (quantized, scales, normed) buffers for rows shaped like `like` (normed empty unless returned)."""
        return (torch.empty_like(like, dtype=FP8_DTYPE), like.new_empty(scale_shape(like.shape, self.recipe), dtype=torch.float32),
                torch.empty_like(like) if self.return_normed else like.new_empty(0))


@dataclass
class NcclPlan(CallPlan):
    """The group's all-reduce (in x's memory when donated), then the fused add-RMSNorm kernel (with the
    FP8 quantization, for the FP8 variant).

    Works on the tensors in their own shape (no reshapes or views: each costs microseconds of host
    time per call, and this runs at every site of every uncaptured step)."""

    def __call__(self, x, residual, weight, eps, x_donated, norm: tuple = PLAIN_NORM):
        reduced, residual_out = self._all_reduce(x, residual, weight, x_donated)
        normed = torch.empty_like(reduced)
        add_rmsnorm_into(reduced, None if residual is None else aligned(residual), aligned(weight), eps, residual_out, normed,
                         *norm)
        self.count(x.shape[-1], x.dtype)
        return normed, residual_out

    def fp8(self, x, residual, weight, eps, x_donated, epilogue: Fp8Epilogue, norm: tuple = PLAIN_NORM):
        reduced, residual_out = self._all_reduce(x, residual, weight, x_donated)
        self.count(x.shape[-1], x.dtype)
        return epilogue.run(reduced, residual, weight, eps, residual_out, norm)

    def _all_reduce(self, x, residual, weight, x_donated):
        """(the all-reduced x, the buffer residual_out goes to: a fresh one when x's own memory was reduced
        or the residual has another dtype)."""
        donated_in_place = writable_in_place(x, x_donated, residual, weight) and x.data_ptr() % KERNEL_ALIGNMENT == 0
        reduced = x if donated_in_place else x.clone(memory_format=torch.contiguous_format)
        ALL_REDUCE_(reduced, "sum", self.group_name)
        WAIT_TENSOR(reduced)
        if residual is not None and residual.dtype != reduced.dtype:
            return reduced, torch.empty_like(reduced, dtype=residual.dtype)
        return reduced, torch.empty_like(reduced) if donated_in_place else reduced


@dataclass
class TrtllmPlan(CallPlan):
    """FlashInfer's TensorRT-LLM kernel: all-reduce, residual add and RMSNorm in one launch (the FP8
    variant then quantizes its norm output in one more kernel: FlashInfer's own FP8 pattern multiplies
    the norm by an approximate reciprocal of the scale, which rounds some values to another code than
    the division the unfused code does)."""

    workspace: FusionWorkspace | None = None

    def __call__(self, x, residual, weight, eps, x_donated, norm: tuple = PLAIN_NORM):
        hidden = x.shape[-1]
        x2d = aligned(x.reshape(-1, hidden))
        handle = self.workspace.handle
        residual2d = handle.zero_residual_for(x2d.shape[0]) if residual is None else aligned(residual.reshape(-1, hidden))
        normed, residual_out = torch.empty_like(x2d), torch.empty_like(x2d)
        TRTLLM.note_use(self.workspace)
        TRTLLM.kernels.allreduce_residual_rmsnorm(
            handle, x2d, residual2d, aligned(weight), eps, normed, residual_out,
            oneshot=self.decision.mode is FusionMode.ONESHOT, weight_offset=norm[0],
        )
        self.count(hidden, x.dtype)
        return normed.view(x.shape), residual_out.view(x.shape)

    def fp8(self, x, residual, weight, eps, x_donated, epilogue: Fp8Epilogue, norm: tuple = PLAIN_NORM):
        normed, residual_out = self(x, residual, weight, eps, x_donated, norm)
        quantized, scales, normed = epilogue.quantize(normed)
        return quantized, scales, residual_out, normed


@dataclass
class PciePlan(CallPlan):
    """FlashInfer's PCIe IPC all-reduce into a fresh buffer, then the fused add-RMSNorm kernel (with the
    FP8 quantization, for the FP8 variant) in it."""

    workspace: FusionWorkspace | None = None

    def __call__(self, x, residual, weight, eps, x_donated, norm: tuple = PLAIN_NORM):
        reduced, residual2d = self._all_reduce(x, residual)
        normed, residual_out = torch.empty_like(reduced), _residual_out(reduced, residual2d)
        add_rmsnorm_into(reduced, residual2d, aligned(weight), eps, residual_out, normed, *norm)
        self.count(x.shape[-1], x.dtype)
        return normed.view(x.shape), residual_out.view(x.shape)

    def fp8(self, x, residual, weight, eps, x_donated, epilogue: Fp8Epilogue, norm: tuple = PLAIN_NORM):
        reduced, residual2d = self._all_reduce(x, residual)
        self.count(x.shape[-1], x.dtype)
        quantized, scales, residual_out, normed = epilogue.run(reduced, residual2d, weight, eps,
                                                               _residual_out(reduced, residual2d), norm)
        shape = x.shape
        return (quantized.view(shape), scales.view(*shape[:-1], -1) if scales.numel() else scales, residual_out.view(shape),
                normed.view(shape) if normed.numel() else normed)

    def _all_reduce(self, x, residual):
        """(x all-reduced over the group into a fresh [tokens, hidden] buffer, the residual as [tokens, hidden])."""
        hidden = x.shape[-1]
        x2d = aligned(x.reshape(-1, hidden))
        reduced = torch.empty_like(x2d)
        PCIE.note_use(self.workspace)
        PCIE.kernels.all_reduce(self.workspace.handle, x2d, reduced)
        return reduced, None if residual is None else aligned(residual.reshape(-1, hidden))


def _residual_out(reduced: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """Where residual_out goes after an out-of-place all-reduce: the reduced buffer itself, or a fresh
    one of the residual's dtype when that differs (a float32 residual stream)."""
    if residual is not None and residual.dtype != reduced.dtype:
        return torch.empty_like(reduced, dtype=residual.dtype)
    return reduced


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


def problem_for(config: GroupConfig, tokens: int, hidden: int, dtype, weight_dtype, residual_dtype, wanted_tokens: int,
                weight_offset: float = 0.0) -> FusionProblem:
    """The decision table's input for one call shape on this group."""
    return FusionProblem(
        sm=config.sm, world_size=config.world_size, dtype=dtype, hidden_size=hidden, num_tokens=tokens,
        weight_dtype=weight_dtype, residual_dtype=residual_dtype, topology=config.topology,
        flashinfer=config.flashinfer, weight_offset=weight_offset,
        trtllm_max_tokens=trtllm_capacity(config, hidden, dtype, wanted_tokens),
        pcie_max_tokens=pcie_capacity(config, hidden, dtype, wanted_tokens),
    )


def ensure_workspace(config: GroupConfig, group: dist.ProcessGroup, mode: FusionMode, hidden: int, dtype, max_tokens: int):
    """The workspace `mode` needs for (hidden, dtype) with `max_tokens`, created collectively if absent."""
    rank, world_size = dist.get_rank(group), config.world_size
    if mode.trtllm:
        tokens = min(max_tokens, trtllm_token_cap(world_size, hidden))
        return TRTLLM.ensure(group, hidden, dtype, tokens, lambda k: k.create_workspace(group, rank, world_size, tokens, hidden, dtype))
    settings = config.settings
    return PCIE.ensure(
        group, hidden, dtype, max_tokens,
        lambda k: k.create_workspace(group, max_tokens, hidden, dtype, settings.pcie_profile, settings.pcie_tune_cache),
    )


def decide_plan(group: dist.ProcessGroup, tokens: int, hidden: int, dtype, weight_dtype, residual_dtype,
                weight_offset: float = 0.0) -> CallPlan:
    """Decide (and create the workspace for, outside capture) one call shape on this group."""
    config = group_config(group)
    wanted = config.settings.max_tokens
    decision = decide(problem_for(config, tokens, hidden, dtype, weight_dtype, residual_dtype, wanted, weight_offset),
                      config.settings, config.thresholds.lookup(config.gpu, config.world_size, hidden, dtype, config.topology.value))
    if not decision.fused:
        decision = FusionDecision(FusionMode.FALLBACK, decision.reason + _context(config, group.group_name, hidden, dtype))
    if decision.fused:
        existing = (TRTLLM if decision.mode.trtllm else PCIE).lookup(group.group_name, hidden, dtype)
        workspace = existing or ensure_workspace(config, group, decision.mode, hidden, dtype, wanted)
        if workspace is None:  # creation failed on some rank, on all ranks alike: decide again without it
            return decide_plan(group, tokens, hidden, dtype, weight_dtype, residual_dtype, weight_offset)
        if decision.mode is FusionMode.PCIE and not PCIE.kernels.supports(workspace.handle, tokens):
            return NcclPlan(group, FusionDecision(FusionMode.FALLBACK, f"the PCIe kernels do not run {tokens} tokens"))
        return (PciePlan if decision.mode is FusionMode.PCIE else TrtllmPlan)(group, decision, workspace)
    return NcclPlan(group, decision)


def _context(config: GroupConfig, group_name: str, hidden: int, dtype: torch.dtype) -> str:
    """What a fallback's reason should also say: why a workspace could not be made, or why the
    group's topology is what it is (a failed link probe, several hosts)."""
    failures = [f"the {registry.name} workspace could not be made: {failure}"
                for registry in (TRTLLM, PCIE) if (failure := registry.failure(group_name, hidden, dtype))]
    if config.topology in (Topology.NONE, Topology.NVLINK) and config.world_size > 1:
        failures.append(config.topology_reason)
    return f" ({'; '.join(failures)})" if failures else ""


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
    if recipe is not None:
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


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _one_row(hidden: int, dtype, weight_dtype, residual_dtype) -> tuple:
    """(row, residual or None, weight, residual_out) of one token, for a compiling call."""
    row = torch.ones(1, hidden, dtype=dtype, device=_device())
    residual = None if residual_dtype is None else torch.ones(1, hidden, dtype=residual_dtype, device=row.device)
    return row, residual, torch.ones(hidden, dtype=weight_dtype, device=row.device), _residual_out(row, residual).clone()


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
    static_scale = None if recipe.dynamic else torch.ones((), device=row.device)
    epilogue = Fp8Epilogue(recipe, static_scale, False)
    if normalize:
        epilogue.run(row, residual, weight, 1e-6, residual_out, norm)
    else:
        epilogue.quantize(row)


def _plan_for(key: tuple, group_name: str) -> CallPlan:
    """The cached plan of `key` (`PlanKey`), made by agreement on its first call, or again when the
    group name now means another group."""
    plan = _PLANS.get(key)
    group = resolve_group(group_name)
    if plan is None or plan.group is not group:
        if plan is not None:  # the name now means another group: nothing decided for the old one holds
            forget_group(group_name)
        plan = _PLANS[key] = plan_call(group, *key[1:])
        runs_in_cpp = len(key) == 8 and key[6:] == PLAIN_NORM and key[5] in (None, key[3])  # the plain norm only
        if type(plan) is NcclPlan and native_installed() and runs_in_cpp:
            register_shape(*key[:6], plan.decision.reason)  # later calls of this shape stay in C++
    return plan


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


def plan_key(group_name: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             norm: tuple = PLAIN_NORM, recipe: Fp8Recipe | None = None) -> PlanKey:
    """The key a call's plan is cached under (`PlanKey`)."""
    hidden = x.shape[-1]
    key = (group_name, x.numel() // hidden if hidden else 0, hidden, x.dtype, weight.dtype,
           None if residual is None else residual.dtype, *norm)
    return key if recipe is None else (*key, recipe)


def allreduce_residual_rmsnorm_fp8_cuda(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, group_name: str, recipe: Fp8Recipe,
    static_scale: torch.Tensor | None, return_normed: bool, x_donated: bool = False, weight_offset: float = 0.0,
    weight_in_fp32: bool = False, divisor: float = FP8_MAX,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 variant on CUDA tensors (`fxfuse.op.fp8_schema`): the same plans, with the quantization
    after the norm; (quantized, scales, residual_out, normed or an empty tensor)."""
    check_arguments(x, residual, weight, weight_in_fp32)
    check_fp8_arguments(x.shape, recipe, static_scale, x.device)
    norm = (weight_offset, weight_in_fp32)
    epilogue = Fp8Epilogue(recipe, static_scale, return_normed, divisor)
    plan = _plan_for(plan_key(group_name, x, residual, weight, norm, recipe), group_name)
    return plan.fp8(x, residual, weight, eps, x_donated, epilogue, norm)
