"""`fxfuse run`: the built-in job end to end on 2 CPU ranks (the fxfuse backend, checked against eager), its
summary, its progress lines, and clean errors for bad input (one `fxfuse: error:` line, exit status 2,
before any work)."""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxfuse.cli import format_run_summary, main


@pytest.mark.slow
def test_run_tiny_tp2_matches_transformers(tmp_path):
    out = tmp_path / "out.json"
    assert main(["run", "--backend", "eager", "--compare", "hf", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["tp"] == 2 and summary["device"] == "cpu" and summary["backend"] == "eager"
    assert summary["inner_compiler"] is None and summary["options"]["inner"] is None and summary["weights"] == "bf16"
    assert summary["max_rel_err"] is not None and summary["max_rel_err"] <= 1e-4
    assert summary["step_ms"] > 0 and summary["step_ms_p90"] >= summary["step_ms"]
    assert summary["tokens_per_s"] == pytest.approx(summary["batch"] * 1000 / summary["step_ms"])
    assert summary["cuda_graph"] is False and summary["graph_widths"] == []  # CPU: no CUDA graphs
    assert summary["options"]["cuda_graph"] is False and summary["options"]["graph_widths"] == []  # what ran
    assert summary["rank"] == 0 and summary["options"]["preset"] == "tiny"
    assert summary["peak_gpu_mem_gb"] is None
    assert summary["allreduce_sites"] is None and summary["fused_sites"] is None  # only the fxfuse backend fuses
    assert summary["fused_op"] is None
    assert len(summary["tokens"]) == 1 + summary["steps"]  # one token from prefill, one per 1-token step
    assert summary["accepted_drafts"] == [[0, 0]] * summary["steps"]  # 1-token steps carry no drafts


@pytest.mark.slow
def test_the_built_in_job_fuses_every_site_and_matches_eager(tmp_path, capfd):
    """`fxfuse run` alone (what `scripts/dev run` runs): tp=2 on CPU, the fxfuse backend (passes, then
    eager) fuses all 1 + 2 * 4 all-reduce sites of the tiny model; logits match the eager model step
    for step; the summary says so, and what the op ran. Rank 0 alone reports progress, and compiling
    has its own lines: the shapes compiled and the layers dynamo traced."""
    out = tmp_path / "out.json"
    assert main(["run", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert (summary["backend"], summary["inner_compiler"], summary["compare"]) == ("fxfuse", "eager", "eager")
    assert summary["allreduce_sites"] == summary["fused_sites"] == 9
    assert summary["fused_op"] == "the CPU reference kernel: gloo all-reduce + float32 RMSNorm"
    assert summary["fxfuse_fusion"] == "auto"
    assert summary["max_rel_err"] <= 1e-4  # float32: the fused op and eager differ by rounding only
    assert summary["compare_ok"] and summary["max_rel_err"] <= summary["max_rel_err_bound"]
    captured = capfd.readouterr()
    assert "backend fxfuse (fusion passes, then eager)" in captured.out
    assert ("fxfuse fused 9 of 9 all-reduce sites; the fused op ran the CPU reference kernel: gloo all-reduce + "
            "float32 RMSNorm") in captured.out
    assert "4 steps of 1 token:" in captured.out and "max relative error vs eager (the same model uncompiled" in captured.out
    err = captured.err
    assert err.count("building tiny (4 layers, random weights)") == 2  # one start and one done line, rank 0 only
    for shape in ("prefill, 2 x 12 tokens (1/2;", "verify step, 2 x 1 tokens (2/2;"):
        compiling = [line for line in err.splitlines() if f"fxfuse: compiling the {shape}" in line]
        assert compiling[0].endswith("fxfuse passes and eager) ...") and ": done in " in compiling[-1]
        assert sum(line.endswith(") ...") for line in compiling) == 1  # rank 0 only
    assert err.count("fxfuse: dynamo traced layer 4/4") >= 1  # once per compile that traces the model
    assert err.count("verify steps of 2 x 1 tokens: 4/4") == 1
    repo = Path(__file__).resolve().parents[1]
    cli_doc = (repo / "docs" / "CLI.md").read_text().split("### The summary\n", 1)[1].split("\n## ", 1)[0]
    assert not [key for key in summary if f"`{key}`" not in cli_doc]  # docs/CLI.md documents every summary field
    readme = (repo / "README.md").read_text()
    sample = readme.split("## What `scripts/dev run` shows", 1)[1].split("```\n", 2)[1].splitlines()
    printed = captured.out.splitlines()
    # the README's sample is this output, timings aside, and the check's numbers aside: float32 rounding
    # differs between CPUs (the error was 4.390e-07 on one, 3.477e-07 on another), so each is held to its bound
    for lines in (sample, printed):
        error, bound = compare_line_numbers(lines[-1])
        assert error <= bound
    assert [line for i, line in enumerate(sample) if i != 2][:-1] == [line for i, line in enumerate(printed) if i != 2][:-1]
    assert ROUNDED.sub("<n>", sample[-1]) == ROUNDED.sub("<n>", printed[-1])


#: The numbers of the summary's check line that float32 rounding decides: the error and the sensitivity.
ROUNDED = re.compile(r"\d\.\d+e[-+]\d+")


def compare_line_numbers(line: str) -> tuple[float, float]:
    """(error, bound) of the summary's `max relative error vs ...` line."""
    match = re.fullmatch(r"max relative error vs .*?: (\S+): ok, within the bound (\S+) \(.*\)", line)
    assert match, line
    return float(match[1]), float(match[2])


@pytest.mark.slow
def test_multi_token_verify_steps_generate_the_greedy_sequence():
    """Speculative verify with 4-token steps must reproduce one-token greedy decoding exactly."""
    from fxfuse.runner.run import RunOptions, run

    one = run(RunOptions(tokens_per_step=1, steps=8, tp=1, backend="eager", compare="none"))
    four = run(RunOptions(tokens_per_step=4, steps=3, tp=1, backend="eager", compare="none"))
    n = min(len(one["tokens"]), len(four["tokens"]))
    assert n >= 4
    assert four["tokens"][:n] == one["tokens"][:n]
    # each step adds its accepted drafts plus one token; the summary says how many were accepted
    accepted = [step[0] for step in four["accepted_drafts"]]
    assert len(four["accepted_drafts"]) == 3 and all(0 <= k <= 3 for k in accepted)
    assert len(four["tokens"]) == 1 + sum(k + 1 for k in accepted)
    assert f"drafts accepted per step (sequence 0, of 3): {', '.join(map(str, accepted))};" in format_run_summary(four)
    # tokens/s counts what the steps generate (accepted drafts + 1 per sequence), not the drafts they read
    generated = sum(sum(k + 1 for k in step) for step in four["accepted_drafts"]) / len(four["accepted_drafts"])
    assert four["tokens_per_s"] == pytest.approx(generated * 1000 / four["step_ms"])
    assert four["verified_tokens_per_s"] == pytest.approx(four["batch"] * 4 * 1000 / four["step_ms"])
    assert f"{four['tokens_per_s']:,.0f} tokens/s generated ({four['verified_tokens_per_s']:,.0f} tokens/s verified" \
        in format_run_summary(four)


def test_tokens_per_second_counts_no_draft_that_was_not_accepted():
    """Issue 41: 4-token steps with no draft accepted generate one token per sequence per step, not four."""
    summary = {"rank": 0, "tp": 2, "device": "cpu", "backend": "eager", "inner_compiler": None, "dtype": "float32",
               "weights": "bf16", "model": "tiny", "layers": 4, "batch": 2, "prompt_len": 12, "tokens_per_step": 4,
               "steps": 2, "cuda_graph": False, "graph_widths": [], "compare": "none", "step_ms": 10.0, "step_ms_p90": 10.0,
               "tokens_per_s": 200.0, "verified_tokens_per_s": 800.0, "peak_gpu_mem_gb": None, "fused_sites": None,
               "tokens": [1, 2, 3], "accepted_drafts": [[0, 0], [0, 0]]}
    assert "200 tokens/s generated (800 tokens/s verified, drafts included)" in format_run_summary(summary)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--preset", "nope"], "unknown model preset 'nope'; choose one of: tiny, deepseek-v3, kimi-k2, kimi-k2.5"),
        (["run", "--tp", "3"], "tensor parallel size 3 does not divide"),
        (["run", "--tp", "100000"], "tensor-parallel sizes that fit this model: 1, 2, 4"),
        (["run", "--graph-widths", "1,2"], "--graph-widths needs --device cuda"),
        (["run", "--backend", "eager", "--inner", "eager"], "--inner applies to --backend fxfuse only"),
        (["run", "--batch", "1000000000"], "of this machine's memory (2 ranks x"),  # the memory plan, before any rank
        (["run", "--json", ""], "--json: the path is empty"),
        (["run", "--json", "/proc/fxfuse.json"], "--json /proc/fxfuse.json: cannot create the file"),
        (["report", "--json", ""], "--json: the path is empty"),
        (["report", "--tp", "3"], "tensor-parallel sizes that fit this model: 1, 2, 4"),
        (["plan", "--gpu-memory-gb", "0"], "argument --gpu-memory-gb: must be a finite number above 0 (got '0')"),
        (["plan", "--gpu-memory-gb", "-96"], "must be a finite number above 0 (got '-96')"),
        (["plan", "--gpu-memory-gb", "nan"], "must be a finite number above 0 (got 'nan')"),
        (["plan", "--gpu-memory-gb", "inf"], "must be a finite number above 0 (got 'inf')"),
        (["plan", "--gpu-memory-gb", "lots"], "argument --gpu-memory-gb: expected a number, got 'lots'"),
        (["plan", "--preset", "tiny", "--tp", "2", "--context", "100000"],
         "--context 100000 is more than the model's max_position_embeddings (256)"),
        (["plan", "--preset", "tiny", "--tp", "2", "--context", "64"], "--context 64 is shorter than the widest step (128"),
        (["plan", "--tp", "3"], "tensor-parallel sizes that fit this model: 1, 2, 4, 8, 16, 32, 64, 128"),
        (["run", "--device", "cuda"], "no CUDA GPU"),
        (["run", "--checkpoint", "/nonexistent/ckpt"], "the directory does not exist"),
        (["run", "--tokens", "0"], "argument --tokens: must be at least 1 (got 0)"),
        (["run", "--tp", "0"], "argument --tp: must be at least 1 (got 0)"),
        (["run", "--tp", "two"], "argument --tp: expected an integer, got 'two'"),
        (["run", "--layers", "-1"], "argument --layers: must be at least 1 (got -1)"),
        (["run", "--layers", "5"], "--layers must be between 1 and 4 (got 5)"),
        (["run", "--steps", "0"], "argument --steps: must be at least 1 (got 0)"),
        (["run", "--cuda-graph"], "--cuda-graph needs --device cuda"),
        (["run", "--dynamic", "maybe"], "argument --dynamic: invalid choice: 'maybe'"),
        (["bench", "model", "--dynamic", "always"], "argument --dynamic: invalid choice: 'always'"),
        (["bench", "fallback", "--modes", "eager"], "argument --modes: expected a comma-separated subset of static, dynamic"),
        (["run", "--tokens", "129"], "--tokens must be at most 128"),
        (["run", "--graph-widths", "1,256"], "argument --graph-widths: each value must be between 1 and 128"),
        (["run", "--prompt-len", "200", "--tokens", "64", "--steps", "2"], "KV cache would need 393 positions"),
        (["run", "--preset", "deepseek-v3", "--layers", "61"], "the weights need at least"),  # 2.7 TB in float32
        (["run", "--frobnicate"], "unrecognized arguments: --frobnicate (see `fxfuse run --help`)"),
        (["run", "--verb"], "unrecognized arguments: --verb"),  # no abbreviations: --verb is not --verbose
        (["--frobnicate"], "unrecognized arguments: --frobnicate (see `fxfuse --help`)"),
        ([], "choose a command: run, report, bench"),
        (["bench"], "choose a benchmark: kernel, model, fallback, gemm, compile (see `fxfuse bench --help`)"),
        (["bench", "model", "--nope"], "unrecognized arguments: --nope (see `fxfuse bench model --help`)"),
        (["bench", "gemm", "--parts", "dense,mlp"], "argument --parts: expected a comma-separated subset of dense, experts"),
        (["bench", "gemm", "--tokens", "0"], "argument --tokens:"),
        (["bench", "fallback", "--repeats", "0"], "argument --repeats: must be at least 1 (got 0)"),
        (["report", "--tp", "0"], "argument --tp: must be at least 1 (got 0)"),
        (["report", "--layers", "9"], "--layers must be between 1 and 4 (got 9)"),
    ],
)
def test_bad_input_gives_one_line_error_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxfuse: error:") and message in err
    assert err.count("\n") == 1  # one line, no usage text, no traceback


def test_dynamic_reaches_the_run_options(monkeypatch):
    """`fxfuse run --dynamic on` runs the built-in job compiled for dynamic shapes (what it runs is stubbed)."""
    import fxfuse.runner.run

    seen = []

    def stop(setup):
        seen.append((setup.options.dynamic, setup.dynamic_shapes))
        raise KeyboardInterrupt

    monkeypatch.setattr(fxfuse.runner.run, "run_prepared", stop)
    assert main(["run", "--dynamic", "on"]) == 130 and main(["run"]) == 130
    assert seen == [("on", True), ("off", False)]  # auto on CPU: static shapes, as before



#: What torchrun tells each of the 2 processes it starts (rank 0's view).
TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500"}


def test_under_torchrun_the_launch_decides_the_tp(monkeypatch, capsys):
    """Each torchrun process is one rank: a --tp other than its WORLD_SIZE is refused before any work (it
    used to run at the launch's size silently); without --tp the launch's size is the run's."""
    import fxfuse.bench.model
    import fxfuse.runner.run

    started = []

    def start(setup):
        started.append(setup.options.tp)
        raise KeyboardInterrupt  # the checks passed: stop here

    monkeypatch.setattr(fxfuse.runner.run, "run_prepared", start)
    monkeypatch.setattr(fxfuse.bench.model, "run_on_ranks", lambda *a, **k: pytest.fail("the benchmark started"))
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    message = ("fxfuse: error: --tp 4, but torchrun started 2 processes (WORLD_SIZE=2) and each is one rank: give --tp 2, "
               "or start 4 (torchrun --nproc-per-node 4)\n")
    assert main(["run", "--tp", "4"]) == 2 and capsys.readouterr().err == message
    assert main(["bench", "model", "--device", "cpu", "--tp", "4"]) == 2 and capsys.readouterr().err == message
    assert main(["run", "--tp", "2"]) == 130 and started == [2]
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["run"]) == 130 and started == [2, 4]

def test_verbose_is_taken_before_or_after_the_subcommand():
    from fxfuse.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["--verbose", "run"]).verbose and parse(["run", "--verbose"]).verbose
    assert not parse(["run"]).verbose and parse(["--verbose", "bench", "model"]).verbose


