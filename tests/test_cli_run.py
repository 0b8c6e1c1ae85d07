"""`fxfuse run`: the built-in job end to end on 2 CPU ranks, and clean errors for bad input."""

import json
import subprocess
import sys

import pytest

from fxfuse.cli import main


def test_run_tiny_tp2_matches_transformers(tmp_path):
    out = tmp_path / "out.json"
    assert main(["run", "--compare", "hf", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["tp"] == 2 and summary["device"] == "cpu" and summary["backend"] == "eager"
    assert summary["max_rel_err"] is not None and summary["max_rel_err"] <= 1e-4
    assert summary["step_ms"] > 0
    assert len(summary["tokens"]) == 1 + summary["steps"]  # one token from prefill, one per 1-token step


def test_multi_token_verify_steps_generate_the_greedy_sequence():
    """Speculative verify with 4-token steps must reproduce one-token greedy decoding exactly."""
    from fxfuse.models.runner import RunOptions, run

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
    ],
)
def test_bad_input_gives_one_line_error_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxfuse: error:") and message in err


def test_help_describes_the_default_job():
    out = subprocess.run([sys.executable, "-m", "fxfuse", "run", "--help"], capture_output=True, text=True, check=True)
    assert "tiny preset" in out.stdout and "--compare" in out.stdout and "--tokens" in out.stdout
