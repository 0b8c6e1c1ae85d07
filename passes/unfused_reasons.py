"""Why a collective left in a rewritten graph was not fused: one sentence naming the node in the way.

`explain_unfused(node, config)` takes an `_c10d_functional.all_reduce` (or `reduce_scatter_tensor`) node
of a graph the passes have run on (so its chains are in canonical form, `canonical_form`) and finds,
in order: a reduction that is not a sum or not an all-reduce; for each RMSNorm that the all-reduced
value or an add of it feeds, the first thing that stops the fusion (a disabled pattern, an unmerged
second all-reduce, a norm not computed in float32 or without a weight, a `site_refusal` of dtype,
shape or eps, an intermediate value used outside the chain, such as the tensors a forward graph
compiled with grad enabled saves for backward); and where no RMSNorm follows, what stands between
the all-reduce and one (a reshape that changes the hidden dimension, a cast, the graph's end: the norm
is then in another compiled graph).

Where the passes know what would fuse the site, the sentence ends with it (`NO_GRAD_ADVICE`,
`WHOLE_STACK_ADVICE`, `FULLGRAPH_ADVICE`). `reason_kind(reason)` blanks the nodes a sentence names, so that the sites
of a graph blocked the same way can be counted together.
"""

from __future__ import annotations

import re

import torch
import torch.fx

from fxfuse.op.schema import FUSED_OPS
from fxfuse.passes.allreduce_rmsnorm_fusion import INPUT_ROLES, NormSpelling, enabled_patterns, site_blocker
from fxfuse.passes.canonical_form import (
    ADD,
    CAST,
    MEAN,
    MUL,
    POW,
    RSQRT,
    RMSNormNodes,
    canonicalize_norms,
    find_rmsnorm,
    is_call,
    is_last_dim_mean,
    is_reshape,
    is_same_shape_add,
    is_summed_wait,
    is_upcast,
    keeps_last_dim,
    starts_norm,
    val,
)
from fxfuse.passes.collective_placement import collective_between
from fxfuse.passes.config import ALLREDUCE_RESIDUAL_RMSNORM, ALLREDUCE_RMSNORM, MERGE_ALLREDUCE, PassConfig
from fxfuse.passes.pattern_support import WAIT_TENSOR, changing_keyword, op_name

REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
COPY_ = torch.ops.aten.copy_.default

#: Advice for a norm whose inside is a forward graph output because autograd saves it.
NO_GRAD_ADVICE = "compile under torch.no_grad() or torch.inference_mode()"
#: Advice for a norm that sits in the next compiled graph.
WHOLE_STACK_ADVICE = (
    "if the next compiled graph applies the RMSNorm (torch.compile on each decoder block, as torchtitan "
    "does), the norm is in another graph: compile the whole stack as one graph"
)
#: The same for a function compiled with fullgraph=True: it is one graph already, so the norm can only be in a
#: function compiled apart.
FULLGRAPH_ADVICE = (
    "where a function compiled apart applies the RMSNorm (torch.compile on each decoder block, as torchtitan does), "
    "compile the all-reduce and the norm in one function"
)


def explain_unfused(collective: torch.fx.Node, config: PassConfig) -> str:
    """Why `run` left this all-reduce (or reduce-scatter) node unfused, as one sentence."""
    if is_call(collective, REDUCE_SCATTER):
        return _reduce_scatter_reason(collective)
    reduce_op = collective.args[1]
    if reduce_op != "sum":
        return f"reduces with {reduce_op!r}, not a sum"
    waits = list(collective.users)
    if len(waits) != 1 or waits[0].target is not WAIT_TENSOR:
        return "its result is not read through one wait_tensor"
    if not enabled_patterns(config):
        return f"patterns {ALLREDUCE_RESIDUAL_RMSNORM} and {ALLREDUCE_RMSNORM} are disabled"
    reduced = waits[0]
    upcasts = [user for user in reduced.users if is_upcast(user, reduced)]
    adds = [(user, value) for value in [reduced, *upcasts] for user in value.users if is_call(user, ADD)]
    candidates = [(reduced, None, reduced)] + [(add, _other_operand(add, value), value) for add, value in adds]
    x_dtype = val(collective.args[0]).dtype if val(collective.args[0]) is not None else None
    for hidden, residual, read in candidates:
        norm = find_rmsnorm(hidden, x_dtype)
        if norm is not None:
            return _fusion_blocker(collective, reduced, norm, residual, config, read is not reduced)
    return _missing_norm_reason(reduced, [add for add, value in adds if value is reduced], config)


