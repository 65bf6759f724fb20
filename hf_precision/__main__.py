"""``python -m hf_precision``: the ``hf-precision`` command (:mod:`hf_precision.tools.cli`)."""

from __future__ import annotations

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
