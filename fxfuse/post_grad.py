"""fxfuse's passes as an Inductor custom post-grad pass, for compiles whose backend is not fxfuse.

`post_grad_pass()` (exported as `fxfuse.post_grad_pass`) returns a `FusionPostGradPass` for
`torch._inductor.config.post_grad_custom_post_pass`: `backend="inductor"`, `mode="max-autotune"`, or a
framework whose own backend calls Inductor then fuse exactly as `backend="fxfuse"` does, which uses
the same class. One call of the pass runs, in this order:
1. the passes that were already in that slot (given as `user_pass`), each as Inductor would have
   run it: they see the graph Inductor's own passes left, as without fxfuse;
2. fxfuse's merge and fusion passes (`FusionRecorder.rewrite`: recorded, counted, dumped);
3. the donation of each fused op's input (`fxfuse.passes.donate_allreduce_input`), last, so that
   Inductor's re-inplacing, which runs next, completes it.

`uuid()` lets Inductor's FX graph cache and AOTAutograd cache key on the pass: a digest of fxfuse's
pass sources (`hashed_sources()`), the `PassConfig` and the order above, with the user passes' own
uuids beside it. Nothing of the machine or of the FXFUSE_* settings is in it: the rewrite reads
neither (its compile-time choices use graph facts only, `fxfuse.op.decide.capability`, so every rank's
graph is the same; the op decides the rest when it first runs). It is None (Inductor then compiles
without its cache, as it would for their pass alone) when a user pass has no uuid.
A cache hit runs no pass. Inductor then replays the counters the compile made, fxfuse's mark among them
(`fxfuse.rewrite.records`): the Counter that holds `counters["inductor"]` tells the pass in Inductor's
config of each mark replayed while the pass is not running (`MarkWatchingCounter`), and the pass turns
it into a record, logged and counted as the run of the pass was (`FusionPostGradPass.loaded_from_cache`):
a compile served by Inductor's caches says so, with its counts, whichever entry point made it.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch._dynamo.utils import counters
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass

import fxfuse.op
import fxfuse.passes
import fxfuse.rewrite
from fxfuse.op.runtime.registration import install_native_fallback
from fxfuse.passes import donate_allreduce_input
from fxfuse.passes.config import PATTERNS, PassConfig
from fxfuse.rewrite.recorder import FusionRecorder
from fxfuse.rewrite.records import MARK_PREFIX, CompileRecord, fused_sites_on_cuda, mark_compiled, record_from_mark

#: Inductor (torch >= 2.12) hands passes of this kind `is_inference`; older releases call `pass_(graph)`.
_INFERENCE_AWARE = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)
#: Bumped when what the uuid covers changes meaning (the order of the passes, say).
UUID_FORMAT = "fxfuse-post-grad-1: user passes, then merge + fusion, then donation"

GraphPass = Callable[[torch.fx.Graph], None]


class FusionPostGradPass(_INFERENCE_AWARE or CustomGraphPass):
    """User passes, then fxfuse's rewrite through `recorder`, then donation (see the module docstring).

    `records` (the recorder's) lists the graphs this pass rewrote and those Inductor loaded from its
    caches while it was the configured pass.
    """

    def __init__(self, recorder: FusionRecorder, user_passes: Sequence[GraphPass] = ()) -> None:
        self.recorder = recorder
        self.user_passes = tuple(user_passes)
        self._marking = False
        watch_marks()

    @property
    def records(self) -> list[CompileRecord]:
        """One `CompileRecord` per graph compiled with this pass, in order."""
        return self.recorder.records

    def __call__(self, graph: torch.fx.Graph, is_inference: bool | None = None) -> None:
        """Run the user passes, fxfuse's rewrite and the donation on a post-grad graph, in place."""
        for user_pass in self.user_passes:
            if _INFERENCE_AWARE is not None and isinstance(user_pass, _INFERENCE_AWARE):
                user_pass(graph, is_inference=is_inference)
            else:
                user_pass(graph)
        recorded = len(self.recorder.records)
        self.recorder.rewrite(graph)
        on_cuda = fused_sites_on_cuda(graph)
        self._marking = True  # the marks this run makes are not loads from the cache
        try:
            for record in self.recorder.records[recorded:]:
                mark_compiled(record, on_cuda)
        finally:
            self._marking = False
        donate_allreduce_input.run(graph)

    def uuid(self) -> tuple[str, tuple[Any, ...]] | None:
        """fxfuse's digest and the user passes' uuids; None if a user pass has none (no caching)."""
        user = tuple(p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.user_passes)
        if any(u is None for u in user):
            return None
        return fxfuse_digest(self.recorder.config), user

    def loaded_from_cache(self, mark: str, count: int = 1) -> None:
        """Record a graph Inductor loaded from its caches (where this pass did not run) from the mark its
        compile left, `count` times, and install the C++ fallback for one with fused CUDA sites, as a run of
        the pass would; marks this pass is making itself are not loads."""
        if self._marking:
            return
        for _ in range(count):
            record, on_cuda = record_from_mark(mark)
            self.recorder.add_record(record)
            if on_cuda and record.stats.fused:
                install_native_fallback()


class MarkWatchingCounter(Counter):
    """The Counter of `counters["inductor"]` (and of dynamo's other counters): an fxfuse mark added while a
    `FusionPostGradPass` is Inductor's configured pass goes to that pass (`loaded_from_cache`); Inductor adds
    a cached graph's marks back when it loads it."""

    def __setitem__(self, key, value) -> None:
        added = value - self.get(key, 0) if isinstance(key, str) and key.startswith(MARK_PREFIX) else 0
        super().__setitem__(key, value)
        if added > 0:
            from torch._inductor import config as inductor_config

            configured = inductor_config.post_grad_custom_post_pass
            if isinstance(configured, FusionPostGradPass):
                configured.loaded_from_cache(key, added)


def watch_marks() -> None:
    """Make dynamo's counters `MarkWatchingCounter`s: the one Inductor writes now, and those made after a
    `counters.clear()` (idempotent)."""
    counters.default_factory = MarkWatchingCounter
    current = counters.get("inductor")
    if current is not None and not isinstance(current, MarkWatchingCounter):
        watching = MarkWatchingCounter()
        dict.update(watching, current)  # no notification for marks already counted
        counters["inductor"] = watching


def post_grad_pass(
    user_pass: Any = None,
    *,
    patterns: Iterable[str] = PATTERNS,
    fuse_without_fast_kernel: bool = False,
    dump_dir: str | os.PathLike | None = None,
) -> FusionPostGradPass:
    """fxfuse's passes as an Inductor custom pass, for `torch._inductor.config.post_grad_custom_post_pass`.

    `user_pass`: what that slot held before (None, a pass, or a list of passes): it runs first, then
    merge and fusion, then the donation of each fused op's input. The other options are
    `FusionRecorder`'s (and `FxfuseBackend`'s). The pass's `records` lists the graphs it rewrote and those
    Inductor loaded from its caches while it was the configured pass (logged as such, with their counts).
    """
    recorder = FusionRecorder(patterns, dump_dir, fuse_without_fast_kernel)
    return FusionPostGradPass(recorder, user_passes_of(user_pass, owner="fxfuse.post_grad_pass"))


def user_passes_of(slot: Any, *, owner: str) -> tuple[GraphPass, ...]:
    """The passes held by a `post_grad_custom_post_pass` value (None, a pass, or a list or tuple of
    passes); a `FusionPostGradPass` stands for the user passes it wraps. Raises TypeError naming
    `owner` for anything that is not a pass."""
    if slot is None:
        return ()
    if isinstance(slot, FusionPostGradPass):
        return slot.user_passes
    passes = tuple(slot) if isinstance(slot, (list, tuple)) else (slot,)
    for user_pass in passes:
        if not callable(user_pass) or isinstance(user_pass, FusionPostGradPass):
            raise TypeError(f"{owner}: a user pass must be a callable on a torch.fx.Graph (or a CustomGraphPass), "
                            f"not {type(user_pass).__name__}")
    return passes


# ---------------------------------------------------------------- what the uuid covers


def fxfuse_digest(config: PassConfig) -> str:
    """Digest of everything that decides what fxfuse's part of the pass does to a graph."""
    facts = (UUID_FORMAT, sources_digest(hashed_sources()), sorted(config.patterns), config.fuse_without_fast_kernel)
    return hashlib.sha256(repr(facts).encode()).hexdigest()


def hashed_sources() -> tuple[Path, ...]:
    """The source files behind fxfuse's part of the pass: every module of `fxfuse.passes`, `fxfuse.op`
    with its sub-packages (the op's schema and the compile-time checks in `fxfuse.op.decide`) and
    `fxfuse.rewrite` (the recorder that runs the passes, its records and graph snapshots), and this
    module. Not the backend: what it adds (the choice of inner compiler) never changes what the pass
    does to a graph."""
    packages = [Path(package.__file__).resolve().parent for package in (fxfuse.passes, fxfuse.op, fxfuse.rewrite)]
    return tuple(sorted({Path(__file__).resolve(), *(path for package in packages for path in package.rglob("*.py"))}))


@functools.cache
def sources_digest(paths: tuple[Path, ...]) -> str:
    """Digest of the files' contents, each under its folder and file name (the same for any checkout
    or install of the same sources). Read once per process."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(f"{path.parent.name}/{path.name}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
