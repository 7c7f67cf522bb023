"""``cpr``: the command line of controlplane-resilience, one module per subcommand.

``app`` holds the parser and ``main``; ``demo``, ``soak``, ``probe``, ``emulate``,
``policies`` and ``dashboards`` run one subcommand each; ``fleet`` is the emulated
fleet runner ``demo`` and ``soak`` share; ``render``, ``story``, ``timeline`` and
``watch`` show what happened; ``common`` has the one-line errors and argument types.
Only this package and ``resilience.testing`` may import ``resilience.testing``.
"""

from resilience.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
