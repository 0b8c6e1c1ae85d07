"""The norm spellings of issue 24 through the passes: Gemma's zero-centred `(1 + w)`, a weight applied in
float32 (`F.rms_norm`, `w.float()`, a float32 weight), a 16-bit value times a float32 inverse root, and a
float32 residual stream with 16-bit activations. Each is fused with exact counts and the op's norm
arguments checked, and equals eager bit for bit; what stays unfused has its exact reason.

Single process with a fake process group (its all-reduce returns the input unchanged), so a compiled
program must equal eager exactly; every compile goes through `OrderCheckedBackend` (collective order).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from collective_order import compiled_like_eager
from toy_graphs import fake_process_group
from toy_graphs import funcol_all_reduce as ar

from fxfuse.op.all_reduce_schema import all_reduce
from fxfuse.op.schema import NORM_OPS
from fxfuse.passes.config import PassConfig
from fxfuse.passes.unfused_reasons import explain_unfused

ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
H = 32
EPS = 1e-6
HALF_DTYPES = (torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def group():
    with fake_process_group() as world:
        yield world


def statistic(c: torch.Tensor) -> torch.Tensor:
    """`rsqrt(mean(c**2) + eps)` over the hidden dimension."""
    return torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + EPS)


def gemma_norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """transformers' Gemma3RMSNorm.forward."""
    x = h.float()
    output = x * statistic(x)
    output = output * (1.0 + w.float())
    return output.type_as(h)


