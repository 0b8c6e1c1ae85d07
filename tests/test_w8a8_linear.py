"""The w8a8 dense linear on CPU: per-token-group FP8 activation quantization in plain torch ops outside the GEMM
op, then `fxfuse_quant::fp8_linear_quantized`.

- `reference.quantize_activations` equals an independent loop over rows and groups, bit for bit, with
  and without a ragged last group;
- a w8a8 `QuantizableLinear` gives exactly `fp8_linear_reference(x, ..., "w8a8")` (what the opaque op
  computed before the split), also when handed its input already quantized (`quantize_input`); w8a16
  exactly `fp8_linear_reference(x, ..., "w8a16")`;
- the op's fake kernel and CPU kernel agree under `torch.library.opcheck`'s fake-tensor and AOT checks;
- compiled (fxfuse, eager inner, one process), a SwiGLU MLP of w8a8 linears has its quantizations as
  plain ops in the graph, one per distinct input (gate and up share theirs), and gives the eager
  output bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from fxfuse.models.fp8 import FP8_DTYPE, FP8_MAX, quantize_blocks
from fxfuse.models.layers import ReplicatedLinear
from fxfuse.models.quant import reference
from fxfuse.models.quant.scheme import QuantScheme

BLOCK = (16, 16)
W8A8 = QuantScheme("fp8", fp8_block=BLOCK, fp8_gemm="w8a8")


def independent_quantization(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and group of `group` columns: scale = max(max |x|, 1e-12) / 448, q = e4m3(clamp(x / scale))."""
    rows, cols = x.shape
    quantized = torch.empty(rows, cols, dtype=FP8_DTYPE)
    scale = torch.empty(rows, -(-cols // group))
    for row in range(rows):
        for g, start in enumerate(range(0, cols, group)):
            values = x[row, start:start + group].float()
            scale[row, g] = max(float(values.abs().max()), 1e-12) / FP8_MAX
            quantized[row, start:start + group] = (values / scale[row, g]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


@pytest.mark.parametrize("cols", [48, 40])  # whole groups; a ragged last group (padded inside)
def test_activation_quantization_is_per_token_group(cols):
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(cols)) * torch.logspace(-2, 2, cols)
    x[1, :16] = 0  # an all-zero group: the smallest scale
    quantized, scale = reference.quantize_activations(x.bfloat16(), 16)
    expected_quantized, expected_scale = independent_quantization(x.bfloat16(), 16)
    assert quantized.shape == (5, cols) and scale.shape == (5, 3)
    assert torch.equal(quantized.view(torch.uint8), expected_quantized.view(torch.uint8))
    assert torch.equal(scale, expected_scale)


def fill_random_fp8(linear: ReplicatedLinear, seed: int) -> None:
    """Random block-quantized weights into an FP8 linear."""
    weight, scale_inv = quantize_blocks(torch.randn(linear.weight.shape, generator=torch.Generator().manual_seed(seed)), BLOCK)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.weight_scale_inv.copy_(scale_inv)


def fp8_linear_module(out_features: int, in_features: int, scheme: QuantScheme) -> ReplicatedLinear:
    """A replicated FP8 linear of `scheme` with random block-quantized weights."""
    linear = ReplicatedLinear(in_features, out_features, dtype=torch.bfloat16, quant=scheme)
    fill_random_fp8(linear, 0)
    return linear


@pytest.mark.parametrize("gemm", ["w8a16", "w8a8"])
def test_linear_is_the_dequantizing_reference_bit_for_bit(gemm):
    linear = fp8_linear_module(40, 48, QuantScheme("fp8", fp8_block=BLOCK, fp8_gemm=gemm))
    x = torch.randn(2, 3, 48, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected = reference.fp8_linear_reference(x, linear.weight, linear.weight_scale_inv, BLOCK, gemm)
    out = linear(x)
    assert out.shape == (2, 3, 40) and out.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    shared = linear.quantize_input(x)
    assert (shared is None) == (gemm == "w8a16")
    assert torch.equal(linear(x, shared), expected)


def test_quantized_op_passes_opcheck():
    linear = fp8_linear_module(40, 48, W8A8)
    quantized, scale = reference.quantize_activations(torch.randn(7, 48, generator=torch.Generator().manual_seed(2)), 16)
    args = (quantized, scale, linear.weight, linear.weight_scale_inv, *BLOCK, torch.bfloat16)
    # test_schema multiplies the inputs to look for mutation, which float8 tensors cannot do on CPU
    torch.library.opcheck(torch.ops.fxfuse_quant.fp8_linear_quantized.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic"))
    out = torch.ops.fxfuse_quant.fp8_linear_quantized(*args)
    assert out.shape == (7, 40) and out.dtype == torch.bfloat16


def test_compiled_mlp_quantizes_each_input_once_in_the_graph():
    from fxfuse.backend import FxfuseBackend
    from fxfuse.models.mlp import ParallelGatedMLP
    from fxfuse.models.parallel import ParallelContext

    mlp = ParallelGatedMLP(48, 64, ParallelContext(), what="intermediate_size", dtype=torch.bfloat16, quant=W8A8)
    for seed, linear in enumerate((mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        fill_random_fp8(linear, seed)
    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(3)).bfloat16()
    backend = FxfuseBackend(inner="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(mlp, backend=backend, fullgraph=True, dynamic=True)(x)
        eager = mlp(x)
    torch._dynamo.reset()
    counts = backend.records[0].before.op_counts
    # gate and up share one quantization of x; down has its own of the hidden state
    assert counts["fxfuse_quant.fp8_linear_quantized"] == 3 and counts["aten.amax"] == 2, counts
    assert counts["fxfuse_quant.fp8_linear"] == 0
    assert torch.equal(compiled, eager)


def test_eager_w8a8_model_gives_the_logits_of_the_in_op_quantization(monkeypatch):
    """The tiny quantized model, eager at tp=1: bit for bit the logits of every FP8 linear computing
    `fp8_linear_reference(x, ..., "w8a8")` in one piece (the CPU arithmetic of the op before the split)."""
    from quant_helpers import FP8_W8A8, TINY_ALIGNED, float_state
    from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
    from fxfuse.models.layers import QuantizableLinear
    from fxfuse.models.parallel import ParallelContext
    from fxfuse.models.quant.checkpoint import quantize_state_dict
    from fxfuse.models.weights import DictSource, load_weights

    model = DeepseekV3ForCausalLM(TINY_ALIGNED, ParallelContext(), dtype=torch.bfloat16, max_batch=2, max_seq_len=8, quant=FP8_W8A8)
    load_weights(model, DictSource(quantize_state_dict(float_state(), FP8_W8A8), config=FP8_W8A8.checkpoint_config()), ParallelContext())
    ids = torch.randint(TINY_ALIGNED.vocab_size, (2, 6), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(6).expand(2, -1)
    with torch.no_grad():
        split = model.eval()(ids, positions)

        def in_one_piece(self, x, quantized=None):
            if self.fp8_block is None:
                return torch.nn.functional.linear(x, self.weight)
            return reference.fp8_linear_reference(x, self.weight, self.weight_scale_inv, self.fp8_block, "w8a8")

        monkeypatch.setattr(QuantizableLinear, "forward", in_one_piece)
        model.reset_cache()
        whole = model(ids, positions)
    assert torch.equal(split, whole)
