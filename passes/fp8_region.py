"""The FP8 quantization after a fused site's norm, as a subgraph whose structure is proven from the graph.

`quantization_region(fused, normed)` finds the one e4m3 cast that the norm's output reaches through
quantization-like ops and returns the `Region` between them, or raises `NotFused` with the reason. What
it proves, from the graph alone (`fxfuse.passes.fp8_recipe_search` then finds what the region computes
by running it):
- **inputs**: the region reads the norm's output, sizes, constants (literals, `get_attr` tensors, `full`)
  and *parameters*: tensors of one value computed apart from the site (a static scale; a Python float
  that dynamo made a graph input under `dynamic=True`, such as `torch.finfo(float8_e4m3fn).max`); the
  pure arithmetic between those and the region (`-1 * fp8_max`) and constants it makes (`ones_like`) are
  part of it;
- **ops**: elementwise ops, maxima over the last dimension, views (keeping the order of the elements),
  pads and slices of the last dimension, size arithmetic (`OPS`);
- **rows stay apart**: every maximum reduces a last dimension that divides a row of the norm's output
  (padded or not), every reshape keeps whole last-dimension runs within a row, and two computed
  operands of an elementwise op have one shape, or one is broadcast along its last dimension only; so
  a row's codes and scales depend on that row alone, for any number of rows (proven for every size the
  graph's symbols may take, not just the traced ones);
- **privacy**: every node of the region but its outputs is read only inside it (a size read of a
  node shaped like the norm's output excepted: the fold re-points it), except casts and views of the
  norm's output alone, which stay for their other readers;
- **outputs**: the e4m3 values the graph reads (the cast, or the first view or slice after it with as
  many elements as the norm's output, which the op's codes can be viewed as) and at most one float32
  value (the scales).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxfuse.passes.canonical_form import CAST, is_call, val

aten = torch.ops.aten
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
#: The dtypes a cast to which ends a quantization: FP8 formats and 8-bit integers (only e4m3fn folds).
QUANTIZED_DTYPES = (*FP8_DTYPES, torch.int8, torch.uint8)
SYM_SIZE = aten.sym_size.int

ELEMENTWISE = frozenset({
    aten.abs.default, aten.neg.default, aten.reciprocal.default, aten.log2.default, aten.exp2.default,
    aten.ceil.default, aten.floor.default, aten.round.default, aten.trunc.default, aten.sign.default,
    aten.sqrt.default, aten.rsqrt.default, aten.exp.default, aten.log.default,
    aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.mul.Tensor, aten.mul.Scalar,
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar,
    aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar,
    aten.maximum.default, aten.minimum.default, aten.fmax.default, aten.fmin.default,
    aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_min.Tensor,
    aten.clamp_max.default, aten.clamp_max.Tensor, aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther,
    aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.ne.Tensor, aten.lt.Scalar, aten.lt.Tensor,
    aten.le.Scalar, aten.le.Tensor, aten.gt.Scalar, aten.gt.Tensor, aten.ge.Scalar, aten.ge.Tensor,
    aten.logical_and.default, aten.logical_or.default, aten.logical_not.default, aten.isnan.default,
    aten.clone.default, aten.alias.default, CAST, aten._to_copy.default,
})
#: Maxima and minima over a dimension (`max.dim` and `min.dim` through `getitem(0)`).
REDUCTIONS = frozenset({aten.amax.default, aten.amin.default, aten.max.dim, aten.min.dim})
RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
                      aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default})
PAD, SLICE = aten.constant_pad_nd.default, aten.slice.Tensor
#: Ops that make a constant from nothing (a parameter's arithmetic may start from them).
CONSTANT_MAKERS = frozenset({aten.full.default, aten.scalar_tensor.default, aten.lift_fresh_copy.default})
#: Every op the region may compute its values with.
OPS = ELEMENTWISE | REDUCTIONS | RESHAPES | {PAD, SLICE}
SIZE_OPS = frozenset({SYM_SIZE, operator.mul, operator.add, operator.sub, operator.floordiv, operator.mod,
                      operator.neg, torch.sym_max, torch.sym_min, torch.sym_sum})


class NotFused(Exception):
    """A quantization follows the norm but cannot be folded; the message says why."""


@dataclass
class Region:
    """The quantization of `normed`: `program` (graph order) computes `codes` and `scales` from `normed`,
    `leaves` (sizes, constants and parameters, by kind) and its own constant arithmetic."""

    normed: torch.fx.Node
    program: list[torch.fx.Node]
    data: set[torch.fx.Node]  # the program's nodes computed from normed
    codes: torch.fx.Node
    scales: torch.fx.Node | None
    leaves: dict[str, list[torch.fx.Node]]  # "size", "constant", "parameter"
    private: set[torch.fx.Node] = field(default_factory=set)  # erased by the fold, once unread
    literals: list[float] = field(default_factory=list)  # the numbers the program's ops are given
    runtime_values: list[torch.fx.Node] = field(default_factory=list)  # one-value CPU tensors the computed values read

    def parameters(self) -> list[torch.fx.Node]:
        """The region's parameters, in graph order."""
        return self.leaves["parameter"]


