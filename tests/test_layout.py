"""The package layout rules of docs/ARCHITECTURE.md, checked on the source: at most 8 modules directly
in fxfuse/, no runner module in models/, no import loop among fxfuse's modules (imports inside
functions included: a lazy import that closes a loop is still a loop to a reader), and lower layers
never import higher ones (`FORBIDDEN`)."""

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


def module_files() -> dict[str, Path]:
    """Every shipped module name -> its source file."""
    modules = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The fxfuse modules `path` imports anywhere in its body (the longest known prefix of each import)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        parents = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
        graph[name] = imported_modules(path, known) - {name} - parents  # a package's own __init__ is not a loop
    return graph


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
