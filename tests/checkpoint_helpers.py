"""Helpers for the checkpoint-loader tests: tiny HF DeepSeek-V3 checkpoints and a module tree that
holds parameters under the reference model's names and tensor-parallel tags (stacked experts too)."""

from __future__ import annotations

import re

import torch
from safetensors.torch import load_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from fxfuse.models.parallel import ParallelContext
from fxfuse.models.sharding import mark_shard, shard_dim

EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>\w+)\.weight$")

#: Checkpoint-name suffix -> split dimension, as the reference DeepSeek-V3 shards it.
SPLIT_DIMS = {
    "embed_tokens.weight": 0,
    "lm_head.weight": 0,
    "q_b_proj.weight": 0,
    "kv_b_proj.weight": 0,
    "o_proj.weight": 1,
    "gate_proj.weight": 0,
    "up_proj.weight": 0,
    "down_proj.weight": 1,
}


def tiny_hf_config(**overrides) -> DeepseekV3Config:
    """A DeepSeek-V3 config small enough for CPU tests: one dense layer, one MoE layer, tp=2 friendly."""
    fields = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
    )
    fields.update(overrides)
    return DeepseekV3Config(**fields)


def save_tiny_hf_checkpoint(directory, *, max_shard_size: str | None = None, seed: int = 0, **config) -> dict[str, torch.Tensor]:
    """Save a randomly initialized tiny HF DeepseekV3ForCausalLM to `directory`; returns the saved tensors."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(tiny_hf_config(**config))
    with torch.no_grad():
        for param in model.parameters():  # HF zero/one-initializes some tensors; make every value distinct
            param.normal_()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return load_saved(directory)


def load_saved(directory) -> dict[str, torch.Tensor]:
    """Every tensor of a saved safetensors checkpoint directory, read fully (the test's ground truth)."""
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def split_dim(checkpoint_name: str) -> int | None:
    """Dimension of checkpoint tensor `checkpoint_name` the reference model splits across ranks."""
    return next((dim for suffix, dim in SPLIT_DIMS.items() if checkpoint_name.endswith(suffix)), None)


def sharded_module_tree(shapes: dict[str, tuple[int, ...]], world_size: int, dtype=torch.float32) -> torch.nn.Module:
    """A module tree with one NaN-filled parameter per checkpoint tensor, named and tagged as the
    reference model names them: local shard shapes, routed experts stacked into `...experts.{proj}`."""
    root = torch.nn.Module()
    experts: dict[str, list[tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        match = EXPERT_TENSOR.match(name)
        if match:
            experts.setdefault(f"{match['experts']}.{match['proj']}", []).append(shape)
            continue
        _add_parameter(root, name, _local(shape, split_dim(name), world_size), split_dim(name), dtype)
    for name, per_expert in experts.items():
        dim = split_dim(name + ".weight")
        _add_parameter(root, name, (len(per_expert), *_local(per_expert[0], dim, world_size)), dim, dtype)
    return root


def _local(shape: tuple[int, ...], dim: int | None, world_size: int) -> tuple[int, ...]:
    local = list(shape)
    if dim is not None:
        local[dim] //= world_size
    return tuple(local)


def _add_parameter(root: torch.nn.Module, name: str, shape, dim: int | None, dtype) -> None:
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    module.register_parameter(leaf, mark_shard(torch.nn.Parameter(torch.full(shape, float("nan"), dtype=dtype)), dim))


def expected_shard(full: dict[str, torch.Tensor], param_name: str, param: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """What `param` must hold on `rank`: its checkpoint tensor(s) split evenly, stacked experts stacked."""
    dim = shard_dim(param)

    def part(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if dim is None else tensor.chunk(world_size, dim=dim)[rank]

    if param_name in full:
        return part(full[param_name])
    experts, proj = param_name.rsplit(".", 1)
    return torch.stack([part(full[f"{experts}.{e}.{proj}.weight"]) for e in range(param.shape[0])])


def fake_rank_context(rank: int, world_size: int) -> ParallelContext:
    """A context for `rank` of `world_size` in this process, over torch's non-communicating fake
    process group: the loader reads only rank and world size, so one process can play every rank."""
    if world_size == 1:
        return ParallelContext()
    from torch._C._distributed_c10d import FakeProcessGroup

    return ParallelContext(rank=rank, world_size=world_size, group=FakeProcessGroup._create_internal(rank, world_size))
