"""Progress lines of the long phases (fxfuse.runner.progress): counters, heartbeats of a running phase,
and the count of layers dynamo traces while compiling, as `fxfuse run` and `fxfuse report` use them."""

from __future__ import annotations

import io
import time

import torch

from fxfuse.runner.progress import Progress, watch_layers


def lines(stream: io.StringIO) -> list[str]:
    """The messages written, without the `<label> [  1.2s]` prefix."""
    return [line.split("] ", 1)[1] for line in stream.getvalue().splitlines()]


def test_count_prints_first_and_last_and_throttles_the_rest():
    stream = io.StringIO()
    progress = Progress(True, "t", stream, min_interval_s=3600)
    for done in range(1, 6):
        progress.count("steps", done, 5)
    assert lines(stream) == ["steps 1/5", "steps 5/5"]


def test_a_long_phase_says_it_is_still_running():
    stream = io.StringIO()
    progress = Progress(True, "t", stream)
    with progress.phase("compiling", heartbeat_s=0.05):
        time.sleep(0.3)
    out = lines(stream)
    assert out[0] == "compiling ..." and out[-1].startswith("compiling: done in ")
    assert any(line.startswith("compiling: still running (") for line in out[1:-1])


def test_disabled_progress_writes_nothing_and_registers_no_hooks():
    stream = io.StringIO()
    progress = Progress(False, "t", stream)
    with progress.phase("x", heartbeat_s=0.01):
        time.sleep(0.05)
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    assert watch_layers(progress, layers, "traced") == [] and stream.getvalue() == ""


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_watch_layers_counts_layers_while_dynamo_traces_and_changes_nothing():
    stream = io.StringIO()
    progress = Progress(True, "t", stream, min_interval_s=0)
    model = Stack()
    x = torch.randn(2, 4)
    expected = model(x)
    watch_layers(progress, model.layers, "traced layer")
    assert model(x).equal(expected) and stream.getvalue() == ""  # eager calls count nothing
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert compiled(x).equal(expected)
    assert lines(stream) == ["traced layer 1/3", "traced layer 2/3", "traced layer 3/3"]
    compiled(x)  # no new trace, no new lines
    assert len(lines(stream)) == 3
    torch._dynamo.reset()


class _Writes(io.StringIO):
    """A stream that keeps each write call apart."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


def test_each_line_is_one_write():
    """A line and its newline in one write: on unbuffered stderr a process stopped between two writes left
    half a line for the launcher's last line to be glued to."""
    stream = _Writes()
    progress = Progress(True, "fxfuse run", stream)
    progress.note("building")
    with progress.phase("compiling"):
        pass
    assert len(stream.calls) == 3 and all(call.endswith("\n") and call.count("\n") == 1 for call in stream.calls)
