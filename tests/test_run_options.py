"""`fxfuse run` option validation (fxfuse.runner.options), on CPU and without starting ranks: the resolved
options the summary reports (the built-in job: fxfuse with eager inside on CPU, checked against eager), the
fused kernel's workspace size, the model resolution and the memory checks."""

from __future__ import annotations

import json

import pytest
import torch

from fxfuse.models.quant.scheme import QuantScheme
from fxfuse.runner.options import RunError, RunOptions, prepare_run, resolve_model


@pytest.fixture
def two_gpus(monkeypatch):
    """Pretend this machine has 2 CUDA GPUs of 141 GB (validation asks torch.cuda how many, and the
    memory plan how large GPU 0 is)."""
    from fxfuse.runner import quant_setup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(quant_setup, "device_memory_bytes", lambda *a: 141 * 10**9)


def test_the_built_in_job_compiles_with_fxfuse_and_checks_itself_against_eager():
    setup = prepare_run(RunOptions())
    o = setup.options
    assert (o.preset, o.tp, o.device, o.backend, o.inner, o.compare) == ("tiny", 2, "cpu", "fxfuse", "eager", "eager")
    assert o.cuda_graph is False and o.graph_widths == ()  # CPU: no CUDA graphs
    assert setup.graph_widths == () and setup.cuda_graph is False and setup.dynamic_shapes is False
    assert prepare_run(RunOptions(backend="eager")).options.inner is None  # only backend fxfuse has an inner compiler


def test_cuda_graph_widths_are_resolved_sorted_and_deduplicated(two_gpus):
    setup = prepare_run(RunOptions(device="cuda", graph_widths=(4, 1, 2, 2)))
    assert setup.options.cuda_graph is True and setup.options.graph_widths == (1, 2, 4)
    assert setup.options.inner == "inductor"  # CUDA: Inductor
    assert prepare_run(RunOptions(device="cuda")).options.graph_widths == (1, 2, 4, 8, 16, 32, 64, 128)


@pytest.mark.parametrize(
    "changes, dynamic",
    [
        ({}, "off"),  # CPU, no CUDA graphs: the prefill and the verify step, one static compile each
        ({"device": "cuda"}, "off"),  # the 1-token verify step replays its graph: one compile per width
        ({"device": "cuda", "tokens_per_step": 3}, "on"),  # width 3 has no graph: one graph serves all
        ({"device": "cuda", "graph_widths": (1, 3), "tokens_per_step": 3}, "off"),
        ({"device": "cuda", "cuda_graph": False, "tokens_per_step": 3}, "off"),  # uncaptured: two shapes
        ({"device": "cuda", "dynamic": "on"}, "on"),  # asked for: as asked
        ({"device": "cuda", "tokens_per_step": 3, "dynamic": "off"}, "off"),
        ({"dynamic": "on"}, "on"),
    ],
)
def test_dynamic_auto_means_static_shapes_unless_the_verify_width_runs_uncaptured_beside_graphs(two_gpus, changes, dynamic):
    setup = prepare_run(RunOptions(**changes))
    assert setup.options.dynamic == dynamic  # resolved, so the summary's options say what ran
    assert setup.dynamic_shapes is (dynamic == "on")


def test_resolve_dynamic_takes_the_callers_rule_for_auto_only():
    from fxfuse.runner.options import resolve_dynamic

    assert [resolve_dynamic(choice, when_auto) for choice in ("on", "off", "auto") for when_auto in (True, False)] == [
        True, True, False, False, True, False]
    with pytest.raises(ValueError, match="unknown dynamic-shapes choice 'maybe'; choose one of: auto, on, off"):
        resolve_dynamic("maybe", True)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"graph_widths": (1, 2)}, "--graph-widths needs --device cuda"),
        ({"inner": "inductor", "backend": "eager"}, "--inner applies to --backend fxfuse only (got --backend eager)"),
        ({"inner": "tvm"}, "unknown inner compiler 'tvm'; choose one of: eager, inductor"),
        ({"dynamic": "yes"}, "unknown dynamic-shapes choice 'yes'; choose one of: auto, on, off"),
        ({"tp": 3}, "tensor-parallel sizes that fit this model: 1, 2, 4"),
        ({"batch": 10**9}, "of this machine's memory (2 ranks x "),
    ],
)
def test_bad_options_are_refused_before_any_rank(changes, message):
    with pytest.raises(RunError) as error:
        prepare_run(RunOptions(**changes))
    assert message in str(error.value)


def test_graph_widths_without_cuda_graphs_are_refused_on_cuda_too(two_gpus):
    with pytest.raises(RunError, match=r"--graph-widths needs CUDA graphs \(drop --no-cuda-graph\)"):
        prepare_run(RunOptions(device="cuda", cuda_graph=False, graph_widths=(1, 2)))


