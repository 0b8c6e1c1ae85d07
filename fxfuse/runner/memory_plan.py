"""The memory plan: how many bytes one rank needs, before anything is allocated, and whether it fits.

`plan_memory(config, ...)` adds up, per rank:
- weights: the parameters of the model as built for this tp and weight format, counted on the meta
  device (so the plan follows the model code: FP8 block scales, INT4 packed words and group scales,
  kv_b_proj held in the model dtype, the float32 router, replicated and split tensors);
- KV cache: MLA caches the shared latent and rotary key of every position on every rank:
  layers x batch x context x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, plus the float32
  rotary tables (2 x context x qk_rope_head_dim / 2);
- fused-op workspace, at tp > 1 with backend fxfuse on CUDA: on NVLink / NVSwitch GPUs
  (`interconnect="nvlink"`) the TensorRT-LLM kernel's, `fxfuse.op.runtime.workspace.workspace_bytes` for the
  tokens it is sized for, capped as the op caps it (`fxfuse.op.decide.policy.trtllm_token_cap`: its 32-bit
  offsets; larger calls run the NCCL fallback); on PCIe-only GPUs (`interconnect="pcie"`) FlashInfer's
  PCIe all-reduce's, `fxfuse.op.runtime.pcie_kernels.pcie_workspace_bytes`, plus the one-kernel path's
  (`fxfuse.op.runtime.one_kernel_pcie.one_kernel_workspace_bytes`, at most its 256 tokens);
- activations: the largest transient of the widest step (batch x step tokens), an estimate: the
  attention scores over the whole static cache (scores and masked scores in the dtype, float32
  softmax, probabilities in the dtype: batch x local heads x tokens x context x (3 x dtype + 4)), or
  the logits (local slice, gathered, float32), or the MLP / expert intermediates, whichever is
  largest, plus the residual stream (4 float32 copies of batch x tokens x hidden);
- CUDA-graph outputs: every captured width keeps its float32 logits (batch x width x vocab x 4) in
  the graphs' shared pool;
- the `--compare eager` reference, when the run holds one: a second copy of the weights and KV cache;
- a reserve: on CUDA a fixed one for the CUDA context, cuBLAS/NCCL workspaces and the compiler
  (RESERVE_BYTES); on CPU the rank's process itself (CPU_RANK_RESERVE_BYTES, measured).
On CPU (`device="cpu"`) there is no workspace and no CUDA graph, and every rank shares the machine's
memory: what must fit is tp x the per-rank total. `MemoryPlan.check(available)` raises
`PlanError` when that exceeds `available` bytes, naming the largest parts and what would fit instead (a
smaller batch or context, more ranks (fewer on CPU), another format, no eager reference). Every size is printed in GB
(1e9 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fxfuse.models.config import ModelConfig
from fxfuse.models.quant.scheme import WEIGHT_FORMATS, QuantScheme

GIB = 2**30
GB = 10**9
#: CUDA context, cuBLAS and NCCL workspaces, Inductor/Triton compile state: not counted elsewhere.
RESERVE_BYTES = 2 * GIB
#: On CPU, what each rank's process holds besides its plan: the interpreter, torch, gloo, dynamo's and
#: the compiler's state (and, with Inductor, its share of the compile workers and the C++ compiler).
#: Measured (resident memory sampled every 0.2 s, torch 2.13, 2 cores): a rank of the built-in job (a plan
#: under 0.01 GB) peaked at 0.50 GB with the eager inner compiler and at 0.87 GB per rank with Inductor
#: (ranks, compile workers and compiler together, over 2 ranks); DeepSeek-V3 with `--layers 1` in bf16 at
#: tp 2 peaked at 3.01 GB per rank for a planned 2.48 GB, the same 0.5 GB on top. Rounded up to 1 GB.
#: Without it, a run passed the check with about 1 GB to spare and was then killed for memory.
CPU_RANK_RESERVE_BYTES = GB
#: Tensor-parallel sizes tried when saying what would fit.
TP_CHOICES = (1, 2, 4, 8, 16)


class PlanError(ValueError):
    """A run whose memory plan does not fit the GPU; the message says what would."""


@dataclass(frozen=True)
class PlanInputs:
    """What the plan depends on (identical on all ranks)."""

    tp: int
    weights: str
    dtype: torch.dtype
    batch: int
    context: int
    step_tokens: int
    graph_widths: tuple[int, ...] = ()
    fused_workspace: bool = False
    fp8_block: tuple[int, int] = (128, 128)
    int4_group: int = 32
    device: str = "cuda"
    interconnect: str = "nvlink"
    reference_copy: bool = False


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank bytes of each part of a run (see the module docstring for how each is counted).

    `workspace_tokens` is the token count the fused-op workspace holds (0 without one), `hidden_size`
    the model's (what `fxfuse tune pcie` needs to tune that workspace)."""

    model: str
    inputs: PlanInputs
    weight_bytes: int
    kv_cache_bytes: int
    workspace_bytes: int
    activation_bytes: int
    graph_output_bytes: int
    reference_bytes: int = 0
    reserve_bytes: int = RESERVE_BYTES
    workspace_tokens: int = 0
    hidden_size: int = 0

    @property
    def parts(self) -> dict[str, int]:
        """Part name -> bytes, in the order printed (the eager reference only when the run holds one)."""
        parts = {"weights": self.weight_bytes, "KV cache": self.kv_cache_bytes, "fused-op workspace": self.workspace_bytes,
                 "activations (est.)": self.activation_bytes, "CUDA-graph outputs": self.graph_output_bytes}
        if self.inputs.reference_copy:
            parts["eager reference"] = self.reference_bytes
        parts["reserve"] = self.reserve_bytes
        return parts

    @property
    def total_bytes(self) -> int:
        """Sum of every part: one rank's bytes."""
        return sum(self.parts.values())

    @property
    def needed_bytes(self) -> int:
        """What must fit in the memory checked: one GPU's share on CUDA, every rank's on CPU (one machine)."""
        return self.total_bytes * (self.inputs.tp if self.inputs.device == "cpu" else 1)

    def table(self, available: int | None = None) -> str:
        """The plan as aligned text lines (GB = 1e9 bytes), what it assumed, and the verdict against
        `available` bytes."""
        i = self.inputs
        lines = [f"memory plan per rank: {self.model}, tp={i.tp}, weights {i.weights}, {str(i.dtype).removeprefix('torch.')}, "
                 f"batch {i.batch}, context {i.context}, step of {i.step_tokens} tokens per sequence"]
        lines += [f"  {name:20s} {bytes_ / GB:10.2f} GB" for name, bytes_ in self.parts.items()]
        lines.append(f"  {'total':20s} {self.total_bytes / GB:10.2f} GB")
        if i.device == "cpu":
            lines.append(f"  {'all ' + str(i.tp) + ' ranks':20s} {self.needed_bytes / GB:10.2f} GB (one machine)")
        if available is not None:
            verdict = "fits" if self.needed_bytes <= available else "does NOT fit"
            lines.append(f"  {verdict} in {available / GB:.2f} GB")
        lines += [f"- {line}" for line in self.assumptions()]
        return "\n".join(lines)

    def assumptions(self) -> list[str]:
        """What the plan assumed, one sentence each: the fused op's workspace and the reserve."""
        i = self.inputs
        if i.device == "cpu":
            return ["CPU: the fused op needs no workspace and there is no CUDA graph; all ranks share this machine",
                    f"reserve: {self.reserve_bytes / GB:.2f} GB per rank for its process (Python, torch, gloo, the "
                    "compiler), as measured on a rank of the built-in job"]
        if not self.workspace_bytes:
            workspace = "fused-op workspace: none (tp=1, or not backend fxfuse)"
        elif i.interconnect == "pcie":
            workspace = (f"fused-op workspace: FlashInfer's PCIe all-reduce (PCIe-only GPUs) for {self.workspace_tokens} tokens; "
                         f"tune it once per machine: fxfuse tune pcie --world-size {i.tp} --hidden {self.hidden_size} "
                         f"--max-tokens {self.workspace_tokens}")
        else:
            workspace = (f"fused-op workspace: FlashInfer's TensorRT-LLM kernel (NVLink / NVSwitch GPUs) for "
                         f"{self.workspace_tokens} tokens; PCIe-only GPUs use FlashInfer's PCIe all-reduce instead "
                         "(--interconnect pcie; tune it with `fxfuse tune pcie`)")
        reserve = f"reserve: a fixed {self.reserve_bytes / GB:.2f} GB for the CUDA context, cuBLAS and NCCL workspaces and the compiler"
        return [workspace, reserve]

    def check(self, available: int, config: ModelConfig) -> None:
        """Raise PlanError (with what would fit) if the plan needs more than `available` bytes (per GPU on
        CUDA, for all ranks on CPU)."""
        if self.needed_bytes <= available:
            return
        largest = sorted(self.parts.items(), key=lambda kv: -kv[1])[:3]
        parts = ", ".join(f"{name} {b / GB:.1f} GB" for name, b in largest)
        suggestions = alternatives(config, self.inputs, available, self.model)
        advice = "; ".join(suggestions) if suggestions else "nothing close to these settings fits"
        where = (f"of this machine's memory ({self.inputs.tp} ranks x {self.total_bytes / GB:.1f} GB: {parts})"
                 if self.inputs.device == "cpu" else f"per rank ({parts})")
        raise PlanError(f"{self.model} needs {self.needed_bytes / GB:.1f} GB {where}, more than the "
                        f"{available / GB:.1f} GB available; would fit: {advice}")


