"""One spelling for every all-reduce -> (merge add) -> residual add -> RMSNorm chain, before matching.

Code written elsewhere spells the same chain many ways. Rather than a traced pattern per spelling, the
passes first call `canonicalize(graph)`, which rewrites each chain that starts at a summed all-reduce
into one form; the traced patterns then match that form only. Every rewrite keeps the values:

- Reshapes (`view`, `reshape`, `_unsafe_view`, `unsqueeze`, `squeeze`) that keep the last dimension,
  between the all-reduce, the merge add, the residual add and the norm, move up to the chain's inputs,
  so the chain runs in the shape the norm sees: `view(wait(all_reduce(x)))` becomes
  `wait(all_reduce(view(x)))` and `view(a + b)` becomes `view(a) + view(b)`; other users of the old
  sum read a view of the new one, in the old shape. The new all-reduce is issued where the old one
  was and waited for where the old wait was (a collective never moves later or past another one); size
  arguments computed after the all-reduce move up before it (a reshape whose sizes come from the sum
  itself stays where it is).
- A 16-bit all-reduced value added to a float32 one by type promotion reads `reduced.to(float32) +
  other` (the float32 residual stream's spelling; the conversion is exact), and such an upcast counts
  as the all-reduced value in what follows.
- An add of an all-reduced value reads `reduced + other` (the all-reduced operand first; of two, the
  later one, whose fused op can then take the earlier as its residual where its all-reduce was). An
  add with `alpha` (`a + alpha * b`) keeps its operands' order.
- The RMSNorm arithmetic that reads a chain value `h` (or a cast of it): `c * c` becomes
  `pow(c, 2)`; `h * rsqrt(...)` with `c = h.to(float32)` (type promotion upcasts `h` exactly)
  becomes `c * rsqrt(...)`; a mean over the last dimension named by its index becomes `mean(..., [-1])`,
  and one with `dtype=` its input's own dtype loses that argument;
  `eps + mean` and `add.Scalar(mean, eps)` become `mean + eps` (`add.Tensor`); repeated casts of `h` to one dtype become one; `rsqrt(v) * c`
  becomes `c * rsqrt(v)`; `weight * normed` becomes `normed * weight` (before or after the cast
  back). All of these are exact in floating point.
- `1 / sqrt(v)`, `reciprocal(sqrt(v))` and `v ** -0.5` become `rsqrt(v)`, and `c / sqrt(v)` becomes
  `c * rsqrt(v)`, where `v = mean(c**2, -1) + eps`: the same math, which can differ from the original
  in the last bit of a float32 (rsqrt is what the fused op computes). Like all rewrites here, they
  touch only chains that start at a summed all-reduce, and stay where such a site is not fused.

After it, an RMSNorm of a chain value `h` reads, with `c = h` or `c = h.to(float32)`,
`n = c * rsqrt(mean(pow(c, 2), [-1], keepdim=True) + eps)`, then `n.to(dtype) * weight` or
`(n * weight).to(dtype)` (in float32 `n * weight`; a float32 residual stream's `(n * weight).to(dtype)`
with `c = h`). `find_rmsnorm(h)` returns its nodes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxfuse.passes.collective_placement import late_ancestors, movable_earlier
from fxfuse.passes.pattern_support import ALL_REDUCE, WAIT_TENSOR, same_shape

aten = torch.ops.aten
ADD = aten.add.Tensor
ADD_SCALAR = aten.add.Scalar
MUL = aten.mul.Tensor
DIV = aten.div.Tensor
POW = aten.pow.Tensor_Scalar
MEAN = aten.mean.dim
RSQRT = aten.rsqrt.default
SQRT = aten.sqrt.default
RECIPROCAL = aten.reciprocal.default
CAST = torch.ops.prims.convert_element_type.default
HALF_DTYPES = (torch.bfloat16, torch.float16)
VIEW = aten.view.default

#: Ops that only reshape; the chain sees through those that keep the last dimension.
RESHAPES = frozenset(
    {
        VIEW,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
    }
)

#: Node meta carried over to the nodes a rewrite makes (where the report finds a site's module).
KEPT_META = ("nn_module_stack", "stack_trace", "source_fn_stack")
#: Node meta key, on a fused site's all-reduce input: the `original_aten` of the nodes the fusion replaced.
CHAIN_ORIGINS = "fxfuse_chain_original_aten"


def val(arg) -> torch.Tensor | None:
    """The fake tensor a graph node computes (None for a non-tensor or a literal)."""
    value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def is_call(node, target) -> bool:
    """Whether `node` is a graph node calling `target`."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def is_summed_wait(node) -> bool:
    """`wait_tensor(all_reduce(x, "sum", group))`."""
    if not is_call(node, WAIT_TENSOR):
        return False
    source = node.args[0]
    return is_call(source, ALL_REDUCE) and source.args[1] == "sum"