def casts_to_fp8_soon(value: torch.fx.Node, depth: int = 8) -> bool:
    """Whether some node within `depth` uses of `value` converts to an FP8 (or 8-bit integer) dtype: a
    quantization, which folds if it is FP8 e4m3's (`quantization_region` says why not otherwise)."""
    frontier = {value}
    for _ in range(depth):
        frontier = {user for node in frontier for user in node.users}
        if any(_fp8_cast_dtype(node) is not None for node in frontier):
            return True
    return False


def quantization_region(fused: torch.fx.Node, normed: torch.fx.Node) -> Region:
    """The quantization of `normed` (output 0 of the fused op `fused`), its structure proven; NotFused says
    why it cannot be folded."""
    reach = _reach(normed)
    casts = [node for node in reach if _fp8_cast_dtype(node) is not None]
    if not casts:
        raise NotFused(_blocked(normed))
    if len(casts) != 1:
        raise NotFused(f"the norm's output is cast to FP8 or 8-bit integers {len(casts)} times")
    (cast,) = casts
    if _fp8_cast_dtype(cast) != torch.float8_e4m3fn:
        raise NotFused(f"the quantization casts to {_fp8_cast_dtype(cast)}, not float8_e4m3fn: only FP8 e4m3 "
                       "quantizations fold")
    chain, codes = _codes_output(cast, normed)
    data = _ancestors_within(codes, reach | set(chain)) | {codes}  # with the sizes a view back after the cast reads
    read_outside = {node for node in data for user in node.users if user not in data and not _dead(user)}
    kept = {node for node in read_outside if node is not codes and _reads_normed_alone(node, normed)}
    kept |= {ancestor for node in kept for ancestor in _ancestors_within(node, data)}  # the casts and views under them
    sizes = {node for node in read_outside if not isinstance(val(node), torch.Tensor)}
    for node in sizes:
        if not _reads_sizes_of_normed_shape(node, data, normed):
            raise NotFused(f"`{node.name}` ({op_name(node)}), a size inside the FP8 quantization, is also used by "
                           f"`{next(u for u in node.users if u not in data).name}`")
    scales = _scales_output(read_outside - kept - sizes - {codes}, data, normed)
    program, leaves = _program(data, normed, fused)
    for node in program:
        if node in data:
            _check_op(node, normed)
    region = Region(normed, program, data, codes, scales, leaves)
    region.private = {node for node in program if node not in kept | sizes}
    region.private |= {dead for node in data for user in node.users if user not in data and _dead(user)
                       for dead in _with_users(user)}  # erased with the nodes they read
    region.literals = _literals(program)
    region.runtime_values = [node for node in [*program, *leaves["parameter"]] if node not in data and _cpu_scalar(node)
                             and any(user in data for user in node.users)]
    return region


def _cpu_scalar(node: torch.fx.Node) -> bool:
    """A 0-dim floating CPU tensor: a number the op can read when it runs (a lifted Python float, or one
    computed from such)."""
    value = val(node)
    return value is not None and value.dim() == 0 and value.device.type == "cpu" and value.is_floating_point()


def _reached(node: torch.fx.Node, step) -> set[torch.fx.Node]:
    """`node` and every node reached from it by `step` (a node -> the nodes next to it)."""
    found, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current not in found:
            found.add(current)
            stack.extend(step(current))
    return found


