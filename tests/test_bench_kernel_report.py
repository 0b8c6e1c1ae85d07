"""CPU tests of `fxfuse bench kernel`'s argument parsing and report writing (no GPU measurement)."""

from __future__ import annotations

import json

import pytest

from fxfuse.bench.kernel import parse_args
from fxfuse.bench.kernel_report import derive_thresholds, file_stem, markdown, write_report
from fxfuse.op.decide.modes import FusionMode
from fxfuse.op.decide.thresholds import read_table


def row(hidden, tokens, variant, us, status="ok", err=3e-3):
    return {"hidden": hidden, "tokens": tokens, "variant": variant, "status": status, "median_us": us,
            "rel_err_normed": err, "rel_err_residual": err, "note": ""}


def report(meaningful=True):
    # hidden 7168: one-shot wins at 1-2 tokens, two-shot at 4, PCIe at 8, unfused (the fallback) at 16.
    times = {1: (5.0, None, 9.0, 20.0, 18.0), 2: (6.0, None, 9.0, 20.0, 18.0), 4: (12.0, 9.0, 10.0, 21.0, 19.0),
             8: (30.0, 25.0, 11.0, 22.0, 21.0), 16: (40.0, 35.0, 30.0, 22.0, 23.0)}
    rows = []
    for tokens, (one, two, pcie, fallback, ind) in times.items():
        rows.append(row(7168, tokens, "fused-oneshot", one))
        rows.append(row(7168, tokens, "fused-twoshot", two, status="ok" if two else "n/a"))
        rows.append(row(7168, tokens, "pcie", pcie))
        rows.append(row(7168, tokens, "fallback", fallback))
        rows.append(row(7168, tokens, "nccl+inductor", ind))
    return {
        "gpu": "NVIDIA H200", "world_size": 2, "topology": "pcie", "dtype": "bfloat16", "date": "2026-11-29T08:00:00+00:00",
        "stamp": "20261129-080000", "command": "fxfuse bench kernel", "versions": {"torch": "2.11"},
        "graph_iters": 20, "repeats": 50, "max_rel_err": 3e-3, "tolerance": 2e-2,
        "timings_meaningful": meaningful, "timing_note": "" if meaningful else "2 ranks time-slice 1 GPU(s)",
        "tokens": [1, 2, 4, 8, 16], "hidden_sizes": [7168], "results": rows,
    }


def test_parse_args_defaults_and_validation():
    args = parse_args([])
    assert args.tokens == "1,2,4,8,16,32,64,128,256,512,1024,2048" and args.hidden == "7168,4096"
    with pytest.raises(SystemExit):
        parse_args(["--variants", "fused-oneshot,magic"])


def test_derive_thresholds_picks_fastest_and_merges_ranges():
    table = derive_thresholds(report())
    e = table.lookup("NVIDIA H200", 2, 7168, "bfloat16", "pcie")
    assert e.topology == "pcie" and table.lookup("NVIDIA H200", 2, 7168, "bfloat16", "nvswitch") is None
    assert [(r.max_tokens, r.mode) for r in e.ranges] == [
        (2, FusionMode.ONESHOT), (4, FusionMode.TWOSHOT), (8, FusionMode.PCIE), (16, FusionMode.FALLBACK)]
    assert e.mode_for(3) is FusionMode.TWOSHOT and e.mode_for(17) is FusionMode.FALLBACK


def test_no_thresholds_from_shared_gpu_timings():
    with pytest.raises(ValueError, match="not meaningful"):
        derive_thresholds(report(meaningful=False))


def test_markdown_labels_shared_gpu_timings():
    text = markdown(report(meaningful=False))
    assert "timings not meaningful" in text and "| 1 | 5.00* | n/a | 9.00* | 20.00* | 18.00* |" in text
    assert "| 4 | 12.00 | 9.00 | 10.00 | 21.00 | 19.00 |" in markdown(report())


def test_write_report_files(tmp_path):
    paths = write_report(report(), tmp_path)
    stem = file_stem("NVIDIA H200", 2, "20261129-080000")
    assert stem == "kernel_nvidia-h200_tp2_20261129-080000"
    assert paths[0].name == stem + ".json" and json.loads(paths[0].read_text())["gpu"] == "NVIDIA H200"
    assert paths[1].read_text().startswith("# fxfuse bench kernel: NVIDIA H200, 2 ranks, bfloat16")


def test_derived_table_round_trips_through_file(tmp_path):
    from fxfuse.op.decide.thresholds import write_table

    write_table(derive_thresholds(report()), tmp_path / "t.json")
    assert read_table(tmp_path / "t.json") == derive_thresholds(report())