def is_reshape(node) -> bool:
    """A node calling one of `RESHAPES`."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in RESHAPES


def keeps_last_dim(reshape: torch.fx.Node) -> bool:
    """Whether a reshape's result has its input's last dimension (size) as its own last dimension."""
    before, after = val(reshape.args[0]), val(reshape)
    return (
        before is not None
        and after is not None
        and before.dim() >= 1
        and after.dim() >= 1
        and statically_known_true(before.shape[-1] == after.shape[-1])
    )


def scales(add: torch.fx.Node) -> bool:
    """Whether an add carries an `alpha` other than 1 (`a + alpha * b`: its operands do not commute)."""
    return add.kwargs.get("alpha", 1) != 1


def is_same_shape_add(node) -> bool:
    """`aten.add.Tensor(a, b)` of two tensors of the result's shape (no scalar, broadcast or alpha)."""
    if not is_call(node, ADD) or scales(node) or len(node.args) != 2:
        return False
    a, b, out = val(node.args[0]), val(node.args[1]), val(node)
    return a is not None and b is not None and out is not None and same_shape(a, out) and same_shape(b, out)


def is_reduced(node, depth: int = 8) -> bool:
    """A sum over a group: a summed all-reduce result, or a mergeable sum of two (`is_merge_add`)."""
    return is_summed_wait(node) or (depth > 0 and is_merge_add(node, depth - 1))


def is_merge_add(node, depth: int = 8) -> bool:
    """A same-shape add of two sums over a group, each read by nothing else (what pattern 3 merges)."""
    return (
        is_call(node, ADD)
        and all(is_reduced(arg, depth) and len(arg.users) == 1 for arg in node.args)
        and is_same_shape_add(node)
    )


def is_upcast(node, source=None) -> bool:
    """`source.to(float32)` for a 16-bit `source` (any node when None): exact, the float32 residual
    stream's read of a 16-bit all-reduce."""
    if not is_call(node, CAST) or node.args[1] != torch.float32 or (source is not None and node.args[0] is not source):
        return False
    before = val(node.args[0])
    return before is not None and before.dtype in HALF_DTYPES


def chain_values(graph: torch.fx.Graph) -> tuple[set[torch.fx.Node], list[torch.fx.Node]]:
    """(reduced values, other adds that read one), the latter in graph order. A reduced value's float32
    upcast counts as reduced (the float32 residual stream's `all_reduce(y).float() + residual`)."""
    reduced: set[torch.fx.Node] = set()
    adds: list[torch.fx.Node] = []
    for node in graph.nodes:
        if is_summed_wait(node) or (is_upcast(node) and node.args[0] in reduced) or (
            is_call(node, ADD) and all(a in reduced and len(a.users) == 1 for a in node.args) and is_same_shape_add(node)
        ):
            reduced.add(node)
        elif is_call(node, ADD) and any(arg in reduced for arg in node.args):
            adds.append(node)
    return reduced, adds


# ---------------------------------------------------------------- the norm, once canonical


@dataclass(frozen=True)
class RMSNormNodes:
    """An RMSNorm over the last dimension of `hidden`, in canonical form (see the module docstring).

    `computed`: the value its statistic is computed on (`hidden` or a cast of it); `eps`: the float or
    node added to the mean; `weight`: the weight operand (None: no weight multiply); `output`: the
    norm's result; `inner`: the nodes after `hidden` up to, not including, `output` (what a fused op
    replaces besides the output); `weight_in_fp32`: the weight multiplies the float32 norm before a
    cast to another dtype (`(n * weight).to(dtype)`) rather than after it.
    """

    hidden: torch.fx.Node
    computed: torch.fx.Node
    eps: object
    weight: object
    output: torch.fx.Node
    inner: tuple[torch.fx.Node, ...]
    weight_in_fp32: bool = False


