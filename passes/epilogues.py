"""Does anything read a fused site's norm output that Inductor would have fused into the norm's kernel?

When the norm stays in Inductor's hands, Inductor fuses the pointwise code after it (a cast, a scale, a
clamp, an FP8 quantization, a second norm) into the kernel that computes the norm. The opaque fused op
takes that fusion away: its norm output goes to memory and every such reader runs as a kernel of its
own. `fusing_reader(value)` finds such a reader, looking through views (which move no data), or
returns None when every reader is one that reads the value from memory anyway: a GEMM
(`NON_FUSING_ATEN`), an op Inductor calls as an extern kernel (anything outside the aten and prims
namespaces: collectives, custom ops, fxfuse's own ops, Triton kernel wrappers) or the graph's output.
Unknown aten ops count as fusing: putting a site in tier (b) when unsure costs nothing against Inductor.
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

#: aten ops Inductor lowers to extern kernels (GEMMs, convolutions): they read their inputs from memory.
NON_FUSING_ATEN = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._scaled_mm.default,
    aten._int_mm.default, aten.convolution.default, aten._weight_int8pack_mm.default,
})
#: Reads of a tensor's metadata, not of its values.
METADATA_READS = frozenset({aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default})
#: Namespaces whose ops Inductor may generate code for (and so fuse with what feeds them).
CODEGEN_NAMESPACES = ("aten", "prims")


def fusing_reader(value: torch.fx.Node, skip: Collection[torch.fx.Node] = frozenset()) -> torch.fx.Node | None:
    """The first node reading `value`, looking through views, that Inductor could fuse into the kernel
    computing `value`, other than those in `skip`; None if there is none."""
    pending = list(value.users)
    seen: set[torch.fx.Node] = set(skip)
    while pending:
        node = pending.pop(0)
        if node in seen:
            continue
        seen.add(node)
        if is_view(node):
            pending.extend(node.users)
        elif node.target is CAST and fusing_reader(node) is None:
            continue  # a cast only GEMMs read (DeepSeek-V3's float32 MoE gate input): kept with its GEMM
        elif fuses_its_inputs(node):
            return node
    return None


def fuses_its_inputs(node: torch.fx.Node) -> bool:
    """Whether Inductor may fuse `node` with the kernel producing its inputs (False for the graph's output,
    GEMMs and extern kernels)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target in NON_FUSING_ATEN or target in METADATA_READS:
        return False
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace in CODEGEN_NAMESPACES
    return not isinstance(target, torch._ops.HigherOrderOperator)  # Python callables: operator.getitem etc.



def describe(node: torch.fx.Node) -> str:
    """`node` in a reason: its name and op (`convert_element_type_3` (prims.convert_element_type))."""
    target = node.target
    name = target.name() if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))
    return f"`{node.name}` ({name.replace('::', '.')})"
