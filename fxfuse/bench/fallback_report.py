"""The files of `fxfuse bench fallback`: the report's markdown, its file name and what failed.

CPU-only; no measurement happens here. A report holds `rows` (one per measured point: tokens, hidden,
quant, dynamic, fused_us / inductor_us with p25 and p75, ratio, `check` per variant, `fusion`, `ok`,
or an `error`), `fusion` (per hidden, quantization and mode: each fxfuse graph's fused-op nodes),
`host_cost`, `op_parts` and `skipped` points (see `fxfuse.bench.fallback`). The markdown has an
overview of the ratios per quantization, hidden size and mode, then one table per (quantization, mode).
"""

from __future__ import annotations

import math
from typing import Any

from fxfuse.bench.arguments import FALLBACK_QUANT
from fxfuse.bench.fallback_blocks import BF16_OUTPUT_KINDS, BF16_TOLERANCE, SCALE_TOLERANCE
from fxfuse.bench.output import gpu_slug, header_lines, mode_name

QUANT_TITLES = {
    "none": "no quantization (the norm's bf16 output)",
    "group": "FP8 per token group of 128, dynamic scales",
    "row": "FP8 per row, dynamic scales (torchao's PerRow arithmetic)",
    "tensor": "FP8 per tensor, one static scale",
    "row_reciprocal": "FP8 per row, dynamic scales times their reciprocal (vLLM's per-token arithmetic)",
    "group_ue8m0": "FP8 per token group of 128, power-of-two (UE8M0) scales (vLLM's per-group arithmetic)",
    "clamp_scale": "a clamp then a scale of the norm's bf16 output",
    "second_rmsnorm": "a second RMSNorm of the norm's bf16 output",
}
#: Site tiers as `graph_fusion` records them, in words.
TIER_WORDS = {"a": "fused", "b": "all-reduce-only op (tier b)", "c": "left to Inductor (tier c)"}


def file_stem(report: dict[str, Any]) -> str:
    """fallback_<gpu>_<stamp>."""
    return f"fallback_{gpu_slug(report['gpu'])}_{report['stamp']}"


def _point(row: dict[str, Any]) -> str:
    return f"{row['quant']} {mode_name(row['dynamic'])} hidden {row['hidden']} tokens {row['tokens']}"


def failures(report: dict[str, Any]) -> list[str]:
    """One line per point that failed: an error, a check out of bounds, or the site not fused by fxfuse."""
    problems = []
    for row in report["rows"]:
        if "error" in row:
            problems.append(f"{_point(row)}: {row['error']}")
            continue
        for variant, check in row["check"].items():
            if not check["ok"]:
                problems.append(f"{_point(row)}: {variant} outside the bounds ({_measures(check)})")
        if row["fusion"]["tier"] == "c":
            problems.append(f"{_point(row)}: the fxfuse variant left the all-reduce site to Inductor ({row['fusion']})")
    return problems


def skipped_summary(points: list[dict[str, Any]]) -> str:
    """Skipped points by hidden size, quantization and mode, with their token counts: what to run again."""
    groups: dict[tuple, list[int]] = {}
    for p in points:
        groups.setdefault((p["hidden"], p["quant"], mode_name(p["dynamic"])), []).append(p["tokens"])
    return "; ".join(f"hidden {hidden} {quant} {mode} at {','.join(map(str, tokens))} tokens"
                     for (hidden, quant, mode), tokens in groups.items())


def _measures(check: dict[str, Any]) -> str:
    return ", ".join(f"{name} {value:.3g}" for name, value in check.items() if name != "ok")


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _timed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "ratio" in r]


