"""A bad FXFUSE_* setting of the fused op is one `fxfuse: error:` line with exit status 2, before any rank
(or any other work) starts, in every command where the op can run: `fxfuse run` (backend fxfuse, the
default), `report`, `bench kernel|fallback|model` and `tune pcie`. The values are parsed by the op's own
parsers (fxfuse.op.decide.settings, fxfuse.op.decide.thresholds), so the message is the one the op would give. An empty
value of any FXFUSE_* variable counts as unset: every one is read through `fxfuse.op.decide.environment.env_setting`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fxfuse.cli import main

SETTINGS = [
    ("FXFUSE_FUSION", "bogus", "bad setting FXFUSE_FUSION='bogus': expected one of auto, oneshot, twoshot, pcie, pcie_one_kernel, off"),
    ("FXFUSE_TOPOLOGY", "mesh", "bad setting FXFUSE_TOPOLOGY='mesh': expected auto, "),
    ("FXFUSE_MAX_TOKENS", "0", "bad setting FXFUSE_MAX_TOKENS='0': expected a positive integer"),
    ("FXFUSE_MAX_TOKENS", "many", "bad setting FXFUSE_MAX_TOKENS='many': expected a positive integer"),
    ("FXFUSE_PCIE_PROFILE", "nvlink", "bad setting FXFUSE_PCIE_PROFILE='nvlink': expected one of rootcplx, pcieswitch"),
    ("FXFUSE_THRESHOLDS", "{missing}", "bad setting FXFUSE_THRESHOLDS: cannot read thresholds file {missing}"),
    ("FXFUSE_THRESHOLDS", "{invalid}", "bad setting FXFUSE_THRESHOLDS: cannot read thresholds file {invalid}: Expecting"),
    ("FXFUSE_THRESHOLDS", "{foreign}", "bad setting FXFUSE_THRESHOLDS: {foreign}: not a thresholds file"),
    # issue 41: these were accepted (maybe as on, a file that is not there, a workspace of 10**11 tokens)
    ("FXFUSE_NATIVE", "maybe", "bad setting FXFUSE_NATIVE='maybe': expected one of 1, true, yes, on, 0, false, no, off"),
    ("FXFUSE_MAX_TOKENS", "99999999999", "bad setting FXFUSE_MAX_TOKENS='99999999999': at most 524288"),
    ("FXFUSE_PCIE_TUNE_CACHE", "{missing}", "bad setting FXFUSE_PCIE_TUNE_CACHE='{missing}': no such file"),
]
#: `fxfuse tune pcie` writes the tuning file that FXFUSE_PCIE_TUNE_CACHE names: there it need not exist yet.
WRITTEN_BY = {("tune pcie", "FXFUSE_PCIE_TUNE_CACHE")}

#: Each command, and the function it would call once its checks passed (module, attribute).
COMMANDS = {
    "run": (["run"], "fxfuse.runner.run", "run_prepared"),
    "report": (["report"], "fxfuse.inspect.site_report", "report_model"),
    "bench kernel": (["bench", "kernel"], "fxfuse.bench.kernel", "main"),
    "bench fallback": (["bench", "fallback"], "fxfuse.bench.fallback", "main"),
    "bench model": (["bench", "model", "--device", "cpu"], "fxfuse.bench.model", "main"),
    "tune pcie": (["tune", "pcie"], "fxfuse.bench.tune_pcie", "main"),
}


@pytest.fixture
def setting_files(tmp_path):
    """Paths for the thresholds cases: a missing file, invalid JSON, and JSON that is no thresholds table."""
    (tmp_path / "invalid.json").write_text("{not json")
    (tmp_path / "foreign.json").write_text('{"entries": []}')
    return {"missing": str(tmp_path / "missing.json"), "invalid": str(tmp_path / "invalid.json"),
            "foreign": str(tmp_path / "foreign.json")}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("variable, value, message", SETTINGS, ids=[f"{v}={x}" for v, x, _ in SETTINGS])
def test_a_bad_setting_is_one_error_line_before_any_work(command, variable, value, message, setting_files,
                                                         monkeypatch, capsys):
    import importlib

    argv, module, attribute = COMMANDS[command]
    if (command, variable) in WRITTEN_BY:
        calls = []
        monkeypatch.setattr(importlib.import_module(module), attribute, lambda *a, **k: calls.append(a) or 0)
        monkeypatch.setenv(variable, value.format(**setting_files))
        assert main(argv) == 0 and len(calls) == 1
        return

    def no_work(*args, **kwargs):
        raise AssertionError(f"{command} started work despite {variable}={value}")

    monkeypatch.setattr(importlib.import_module(module), attribute, no_work)
    monkeypatch.setenv(variable, value.format(**setting_files))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxfuse: error: " + message.format(**setting_files)), err
    assert err.count("\n") == 1  # one line, no traceback


def test_settings_are_not_checked_where_the_op_cannot_run(monkeypatch):
    """A run with the eager or Inductor backend never calls the op, so its settings do not stop it."""
    from fxfuse.runner.options import RunOptions, prepare_run

    monkeypatch.setenv("FXFUSE_FUSION", "bogus")
    assert prepare_run(RunOptions(backend="eager")).options.backend == "eager"


def test_the_thresholds_variable_is_the_ops():
    from fxfuse.op.decide.thresholds import ENV_THRESHOLDS
    from fxfuse.runner.op_settings import THRESHOLDS_ENV

    assert THRESHOLDS_ENV == ENV_THRESHOLDS


def test_a_good_thresholds_file_passes(tmp_path, monkeypatch):
    from fxfuse.op.decide.thresholds import DEFAULT_PATH
    from fxfuse.runner.op_settings import checked_op_settings, planned_interconnect

    monkeypatch.setenv("FXFUSE_THRESHOLDS", str(DEFAULT_PATH))
    monkeypatch.setenv("FXFUSE_TOPOLOGY", "pcie")
    assert planned_interconnect(checked_op_settings()) == "pcie"
    monkeypatch.setenv("FXFUSE_TOPOLOGY", "nvswitch")
    assert planned_interconnect(checked_op_settings()) == "nvlink"



def _fusion_settings():
    import os

    from fxfuse.op.decide.settings import settings_from_env

    return settings_from_env(os.environ)


def _thresholds():
    from fxfuse.op.decide.thresholds import load_thresholds

    return load_thresholds()


def _native_enabled():
    from fxfuse.op.kernels.native_build import native_enabled

    return native_enabled()


def _native_cache():
    from fxfuse.op.kernels.native_build import cache_dir

    return cache_dir()


def _fp8_gemm():
    from fxfuse.runner.quant_setup import bench_scheme

    return bench_scheme("fp8").fp8_gemm


#: Every FXFUSE_* variable the package reads -> what it decides, read from this process's environment.
READERS = {
    "FXFUSE_FUSION": _fusion_settings, "FXFUSE_MAX_TOKENS": _fusion_settings, "FXFUSE_TOPOLOGY": _fusion_settings,
    "FXFUSE_PCIE_PROFILE": _fusion_settings, "FXFUSE_PCIE_TUNE_CACHE": _fusion_settings,
    "FXFUSE_THRESHOLDS": _thresholds, "FXFUSE_NATIVE": _native_enabled, "FXFUSE_NATIVE_CACHE": _native_cache,
    "FXFUSE_FP8_GEMM": _fp8_gemm,
}


@pytest.mark.parametrize("empty", ["", "  "], ids=["empty", "blank"])
@pytest.mark.parametrize("variable", READERS)
def test_an_empty_setting_counts_as_unset(variable, empty, monkeypatch):
    """One rule for every FXFUSE_* variable (`fxfuse.op.decide.environment.env_setting`): empty is unset, as in most
    tools (`FXFUSE_FUSION=` was refused while `FXFUSE_PCIE_PROFILE=` was taken as unset)."""
    monkeypatch.delenv(variable, raising=False)
    unset = READERS[variable]()
    monkeypatch.setenv(variable, empty)
    assert READERS[variable]() == unset


@pytest.mark.parametrize("variable", sorted(set(READERS) - {"FXFUSE_NATIVE_CACHE"}))  # the run reads that one on CUDA only
def test_a_run_starts_with_an_empty_setting(variable, monkeypatch, capsys):
    import fxfuse.runner.run

    def started(setup):
        raise KeyboardInterrupt  # the checks passed: stop here

    monkeypatch.setattr(fxfuse.runner.run, "run_prepared", started)
    monkeypatch.setenv(variable, "")
    assert main(["run"]) == 130, capsys.readouterr().err


def direct_reads(source: str) -> list[tuple[int, str]]:
    """(line, variable) of each FXFUSE_* variable `source` reads from the environment itself:
    `environ.get(...)`, `environ[...]`, `... in environ`, `os.getenv(...)`, by name or through a module constant."""
    tree = ast.parse(source)
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) for target in node.targets if isinstance(target, ast.Name)}

    def variable(node):
        value = node.value if isinstance(node, ast.Constant) else constants.get(getattr(node, "id", None))
        return value if isinstance(value, str) and value.startswith("FXFUSE_") else None

    def is_environ(node):
        return getattr(node, "attr", getattr(node, "id", None)) == "environ"

    reads = []
    for node in ast.walk(tree):
        keys = []
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute) and (
                (node.func.attr == "get" and is_environ(node.func.value)) or node.func.attr == "getenv"):
            keys = [node.args[0]]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            keys = [node.slice]
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            keys = [node.left]
        reads += [(node.lineno, variable(k)) for k in keys if variable(k)]
    return reads


def test_the_scan_finds_direct_reads():
    source = ('import os\nENV = "FXFUSE_A"\nos.environ.get("FXFUSE_B", "1")\nos.environ[ENV]\n"FXFUSE_C" in os.environ\n'
              'os.getenv("FXFUSE_D")\nos.environ.get("CXX")\n')
    assert direct_reads(source) == [(3, "FXFUSE_B"), (4, "FXFUSE_A"), (5, "FXFUSE_C"), (6, "FXFUSE_D")]


def test_every_fxfuse_variable_is_read_through_env_setting():
    """No module reads an FXFUSE_* variable from the environment itself, and the tests above cover every
    FXFUSE_* name the sources mention."""
    repo = Path(__file__).resolve().parents[1]
    sources = [p for folder in ("fxfuse", "models", "passes") for p in sorted((repo / folder).rglob("*.py"))]
    direct = [f"{path.relative_to(repo)}:{line} {name}" for path in sources for line, name in direct_reads(path.read_text())]
    assert not direct, direct
    named = {name for path in sources for name in re.findall(r"\bFXFUSE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())}
    assert named <= set(READERS), named - set(READERS)
