"""A bad FXFUSE_* setting of the fused op is one `fxfuse: error:` line with exit status 2, before any rank
(or any other work) starts, in every command where the op can run: `fxfuse run` (backend fxfuse, the
default), `report`, `bench kernel|fallback|model` and `tune pcie`. The values are parsed by the op's own
parsers (fxfuse.op.settings, fxfuse.op.thresholds), so the message is the one the op would give."""

from __future__ import annotations

import pytest

from fxfuse.cli import main

SETTINGS = [
    ("FXFUSE_FUSION", "bogus", "bad setting FXFUSE_FUSION='bogus': expected one of auto, oneshot, twoshot, pcie, off"),
    ("FXFUSE_TOPOLOGY", "mesh", "bad setting FXFUSE_TOPOLOGY='mesh': expected auto, "),
    ("FXFUSE_MAX_TOKENS", "0", "bad setting FXFUSE_MAX_TOKENS='0': expected a positive integer"),
    ("FXFUSE_MAX_TOKENS", "many", "bad setting FXFUSE_MAX_TOKENS='many': expected a positive integer"),
    ("FXFUSE_PCIE_PROFILE", "nvlink", "bad setting FXFUSE_PCIE_PROFILE='nvlink': expected one of rootcplx, pcieswitch"),
    ("FXFUSE_THRESHOLDS", "{missing}", "bad setting FXFUSE_THRESHOLDS: cannot read thresholds file {missing}"),
    ("FXFUSE_THRESHOLDS", "{invalid}", "bad setting FXFUSE_THRESHOLDS: cannot read thresholds file {invalid}: Expecting"),
    ("FXFUSE_THRESHOLDS", "{foreign}", "bad setting FXFUSE_THRESHOLDS: {foreign}: not a thresholds file"),
]

#: Each command, and the function it would call once its checks passed (module, attribute).
COMMANDS = {
    "run": (["run"], "fxfuse.runner.run", "run_prepared"),
    "report": (["report"], "fxfuse.inspect.site_report", "report_model"),
    "bench kernel": (["bench", "kernel"], "fxfuse.bench.kernel", "main"),
    "bench fallback": (["bench", "fallback"], "fxfuse.bench.fallback", "main"),
    "bench model": (["bench", "model", "--device", "cpu"], "fxfuse.bench.model", "main"),
    "tune pcie": (["tune", "pcie"], "fxfuse.runner.tune_pcie", "main"),
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
    from fxfuse.op.thresholds import ENV_THRESHOLDS
    from fxfuse.runner.op_settings import THRESHOLDS_ENV

    assert THRESHOLDS_ENV == ENV_THRESHOLDS


def test_a_good_thresholds_file_passes(tmp_path, monkeypatch):
    from fxfuse.op.thresholds import DEFAULT_PATH
    from fxfuse.runner.op_settings import checked_op_settings, planned_interconnect

    monkeypatch.setenv("FXFUSE_THRESHOLDS", str(DEFAULT_PATH))
    monkeypatch.setenv("FXFUSE_TOPOLOGY", "pcie")
    assert planned_interconnect(checked_op_settings()) == "pcie"
    monkeypatch.setenv("FXFUSE_TOPOLOGY", "nvswitch")
    assert planned_interconnect(checked_op_settings()) == "nvlink"
