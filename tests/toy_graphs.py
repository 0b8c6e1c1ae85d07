"""Toy tensor-parallel programs for the fusion tests, written the way users write them.

The RMSNorm and all-reduce spellings here are user code, written independently of the pattern
functions in `fxfuse.passes` (tests that imported those would only check them against themselves).
`toy_decoder` chains every site kind the passes must find: the embedding all-reduce into the first
norm (pattern 2), attention/MLP all-reduces into residual adds and norms with the residual on either
side of `+` (pattern 1), and a last layer whose residual feeds only the final norm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from fxfuse.backend import FxfuseBackend

# ---------------------------------------------------------------- RMSNorm as users write it


def rmsnorm_transformers(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward: fp32 upcast, pow/mean/rsqrt, cast back, weight * x."""
    input_dtype = h.dtype
    hidden = h.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def rmsnorm_weight_on_right(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Cast back, then `x * weight` (weight on the right)."""
    hidden = h.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return hidden.type_as(h) * weight


def rmsnorm_weight_in_fp32(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weight applied in float32 before the cast back: `(x * weight).to(dtype)`."""
    hidden = h.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return (hidden * weight).to(h.dtype)


def rmsnorm_weight_in_fp32_left(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weight applied in float32 before the cast back, on the left: `(weight * x).to(dtype)`."""
    hidden = h.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * hidden).to(h.dtype)


def rmsnorm_functional(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`F.rms_norm` over the hidden dimension."""
    return F.rms_norm(h, (h.shape[-1],), weight, eps)


def rmsnorm_gpt_fast(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """gpt-fast's RMSNorm: `x * x` (not `pow`), `torch.mean(..., dim=-1)`, `type_as`, `output * weight`."""

    def _norm(x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)

    return _norm(h.float()).type_as(h) * weight


def rmsnorm_rsqrt_on_left(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rsqrt(variance + eps) * x`, the weight on the left of the cast-back value."""
    hidden = h.to(torch.float32)
    return weight * (torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps) * hidden).to(h.dtype)


def rmsnorm_eps_first_square(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`eps + mean(x.square(), dim=<last index>)`, upcast twice with `.float()`."""
    variance = h.float().square().mean(h.dim() - 1, keepdim=True)
    return weight * (h.float() * torch.rsqrt(eps + variance)).to(h.dtype)


def rmsnorm_one_over_sqrt(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * (1 / sqrt(variance + eps))`."""
    hidden = h.float()
    return weight * (hidden * (1 / torch.sqrt(hidden.pow(2).mean(-1, keepdim=True) + eps))).to(h.dtype)


def rmsnorm_divide_by_sqrt(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(variance + eps)`, `x ** 2`."""
    hidden = h.float()
    return (hidden / torch.sqrt((hidden**2).mean(-1, keepdim=True) + eps)).to(h.dtype) * weight


def rmsnorm_reciprocal_sqrt(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * reciprocal(sqrt(variance + eps))`."""
    hidden = h.float()
    return weight * (hidden * torch.reciprocal(torch.sqrt(hidden.pow(2).mean(-1, keepdim=True) + eps))).to(h.dtype)


def rmsnorm_power_minus_half(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * (variance + eps) ** -0.5`."""
    hidden = h.float()
    return weight * (hidden * (hidden.pow(2).mean(-1, keepdim=True) + eps) ** -0.5).to(h.dtype)


RMSNORMS: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "transformers": rmsnorm_transformers,
    "weight_on_right": rmsnorm_weight_on_right,
    "weight_in_fp32": rmsnorm_weight_in_fp32,
    "weight_in_fp32_left": rmsnorm_weight_in_fp32_left,
    "functional": rmsnorm_functional,
    "gpt_fast": rmsnorm_gpt_fast,
    "rsqrt_on_left": rmsnorm_rsqrt_on_left,
    "eps_first_square": rmsnorm_eps_first_square,
    "one_over_sqrt": rmsnorm_one_over_sqrt,
    "divide_by_sqrt": rmsnorm_divide_by_sqrt,
    "reciprocal_sqrt": rmsnorm_reciprocal_sqrt,
    "power_minus_half": rmsnorm_power_minus_half,
}
#: Spellings that use rsqrt, as the fused op does, and multiply by the weight after the cast back or
#: in float32 before it (the op is told which): bit-identical to it in every dtype.
SAME_ROUNDING = ("transformers", "weight_on_right", "gpt_fast", "rsqrt_on_left", "eps_first_square", "weight_in_fp32",
                 "weight_in_fp32_left", "functional")

# ---------------------------------------------------------------- all-reduce as users write it


def funcol_all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Functional collective (what `ParallelContext.all_reduce` uses)."""
    return funcol.all_reduce(x, "sum", group)


def inplace_all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """In-place `torch.distributed.all_reduce` on an intermediate (dynamo remaps it)."""
    dist.all_reduce(x, group=group)
    return x


#: eps of each norm site of `toy_decoder`, all different so each site must keep its own.
DECODER_EPS = (1e-6, 1e-5, 2e-6, 3e-5)


def toy_decoder(
    embed_partial: torch.Tensor,
    w_attn: torch.Tensor,
    w_mlp: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
) -> torch.Tensor:
    """Four fusible sites: 1 without residual (embedding) and 3 with (both `+` orders, both spellings)."""
    h = funcol_all_reduce(embed_partial, group)  # vocab-parallel embedding
    n = norm(h, norm_weight, DECODER_EPS[0])  # pattern 2; h is the first residual
    h = funcol_all_reduce(n @ w_attn, group) + h  # attention: reduced + residual
    n = norm(h, norm_weight, DECODER_EPS[1])
    h = h + inplace_all_reduce(n @ w_mlp, group)  # MLP, in-place spelling: residual + reduced
    n = norm(h, norm_weight, DECODER_EPS[2])  # next layer's input norm
    h = inplace_all_reduce(n @ w_attn, group) + h  # last layer: h feeds only the final norm
    return norm(h, norm_weight, DECODER_EPS[3])


def decoder_inputs(dtype: torch.dtype, tokens: int = 5, hidden: int = 32, seed: int = 0) -> list[torch.Tensor]:
    """Inputs of `toy_decoder` (different per `seed`, i.e. per rank, except the norm weight)."""
    gen = torch.Generator().manual_seed(seed)
    norm_weight = 1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(1234))
    return [
        torch.randn(tokens, hidden, generator=gen).to(dtype),
        (torch.randn(hidden, hidden, generator=gen) / hidden**0.5).to(dtype),
        (torch.randn(hidden, hidden, generator=gen) / hidden**0.5).to(dtype),
        norm_weight.to(dtype),
    ]


def deepseek_moe_block(
    x: torch.Tensor,
    residual: torch.Tensor,
    w_routed: torch.Tensor,
    w_shared: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek official style: routed and shared experts each all-reduce, then residual + norm."""
    routed = funcol_all_reduce(x @ w_routed, group)
    shared = funcol_all_reduce(x @ w_shared, group)
    h = residual + (routed + shared)
    return rmsnorm_transformers(h, norm_weight, 1e-6), h


# ---------------------------------------------------------------- process groups and compiling


@contextlib.contextmanager
def fake_process_group(world_size: int = 2) -> Iterator[dist.ProcessGroup]:
    """A fake (single-process, no communication) default group, for graph-shape-only tests."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def compile_and_run(fn: Callable, *args, backend: FxfuseBackend | None = None, **compile_kwargs):
    """`torch.compile(fn, backend=..., fullgraph=True)(*args)` without grad; returns (backend, output).

    The backend defaults to `FxfuseBackend(inner="eager")`; dynamo's caches are reset first so each
    call compiles afresh.
    """
    backend = backend if backend is not None else FxfuseBackend(inner="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        output = torch.compile(fn, backend=backend, fullgraph=True, **compile_kwargs)(*args)
    return backend, output


class GraphCapture(FxfuseBackend):
    """An eager `FxfuseBackend` that also keeps each post-grad GraphModule after its passes ran.

    With `patterns=()` no pass runs, so `graphs` holds what the passes would be given; pass-level
    tests then call the passes themselves.
    """

    def __init__(self, patterns=(), fuse_without_fast_kernel: bool = False) -> None:
        super().__init__(inner="eager", patterns=patterns, fuse_without_fast_kernel=fuse_without_fast_kernel)
        self.graphs: list[torch.fx.GraphModule] = []

    def rewrite(self, graph: torch.fx.Graph):
        decisions = super().rewrite(graph)
        self.graphs.append(graph.owning_module)
        self.site_decisions = decisions  # of the last graph
        return decisions


def post_grad_graph(fn: Callable, *args, **compile_kwargs) -> torch.fx.GraphModule:
    """The (single) post-grad graph the fxfuse passes are given for `fn(*args)` (fullgraph compile)."""
    capture, _ = compile_and_run(fn, *args, backend=GraphCapture(), **compile_kwargs)
    (graph,) = capture.graphs
    return graph
