"""Shared output of the benchmarks: write a result as JSON + markdown (+ PNG) and print it.

Every `fxfuse bench` command finishes the same way: rank 0 records the command line, writes
`<stem>.json`, `<stem>.md` and, where matplotlib is importable, `<stem>.png`, lists the files (by
absolute path: the default `--out-dir` is relative to the current directory) and prints the markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from fxfuse.command_line import CommandParser, check_output_dir, parsed_or_status


def write_result_files(
    stem: Path, document: dict[str, Any], markdown_text: str, plot: Callable[[Path], bool]
) -> list[Path]:
    """Write stem.json (document), stem.md (markdown_text) and stem.png (if `plot` drew it); return the paths."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    # appended, not with_suffix: a stem may contain dots (the kimi-k2.5 preset) that are no suffix
    paths = [stem.parent / f"{stem.name}.json", stem.parent / f"{stem.name}.md"]
    paths[0].write_text(json.dumps(document, indent=2) + "\n")
    paths[1].write_text(markdown_text)
    png = stem.parent / f"{stem.name}.png"
    if plot(png):
        paths.append(png)
    return paths


def publish(report: dict[str, Any], benchmark: str, argv: list[str] | None, write, markdown) -> None:
    """Record `fxfuse bench <benchmark> ...` in the report, write its files with `write`, print them."""
    report["command"] = shlex.join(["fxfuse", "bench", benchmark, *(argv if argv is not None else sys.argv[1:])])
    for path in write(report):
        print(f"wrote {Path(path).absolute()}")
    print(markdown(report))


def report_header(benchmark: str, gpu: str) -> dict[str, Any]:
    """The fields every benchmark report starts with: its name, the UTC date and file stamp of now,
    the GPU, and an empty `command` that `publish` fills in."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"benchmark": benchmark, "date": now.isoformat(timespec="seconds"), "stamp": now.strftime("%Y%m%d-%H%M%S"),
            "command": "", "gpu": gpu}


def header_lines(title: str, report: dict[str, Any]) -> list[str]:
    """The first lines of every benchmark's markdown: `# title`, then the run's date, command and versions."""
    return [
        f"# {title}",
        "",
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
    ]


def relative_l2_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error ||actual - expected|| / ||expected||, in float32."""
    actual, expected = actual.float(), expected.float()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def package_versions(packages: tuple[str, ...]) -> dict[str, str]:
    """Python, torch and CUDA versions, and each named installed distribution's ("not installed" if absent)."""
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def mode_name(dynamic: bool | None) -> str:
    """A compile's shape mode in words: "static" (`dynamic=False`), "dynamic" (`dynamic=True`), "" (None:
    not compiled, or not recorded)."""
    return {False: "static", True: "dynamic"}.get(dynamic, "")


def gpu_slug(gpu: str) -> str:
    """A GPU name as it appears in result file names: lower case, runs of other characters as one '-'."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")


def one_gpu_arguments(argv: list[str] | None, prog: str, description: str,
                      declare: Callable[[argparse.ArgumentParser], None],
                      check: Callable[[argparse.Namespace], None] | None = None) -> tuple[argparse.Namespace | None, int | None]:
    """A one-GPU benchmark's arguments (declared by `declare`, then checked by `check`, which raises
    ValueError), --out-dir checked and a GPU required: `(args, None)` to go on, or `(None, exit status)`
    after --help, a usage error or a one-line error."""
    def parse() -> argparse.Namespace:
        parser = CommandParser(prog=prog, description=description)
        declare(parser)
        args = parser.parse_args(argv)
        if check is not None:
            check(args)
        check_output_dir(args.out_dir, "--out-dir")
        return args

    args, status = parsed_or_status(parse)
    if status is None and not torch.cuda.is_available():
        print(f"fxfuse: error: {prog} needs a CUDA GPU", file=sys.stderr)
        return None, 2
    return args, status
