"""CPU tests of `fxfuse.runner.step_backends.compile_step`'s shape modes: every compiled step runs with
dynamo's recompile limit raised (restored after every call), so one graph per width fits where
`fullgraph=True` would otherwise fail at dynamo's default of 8 graphs, and a dynamic-shape step still
compiles over a module that static steps already compiled many times (the model benchmark's
`--dynamic both`)."""

from __future__ import annotations

import pytest
import torch

from fxfuse.runner.step_backends import RECOMPILE_LIMIT, _within_recompile_limit, compile_step


class TinyStep(torch.nn.Module):
    """A model step's signature, (input_ids, positions) -> logits, without collectives."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 32)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids) * (1 + positions.unsqueeze(-1)))


def test_a_compiled_step_runs_with_the_raised_limit_and_restores_it():
    config = torch._dynamo.config
    before = config.recompile_limit
    seen = []

    def step(*args):
        seen.append(config.recompile_limit)
        if args:
            raise RuntimeError("the step failed")
        return "out"

    limited = _within_recompile_limit(step)
    assert limited() == "out" and seen == [max(before, RECOMPILE_LIMIT)] and config.recompile_limit == before
    with pytest.raises(RuntimeError, match="the step failed"):
        limited(torch.zeros(1))
    assert config.recompile_limit == before  # restored after a failure too


def test_the_shape_mode_reaches_torch_compile():
    model = TinyStep()
    for backend, dynamic in (("inductor", True), ("fxfuse", False)):
        compiled = compile_step(model, backend, inner="eager", dynamic=dynamic)
        assert compiled.step.__name__ == "compiled_step" and (compiled.fxfuse_backend is not None) == (backend == "fxfuse")
    assert compile_step(model, "eager", dynamic=False).step is model


@pytest.mark.slow
@torch.no_grad()
def test_a_static_step_compiles_one_graph_per_width_past_dynamos_default_limit():
    torch._dynamo.reset()
    model = TinyStep()
    widths = range(1, 11)  # ten shapes: more than dynamo's default limit of 8
    compiled = compile_step(model, "fxfuse", inner="eager", dynamic=False)
    for width in widths:
        ids, positions = torch.randint(0, 32, (2, width)), torch.arange(width).expand(2, -1)
        torch.testing.assert_close(compiled.step(ids, positions), model(ids, positions))
    assert len(compiled.fxfuse_backend.records) == 10  # one graph per width
    # then dynamic shapes over the same module, as `fxfuse bench model --dynamic both` compiles: before the
    # limit covered dynamic steps too, this compile failed with FailOnRecompileLimitHit (seen on the H200)
    dynamic = compile_step(model, "fxfuse", inner="eager", dynamic=True)
    for width in (3, 5):
        ids, positions = torch.randint(0, 32, (2, width)), torch.arange(width).expand(2, -1)
        torch.testing.assert_close(dynamic.step(ids, positions), model(ids, positions))
    assert len(dynamic.fxfuse_backend.records) == 1  # one graph serves both widths
    torch._dynamo.reset()
    plain = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):  # what the raised limit prevents
        for width in widths:
            plain(torch.zeros(1, width, dtype=torch.long), torch.zeros(1, width, dtype=torch.long))
    torch._dynamo.reset()