def test_bench_arguments_are_handed_over_without_the_command_and_verbose():
    from fxfuse.cli import _benchmark_argv

    argv = ["--verbose", "bench", "model", "--device", "cpu", "--verbose", "--preset", "tiny"]
    assert _benchmark_argv(argv, "model") == ["--device", "cpu", "--preset", "tiny"]


def test_help_shows_every_default():
    """Every option of every subcommand and benchmark says its default in --help."""
    from fxfuse.cli import build_parser

    def subparsers(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield sub
                    yield from subparsers(sub)

    parsers = list(subparsers(build_parser()))
    assert {p.prog for p in parsers} >= {"fxfuse run", "fxfuse report", "fxfuse bench", "fxfuse bench model",
                                         "fxfuse bench kernel"}
    missing = [
        f"{p.prog} {action.option_strings[0]}"
        for p in parsers
        for action in p._actions
        if action.option_strings and action.dest not in ("help", "verbose") and "default" not in (action.help or "")
    ]
    assert not missing


@pytest.mark.parametrize("command", ["run", "report"])
def test_unwritable_json_path_is_refused_before_any_work(command, monkeypatch, capsys):
    import fxfuse.runner.options as options

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the output path was checked")

    monkeypatch.setattr(options, "prepare_run", no_work)
    monkeypatch.setattr(options, "resolve_model", no_work)
    assert main([command, "--json", "/nonexistent_dir/x.json"]) == 2
    assert capsys.readouterr().err == "fxfuse: error: --json /nonexistent_dir/x.json: directory '/nonexistent_dir' does not exist\n"


def test_output_path_checks(tmp_path):
    from fxfuse.command_line import check_output_dir, check_output_file

    check_output_file(tmp_path / "new.json", "--json")  # a new file in an existing folder: fine
    check_output_dir(tmp_path / "new" / "deeper", "--out-dir")  # created later, under a writable folder
    with pytest.raises(ValueError, match="is a directory, not a file"):
        check_output_file(tmp_path, "--json")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        check_output_dir(tmp_path / "file" / "results", "--out-dir")
    # tried, not only asked: root passes every permission check, yet nothing can be created in /proc
    with pytest.raises(ValueError, match="--out-dir /proc/fxfuse-results: (cannot create folders in|'/proc' is not writable)"):
        check_output_dir("/proc/fxfuse-results", "--out-dir")
    check_output_dir(tmp_path, "--out-dir")  # an existing writable folder; the probe file is gone again
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_a_failed_write_at_the_end_keeps_the_results_and_exits_2(tmp_path, monkeypatch, capsys):
    """The path was fine when the run started but cannot be written when it ends: the summary is
    printed anyway, then one error line naming the file."""
    import fxfuse.runner.run

    target = tmp_path / "out.json"
    summary = {"rank": 0, "tp": 2, "device": "cpu", "backend": "eager", "inner_compiler": None, "dtype": "float32",
               "weights": "bf16", "model": "tiny",
               "layers": 4, "batch": 2, "prompt_len": 12, "tokens_per_step": 1, "steps": 4, "cuda_graph": False,
               "graph_widths": [], "compare": "none", "max_rel_err": None, "step_ms": 2.0, "step_ms_p90": 3.0,
               "tokens_per_s": 1000.0, "peak_gpu_mem_gb": None, "fused_sites": None, "fused_op": None, "tokens": [1, 2, 3, 4, 5],
               "accepted_drafts": [[0, 0]] * 4}

    def run_prepared(setup):
        target.mkdir()  # now a directory: the write fails
        return summary

    monkeypatch.setattr(fxfuse.runner.run, "run_prepared", run_prepared)
    assert main(["run", "--json", str(target)]) == 2
    out, err = capsys.readouterr()
    assert "tokens (sequence 0): [1, 2, 3, 4, 5]" in out
    assert err.startswith(f"fxfuse: error: cannot write {target}: ") and err.count("\n") == 1


def test_checkpoint_that_does_not_fit_tp_is_refused_before_loading(tmp_path, capsys):
    from fxfuse.models.presets import get_preset

    (tmp_path / "config.json").write_text(json.dumps(get_preset("tiny").to_hf_dict()))  # no weights: never read
    assert main(["run", "--checkpoint", str(tmp_path), "--tp", "3"]) == 2
    assert "tensor parallel size 3 does not divide" in capsys.readouterr().err


@pytest.mark.parametrize("tp, gpus", [(2, 1), (8, 1), (8, 4)])
def test_more_gpus_than_present_is_refused_before_any_rank(tp, gpus, monkeypatch, capsys):
    """Ranks sharing a GPU are a test mode (tests/gpu, `fxfuse bench kernel`), never a user's run: `fxfuse run
    --tp N` on fewer than N GPUs is one error line, and no rank starts."""
    import fxfuse.runner.run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(fxfuse.runner.run, "run_on_ranks", lambda *a, **k: pytest.fail("a rank was started"))
    assert main(["run", "--device", "cuda", "--tp", str(tp)]) == 2
    err = capsys.readouterr().err
    assert f"--tp {tp} needs {tp} GPUs (one process per GPU), but only {gpus} are present" in err and err.count("\n") == 1


def test_help_describes_the_default_job():
    out = subprocess.run([sys.executable, "-m", "fxfuse", "run", "--help"], capture_output=True, text=True, check=True)
    assert "tiny preset" in out.stdout and "--compare" in out.stdout and "--tokens" in out.stdout
    assert "--cuda-graph" in out.stdout and "--no-cuda-graph" in out.stdout and "--graph-widths" in out.stdout
    assert "fxfuse backend" in out.stdout and "--inner" in out.stdout


@pytest.mark.parametrize("command", ["run", "report", "plan"])
def test_help_lists_every_preset_of_the_registry(command, capsys):
    from fxfuse.models.presets import PRESETS

    assert main([command, "--help"]) == 0
    assert "built-in model config: " + ", ".join(PRESETS) in " ".join(capsys.readouterr().out.split())


def test_a_checkpoint_that_is_a_file_is_named(tmp_path, capsys):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert main(["run", "--checkpoint", str(tmp_path / "model.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "is a file; give the directory that holds config.json and the .safetensors files" in err and err.count("\n") == 1


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_checkpoint_is_refused_before_any_rank(damage, tmp_path, monkeypatch, capsys):
    """The safetensors headers are read in the launching process: a truncated or missing weights file is
    one error line there, and no rank starts."""
    import fxfuse.runner.run
    from checkpoint_helpers import save_tiny_hf_checkpoint

    save_tiny_hf_checkpoint(tmp_path)
    weights = tmp_path / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        weights.unlink()
    capsys.readouterr()  # the checkpoint writer's progress bar

    def no_ranks(setup):
        raise AssertionError("a rank started")

    monkeypatch.setattr(fxfuse.runner.run, "run_prepared", no_ranks)
    assert main(["run", "--checkpoint", str(tmp_path), "--backend", "eager"]) == 2
    err = capsys.readouterr().err
    expected = "file not fully covered" if damage == "truncated" else "no model.safetensors or model.safetensors.index.json"
    assert err.startswith(f"fxfuse: error: checkpoint {tmp_path} cannot be loaded: ") and expected in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("content", ["[1, 2]", '{"hidden_size": "thirty-two", "vocab_size": 8, "num_hidden_layers": 1, '
                                     '"num_attention_heads": 2}', "{}"])
@pytest.mark.parametrize("command", ["run", "report", "plan"])
def test_a_malformed_config_json_is_one_error_line(command, content, tmp_path, capsys):
    (tmp_path / "config.json").write_text(content)
    assert main([command, "--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fxfuse: error: cannot read {tmp_path / 'config.json'}: ") and err.count("\n") == 1


def test_benchmarks_say_where_they_wrote_their_files(tmp_path, monkeypatch, capsys):
    """The default --out-dir is relative (bench/results of the current directory): the files are listed by
    absolute path, so a run from another folder says where its results went."""
    from fxfuse.bench.output import publish

    monkeypatch.chdir(tmp_path)
    publish({}, "model", ["--device", "cpu"], lambda report: [Path("bench/results/x.json")], lambda report: "table")
    assert capsys.readouterr().out == f"wrote {tmp_path}/bench/results/x.json\ntable\n"