def plan_memory(config: ModelConfig, inputs: PlanInputs, model: str = "model") -> MemoryPlan:
    """The per-rank memory plan of running `config` with `inputs` (no tensor is allocated)."""
    weights = weight_bytes(config, inputs.tp, inputs.weights, inputs.dtype, inputs.fp8_block, inputs.int4_group)
    return _plan_with_weights(config, inputs, model, weights)


def _plan_with_weights(config: ModelConfig, inputs: PlanInputs, model: str, weights: int) -> MemoryPlan:
    d = inputs.dtype.itemsize
    cuda = inputs.device == "cuda"
    tokens, workspace = _workspace(config, inputs) if cuda else (0, 0)
    outputs = sum(inputs.batch * w * config.vocab_size * 4 for w in inputs.graph_widths)
    kv_cache = kv_cache_bytes(config, inputs.batch, inputs.context, inputs.dtype)
    return MemoryPlan(model, inputs, weights, kv_cache, workspace,
                      activation_bytes(config, inputs.tp, inputs.batch, inputs.step_tokens, inputs.context, d), outputs,
                      reference_bytes=weights + kv_cache if inputs.reference_copy else 0,
                      reserve_bytes=RESERVE_BYTES if cuda else CPU_RANK_RESERVE_BYTES, workspace_tokens=tokens,
                      hidden_size=config.hidden_size)