def users_calling(node: torch.fx.Node, target, first: torch.fx.Node | None = None) -> list[torch.fx.Node]:
    """Users of `node` that call `target` (with `first` as their first argument, when given), in order."""
    return [u for u in node.users if is_call(u, target) and (first is None or u.args[0] is first)]


def is_last_dim_mean(mean: torch.fx.Node) -> bool:
    """`mean(t, [-1], keepdim=True)`."""
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    return list(mean.args[1]) == [-1] and keepdim is True


def find_rmsnorm(hidden: torch.fx.Node, cast_to: torch.dtype | None = None) -> RMSNormNodes | None:
    """The canonical RMSNorm over the last dimension that reads `hidden`, if there is one.

    Its result is cast back to `cast_to` (default: `hidden`'s dtype; a float32 residual stream's norm
    is cast to the 16-bit activations' dtype)."""
    for computed in [hidden] + users_calling(hidden, CAST, hidden):
        for square in users_calling(computed, POW, computed):
            if square.args[1] != 2:
                continue
            for mean in users_calling(square, MEAN, square):
                if not is_last_dim_mean(mean):
                    continue
                for add_eps in users_calling(mean, ADD, mean):
                    for inverse_rms in users_calling(add_eps, RSQRT, add_eps):
                        for normalized in users_calling(inverse_rms, MUL):
                            if normalized.args == (computed, inverse_rms):
                                statistic = (square, mean, add_eps, inverse_rms, normalized)
                                return _with_weight(hidden, computed, statistic, cast_to)
    return None


def _weight_multiply(value: torch.fx.Node) -> tuple[torch.fx.Node, object] | None:
    """(`value * w` node, w) for the first multiply of `value` by something else, either side."""
    for user in users_calling(value, MUL):
        if len(user.args) == 2 and user.args[0] is not user.args[1]:
            return user, (user.args[1] if user.args[0] is value else user.args[0])
    return None


def _with_weight(hidden: torch.fx.Node, computed: torch.fx.Node, statistic: tuple,
                 cast_to: torch.dtype | None = None) -> RMSNormNodes:
    """Complete a found statistic with the weight multiply and the cast back (to `cast_to`, by default
    `hidden`'s dtype; a cast to another dtype when there is none to it, so a check can name it)."""
    normalized = statistic[-1]
    inner = ([computed] if computed is not hidden else []) + list(statistic)
    own = val(hidden).dtype if val(hidden) is not None else None
    dtype = cast_to if cast_to is not None else own
    casts_back = _casts_preferring(normalized, dtype)
    weight, output, weight_in_fp32 = None, normalized, False
    if casts_back and _weight_multiply(casts_back[0]):  # n.to(dtype) * weight
        inner.append(casts_back[0])
        output, weight = _weight_multiply(casts_back[0])
    elif _weight_multiply(normalized):  # (n * weight).to(dtype), or n * weight when n has hidden's dtype
        output, weight = _weight_multiply(normalized)
        later_casts = _casts_preferring(output, dtype)
        if (computed is not hidden or dtype != own) and later_casts:
            inner.append(output)
            output, weight_in_fp32 = later_casts[0], True
    elif casts_back:
        output = casts_back[0]
    return RMSNormNodes(hidden, computed, statistic[2].args[1], weight, output, tuple(inner), weight_in_fp32)


def _casts_preferring(value: torch.fx.Node, dtype: torch.dtype | None) -> list[torch.fx.Node]:
    """The casts of `value` (to another dtype than its own), those to `dtype` first."""
    own = val(value).dtype if val(value) is not None else None
    casts = [c for c in users_calling(value, CAST, value) if c.args[1] != own]
    return sorted(casts, key=lambda c: c.args[1] != dtype)


# ---------------------------------------------------------------- rewriting


def emit_node(graph: torch.fx.Graph, target, args: tuple, *, before: torch.fx.Node, meta_from: torch.fx.Node,
              origins: dict | None = None) -> torch.fx.Node:
    """A new `target(*args)` node before `before`, with its fake value (computed from its arguments'
    under their fake mode: the op's own error if it rejects them), `meta_from`'s `KEPT_META`, and an
    `original_aten`: the next one `origins` (from `chain_origins`) holds for `target`, taken from it, where
    the node stands in for one of a replaced chain's, else what user code would give it (`original_aten_of`)."""
    values = _meta_values(args)
    fake_mode = detect_fake_mode([v for v in _flatten(values) if isinstance(v, torch.Tensor)])
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        value = target(*values)
    with graph.inserting_before(before):
        node = graph.call_function(target, args)
    node.meta.update({k: meta_from.meta[k] for k in KEPT_META if k in meta_from.meta})
    kept = (origins or {}).get(target)
    original = kept.pop(0) if kept else original_aten_of(target)
    if original is not None:
        node.meta["original_aten"] = original
    node.meta["val"] = value
    return node


