"""Names and defaults the `fxfuse` commands take: `--dtype` in torch's names or the short ones (bf16, fp16,
fp32) and `--weights bf16` also as bfloat16, wherever they are taken; `fxfuse run`'s dtype per device
(float32 on CPU, bfloat16 on CUDA) and why, in each command's --help; `fxfuse plan`'s default tp, cut to
one the model takes; and a plan without a GPU to check against says that it gives no verdict."""

from __future__ import annotations

import pytest

from fxfuse.cli import build_parser, main

#: Every command and benchmark that takes --dtype, with the dtypes it takes.
DTYPE_COMMANDS = {
    ("run",): ("float32", "bfloat16", "float16"),
    ("report",): ("float32", "bfloat16", "float16"),
    ("plan",): ("float32", "bfloat16", "float16"),
    ("bench", "model"): ("bfloat16", "float16", "float32"),
    ("bench", "kernel"): ("bfloat16", "float16"),
    ("tune", "pcie"): ("bfloat16", "float16"),
}
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def parsed(argv: list[str]):
    """The arguments `argv` parse to: the `fxfuse` parser's, or a benchmark's / `tune pcie`'s own."""
    if argv[0] == "bench":
        from fxfuse.bench.model import parse_args as model_args
        from fxfuse.bench.kernel import parse_args as kernel_args

        return {"model": model_args, "kernel": kernel_args}[argv[1]](argv[2:])
    if argv[0] == "tune":
        from fxfuse.bench.tune_pcie import parse_args

        return parse_args(argv[2:])
    return build_parser().parse_args(argv)


@pytest.mark.parametrize("command", DTYPE_COMMANDS, ids=" ".join)
def test_dtype_takes_both_spellings(command):
    for dtype in DTYPE_COMMANDS[command]:
        assert parsed([*command, "--dtype", dtype]).dtype == dtype
        assert parsed([*command, "--dtype", SHORT[dtype]]).dtype == dtype
        assert parsed([*command, "--dtype", SHORT[dtype].upper()]).dtype == dtype


@pytest.mark.parametrize("command", [("run",), ("plan",), ("bench", "model")], ids=" ".join)
def test_weights_bf16_is_also_bfloat16(command):
    assert parsed([*command, "--weights", "bfloat16"]).weights == "bf16"
    assert parsed([*command, "--weights", "fp8"]).weights == "fp8"


def test_a_dtype_of_another_name_is_one_error_line(capsys):
    assert main(["run", "--dtype", "int8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxfuse: error: argument --dtype: invalid choice: 'int8'") and err.count("\n") == 1


def test_run_takes_each_devices_dtype(monkeypatch):
    """float32 on CPU (the built-in job's check against eager sees float32 rounding only), bfloat16 on CUDA
    (where float32 sites are left to Inductor: a float32 default fused nothing there)."""
    import torch

    import fxfuse.runner.quant_setup
    from fxfuse.runner.options import RunOptions, prepare_run

    assert prepare_run(RunOptions()).options.dtype == "float32"
    assert prepare_run(RunOptions(dtype="bfloat16")).options.dtype == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(fxfuse.runner.quant_setup, "device_memory_bytes", lambda: 80 * 10**9)
    assert prepare_run(RunOptions(device="cuda")).options.dtype == "bfloat16"


@pytest.mark.parametrize("command, says", [
    ("run", "default: float32 on cpu, the check against eager then sees float32 rounding only; bfloat16 on cuda, the "
            "fused all-reduce kernels take 16-bit activations only"),
    ("report", "default bfloat16, as on GPUs: the fused all-reduce kernels take 16-bit activations only; `fxfuse run` on "
               "CPU uses float32"),
    ("plan", "default bfloat16, as on GPUs: the fused all-reduce kernels take 16-bit activations only"),
])
def test_help_says_why_each_default_dtype(command, says, capsys):
    assert main([command, "--help"]) == 0
    assert says in " ".join(capsys.readouterr().out.split())


def test_plan_takes_a_tp_the_model_splits_into(capsys):
    """The default tp is 8 (one node), cut to the largest size the model takes: 4 for the tiny preset, which
    8 does not split (it used to fail on the default)."""
    assert main(["plan", "--preset", "tiny", "--gpu-memory-gb", "80"]) == 0
    assert "memory plan per rank: tiny, tp=4," in capsys.readouterr().out
    assert main(["plan", "--gpu-memory-gb", "200"]) == 0
    assert "memory plan per rank: deepseek-v3, tp=8," in capsys.readouterr().out


def test_a_plan_without_a_gpu_says_it_gives_no_verdict(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["plan", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "fits" not in out and out.splitlines()[-1] == (
        "- no verdict: this machine has no GPU and --gpu-memory-gb was not given; give --gpu-memory-gb G (one GPU's "
        "memory in GB) to check the plan against it")