def overview_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (quant, hidden): the range of fxfuse/Inductor under each mode, the points where fxfuse is slower
    (`slower`: its p25 above Inductor's p75) or faster (`faster`: its p75 below Inductor's p25) beyond the
    samples' spread, Inductor's own dynamic/static time (geometric mean over the token counts measured both
    ways), and the points that failed."""
    out = []
    for quant in FALLBACK_QUANT:
        for hidden in dict.fromkeys(r["hidden"] for r in report["rows"] if r["quant"] == quant):
            rows = [r for r in report["rows"] if r["quant"] == quant and r["hidden"] == hidden]
            entry: dict[str, Any] = {"quant": quant, "hidden": hidden, "failed": sum(not r["ok"] for r in rows),
                                     "slower": sum(r["fused_p25"] > r["inductor_p75"] for r in _timed(rows)),
                                     "faster": sum(r["fused_p75"] < r["inductor_p25"] for r in _timed(rows))}
            for dynamic in (False, True):
                ratios = [r["ratio"] for r in _timed(rows) if r["dynamic"] is dynamic]
                entry[mode_name(dynamic)] = (min(ratios), max(ratios)) if ratios else None
            inductor = {(r["tokens"], r["dynamic"]): r["inductor_us"] for r in _timed(rows)}
            entry["inductor_dynamic_over_static"] = _geomean(
                [inductor[(t, True)] / inductor[(t, False)] for t, dynamic in inductor if not dynamic and (t, True) in inductor])
            out.append(entry)
    return out


def _fusion_line(entries: list[dict[str, Any]], quant: str) -> str:
    """What the fxfuse backend did in the graphs of one (quant, mode), over every hidden size."""
    graphs = [g for e in entries for g in e["graphs"]]
    if not graphs:
        return "- fxfuse graphs: none compiled"
    ops: dict[str, set[int]] = {}
    for g in graphs:
        for name, count in g["fused_ops"].items():
            ops.setdefault(name, set()).add(count)
    nodes = "; ".join(f"{name} x{'/'.join(map(str, sorted(counts)))}" for name, counts in ops.items()) or "none"
    tiers = "; ".join(f"{TIER_WORDS[tier]} in {count}" for tier in TIER_WORDS
                      if (count := sum(g["tier"] == tier for g in graphs)))
    line = f"- fxfuse graphs compiled: {len(graphs)}; the all-reduce site {tiers}; fused-op nodes per graph: {nodes}"
    if quant not in BF16_OUTPUT_KINDS:
        fused = sum(bool(g["quant_fused"]) for g in graphs)
        line += ("; quantization fused into the op: " + ("yes, in every graph" if fused == len(graphs) else
                 f"in {fused} of {len(graphs)} graphs" if fused else "no (Inductor quantizes the op's normed output)"))
    return line


def _us(row: dict[str, Any], prefix: str) -> str:
    return f"{row[f'{prefix}_us']:.2f} ({row[f'{prefix}_p25']:.2f}-{row[f'{prefix}_p75']:.2f})"


def _check_cell(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"ERROR: {row['error']}"
    bad = [f"{variant}: {_measures(check)}" for variant, check in row["check"].items() if not check["ok"]]
    if row["fusion"]["tier"] == "c":
        bad.append("site left to Inductor")
    return "FAILED " + "; ".join(bad) if bad else "ok"


def _table(report: dict[str, Any], quant: str, dynamic: bool) -> list[str]:
    rows = [r for r in report["rows"] if r["quant"] == quant and r["dynamic"] is dynamic]
    entries = [e for e in report["fusion"] if e["quant"] == quant and e["dynamic"] is dynamic]
    if not rows:
        return []
    shapes = "dynamic=True, one graph for every token count above 1" if dynamic else "dynamic=False, one compile per token count"
    lines = ["", f"## {QUANT_TITLES[quant]}: {mode_name(dynamic)} shapes ({shapes})", "", _fusion_line(entries, quant), "",
             "| hidden | tokens | Inductor us | fxfuse us | ratio | check |", "|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "ratio" in r:
            lines.append(f"| {r['hidden']} | {r['tokens']} | {_us(r, 'inductor')} | {_us(r, 'fused')} | {r['ratio']:.3f} | {_check_cell(r)} |")
        else:
            lines.append(f"| {r['hidden']} | {r['tokens']} | - | - | - | {_check_cell(r)} |")
    return lines


def _input_sets_line(report: dict[str, Any]) -> str:
    """How many copies of the inputs the captured calls cycled through, and why."""
    if "input_sets" not in report:  # reports from before the copies: one set
        return "every captured call read the same inputs (L2-hot)"
    counts = sorted({r["input_sets"] for r in report["rows"] if "input_sets" in r})
    if report["input_sets"] == 0:
        chosen = (f"--input-sets 0: enough to cover twice the L2 cache of {report['l2_bytes'] / (1 << 20):.0f} MiB, "
                  f"at most {report['iters']}")
    else:
        chosen = f"--input-sets {report['input_sets']}"
    if not counts:
        spread = "-"
    else:
        spread = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return (f"the calls cycled through {spread} copies of input and residual per point "
            f"({chosen}; 1 = L2-hot)")


def _without(report: dict[str, Any]) -> str:
    """`, patterns without X` for a report whose fxfuse variant ran without some passes; else empty."""
    without = report.get("fxfuse_without") or []
    return f", patterns without {', '.join(without)}" if without else ""


def _range(value: tuple[float, float] | None) -> str:
    return "-" if value is None else f"{value[0]:.3f}-{value[1]:.3f}"


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: facts, the overview, a table per (quantization, mode), host cost."""
    rows = report["rows"]
    lines = header_lines(f"fxfuse bench fallback: {report['gpu']}, one-rank NCCL group, {report['dtype']}", report) + [
        f"- timing: CUDA-graph replay of {report['iters']} calls, median (p25-p75) of {report['repeats']} samples, "
        "microseconds per call; variants interleaved; ratio = fxfuse / Inductor",
        f"- inputs: {_input_sets_line(report)}",
        "- variants: `inductor` = torch.compile(backend=\"inductor\"); `fxfuse` = "
        "FxfuseBackend(fuse_without_fast_kernel=True" + _without(report) + "): the site fused (tier a) or, where the "
        "norm feeds code the op cannot fold, the all-reduce-only op then Inductor's add, norm and epilogue (tier b); "
        "each op on its NCCL plan",
        f"- check, both variants at every point, against float32: bf16 outputs within {BF16_TOLERANCE:g} relative L2, "
        f"FP8 outputs dequantized within one e4m3 step, scales within {SCALE_TOLERANCE:g} relative: "
        f"{sum(r['ok'] for r in rows)} of {len(rows)} points passed",
        f"- time: {report['wall_s']:.0f} s in all, {report['first_call_s']:.0f} s of it in first calls (compiles)",
    ]
    if report["skipped"]:
        lines.append(f"- {len(report['skipped'])} point(s) skipped, the time budget of {report['time_budget_s']:g} s "
                     f"spent: {skipped_summary(report['skipped'])}")
    lines += ["", "| quantization | hidden | fxfuse/Inductor static | fxfuse/Inductor dynamic | points slower / faster "
              "beyond the quartiles | Inductor dynamic/static (geomean) | failed points |", "|---|---:|---:|---:|---:|---:|---:|"]
    for e in overview_rows(report):
        slowdown = "-" if e["inductor_dynamic_over_static"] is None else f"{e['inductor_dynamic_over_static']:.2f}"
        lines.append(f"| {e['quant']} | {e['hidden']} | {_range(e['static'])} | {_range(e['dynamic'])} | "
                     f"{e['slower']} / {e['faster']} | {slowdown} | {e['failed']} |")
    for quant in FALLBACK_QUANT:
        for dynamic in (False, True):
            lines += _table(report, quant, dynamic)
    if report["host_cost"]:
        lines += ["", f"Host cost per uncaptured call (1 token; the op's C++ fallback "
                      f"{'installed' if report.get('native_fallback') else 'NOT installed'}; median (p25-p75) of "
                      "interleaved rounds):", "", "| block | hidden | mode | Inductor us | fxfuse us | ratio |",
                  "|---|---:|---|---:|---:|---:|"]
        for r in report["host_cost"]:
            lines.append(f"| {r.get('quant', 'none')} | {r['hidden']} | {mode_name(r['dynamic'])} | {r['inductor_host_us']:.1f} "
                         f"({r['inductor_host_p25']:.1f}-{r['inductor_host_p75']:.1f}) | {r['fused_host_us']:.1f} "
                         f"({r['fused_host_p25']:.1f}-{r['fused_host_p75']:.1f}) | {r['ratio']:.3f} |")
    if report["op_parts"]:
        lines += ["", "Parts of one fallback call, called eagerly (us per call):", ""]
        for r in report["op_parts"]:
            lines.append(f"- hidden {r['hidden']}: " + ", ".join(f"{name} {us:.1f}" for name, us in r["parts_us"].items()))
    return "\n".join(lines) + "\n"
