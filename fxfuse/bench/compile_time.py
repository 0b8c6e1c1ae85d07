"""`fxfuse bench compile`: cold and warm compile time with plain Inductor and with fxfuse (CPU).

fxfuse must not defeat Inductor's caches: its post-grad pass has a stable uuid, so the FX graph cache
and the AOTAutograd cache serve a second process that compiles the same model, and a warm fxfuse
compile should cost about what a warm Inductor compile costs. For each model, backend and repeat this
runs two fresh processes on one fresh `TORCHINDUCTOR_CACHE_DIR`: the first compiles cold (empty cache),
the second warm (the same cache; dynamo traces again: no cache across processes keeps its work).

What one process measures (`measure`): a one-step forward of the DeepSeek-V3 reference model (batch 1,
4 tokens, bfloat16, uninitialized weights that are never read) as rank 0 of a fake process group,
compiled with `torch.compile(fullgraph=True, dynamic=True)` through the backend (`inductor`:
`compile_fx`, what `backend="inductor"` runs; `fxfuse`: `FxfuseBackend()`, what `backend="fxfuse"`
runs). The compile is timed from the first call to the end of the backend, whose compiled step is then
not run; the backend's own share (AOT autograd, the passes, Inductor or its caches) is timed apart, the
rest is dynamo. Models: `tiny` at tp=2 and `deepseek-v3` (full widths) at tp=8, both cut to `--layers`;
with `--weights fp8` the model keeps FP8 block weights whose GEMMs quantize their inputs (w8a8), so that
the graph holds the FP8 quantizations fxfuse folds, and each cold fxfuse compile reports its passes' time
and the FP8 searches' share of it (`fxfuse.rewrite.records.PassTiming`).
It also reads Inductor's cache counters (FX graph cache and AOTAutograd cache hits, misses, bypasses)
and, for fxfuse, the all-reduce sites and fused sites of the compiled graph from the backend's
records, which on a hit come from the cache (`fxfuse.rewrite.records`).

Writes bench/results/compile_<stamp>.{json,md} (command, machine, versions, date, one row per model
and backend with the median cold and warm seconds and every sample). Exit status 1 when a warm fxfuse
compile missed either cache or recorded other fused sites than the cold one.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fxfuse.bench.arguments import COMPILE_DESCRIPTION, add_compile_arguments
from fxfuse.command_line import CommandParser, check_output_dir, parsed_or_status

#: Tensor-parallel size of each model's fake group, and the step every compile traces.
MODEL_TP = {"tiny": 2, "deepseek-v3": 8}
TOKENS = 4
CHILD_TIMEOUT_S = 1800
#: The cache counters a measurement reads: (counters group, name).
CACHE_COUNTERS = {
    "fx_graph": ("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")),
    "aot_autograd": ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")),
}


class CompiledOnly(Exception):
    """Raised instead of running the compiled step: only the compile is measured."""


def main(argv: list[str] | None = None) -> int:
    """Measure every model and backend cold and warm, write the result files, return the exit status."""
    def parse():
        parser = CommandParser(prog="fxfuse bench compile", description=COMPILE_DESCRIPTION)
        add_compile_arguments(parser)
        args = parser.parse_args(argv)
        check_output_dir(args.out_dir, "--out-dir")
        if args.weights == "fp8" and "tiny" in args.models:
            parser.error("--weights fp8 needs --models deepseek-v3 (the tiny preset's tp 2 slices do not fill whole FP8 blocks)")
        return args

    args, status = parsed_or_status(parse)
    if status is not None:
        return status
    from fxfuse.bench.output import publish, write_result_files

    report = run_benchmark(args)
    publish(report, "compile", argv, lambda r: write_result_files(
        args.out_dir / f"compile_{r['stamp']}", r, markdown(r), lambda path: False), markdown)
    problems = cache_problems(report)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


def run_benchmark(args) -> dict:
    """Cold then warm process per model, backend and repeat (backends interleaved); the report."""
    from fxfuse.bench.output import package_versions, report_header

    report = {**report_header("compile", "none"), "machine": machine(), "versions": package_versions(("triton",)),
              "settings": {"layers": args.layers, "tokens": TOKENS, "dtype": "bfloat16", "dynamic": True,
                           "weights": args.weights,
                           "tp": {model: MODEL_TP[model] for model in args.models}, "repeats": args.repeats,
                           "compile_threads": args.compile_threads or "Inductor's default"},
              "load_average_before": os.getloadavg()}
    samples = {(model, backend): [] for model in args.models for backend in args.backends}
    for _ in range(args.repeats):
        for (model, backend), runs in samples.items():
            cache = tempfile.mkdtemp(prefix="fxfuse-compile-bench-")
            try:
                spec = {"model": model, "backend": backend, "layers": args.layers,
                        "compile_threads": args.compile_threads, "weights": args.weights}
                runs.append({"cold": run_measurement(spec, cache), "warm": run_measurement(spec, cache)})
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    report["load_average_after"] = os.getloadavg()
    report["rows"] = [summarize(model, backend, runs) for (model, backend), runs in samples.items()]
    report["warm_fxfuse_vs_inductor"] = warm_ratios(report["rows"])
    return report


def run_measurement(spec: dict, cache_dir: str) -> dict:
    """`measure(spec)` in a fresh Python process whose Inductor cache is `cache_dir`."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "TRITON_CACHE_DIR": str(Path(cache_dir) / "triton")}
    code = "import json, sys; from fxfuse.bench.compile_time import measure; print(json.dumps(measure(json.loads(sys.argv[1]))))"
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], env=env, capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(spec: dict) -> dict:
    """Compile one model step once with one backend in this process (see the module docstring)."""
    import torch
    from torch._dynamo.utils import counters

    from fxfuse.backend import FxfuseBackend
    from fxfuse.inspect.site_report import fake_process_group
    from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
    from fxfuse.models.parallel import ParallelContext
    from fxfuse.models.presets import get_preset

    if spec["compile_threads"] is not None:
        torch._inductor.config.compile_threads = spec["compile_threads"]
    from torch._inductor.compile_fx import compile_fx

    fxfuse = FxfuseBackend() if spec["backend"] == "fxfuse" else None
    backend = fxfuse if fxfuse is not None else compile_fx
    backend_seconds = 0.0

    def compile_only(gm, example_inputs):
        nonlocal backend_seconds
        start = time.perf_counter()
        backend(gm, example_inputs)
        backend_seconds += time.perf_counter() - start

        def refuse(*args):
            raise CompiledOnly

        return refuse

    from fxfuse.models.quant.scheme import QuantScheme

    config = get_preset(spec["model"], layers=spec["layers"])
    quant = QuantScheme("fp8", fp8_gemm="w8a8") if spec.get("weights") == "fp8" else None
    with fake_process_group(MODEL_TP[spec["model"]]) as group, torch.no_grad():
        model = DeepseekV3ForCausalLM(config, ParallelContext.from_group(group), dtype=torch.bfloat16, max_seq_len=TOKENS,
                                      quant=quant)
        inputs = torch.zeros(1, TOKENS, dtype=torch.long), torch.arange(TOKENS).unsqueeze(0)
        start = time.perf_counter()
        try:
            torch.compile(model, backend=compile_only, fullgraph=True, dynamic=True)(*inputs)
        except CompiledOnly:
            pass
        seconds = time.perf_counter() - start
    result = {"seconds": seconds, "backend_seconds": backend_seconds, "dynamo_seconds": seconds - backend_seconds,
              "caches": {cache: {name.rsplit("_", 1)[-1]: counters[group_name][name] for name in names}
                         for cache, (group_name, names) in CACHE_COUNTERS.items()}}
    if fxfuse is not None:
        result["records"] = [{"allreduce_sites": r.stats.allreduces_before, "fused_sites": r.stats.fused,
                              "fp8_folded": r.stats.fp8_quantizations_folded, "from_cache": r.from_cache,
                              **({} if r.timing is None else {
                                  "pass_s": round(r.timing.seconds, 3), "fp8_search_s": round(r.timing.fp8_search_seconds, 3),
                                  "fp8_searches": r.timing.fp8_searches,
                                  "fp8_quantizations": r.timing.fp8_searches + r.timing.fp8_search_hits})}
                             for r in fxfuse.records]
    return result


