"""Which rewrites the fxfuse passes may apply: the pattern names and `PassConfig`."""

from __future__ import annotations

from dataclasses import dataclass

MERGE_ALLREDUCE = "merge_allreduce"
"""Pattern 3: `all_reduce(a) + all_reduce(b)` on one group becomes `all_reduce(a + b)`."""
ALLREDUCE_RESIDUAL_RMSNORM = "allreduce_residual_rmsnorm"
"""Pattern 1: all_reduce -> residual add -> RMSNorm becomes the fused op."""
ALLREDUCE_RMSNORM = "allreduce_rmsnorm"
"""Pattern 2: all_reduce -> RMSNorm (no residual) becomes the fused op with residual=None."""

FP8_EPILOGUE = "fp8_epilogue"
"""After 1 or 2: an FP8 quantization of the norm's output folds into the fused op (its FP8 variant)."""

FAST_ALLREDUCE = "fast_allreduce"
"""Tier (b): the all-reduce-only op (`fxfuse::all_reduce`) where a fused site's norm output feeds an
epilogue the fused op cannot fold (the add and norm go back to Inductor), and for every summed
all-reduce left unfused where a fused all-reduce kernel can run (`fxfuse.passes.site_tiers`)."""

PATTERNS = (MERGE_ALLREDUCE, ALLREDUCE_RESIDUAL_RMSNORM, ALLREDUCE_RMSNORM, FP8_EPILOGUE, FAST_ALLREDUCE)


@dataclass(frozen=True)
class PassConfig:
    """The set of enabled pattern names (all of `PATTERNS` by default; unknown names raise), and
    whether to fuse sites where no fused all-reduce kernel can run (`fuse_without_fast_kernel`; off by
    default: such CUDA sites are left to Inductor, see `fxfuse.op.decide.capability`; benchmarks of the op's
    fallback turn it on)."""

    patterns: frozenset[str] = frozenset(PATTERNS)
    fuse_without_fast_kernel: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "patterns", frozenset(self.patterns))
        unknown = sorted(self.patterns - set(PATTERNS))
        if unknown:
            raise ValueError(f"unknown fxfuse pattern(s) {unknown}; known: {list(PATTERNS)}")

    def enabled(self, pattern: str) -> bool:
        """Whether the pattern called `pattern` may be rewritten."""
        return pattern in self.patterns
