"""Checkpoint loader: tensor sources, per-rank slices of every parameter (stacked experts
included) at tp 1 and 2, skipped tensors, and one CheckpointError test per failure kind."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from checkpoint_helpers import expected_shard, fake_rank_context, load_saved, save_tiny_hf_checkpoint, sharded_module_tree
from fxfuse.launch import run_on_ranks
from fxfuse.models.weights import CheckpointError, DictSource, SafetensorsSource, load_weights


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory):
    """A tiny HF checkpoint in one model.safetensors, with its full tensors."""
    directory = tmp_path_factory.mktemp("single")
    return directory, save_tiny_hf_checkpoint(directory)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    """The same tiny checkpoint split over several files with model.safetensors.index.json."""
    directory = tmp_path_factory.mktemp("sharded")
    return directory, save_tiny_hf_checkpoint(directory, max_shard_size="20KB")


def shapes_of(tensors):
    return {name: tuple(t.shape) for name, t in tensors.items()}


def assert_loaded(model, full, rank, world_size):
    for name, param in model.named_parameters():
        assert torch.equal(param, expected_shard(full, name, param, rank, world_size).to(param.dtype)), name


def test_sharded_checkpoint_has_an_index(sharded_dir):
    directory, _ = sharded_dir
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_safetensors_source_metadata_and_slices(layout, request):
    directory, full = request.getfixturevalue(f"{layout}_dir")
    with SafetensorsSource(directory) as source:
        assert sorted(source.keys()) == sorted(full)
        assert source.config["model_type"] == "deepseek_v3"
        for name, tensor in full.items():
            assert source.shape(name) == tuple(tensor.shape)
            assert source.dtype(name) == tensor.dtype
        name = "model.layers.0.self_attn.o_proj.weight"
        part = source.read(name, (slice(0, 32), slice(16, 32)))
        assert part.shape == (32, 16) and torch.equal(part, full[name][:, 16:32])


def test_dict_source_reads_slices():
    tensor = torch.arange(12.0).view(3, 4)
    source = DictSource({"w": tensor}, config={"model_type": "x"})
    assert source.keys() == ["w"] and source.shape("w") == (3, 4) and source.dtype("w") == torch.float32
    assert torch.equal(source.read("w", (slice(1, 3), slice(0, 2))), tensor[1:3, 0:2])


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_every_rank_gets_its_slice(layout, world_size, request):
    directory, full = request.getfixturevalue(f"{layout}_dir")
    with SafetensorsSource(directory) as source:
        for rank in range(world_size):
            model = sharded_module_tree(shapes_of(full), world_size)
            assert any(name.endswith("experts.down_proj") for name, _ in model.named_parameters())
            load_weights(model, source, fake_rank_context(rank, world_size))
            assert_loaded(model, full, rank, world_size)


def test_dict_source_loads_like_safetensors(single_dir):
    _, full = single_dir
    model = sharded_module_tree(shapes_of(full), 2)
    load_weights(model, DictSource(full), fake_rank_context(1, 2))
    assert_loaded(model, full, 1, 2)


def test_casts_to_parameter_dtype(single_dir):
    directory, full = single_dir
    model = sharded_module_tree(shapes_of(full), 1, dtype=torch.bfloat16)
    load_weights(model, SafetensorsSource(directory), fake_rank_context(0, 1))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert_loaded(model, full, 0, 1)


def _load_on_real_rank(ctx, directory):
    """Rank body for test_loads_on_spawned_ranks: load this rank's slices, return (checked, wrong) names."""
    full = load_saved(directory)
    model = sharded_module_tree(shapes_of(full), ctx.world_size)
    load_weights(model, SafetensorsSource(directory), ctx)
    params = dict(model.named_parameters())
    wrong = [n for n, p in params.items() if not torch.equal(p, expected_shard(full, n, p, ctx.rank, ctx.world_size))]
    return sorted(params), wrong


def test_loads_on_spawned_ranks(sharded_dir):
    directory, full = sharded_dir
    for checked, wrong in run_on_ranks(_load_on_real_rank, 2, directory):
        assert len(checked) == len(full) - 3 * 4 + 3 and wrong == []


def test_skips_extra_layers_rotary_tables_and_unused_scales(single_dir):
    _, full = single_dir
    model_tensors = {k: v for k, v in full.items() if not k.startswith("model.layers.1.")}
    extra = {
        "model.layers.1.self_attn.o_proj.weight": full["model.layers.1.self_attn.o_proj.weight"],  # --layers 1
        "model.layers.61.eh_proj.weight": torch.zeros(4, 8),  # DeepSeek-V3 multi-token-prediction layer
        "model.rotary_emb.inv_freq": torch.zeros(4),
    }
    model = sharded_module_tree(shapes_of(model_tensors), 2)
    load_weights(model, DictSource({**model_tensors, **extra}), fake_rank_context(0, 2))
    assert_loaded(model, full, 0, 2)
