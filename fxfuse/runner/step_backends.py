"""How a model step is compiled for the runner and the model benchmark: eager, Inductor or fxfuse.

`compile_step(model, backend)` returns a `CompiledStep`: the callable that runs one forward
(`step(input_ids, positions)`), and for backend "fxfuse" the `FxfuseBackend` object (with its inner
compiler, Inductor or eager) whose records say what the fusion pass found
(`CompiledStep.fusion_summary()`). All compiled variants use `fullgraph=True` (a graph break fails
loudly). `dynamic=True`: dynamic shapes, one graph serves many batch sizes and step widths (torch still
specializes sizes of 1: a 1-token step or a batch of 1 gets its own graph). `dynamic=False`: static
shapes, one graph per shape (Inductor's code for a fixed shape is faster; under CUDA graphs each
captured width is compiled once). Every compiled step runs with dynamo's recompile limit raised to
`RECOMPILE_LIMIT`: the static graphs need it, and a dynamic-shape step compiled over a module that
static steps already compiled (the model benchmark's `--dynamic both`) counts their graphs against
the same limit. Which mode a run uses: `fxfuse.runner.options.resolve_dynamic`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fxfuse.runner.options import BACKENDS

#: Graphs the steps may compile for one module: one per shape for static steps (the runner's captured
#: widths, the prefill and the verify step; the model benchmark's batch x width points for every backend
#: and shape mode compiled over the same model), far above dynamo's default of 8, which `fullgraph=True`
#: turns into an error when it is reached.
RECOMPILE_LIMIT = 64


@dataclass
class CompiledStep:
    """A model step and, for backend "fxfuse", the backend object that compiled it."""

    backend: str
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    fxfuse_backend: object | None = None

    def fusion_summary(self) -> dict[str, int | None]:
        """`fxfuse.backend.fusion_summary` of the fxfuse backend (the last compiled graph's
        all-reduce and fused sites, merged pairs, graphs compiled); all None for other backends."""
        if self.fxfuse_backend is None:
            return {"allreduce_sites": None, "fused_sites": None, "fast_all_reduces": None, "merged": None,
                    "graphs_compiled": None}
        from fxfuse.backend import fusion_summary

        return fusion_summary(self.fxfuse_backend)


def compile_step(model: torch.nn.Module, backend: str, fuse_without_fast_kernel: bool = False, inner: str = "inductor",
                 dynamic: bool = True) -> CompiledStep:
    """Wrap `model` for `backend`: the module itself (eager), or torch.compile with Inductor or fxfuse.

    Compilation happens lazily, on the first call with each new shape class (every new shape when
    `dynamic` is False). `fuse_without_fast_kernel` (fuse sites where only the op's fallback can run:
    benchmarks) and `inner` (what compiles the graph after the passes) are handed to the fxfuse backend.
    """
    if backend == "eager":
        return CompiledStep(backend, model)
    if backend == "inductor":
        return CompiledStep(backend, _within_recompile_limit(torch.compile(model, backend="inductor", fullgraph=True, dynamic=dynamic)))
    if backend == "fxfuse":
        from fxfuse.backend import FxfuseBackend

        fxfuse_backend = FxfuseBackend(inner=inner, fuse_without_fast_kernel=fuse_without_fast_kernel)
        step = torch.compile(model, backend=fxfuse_backend, fullgraph=True, dynamic=dynamic)
        return CompiledStep(backend, _within_recompile_limit(step), fxfuse_backend)
    raise ValueError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")


def _within_recompile_limit(step: Callable) -> Callable:
    """`step` run with dynamo's recompile limit at least `RECOMPILE_LIMIT` (set for the call and
    restored after it: a few microseconds, nothing next to a model step, and nothing at all for steps
    replayed from CUDA graphs)."""

    def compiled_step(*args: torch.Tensor) -> torch.Tensor:
        config = torch._dynamo.config
        limit = config.recompile_limit
        config.recompile_limit = max(limit, RECOMPILE_LIMIT)
        try:
            return step(*args)
        finally:
            config.recompile_limit = limit

    return compiled_step
