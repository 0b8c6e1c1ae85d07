"""Turn `fxfuse bench model` measurements into files: JSON, a markdown table and a PNG plot.

CPU-only; no measurement happens here. A report dict holds `results` rows (batch, tokens,
backend, dynamic (the compiled backends' shape mode: False static, True dynamic; None for eager),
status "ok" / "failed" / "skipped", step_ms, step_ms_p90, rel_err_vs_eager, eager_sensitivity, note)
and `collectives` rows (batch, tokens, allreduces, allreduce_ms). `summary_rows` derives, per shape
mode and (batch, tokens), the fxfuse/inductor ratio and the share of the unfused (Inductor) step
spent in the all-reduces alone; `static_over_dynamic` compares a backend's two modes.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from fxfuse.bench.output import header_lines, mode_name, write_result_files

BACKEND_ORDER = ("eager", "inductor", "fxfuse")
#: What each shape mode of the compiled backends means, for the report.
SHAPES = {
    False: "static (dynamic=False: one graph per batch x width, as engines that capture one graph per width compile)",
    True: "dynamic (dynamic=True: one graph for every batch and width, sizes of 1 specialized)",
}


def file_stem(report: dict[str, Any]) -> str:
    """Results file name without suffix, e.g. model_nvidia-h200_tp1_deepseek-v3-4l_20261129-091500."""
    slug = re.sub(r"[^a-z0-9]+", "-", report["gpu"].lower()).strip("-")
    config = report["config"]
    return f"model_{slug}_tp{report['world_size']}_{config['preset']}-{config['layers']}l_{report['stamp']}"


def report_modes(report: dict[str, Any]) -> list[bool | None]:
    """The shape modes the compiled backends ran in (False: static, True: dynamic), static first; [None]
    for reports that do not record them (eager only, or written before `--dynamic` existed)."""
    modes = {r.get("dynamic") for r in report["results"] if r["backend"] != "eager"} - {None}
    return sorted(modes) or [None]


def summary_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per shape mode and (batch, tokens): each backend's median ms, fxfuse/inductor, all-reduce ms and share.

    Eager (never compiled) appears in every mode's rows. The share is the all-reduces' time over the
    Inductor step's (eager's if Inductor was not run); None where a number is missing (tp=1 has no
    all-reduce).
    """
    medians = {(r["batch"], r["tokens"], r["backend"], r.get("dynamic")): r["step_ms"] for r in report["results"]}
    collectives = {(c["batch"], c["tokens"]): c["allreduce_ms"] for c in report["collectives"]}
    points = sorted({(r["batch"], r["tokens"]) for r in report["results"]})
    rows = []
    for dynamic in report_modes(report):
        for batch, tokens in points:
            ms = {b: medians.get((batch, tokens, b, None if b == "eager" else dynamic)) for b in BACKEND_ORDER}
            unfused = ms["inductor"] if ms["inductor"] is not None else ms["eager"]
            allreduce_ms = collectives.get((batch, tokens))
            rows.append({
                "dynamic": dynamic,
                "batch": batch,
                "tokens": tokens,
                **{f"{b}_ms": ms[b] for b in BACKEND_ORDER},
                "fxfuse_over_inductor": _ratio(ms["fxfuse"], ms["inductor"]),
                "allreduce_ms": allreduce_ms,
                "allreduce_share": _ratio(allreduce_ms, unfused),
            })
    return rows


def static_over_dynamic(rows: list[dict[str, Any]], backend: str) -> dict[str, float] | None:
    """Geometric mean, min and max of `backend`'s static-shape step time over its dynamic-shape one at
    the points measured both ways; None unless the rows hold both modes."""
    static = {(r["batch"], r["tokens"]): r[f"{backend}_ms"] for r in rows if r["dynamic"] is False}
    ratios = [static[(r["batch"], r["tokens"])] / r[f"{backend}_ms"] for r in rows
              if r["dynamic"] is True and r[f"{backend}_ms"] and static.get((r["batch"], r["tokens"]))]
    return _spread(ratios)