def _other_operand(add: torch.fx.Node, operand: torch.fx.Node):
    return add.args[1] if add.args[0] is operand else add.args[0]


def _fusion_blocker(all_reduce, reduced, norm: RMSNormNodes, residual, config: PassConfig, upcast: bool = False) -> str:
    """The first reason the site `all_reduce -> (upcast) -> (+ residual) -> norm` was not rewritten."""
    with_residual = norm.hidden is not reduced
    pattern = ALLREDUCE_RESIDUAL_RMSNORM if with_residual else ALLREDUCE_RMSNORM
    if not config.enabled(pattern):
        return f"pattern {pattern} is disabled"
    computed = val(norm.computed)
    if computed is not None and computed.dtype != torch.float32:
        return (f"the RMSNorm of `{norm.hidden.name}` computes in {_name(computed.dtype)}, not float32 (no upcast): "
                "the fused op's float32 norm would round differently")
    if norm.weight is None:
        return f"the RMSNorm `{norm.output.name}` has no weight (the fused op multiplies by one)"
    eps = norm.eps if isinstance(norm.eps, (int, float)) else val(norm.eps)
    spelling = NormSpelling(weight_in_fp32=norm.weight_in_fp32, float32_residual=upcast)
    dtypes = tuple(val(node).dtype if val(node) is not None else None for node in (norm.output, norm.hidden))
    site = sorted({all_reduce, reduced, norm.hidden, norm.output, *norm.inner})
    inputs = dict(zip(INPUT_ROLES, (residual, norm.weight, norm.eps)))
    refusal = site_blocker(all_reduce, site, inputs, eps, with_residual, spelling, dtypes,
                           None if config.fuse_without_fast_kernel else all_reduce.args[2])
    if refusal is not None:
        return refusal
    written_back = next((user for user in reduced.users if is_call(user, COPY_) and user.args[1] is reduced), None)
    if written_back is not None and written_back.args[0].op == "placeholder":
        return (f"the all-reduce writes its result back into the graph input `{written_back.args[0].name}` "
                f"(`{written_back.name}`: an in-place all_reduce of an input): the fused op returns the sum plus the "
                "residual and its norm, not the all-reduced value itself; all-reduce a tensor the function computes "
                "(as a row-parallel projection's output), which fuses")
    if with_residual and len(reduced.users) > 1:
        return "the all-reduced value is also used apart from the residual add"
    upcasts = [user for user in reduced.users if is_upcast(user, reduced)] if upcast else []
    inside = set(norm.inner) | {reduced, *upcasts}
    for node in ([reduced, *upcasts] if with_residual else []) + list(norm.inner):
        for user in node.users:
            if user not in inside and user is not norm.output and user is not norm.hidden:
                return _outside_use_reason(node, user)
    return (f"the all-reduce -> {'add -> ' if with_residual else ''}RMSNorm ending at `{norm.output.name}` "
            "matched no fusion pattern")


def _unmerged_reason(reduced, other_wait, add, config: PassConfig) -> str:
    """Why `add = reduced + other_wait` (two all-reduces, whose sum goes on to a residual add and an
    RMSNorm) was not merged into one all-reduce."""
    mine, theirs = reduced.args[0], other_wait.args[0]
    if not config.enabled(MERGE_ALLREDUCE):
        return f"it is added to another all-reduce (`{add.name}`) and pattern {MERGE_ALLREDUCE} is disabled"
    if mine.args[2] != theirs.args[2]:
        return (f"it is added (`{add.name}`) to an all-reduce over another group ({mine.args[2]!r} and "
                f"{theirs.args[2]!r}): only sums over one group merge")
    a, b = val(mine.args[0]), val(theirs.args[0])
    if a is not None and b is not None and a.dtype != b.dtype:
        return f"it is added (`{add.name}`) to an all-reduce of {_name(b.dtype)}, not {_name(a.dtype)}: no merge"
    if a is not None and b is not None and list(a.shape) != list(b.shape):
        return f"it is added (`{add.name}`) to an all-reduce of shape {list(b.shape)}, not {list(a.shape)}: no merge"
    keyword = changing_keyword([add])
    if keyword is not None:
        return f"it is added to another all-reduce by `{add.name}`, which is called with {keyword[1]}={keyword[2]}: no merge"
    between = collective_between(mine, theirs)
    if between is not None:
        return (f"it is added (`{add.name}`) to another all-reduce, and `{between.name}` is issued between the two: "
                "merging would change the order of collectives")
    return f"it is added (`{add.name}`) to another all-reduce whose result is also used elsewhere: no merge"


