"""README.md's Python example runs as written: the complete script of "## Using the backend", with the
options snippet added where the README says it goes, on 2 gloo ranks started the way torchrun starts
them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Rank 0 must print the counters and stats the
README shows: one all-reduce, fused with its residual add and RMSNorm.

Fast checks of the documents: the README opens with the two commands, `scripts/dev run` and `scripts/dev
test` (the second is what CI runs); every relative link of README.md and docs/*.md reaches a file and, with
an anchor, a heading of it (GitHub's anchors); no document tells anyone to install fxfuse from PyPI, where
there is no such package. (tests/test_cli_run.py checks the README's sample output, tests/test_post_grad_pass.py
runs its `fxfuse.post_grad_pass()` block.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fxfuse.runner.launch import free_port

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TIMEOUT_S = 300
#: Documents that other branches write and the README already links to: checked once they exist.
WRITTEN_ELSEWHERE = {REPO / "docs" / "FP8.md"}


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
           "'allreduces_after': 0, 'fp8_quantizations_folded': 0, 'fast_all_reduces': 0}" in out
    assert "FusionStats(allreduces_before=1, merged=0, fused_with_residual=1, fused_without_residual=0, " \
           "allreduces_after=0, fp8_quantizations_folded=0, fast_all_reduces=0)" in out
    assert "fxfuse.allreduce_residual_rmsnorm" in out  # the diff shows the fused op
    assert outputs[1][0] == ""  # rank 1 prints nothing
    assert sorted(p.name for p in (tmp_path / "graphs").iterdir())[:3] == [
        "graph_000_rank0.after.txt", "graph_000_rank0.before.txt", "graph_000_rank0.diff.txt"]


def test_readme_opens_with_the_two_commands():
    """The first thing after the title: one bash block with exactly `scripts/dev run` and `scripts/dev test`."""
    lines = README.read_text().splitlines()
    assert lines[0] == "# fxfuse" and lines[1] == "" and lines[2] == "```bash"
    block = lines[3:lines.index("```", 3)]
    assert [line.split("#", 1)[0].strip() for line in block] == ["scripts/dev run", "scripts/dev test"]
    assert (REPO / ".ci" / "run").read_text().rstrip().endswith("\nscripts/dev test")  # CI runs the second


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(markdown: str) -> str:
    """The text of a markdown document without its fenced code blocks."""
    return re.sub(r"^```.*?^```$", "", markdown, flags=re.S | re.M)


@pytest.mark.parametrize("document", [README, *sorted((REPO / "docs").glob("*.md"))], ids=lambda path: path.name)
def test_relative_links_reach_a_file_and_heading(document):
    text = prose(document.read_text())
    targets = re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`\n]*`", "", text))
    broken = []
    for target in targets:
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        if linked in WRITTEN_ELSEWHERE and not linked.exists():
            continue
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in {github_anchor(line.lstrip("#")) for line in
                                       prose(linked.read_text()).splitlines() if line.startswith("#")}:
            broken.append(f"{target}: no such heading")
    assert not broken
    assert targets or document != README


def test_no_document_installs_fxfuse_from_pypi():
    documents = [README, REPO / "DEVELOPERS.md", REPO / "BENCHMARKS.md", *(REPO / "docs").glob("*.md")]
    found = [(path.name, match) for path in documents
             for match in re.findall(r"pip install[^\n`]*?[\s\"']fxfuse\b[^\n`]*", path.read_text())]
    assert not found
    assert 'pip install -e ".[cuda]"' in README.read_text()  # from a clone of the repository
