"""The memory plan: how many bytes one rank needs, before anything is allocated, and whether it fits.

`plan_memory(config, ...)` adds up, per rank:
- weights: the parameters of the model as built for this tp and weight format, counted on the meta
  device (so the plan follows the model code: FP8 block scales, INT4 packed words and group scales,
  kv_b_proj held in the model dtype, the float32 router, replicated and split tensors);
- KV cache: MLA caches the shared latent and rotary key of every position on every rank:
  layers x batch x context x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, plus the float32
  rotary tables (2 x context x qk_rope_head_dim / 2);
- fused-op workspace: `fxfuse.op.workspace.workspace_bytes(tp, max_tokens, hidden, dtype)` at tp > 1
  with backend fxfuse (FlashInfer's buffers and the zero residual);
- activations: the largest transient of the widest step (batch x step tokens), an estimate: the
  attention scores over the whole static cache (scores and masked scores in the dtype, float32
  softmax, probabilities in the dtype: batch x local heads x tokens x context x (3 x dtype + 4)), or
  the logits (local slice, gathered, float32), or the MLP / expert intermediates, whichever is
  largest, plus the residual stream (4 float32 copies of batch x tokens x hidden);
- CUDA-graph outputs: every captured width keeps its float32 logits (batch x width x vocab x 4) in
  the graphs' shared pool;
- a fixed reserve for the CUDA context, cuBLAS/NCCL workspaces and the compiler (RESERVE_BYTES).
`MemoryPlan.check(available)` raises `PlanError` when the total exceeds `available` bytes, naming the
largest parts and what would fit instead (a smaller batch or context, more ranks, another format).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fxfuse.models.config import ModelConfig
from fxfuse.models.quant.scheme import WEIGHT_FORMATS, QuantScheme

GIB = 2**30
#: CUDA context, cuBLAS and NCCL workspaces, Inductor/Triton compile state: not counted elsewhere.
RESERVE_BYTES = 2 * GIB
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


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank bytes of each part of a run (see the module docstring for how each is counted)."""

    model: str
    inputs: PlanInputs
    weight_bytes: int
    kv_cache_bytes: int
    workspace_bytes: int
    activation_bytes: int
    graph_output_bytes: int
    reserve_bytes: int = RESERVE_BYTES

    @property
    def parts(self) -> dict[str, int]:
        """Part name -> bytes, in the order printed."""
        return {"weights": self.weight_bytes, "KV cache": self.kv_cache_bytes, "fused-op workspace": self.workspace_bytes,
                "activations (est.)": self.activation_bytes, "CUDA-graph outputs": self.graph_output_bytes,
                "reserve": self.reserve_bytes}

    @property
    def total_bytes(self) -> int:
        """Sum of every part."""
        return sum(self.parts.values())

    def table(self, available: int | None = None) -> str:
        """The plan as aligned text lines (GB = 1e9 bytes), with the verdict against `available` bytes."""
        i = self.inputs
        lines = [f"memory plan per rank: {self.model}, tp={i.tp}, weights {i.weights}, {str(i.dtype).removeprefix('torch.')}, "
                 f"batch {i.batch}, context {i.context}, step of {i.step_tokens} tokens per sequence"]
        lines += [f"  {name:20s} {bytes_ / 1e9:10.2f} GB" for name, bytes_ in self.parts.items()]
        lines.append(f"  {'total':20s} {self.total_bytes / 1e9:10.2f} GB")
        if available is not None:
            verdict = "fits" if self.total_bytes <= available else "does NOT fit"
            lines.append(f"  {verdict} in {available / 1e9:.2f} GB")
        return "\n".join(lines)

    def check(self, available: int, config: ModelConfig) -> None:
        """Raise PlanError (with what would fit) if the plan needs more than `available` bytes per rank."""
        if self.total_bytes <= available:
            return
        largest = sorted(self.parts.items(), key=lambda kv: -kv[1])[:3]
        parts = ", ".join(f"{name} {b / 1e9:.1f} GB" for name, b in largest)
        suggestions = alternatives(config, self.inputs, available, self.model)
        advice = "; ".join(suggestions) if suggestions else "nothing close to these settings fits"
        raise PlanError(f"{self.model} needs {self.total_bytes / 1e9:.1f} GB per rank ({parts}), more than the "
                        f"{available / 1e9:.1f} GB available; would fit: {advice}")


def plan_memory(config: ModelConfig, inputs: PlanInputs, model: str = "model") -> MemoryPlan:
    """The per-rank memory plan of running `config` with `inputs` (no tensor is allocated)."""
    weights = weight_bytes(config, inputs.tp, inputs.weights, inputs.dtype, inputs.fp8_block, inputs.int4_group)
    return _plan_with_weights(config, inputs, model, weights)


def _plan_with_weights(config: ModelConfig, inputs: PlanInputs, model: str, weights: int) -> MemoryPlan:
    d = inputs.dtype.itemsize
    tokens = inputs.batch * inputs.step_tokens
    workspace = 0
    if inputs.fused_workspace and inputs.tp > 1:
        from fxfuse.op.workspace import workspace_bytes

        workspace = workspace_bytes(inputs.tp, tokens, config.hidden_size, inputs.dtype)
    outputs = sum(inputs.batch * w * config.vocab_size * 4 for w in inputs.graph_widths)
    return MemoryPlan(model, inputs, weights, kv_cache_bytes(config, inputs.batch, inputs.context, inputs.dtype),
                      workspace, activation_bytes(config, inputs.tp, inputs.batch, inputs.step_tokens, inputs.context, d), outputs)


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
    from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
    from fxfuse.models.parallel import ParallelContext

    ctx = ParallelContext(rank=0, world_size=tp, group=_NO_GROUP if tp > 1 else None)
    scheme = QuantScheme(weights, fp8_block=fp8_block, int4_group=int4_group)
    model = DeepseekV3ForCausalLM(config, ctx, dtype=dtype, device="meta", max_batch=1, max_seq_len=1, quant=scheme)
    seen, total = set(), 0
    for param in model.parameters():  # tied embeddings count once
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel() * param.element_size()
    return total


#: Stands in for a process group: building the model only reads rank and world size.
_NO_GROUP = object()


def alternatives(config: ModelConfig, inputs: PlanInputs, available: int, model: str) -> list[str]:
    """Nearby settings that fit in `available` bytes: a smaller batch or context, more ranks, other formats."""
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
        return weights is not None and _plan_with_weights(config, changed, model, weights).total_bytes <= available

    found = []
    batch = _largest(lambda b: fits(batch=b), inputs.batch - 1)
    if batch:
        found.append(f"--batch {batch} (at this context)")
    context = _largest(lambda c: fits(context=c), inputs.context - 1, floor=max(inputs.step_tokens, *inputs.graph_widths, 1))
    if context:
        found.append(f"a context of {context} positions (at this batch)")
    more_ranks = [tp for tp in TP_CHOICES if tp > inputs.tp and fits(tp=tp)]
    if more_ranks:
        found.append(f"--tp {more_ranks[0]}")
    formats = [fmt for fmt in WEIGHT_FORMATS if fmt != inputs.weights and fits(weights=fmt)]
    if formats:
        found.append("--weights " + " or ".join(formats))
    return found


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
