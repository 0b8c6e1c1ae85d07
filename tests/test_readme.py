"""README.md's Python example runs as written: the complete script of "## Using the backend", with the
options snippet added where the README says it goes, on 2 gloo ranks started the way torchrun starts
them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Rank 0 must print the counters and stats the
README shows: one all-reduce, fused with its residual add and RMSNorm."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fxfuse.runner.launch import free_port

README = Path(__file__).resolve().parents[1] / "README.md"
TIMEOUT_S = 300


def python_blocks(markdown: str, section: str) -> list[str]:
    """The ```python blocks of one `## ` section, in order."""
    body = markdown.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def example_script() -> str:
    """The complete example with the options snippet inserted before `dist.destroy_process_group()`."""
    script, options = python_blocks(README.read_text(), "Using the backend")
    assert "init_process_group" in script and "FxfuseBackend(" in options
    head, tail = script.split("dist.destroy_process_group()\n")
    return head + options + "dist.destroy_process_group()\n" + tail


@pytest.mark.slow
def test_readme_example_runs_on_two_gloo_ranks(tmp_path):
    path = tmp_path / "example.py"
    path.write_text(example_script())
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(path)], env=env, cwd=tmp_path, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = []
    try:
        for rank, proc in enumerate(procs):
            try:
                outputs.append(proc.communicate(timeout=TIMEOUT_S))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} of the README example did not finish within {TIMEOUT_S} s")
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{err[-3000:]}"
    out = outputs[0][0]
    assert "{'allreduces_before': 1, 'merged': 0, 'fused_with_residual': 1, 'fused_without_residual': 0, " \
           "'allreduces_after': 0, 'fp8_quantizations_folded': 0}" in out
    assert "FusionStats(allreduces_before=1, merged=0, fused_with_residual=1, fused_without_residual=0, " \
           "allreduces_after=0, fp8_quantizations_folded=0)" in out
    assert "fxfuse.allreduce_residual_rmsnorm" in out  # the diff shows the fused op
    assert outputs[1][0] == ""  # rank 1 prints nothing
    assert sorted(p.name for p in (tmp_path / "graphs").iterdir())[:3] == [
        "graph_000_rank0.after.txt", "graph_000_rank0.before.txt", "graph_000_rank0.diff.txt"]
