"""The tested torch range (issue 40): declared once, in pyproject.toml's torch requirement; read back from the
installed metadata at run time; one warning per process on any other torch, naming the range; the README and
DEVELOPERS.md say the same range."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from fxfuse import torch_support
from fxfuse.torch_support import describe_range, supported_torch, unsupported_torch_message

REPO = Path(__file__).resolve().parents[1]


def _declared() -> SpecifierSet:
    """pyproject.toml's torch requirement (its one line `"torch..."` among the dependencies)."""
    (torch,) = re.findall(r'^\s*"torch([<>=!~][^"]*)"', (REPO / "pyproject.toml").read_text(), flags=re.M)
    return SpecifierSet(torch)


def test_the_range_has_an_upper_bound_and_the_metadata_is_pyprojects():
    declared = _declared()
    assert any(s.operator == "<" for s in declared) and any(s.operator == ">=" for s in declared)
    assert supported_torch() == declared  # the installed package's metadata: re-run scripts/dev after editing pyproject


def test_the_documents_state_the_declared_range():
    words = f"torch {describe_range(_declared())}"
    for document in ("README.md", "DEVELOPERS.md"):
        assert words in (REPO / document).read_text(), (document, words)


@pytest.mark.parametrize("version, warned", [("2.11.0", False), ("2.13.0+cpu", False), ("2.15.0+cu132", False),
                                             ("2.10.2", True), ("2.16.0", True), ("2.16.0.dev20261201", True)])
def test_only_a_torch_outside_the_range_is_warned_about(version, warned):
    message = unsupported_torch_message(version, SpecifierSet(">=2.11,<2.16"))
    assert (message is not None) == warned
    if warned:
        assert "tested on torch 2.11 to 2.15" in message and f"torch {version} is installed" in message


def test_the_backend_warns_once_per_process(monkeypatch, caplog):
    from fxfuse.backend import FxfuseBackend

    monkeypatch.setattr(torch_support, "supported_torch", lambda: SpecifierSet(">=2.0,<2.1"))
    torch_support.warn_if_untested.cache_clear()
    with caplog.at_level(logging.WARNING, logger="fxfuse.torch_support"):
        FxfuseBackend(inner="eager")
        FxfuseBackend(inner="eager")
    torch_support.warn_if_untested.cache_clear()
    warnings = [r.getMessage() for r in caplog.records if r.name == "fxfuse.torch_support"]
    assert len(warnings) == 1 and "fxfuse was tested on torch 2.0 to 2.0" in warnings[0]
