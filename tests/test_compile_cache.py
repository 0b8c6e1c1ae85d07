"""fxfuse and Inductor's caches: a second process compiling the same graph is served by the FX graph
cache and the AOTAutograd cache, and the backend's records, `fusion_summary`, `counters["fxfuse"]` and
dumps still say what the compiled graph contains (`fxfuse.rewrite.records`); and `fxfuse bench compile`.

Slow: the toy decoder (fake process group, one process each) compiled by `FxfuseBackend()` on one fresh
Inductor cache: cold (the passes run), warm (both caches hit; the same records, from the cache), warm
after the snapshot files were deleted (the stats survive), and with another pattern set (another uuid:
a miss), cold and warm. One cold + warm pair of the compile benchmark's own measurement.
Fast: marks and snapshot files, turning replayed marks into records, the benchmark's report and checks.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from toy_graphs import RMSNORMS, decoder_inputs, fake_process_group, post_grad_graph, toy_decoder

import fxfuse.bench.compile_time as compile_time
import fxfuse.post_grad
from fxfuse.backend import FxfuseBackend
from fxfuse.passes.config import ALLREDUCE_RESIDUAL_RMSNORM, ALLREDUCE_RMSNORM, PATTERNS
from fxfuse.post_grad import FusionPostGradPass
from fxfuse.rewrite.graph_diff import GraphSnapshot
from fxfuse.rewrite.records import CompileRecord, FusionStats, mark_compiled, mark_name, record_from_mark, snapshots_dir

TESTS = Path(__file__).resolve().parent
STATS = FusionStats(allreduces_before=4, merged=0, fused_with_residual=3, fused_without_residual=1, allreduces_after=0)

_COMPILE = """
import functools, json, sys
from dataclasses import asdict
import torch
from torch._dynamo.utils import counters
sys.path.insert(0, sys.argv[3])
from toy_graphs import RMSNORMS, decoder_inputs, fake_process_group, toy_decoder
from fxfuse.backend import FxfuseBackend, fusion_summary

backend = FxfuseBackend(patterns=json.loads(sys.argv[1]), dump_dir=sys.argv[2])
with fake_process_group() as group, torch.no_grad():
    decoder = functools.partial(toy_decoder, group=group, norm=RMSNORMS["transformers"])
    out = torch.compile(decoder, backend=backend, fullgraph=True)(*decoder_inputs(torch.float32))
records = [{"stats": asdict(r.stats), "from_cache": r.from_cache, "diff": r.diff(),
            "before": r.before and list(r.before.lines), "after": r.after and list(r.after.lines)} for r in backend.records]
caches = {name: counters[group][name] for group, names in (("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss")),
          ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss"))) for name in names}
print(json.dumps({"records": records, "summary": fusion_summary(backend), "fxfuse": dict(counters["fxfuse"]),
                  "caches": caches, "out": out.tolist()}))
"""


def compile_in_process(cache: Path, dump_dir: Path, patterns=PATTERNS) -> dict:
    """Compile the toy decoder with `FxfuseBackend` in a fresh process on the Inductor cache `cache`."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(list(patterns)), str(dump_dir), str(TESTS)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "stderr": done.stderr}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """On one cache: cold; then two chains side by side (each compile is a process of its own, so both
    cores work): warm, then warm again without the cold compile's snapshot files; and another pattern set
    cold, then warm. The first chain deletes only the files the cold compile wrote (a hit writes none),
    never the other chain's."""
    root = tmp_path_factory.mktemp("cache")
    cache = root / "inductor"
    results = {"cold": compile_in_process(cache, root / "dump_cold")}
    cold_snapshots = list((cache / "fxfuse").glob("*.json"))

    def same_patterns() -> dict:
        warm = compile_in_process(cache, root / "dump_warm")
        for path in cold_snapshots:
            path.unlink()
        return {"warm": warm, "no_snapshots": compile_in_process(cache, root / "dump_no_snapshots")}

    def other_patterns() -> dict:
        patterns = (ALLREDUCE_RESIDUAL_RMSNORM,)
        return {"other_patterns": compile_in_process(cache, root / "dump_other", patterns=patterns),
                "other_patterns_warm": compile_in_process(cache, root / "dump_other_warm", patterns=patterns)}

    with ThreadPoolExecutor(2) as pool:
        for chain in [pool.submit(same_patterns), pool.submit(other_patterns)]:
            results.update(chain.result())
    results["dumps"] = {name: sorted(p.name for p in (root / f"dump_{name}").iterdir()) for name in ("cold", "warm", "no_snapshots")}
    return results


@pytest.mark.slow
def test_cold_compile_misses_and_runs_the_passes(runs):
    cold = runs["cold"]
    assert cold["caches"] == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 1, "autograd_cache_hit": 0, "autograd_cache_miss": 1}
    (record,) = cold["records"]
    assert record["from_cache"] is False and FusionStats(**record["stats"]) == STATS