def summarize(model: str, backend: str, runs: list[dict]) -> dict:
    """One row: median cold and warm seconds (total, dynamo, backend), the warm caches, every sample."""
    def median(phase: str, key: str) -> float:
        return round(statistics.median(run[phase][key] for run in runs), 2)

    row = {"model": model, "tp": MODEL_TP[model], "backend": backend,
           "cold_s": median("cold", "seconds"), "warm_s": median("warm", "seconds"),
           "cold_backend_s": median("cold", "backend_seconds"), "warm_backend_s": median("warm", "backend_seconds"),
           "warm_dynamo_s": median("warm", "dynamo_seconds"),
           "warm_caches": [run["warm"]["caches"] for run in runs],
           "samples": runs}
    if backend == "fxfuse":
        row["records"] = {phase: [run[phase]["records"] for run in runs] for phase in ("cold", "warm")}
    return row


def warm_ratios(rows: list[dict]) -> dict[str, float]:
    """Per model measured with both backends: warm fxfuse seconds / warm Inductor seconds (medians)."""
    warm = {(row["model"], row["backend"]): row["warm_s"] for row in rows}
    return {model: round(warm[model, "fxfuse"] / warm[model, "inductor"], 3)
            for model, backend in warm if backend == "fxfuse" and (model, "inductor") in warm}


