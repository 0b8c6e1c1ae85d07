"""`fxfuse report` through the CLI: it says on stderr what it traces (a line per layer dynamo traces,
a heartbeat while it compiles), and watching the layers changes nothing in the report."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from fxfuse.cli import main
from fxfuse.inspect.site_report import report_model
from fxfuse.models.presets import get_preset


@pytest.mark.slow
def test_report_progress_and_the_same_rows_as_without_it(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["report", "--layers", "2", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert "fxfuse report [" in err and "tracing tiny (2 layers, tp=2) on fake tensors" in err
    assert "dynamo traced layer 1/2" in err and "dynamo traced layer 2/2" in err
    assert ": done in " in err
    document = json.loads(out.read_text())
    unwatched = report_model(get_preset("tiny", layers=2), 2, name="tiny")
    assert document["sites"] == [asdict(row) for row in unwatched.sites]
    assert (document["allreduce_sites"], document["fused_sites"]) == (unwatched.allreduce_sites, unwatched.fused_sites) == (5, 5)
