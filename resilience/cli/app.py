"""``cpr``: the command line of controlplane-resilience; its subcommands are :data:`_COMMANDS` (``cpr --help`` lists them).

Bad input is one line on stderr and a non-zero exit (2 for bad arguments), never a traceback; abbreviated flags
are refused. A closed output pipe ends the command quietly with :data:`CLOSED_PIPE_EXIT`. Heavy imports happen
inside the subcommand that needs them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import get_args

import resilience
from resilience.cli.common import CliError, OneLineParser, add_router, non_negative_int, port_number, positive_float, positive_int
from resilience.testing.faultplan import FaultKind

__all__ = ["CLOSED_PIPE_EXIT", "build_parser", "main"]

CLOSED_PIPE_EXIT = 128 + signal.SIGPIPE
"""Exit status, with no message, when the reader of stdout or stderr went away (``cpr demo | head -2``): 141, what a
shell reports for every tool SIGPIPE ends (Python's own BrokenPipeError advice exits 1, a failure of the command)."""

_DEMO_SEED = 1
"""The demo's default seed (any seed tells the same story; the same seed injects the same faults)."""


_EXAMPLES = """examples:
  cpr demo                                   8 engines, 20 steps, the old way and ours side by side
  cpr demo --timeline timeline.png           ... and draw one offload/onload across engines (.png or .html)
  cpr demo --router smg                      behind a real smg gateway: smg's own client vs ours
  cpr soak --engines 8 --steps 1000          a long run of ours; is memory flat?
  cpr probe http://127.0.0.1:30000 http://127.0.0.1:30001 --timeout 3
  cpr journal show run.journal               what a restarted controller would resume from
  cpr policies --file my-policies.toml       validate a policy file and show its table
  cpr emulate --port 30000                   one emulated SGLang engine for your own tests
  cpr emulate --engines 64                   64 engines forked from one process, their URLs printed as a list
  cpr emulate --engines 4 --fault-plan plan.yaml
                                             4 engines, each behind a fault proxy playing plan.yaml (the proxies' URLs printed)
  cpr emulate --engines 4 --router smg       4 engines behind a real smg gateway (the gateway's URL printed)
  cpr probe --router smg http://127.0.0.1:30080
                                             the workers an smg gateway lists, each checked at its own URL
"""


def _add_engine(parser: argparse.ArgumentParser, vllm: str) -> None:
    """Add ``--engine sglang|vllm`` (default sglang) to ``parser``; ``vllm``: what ``vllm`` means for this subcommand."""
    parser.add_argument("--engine", choices=("sglang", "vllm"), default="sglang", help=f"vllm: {vllm}; default sglang")


def _demo_arguments(p: OneLineParser) -> None:
    p.add_argument("--seed", type=int, default=_DEMO_SEED, help="seed of the faults and straggler timing (default: %(default)s)")
    p.add_argument("--engines", type=positive_int, default=8, help="emulated engines (default: %(default)s)")
    p.add_argument("--steps", type=positive_int, default=20, help="colocate steps per way (default: %(default)s)")
    p.add_argument("--report", default="cpr-demo-report.json", metavar="FILE", help="JSON report (default: %(default)s)")
    p.add_argument("--metrics-port", type=port_number, default=0, help="serve /metrics on 127.0.0.1:PORT; 0 = a free port (default)")
    p.add_argument(
        "--traces",
        choices=("off", "console", "otlp"),
        default="off",
        help="OpenTelemetry spans: console (one JSON object per span per line, into --traces-file, not into the progress) "
        "or otlp (to OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT, else http://localhost:4318; "
        "an unreachable collector is an error before the run); default off",
    )
    p.add_argument(
        "--traces-file",
        default="cpr-demo-spans.jsonl",
        metavar="FILE",
        help="where --traces console writes its spans, one JSON object per line (default: %(default)s)",
    )
    p.add_argument("--timeline", metavar="FILE", help="draw the offload/onload timeline across engines: .png or .html")
    add_router(p, "run the steps behind a real smg gateway, smg's own client vs ours direct and through SmgFanOut (the [smg] extra)")
    _add_engine(p, "emulated vLLM 0.33.0 engines, SkyRL's sequence (bare gather, no retry, no timeout) against ours")


def _soak_arguments(p: OneLineParser) -> None:
    p.add_argument("--engines", type=positive_int, default=8, help="emulated engines (default: %(default)s)")
    p.add_argument("--steps", type=positive_int, default=100, help="colocate steps (default: %(default)s)")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the faults and straggler timing; with --fault-plan, of the straggler timing only (the plan has its "
        "own seed) (default: 0, or the --fault-plan's seed)",
    )
    p.add_argument(
        "--fault-plan",
        metavar="FILE",
        help="a fault plan instead of the soak's own: .toml, .yaml or .json with `seed`, optional `max_streak` and `rules`, "
        f"each rule a `path` and a `kind` ({', '.join(get_args(FaultKind))}) with its fields "
        "(see resilience.testing.faults.FaultRule)",
    )
    p.add_argument("--way", choices=("ours", "old"), default="ours", help="which loop to run (default: %(default)s)")
    p.add_argument(
        "--restart-every",
        type=non_negative_int,
        default=None,
        metavar="K",
        help="kill the controller every K steps, inside a seeded phase, and start a new one on its journal; 0 = never "
        "(default: 50; with --engine vllm: 0, the only value it takes)",
    )
    _add_engine(
        p,
        "emulated vLLM 0.33.0 engines and cpr demo --engine vllm's loop and faults (no controller kills)",
    )
    p.add_argument(
        "--churn",
        type=positive_int,
        default=None,
        metavar="K",
        help="churn instead of controller kills: every K steps an engine is killed inside an offload and restarted, "
        "a spare joins every K+2 and an engine leaves every 2K+1 (resilience.testing.churn; default: off)",
    )
    p.add_argument("--report", default="cpr-soak-report.json", metavar="FILE", help="JSON report (default: %(default)s)")


def _probe_arguments(p: OneLineParser) -> None:
    p.add_argument("urls", nargs="+", metavar="URL", help="engine base URL, e.g. http://127.0.0.1:30000")
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=3.0,
        help="seconds per check; a paused engine's /health hangs ~20 s (default: %(default)s)",
    )
    p.add_argument("--api-key-env", metavar="VAR", help="send the API key in environment variable VAR as a Bearer token")
    _add_engine(
        p,
        "check vLLM servers instead: /health, /version, /is_paused, /is_sleeping, /weight_info "
        "(none is guarded by vLLM's --api-key, so no key is sent)",
    )
    add_router(
        p,
        "each URL is an smg gateway: its workers (GET /workers, with smg's status of each) are the engines checked "
        "(the checks go to each worker's own URL); healthy only when every worker is ready and answers /health",
    )