def remember_chain_origins(anchor: torch.fx.Node, chain: Iterable[torch.fx.Node]) -> None:
    """Keep on `anchor` (a node the replacement of `chain` leaves in the graph) the `original_aten` of each
    node of `chain`, by target in graph order, so that a rewrite that later gives the chain back
    (`site_tiers.demote`) can give its nodes the meta Inductor's own graph has (`chain_origins`)."""
    origins: dict = {}
    for node in sorted(chain):  # nodes order as the graph does (as `collective_placement` sorts them)
        origins.setdefault(node.target, []).append(node.meta.get("original_aten"))
    anchor.meta[CHAIN_ORIGINS] = origins


def chain_origins(anchor: torch.fx.Node) -> dict:
    """A copy of what `remember_chain_origins` kept on `anchor` ({} if nothing), for `emit_node` to take from."""
    return {target: list(originals) for target, originals in anchor.meta.get(CHAIN_ORIGINS, {}).items()}


def original_aten_of(target) -> torch._ops.OpOverload | None:
    """The aten op AOT autograd records as `original_aten` for user code that computes `target`: an aten op
    itself, `aten._to_copy` for a dtype conversion (`.to(dtype)`, `.float()`), None for any other op.

    Inductor names a fused kernel after the `original_aten` ops of its nodes, and keys its autotuning cache
    by the kernel's source, name included: a node a rewrite makes without it changes the kernel's name,
    so code the rewrite gave back to Inductor unchanged (tier (b)'s add and norm) would be tuned afresh,
    possibly into another launch configuration than Inductor's own graph gets, and would show in profiles
    under another name."""
    if target is CAST:
        return torch.ops.aten._to_copy.default
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        return target
    return None


