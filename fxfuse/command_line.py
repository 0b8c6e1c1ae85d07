"""Argument handling shared by the `fxfuse` command and its benchmarks; imports no torch.

`CommandParser` is an `argparse.ArgumentParser` whose usage errors are one line,
`fxfuse: error: <what is wrong> (see `<command> --help`)`, with exit status 2. `at_least`,
`positive_float` and `int_list` are argument types whose errors name the bad value; `spelled` takes other
spellings of a name (`--dtype bf16` for bfloat16, `--weights bfloat16` for bf16) and `add_dtype_option`
declares a `--dtype` that takes both. `check_output_file`
and `check_output_dir` refuse an output path that cannot be written before any work starts;
`write_json` turns a failed write into a `ValueError` naming the file.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose errors are one `fxfuse: error:` line (exit status 2).

    Long options must be spelled out (no abbreviations), so `--verb` is an error, not `--verbose`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # argparse's hook for every usage error
        """Print `fxfuse: error: <message> (see `<prog> --help`)` to stderr and exit with status 2."""
        self.exit(2, f"fxfuse: error: {message} (see `{self.prog} --help`)\n")


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum} (got {value})")
        return value

    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0 (`0`, `-96`, `nan` and `inf` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0 (got {text!r})")
    return value


def int_list(low: int, high: int) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: comma-separated integers, each in [low, high], e.g. `1,2,4` -> (1, 2, 4)."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        bad = [v for v in values if not low <= v <= high]
        if bad:
            raise argparse.ArgumentTypeError(f"each value must be between {low} and {high} (got {text!r})")
        return values

    return parse


def comma_subset(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: a non-empty comma-separated subset of `allowed`, e.g. `dense` -> ["dense"]."""

    def parse(text: str) -> list[str]:
        values = [part for part in text.split(",") if part]
        if not values or set(values) - set(allowed):
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {', '.join(allowed)}, got {text!r}")
        return values

    return parse


#: Short names of the dtypes `--dtype` takes, and the long name of the `--weights` format bf16. The
#: canonical names (torch's dtype names, the weight formats) are what summaries and JSON files hold.
DTYPE_SPELLINGS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
WEIGHT_SPELLINGS = {"bfloat16": "bf16"}


def spelled(spellings: dict[str, str]) -> Callable[[str], str]:
    """An argparse type: `text` in lower case, another spelling replaced by its canonical name from
    `spellings` (`bf16` -> `bfloat16`); the option's `choices` then check the result."""

    def parse(text: str) -> str:
        name = text.strip().lower()
        return spellings.get(name, name)

    return parse


def add_dtype_option(p: argparse.ArgumentParser, choices: tuple[str, ...], default: str | None, help_text: str) -> None:
    """Declare `--dtype` on `p`: one of `choices` (torch's names), each also taken in its short spelling
    (`DTYPE_SPELLINGS`: bf16, fp16, fp32). `help_text` says what it sets and its default."""
    short = {name: alias for alias, name in DTYPE_SPELLINGS.items()}
    names = [f"{name} ({short[name]})" for name in choices]
    listed = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
    p.add_argument("--dtype", type=spelled(DTYPE_SPELLINGS), choices=choices, default=default, help=f"{listed}: {help_text}")


def check_output_file(path: str | os.PathLike, flag: str) -> None:
    """Raise ValueError unless a file can be written at `path`: not empty, not a directory, its folder
    exists, and the file opens for writing (tried: a new file is created and removed again, so a folder
    that refuses files, such as /proc, is found out now rather than after the work)."""
    if not os.fspath(path):
        raise ValueError(f"{flag}: the path is empty")
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a directory, not a file")
    folder = target.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: directory {str(folder)!r} does not exist")
    created = not target.exists()
    flags = os.O_WRONLY | os.O_NONBLOCK | (os.O_CREAT | os.O_EXCL if created else os.O_APPEND)
    try:
        os.close(os.open(target, flags, 0o644))
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise ValueError(f"{flag} {path}: not writable") from None
        raise ValueError(f"{flag} {path}: cannot {'create' if created else 'open'} the file ({exc.strerror or exc})") from None
    if created:
        target.unlink(missing_ok=True)


def check_output_dir(path: str | os.PathLike, flag: str) -> None:
    """Raise ValueError unless `path` is a writable directory or can be created (its nearest existing
    ancestor is a writable directory). Tried, not only asked of the permission bits: a file is created in
    `path` (a folder in its nearest existing ancestor, if `path` is still to be made) and removed again,
    since root passes every permission check yet cannot create files in folders such as /proc or /sys."""
    folder = Path(path).absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {str(existing)!r} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {str(existing)!r} is not writable")
    try:
        if existing == folder:
            handle, probe = tempfile.mkstemp(prefix=".fxfuse-write-check-", dir=existing)
            os.close(handle)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".fxfuse-write-check-", dir=existing))
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise ValueError(f"{flag} {path}: {str(existing)!r} is not writable") from None
        raise ValueError(f"{flag} {path}: cannot create {'files' if existing == folder else 'folders'} in "
                         f"{str(existing)!r} ({exc.strerror or exc})") from None


def parsed_or_status(parse: Callable[[], Any]) -> tuple[Any, int | None]:
    """Run `parse` (a command's argument parsing and checks): `(args, None)`, or `(None, exit status)`
    after `--help`, a usage error (already printed) or a ValueError (printed as one `fxfuse: error:` line)."""
    try:
        return parse(), None
    except SystemExit as exc:  # --help, or a usage error already printed
        return None, int(exc.code or 0)
    except ValueError as exc:
        print(f"fxfuse: error: {exc}", file=sys.stderr)
        return None, 2


def write_json(path: str | os.PathLike, document: Any) -> None:
    """Write `document` as indented JSON to `path`; a failed write raises ValueError naming the file."""
    try:
        with open(path, "w") as f:
            json.dump(document, f, indent=2)
            f.write("\n")
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc.strerror or exc}") from exc
