"""Compile time of the fxfuse pass vs Inductor on the same graph: DeepSeek-V3-shaped slices at tp=8.

One fake-process-group rank compiles a 4-token step of the reference model cut to LAYERS layers
(bfloat16, uninitialized CPU weights that are never read: the compiled step is stopped before it
runs) with one inner compiler, cold (a fresh process and Inductor cache directory, one compile):
- `eager`: AOT autograd + the fxfuse passes (what `fxfuse report` times);
- `inductor`: AOT autograd + Inductor (CPU code generation, one compile thread), the fxfuse passes
  running inside it as Inductor's post-grad custom pass.
Prints one JSON line: layers, inner compiler, compile seconds (dynamo included), backend seconds
(everything after dynamo), pass seconds (the fxfuse passes, pattern tracing included).
When to run it: after a change to the passes, their pattern tracing or the recorder that could change
how long a compile spends in fxfuse, to refresh the table in bench/results/report_timing.md (which has
the loop over layers and inner compilers). CPU only; about a minute per line at 8 layers.
Usage: python scripts/pass_vs_inductor.py LAYERS eager|inductor   (one measurement per process: Inductor
keeps compiled kernels in memory, so a second compile in the same process would not be cold)
"""

from __future__ import annotations

import json
import sys
import time

import torch

from fxfuse.backend import FxfuseBackend
from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.presets import get_preset
from fxfuse.inspect.site_report import fake_process_group

TP, TOKENS = 8, 4


class CompiledOnly(Exception):
    """Raised instead of running the compiled step: only the compile is measured."""


class TimedBackend(FxfuseBackend):
    """An `FxfuseBackend` that records its compile time and pass time, and never runs the graph."""

    def __init__(self, inner: str) -> None:
        super().__init__(inner=inner)
        self.backend_seconds = self.pass_seconds = 0.0

    def rewrite(self, graph: torch.fx.Graph) -> None:
        start = time.perf_counter()
        super().rewrite(graph)
        self.pass_seconds += time.perf_counter() - start

    def __call__(self, gm, example_inputs):
        start = time.perf_counter()
        super().__call__(gm, example_inputs)
        self.backend_seconds += time.perf_counter() - start

        def refuse(*args):
            raise CompiledOnly

        return refuse


def measure(layers: int, inner: str) -> dict:
    """Compile a `layers`-layer slice once with `inner`; the backend's and the pass's seconds."""
    config = get_preset("deepseek-v3", layers=layers)
    backend = TimedBackend(inner)
    with fake_process_group(TP) as group, torch.no_grad():
        model = DeepseekV3ForCausalLM(config, ParallelContext.from_group(group), dtype=torch.bfloat16, max_seq_len=TOKENS)
        torch._dynamo.reset()
        start = time.perf_counter()
        try:
            torch.compile(model, backend=backend, fullgraph=True, dynamic=True)(
                torch.zeros(1, TOKENS, dtype=torch.long), torch.arange(TOKENS).unsqueeze(0)
            )
        except CompiledOnly:
            pass
        total = time.perf_counter() - start
    (record,) = backend.records
    return {
        "layers": layers,
        "inner": inner,
        "compile_seconds": round(total, 1),
        "backend_seconds": round(backend.backend_seconds, 1),
        "pass_seconds": round(backend.pass_seconds, 2),
        "allreduce_sites": record.stats.allreduces_before,
        "fused_sites": record.stats.fused,
    }


if __name__ == "__main__":
    torch._inductor.config.compile_threads = 1
    print(json.dumps(measure(int(sys.argv[1]), sys.argv[2])), flush=True)
