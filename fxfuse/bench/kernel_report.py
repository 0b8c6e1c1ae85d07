"""Turn `fxfuse bench kernel` measurements into files: JSON, a markdown table, a PNG plot, and a
thresholds table derived from the medians. CPU-only; no measurement happens here.

A measurement row is a dict: hidden, tokens, variant, status ("ok", "n/a", "failed"),
median_us (None unless timed), rel_err_normed, rel_err_residual, note.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

from fxfuse.bench.output import header_lines, write_result_files
from fxfuse.op.decide.modes import FusionMode
from fxfuse.op.decide.thresholds import ThresholdEntry, ThresholdTable, TokenRange

#: Benchmark variants in table order, with the column titles used in reports.
VARIANTS = {
    "fused-oneshot": "fused one-shot",
    "fused-twoshot": "fused two-shot",
    "pcie": "PCIe all-reduce + fused norm",
    "pcie-one-kernel": "one-kernel PCIe all-reduce + norm",
    "fallback": "fxfuse fallback (NCCL + fused norm)",
    "nccl+inductor": "unfused: NCCL + Inductor add-RMSNorm",
}
#: Variants that run an implementation of the fused op, and which one.
FUSED_MODES = {"fused-oneshot": FusionMode.ONESHOT, "fused-twoshot": FusionMode.TWOSHOT, "pcie": FusionMode.PCIE,
               "pcie-one-kernel": FusionMode.PCIE_ONE_KERNEL, "fallback": FusionMode.FALLBACK}


def file_stem(gpu: str, world_size: int, stamp: str) -> str:
    """Results file name without suffix, e.g. kernel_nvidia-h200_tp2_20261129-081500."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return f"kernel_{slug}_tp{world_size}_{stamp}"


def _cell(row: dict[str, Any] | None, meaningful: bool) -> str:
    if row is None or row["status"] == "n/a":
        return "n/a"
    if row["status"] == "failed":
        return "FAILED"
    if row["median_us"] is None:
        return f"checked (err {row['rel_err_normed']:.1e})"
    mark = "" if meaningful else "*"
    return f"{row['median_us']:.2f}{mark}"


def markdown(report: dict[str, Any]) -> str:
    """A markdown summary: header facts, then one table of medians (µs per call) per hidden size, with a column
    per variant the run measured."""
    meaningful = report["timings_meaningful"]
    lines = header_lines(f"fxfuse bench kernel: {report['gpu']}, {report['world_size']} ranks, {report['dtype']}", report) + [
        f"- timing: CUDA-graph replay of {report['graph_iters']} calls, median of {report['repeats']} replays, "
        "slowest rank, microseconds per call",
        f"- correctness: max relative error vs an fp32 reference over all checks: {report['max_rel_err']:.2e} "
        f"(tolerance {report['tolerance']:.0e})",
    ]
    if not meaningful:
        lines.append(f"- **timings not meaningful**: {report['timing_note']} (values marked *)")
    by_key = {(r["hidden"], r["tokens"], r["variant"]): r for r in report["results"]}
    shown = [v for v in VARIANTS if any(r["variant"] == v for r in report["results"])]  # the variants this run had
    for hidden in report["hidden_sizes"]:
        lines += ["", f"## hidden {hidden}", "", "| tokens | " + " | ".join(VARIANTS[v] for v in shown) + " |",
                  "|---:|" + "---:|" * len(shown)]
        for tokens in report["tokens"]:
            cells = [_cell(by_key.get((hidden, tokens, v)), meaningful) for v in shown]
            lines.append(f"| {tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def derive_thresholds(report: dict[str, Any]) -> ThresholdTable:
    """Per hidden size, the fastest of one-shot / two-shot / PCIe / unfused (fallback or Inductor's) at
    each measured token count, merged into ranges (a count between two measured ones takes the larger one's mode;
    beyond the largest measured count: fallback). Raises ValueError if timings are not meaningful."""
    if not report["timings_meaningful"]:
        raise ValueError(f"refusing to derive thresholds from timings that are not meaningful: {report['timing_note']}")
    entries = {}
    for hidden in report["hidden_sizes"]:
        ranges: list[TokenRange] = []
        for tokens in report["tokens"]:
            best = _fastest_mode(r for r in report["results"] if r["hidden"] == hidden and r["tokens"] == tokens)
            if best is None:
                continue
            if ranges and ranges[-1].mode is best:
                ranges[-1] = TokenRange(tokens, best)
            else:
                ranges.append(TokenRange(tokens, best))
        if ranges:
            source = f"fxfuse bench kernel {report['date']}"
            entry = ThresholdEntry(report["gpu"], report["world_size"], hidden, report["dtype"], tuple(ranges), source,
                                   topology=report.get("topology", "any"))
            entries[entry.key()] = entry
    return ThresholdTable(entries)


def _fastest_mode(rows: Iterable[dict[str, Any]]) -> FusionMode | None:
    timed = [(r["median_us"], FUSED_MODES.get(r["variant"], FusionMode.FALLBACK))
             for r in rows if r["status"] == "ok" and r["median_us"] is not None]
    return min(timed, key=lambda t: t[0])[1] if timed else None


def plot(report: dict[str, Any], path: Path) -> bool:
    """Write a log-log plot of median µs vs tokens per hidden size; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    hiddens = report["hidden_sizes"]
    fig, axes = plt.subplots(1, len(hiddens), figsize=(6 * len(hiddens), 4.5), squeeze=False)
    for ax, hidden in zip(axes[0], hiddens):
        for variant, title in VARIANTS.items():
            points = [(r["tokens"], r["median_us"]) for r in report["results"]
                      if r["hidden"] == hidden and r["variant"] == variant and r["median_us"] is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=title)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("µs per call (median)")
        ax.set_title(f"hidden {hidden}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    label = "" if report["timings_meaningful"] else " — TIMINGS NOT MEANINGFUL (ranks share a GPU)"
    fig.suptitle(f"{report['gpu']}, {report['world_size']} ranks, {report['dtype']}{label}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write <stem>.json, <stem>.md and (with matplotlib) <stem>.png into out_dir; return their paths."""
    stem = out_dir / file_stem(report["gpu"], report["world_size"], report["stamp"])
    return write_result_files(stem, report, markdown(report), lambda path: plot(report, path))