def _workspace(config: ModelConfig, inputs: PlanInputs) -> tuple[int, int]:
    """(tokens, bytes) of one rank's fused-op workspace: none at tp=1 or without backend fxfuse; else
    the TensorRT-LLM kernel's, capped as the op caps it, or on PCIe both the PCIe all-reduce's and the one-kernel
    path's (a tuning file may choose either per token count, so both may be made)."""
    if not inputs.fused_workspace or inputs.tp == 1:
        return 0, 0
    tokens = inputs.batch * inputs.step_tokens
    if inputs.interconnect == "pcie":
        from fxfuse.op.runtime.one_kernel_pcie import ONE_KERNEL_MAX_TOKENS, one_kernel_workspace_bytes
        from fxfuse.op.runtime.pcie_kernels import pcie_workspace_bytes

        one_kernel = one_kernel_workspace_bytes(inputs.tp, min(tokens, ONE_KERNEL_MAX_TOKENS), config.hidden_size, inputs.dtype)
        return tokens, pcie_workspace_bytes(inputs.tp, tokens, config.hidden_size, inputs.dtype) + one_kernel
    from fxfuse.op.decide.policy import trtllm_token_cap
    from fxfuse.op.runtime.workspace import workspace_bytes

    tokens = min(tokens, trtllm_token_cap(inputs.tp, config.hidden_size))
    return tokens, workspace_bytes(inputs.tp, tokens, config.hidden_size, inputs.dtype)