@pytest.mark.slow
def test_warm_compile_hits_both_caches_and_records_the_same(runs):
    cold, warm = runs["cold"], runs["warm"]
    assert warm["caches"] == {"fxgraph_cache_hit": 1, "fxgraph_cache_miss": 0, "autograd_cache_hit": 1, "autograd_cache_miss": 0}
    (cold_record,), (warm_record,) = cold["records"], warm["records"]
    assert warm_record["from_cache"] is True
    assert {k: v for k, v in warm_record.items() if k != "from_cache"} == {k: v for k, v in cold_record.items() if k != "from_cache"}
    assert warm["summary"] == cold["summary"] == {"allreduce_sites": 4, "fused_sites": 4, "fast_all_reduces": 0, "merged": 0,
                                                 "graphs_compiled": 1}
    assert warm["fxfuse"] == cold["fxfuse"] == {"allreduces_before": 4, "merged": 0, "fused_with_residual": 3,
                                                "fused_without_residual": 1, "allreduces_after": 0,
                                                "fp8_quantizations_folded": 0, "fast_all_reduces": 0}
    assert warm["out"] == cold["out"]
    assert runs["dumps"]["warm"] == runs["dumps"]["cold"] == [
        "graph_000_rank0.after.txt", "graph_000_rank0.before.txt", "graph_000_rank0.diff.txt"]


@pytest.mark.slow
def test_a_hit_without_snapshot_files_keeps_the_stats(runs):
    hit = runs["no_snapshots"]
    assert hit["caches"]["fxgraph_cache_hit"] == 1
    (record,) = hit["records"]
    assert (record["from_cache"], record["before"], record["after"]) == (True, None, None)
    assert FusionStats(**record["stats"]) == STATS and record["diff"].startswith("no snapshots:")
    assert hit["summary"] == runs["cold"]["summary"] and hit["fxfuse"] == runs["cold"]["fxfuse"]
    assert runs["dumps"]["no_snapshots"] == ["graph_000_rank0.diff.txt"]


@pytest.mark.slow
def test_another_pattern_set_is_another_cache_entry(runs):
    other = runs["other_patterns"]
    assert other["caches"]["fxgraph_cache_miss"] == 1 and other["caches"]["fxgraph_cache_hit"] == 0
    (record,) = other["records"]
    assert (record["from_cache"], record["stats"]["fused_with_residual"], record["stats"]["fused_without_residual"]) == (False, 3, 0)


@pytest.mark.slow
def test_a_graph_with_an_unfused_site_warns_once_cold_and_warm(runs):
    """Its warning (`fxfuse.rewrite.log`) comes with the mark, so a cache hit, where no pass runs, says
    it too; fully fused graphs say nothing."""
    assert runs["other_patterns_warm"]["caches"]["fxgraph_cache_hit"] == 1
    for name in ("cold", "warm", "no_snapshots"):
        assert "fxfuse fused" not in runs[name]["stderr"]
    for name, loaded in (("other_patterns", ""), ("other_patterns_warm", " (loaded from Inductor's cache)")):
        (warning,) = [line for line in runs[name]["stderr"].splitlines() if line.startswith("fxfuse fused")]
        assert warning == (f"fxfuse fused 3 of 4 all-reduce sites of graph 0/0{loaded}. Most common reason (1 of the 1 "
                           f"unfused): pattern {ALLREDUCE_RMSNORM} is disabled. TORCH_LOGS=fxfuse lists every site.")