def _with_users(node: torch.fx.Node) -> set[torch.fx.Node]:
    """`node` and everything computed from it."""
    return _reached(node, lambda current: current.users)


def _dead(node: torch.fx.Node, depth: int = 4) -> bool:
    """Whether `node` computes nothing anything reads (a size computed and never used: the graph keeps some)."""
    return node.op == "call_function" and not node.is_impure() and depth > 0 and all(_dead(u, depth - 1) for u in node.users)


def _reads_sizes_of_normed_shape(node: torch.fx.Node, data: set, normed: torch.fx.Node) -> bool:
    """A size computed (within the region) only from sizes of nodes shaped like the norm's output: the fold
    re-points those reads to the fused op's input, which has that shape."""
    if is_call(node, SYM_SIZE):
        return node.args[0] is normed or same_shape(node.args[0], normed)
    return all(_reads_sizes_of_normed_shape(arg, data, normed) for arg in node.all_input_nodes if arg in data)


def _fp8_cast_dtype(node) -> torch.dtype | None:
    """The FP8 or 8-bit integer dtype a cast node converts to (`QUANTIZED_DTYPES`), or None."""
    if is_call(node, CAST) and node.args[1] in QUANTIZED_DTYPES:
        return node.args[1]
    if is_call(node, aten._to_copy.default) and node.kwargs.get("dtype") in QUANTIZED_DTYPES:
        return node.kwargs["dtype"]
    return None


def _reach(normed: torch.fx.Node, limit: int = 256) -> set[torch.fx.Node]:
    """The nodes computed from `normed` through the region's ops only (and size reads), before any FP8 cast's users."""
    seen, stack = set(), [normed]
    while stack and len(seen) < limit:
        node = stack.pop()
        for user in node.users:
            if user in seen or user.op != "call_function":
                continue
            if user.target in OPS or user.target in SIZE_OPS or user.target is operator.getitem or \
                    _fp8_cast_dtype(user) is not None:
                seen.add(user)
                if _fp8_cast_dtype(user) is None:
                    stack.append(user)
    return seen


def _blocked(normed: torch.fx.Node) -> str:
    """Why no FP8 cast is reached through the region's ops: the first other op on a path to one."""
    frontier, parents = [normed], {}
    for _ in range(8):
        following = []
        for node in frontier:
            for user in node.users:
                parents.setdefault(user, node)
                following.append(user)
                if _fp8_cast_dtype(user) is not None:
                    path = [user]
                    while path[-1] in parents and parents[path[-1]] is not normed:
                        path.append(parents[path[-1]])
                    blocker = next((n for n in reversed(path) if n.op != "call_function" or not (
                        n.target in OPS or n.target in SIZE_OPS or n.target is operator.getitem)), path[0])
                    return (f"`{blocker.name}` ({op_name(blocker)}) between the norm and the FP8 cast is not an elementwise "
                            "op, a maximum over the last dimension, a view, a pad or a slice")
        frontier = following
    return "no FP8 cast reads the norm's output through elementwise ops, maxima, views, pads and slices"


def _ancestors_within(node: torch.fx.Node, within: set) -> set[torch.fx.Node]:
    """What `node` is computed from through nodes of `within` (`node` itself excluded)."""
    return _reached(node, lambda current: [parent for parent in current.all_input_nodes if parent in within]) - {node}


def _codes_output(cast: torch.fx.Node, normed: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node]:
    """(the views and slices after the cast up to the codes output, that output): the first node of the
    cast's single-reader chain of views and slices with as many elements as the norm's output."""
    chain, node = [], cast
    while True:
        chain.append(node)
        if same_count(val(node).shape, val(normed).shape) and reshape_plan(list(val(node).shape), list(val(normed).shape)):
            return chain[1:], node
        users = list(node.users)
        if len(users) != 1 or users[0].op != "call_function" or users[0].target not in RESHAPES | {SLICE}:
            raise NotFused(f"the FP8 values `{node.name}` have the shape {list(val(node).shape)}, which the op's "
                           f"{list(val(normed).shape)} cannot be viewed as")
        node = users[0]


def _reads_normed_alone(node: torch.fx.Node, normed: torch.fx.Node) -> bool:
    """`node` is normed under casts and views only (it stays in the graph for its other readers)."""
    while node is not normed:
        if not (is_call(node, CAST) or (node.op == "call_function" and node.target in RESHAPES)):
            return False
        node = node.args[0]
    return True