def kv_cache_bytes(config: ModelConfig, batch: int, context: int, dtype: torch.dtype) -> int:
    """Static MLA cache of every layer (replicated on each rank) plus the float32 rotary tables."""
    per_position = config.kv_lora_rank + config.qk_rope_head_dim
    cache = config.num_hidden_layers * batch * context * per_position * dtype.itemsize
    return cache + 2 * context * (config.qk_rope_head_dim // 2) * 4


def activation_bytes(config: ModelConfig, tp: int, batch: int, tokens: int, context: int, itemsize: int) -> int:
    """Estimated peak transient memory of one step of `tokens` tokens per sequence (module docstring)."""
    rows = batch * tokens
    heads = config.num_attention_heads // tp
    attention = batch * heads * tokens * context * (3 * itemsize + 4)
    logits = rows * config.vocab_size * (itemsize // tp + itemsize + 4)
    dense = rows * (config.intermediate_size // tp) * 3 * itemsize if config.first_k_dense_replace else 0
    expert_rows = rows * config.num_experts_per_tok
    experts = expert_rows * ((config.moe_intermediate_size // tp) * 3 * itemsize + config.hidden_size * 8)
    return max(attention, logits, dense, experts) + 4 * rows * config.hidden_size * 4


def weight_bytes(config: ModelConfig, tp: int, weights: str, dtype: torch.dtype,
                 fp8_block: tuple[int, int] = (128, 128), int4_group: int = 32) -> int:
    """Bytes of one rank's parameters: the model built on the meta device for this tp and format."""
    model = meta_model(config, tp, dtype, QuantScheme(weights, fp8_block=fp8_block, int4_group=int4_group))
    seen, total = set(), 0
    for param in model.parameters():  # tied embeddings count once
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel() * param.element_size()
    return total


def meta_model(config: ModelConfig, tp: int, dtype: torch.dtype, quant: QuantScheme):
    """Rank 0's shard of the model at tensor-parallel size `tp`, built on the meta device (no memory, no
    process group): its parameters have the shapes, dtypes and formats a real rank would load."""
    from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(config, meta_context(tp), dtype=dtype, device="meta", max_batch=1, max_seq_len=1, quant=quant)


def meta_context(tp: int):
    """A `ParallelContext` of rank 0 at size `tp` for models built on the meta device (which only read
    rank and world size, never the group)."""
    from fxfuse.models.parallel import ParallelContext

    return ParallelContext(rank=0, world_size=tp, group=_NO_GROUP if tp > 1 else None)


#: Stands in for a process group: building the model only reads rank and world size.
_NO_GROUP = object()


def alternatives(config: ModelConfig, inputs: PlanInputs, available: int, model: str) -> list[str]:
    """Nearby settings that fit in `available` bytes: a smaller batch or context, more ranks (on CPU, where
    every rank shares the machine: fewer), other formats, no eager reference."""
    weights_at = {}

    def weights_for(tp: int, fmt: str) -> int | None:
        if (tp, fmt) not in weights_at:
            try:
                config.check_tensor_parallel(tp)
                weights_at[(tp, fmt)] = weight_bytes(config, tp, fmt, inputs.dtype, inputs.fp8_block, inputs.int4_group)
            except ValueError:
                weights_at[(tp, fmt)] = None
        return weights_at[(tp, fmt)]

    def fits(**changes) -> bool:
        changed = replace(inputs, **changes)
        weights = weights_for(changed.tp, changed.weights)
        return weights is not None and _plan_with_weights(config, changed, model, weights).needed_bytes <= available

    found = []
    batch = _largest(lambda b: fits(batch=b), inputs.batch - 1)
    if batch:
        found.append(f"--batch {batch} (at this context)")
    context = _largest(lambda c: fits(context=c), inputs.context - 1, floor=max(inputs.step_tokens, *inputs.graph_widths, 1))
    if context:
        found.append(f"a context of {context} positions (at this batch)")
    if inputs.device == "cpu":  # every rank on this machine, each with its process's reserve: fewer ranks need less
        fewer_ranks = [tp for tp in TP_CHOICES if tp < inputs.tp and fits(tp=tp)]
        if fewer_ranks:
            found.append(f"--tp {fewer_ranks[-1]} (fewer processes on this machine)")
    else:
        more_ranks = [tp for tp in TP_CHOICES if tp > inputs.tp and fits(tp=tp)]
        if more_ranks:
            found.append(f"--tp {more_ranks[0]}")
    formats = [fmt for fmt in _formats_of(model) if fmt != inputs.weights and fits(weights=fmt)]
    if formats:
        found.append("--weights " + " or ".join(formats))
    if inputs.reference_copy and fits(reference_copy=False):
        found.append("--compare none (no eager copy of the model)")
    return found


def _formats_of(model: str) -> tuple[str, ...]:
    """The weight formats worth suggesting for `model`: for a preset, bf16 and the formats its checkpoints are
    published in (DeepSeek-V3's INT4 is no checkpoint anyone ships); for another model, every format."""
    from fxfuse.models.presets import PUBLISHED_FORMATS

    return ("bf16", *PUBLISHED_FORMATS[model]) if model in PUBLISHED_FORMATS else WEIGHT_FORMATS


def _largest(ok, high: int, floor: int = 1) -> int | None:
    """The largest value in [floor, high] for which `ok` holds (ok is monotone: true below a bound), or None."""
    if high < floor or not ok(floor):
        return None
    low = floor
    while low < high:  # invariant: ok(low)
        mid = (low + high + 1) // 2
        low, high = (mid, high) if ok(mid) else (low, mid - 1)
    return low


def device_memory_bytes(device_index: int = 0) -> int:
    """Total memory of CUDA device `device_index` (what a rank may plan for)."""
    return torch.cuda.get_device_properties(device_index).total_memory
