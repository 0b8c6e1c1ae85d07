"""How fxfuse reads its FXFUSE_* environment variables: one rule for all of them.

`env_setting(name, environ)` is the value of one variable with surrounding blanks removed, or None when
it is unset or empty (`FXFUSE_FUSION=` means the same as no FXFUSE_FUSION, as in most tools). Every
FXFUSE_* variable the package reads goes through it (the op's settings, its thresholds file, its C++
fallback's switch and cache folder, the FP8 GEMM choice); tests/test_cli_settings.py checks that none
is read another way. Imports nothing else of fxfuse, and no torch.
"""

from __future__ import annotations

import os
from typing import Mapping


def env_setting(name: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """The value of the variable `name` in `environ` without surrounding blanks; None if unset or empty."""
    return (environ.get(name) or "").strip() or None