def _scales_output(outputs: set, data: set, normed: torch.fx.Node) -> torch.fx.Node | None:
    """The one float32 value read outside besides the codes (the scales), or None; NotFused for anything else
    read outside (a size read of a node shaped like the norm's output is re-pointed by the fold)."""
    found = None
    for node in sorted(outputs):
        readers = [user for user in node.users if user not in data and not (is_call(user, SYM_SIZE) and same_shape(node, normed))]
        if not readers:
            continue
        if found is None and isinstance(val(node), torch.Tensor) and val(node).dtype == torch.float32:
            found = node
            continue
        raise NotFused(f"`{node.name}` ({op_name(node)}) inside the FP8 quantization is also used by `{readers[0].name}`")
    return found


def _program(data: set, normed: torch.fx.Node, fused: torch.fx.Node) -> tuple[list[torch.fx.Node], dict]:
    """(the nodes to run: the pure arithmetic of the data nodes' other inputs, then the data nodes in graph
    order; the leaves by kind, in graph order)."""
    leaves = {"size": [], "constant": [], "parameter": []}
    extra: set[torch.fx.Node] = set()
    stack = [arg for node in data for arg in node.all_input_nodes if arg not in data and arg is not normed]
    while stack:
        node = stack.pop()
        if node in extra or any(node in kind for kind in leaves.values()):
            continue
        kind = _leaf_kind(node, fused)
        if kind is not None:
            leaves[kind].append(node)
        elif node.op == "call_function" and not node.is_impure() and (
                node.target in CONSTANT_MAKERS or (node.target in ELEMENTWISE and _numel_is_one(node))):
            extra.add(node)
            stack.extend(node.all_input_nodes)
        else:
            raise NotFused(f"the FP8 quantization reads `{node.name}` ({op_name(node)}), which is neither the norm's "
                           "output, a size, a constant nor one value computed apart from the site")
    order = {node: index for index, node in enumerate(normed.graph.nodes)}
    for kind in leaves:
        leaves[kind].sort(key=order.__getitem__)
    data_in_order = sorted(data, key=order.__getitem__)
    return _in_order_of_need(extra, data_in_order) + data_in_order, leaves


