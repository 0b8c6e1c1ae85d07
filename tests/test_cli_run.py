"""`fxfuse run`: the built-in job end to end on 2 CPU ranks, and clean errors for bad input."""

import json
import subprocess
import sys

import pytest
import torch

from fxfuse.cli import main


def test_run_tiny_tp2_matches_transformers(tmp_path):
    out = tmp_path / "out.json"
    assert main(["run", "--compare", "hf", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["tp"] == 2 and summary["device"] == "cpu" and summary["backend"] == "eager"
    assert summary["max_rel_err"] is not None and summary["max_rel_err"] <= 1e-4
    assert summary["step_ms"] > 0 and summary["step_ms_p90"] >= summary["step_ms"]
    assert summary["tokens_per_s"] == pytest.approx(summary["batch"] * 1000 / summary["step_ms"])
    assert summary["cuda_graph"] is False and summary["graph_widths"] == []  # CPU: no CUDA graphs
    assert summary["peak_gpu_mem_gb"] is None
    assert summary["allreduce_sites"] is None and summary["fused_sites"] is None  # only the fxfuse backend fuses
    assert len(summary["tokens"]) == 1 + summary["steps"]  # one token from prefill, one per 1-token step


@pytest.mark.slow
def test_fxfuse_backend_fuses_every_site_and_matches_eager(tmp_path, capfd):
    """tp=2 on CPU: the fxfuse backend (passes, then Inductor) fuses all 1 + 2 * 4 all-reduce sites of
    the tiny model; logits match the eager model step for step; rank 0 alone reports progress."""
    out = tmp_path / "out.json"
    argv = ["run", "--backend", "fxfuse", "--compare", "eager", "--tokens", "4", "--steps", "2", "--json", str(out)]
    assert main(argv) == 0
    summary = json.loads(out.read_text())
    assert summary["allreduce_sites"] == summary["fused_sites"] == 9
    assert summary["max_rel_err"] <= 1e-4
    err = capfd.readouterr().err
    assert err.count("building tiny (4 layers, random weights)") == 2  # one start and one done line, rank 0 only


def test_multi_token_verify_steps_generate_the_greedy_sequence():
    """Speculative verify with 4-token steps must reproduce one-token greedy decoding exactly."""
    from fxfuse.runner.run import RunOptions, run

    one = run(RunOptions(tokens_per_step=1, steps=8, tp=1))
    four = run(RunOptions(tokens_per_step=4, steps=3, tp=1))
    n = min(len(one["tokens"]), len(four["tokens"]))
    assert n >= 4
    assert four["tokens"][:n] == one["tokens"][:n]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--preset", "nope"], "unknown preset 'nope'"),
        (["run", "--tp", "3"], "tensor parallel size 3 does not divide"),
        (["run", "--device", "cuda"], "no CUDA GPU"),
        (["run", "--checkpoint", "/nonexistent/ckpt"], "does not exist"),
        (["run", "--tokens", "0"], "--tokens must be at least 1"),
        (["run", "--layers", "0"], "layers"),
        (["run", "--cuda-graph"], "--cuda-graph needs --device cuda"),
        (["run", "--tokens", "129"], "--tokens must be at most 128"),
        (["run", "--graph-widths", "1,256"], "--graph-widths must be widths between 1 and 128"),
        (["run", "--prompt-len", "200", "--tokens", "64", "--steps", "2"], "KV cache would need 393 positions"),
    ],
)
def test_bad_input_gives_one_line_error_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxfuse: error:") and message in err


def test_checkpoint_that_does_not_fit_tp_is_refused_before_loading(tmp_path, capsys):
    from fxfuse.models.presets import get_preset

    (tmp_path / "config.json").write_text(json.dumps(get_preset("tiny").to_hf_dict()))  # no weights: never read
    assert main(["run", "--checkpoint", str(tmp_path), "--tp", "3"]) == 2
    assert "tensor parallel size 3 does not divide" in capsys.readouterr().err


def test_more_gpus_than_present_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["run", "--device", "cuda", "--tp", "2"]) == 2
    assert "--tp 2 needs 2 GPUs (one process per GPU), but only 1 are present" in capsys.readouterr().err


def test_help_describes_the_default_job():
    out = subprocess.run([sys.executable, "-m", "fxfuse", "run", "--help"], capture_output=True, text=True, check=True)
    assert "tiny preset" in out.stdout and "--compare" in out.stdout and "--tokens" in out.stdout
    assert "--cuda-graph" in out.stdout and "--no-cuda-graph" in out.stdout and "--graph-widths" in out.stdout