@pytest.mark.parametrize(
    "changes, tokens",
    [
        ({}, 8 * 128),  # default widths 1..128: the widest graph replays 8 x 128 tokens
        ({"graph_widths": (1, 2, 4)}, 8 * 4),
        ({"graph_widths": (1, 2), "tokens_per_step": 16}, 8 * 2),  # 16-token steps run uncaptured
        ({"cuda_graph": False, "graph_widths": None}, 8 * 4),  # no graphs: batch x tokens per step
        ({"cuda_graph": False, "graph_widths": None, "tokens_per_step": 1}, 8),
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
        prepare_run(RunOptions(preset="deepseek-v3", layers=4, compare="none"))
    with pytest.raises(RunError, match=r"2 copies"):  # --compare eager holds a second copy
        prepare_run(RunOptions(preset="deepseek-v3", layers=4, dtype="bfloat16", compare="eager"))
    prepare_run(RunOptions())  # the tiny model fits


def test_the_cpu_memory_plan_counts_every_rank_and_the_eager_copy(monkeypatch):
    """On CPU all ranks share one machine: what must fit is tp x one rank's plan, the eager reference's
    weights and KV cache included; the error says what would fit, before any rank starts."""
    import fxfuse.runner.options as options
    from fxfuse.models.presets import get_preset
    from fxfuse.runner.memory_plan import CPU_RANK_RESERVE_BYTES, PlanInputs, plan_memory

    o = RunOptions(batch=4096, prompt_len=200, steps=2)
    rank = plan_memory(get_preset("tiny"), PlanInputs(tp=2, weights="bf16", dtype=torch.float32, batch=4096, context=204,
                                                      step_tokens=200, device="cpu", reference_copy=True))
    assert rank.workspace_bytes == rank.graph_output_bytes == 0  # nothing of CUDA's on CPU
    assert rank.reserve_bytes == CPU_RANK_RESERVE_BYTES  # each rank's process: measured, see memory_plan.py
    assert rank.reference_bytes == rank.weight_bytes + rank.kv_cache_bytes and rank.needed_bytes == 2 * rank.total_bytes
    monkeypatch.setattr(options, "available_host_memory", lambda: rank.needed_bytes)
    prepare_run(o)  # exactly enough
    monkeypatch.setattr(options, "available_host_memory", lambda: rank.needed_bytes - 1)
    with pytest.raises(RunError) as error:
        prepare_run(o)
    assert f"needs {rank.needed_bytes / 1e9:.1f} GB of this machine's memory (2 ranks x" in str(error.value)
    assert "would fit: --batch " in str(error.value) and "--compare none" in str(error.value)



def test_the_cpu_plan_keeps_a_reserve_for_each_ranks_process(monkeypatch):
    """Each rank's process (Python, torch, gloo, the compiler) holds about 0.5 GB besides its plan (0.9 GB
    with Inductor): a run whose plans left about 1 GB of the machine passed the check and was then killed for
    memory. The built-in job's plans are under 0.01 GB, so 1.5 GB available fits one rank but not two."""
    import fxfuse.runner.options as options

    monkeypatch.setattr(options, "available_host_memory", lambda: int(1.5e9))
    with pytest.raises(RunError, match=r"of this machine's memory \(2 ranks x 1\.0 GB: .*reserve 1\.0 GB.*would fit: "
                                       r"--tp 1 \(fewer processes on this machine\)"):
        prepare_run(RunOptions())
    prepare_run(RunOptions(tp=1))

def test_a_checkpoint_file_and_bad_config_json_are_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(RunError, match="is a file; give the directory that holds config.json"):
        resolve_model(None, str(tmp_path / "model.safetensors"), None)
    for content, message in [("[1, 2]", "must hold a JSON object, not a list"),
                             ("{}", "has no vocab_size, hidden_size, num_hidden_layers, num_attention_heads"),
                             ('{"vocab_size": 8, "hidden_size": "thirty-two", "num_hidden_layers": 1, "num_attention_heads": 2}',
                              "hidden_size 'thirty-two' must be an integer")]:
        (tmp_path / "config.json").write_text(content)
        with pytest.raises(RunError, match=message):
            resolve_model(None, str(tmp_path), None)


@pytest.mark.slow  # the quantization libraries' imports: about 20 s on 2 cores
@pytest.mark.parametrize("stored, prefix", [("fp8", ""), ("int4", ""), ("int4", "language_model.")])
def test_quantized_checkpoints_pass_the_header_check_in_every_format_they_load_as(stored, prefix, tmp_path):
    """The check before any rank starts accepts what the loader accepts: a FP8 or INT4 checkpoint (with
    Kimi-K2.5's multimodal prefix too) as stored, or dequantized to bf16; the other format is refused."""
    from fxfuse.runner.checkpoint_check import check_checkpoint
    from quant_helpers import FP8, INT4, TINY_ALIGNED, float_state, fp8_checkpoint, int4_checkpoint, save_checkpoint

    scheme = FP8 if stored == "fp8" else INT4
    tensors = (fp8_checkpoint if stored == "fp8" else int4_checkpoint)(float_state())
    save_checkpoint(tmp_path, tensors, scheme, prefix=prefix)
    for quant in (scheme, QuantScheme()):
        check_checkpoint(str(tmp_path), TINY_ALIGNED, 2, torch.float32, quant)
    other = INT4 if stored == "fp8" else FP8
    with pytest.raises(RunError, match=f"^checkpoint {tmp_path} cannot be loaded: "):
        check_checkpoint(str(tmp_path), TINY_ALIGNED, 2, torch.float32, other)
