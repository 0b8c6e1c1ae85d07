"""The `fxfuse` torch.compile backend: fusion passes on the post-grad graph, then Inductor or eager.

`torch.compile(model, backend="fxfuse")` resolves to `fxfuse_backend` through the
`torch_dynamo_backends` entry point, with no import of fxfuse. A configured `FxfuseBackend` object can
be passed instead: `torch.compile(model, backend=FxfuseBackend(inner="eager", patterns=...))`.
Compiles whose backend is not fxfuse get the same passes from `fxfuse.post_grad_pass()`, as
Inductor's `post_grad_custom_post_pass` (`fxfuse.post_grad`).

Data path: dynamo graph -> AOT autograd (functional ATen, Inductor's decompositions) -> the passes
(`merge_allreduce`, then `allreduce_rmsnorm_fusion`, then `fp8_epilogue`; for Inductor also
`donate_allreduce_input`) -> the
inner compiler. With `inner="inductor"` the passes run as Inductor's `post_grad_custom_post_pass`
(`fxfuse.post_grad.FusionPostGradPass`, after any pass the user had put in that slot), whose uuid lets
Inductor's FX graph cache and AOTAutograd cache serve the compile; with `inner="eager"` they run on the
AOT forward graph after the clean-ups Inductor does before that point, and the graph then runs as is.
The backend is the `fxfuse.rewrite.recorder.FusionRecorder` that runs the passes: every compiled graph
is recorded on it (`records`): the graph before and after, and `FusionStats`, also for graphs Inductor
loaded from its caches, where the passes did not run (`fxfuse.rewrite.records` says how). The same numbers are also summed into
`torch._dynamo.utils.counters["fxfuse"]`, the only view of compiles made through the
`backend="fxfuse"` entry point. The rewrite depends only on the graph, so every rank makes the same
decisions.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Callable

import torch
import torch.fx

from fxfuse.passes.config import PATTERNS
from fxfuse.post_grad import FusionPostGradPass, user_passes_of
from fxfuse.rewrite.recorder import FusionRecorder
from fxfuse.rewrite.records import CompileRecord, FusionStats

__all__ = ["CompileRecord", "FusionStats", "FxfuseBackend", "fusion_summary", "fxfuse_backend"]

INNER_COMPILERS = ("inductor", "eager")


class FxfuseBackend(FusionRecorder):
    """A configured fxfuse backend: pass it as `torch.compile(..., backend=FxfuseBackend(...))`.

    inner: "inductor" (default) or "eager" (no code generation: fast, for tests).
    patterns, dump_dir, fuse_without_fast_kernel: the `FusionRecorder`'s (enabled patterns, where each
    graph's before/after/diff files go, fusing CUDA sites no fused all-reduce kernel can run).
    mode, options: `torch.compile`'s, for the inner Inductor, which applies them as it does for
    `backend="inductor"` (`mode="reduce-overhead"`: CUDA graphs; `"max-autotune"`; `options` of Inductor's
    config); given to `torch.compile(..., backend="fxfuse", mode=...)` they reach the backend here too. The
    eager inner compiler takes neither (ValueError).
    After compiling, `records` holds one `CompileRecord` per compiled graph, in order (`from_cache`
    for those Inductor loaded from its caches). With Inductor, the passes take the
    `post_grad_custom_post_pass` slot of Inductor's config for these compiles and run the pass that was
    there first.
    """

    def __init__(
        self,
        inner: str = "inductor",
        patterns: Iterable[str] = PATTERNS,
        dump_dir: str | os.PathLike | None = None,
        fuse_without_fast_kernel: bool = False,
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        if inner not in INNER_COMPILERS:
            raise ValueError(f"unknown inner compiler {inner!r}; choose one of {INNER_COMPILERS}")
        super().__init__(patterns, dump_dir, fuse_without_fast_kernel)
        self.inner = inner
        self.inductor_config = inductor_config_patches(inner, mode, options)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                 options: dict[str, Any] | None = None) -> Callable[..., Any]:
        """Compile a dynamo graph: AOT autograd, the fusion passes, then the inner compiler (`mode` and
        `options`: as `torch.compile` passes them, added to the backend's own)."""
        patches = {**self.inductor_config, **inductor_config_patches(self.inner, mode, options)}
        if self.inner == "inductor":
            from torch._inductor import config as inductor_config
            from torch._inductor.compile_fx import compile_fx

            slot = inductor_config.post_grad_custom_post_pass
            fusion = FusionPostGradPass(self, user_passes_of(slot, owner="post_grad_custom_post_pass"))
            return compile_fx(gm, example_inputs, config_patches={**patches, "post_grad_custom_post_pass": fusion})
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.decomposition import select_decomp_table

        compile_eager = aot_autograd(
            fw_compiler=self._compile_eager_graph,
            decompositions=select_decomp_table(),
            keep_inference_input_mutations=True,
        )
        return compile_eager(gm, example_inputs)

    def _compile_eager_graph(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """AOT graph -> the clean-ups Inductor runs before post-grad custom passes -> passes -> eager.

        The clean-ups (joint-graph passes such as pointless-view removal, then no-op removal) make
        the graph the passes see here the one they see under Inductor.
        """
        from functorch.compile import make_boxed_func
        from torch._inductor.fx_passes.joint_graph import joint_graph_passes
        from torch._inductor.fx_passes.post_grad import remove_noop_ops

        joint_graph_passes(gm)
        remove_noop_ops(gm.graph)
        self.rewrite(gm.graph)
        gm.recompile()
        return make_boxed_func(gm.forward)


def fusion_summary(backend: FxfuseBackend) -> dict[str, int | None]:
    """What the pass did to the graph a run last compiled: the runner's JSON fields.

    `allreduce_sites`: all-reduces in that graph before the passes; `fused_sites`: fused ops after
    them (tier a); `fast_all_reduces`: all-reduce-only ops after them (tier b, `fxfuse.passes.site_tiers`);
    `merged`: all-reduce pairs merged first; `graphs_compiled`: graphs compiled so far, the
    passes run or loaded from Inductor's caches (with fullgraph=True, one per compile, e.g. a width-1
    step compiled apart).
    The counts are None before anything was compiled. The last graph, not a sum over compiles: each
    compile is the whole model again, so summing would count every site once per compile.
    """
    if not backend.records:
        return {"allreduce_sites": None, "fused_sites": None, "fast_all_reduces": None, "merged": None, "graphs_compiled": 0}
    stats = backend.records[-1].stats
    return {
        "allreduce_sites": stats.allreduces_before,
        "fused_sites": stats.fused,
        "fast_all_reduces": stats.fast_all_reduces,
        "merged": stats.merged,
        "graphs_compiled": len(backend.records),
    }


def inductor_config_patches(inner: str, mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """The Inductor config `torch.compile(mode=..., options=...)` would give `backend="inductor"` (made by
    Inductor's own wrapper, which checks the mode and option names); ValueError for the eager inner compiler,
    which has no such settings."""
    if (mode is None or mode == "default") and not options:
        return {}
    if inner != "inductor":
        raise ValueError(f"mode={mode!r} and options={options!r} configure Inductor; fxfuse's inner compiler here is "
                         f"{inner!r}, which takes neither (use inner='inductor', the default)")
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"options must be a dict of Inductor config settings, got {type(options).__name__}")
    try:
        return dict(torch._TorchCompileInductorWrapper(mode, options, None).config)
    except RuntimeError as error:  # an unknown mode or option name
        raise ValueError(str(error).split(", known options are")[0] + " (Inductor's settings: torch._inductor.config)") from None


def fxfuse_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                   options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The `backend="fxfuse"` entry point: `FxfuseBackend()` with defaults (Inductor, all patterns), with
    `torch.compile`'s `mode` and `options` for the inner Inductor."""
    return FxfuseBackend(mode=mode, options=options)(gm, example_inputs)