def _outside_use_reason(node: torch.fx.Node, user: torch.fx.Node) -> str:
    what = f"`{node.name}` ({op_name(node)}) inside the all-reduce -> RMSNorm chain"
    if user.op != "output":
        return f"{what} is also used by `{user.name}` ({op_name(user)})"
    training = _compiling_a_training_forward()
    if training:
        return f"{what} is saved for backward (grad is enabled): {NO_GRAD_ADVICE}"
    if training is None:
        return f"{what} is also a graph output (with grad enabled it is saved for backward: {NO_GRAD_ADVICE})"
    return f"{what} is also an output of the graph"


def _compiling_a_training_forward() -> bool | None:
    """True while AOT autograd compiles the forward of a training graph, False for an inference
    graph, None outside a compile (the graph alone does not say why it returns a value)."""
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    if metadata is None:
        return None
    return bool(getattr(metadata, "traced_tangents", None)) or getattr(metadata, "num_symints_saved_for_bw", None) is not None


def _missing_norm_reason(reduced: torch.fx.Node, adds: list[torch.fx.Node], config: PassConfig) -> str:
    """No RMSNorm reads the all-reduced value or an add of it: what stands in the way, if anything."""
    for user in reduced.users:
        if user.target in FUSED_OPS and user.args[1] is reduced:
            if user.args[4] != reduced.args[0].args[2]:
                return (f"it is the residual of the fused site `{user.name}`, which reduces over another group "
                        f"({user.args[4]!r}): only sums over one group merge")
            return f"it is the residual of the fused site `{user.name}` (the two all-reduces were not merged)"
    for add in adds:
        other = _other_operand(add, reduced)
        normed_adds = [a for a in add.users if is_call(a, ADD) and find_rmsnorm(a)]
        if normed_adds and is_summed_wait(other):
            return _unmerged_reason(reduced, other, add, config)
        if normed_adds:
            return (f"it is added (`{add.name}`) to `{other.name}`, which is not all-reduced, before the residual add "
                    f"`{normed_adds[0].name}` that the RMSNorm reads: the fused op adds the residual to the all-reduced "
                    f"sum itself (adding `{other.name}` to the residual first would round differently)")
    for value in [reduced] + adds:
        for user in value.users:
            if is_reshape(user) and _normed_soon(user):
                if not keeps_last_dim(user):
                    return (f"`{user.name}` reshapes the all-reduced value from {list(val(value).shape)} to "
                            f"{list(val(user).shape)}, changing its last (hidden) dimension")
                return f"`{user.name}` reshapes `{value.name}`, which is also used by " + ", ".join(
                    f"`{other.name}`" for other in value.users if other is not user)
            if is_call(user, CAST) and value is reduced and any(find_rmsnorm(a) for a in user.users if is_call(a, ADD)):
                return (f"the all-reduced value ({_name(val(reduced).dtype)}) is cast to {_name(user.args[1])} by "
                        f"`{user.name}` before the residual add: the fused op adds in the all-reduced dtype, or in "
                        "float32 (a float32 residual stream of 16-bit activations)")
            if is_call(user, MUL) and _normed_soon(user):
                return (f"`{user.name}` scales the all-reduced value before the RMSNorm: the fused op norms the sum "
                        "itself (scaling each rank's part before the all-reduce would round differently)")
    for value in [reduced] + adds:
        reordered = _weight_first_norm(value)
        if reordered is not None:
            return reordered
    for value in [reduced] + adds:
        if any(user.op == "output" for user in value.users):
            what = "the all-reduced value" if value is reduced else "the all-reduced value plus residual"
            if _compiled_as_one_graph():
                return (f"`{value.name}` ({what}) is returned from the graph and no RMSNorm follows it here (the function "
                        f"was compiled with fullgraph=True): {FULLGRAPH_ADVICE}")
            return f"`{value.name}` ({what}) is returned from the graph and no RMSNorm follows it here: {WHOLE_STACK_ADVICE}"
    return "no RMSNorm follows" + (" the all-reduce or its residual add" if adds else "")


