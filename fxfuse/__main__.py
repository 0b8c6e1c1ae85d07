"""`python -m fxfuse` runs the command-line interface (same as the `fxfuse` script)."""

from fxfuse.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