def cache_problems(report: dict) -> list[str]:
    """What went wrong with the caches: a warm fxfuse compile that missed (or bypassed) the FX graph cache
    or the AOTAutograd cache, or whose records differ from the cold compile's (fused sites, hit flags)."""
    problems = []
    for row in report["rows"]:
        if row["backend"] != "fxfuse":
            continue
        for index, run in enumerate(row["samples"]):
            caches = run["warm"]["caches"]
            if caches["fx_graph"]["hit"] < 1 or caches["aot_autograd"]["hit"] < 1:
                problems.append(f"{row['model']} repeat {index}: the warm fxfuse compile missed a cache: {caches}")
            cold = [(r["allreduce_sites"], r["fused_sites"]) for r in run["cold"]["records"]]
            warm = [(r["allreduce_sites"], r["fused_sites"]) for r in run["warm"]["records"]]
            if warm != cold or not all(r["from_cache"] for r in run["warm"]["records"]):
                problems.append(f"{row['model']} repeat {index}: warm records {run['warm']['records']} "
                                f"differ from cold {run['cold']['records']}")
    return problems


def machine() -> str:
    """This machine in words: CPU model, cores, memory."""
    model = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown CPU")
    memory_kb = next((int(line.split()[1]) for line in _read_lines("/proc/meminfo") if line.startswith("MemTotal:")), 0)
    return f"{model}, {os.cpu_count()} cores, {memory_kb / 2**20:.0f} GiB memory, no GPU used"


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def markdown(report: dict) -> str:
    """The report as markdown: header, one table row per model and backend, the warm ratios."""
    from fxfuse.bench.output import header_lines

    settings = report["settings"]
    lines = header_lines("Compile time: cold and warm Inductor caches, Inductor vs fxfuse", report) + [
        f"- machine: {report['machine']}; load average {report['load_average_before'][0]:.1f} before, "
        f"{report['load_average_after'][0]:.1f} after",
        f"- {settings['layers']} layers, a {settings['tokens']}-token step, {settings['dtype']}, dynamic shapes, "
        f"fake process group, compile_threads: {settings['compile_threads']}; median of {settings['repeats']} "
        "cold + warm pairs, each on a fresh cache",
        "",
        "| model | tp | backend | cold s | cold: backend s | cold: fxfuse passes s (FP8 searches s, run / quantizations) | warm s | warm: dynamo s | warm: backend s | warm cache hits (FX graph, AOT) | fused sites cold / warm |",
        "|---|---:|---|---:|---:|---|---:|---:|---:|---|---|",
    ]
    for row in report["rows"]:
        hits = ", ".join(f"{c['fx_graph']['hit']}/{c['aot_autograd']['hit']}" for c in row["warm_caches"])
        fused = "-"
        if "records" in row:
            fused = " / ".join(",".join(str(r["fused_sites"]) for r in row["records"][phase][0]) for phase in ("cold", "warm"))
        lines.append(f"| {row['model']} | {row['tp']} | {row['backend']} | {row['cold_s']:.1f} | {row['cold_backend_s']:.1f} | "
                     f"{_pass_times(row)} | {row['warm_s']:.1f} | {row['warm_dynamo_s']:.1f} | {row['warm_backend_s']:.2f} | "
                     f"{hits} | {fused} |")
    if report["warm_fxfuse_vs_inductor"]:
        lines += ["", "Warm fxfuse / warm Inductor: " + ", ".join(
            f"{model} {ratio:.2f}x" for model, ratio in report["warm_fxfuse_vs_inductor"].items())]
    return "\n".join(lines) + "\n"


def _pass_times(row: dict) -> str:
    """The cold compiles' fxfuse pass time and its FP8 searches (medians over repeats), or "-" for Inductor."""
    if "records" not in row:
        return "-"
    runs = [records for records in row["records"]["cold"] if records and "pass_s" in records[0]]
    if not runs:
        return "-"
    def median(key):
        return statistics.median(sum(r[key] for r in records) for records in runs)

    return (f"{median('pass_s'):.2f} ({median('fp8_search_s'):.2f}, {median('fp8_searches'):.0f} / "
            f"{median('fp8_quantizations'):.0f})")


if __name__ == "__main__":
    sys.exit(main())
