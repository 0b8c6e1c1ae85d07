"""Which tests this session runs: a module fixture that does the work of several tests in one spawn does
only the selected tests' part (`-m "not slow"`, `-k`, a node id), so the fast loop stays fast."""

from __future__ import annotations

import pytest


def selected(request: pytest.FixtureRequest, test_name: str) -> bool:
    """Whether the session runs the test function `test_name` of the requesting fixture's module (any of
    its parametrized cases)."""
    module = request.module
    return any(getattr(item, "module", None) is module and getattr(item, "originalname", None) == test_name
               for item in request.session.items)
