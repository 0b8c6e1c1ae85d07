"""The distribution as users get it: a non-editable install ships fxfuse.models / fxfuse.passes
(never top-level `models` / `passes`), its data files, and the torch_dynamo_backends entry point."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CHECK = """
import importlib.util, json, sys
import fxfuse, fxfuse.models.deepseek_v3, fxfuse.passes.allreduce_rmsnorm_fusion, fxfuse.op.decide.thresholds, fxfuse.backend
assert fxfuse.__file__.startswith(sys.argv[1]), fxfuse.__file__
assert importlib.util.find_spec("models") is None and importlib.util.find_spec("passes") is None
print(json.dumps({"ok": True}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(REPO)],
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
    # run from an empty directory with only the install on the path (not the repo checkout)
    env = {"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", CHECK, str(installed)],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"ok": true' in out.stdout


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
