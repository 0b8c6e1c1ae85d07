"""A per-site fusion report of any function or module, compiled as the caller would compile it.

`report_compiled(fn, *example_inputs, **compile_kwargs)` compiles `fn` (a module or a function) with
`torch.compile(..., **compile_kwargs)` through an eager-inner fxfuse backend that records every
all-reduce (and reduce-scatter) site of every graph dynamo makes, runs it once on `example_inputs`,
and returns the `FusionReport` (`fxfuse.inspect.site_report`): one row per site with its layer,
block, whether it fused and, if not, why. It runs in the caller's grad mode and process groups, so a
report made with grad enabled shows why that compile cannot fuse. With a real process group, call it
on every rank (it runs one step); under a fake group (`torch.testing._internal.distributed.fake_pg`)
and fake tensors one process suffices, as `fxfuse report` does for the built-in presets.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from fxfuse.inspect.site_report import FusionReport, SiteTracingBackend, summarize
from fxfuse.passes.config import PATTERNS


def report_compiled(
    fn: Callable[..., Any], *example_inputs: Any, name: str | None = None, patterns=PATTERNS, **compile_kwargs: Any
) -> FusionReport:
    """Compile `fn` with the fxfuse passes, run it on `example_inputs`, and report every site.

    `compile_kwargs` go to `torch.compile` as given (e.g. `fullgraph=True`, `dynamic=True`); dynamo's
    caches are reset before and after. `name` labels the report (default: the class or function
    name); `layers` is the number of distinct decoder-layer indices among the sites (None for code with no
    decoder layers, a block), `tp` the default
    group's world size (1 without one) and `dtype` that of `fn`'s first floating-point parameter or
    input.
    """
    backend = SiteTracingBackend(patterns)
    torch._dynamo.reset()
    start = time.perf_counter()
    try:
        torch.compile(fn, backend=backend, **compile_kwargs)(*example_inputs)
    finally:
        seconds = time.perf_counter() - start
        torch._dynamo.reset()
    if not backend.records:
        raise RuntimeError("torch.compile made no graph for the fxfuse passes (nothing was compiled)")
    layers = len({row.layer for row in backend.sites if row.layer is not None}) or None  # a plain block: none known
    return summarize(backend, seconds, model=name or _label(fn), layers=layers, tp=_world_size(),
                     dtype=_floating_dtype(fn, example_inputs))


def _label(fn) -> str:
    return type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__name__", type(fn).__name__)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _floating_dtype(fn, example_inputs) -> torch.dtype:
    tensors = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    tensors += [x for x in example_inputs if isinstance(x, torch.Tensor)]
    return next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
