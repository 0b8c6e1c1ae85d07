"""Checkpoint loader: tensor sources, per-rank slices of every parameter (stacked experts
included) at tp 1 and 2, skipped tensors, and one CheckpointError test per failure kind."""

from __future__ import annotations

import json

import pytest
import torch

from checkpoint_helpers import expected_shard, fake_rank_context, load_saved, save_tiny_hf_checkpoint, sharded_module_tree
from fxfuse.runner.launch import run_on_ranks
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


@pytest.mark.slow
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


# ---- validation: every failure kind is reported by name, before any tensor data is read ----


class CountingSource(DictSource):
    """A DictSource that counts reads, to prove validation happens before any data is read."""

    reads = 0

    def read(self, name, slices):
        self.reads += 1
        return super().read(name, slices)


def load_problem(full, model_tensors, world_size=2, *, pattern):
    """Load `full` into a tree built from `model_tensors`; assert a CheckpointError matching `pattern`
    and that no tensor data was read. Returns the error."""
    source = CountingSource(full)
    model = sharded_module_tree(shapes_of(model_tensors), world_size)
    with pytest.raises(CheckpointError, match=pattern) as info:
        load_weights(model, source, fake_rank_context(0, world_size))
    assert source.reads == 0
    return info.value


def test_missing_tensor(single_dir):
    _, full = single_dir
    partial = {k: v for k, v in full.items() if k != "model.layers.1.mlp.experts.2.up_proj.weight"}
    error = load_problem(partial, full, pattern=r"missing tensor model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight "
                         r"\(for parameter model\.layers\.1\.mlp\.experts\.up_proj\)")
    assert len(error.problems) == 1


def test_unexpected_tensor(single_dir):
    _, full = single_dir
    extra = {**full, "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 32)}
    load_problem(extra, full, pattern=r"unexpected tensor model\.layers\.0\.self_attn\.q_proj\.weight")


def test_orphan_scale_is_unexpected(single_dir):
    _, full = single_dir
    extra = {**full, "model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1, 1)}
    load_problem(extra, full, pattern=r"unexpected tensor model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv")


def test_shape_mismatch(single_dir):
    _, full = single_dir
    wrong = {**full, "model.layers.1.mlp.experts.3.down_proj.weight": torch.zeros(32, 18)}
    load_problem(wrong, full, pattern=r"tensor model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight: checkpoint shape "
                 r"\(32, 18\) does not match the model's \(32, 16\) \(parameter model\.layers\.1\.mlp\.experts\.down_proj, "
                 r"dim 1 split over 2 ranks\)")


def test_tensor_parallel_size_not_dividing(single_dir):
    _, full = single_dir
    error = load_problem(full, full, world_size=3, pattern=r"tensor model\.embed_tokens\.weight: tensor-parallel size 3 "
                         r"does not divide dim 0 \(size 64\)")
    assert any("o_proj.weight: tensor-parallel size 3 does not divide dim 1 (size 32)" in p for p in error.problems)


def test_many_problems_are_listed_together(single_dir):
    _, full = single_dir
    extras = {f"model.extra_{i}.weight": torch.zeros(1) for i in range(13)}
    error = load_problem({**full, **extras}, full, pattern=r"\(13 problem\(s\)\)")
    message = str(error)
    assert message.count("unexpected tensor model.extra_") == 10 and "... and 3 more problem(s)" in message


def test_non_strict_tolerates_missing_and_unexpected(single_dir):
    _, full = single_dir
    kept = "model.norm.weight"
    partial = {k: v for k, v in full.items() if k != kept}
    model = sharded_module_tree(shapes_of(full), 2)
    load_weights(model, DictSource({**partial, "extra.weight": torch.zeros(1)}), fake_rank_context(0, 2), strict=False)
    params = dict(model.named_parameters())
    assert params.pop(kept).isnan().all()
    for name, param in params.items():
        assert torch.equal(param, expected_shard(full, name, param, 0, 2)), name


def copy_checkpoint(source_dir, target_dir):
    target_dir.mkdir()
    for path in source_dir.iterdir():
        (target_dir / path.name).write_bytes(path.read_bytes())
    return target_dir


def test_missing_config_json(single_dir, tmp_path):
    directory = copy_checkpoint(single_dir[0], tmp_path / "ckpt")
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"missing config\.json in checkpoint directory"):
        SafetensorsSource(directory)


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        SafetensorsSource(tmp_path)


def test_corrupt_file(single_dir, tmp_path):
    directory = copy_checkpoint(single_dir[0], tmp_path / "ckpt")
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cannot read safetensors file .*model\.safetensors"):
        SafetensorsSource(directory)


def test_index_names_a_missing_file(sharded_dir, tmp_path):
    directory = copy_checkpoint(sharded_dir[0], tmp_path / "ckpt")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    lost = index["weight_map"]["model.norm.weight"]
    (directory / lost).unlink()
    with pytest.raises(CheckpointError, match=rf"missing file {lost} \(named in model\.safetensors\.index\.json\)"):
        SafetensorsSource(directory)


def test_index_entry_its_file_lacks(sharded_dir, tmp_path):
    directory = copy_checkpoint(sharded_dir[0], tmp_path / "ckpt")
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    wrong_file = next(f for f in files if f != index["weight_map"]["model.norm.weight"])
    index["weight_map"]["model.norm.weight"] = wrong_file
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"tensor model\.norm\.weight: .* maps it to {wrong_file}, which does not contain it"):
        SafetensorsSource(directory)


def test_tensor_missing_from_index(sharded_dir, tmp_path):
    directory = copy_checkpoint(sharded_dir[0], tmp_path / "ckpt")
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["lm_head.weight"]
    index_path.write_text(json.dumps(index))
    model = sharded_module_tree(shapes_of(sharded_dir[1]), 2)
    with pytest.raises(CheckpointError, match=r"missing tensor lm_head\.weight"):
        load_weights(model, SafetensorsSource(directory), fake_rank_context(0, 2))


# ---- the reference model's parameter names and tags against a real HF checkpoint ----


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("world_size", [1, 2])
def test_reference_model_loads_hf_checkpoint(tmp_path, tied, world_size):
    from fxfuse.models.config import ModelConfig
    from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM

    full = save_tiny_hf_checkpoint(tmp_path, tie_word_embeddings=tied)
    assert ("lm_head.weight" in full) != tied
    with SafetensorsSource(tmp_path) as source:
        for rank in range(world_size):
            ctx = fake_rank_context(rank, world_size)
            model = DeepseekV3ForCausalLM(ModelConfig.from_pretrained(tmp_path), ctx, dtype=torch.float32, max_seq_len=16)
            load_weights(model, source, ctx)
            assert_loaded(model, full, rank, world_size)