def _policies_arguments(p: OneLineParser) -> None:
    p.add_argument("--file", metavar="FILE", help="a policy file to validate and show instead of SGLANG_POLICIES")
    p.add_argument(
        "--over-sglang",
        action="store_true",
        help="show SGLANG_POLICIES with the file's entries added, or overriding the built-in entry they match "
        "(starting from its policy and changing only the fields the file names)",
    )


def _dashboards_arguments(p: OneLineParser) -> None:
    p.add_argument("--out", metavar="DIR", help="the grafana folder to write (default: the repository's grafana/)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs from a fresh generation")


def _journal_arguments(p: OneLineParser) -> None:
    jsub = p.add_subparsers(dest="journal_command", metavar="ACTION", parser_class=OneLineParser, required=True)
    show = jsub.add_parser("show", help="print the journal's records and the engines' last state")
    show.add_argument("path", metavar="PATH", help="the journal file")
    show.add_argument("--last", type=positive_int, default=None, metavar="N", help="only the last N rows of records (default: all)")


_COMMANDS: dict[str, tuple[str, str, Callable[[OneLineParser], None] | None]] = {
    "demo": (
        "the colocate loop under the seed's faults, the old way and ours, side by side",
        "Run colocated RL steps (rollout with stragglers, offload, training pause, onload, weight sync) on "
        "emulated SGLang engines behind fault proxies, once the old way and once ours, and compare them in a table.",
        _demo_arguments,
    ),
    "soak": (
        "the colocate loop for many steps, with RSS sampled each step",
        "Run the colocate loop for many steps on emulated engines behind fault proxies; sample the RSS of "
        "this process and of the engines each step and report whether memory stayed flat.",
        _soak_arguments,
    ),
    "probe": (
        "read-only checks of real engines (exit 0 only if all healthy)",
        "Check SGLang engines without changing them (never pauses, flushes or releases): /health, /ready, "
        "/model_info, /v1/loads, /server_info, all engines at once, one attempt per check.",
        _probe_arguments,
    ),
    "emulate": ("run emulated SGLang engines: one, or --engines N (see cpr emulate --help)", "", None),
    "policies": (
        "print the effective policy table; validate a policy file",
        "Print SGLANG_POLICIES, or the table a policy file (.toml, .yaml) gives, as a table. "
        "An invalid file is one line naming the field and the rule it broke, and exit 1.",
        _policies_arguments,
    ),
    "dashboards": (
        "regenerate grafana/ (dashboard JSON and alert rules), or --check it",
        "Run the grafana.dashboard generator: write the dashboard into DIR/dashboards and the alert rules into DIR/rules.",
        _dashboards_arguments,
    ),
    "journal": (
        "show a barrier journal: its records and what a restarted controller would resume from",
        "Read a barrier journal (Orchestrator(..., journal=PATH)) without taking its lock: every record "
        "(why it was written, each engine's state and facts), then each engine as a controller started on it would know it.",
        _journal_arguments,
    ),
}
"""Each subcommand: its ``cpr --help`` line, its own ``--help`` description, what adds its arguments (None: the
emulator's parser reads them); each but ``emulate`` runs as ``resilience.cli.<command>.run_<command>(args)``."""


