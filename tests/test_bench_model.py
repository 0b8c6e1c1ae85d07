"""CPU tests of `fxfuse bench model` (and `fxfuse bench kernel`'s CPU error): input errors, defaults that fit
the machine, the smoke run on 2 gloo ranks, failure handling and the report writer (ratios, all-reduce
share, files). The CUDA-graph timing itself runs on a GPU (`PARTS=model scripts/gpu_check.sh`)."""

from __future__ import annotations

import json

import pytest
import torch

from fxfuse.bench.model import config_from_args, main, parse_args
from fxfuse.bench.model_report import markdown, ratio_summary, summary_rows, write_report


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "needs CUDA GPUs (use --device cpu"),
        (["--device", "cpu", "--backends", "eager,tvm"], "unknown backends ['tvm']"),
        (["--device", "cpu", "--tokens", "1,256"], "--tokens must be at most 128"),
        (["--device", "cpu", "--tokens", "64", "--context", "32"], "does not fit a KV cache of --context 32"),
        (["--device", "cpu", "--preset", "nope"], "unknown preset 'nope'"),
        (["--device", "cpu", "--preset", "deepseek-v3", "--layers", "62"], "--layers must be between 1 and 61"),
        (["--device", "cpu", "--layers", "5"], "--layers must be between 1 and 4"),  # tiny on cpu
        (["--device", "cpu", "--tp", "3"], "tensor parallel size 3 does not divide"),
        (["--device", "cpu", "--batch", "0"], "--batch values must be at least 1"),
        (["--device", "cpu", "--repeats", "0"], "argument --repeats: must be at least 1 (got 0)"),
        (["--device", "cpu", "--context", "300"], "--context 300 exceeds max_position_embeddings 256"),
        (["--device", "cpu", "--out-dir", __file__ + "/results"], "is not a directory"),
        (["--device", "cpu", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_input_exits_2_with_a_message(argv, message, capsys):
    if not argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxfuse: error: ") and message in err and err.count("\n") == 1


def test_an_unknown_fp8_gemm_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setenv("FXFUSE_FP8_GEMM", "w4a4")
    assert main(["--device", "cpu", "--weights", "fp8"]) == 2
    assert capsys.readouterr().err == "fxfuse: error: FXFUSE_FP8_GEMM='w4a4'; choose one of: w8a16, w8a8\n"


def test_the_fp8_gemm_is_recorded_and_named_in_the_title(monkeypatch):
    monkeypatch.setenv("FXFUSE_FP8_GEMM", "w8a8")
    config, _ = config_from_args(parse_args(["--device", "cpu", "--weights", "fp8"]))
    assert (config.weights, config.fp8_gemm) == ("fp8", "w8a8")
    report = fake_report()
    report["config"].update(weights="fp8", fp8_gemm="w8a8")
    assert markdown(report).startswith("# fxfuse bench model: NVIDIA H200, tp=2, deepseek-v3 (4 layers), bfloat16, fp8 w8a8 weights\n")


def test_cpu_defaults_make_a_short_smoke_run_where_sites_fuse():
    """On cpu the defaults are the smoke run of `CPU_SMOKE_RUN`: the tiny preset (full-width DeepSeek-V3 layers
    do not fit in memory), its first 2 layers (one dense, one MoE) and a KV cache of its 256 positions (1024 is
    the default only where it fits); tp 2, so there are all-reduce sites to fuse; one width and one batch size,
    so each compiled backend compiles one graph; few samples. Every backend is still measured."""
    config, tp = config_from_args(parse_args(["--device", "cpu"]))
    assert (config.preset, config.layers, config.context, tp) == ("tiny", 2, 256, 2)
    assert (config.tokens, config.batches, config.backends) == ((2,), (2,), ("eager", "inductor", "fxfuse"))
    assert (config.repeats, config.iters, config.cuda_graphs, config.dynamic) == (3, 2, False, (True,))
    given, tp = config_from_args(parse_args(["--device", "cpu", "--tp", "1", "--layers", "4", "--tokens", "1,4",
                                             "--batch", "1,8", "--repeats", "10", "--iters", "5"]))
    assert (given.layers, given.tokens, given.batches, given.repeats, given.iters, tp) == (4, (1, 4), (1, 8), 10, 5, 1)


def test_the_help_says_what_the_cpu_run_does_and_does_not_measure(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--device cpu is a smoke run of the benchmark's code" in text
    assert "tensor parallel over 2 gloo processes" in text and "What it does not measure: speed." in text
    assert "default 1,4,16,64 on cuda, 2 on cpu" in text  # --tokens, per device


@pytest.mark.parametrize("out_dir, message", [
    ("/proc/fxfuse-results", "--out-dir /proc/fxfuse-results: "),  # root passes the permission bits, yet cannot create it
    (__file__ + "/results", "is not a directory"),
], ids=["in /proc", "under a file"])
def test_an_unwritable_out_dir_is_refused_before_any_work(out_dir, message, monkeypatch, capsys):
    """`fxfuse bench model --device cpu --out-dir X` with X not writable: one `fxfuse: error:` line and exit
    status 2 before the op's settings are read, the benchmark is imported or any rank starts (at once: the
    same command in a fresh process imports no torch, `tests/test_cli_startup.py`)."""
    from types import SimpleNamespace

    import fxfuse.cli
    import fxfuse.runner.op_settings

    def no_work(*args, **kwargs):
        raise AssertionError("work started before --out-dir was checked")

    monkeypatch.setattr(fxfuse.runner.op_settings, "checked_op_settings", no_work)
    monkeypatch.setattr(fxfuse.cli, "importlib", SimpleNamespace(import_module=no_work))  # the benchmark's module
    assert fxfuse.cli.main(["bench", "model", "--device", "cpu", "--out-dir", out_dir]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxfuse: error: ") and message in err and err.count("\n") == 1


def test_full_width_layers_that_do_not_fit_in_memory_are_refused(monkeypatch, capsys):
    import fxfuse.runner.options as options

    monkeypatch.setattr(options, "available_host_memory", lambda: 16 * 10**9)
    assert main(["--device", "cpu", "--preset", "deepseek-v3", "--layers", "4"]) == 2
    assert "the weights need at least 30.2 GB of memory" in capsys.readouterr().err


def test_the_timing_says_whether_steps_were_replayed_or_uncaptured():
    """CUDA graphs by default on cuda; `--no-cuda-graphs` times the uncaptured steps; cpu never captures."""
    import dataclasses

    from fxfuse.bench.model import _timing_text

    cpu, _ = config_from_args(parse_args(["--device", "cpu"]))
    assert cpu.cuda_graphs is False and _timing_text(cpu, cuda=False).startswith("CPU smoke run, wall clock")
    assert parse_args(["--no-cuda-graphs"]).cuda_graphs is False and parse_args([]).cuda_graphs is True
    replayed = dataclasses.replace(cpu, device="cuda", cuda_graphs=True, repeats=10, iters=5)  # cuda's defaults
    assert _timing_text(replayed, cuda=True) == "CUDA-graph replay; median of 10 samples of 5 replays, slowest rank"
    uncaptured = dataclasses.replace(replayed, cuda_graphs=False)
    assert _timing_text(uncaptured, cuda=True).startswith("uncaptured compiled steps (no CUDA graphs: host cost included)")


def test_kernel_bench_without_cuda_is_one_error_line(capsys):
    from fxfuse.bench.kernel import main as kernel_main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert kernel_main([]) == 2
    assert capsys.readouterr().err == "fxfuse: error: fxfuse bench kernel needs CUDA GPUs (this machine has none)\n"


def test_kernel_variant_names_match_the_report():
    from fxfuse.bench.arguments import KERNEL_VARIANTS
    from fxfuse.bench.kernel_report import VARIANTS

    assert KERNEL_VARIANTS == tuple(VARIANTS)


@pytest.mark.slow
def test_cpu_smoke_run_writes_a_report(tmp_path):
    """Two gloo ranks, the tiny model cut to 1 layer, eager only: rows per point, collectives timed."""
    argv = ["--device", "cpu", "--preset", "tiny", "--layers", "1", "--tp", "2", "--tokens", "1,2", "--batch", "2",
            "--backends", "eager", "--repeats", "2", "--iters", "1", "--context", "16", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    (json_path,) = tmp_path.glob("model_cpu-*_tp2_tiny-1l_*.json")
    report = json.loads(json_path.read_text())
    assert report["command"].startswith("fxfuse bench model --device cpu")
    assert report["world_size"] == 2 and report["cuda_graphs"] is False
    assert [(r["batch"], r["tokens"], r["backend"], r["status"]) for r in report["results"]] == [
        (2, 1, "eager", "ok"), (2, 2, "eager", "ok")]
    assert all(r["step_ms"] > 0 for r in report["results"])
    assert all(0 < r["eager_sensitivity"] < 0.05 for r in report["results"])  # the perturbed eager step, per width
    assert [(c["tokens"], c["allreduces"]) for c in report["collectives"]] == [(1, 3), (2, 3)]  # 1 + 2 * layers
    assert [row["allreduce_share"] > 0 for row in report["summary"]] == [True, True]
    assert json_path.with_suffix(".md").exists()


@pytest.mark.slow
def test_the_default_cpu_smoke_run_fuses_every_site_and_checks_every_backend(tmp_path):
    """`fxfuse bench model --device cpu` with its defaults, as its --help describes it: tp 2 on gloo, the tiny
    preset's first 2 layers, eager, Inductor and fxfuse (its passes, then Inductor) at one point, each within
    the bound of eager; all 5 sites fused; the report written. Measured on 2 shared CPU cores (2026-12-02): this
    test 44 s with a cold Inductor cache, 10 s with a warm one; the command itself 47 to 85 s cold (by the
    machine's load) and 19 s warm. Before these defaults (tp 1, widths 1,4,16,64 x batches 1,8, 10 x 5 samples)
    it took 10.6 minutes, 3.3 the second time, and had no site to fuse."""
    assert main(["--device", "cpu", "--out-dir", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("model_cpu-*_tp2_tiny-2l_*.json")
    report = json.loads(json_path.read_text())
    assert report["world_size"] == 2 and report["cuda_graphs"] is False
    assert report["allreduce_sites"] == report["fused_sites"] == 5  # the embedding's, then two per layer
    assert [(r["batch"], r["tokens"], r["backend"], r["status"]) for r in report["results"]] == [
        (2, 2, "eager", "ok"), (2, 2, "inductor", "ok"), (2, 2, "fxfuse", "ok")]
    assert all(r["step_ms"] > 0 for r in report["results"])
    assert [row["fxfuse_over_inductor"] is not None for row in report["summary"]] == [True]
    assert json_path.with_suffix(".md").exists()


def test_a_failing_backend_is_reported_not_fatal():
    from fxfuse.bench.model import _prepare_runner

    class Model:
        def reset_cache(self):
            pass

    def broken_step(ids, positions):
        raise RuntimeError("lowering failed\nsecond line")

    config, _ = config_from_args(parse_args(["--device", "cpu", "--tokens", "1"]))
    inputs = {1: (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))}
    runner, error = _prepare_runner(Model(), broken_step, 1, config, inputs, torch.device("cpu"), {}, "inductor", None)
    assert runner is None and error == "RuntimeError: lowering failed"


def fake_report(world_size=2):
    """Two points at batch 1; fxfuse 10% faster than inductor at 4 tokens, equal at 1."""
    times = {1: (10.0, 4.0, 4.0), 4: (12.0, 5.0, 4.5)}
    results = [
        {"batch": 1, "tokens": tokens, "backend": backend, "status": "ok", "step_ms": ms, "step_ms_p90": ms,
         "rel_err_vs_eager": None if backend == "eager" else 3e-3, "note": ""}
        for tokens, row in times.items() for backend, ms in zip(("eager", "inductor", "fxfuse"), row)
    ]
    collectives = [{"batch": 1, "tokens": t, "allreduces": 9, "allreduce_ms": 1.0} for t in times] if world_size > 1 else []
    return {
        "gpu": "NVIDIA H200", "world_size": world_size, "stamp": "20261129-090000", "date": "2026-11-29T09:00:00+00:00",
        "command": "fxfuse bench model", "versions": {"torch": "2.11.0"}, "timing": "CUDA-graph replay",
        "config": {"preset": "deepseek-v3", "layers": 4, "dtype": "bfloat16", "context": 1024},
        "allreduce_sites": 9 if world_size > 1 else 0, "fused_sites": 9 if world_size > 1 else 0,
        "fused_kernel_ready": world_size > 1, "tolerance": 0.1, "results": results, "collectives": collectives,
    }


def test_summary_rows_give_ratio_and_all_reduce_share():
    rows = summary_rows(fake_report())
    assert [(r["tokens"], r["fxfuse_over_inductor"], r["allreduce_share"]) for r in rows] == [
        (1, 1.0, 0.25), (4, pytest.approx(0.9), 0.2)]
    summary = ratio_summary(rows)
    assert summary["geomean"] == pytest.approx((1.0 * 0.9) ** 0.5)
    assert (summary["min"], summary["max"], summary["points"]) == (pytest.approx(0.9), 1.0, 2)


def test_markdown_states_tp1_and_has_one_row_per_point():
    text = markdown(fake_report(world_size=1))
    assert "tp=1: the step has no all-reduce" in text
    assert "| 1 | 4 | 12.000 | 5.000 | 4.500 | 0.900 | - | - |" in text
    assert "geometric mean 0.949" in text


def test_markdown_states_the_check_and_its_bound():
    report = fake_report(world_size=1)
    assert "worst relative L2 error 3.00e-03 (tolerance 0.1)" in markdown(report)  # reports without sensitivity
    report["sensitivity_factor"] = 3.0
    for row, sensitivity in zip(report["results"], (0.02, 0.02, 0.02, 0.104, 0.104, 0.104)):
        row["eager_sensitivity"] = sensitivity
    report["results"][-1].update(status="failed", rel_err_vs_eager=0.5)
    text = markdown(report)
    assert "bound per point: max(0.1, 3 x the eager step's sensitivity" in text and "2.00e-02 to 1.04e-01)" in text
    assert "FAILED checks: fxfuse batch 1 x 4 (err 5.00e-01)" in text


def test_write_report_files(tmp_path):
    paths = write_report(fake_report(), tmp_path)
    assert paths[0].name == "model_nvidia-h200_tp2_deepseek-v3-4l_20261129-090000.json"
    document = json.loads(paths[0].read_text())
    assert document["fxfuse_over_inductor"]["points"] == 2 and len(document["summary"]) == 2
    assert "| 1 | 1 | 10.000 | 4.000 | 4.000 | 1.000 | 1.000 | 25.0% |" in paths[1].read_text()


def test_result_file_names_keep_dots_of_the_preset(tmp_path):
    from fxfuse.bench.output import write_result_files

    paths = write_result_files(tmp_path / "model_gpu_tp1_kimi-k2.5-2l_20261201", {"a": 1}, "# x\n", lambda path: False)
    assert [p.name for p in paths] == ["model_gpu_tp1_kimi-k2.5-2l_20261201.json", "model_gpu_tp1_kimi-k2.5-2l_20261201.md"]


def test_dynamic_auto_is_static_shapes_where_every_width_is_captured():
    from fxfuse.bench.model import shape_modes

    assert config_from_args(parse_args(["--device", "cpu"]))[0].dynamic == (True,)  # uncaptured: one graph for all
    assert config_from_args(parse_args(["--device", "cpu", "--dynamic", "both"]))[0].dynamic == (False, True)
    assert config_from_args(parse_args(["--device", "cpu", "--dynamic", "off"]))[0].dynamic == (False,)
    assert [shape_modes("auto", cuda_graphs) for cuda_graphs in (True, False)] == [(False,), (True,)]
    assert [shape_modes(choice, True) for choice in ("on", "off", "both")] == [(True,), (False,), (False, True)]


def test_each_compiled_backend_is_a_variant_per_shape_mode():
    from fxfuse.bench.model import compiled_variants, variant_name

    config, _ = config_from_args(parse_args(["--device", "cpu", "--dynamic", "both"]))
    variants = compiled_variants(torch.nn.Linear(2, 2), config)  # compiles lazily: nothing compiled here
    assert list(variants) == [("eager", None), ("inductor", False), ("inductor", True), ("fxfuse", False), ("fxfuse", True)]
    assert variants[("fxfuse", True)].fxfuse_backend is not variants[("fxfuse", False)].fxfuse_backend
    assert [variant_name(v, config) for v in variants] == [
        "eager", "inductor (static)", "inductor (dynamic)", "fxfuse (static)", "fxfuse (dynamic)"]
    single, _ = config_from_args(parse_args(["--device", "cpu"]))
    assert variant_name(("inductor", True), single) == "inductor"


class FakeModel(torch.nn.Module):
    """What `_bench_batch` uses of the model: its vocabulary, its first decoder layer, its cache reset."""

    def __init__(self):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(vocab_size=16)
        self.embed = torch.nn.Embedding(16, 8)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Linear(8, 16)])

    def reset_cache(self):
        pass

    def forward(self, input_ids, positions):
        return self.model.layers[0](self.embed(input_ids))


@torch.no_grad()
def test_rows_carry_each_variants_shape_mode_and_check():
    """Eager once, Inductor static and dynamic (here stand-ins: the dynamic one off by 50%): every row
    says its backend and mode, the wrong one fails its check, and the report has a table per mode."""
    from types import SimpleNamespace

    from fxfuse.bench.model import _AgreedClock, _bench_batch
    from fxfuse.runner.progress import Progress
    from fxfuse.runner.step_backends import CompiledStep

    config, _ = config_from_args(parse_args(["--device", "cpu", "--tokens", "1,2", "--backends", "eager,inductor",
                                             "--dynamic", "both", "--repeats", "2", "--iters", "1"]))
    model, ctx = FakeModel(), SimpleNamespace(rank=0, world_size=1)
    compiled = {("eager", None): CompiledStep("eager", model),
                ("inductor", False): CompiledStep("inductor", lambda ids, pos: model(ids, pos) * 1.0001),
                ("inductor", True): CompiledStep("inductor", lambda ids, pos: model(ids, pos) * 1.5)}
    rows = _bench_batch(ctx, config, model, compiled, 2, torch.device("cpu"), _AgreedClock(ctx, None), Progress(False, "t"))
    assert [(r["backend"], r["dynamic"], r["tokens"], r["status"]) for r in rows] == [
        ("eager", None, 1, "ok"), ("eager", None, 2, "ok"), ("inductor", False, 1, "ok"), ("inductor", False, 2, "ok"),
        ("inductor", True, 1, "failed"), ("inductor", True, 2, "failed")]
    assert rows[4]["rel_err_vs_eager"] == pytest.approx(0.5, rel=1e-4) and rows[2]["rel_err_vs_eager"] < 1e-3
    report = {**fake_report(world_size=1), "results": rows}
    text = markdown(report)
    assert "### static shapes" in text and "### dynamic shapes" in text
    assert "FAILED checks: inductor dynamic batch 2 x 1 (err 5.00e-01), inductor dynamic batch 2 x 2" in text


def fake_two_mode_report():
    """One point measured static and dynamic: Inductor 4 / 6 ms, fxfuse 4 / 5.4 ms, eager 10 ms."""
    report = fake_report(world_size=1)
    report["results"] = [
        {"batch": 1, "tokens": 4, "backend": backend, "dynamic": dynamic, "status": "ok", "step_ms": ms, "step_ms_p90": ms,
         "rel_err_vs_eager": None if backend == "eager" else 3e-3, "note": ""}
        for backend, dynamic, ms in (("eager", None, 10.0), ("inductor", False, 4.0), ("inductor", True, 6.0),
                                     ("fxfuse", False, 4.0), ("fxfuse", True, 5.4))]
    return report


def test_both_shape_modes_give_a_table_each_and_their_comparison(tmp_path):
    from fxfuse.bench.model_report import static_over_dynamic

    report = fake_two_mode_report()
    rows = summary_rows(report)
    assert [(r["dynamic"], r["eager_ms"], r["inductor_ms"], r["fxfuse_ms"]) for r in rows] == [
        (False, 10.0, 4.0, 4.0), (True, 10.0, 6.0, 5.4)]  # eager, never compiled, in both
    assert static_over_dynamic(rows, "inductor")["geomean"] == pytest.approx(4 / 6)
    assert static_over_dynamic(summary_rows(fake_report()), "inductor") is None  # one mode: nothing to compare
    text = markdown(report)
    assert "- shapes: static (dynamic=False: one graph per batch x width" in text and "; one table per mode" in text
    assert "- inductor, static-shape step / dynamic-shape step: geometric mean 0.667 over 1 points" in text
    static_table, dynamic_table = text.split("### static shapes")[1].split("### dynamic shapes")
    assert "| 1 | 4 | 10.000 | 4.000 | 4.000 | 1.000 | - | - |" in static_table
    assert "| 1 | 4 | 10.000 | 6.000 | 5.400 | 0.900 | - | - |" in dynamic_table
    paths = write_report(report, tmp_path)
    import importlib.util

    assert len(paths) == (3 if importlib.util.find_spec("matplotlib") else 2)  # the plot draws both modes
    document = json.loads(paths[0].read_text())
    assert document["fxfuse_over_inductor"]["static"]["geomean"] == 1.0
    assert document["fxfuse_over_inductor"]["dynamic"]["geomean"] == pytest.approx(0.9)