def _weight_first_norm(value: torch.fx.Node) -> str | None:
    """Why an RMSNorm of `value` that multiplies in its weight in another order than the fused op does
    (`w * x * rsqrt(...)`, `x * (w * rsqrt(...))`) does not fuse; None when no such norm reads `value`."""
    for computed in [value, *(user for user in value.users if is_call(user, CAST))]:
        for square in computed.users:
            if not (is_call(square, POW) and square.args[1] == 2):
                continue
            for mean in (u for u in square.users if is_call(u, MEAN) and is_last_dim_mean(u)):
                for add_eps in (u for u in mean.users if is_call(u, ADD)):
                    for inverse in (u for u in add_eps.users if is_call(u, RSQRT)):
                        products = [u for u in inverse.users if is_call(u, MUL)] + \
                            [u for u in computed.users if is_call(u, MUL) and u is not square]
                        if products:
                            return (f"the RMSNorm of `{value.name}` multiplies its weight in another order than "
                                    f"`(x * rsqrt(mean(x**2) + eps)) * weight` (`{products[0].name}`: the weight times "
                                    "x or times the rsqrt first), which rounds differently: the fused op "
                                    "computes that order only; write the norm `x * rsqrt(...) * weight` (or `weight * "
                                    "(x * rsqrt(...))`) to fuse it")
    return None


def _compiled_as_one_graph() -> bool:
    """Whether the compile running now was asked for one graph (`fullgraph=True`); False outside dynamo."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return bool(getattr(InstructionTranslator.current_tx(), "one_graph", False))
    except Exception:  # noqa: BLE001 - no dynamo compile is running (a graph given to the passes directly)
        return False


def _normed_soon(value: torch.fx.Node) -> bool:
    """Whether an RMSNorm reads `value` or an add of it."""
    return find_rmsnorm(value) is not None or any(find_rmsnorm(a) for a in value.users if is_call(a, ADD))


def _reduce_scatter_reason(node: torch.fx.Node) -> str:
    waits = [user for user in node.users if user.target is WAIT_TENSOR]
    follows = ""
    for wait in waits:
        for hidden in [wait] + [a for a in wait.users if is_same_shape_add(a)]:
            norm = find_rmsnorm(hidden)
            if norm is not None:
                follows = f"; the RMSNorm `{norm.output.name}` that follows runs on this rank's shard"
    return (f"`{node.name}` is a reduce-scatter (sequence parallel), not an all-reduce: the fused op all-reduces"
            + follows)


def normed_inputs(graph: torch.fx.Graph) -> list[str]:
    """Names of the graph inputs that an RMSNorm reads (in any spelling; `graph` is not changed)."""
    candidates = [p for p in graph.find_nodes(op="placeholder") if any(starts_norm(u, p) for u in p.users)]
    if not candidates:
        return []
    copy, mapping = torch.fx.Graph(), {}
    copy.graph_copy(graph, mapping)
    copied = [mapping[p] for p in candidates]
    canonicalize_norms(copy, copied)
    return [p.name for p, c in zip(candidates, copied) if find_rmsnorm(c) is not None]


def needs_another_graph(reason: str | None) -> bool:
    """Whether `reason` says the site's sum leaves its graph with no RMSNorm after it (see `in_another_graph`)."""
    return reason is not None and reason.endswith((WHOLE_STACK_ADVICE, FULLGRAPH_ADVICE))


def in_another_graph(reason: str, normed: list[tuple[int, str]]) -> str:
    """`reason` made exact for a sum returned from its graph when some compiled graph (index, input
    name in `normed`) applies an RMSNorm to one of its inputs: the norm is in another graph."""
    if not needs_another_graph(reason) or not normed:
        return reason
    graph, name = normed[0]
    return reason.removesuffix(WHOLE_STACK_ADVICE).removesuffix(FULLGRAPH_ADVICE) + (
        f"graph {graph} applies an RMSNorm to its input `{name}`, so the norm is in another graph (or a later "
        "run of this one, as with torch.compile on each decoder block): compile the whole stack as one graph")


#: A node named in a reason, with the op it calls when the sentence gives it: "`rsqrt_1` (rsqrt)".
_NAMED_NODE = re.compile(r"`[^`]*`(?: \([\w.]+\))?")


def reason_kind(reason: str) -> str:
    """`reason` with the nodes it names blanked: equal for sites blocked the same way (a value of each
    layer's chain saved for backward, say, whichever value it is)."""
    return _NAMED_NODE.sub("`…`", reason)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

