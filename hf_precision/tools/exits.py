"""How a command fails: one line on stderr and the exit code that says why (``--help`` lists
them). Shared by every command of :mod:`hf_precision.tools.cli`.

>>> try:
...     fail("no such folder: ./x")
... except SystemExit as stop:
...     print(stop.code)
2
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

#: exit codes of every command (``--help`` says them): 1 is only ever "violates the policy" /
#: "a dtype or device error was diagnosed"
EXIT_BAD_INPUT = 2  # bad arguments, a source that does not exist or whose config cannot be read
EXIT_BAD_WEIGHTS = 3  # weight files that cannot be read: empty, truncated, corrupt, wrong format


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    print(f"hf-precision: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def bad_weights(path: Path, what: str) -> NoReturn:
    """The one line for a weight file that cannot be read, and its own exit code (3)."""
    fail(f"{path}: cannot read the weights: {what}", EXIT_BAD_WEIGHTS)