def build_parser() -> OneLineParser:
    """The ``cpr`` argument parser (``emulate`` passes its arguments to the emulator's own parser)."""
    parser = OneLineParser(
        prog="cpr",
        description="Resilient HTTP control planes for colocated RL training with SGLang.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"cpr {resilience.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    parser.set_defaults(_subparsers=sub.choices)
    for name, (help_line, description, add_arguments) in _COMMANDS.items():
        if add_arguments is None:
            sub.add_parser(name, help=help_line, add_help=False)
        else:
            add_arguments(sub.add_parser(name, help=help_line, description=description))
    return parser


def _dispatch(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"resilience.cli.{args.command}")
    run: Callable[[argparse.Namespace], int] = getattr(module, f"run_{args.command}")
    return run(args)


def _quiet_after_closed_pipe() -> int:
    """Point stdout and stderr at /dev/null (so the interpreter's last flush has nowhere to fail) and return 141."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):  # a stream without a file descriptor
                os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)
    return CLOSED_PIPE_EXIT


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``cpr`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status (141 when the output pipe closed)."""
    try:
        return _main(argv)
    except BrokenPipeError:
        return _quiet_after_closed_pipe()


def _main(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["emulate"]:
        from resilience.cli.emulate import run_emulate, run_emulate_vllm
        from resilience.testing.emulator.server import engine_kind

        return (run_emulate_vllm if engine_kind(args_list[1:]) == "vllm" else run_emulate)(args_list[1:])
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(args_list)
        if extra:  # name the subcommand whose flags were wrong, not "cpr"
            (args._subparsers.get(args.command) or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, or a one-line argument error
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    prog = f"cpr {args.command}"
    try:
        return _dispatch(args)
    except CliError as exc:
        print(f"{prog}: error: {exc.message}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away: main() ends quietly
        raise
    except Exception as exc:  # a bug or an environment problem: still one line, the traceback only on request
        if os.environ.get("CPR_DEBUG"):
            raise
        text = " ".join(str(exc).split())[:300]
        print(f"{prog}: error: {type(exc).__name__}: {text} (set CPR_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1
