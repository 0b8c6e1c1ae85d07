"""`fxfuse run` option validation (fxfuse.runner.options), on CPU and without starting ranks: the resolved
options the summary reports, the fused kernel's workspace size, the model resolution and the memory check."""

from __future__ import annotations

import json

import pytest
import torch

from fxfuse.runner.options import RunError, RunOptions, prepare_run, resolve_model


@pytest.fixture
def two_gpus(monkeypatch):
    """Pretend this machine has 2 CUDA GPUs of 141 GB (validation asks torch.cuda how many, and the
    memory plan how large GPU 0 is)."""
    from fxfuse.runner import quant_setup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(quant_setup, "device_memory_bytes", lambda *a: 141 * 10**9)


def test_cpu_options_say_what_ran():
    setup = prepare_run(RunOptions(graph_widths=(4, 1, 2, 2)))
    assert setup.options.cuda_graph is False and setup.options.graph_widths == ()  # CPU: no CUDA graphs
    assert setup.graph_widths == () and setup.cuda_graph is False


def test_cuda_graph_widths_are_resolved_sorted_and_deduplicated(two_gpus):
    setup = prepare_run(RunOptions(device="cuda", graph_widths=(4, 1, 2, 2)))
    assert setup.options.cuda_graph is True and setup.options.graph_widths == (1, 2, 4)


@pytest.mark.parametrize(
    "changes, tokens",
    [
        ({}, 8 * 128),  # default widths 1..128: the widest graph replays 8 x 128 tokens
        ({"graph_widths": (1, 2, 4)}, 8 * 4),
        ({"graph_widths": (1, 2), "tokens_per_step": 16}, 8 * 2),  # 16-token steps run uncaptured
        ({"cuda_graph": False}, 8 * 4),  # no graphs: batch x tokens per step
        ({"cuda_graph": False, "tokens_per_step": 1}, 8),
    ],
)
def test_fused_kernel_workspace_covers_what_the_graphs_replay_not_the_prefill(two_gpus, changes, tokens):
    """The prefill (8 x 100 tokens here) is larger than any graph: it runs the op's fallback, so it
    does not size the workspace."""
    options = RunOptions(**{"device": "cuda", "batch": 8, "prompt_len": 100, "tokens_per_step": 4, **changes})
    assert prepare_run(options).fused_kernel_tokens == tokens


def test_resolve_model_cuts_layers_and_names_a_bad_config_file(tmp_path):
    config, name = resolve_model("tiny", None, 2)
    assert (config.num_hidden_layers, name) == (2, "tiny")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(RunError, match=f"cannot read {tmp_path / 'config.json'}: "):
        resolve_model(None, str(tmp_path), None)
    with pytest.raises(RunError, match=r"--layers must be between 1 and 4 \(got 5\)"):
        resolve_model("tiny", None, 5)


def test_checkpoint_layers_are_checked_against_its_config(tmp_path):
    from fxfuse.models.presets import get_preset

    (tmp_path / "config.json").write_text(json.dumps(get_preset("tiny").to_hf_dict()))
    with pytest.raises(RunError, match=r"--layers must be between 1 and 4 \(got 7\)"):
        prepare_run(RunOptions(preset=None, checkpoint=str(tmp_path), layers=7))


def test_a_model_larger_than_free_memory_is_refused_on_cpu(monkeypatch):
    import fxfuse.runner.options as options

    monkeypatch.setattr(options, "available_host_memory", lambda: 8 * 10**9)
    with pytest.raises(RunError, match=r"need at least 60\.4 GB .* available \(8\.0 GB\); use --preset tiny"):
        prepare_run(RunOptions(preset="deepseek-v3", layers=4))
    with pytest.raises(RunError, match=r"2 copies"):  # --compare eager holds a second copy
        prepare_run(RunOptions(preset="deepseek-v3", layers=4, dtype="bfloat16", compare="eager"))
    prepare_run(RunOptions())  # the tiny model fits