class _Rewriter:
    """The canonicalizing rewrites of one graph; `changes` counts them."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.changes = 0
        self.views_back: set[torch.fx.Node] = set()  # views made for old-shape users: never moved again

    def emit(self, target, args: tuple, *, before: torch.fx.Node, meta_from: torch.fx.Node) -> torch.fx.Node | None:
        """`emit_node`, or None if the op rejects the args."""
        try:
            return emit_node(self.graph, target, args, before=before, meta_from=meta_from)
        except RuntimeError:
            return None

    def emit_all(self, steps, before: torch.fx.Node) -> list[torch.fx.Node] | None:
        """Emit `(target, args_fn, meta_from)` steps in order (each `args_fn` gets the nodes made so
        far); all of them or, if any op rejects its arguments, none (those made are erased again)."""
        made: list[torch.fx.Node] = []
        for target, args_fn, meta_from in steps:
            node = self.emit(target, args_fn(made), before=before, meta_from=meta_from)
            if node is None:
                for unused in reversed(made):
                    self.graph.erase_node(unused)
                return None
            made.append(node)
        return made

    # ---- reshapes

    def hoist_reshapes(self) -> None:
        """Move last-dim-keeping reshapes up through summed all-reduces and sums, until none moves."""
        moved = True
        while moved:
            moved = False
            for node in list(self.graph.nodes):
                if node._erased or not is_reshape(node) or node in self.views_back:
                    continue
                source = node.args[0]
                if is_summed_wait(source):
                    moved |= keeps_last_dim(node) and self._reshape_before_all_reduce(node, source)
                elif is_call(source, ADD) and any(is_reduced(arg) for arg in source.args[:2]):
                    moved |= is_same_shape_add(source) and keeps_last_dim(node) and self._reshape_operands(node, source)
        if self.changes:
            stable_topological_sort(self.graph)

    def _reshape_before_all_reduce(self, reshape: torch.fx.Node, wait: torch.fx.Node) -> bool:
        """`reshape(wait(all_reduce(x)))` -> `wait(all_reduce(reshape(x)))`, when nothing else reads them.

        The new all-reduce is issued where the old one was and waited for where the old wait was (never
        later, never past another collective); size arguments computed after the all-reduce move up
        before it, unless they cannot (computed from the sum, or by a collective or a mutation).
        """
        all_reduce = wait.args[0]
        if len(wait.users) != 1 or len(all_reduce.users) != 1:
            return False
        x, rest = all_reduce.args[0], reshape.args[1:]
        late = sorted(late_ancestors(_flatten(rest), all_reduce))
        if not all(movable_earlier(node) for node in late):
            return False
        for node in late:
            all_reduce.prepend(node)
        made = self.emit_all(
            [
                (reshape.target, lambda made: (x, *rest), x),
                (ALL_REDUCE, lambda made: (made[0], *all_reduce.args[1:]), all_reduce),
            ],
            before=all_reduce,
        )
        if made is None:
            return False
        new_wait = self.emit_all([(WAIT_TENSOR, lambda _: (made[1],), wait)], before=wait)
        if new_wait is None:
            for unused in reversed(made):
                self.graph.erase_node(unused)
            return False
        reshape.replace_all_uses_with(new_wait[0])
        for old in (reshape, wait, all_reduce):
            self.graph.erase_node(old)
        self.changes += 1
        return True

    def _reshape_operands(self, reshape: torch.fx.Node, add: torch.fx.Node) -> bool:
        """`reshape(a + b)` -> `reshape(a) + reshape(b)`; other users of `a + b` read a view back.

        Only when the reshaped sum goes on to a norm or an add while the old sum feeds no norm (the
        chain then runs in the norm's shape), and the reshape's size arguments are not computed from
        the old sum.
        """
        others = [user for user in add.users if user is not reshape]
        if not any(starts_norm(user, reshape) or is_call(user, ADD) for user in reshape.users):
            return False
        if any(starts_norm(user, add) for user in others) or _depends_on(reshape.args[1:], add):
            return False
        (a, b), rest = add.args, reshape.args[1:]
        steps = [
            (reshape.target, lambda made: (a, *rest), a),
            (reshape.target, lambda made: (b, *rest), b),
            (ADD, lambda made: (made[0], made[1]), add),
        ]
        back_sizes = self._size_args(_size_source(a), before=reshape) if others else []
        if back_sizes is None:
            return False
        if others:
            steps.append((VIEW, lambda made: (made[2], back_sizes), add))
        made = self.emit_all(steps, before=reshape)
        if made is None:
            return False
        reshape.replace_all_uses_with(made[2])
        self.graph.erase_node(reshape)
        if others:
            self.views_back.add(made[3])
            add.replace_all_uses_with(made[3])
        self.graph.erase_node(add)
        self.changes += 1
        return True

    def _size_args(self, like: torch.fx.Node, before: torch.fx.Node) -> list | None:
        """`like`'s shape as view arguments: ints, and `sym_size(like, d)` nodes for symbolic sizes."""
        sizes = []
        for dim, size in enumerate(val(like).shape):
            if isinstance(size, int):
                sizes.append(size)
                continue
            node = self.emit(aten.sym_size.int, (like, dim), before=before, meta_from=like)
            if node is None:
                return None
            sizes.append(node)
        return sizes

    # ---- adds and norm spellings

    def upcast_promoted_adds(self, adds: Iterable[torch.fx.Node], reduced: set[torch.fx.Node]) -> None:
        """`reduced + r32` with a 16-bit `reduced` (type promotion adds in float32) -> `reduced.to(float32)
        + r32`: the same exact conversion, spelled as the float32 residual stream writes it."""
        for add in adds:
            out = val(add)
            if out is None or out.dtype != torch.float32 or not is_same_shape_add(add):
                continue
            for index, operand in enumerate(add.args[:2]):
                value = val(operand)
                if operand in reduced and value is not None and value.dtype in HALF_DTYPES:
                    cast = self.emit(CAST, (operand, torch.float32), before=add, meta_from=operand)
                    if cast is not None:
                        add.replace_input_with(operand, cast)
                        reduced.add(cast)
                        self.changes += 1

    def order_adds(self, adds: Iterable[torch.fx.Node], reduced: set[torch.fx.Node]) -> None:
        """`other + reduced` -> `reduced + other` (addition commutes exactly); of two reduced operands,
        the one read by nothing else comes first (the one a fused op can consume), and of two such, the
        later one (its fused op, issued where its all-reduce was, can read the earlier as its residual).
        An add with `alpha` (which scales its second operand only) keeps its order."""

        def rank(operand) -> tuple[bool, bool]:
            return operand in reduced, operand in reduced and len(operand.users) == 1

        for add in adds:
            first, second = add.args[:2]
            if not scales(add) and (rank(second) > rank(first) or (rank(second) == rank(first) == (True, True)
                                                                    and first < second)):
                add.args = (second, first)
                self.changes += 1

    def canonicalize_norm_of(self, hidden: torch.fx.Node) -> None:
        """Rewrite the RMSNorm spellings that read `hidden` (or its casts) into the canonical form."""
        casts = users_calling(hidden, CAST, hidden)
        for index, cast in enumerate(casts):
            first = next(c for c in casts[: index + 1] if c.args[1:] == cast.args[1:] and c.kwargs == cast.kwargs)
            if first is not cast:
                cast.replace_all_uses_with(first)
                self.graph.erase_node(cast)
                self.changes += 1
        for computed in [hidden] + users_calling(hidden, CAST, hidden):
            self._canonicalize_statistic(computed)

    def _canonicalize_statistic(self, computed: torch.fx.Node) -> None:
        for user in list(computed.users):
            if is_call(user, MUL) and user.args == (computed, computed):
                self._retarget(user, POW, (computed, 2))
        for square in users_calling(computed, POW, computed):
            if square.args[1] != 2:
                continue
            for mean in users_calling(square, MEAN, square):
                self._canonicalize_mean(mean)
                if not is_last_dim_mean(mean):
                    continue
                for user in list(mean.users):
                    if is_call(user, ADD_SCALAR) and user.args[0] is mean:  # F.rms_norm's functionalized `add_`
                        self._retarget(user, ADD, user.args)
                    if is_call(user, ADD) and user.args[1] is mean and user.args[0] is not mean and not scales(user):
                        user.args = (mean, user.args[0])
                        self.changes += 1
                for add_eps in users_calling(mean, ADD, mean):
                    self._canonicalize_inverse_rms(add_eps, computed)

    def _canonicalize_mean(self, mean: torch.fx.Node) -> None:
        """`mean(t, [d], keepdim)` with d the index of the last dimension -> `mean(t, [-1], keepdim)`; a
        `dtype=` that is t's own dtype is dropped (the same mean: torch 2.15's patterns do not match it)."""
        dims, value = list(mean.args[1]), val(mean.args[0])
        if value is not None and len(dims) == 1 and dims != [-1] and dims[0] == value.dim() - 1:
            mean.args = (mean.args[0], [-1], *mean.args[2:])
            self.changes += 1
        if value is not None and mean.kwargs.get("dtype") == value.dtype:
            mean.kwargs = {name: arg for name, arg in mean.kwargs.items() if name != "dtype"}
            self.changes += 1

    def _canonicalize_inverse_rms(self, add_eps: torch.fx.Node, computed: torch.fx.Node) -> None:
        """Every spelling of `1 / sqrt(add_eps)` -> one `rsqrt(add_eps)`, used as `computed * rsqrt`."""
        for power in users_calling(add_eps, POW, add_eps):
            if power.args[1] == -0.5:
                self._retarget(power, RSQRT, (add_eps,))
        for root in users_calling(add_eps, SQRT, add_eps):
            for user in list(root.users):
                if is_call(user, RECIPROCAL) or (is_call(user, DIV) and user.args == (1, root)):
                    self._retarget(user, RSQRT, (add_eps,))
                elif is_call(user, DIV) and user.args == (computed, root):
                    self._retarget(user, MUL, (computed, self._rsqrt_of(add_eps, like=root)))
            if not root.users:
                self.graph.erase_node(root)
        inverses = users_calling(add_eps, RSQRT, add_eps)
        for duplicate in inverses[1:]:
            duplicate.replace_all_uses_with(inverses[0])
            self.graph.erase_node(duplicate)
            self.changes += 1
        for inverse in inverses[:1]:
            self._upcast_explicitly(inverse, computed)
            for user in users_calling(inverse, MUL):
                if user.args in ((inverse, 1), (1, inverse), (inverse, 1.0), (1.0, inverse)):
                    user.replace_all_uses_with(inverse)
                    self.graph.erase_node(user)
                    self.changes += 1
            for user in users_calling(inverse, MUL):
                if user.args == (inverse, computed):
                    user.args = (computed, inverse)
                    self.changes += 1
                if user.args == (computed, inverse):
                    self._weight_on_the_right(user)

    def _upcast_explicitly(self, inverse: torch.fx.Node, computed: torch.fx.Node) -> None:
        """`h * rsqrt(...)` with `h` 16-bit and `computed = h.to(float32)` -> `computed * rsqrt(...)`: type
        promotion converts `h` to float32 exactly, so this is the same product."""
        if not is_call(computed, CAST) or computed.args[1] != torch.float32:
            return
        source = computed.args[0]
        for user in users_calling(inverse, MUL):
            if len(user.args) == 2 and set(user.args) == {source, inverse} and source is not inverse \
                    and val(user) is not None and val(user).dtype == torch.float32:
                user.args = (computed, inverse)
                self.changes += 1

    def _rsqrt_of(self, add_eps: torch.fx.Node, like: torch.fx.Node) -> torch.fx.Node:
        """The `rsqrt(add_eps)` node, made right after `add_eps` (valued like `like`) if there is none."""
        existing = users_calling(add_eps, RSQRT, add_eps)
        if existing:
            return existing[0]
        with self.graph.inserting_after(add_eps):
            node = self.graph.call_function(RSQRT, (add_eps,))
        node.meta.update(like.meta)
        node.meta["original_aten"] = original_aten_of(RSQRT)
        self.changes += 1
        return node

    def _weight_on_the_right(self, normalized: torch.fx.Node) -> None:
        """`weight * normalized` and `weight * normalized.to(dtype)` -> the weight on the right."""
        for value in [normalized] + users_calling(normalized, CAST, normalized):
            for user in users_calling(value, MUL):
                if user.args[1] is value and user.args[0] is not value:
                    user.args = (value, user.args[0])
                    self.changes += 1

    def _retarget(self, node: torch.fx.Node, target, args: tuple) -> None:
        """Make `node` compute `target(*args)` in place (same shape and dtype as before)."""
        node.target, node.args = target, args
        self.changes += 1


def _size_source(value: torch.fx.Node) -> torch.fx.Node:
    """A node of `value`'s shape whose extra `sym_size` users block no fusion: `value` itself, or for a
    reduced value the input of (the first of) its all-reduce(s), which patterns bind as an argument."""
    while is_reduced(value):
        value = value.args[0].args[0] if is_summed_wait(value) else value.args[0]
    return value


def starts_norm(user: torch.fx.Node, value: torch.fx.Node) -> bool:
    """Whether `user` may begin an RMSNorm of `value`: a cast, a square, or `value * value`."""
    return (
        is_call(user, CAST)
        or (is_call(user, POW) and user.args == (value, 2))
        or (is_call(user, MUL) and user.args == (value, value))
    )


def _depends_on(args, node: torch.fx.Node, depth: int = 6) -> bool:
    """Whether a graph node in `args` is computed from `node` (looking up to `depth` steps back)."""
    frontier = {a for a in _flatten(args) if isinstance(a, torch.fx.Node)}
    for _ in range(depth):
        if node in frontier:
            return True
        frontier = {arg for n in frontier for arg in n.all_input_nodes}
    return node in frontier


def _meta_values(arg):
    """`arg` with every graph node replaced by its meta value (recursively through lists/tuples)."""
    if isinstance(arg, torch.fx.Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return type(arg)(_meta_values(a) for a in arg)
    return arg


def _flatten(values) -> list:
    flat = []
    for v in values:
        flat.extend(_flatten(v) if isinstance(v, (list, tuple)) else [v])
    return flat


def canonicalize(graph: torch.fx.Graph) -> int:
    """Rewrite every all-reduce chain of `graph` into the canonical form, in place; returns how many
    rewrites it made (0 for a graph already canonical, so calling it again changes nothing)."""
    rewriter = _Rewriter(graph)
    rewriter.hoist_reshapes()
    reduced, adds = chain_values(graph)
    rewriter.upcast_promoted_adds(adds, reduced)
    rewriter.order_adds([node for node in graph.nodes if node in reduced and is_call(node, ADD)] + adds, reduced)
    hidden_values = reduced | set(adds)
    return rewriter.changes + canonicalize_norms(graph, [node for node in graph.nodes if node in hidden_values])


def canonicalize_norms(graph: torch.fx.Graph, values: Iterable[torch.fx.Node]) -> int:
    """Rewrite the RMSNorm spellings that read each of `values` (or a cast of it) into the canonical
    form, in place; returns how many rewrites it made."""
    rewriter = _Rewriter(graph)
    for value in values:
        rewriter.canonicalize_norm_of(value)
    return rewriter.changes