def _in_order_of_need(extra: set, data_in_order: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The arithmetic apart from the norm's output, each node after its inputs, in the order the data nodes
    first read it: not in graph order, where a value several sites share (one `-448`) sits before one
    site's data and after another's, which would make the sites' programs differ."""
    ordered: list[torch.fx.Node] = []
    placed: set[torch.fx.Node] = set()

    def place(node: torch.fx.Node) -> None:
        if node in extra and node not in placed:
            placed.add(node)
            for arg in node.all_input_nodes:
                place(arg)
            ordered.append(node)

    for node in data_in_order:
        for arg in node.all_input_nodes:
            place(arg)
    return ordered


def _leaf_kind(node: torch.fx.Node, fused: torch.fx.Node) -> str | None:
    """"size" (an int), "constant" (a `get_attr` tensor), "parameter" (one floating value computed apart
    from the site, its value drawn by the search) or None (computed by the program)."""
    value = node.meta.get("val")
    if isinstance(value, (int, torch.SymInt)):
        return "size"
    if node.op == "get_attr":
        return "constant"
    if depends_on(node, fused):
        raise NotFused(f"the FP8 quantization reads `{node.name}` ({op_name(node)}), which is computed from the norm's output "
                       "or the fused op's other outputs by code outside the quantization")
    if node.op == "call_function" and (node.target in ELEMENTWISE or node.target in CONSTANT_MAKERS):
        return None
    if isinstance(value, torch.Tensor) and value.is_floating_point() and _numel_is_one(node):
        return "parameter"
    return None


def _numel_is_one(node: torch.fx.Node) -> bool:
    value = val(node)
    return value is not None and statically_known_true(numel(value) == 1)


def _check_op(node: torch.fx.Node, normed: torch.fx.Node) -> None:
    """NotFused unless `node` (computed from normed) is one of the region's ops, keeping rows apart."""
    if node.op != "call_function":
        raise NotFused(f"`{node.name}` inside the FP8 quantization is a {node.op}")
    target = node.target
    if target in SIZE_OPS:
        return
    if target is operator.getitem:
        if node.args[1] != 0 or not (is_call(node.args[0], aten.max.dim) or is_call(node.args[0], aten.min.dim)):
            raise NotFused(f"`{node.name}` takes output {node.args[1]} of `{node.args[0].name}` ({op_name(node.args[0])})")
        return
    if _fp8_cast_dtype(node) is not None:
        return
    if target not in OPS:
        raise NotFused(f"`{node.name}` ({op_name(node)}) inside the FP8 quantization is not an elementwise op, a maximum "
                       "over the last dimension, a view, a pad or a slice")
    rows = row_count(normed)
    if target in REDUCTIONS:
        _check_reduction(node, rows)
    elif target in RESHAPES:
        _check_reshape(node, rows)
    elif target in (PAD, SLICE):
        _check_last_dim_op(node)
    else:
        _check_broadcast(node)


def _check_reduction(node: torch.fx.Node, rows) -> None:
    source = node.args[0]
    rank = val(source).dim()
    if node.target in (aten.amax.default, aten.amin.default):
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", [])
        dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    else:
        dims = [node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")]
    if not dims or (len(dims) == rank and rank > 1):
        raise NotFused(f"`{node.name}` reduces over every dimension: one scale for the whole tensor (dynamic per-tensor "
                       "scaling) is not folded")
    if [d % rank for d in dims] != [rank - 1]:
        raise NotFused(f"`{node.name}` reduces over dimensions {list(dims)}, not the last one")
    if not _runs_within_rows(val(source), rows):
        raise NotFused(f"`{node.name}` reduces runs of {val(source).shape[-1]} values, which are not known to lie within "
                       "rows of the norm's output (a group could span two rows)")


def _check_reshape(node: torch.fx.Node, rows) -> None:
    before, after = val(node.args[0]), val(node)
    if node.target is aten.expand.default:
        if before.dim() != after.dim() or not all(statically_known_true(a == b) for a, b in zip(before.shape[:-1], after.shape[:-1])):
            raise NotFused(f"`{node.name}` expands `{node.args[0].name}` along other dimensions than the last")
        return
    if not _runs_within_rows(after, rows):
        sizes = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) else None
        if node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default) and sizes and \
                isinstance(sizes[-1], int) and sizes[-1] > 1:
            raise NotFused(f"`{node.name}` groups the flattened rows by {sizes[-1]}, and a row of the norm's output is not "
                           f"known to hold whole groups (a group could span two rows)")
        raise NotFused(f"`{node.name}` ({op_name(node)}) lays out values of several rows of the norm's output along one last "
                       f"dimension ({list(after.shape)}): they would be read across the columns")


def _check_last_dim_op(node: torch.fx.Node) -> None:
    rank = val(node.args[0]).dim()
    if node.target is PAD:
        if len(node.args[1]) != 2:
            raise NotFused(f"`{node.name}` pads other dimensions than the last")
    elif node.args[1] % rank != rank - 1 if len(node.args) > 1 else rank != 1:
        raise NotFused(f"`{node.name}` slices dimension {node.args[1]}, not the last one")


def _check_broadcast(node: torch.fx.Node) -> None:
    """Two computed operands of an elementwise op: one shape, or one broadcast along its last dimension only."""
    shapes = [val(arg).shape for arg in node.all_input_nodes if val(arg) is not None and not _numel_is_one(arg)]
    result = val(node).shape
    for shape in shapes:
        if len(shape) != len(result) or not all(statically_known_true(a == b) for a, b in zip(shape[:-1], result[:-1])):
            raise NotFused(f"`{node.name}` ({op_name(node)}) broadcasts an operand of shape {list(shape)} to {list(result)} "
                           "along other dimensions than the last")


