"""`fxfuse --help`, every subcommand's `--help` and bad arguments answer without importing torch.

Each case runs `python -X importtime -m fxfuse ...` in a fresh process and reads the list of modules
it imported from stderr: torch must not be among them. (How long that takes is machine-dependent
and not asserted; without torch it is about 0.1 s, with it several seconds.)
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    (["--help"], 0),
    (["run", "--help"], 0),
    (["report", "--help"], 0),
    (["bench", "--help"], 0),
    (["bench", "model", "--help"], 0),
    (["bench", "kernel", "--help"], 0),
    (["--frobnicate"], 2),
    (["run", "--tp", "0"], 2),
    (["run", "--preset", "nope"], 2),
    (["run", "--tp", "3"], 2),
    (["run", "--layers", "9"], 2),
    (["run", "--json", "/nonexistent_dir/x.json"], 2),
    (["report", "--json", "/nonexistent_dir/x.json"], 2),
    (["report", "--preset", "nope"], 2),
    (["bench"], 2),
    (["bench", "model", "--repeats", "0"], 2),
    (["bench", "model", "--device", "cpu", "--out-dir", "/proc/fxfuse-results"], 2),  # cannot be created
    (["plan", "--help"], 0),
    (["plan", "--tp", "3"], 2),
    (["plan", "--gpu-memory-gb", "inf"], 2),
    (["plan", "--preset", "tiny", "--tp", "2", "--context", "100000"], 2),
    (["run", "--graph-widths", "1,2"], 2),
    (["run", "--json", ""], 2),
]


def imported_modules(importtime_stderr: str) -> set[str]:
    """Module names from `-X importtime` lines (`import time: self | cumulative | module`)."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


@pytest.mark.parametrize("argv, status", CASES, ids=[" ".join(argv) for argv, _ in CASES])
def test_answers_without_importing_torch(argv, status):
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "fxfuse", *argv],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == status, proc.stderr[-2000:]
    modules = imported_modules(proc.stderr)
    assert "fxfuse.cli" in modules  # the import list was read
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}
    if status == 2:
        errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
        assert len(errors) == 1 and errors[0].startswith("fxfuse: error: ")
