"""The weight a fused op reads: a float32 weight built from the model's 16-bit one, taken apart.

A norm that applies its weight in float32 (`weight_in_fp32`) often builds that float32 weight in the
graph from the model's parameter: `w.float()` (`F.rms_norm`, a float32 residual stream's norm) or
Gemma's zero-centred `1.0 + w.float()`. The op computes exactly `weight.float() + weight_offset` in
float32 itself, so it can read `w` with the offset instead: the same values, and a 16-bit weight is
what FlashInfer's TensorRT-LLM kernel takes (a float32 weight leaves a site the PCIe or NCCL path).
"""

from __future__ import annotations

import torch
import torch.fx

from fxfuse.passes.canonical_form import ADD, ADD_SCALAR, HALF_DTYPES, is_call, is_upcast, scales, val

#: Positions of the fused op's norm arguments.
WEIGHT, WEIGHT_OFFSET, WEIGHT_IN_FP32 = 2, 5, 6


def take_weight_apart(op: torch.fx.Node) -> bool:
    """Make a fused op `op` that applies a float32 weight `w.float()` or `w.float() + c` (c a Python
    number) read the 16-bit `w` (x's dtype) with `weight_offset=c`, dropping the nodes that built the
    float32 weight when nothing else reads them; returns whether it changed."""
    if len(op.args) <= WEIGHT_IN_FP32 or op.args[WEIGHT_IN_FP32] is not True or op.args[WEIGHT_OFFSET] != 0.0:
        return False
    found = _parameter_and_offset(op.args[WEIGHT])
    x = val(op.args[0])
    if found is None or x is None or val(found[0]).dtype != x.dtype or x.dtype not in HALF_DTYPES:
        return False
    weight, offset = found
    built = op.args[WEIGHT]
    args = list(op.args)
    args[WEIGHT], args[WEIGHT_OFFSET] = weight, offset
    op.args = tuple(args)
    for node in (built, *built.all_input_nodes):  # the float32 weight's nodes, now read by nothing
        if node is not weight and not node.users:
            op.graph.erase_node(node)
    return True


def _parameter_and_offset(weight: object) -> tuple[torch.fx.Node, float] | None:
    """(w, c) for a `w.to(float32)` (c = 0) or `w.to(float32) + c` node, w 16-bit; None otherwise."""
    if is_upcast(weight):
        return weight.args[0], 0.0
    if not (is_call(weight, ADD) or is_call(weight, ADD_SCALAR)) or scales(weight) or len(weight.args) != 2:
        return None
    first, second = weight.args
    upcast, offset = (first, second) if is_upcast(first) else (second, first)
    if not is_upcast(upcast) or isinstance(offset, bool) or not isinstance(offset, (int, float)):
        return None
    return upcast.args[0], float(offset)