def ratio_summary(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Geometric mean, min and max of fxfuse/inductor over the points that have both; None if none."""
    return _spread([r["fxfuse_over_inductor"] for r in rows if r["fxfuse_over_inductor"] is not None])


def _spread(ratios: list[float]) -> dict[str, float] | None:
    if not ratios:
        return None
    return {
        "geomean": math.exp(sum(math.log(x) for x in ratios) / len(ratios)),
        "min": min(ratios),
        "max": max(ratios),
        "points": len(ratios),
    }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _bound_text(report: dict[str, Any]) -> str:
    """The check's bound in words: the tolerance, or a multiple of the eager step's own sensitivity."""
    sensitivities = [r["eager_sensitivity"] for r in report["results"] if r.get("eager_sensitivity") is not None]
    if not sensitivities or "sensitivity_factor" not in report:
        return f"tolerance {report['tolerance']:g}"
    return (f"bound per point: max({report['tolerance']:g}, {report['sensitivity_factor']:g} x the eager step's "
            f"sensitivity, its logits' distance when the first layer's input is perturbed by half a bf16 rounding "
            f"step: {min(sensitivities):.2e} to {max(sensitivities):.2e})")


def markdown(report: dict[str, Any]) -> str:
    """A markdown summary: header facts, then one row per (batch, tokens per sequence), a table per shape mode."""
    config = report["config"]
    rows = summary_rows(report)
    checked = [r["rel_err_vs_eager"] for r in report["results"] if r["rel_err_vs_eager"] is not None]
    weights = config.get("weights", "bf16")
    if weights == "fp8":
        weights += f" {config.get('fp8_gemm', 'w8a16')}"
    title = (f"fxfuse bench model: {report['gpu']}, tp={report['world_size']}, {config['preset']} "
             f"({config['layers']} layers), {config['dtype']}" + ("" if weights == "bf16" else f", {weights} weights"))
    lines = header_lines(title, report) + [
        f"- timing: {report['timing']}; milliseconds per verify step (one forward of batch x tokens, "
        f"attending over a {config['context']}-position KV cache)",
        f"- all-reduce sites per step: {_or_dash(report['allreduce_sites'])}, fused by fxfuse: "
        f"{_or_dash(report['fused_sites'])}, FlashInfer kernel ready: {_or_dash(report['fused_kernel_ready'])}",
    ]
    if checked:
        lines.append(f"- check: logits vs eager on the same inputs, worst relative L2 error {max(checked):.2e} "
                     f"({_bound_text(report)})")
    modes = report_modes(report)
    if modes != [None]:
        lines.append("- shapes: " + "; ".join(SHAPES[dynamic] for dynamic in modes)
                     + ("; one table per mode" if len(modes) > 1 else ""))
    if len(modes) == 1:
        lines += _ratio_lines(rows, "fxfuse / inductor")
    if report["world_size"] == 1 and report.get("single_rank_collectives"):
        lines.append("- tp=1 with one-rank all-reduces issued at every site and fused by fxfuse, whose op runs its NCCL "
                     "fallback there: fxfuse/inductor is what the fallback costs in the whole step")
    elif report["world_size"] == 1:
        lines.append("- tp=1: the step has no all-reduce, so there is nothing to fuse; fxfuse/inductor shows what the pass costs")
    skipped = [r for r in report["results"] if r["status"] == "skipped"]
    if skipped:
        lines.append(f"- {len(skipped)} point(s) skipped: {skipped[0]['note']}")
    if len(modes) > 1:
        for backend in ("inductor", "fxfuse"):
            spread = static_over_dynamic(rows, backend)
            if spread is not None:
                lines.append(f"- {backend}, static-shape step / dynamic-shape step: geometric mean {spread['geomean']:.3f} "
                             f"over {spread['points']} points (min {spread['min']:.3f}, max {spread['max']:.3f})")
    for dynamic in modes:
        mode_rows = [r for r in rows if r["dynamic"] is dynamic]
        if len(modes) > 1:
            lines += ["", f"### {mode_name(dynamic)} shapes", ""] + _ratio_lines(mode_rows, "fxfuse / inductor")
        lines += [
            "",
            "| batch | tokens/seq | eager ms | inductor ms | fxfuse ms | fxfuse/inductor | all-reduce ms | all-reduce share |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in mode_rows:
            ratio = "-" if r["fxfuse_over_inductor"] is None else f"{r['fxfuse_over_inductor']:.3f}"
            share = "-" if r["allreduce_share"] is None else f"{100 * r['allreduce_share']:.1f}%"
            lines.append(f"| {r['batch']} | {r['tokens']} | {_ms(r['eager_ms'])} | {_ms(r['inductor_ms'])} | "
                         f"{_ms(r['fxfuse_ms'])} | {ratio} | {_ms(r['allreduce_ms'])} | {share} |")
    failed = [r for r in report["results"] if r["status"] == "failed"]
    if failed:
        lines += ["", "FAILED checks: " + ", ".join(
            f"{r['backend']}{' ' + mode_name(r.get('dynamic')) if len(modes) > 1 else ''} batch {r['batch']} x "
            f"{r['tokens']} (err {r['rel_err_vs_eager']:.2e})" for r in failed)]
    return "\n".join(lines) + "\n"


def _ratio_lines(rows: list[dict[str, Any]], what: str) -> list[str]:
    summary = ratio_summary(rows)
    if summary is None:
        return []
    return [f"- {what}: geometric mean {summary['geomean']:.3f} over {summary['points']} points "
            f"(min {summary['min']:.3f}, max {summary['max']:.3f})"]


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def plot(report: dict[str, Any], path: Path) -> bool:
    """Write step ms vs tokens per backend (one panel per batch) and fxfuse/inductor; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    rows, modes = summary_rows(report), report_modes(report)
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches) + 1, figsize=(5 * (len(batches) + 1), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for dynamic in modes:
            for backend in BACKEND_ORDER:
                if backend == "eager" and dynamic != modes[0]:
                    continue  # eager is not compiled: drawn once
                points = [(r["tokens"], r[f"{backend}_ms"]) for r in rows
                          if r["batch"] == batch and r["dynamic"] is dynamic and r[f"{backend}_ms"] is not None]
                if points:
                    ax.plot(*zip(*points), marker="o", label=_series(backend, dynamic, modes, backend == "eager"))
        _token_axis(ax, rows)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_ylabel("ms per step (median)")
        ax.set_title(f"batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ratio_ax = axes[0][-1]
    for dynamic in modes:
        for batch in batches:
            points = [(r["tokens"], r["fxfuse_over_inductor"]) for r in rows
                      if r["batch"] == batch and r["dynamic"] is dynamic and r["fxfuse_over_inductor"] is not None]
            if points:
                ratio_ax.plot(*zip(*points), marker="o", label=_series(f"batch {batch}", dynamic, modes, False))
    ratio_ax.axhline(1.0, color="gray", linewidth=1)
    _token_axis(ratio_ax, rows)
    ratio_ax.set_title("fxfuse / inductor")
    ratio_ax.grid(True, which="both", alpha=0.3)
    ratio_ax.legend(fontsize=8)
    config = report["config"]
    fig.suptitle(f"{report['gpu']}, tp={report['world_size']}, {config['preset']} x {config['layers']} layers, {config['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _series(name: str, dynamic: bool | None, modes: list[bool | None], uncompiled: bool) -> str:
    """A plot label: the name, with its shape mode where the report has several (not for eager)."""
    return name if len(modes) == 1 or uncompiled else f"{name}, {mode_name(dynamic)}"


def _token_axis(ax, rows: list[dict[str, Any]]) -> None:
    """A log2 x axis labelled with the measured tokens-per-sequence values."""
    tokens = sorted({r["tokens"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.set_xlabel("tokens per sequence")


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write <stem>.json (with the summary rows and `fxfuse_over_inductor`, the ratios' spread, per shape
    mode when the run measured both), <stem>.md and, with matplotlib, <stem>.png; return their paths."""
    rows, modes = summary_rows(report), report_modes(report)
    ratios = ratio_summary(rows) if len(modes) == 1 else {
        mode_name(dynamic): ratio_summary([r for r in rows if r["dynamic"] is dynamic]) for dynamic in modes}
    document = {**report, "summary": rows, "fxfuse_over_inductor": ratios}
    return write_result_files(out_dir / file_stem(report), document, markdown(report), lambda path: plot(report, path))
