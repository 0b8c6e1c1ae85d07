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


#: The spellings of an on/off switch (`FXFUSE_NATIVE`).
SWITCH_VALUES = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def switch_setting(name: str, default: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """An on/off variable: `default` when unset; ValueError naming it for a value that is neither."""
    value = env_setting(name, environ)
    if value is None:
        return default
    if value.lower() not in SWITCH_VALUES:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(SWITCH_VALUES)}")
    return SWITCH_VALUES[value.lower()]