# ---------------------------------------------------------------- marks and snapshot files


@pytest.fixture
def inductor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    counters.clear()
    return tmp_path / "inductor"


def small_record() -> CompileRecord:
    before = GraphSnapshot(lines=("arg_0 = input", "all_reduce_0 = _c10d_functional.all_reduce(arg_0)"),
                           op_counts=Counter({"_c10d_functional.all_reduce": 1}))
    after = GraphSnapshot(lines=("arg_0 = input", "fused_0 = fxfuse.allreduce_residual_rmsnorm(arg_0)"),
                          op_counts=Counter({"fxfuse.allreduce_residual_rmsnorm": 1}))
    return CompileRecord(before, after, FusionStats(1, 0, 0, 1, 0))


def test_a_mark_round_trips_through_its_counter_and_file(inductor_cache):
    record = small_record()
    name = mark_compiled(record, on_cuda=False)
    assert counters["inductor"][name] == 1 and name.startswith("fxfuse:")
    (kept,) = (inductor_cache / "fxfuse").iterdir()
    assert mark_compiled(record, on_cuda=False) == name and list((inductor_cache / "fxfuse").iterdir()) == [kept]
    loaded, on_cuda = record_from_mark(name)
    assert (loaded.stats, loaded.before.lines, loaded.after.op_counts, loaded.from_cache, on_cuda) == (
        record.stats, record.before.lines, record.after.op_counts, True, False)
    assert loaded.diff() == record.diff()
    kept.unlink()
    missing, _ = record_from_mark(name)
    assert (missing.stats, missing.before, missing.after) == (record.stats, None, None)


def test_snapshots_live_beside_inductors_cache():
    assert snapshots_dir().name == "fxfuse"


def test_cache_hits_become_records_once(inductor_cache, monkeypatch):
    """Marks Inductor adds back while the pass is the configured one become records (with `counters` cleared
    first, as users do, too); marks the pass makes itself do not count twice; marks added while another pass is
    configured are not this pass's; a replayed CUDA graph with fused sites installs the C++ fallback."""
    installs = []
    monkeypatch.setattr(fxfuse.post_grad, "install_native_fallback", lambda: installs.append(True))
    backend = FxfuseBackend()
    fusion = FusionPostGradPass(backend)
    counters.clear()
    with fake_process_group() as group, torch._inductor.config.patch(post_grad_custom_post_pass=fusion):
        decoder = functools.partial(toy_decoder, group=group, norm=RMSNORMS["transformers"])
        fusion(post_grad_graph(decoder, *decoder_inputs(torch.float32)).graph)  # a miss: the pass runs and marks
        counters["inductor"] += Counter({mark_name(STATS, True, None): 1})  # a hit: as Inductor adds a graph's counters
        counters["inductor"][mark_name(FusionStats(1, 0, 0, 0, 1), True, None)] += 1  # a CUDA graph with nothing fused
    counters["inductor"][mark_name(STATS, True, None)] += 1  # another compile, without this pass: not recorded
    assert [(r.from_cache, r.stats.fused) for r in backend.records] == [(False, 4), (True, 4), (True, 0)]
    assert installs == [True]
    assert counters["fxfuse"]["fused_with_residual"] == 3 + 3


# ---------------------------------------------------------------- fxfuse bench compile


def test_bench_compile_answers_help_and_bad_arguments_without_torch():
    for argv, status in ((["--help"], 0), (["--models", "gpt2"], 2), (["--repeats", "0"], 2)):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "fxfuse", "bench", "compile", *argv],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == status, done.stderr[-2000:]
        modules = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
        assert "fxfuse.cli" in modules and "torch" not in modules
        if status:
            errors = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
            assert len(errors) == 1 and errors[0].startswith("fxfuse: error: ")