def _runs_within_rows(value: torch.Tensor, rows) -> bool:
    """Whether each run of `value`'s last dimension lies within one row of the norm's output: the number of
    elements per row is known to be whole and a multiple of the last dimension (runs start at multiples of
    the last dimension, rows at multiples of the per-row count)."""
    if value.dim() == 0:
        return True
    elements = numel(value)
    return statically_known_true(elements % rows == 0) and statically_known_true((elements // rows) % value.shape[-1] == 0)


def row_count(normed: torch.fx.Node):
    """The number of rows of the norm's output (the product of its leading sizes; an int or a SymInt)."""
    count = 1
    for size in val(normed).shape[:-1]:
        count = count * size
    return count


def numel(value: torch.Tensor):
    """The number of elements of a (fake) tensor, an int or a SymInt."""
    count = 1
    for size in value.shape:
        count = count * size
    return count


def _literals(program: list[torch.fx.Node]) -> list[float]:
    """The finite float and int numbers the program's ops take as arguments (besides sizes)."""
    numbers = []
    for node in program:
        if node.target in RESHAPES or node.target in SIZE_OPS or node.target in (SLICE, operator.getitem):
            continue
        flat = []
        torch.fx.node.map_aggregate((node.args, tuple(node.kwargs.values())), lambda a: flat.append(a) or a)
        numbers += [float(a) for a in flat if isinstance(a, (int, float)) and not isinstance(a, bool)]
    return numbers


def same_count(shape, other) -> bool:
    """Whether two shapes are known to hold as many elements (dimension by dimension where they have one rank:
    the graph's guards then decide more)."""
    if len(shape) == len(other) and all(statically_known_true(a == b) for a, b in zip(shape, other)):
        return True
    count = other_count = 1
    for size in shape:
        count = count * size
    for size in other:
        other_count = other_count * size
    return statically_known_true(count == other_count)


def same_shape(node: torch.fx.Node, normed: torch.fx.Node) -> bool:
    """Whether `node` has the shape of the norm's output."""
    if not isinstance(val(node), torch.Tensor):
        return False
    shape, normed_shape = val(node).shape, val(normed).shape
    return len(shape) == len(normed_shape) and all(statically_known_true(a == b) for a, b in zip(shape, normed_shape))


def size_readers(nodes, normed: torch.fx.Node) -> list[torch.fx.Node]:
    """The `sym_size` nodes that read the size of `normed` or of a node of `nodes` with normed's shape."""
    return [user for node in {*nodes, normed} if same_shape(node, normed) for user in node.users if is_call(user, SYM_SIZE)]


def depends_on(node: torch.fx.Node, fused: torch.fx.Node) -> bool:
    """Whether `node` is computed from `fused`'s outputs (every input path, not a bounded depth: nodes
    before `fused` in the graph cannot depend on it)."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current is fused:
            return True
        if current in seen or current < fused:
            continue
        seen.add(current)
        stack.extend(current.all_input_nodes)
    return False


def op_name(node) -> str:
    """The op a node calls, as a short name (`amax`, `div`)."""
    return getattr(getattr(getattr(node, "target", None), "overloadpacket", None), "__name__", None) or \
        str(getattr(node, "target", node))


def reshape_plan(shape: list, op_shape: list, groups_proven: bool = False) -> tuple | None:
    """How the op's output of `op_shape` is read as `shape` (same elements in the same order): ("same",),
    ("view", sizes with -1 for the one symbolic dimension), ("unsqueeze", the op's size-1 dimensions
    to squeeze, the dimensions of size 1 to insert), or None when no such reshape is known to fit.
    `groups_proven`: the match proved that `shape` holds one scale per group of the op's rows, so its
    last dimension other than 1 is the op's group count, whatever symbolic form it has
    (`(s + 127) // 128` and `(s + (-s mod 128)) // 128` are one number that sympy cannot equate)."""
    def equal(a, b) -> bool:
        return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))

    if equal(shape, op_shape):
        return ("same",)
    kept, op_kept = [d for d in shape if d != 1], [d for d in op_shape if d != 1]
    squeezes = ("unsqueeze", [i for i, d in enumerate(op_shape) if d == 1], [i for i, d in enumerate(shape) if d == 1])
    if groups_proven and kept and op_kept and equal(kept[:-1], op_kept[:-1]):
        return squeezes
    if not statically_known_true(math.prod(shape) == math.prod(op_shape)):
        return None
    sizes = _view_sizes(shape)
    if sizes is not None:
        return ("view", sizes)
    return squeezes if equal(kept, op_kept) else None


def _view_sizes(shape) -> list | None:
    """`view` sizes for `shape` that name no symbol: -1 for its one symbolic dimension; None if it has more."""
    sizes = [d if isinstance(d, int) else -1 for d in shape]
    return sizes if sizes.count(-1) <= 1 else None