def weight_cast_first(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The weight cast to float32 and applied before the one cast back."""
    x = h.float()
    return (x * statistic(x) * w.float()).to(h.dtype)


def functional(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(h, (H,), w, EPS)


def promoted(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A 16-bit value times a float32 inverse root (type promotion upcasts it), cast back, times w."""
    return (h * statistic(h.float())).to(h.dtype) * w


def promoted_weight_left(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (statistic(h.float()) * h).type_as(h)


def compiled(fn, *args, fused: int):
    """`compiled_like_eager` (collective order checked, outputs equal to eager exactly), then the rewritten
    graph and its fused op nodes."""
    gm = compiled_like_eager(fn, *args, fused=fused)
    return gm, [node for node in gm.graph.nodes if node.op == "call_function" and node.target in NORM_OPS]


def norm_arguments(node: torch.fx.Node) -> tuple:
    """(weight node, weight_offset, weight_in_fp32) of a fused op node."""
    defaults = (0.0, False)
    extra = tuple(node.args[5:7]) + defaults[len(node.args[5:7]):]
    return (node.args[2], *extra)


def reasons(gm) -> list[str]:
    return [explain_unfused(node, PassConfig()) for node in gm.graph.find_nodes(op="call_function", target=ALL_REDUCE)]


def half_inputs(dtype, *, weight_dtype=None, residual_dtype=None, tokens=5):
    g = torch.Generator().manual_seed(0)
    y = torch.randn(tokens, H, generator=g).to(dtype)
    r = torch.randn(tokens, H, generator=g).to(residual_dtype or dtype)
    w = (0.1 * torch.randn(H, generator=g)).to(weight_dtype or dtype)
    return y, r, w


# ---------------------------------------------------------------- the weight applied in float32


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "plain"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_gemma_norm_fuses_with_its_offset(group, dtype, with_residual):
    """`(normed * (1.0 + w.float())).type_as(x)`: the op takes Gemma's own weight with offset 1 in float32."""

    def site(y, r, w):
        h = ar(y, group) + r if with_residual else ar(y, group)
        return gemma_norm(h, w), h

    _, (op,) = compiled(site, *half_inputs(dtype), fused=1)
    weight, offset, in_fp32 = norm_arguments(op)
    assert (weight.op, weight.meta["val"].dtype, offset, in_fp32) == ("placeholder", dtype, 1.0, True)


def test_gemma_norm_in_float32_fuses(group):
    def site(y, r, w):
        h = ar(y, group) + r
        return gemma_norm(h, w), h

    compiled(site, *half_inputs(torch.float32), fused=1)


@pytest.mark.parametrize("norm", [weight_cast_first, functional], ids=["weight_cast_first", "F.rms_norm"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_a_16bit_weight_applied_in_float32(group, dtype, norm):
    """The op applies the weight in float32 before its one cast, as `F.rms_norm` does: bit for bit."""

    def site(y, r, w):
        h = ar(y, group) + r
        return norm(h, w), h

    _, (op,) = compiled(site, *half_inputs(dtype), fused=1)
    weight, offset, in_fp32 = norm_arguments(op)
    assert (weight.op, offset, in_fp32) == ("placeholder", 0.0, True)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_a_float32_weight_with_16bit_activations(group, dtype):
    def site(y, r, w32):
        h = ar(y, group) + r
        c = h.float()
        return (c * statistic(c) * w32).to(h.dtype), h

    inputs = half_inputs(dtype, weight_dtype=torch.float32)
    _, (op,) = compiled(site, *inputs, fused=1)
    weight, offset, in_fp32 = norm_arguments(op)
    assert (weight.meta["val"].dtype, offset, in_fp32) == (torch.float32, 0.0, True)


def test_a_16bit_weight_plus_a_tensor_offset_stays_a_float32_weight(group):
    """`w.float() + t` (t a tensor): no scalar offset to peel, the float32 sum is the weight."""

    def site(y, r, w, t):
        h = ar(y, group) + r
        c = h.float()
        return (c * statistic(c) * (w.float() + t)).to(h.dtype), h

    _, (op,) = compiled(site, *half_inputs(torch.bfloat16), torch.tensor(1.0), fused=1)
    weight, offset, in_fp32 = norm_arguments(op)
    assert (weight.meta["val"].dtype, offset, in_fp32) == (torch.float32, 0.0, True)


# ---------------------------------------------------------------- a 16-bit value times a float32 root


@pytest.mark.parametrize("norm", [promoted, promoted_weight_left], ids=["weight_right", "weight_left"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_a_16bit_value_times_a_float32_inverse_root(group, dtype, norm):
    """`x * rsqrt(x.float()...)`: type promotion upcasts x exactly, the canonical spelling's math."""

    def site(y, r, w):
        h = ar(y, group) + r
        return norm(h, w), h

    _, (op,) = compiled(site, *half_inputs(dtype), fused=1)
    assert norm_arguments(op)[1:] == (0.0, False)


# ---------------------------------------------------------------- a float32 residual stream


def fp32_stream_norm(h32: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (h32 * statistic(h32) * w.float()).to(dtype)


@pytest.mark.parametrize("residual_first", [False, True], ids=["reduced_first", "residual_first"])
@pytest.mark.parametrize("weight_dtype", [None, torch.float32], ids=["weight_16bit", "weight_fp32"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_a_float32_residual_stream(group, dtype, weight_dtype, residual_first):
    """`ar(y).float() + r32 -> norm in float32 -> cast`: the op takes the float32 residual, returns it."""

    def layer(y, r32, w):
        reduced = ar(y, group).float()
        h32 = r32 + reduced if residual_first else reduced + r32
        return fp32_stream_norm(h32, w, y.dtype), h32

    inputs = half_inputs(dtype, weight_dtype=weight_dtype, residual_dtype=torch.float32)
    _, (op,) = compiled(layer, *inputs, fused=1)
    assert op.args[1].op == "placeholder" and op.args[1].meta["val"].dtype == torch.float32
    assert norm_arguments(op)[1:] == (0.0, True)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_a_float32_residual_added_by_type_promotion(group, dtype):
    """`ar(y) + r32` without `.float()`: promotion converts the sum exactly, as the explicit upcast does."""

    def layer(y, r32, w):
        h32 = ar(y, group) + r32
        return fp32_stream_norm(h32, w, y.dtype), h32

    _, (op,) = compiled(layer, *half_inputs(dtype, residual_dtype=torch.float32), fused=1)
    assert norm_arguments(op)[1:] == (0.0, True)


def test_two_layers_of_a_float32_residual_stream(group):
    """The residual out of one fused site is the next one's float32 residual."""

    def two_layers(y1, y2, r32, w1, w2):
        h = ar(y1, group).float() + r32
        n1 = fp32_stream_norm(h, w1, torch.bfloat16)
        h = ar(y2 + n1, group).float() + h
        return fp32_stream_norm(h, w2, torch.bfloat16), h

    y1, r32, w1 = half_inputs(torch.bfloat16, residual_dtype=torch.float32)
    y2, _, w2 = half_inputs(torch.bfloat16)
    # the first norm feeds an add Inductor fuses into it: that site is in tier (b), its add and norm Inductor's
    gm, _ = compiled(two_layers, y1, y2, r32, w1, w2, fused=1)
    assert len(gm.graph.find_nodes(op="call_function", target=all_reduce)) == 1


# ---------------------------------------------------------------- what stays unfused, and why


def test_a_norm_cast_to_another_dtype_is_not_fused(group):
    """The norm's result cast to float16 from bfloat16 activations: the op returns bfloat16."""

    def site(y, r, w):
        h = ar(y, group) + r
        c = h.float()
        return (c * statistic(c) * w).to(torch.float16), h

    gm, _ = compiled(site, *half_inputs(torch.bfloat16), fused=0)
    assert reasons(gm) == ["the RMSNorm's result is float16, not the all-reduced bfloat16 the fused op returns"]


def test_a_float32_stream_norm_left_in_float32_is_not_fused(group):
    def layer(y, r32, w32):
        h32 = ar(y, group).float() + r32
        return h32 * statistic(h32) * w32, h32

    gm, _ = compiled(layer, *half_inputs(torch.bfloat16, weight_dtype=torch.float32, residual_dtype=torch.float32),
                     fused=0)
    assert reasons(gm) == ["the RMSNorm's result is float32, not the all-reduced bfloat16 the fused op returns"]


def test_a_scaled_sum_before_the_norm_is_not_fused(group):
    """Gemma's scaled embedding, vocab-parallel: `ar(e) * sqrt(hidden)` before the first norm."""

    def embedding(e, w, scale):
        h = ar(e, group) * scale.to(e.dtype)
        return gemma_norm(h, w), h

    gm, _ = compiled(embedding, *half_inputs(torch.bfloat16)[::2], torch.tensor(H**0.5), fused=0)
    (reason,) = reasons(gm)
    assert re.fullmatch(r"`mul\w*` scales the all-reduced value before the RMSNorm: the fused op norms the sum "
                        r"itself \(scaling each rank's part before the all-reduce would round differently\)", reason), reason


def test_a_sum_cast_to_another_16bit_dtype_before_the_add_is_not_fused(group):
    def site(y, r16, w16):
        h = ar(y, group).to(torch.float16) + r16
        c = h.float()
        return (c * statistic(c)).to(h.dtype) * w16, h

    y, _, _ = half_inputs(torch.bfloat16)
    _, r16, w16 = half_inputs(torch.float16)
    gm, _ = compiled(site, y, r16, w16, fused=0)
    assert reasons(gm) == [
        "the all-reduced value (bfloat16) is cast to float16 by `convert_element_type` before the residual add: the "
        "fused op adds in the all-reduced dtype, or in float32 (a float32 residual stream of 16-bit activations)"]


def test_a_float64_residual_stream_is_not_fused(group):
    """The pattern's upcast matches a cast to any dtype: a float64 stream must not pass for a float32 one."""

    def layer(y, r32, w32):
        h = ar(y, group).double() + r32
        return (h * statistic(h) * w32).to(y.dtype), h

    gm, _ = compiled(layer, *half_inputs(torch.bfloat16, weight_dtype=torch.float32, residual_dtype=torch.float32),
                     fused=0)
    assert reasons(gm) == [
        "the all-reduced value (bfloat16) is cast to float64 by `convert_element_type` before the residual add: the "
        "fused op adds in the all-reduced dtype, or in float32 (a float32 residual stream of 16-bit activations)"]
