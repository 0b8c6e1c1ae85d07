"""How `fxfuse run` (and the benchmarks built on its launcher) end early; imports no torch.

`RunError`: the run cannot start (bad option, model or machine), raised before any rank starts;
`RankFailed`: a rank raised, raised in the launching process with that rank's traceback;
`Terminated`: the launching process got SIGTERM (raised by the handler the `fxfuse` command installs,
so the launcher stops its ranks on the way out).
"""

from __future__ import annotations


class RunError(ValueError):
    """A run that cannot start: bad option, model or machine; the message says which."""


class RankFailed(RuntimeError):
    """Raised in the launching process when a rank failed.

    `rank` is the failing rank (None if unknown), `error` the one-line `Type: message` of the
    exception it raised and `traceback` its full traceback text. `killed_for_memory` says that a rank
    ended by SIGKILL without reporting, as the kernel's out-of-memory killer ends processes; the
    command then says what of its options would need less memory.
    """

    def __init__(self, message: str, rank: int | None = None, error: str = "", traceback_text: str = "",
                 killed_for_memory: bool = False):
        super().__init__(message)
        self.rank = rank
        self.error = error or message
        self.traceback = traceback_text
        self.killed_for_memory = killed_for_memory


class Terminated(BaseException):
    """Raised by the `fxfuse` command's SIGTERM handler. A BaseException, like KeyboardInterrupt, so no
    `except Exception` on the way swallows it; the launcher stops the ranks as it passes."""
