"""The distribution as users get it: a non-editable install ships fxfuse.models / fxfuse.passes
(never top-level `models` / `passes`), its data files, and the torch_dynamo_backends entry point."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

CHECK = """
import importlib.util, json, sys
import fxfuse, fxfuse.models.deepseek_v3, fxfuse.passes.allreduce_rmsnorm_fusion, fxfuse.op.decide.thresholds
import fxfuse.backend, fxfuse.post_grad, fxfuse.cli  # what `backend="fxfuse"` and the command import
assert fxfuse.__file__.startswith(sys.argv[1]), fxfuse.__file__
assert fxfuse.backend.__file__.startswith(sys.argv[1]), fxfuse.backend.__file__
assert importlib.util.find_spec("models") is None and importlib.util.find_spec("passes") is None
print(json.dumps({"ok": True}))
"""


#: What a fresh clone does not have: the build's and the editable install's left-overs (setuptools copies files
#: that an old `*.egg-info/SOURCES.txt` or `build/lib` lists, which hid a package missing from pyproject.toml),
#: the environments (.venv, and .venv-* for other torch releases), carried wheels (.whl*), and the benchmark
#: results (large, not shipped).
NOT_IN_A_CLONE = {".git", "build", "dist", ".pytest_cache"}
#: Prefixes of git-ignored folders a working tree may hold (.gitignore's `.venv*/` and `/.whl*/`).
NOT_IN_A_CLONE_PREFIXES = (".venv", ".whl")


def _clone_like(folder: str, names: list[str]) -> set[str]:
    ignored = {name for name in names if name == "__pycache__"}
    if Path(folder) == REPO:
        ignored |= {name for name in names
                    if name in NOT_IN_A_CLONE or name.startswith(NOT_IN_A_CLONE_PREFIXES) or name.endswith(".egg-info")}
    if Path(folder) == REPO / "bench":
        ignored |= {"results"} & set(names)
    return ignored


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A non-editable install (`pip install .`) of a copy of the working tree as a fresh clone has it."""
    source = tmp_path_factory.mktemp("source") / "fxfuse"
    shutil.copytree(REPO, source, ignore=_clone_like)
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(source)],
        check=True, capture_output=True, text=True,
    )
    return target


@pytest.mark.slow
def test_non_editable_install_imports_subpackages_under_fxfuse(installed, tmp_path):
    assert (installed / "fxfuse" / "models" / "deepseek_v3.py").is_file()
    assert (installed / "fxfuse" / "passes" / "allreduce_rmsnorm_fusion.py").is_file()
    assert (installed / "fxfuse" / "op" / "decide" / "default_thresholds.json").is_file()
    assert (installed / "fxfuse" / "op" / "kernels" / "native_fallback.cpp").is_file()
    assert not (installed / "models").exists() and not (installed / "passes").exists()
    # every package of the source tree ships (pyproject.toml lists them one by one; fxfuse.rewrite was missing)
    sources = {"fxfuse": REPO / "fxfuse", "fxfuse/passes": REPO / "passes", "fxfuse/models": REPO / "models"}
    packages = {f"{name}/{init.parent.relative_to(root)}".rstrip("/.") for name, root in sources.items()
                for init in root.rglob("__init__.py")}
    assert not [package for package in sorted(packages) if not (installed / package / "__init__.py").is_file()]
    # run from an empty directory with only the install and the dependencies on the path: not the repo checkout,
    # and without site's .pth files, one of which is the editable install's finder (it would serve what the
    # install lacks from the checkout)
    dependencies = Path(torch.__file__).parents[1]
    env = {"PYTHONPATH": os.pathsep.join([str(installed), str(dependencies)]), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-S", "-c", CHECK, str(installed)],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"ok": true' in out.stdout


@pytest.mark.slow
def test_entry_point_registers_the_backend(installed):
    entry_points = next(installed.glob("fxfuse-*.dist-info")) / "entry_points.txt"
    text = entry_points.read_text()
    assert "[torch_dynamo_backends]" in text and "fxfuse = fxfuse.backend:fxfuse_backend" in text
    assert "[console_scripts]" in text and "fxfuse = fxfuse.cli:main" in text


def test_every_package_folder_is_listed_in_pyproject():
    """setuptools ships only the packages pyproject names: a new folder missing there imports in a checkout
    (editable install) and fails in a wheel (fxfuse.rewrite was missing so, and `fxfuse.backend` with it)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {package: REPO / folder for package, folder in tool["package-dir"].items()}
    found = set()
    for package, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            found.add(".".join((package, *parts)))
    assert found == set(tool["packages"])
