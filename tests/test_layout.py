"""The package layout rules of docs/ARCHITECTURE.md, checked on the source: at most 8 modules directly
in fxfuse/, no runner module in models/, no import loop among fxfuse's modules (imports inside
functions included: a lazy import that closes a loop is still a loop to a reader), lower layers
never import higher ones (`FORBIDDEN`), and inside fxfuse/op/ each part imports only the parts below
it (`OP_PARTS`, `OP_MAY_IMPORT`). Relative imports and `importlib.import_module("fxfuse...")` calls
with a literal name count as imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: Source folder -> the package name it ships as.
PACKAGE_DIRS = {"fxfuse": "fxfuse", "passes": "fxfuse.passes", "models": "fxfuse.models"}
#: What sits above the compile entry points (backend, post_grad): the report, the runner, the CLI.
ABOVE_ENTRY_POINTS = ("fxfuse.inspect", "fxfuse.runner", "fxfuse.bench", "fxfuse.cli")
#: Module or subpackage -> those it must never import. The compiler side, lowest first: op, passes,
#: rewrite (a pass run and its records), post_grad, backend, then the report above them.
FORBIDDEN = {
    "fxfuse.op": ("fxfuse.passes", "fxfuse.rewrite", "fxfuse.post_grad", "fxfuse.backend", *ABOVE_ENTRY_POINTS),
    "fxfuse.models": ("fxfuse.passes", "fxfuse.rewrite", "fxfuse.post_grad", "fxfuse.backend", *ABOVE_ENTRY_POINTS,
                      "fxfuse.op"),
    "fxfuse.passes": ("fxfuse.rewrite", "fxfuse.post_grad", "fxfuse.backend", *ABOVE_ENTRY_POINTS, "fxfuse.models"),
    "fxfuse.rewrite": ("fxfuse.post_grad", "fxfuse.backend", *ABOVE_ENTRY_POINTS, "fxfuse.models"),
    "fxfuse.post_grad": ("fxfuse.backend", *ABOVE_ENTRY_POINTS, "fxfuse.models"),
    "fxfuse.backend": (*ABOVE_ENTRY_POINTS, "fxfuse.models"),
    "fxfuse.runner": ("fxfuse.bench", "fxfuse.cli"),
}
#: The parts of fxfuse.op, lowest first, by the modules (or sub-packages) each holds: the op's contract
#: (its definition and reference arithmetic), the decision, fxfuse's own kernels, the runtime.
OP_PARTS = {
    "contract": ("fxfuse.op", "fxfuse.op.schema", "fxfuse.op.fp8_schema", "fxfuse.op.all_reduce_schema", "fxfuse.op.fp8_recipe", "fxfuse.op.reference"),
    "decide": ("fxfuse.op.decide",),
    "kernels": ("fxfuse.op.kernels",),
    "runtime": ("fxfuse.op.runtime",),
}
#: Part -> the other parts (and single modules of them) its modules may import: nothing outside fxfuse.op,
#: and no import back up. The kernels' one use of the decision: `native_build` reads FXFUSE_NATIVE and
#: FXFUSE_NATIVE_CACHE with `env_setting`, the one reader of every FXFUSE_* variable.
OP_MAY_IMPORT = {
    "contract": (),
    "decide": ("contract",),
    "kernels": ("contract", "fxfuse.op.decide.environment"),
    "runtime": ("contract", "decide", "kernels"),
}


def module_files() -> dict[str, Path]:
    """Every shipped module name -> its source file."""
    modules = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


def imported_modules(path: Path, known: set[str], module: str = "") -> set[str]:
    """The fxfuse modules `path` (module `module`) imports anywhere in its body (the longest known prefix
    of each import): import statements, relative ones resolved, and `importlib.import_module` /
    `__import__` calls with a literal name."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and _names_an_import(node.func)):
            names = [node.args[0].value]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _names_an_import(func: ast.expr) -> bool:
    """Whether a call's function is `importlib.import_module`, `import_module` or `__import__`."""
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        parents = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
        graph[name] = imported_modules(path, known, name) - {name} - parents  # a package's own __init__ is not a loop
    return graph


def within(name: str, prefixes) -> bool:
    """Whether module `name` is one of `prefixes` or inside one of them."""
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def op_part(name: str) -> str | None:
    """The part of fxfuse.op module `name` belongs to (`OP_PARTS`), None outside fxfuse.op."""
    for part, members in OP_PARTS.items():
        if name in members or within(name, [m for m in members if m != "fxfuse.op"]):
            return part
    return None


def test_at_most_eight_modules_directly_in_fxfuse():
    direct = sorted(p.name for p in (REPO / "fxfuse").glob("*.py"))
    assert len(direct) <= 8, direct


def test_models_holds_no_runner_module():
    names = {p.stem for p in (REPO / "models").glob("*.py")}
    assert not names & {"runner", "run_setup", "cuda_graph_step", "step_backends", "progress", "speculative", "launch"}


def test_the_op_and_its_kernels_live_in_one_subpackage():
    op = REPO / "fxfuse" / "op"
    op_modules = {p.relative_to(op).with_suffix("").as_posix() for p in op.rglob("*.py")}
    assert {"schema", "reference", "runtime/cuda_dispatch", "decide/policy", "decide/thresholds",
            "kernels/add_rmsnorm_kernel"} <= op_modules
    assert not list((REPO / "fxfuse").glob("*kernel*.py"))


def test_no_import_loop():
    graph = import_graph()
    cycles = []

    def visit(name: str, stack: list[str], on_stack: set[str], done: set[str]) -> None:
        on_stack.add(name)
        stack.append(name)
        for dep in sorted(graph.get(name, ())):
            if dep in on_stack:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in done:
                visit(dep, stack, on_stack, done)
        stack.pop()
        on_stack.discard(name)
        done.add(name)

    done: set[str] = set()
    for name in sorted(graph):
        if name not in done:
            visit(name, [], set(), done)
    assert not cycles, "import loops: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_lower_layers_never_import_higher_ones(layer):
    bad = {
        (name, dep)
        for name, deps in import_graph().items()
        if name == layer or name.startswith(layer + ".")
        for dep in deps
        if any(dep == f or dep.startswith(f + ".") for f in FORBIDDEN[layer])
    }
    assert not bad, sorted(bad)


def test_every_op_module_is_in_one_part():
    """A new module directly in fxfuse/op/ is part of the op's contract only if listed there: anything
    else goes in decide/, kernels/ or runtime/ (see each one's __init__ docstring)."""
    op_modules = [name for name in module_files() if within(name, ["fxfuse.op"])]
    assert {name: op_part(name) for name in op_modules if op_part(name) is None} == {}
    assert all(part in OP_MAY_IMPORT for part in OP_PARTS)


@pytest.mark.parametrize("part", sorted(OP_PARTS))
def test_op_parts_import_only_the_parts_below_them(part):
    """contract <- decide <- runtime, contract (+ decide.environment) <- kernels <- runtime: never back up,
    and nothing of fxfuse outside fxfuse.op (passes, rewrite, backend, runner, bench, inspect, models)."""
    allowed = (part, *OP_MAY_IMPORT[part])
    bad = sorted(
        (name, dep)
        for name, deps in import_graph().items()
        if op_part(name) == part
        for dep in deps
        if op_part(dep) not in allowed and dep not in allowed
    )
    assert not bad, f"fxfuse.op's {part} may import only {', '.join(allowed)}; found (module, import): {bad}"
