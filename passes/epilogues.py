"""Does anything read a fused site's norm output that Inductor would have fused into the norm's kernel?

When the norm stays in Inductor's hands, Inductor fuses the pointwise code after it (a cast, a scale, a
clamp, an FP8 quantization, a second norm) into the kernel that computes the norm. The opaque fused op
takes that fusion away: its norm output goes to memory and every such reader runs as a kernel of its
own. `fusing_reader(value)` finds such a reader, looking through views (which move no data), or
returns None when none exists. Inductor fuses a pointwise reader (a cast, a scale, a clamp, an add, a
quantization's division) or a reduction (an amax, a second norm's mean) into the norm's kernel, whatever
else reads the norm: the ops' `pointwise` and `reduction` tags say which ops those are. A reader that picks
elements by index (a MoE block's gather of the norm's rows for its experts, `aten.index`) is fused only
by inlining the norm into it, which Inductor does only when nothing needs the norm's values in memory:
with a GEMM, an extern kernel (collectives, custom ops, fxfuse's own ops, Triton kernel wrappers) or the
graph's output also reading them, the gather runs as a kernel of its own in both tiers (checked on
Inductor's generated code), so a MoE block's norm, which its router's GEMM reads, stays in tier (a).
A dtype cast whose own readers are all non-fusing (a float32 copy for a GEMM, as DeepSeek-V3's MoE gate
reads the norm) is not counted: in tier (a) it is one more kernel, as Inductor's norm kernel writes one more
output in tier (b); whether (b) wins there on NCCL and PCIe plans is not measured yet.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.fx

from fxfuse.passes.pattern_support import is_view

aten = torch.ops.aten
CAST = torch.ops.prims.convert_element_type.default

#: Op tags of the code Inductor fuses into the kernel producing its input.
FUSING_TAGS = frozenset({torch.Tag.pointwise, torch.Tag.reduction})
#: Untagged ops that are pointwise all the same (a dtype conversion before decomposition).
UNTAGGED_POINTWISE = frozenset({aten._to_copy.default})
#: aten ops Inductor lowers to extern kernels (GEMMs, convolutions): they read their inputs from memory.
EXTERN_ATEN = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._scaled_mm.default,
    aten._int_mm.default, aten.convolution.default, aten._weight_int8pack_mm.default,
})
#: Reads of a tensor's metadata, not of its values.
METADATA_READS = frozenset({aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default})
#: Namespaces whose ops Inductor generates code for.
CODEGEN_NAMESPACES = ("aten", "prims")


def fusing_reader(value: torch.fx.Node, skip: Collection[torch.fx.Node] = frozenset()) -> torch.fx.Node | None:
    """The first node reading `value`, looking through views, that Inductor could fuse into the kernel
    computing `value`, other than those in `skip`; None if there is none."""
    inlining = None  # the first reader that picks elements by index
    materialized = False  # whether something needs `value` in memory
    for node in _value_readers(value, skip):
        if node.target in METADATA_READS:
            continue
        if node.target is CAST and fusing_reader(node) is None:
            materialized = True  # a cast only GEMMs read (DeepSeek-V3's float32 MoE gate input): kept with its GEMM
        elif fuses_its_inputs(node):
            return node
        elif reads_from_memory(node):
            materialized = True
        elif inlining is None:
            inlining = node
    return None if materialized else inlining


def _value_readers(value: torch.fx.Node, skip: Collection[torch.fx.Node]) -> list[torch.fx.Node]:
    """The nodes reading `value` other than views, and those reading its views, except `skip`."""
    readers, pending, seen = [], list(value.users), set(skip)
    while pending:
        node = pending.pop(0)
        if node in seen:
            continue
        seen.add(node)
        if is_view(node):
            pending.extend(node.users)
        else:
            readers.append(node)
    return readers


def fuses_its_inputs(node: torch.fx.Node) -> bool:
    """Whether Inductor fuses `node` into the kernel producing its inputs whatever else reads them: a
    pointwise op or a reduction."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return target in UNTAGGED_POINTWISE or not FUSING_TAGS.isdisjoint(target.tags)


def reads_from_memory(node: torch.fx.Node) -> bool:
    """Whether `node` needs its inputs in memory: the graph's output, a GEMM, an extern kernel or any op
    Inductor does not generate code for."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return True
    return target in EXTERN_ATEN or target.namespace not in CODEGEN_NAMESPACES


def describe(node: torch.fx.Node) -> str:
    """`node` in a reason: its name and op (`convert_element_type_3` (prims.convert_element_type))."""
    target = node.target
    name = target.name() if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))
    return f"`{node.name}` ({name.replace('::', '.')})"
