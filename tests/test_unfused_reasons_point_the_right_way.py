"""Reasons a user reads for a site left unfused, each pointing at what is in the way (issue 41, items 1 and 7):
an RMSNorm that multiplies in its weight first (`w * h * rsqrt(...)` and its other orders) says so and how to
write it, where it used to say that no RMSNorm follows; the advice to compile the whole stack as one graph is
not given to a function compiled with fullgraph=True; an in-place all_reduce of a graph input says it writes
the input back; an int8 quantization after the norm says that only FP8 e4m3 quantizations fold. The orders
the fused op computes still fuse. Single process, fake process group, the eager inner compiler."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from toy_graphs import GraphCapture, fake_process_group

from fxfuse.passes.config import FAST_ALLREDUCE, PATTERNS

H = 64
EPS = 1e-6


def _inverse_rms(h):
    return torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)


#: The orders of `x * rsqrt(...) * w` people write: the fused op computes `(x * r) * w` (and `r * x * w` is the
#: same product in float32: multiplication commutes); the others round differently.
ORDERS = {
    "w * h * r": (lambda h, w: w * h * _inverse_rms(h), False),
    "(w * h) * r": (lambda h, w: (w * h) * _inverse_rms(h), False),
    "h * (w * r)": (lambda h, w: h * (w * _inverse_rms(h)), False),
    "r * h * w": (lambda h, w: _inverse_rms(h) * h * w, True),
    "h * r * w": (lambda h, w: h * _inverse_rms(h) * w, True),
}


def _decisions(fn, *inputs, fullgraph=True, patterns=PATTERNS):
    """The site decisions of the one graph `fn` compiles to (its reasons computed during the compile)."""
    backend = GraphCapture(patterns=patterns)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=fullgraph)(*inputs)
    return backend.site_decisions


def _inputs(dtype=torch.float32):
    return torch.randn(4, H, dtype=dtype), torch.randn(4, H, dtype=dtype), torch.randn(H, dtype=dtype)


@pytest.mark.parametrize("order", ORDERS)
def test_each_order_of_the_weight_fuses_or_says_how_to_write_it(order):
    norm, fuses = ORDERS[order]
    with fake_process_group() as group:
        def site(y, r, w):
            h = funcol.all_reduce(y, "sum", group.group_name) + r
            return norm(h, w), h

        (decision,) = _decisions(site, *_inputs())
    if fuses:
        assert decision.fused_into is not None and decision.reason is None
    else:
        assert decision.fused_into is None
        assert decision.reason.startswith("the RMSNorm of `add` multiplies its weight in another order than "
                                          "`(x * rsqrt(mean(x**2) + eps)) * weight`"), decision.reason
        assert "write the norm `x * rsqrt(...) * weight`" in decision.reason
        assert "no RMSNorm follows" not in decision.reason


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks_allowed"])
def test_the_whole_stack_advice_is_not_given_to_a_fullgraph_compile(fullgraph):
    with fake_process_group() as group:
        def block(y, r):  # the sum leaves the function: a norm could only be in another compiled function
            return funcol.all_reduce(y, "sum", group.group_name) + r

        (decision,) = _decisions(block, *_inputs()[:2], fullgraph=fullgraph)
    if fullgraph:
        assert "no RMSNorm follows it here (the function was compiled with fullgraph=True): where a function compiled " \
            "apart applies the RMSNorm" in decision.reason
        assert "compile the whole stack as one graph" not in decision.reason
    else:
        assert decision.reason.endswith("compile the whole stack as one graph")


def test_an_in_place_all_reduce_of_an_input_says_it_writes_the_input_back():
    with fake_process_group():
        def site(y, r, w):
            dist.all_reduce(y)
            h = y + r
            c = h.float()
            return w * (c * _inverse_rms(c)).to(h.dtype), h

        (decision,) = _decisions(site, *_inputs())
    assert decision.reason.startswith("the all-reduce writes its result back into the graph input `arg0_1` (`copy_`: an "
                                      "in-place all_reduce of an input)"), decision.reason
    assert "also used apart from the residual add" not in decision.reason


def test_an_int8_quantization_says_only_fp8_e4m3_folds():
    with fake_process_group() as group:
        def site(y, r, w):
            h = funcol.all_reduce(y, "sum", group.group_name) + r
            c = h.float()
            n = w * (c * _inverse_rms(c)).to(h.dtype)
            scale = n.abs().amax(-1, keepdim=True) / 127
            return (n / scale).round().clamp(-128, 127).to(torch.int8), scale, h

        inputs = _inputs(torch.bfloat16)
        (tier_b,) = _decisions(site, *inputs)
        (fused,) = _decisions(site, *inputs, patterns=[p for p in PATTERNS if p != FAST_ALLREDUCE])
    assert "the quantization casts to torch.int8, not float8_e4m3fn: only FP8 e4m3 quantizations fold" in tier_b.reason
    assert "`abs" not in tier_b.reason
    assert fused.fused_into is not None  # without tier (b) the site stays fused, its quantization after it