def fake_measurement(spec: dict, cache_dir: str, *, warm_misses: bool = False) -> dict:
    """What `run_measurement` returns, made up: warm when the cache directory already has an entry."""
    warm = (Path(cache_dir) / "done").exists()
    Path(cache_dir, "done").touch()
    hit = warm and not warm_misses
    result = {"seconds": 5.0 if warm else 60.0, "backend_seconds": 3.0 if warm else 55.0,
              "dynamo_seconds": 2.0 if warm else 5.0,
              "caches": {"fx_graph": {"hit": int(hit), "miss": int(not hit), "bypass": 0},
                         "aot_autograd": {"hit": int(hit), "miss": int(not hit), "bypass": 0}}}
    if spec["backend"] == "fxfuse":
        result["seconds"] += 1.0
        result["records"] = [{"allreduce_sites": 9, "fused_sites": 9, "fp8_folded": 0, "from_cache": hit,
                              **({} if hit else {"pass_s": 0.5, "fp8_search_s": 0.1, "fp8_searches": 1,
                                                 "fp8_quantizations": 9})}]
    return result


@pytest.mark.parametrize("warm_misses", [False, True], ids=["hits", "warm-miss"])
def test_bench_compile_report(tmp_path, monkeypatch, capsys, warm_misses):
    monkeypatch.setattr(compile_time, "run_measurement", lambda spec, cache: fake_measurement(spec, cache, warm_misses=warm_misses))
    status = compile_time.main(["--models", "tiny", "--repeats", "2", "--out-dir", str(tmp_path)])
    (json_path,) = tmp_path.glob("compile_*.json")
    report = json.loads(json_path.read_text())
    assert json_path.with_suffix(".md").exists()
    assert report["command"] == f"fxfuse bench compile --models tiny --repeats 2 --out-dir {tmp_path}"
    assert {"date", "machine", "versions", "settings", "rows"} <= set(report) and "torch" in report["versions"]
    rows = {row["backend"]: row for row in report["rows"]}
    assert (rows["inductor"]["cold_s"], rows["inductor"]["warm_s"], rows["fxfuse"]["warm_s"]) == (60.0, 5.0, 6.0)
    assert len(rows["fxfuse"]["samples"]) == 2 and report["warm_fxfuse_vs_inductor"] == {"tiny": 1.2}
    out, err = capsys.readouterr()
    assert "| tiny | 2 | fxfuse | 61.0 | 55.0 | 0.50 (0.10, 1 / 9) | 6.0 |" in out
    assert (status, "FAILED" in err) == ((1, True) if warm_misses else (0, False))


@pytest.mark.slow
def test_bench_measurement_cold_then_warm(tmp_path):
    spec = {"model": "tiny", "backend": "fxfuse", "layers": 1, "compile_threads": 1}
    cold, warm = (compile_time.run_measurement(spec, str(tmp_path)) for _ in range(2))
    assert cold["caches"]["fx_graph"]["miss"] == 1 and warm["caches"]["fx_graph"]["hit"] == 1
    assert warm["caches"]["aot_autograd"]["hit"] == 1
    sites = 3  # the embedding, the attention and the MLP of the one layer
    (cold_record,), (warm_record,) = cold["records"], warm["records"]
    assert {k: cold_record[k] for k in ("allreduce_sites", "fused_sites", "fp8_folded", "from_cache")} == {
        "allreduce_sites": sites, "fused_sites": sites, "fp8_folded": 0, "from_cache": False}
    assert cold_record["pass_s"] > 0 and (cold_record["fp8_searches"], cold_record["fp8_quantizations"]) == (0, 0)
    assert warm_record == {"allreduce_sites": sites, "fused_sites": sites, "fp8_folded": 0, "from_cache": True}
    assert warm["seconds"] < cold["seconds"] and warm["dynamo_seconds"] > 0
