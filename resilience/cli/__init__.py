"""``cpr``: the command line, one module per subcommand (``app`` holds the parser and ``main``).

Only this package and ``resilience.testing`` may import ``resilience.testing``.
"""

from resilience.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
