"""``python -m resilience.testing.emulator``: run one emulated SGLang engine."""

from __future__ import annotations

import sys

from .server import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
