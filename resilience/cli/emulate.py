"""``cpr emulate``: run emulated SGLang (or, with ``--engine vllm``, vLLM 0.33.0) engines, arguments checked by the
emulator's own parser first.

``--engine vllm`` takes vLLM's flags where vLLM has them; ``VLLM_SERVER_DEV_MODE`` comes from the environment, and
``--engines N`` forks N engines from the shared zygote. ``--fault-plan FILE`` (SGLang only) puts a
:class:`~resilience.testing.faults.FaultProxy` playing the plan in front of each engine: the ``EMULATOR READY
<url>`` lines give the proxies' URLs (``--port P`` puts them on P, P+1, ...) and stderr each engine's own.
``--router smg`` registers the engines with a real smg gateway on 127.0.0.1 (the ``[smg]`` extra): one READY line
gives the gateway's URL (``--port P`` puts it on P). SIGINT or SIGTERM stops the gateway, proxies and engines.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from resilience.cli.common import OneLineParser, add_router, plural

if TYPE_CHECKING:
    from resilience.testing.emulator import EmulatedFleet, EngineConfig
    from resilience.testing.faults import FaultPlan

__all__ = ["run_emulate", "run_emulate_vllm"]

T = TypeVar("T")


def _parser() -> argparse.ArgumentParser:
    from resilience.testing.emulator.server import build_parser as emulator_parser

    parser = emulator_parser("cpr emulate")
    parser.__class__ = OneLineParser  # same parser, one-line errors
    parser.add_argument(
        "--fault-plan",
        metavar="FILE",
        help="put a fault proxy on 127.0.0.1 in front of each engine, playing the fault plan FILE (.toml, .yaml, .json: "
        "a seed and rules, see resilience.testing.faults.FaultPlan); the READY lines then give the proxies' URLs and "
        "--port P puts the proxies on P, P+1, ... (default: no proxy)",
    )
    add_router(parser, "register the engines with a real smg gateway on 127.0.0.1 and print its URL (the [smg] extra)")
    return parser


def run_emulate(argv: Sequence[str]) -> int:
    """Check ``argv`` with the emulator's own parser (errors in one line, exit 2), then hand over to it (or serve behind proxies)."""
    from resilience.testing.emulator import main as emulator_main
    from resilience.testing.emulator.config import config_from_namespace

    parser = _parser()

    def check(args: argparse.Namespace) -> EngineConfig:
        config = config_from_namespace(args)
        _check_port(parser, args.port)
        smg = args.router == "smg"
        if args.fault_plan is not None or smg:
            option = "--router smg" if smg else "--fault-plan"
            for flag, given in (("--host", args.host != "127.0.0.1"), ("--exit-with-parent", args.exit_with_parent is not None)):
                if given:
                    parser.error(f"argument {option}: not with {flag} (the engines serve on 127.0.0.1 until a signal)")
            proxied = args.engines if args.fault_plan is not None and not smg else 1  # ports the READY lines take
            if args.engines < 1 or (args.port and args.port + proxied - 1 > 65535):
                parser.error(f"argument --engines: must be >= 1 and fit ports {args.port}.. below 65536, but was {args.engines}")
        return config

    parsed = _parse(parser, argv, check)
    if isinstance(parsed, int):
        return parsed
    args, config = parsed
    if args.fault_plan is None and args.router == "direct":
        return emulator_main(_without_router(argv), prog="cpr emulate")
    return _serve_fleet(args, config)


def _parse(
    parser: argparse.ArgumentParser, argv: Sequence[str], check: Callable[[argparse.Namespace], T]
) -> tuple[argparse.Namespace, T] | int:
    """``argv`` parsed by ``parser`` and what ``check(args)`` gives (it may call ``parser.error``); or the exit status:
    0 after ``--help``, 2 after a one-line error (a ValueError from ``check`` is printed as one)."""
    try:
        args = parser.parse_args(list(argv))
        return args, check(args)
    except SystemExit as exc:  # --help, or a one-line argument error
        return exc.code if isinstance(exc.code, int) else 0
    except ValueError as exc:
        print(f"cpr emulate: error: {exc}", file=sys.stderr)
        return 2


def _check_port(parser: argparse.ArgumentParser, port: int) -> None:
    if not 0 <= port <= 65535:
        parser.error(f"argument --port: must be a port number 0..65535, but was {port}")


def _without_router(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--router direct`` (the emulator's own parser does not take it)."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == "--router" and i + 1 < len(argv):
            skip = True
        elif not arg.startswith("--router="):
            out.append(arg)
    return out


def _serve_fleet(args: argparse.Namespace, config: EngineConfig) -> int:
    """Start ``args.engines`` engines, a fault proxy in front of each (``--fault-plan``) and an smg gateway in front of
    them all (``--router smg``); serve until SIGINT/SIGTERM."""
    from resilience.testing.emulator import EmulatedFleet
    from resilience.testing.emulator.serve_many import ProgressPrinter, stop_on_signal
    from resilience.testing.faults import FaultPlan, FaultPlanError
    from resilience.testing.smg import smg_available

    smg = args.router == "smg"
    if smg and not smg_available():
        print("cpr emulate: error: --router smg needs smg: pip install 'controlplane-resilience[smg]'", file=sys.stderr)
        return 2
    try:
        plan = None if args.fault_plan is None else FaultPlan.load(args.fault_plan)
    except FaultPlanError as exc:
        print(f"cpr emulate: error: bad --fault-plan: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    with stop_on_signal() as stop:
        fleet = EmulatedFleet(
            args.engines,
            config,
            startup_timeout=args.startup_timeout,
            progress=ProgressPrinter(),
            log_level=args.log_level,
            memory_state_dir=args.memory_state_dir,
        )
        try:
            return _serve_behind(stop, args, fleet, plan, smg)
        finally:
            fleet.stop()


def _serve_behind(stop: threading.Event, args: argparse.Namespace, fleet: EmulatedFleet, plan: FaultPlan | None, smg: bool) -> int:
    """Start ``fleet``, its fault proxies (``plan``) and the smg gateway (``smg``); serve until ``stop``; the exit status."""
    from resilience.testing.emulator import EmulatorStartError
    from resilience.testing.emulator.serve_many import serve_until
    from resilience.testing.faults import FaultProxy
    from resilience.testing.smg import SmgGateway, SmgStartError

    proxies: list[FaultProxy] = []
    gateway: SmgGateway | None = None
    try:
        try:
            fleet.start()
        except EmulatorStartError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"cpr emulate: error: the engines did not start: {first}", file=sys.stderr)
            return 1
        fronts = [engine.direct_url for engine in fleet.engines]  # what stands in front of each engine
        if plan is not None:
            for engine in fleet.engines:
                port = args.port + engine.index if args.port and not smg else 0
                proxy = FaultProxy(engine.direct_url, plan, engine.index, port=port)
                proxies.append(proxy)
                try:
                    proxy.start()
                except OSError as exc:
                    print(f"cpr emulate: error: cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}", file=sys.stderr)
                    return 1
            fronts = [proxy.url for proxy in proxies]
            print(f"fault plan {args.fault_plan}: seed {plan.seed}, {plural(len(plan.rules), 'rule')}", file=sys.stderr)
        for engine, front in zip(fleet.engines, fronts, strict=True):
            behind = f" behind fault proxy {front}" if proxies else ""
            print(f"engine {engine.index}: {engine.direct_url}{behind}", file=sys.stderr)
        if smg:
            gateway = SmgGateway(fronts, port=args.port)
            try:
                gateway.start()
            except SmgStartError as exc:
                print(f"cpr emulate: error: the smg gateway did not start: {str(exc).splitlines()[0]}", file=sys.stderr)
                return 1
            print(f"smg gateway {gateway.url} (pid {gateway.pid}) in front of {plural(len(fronts), 'engine')}", file=sys.stderr)
        return serve_until(stop, fleet, [gateway.url] if gateway is not None else fronts if proxies else [], log_lines=0)
    finally:
        if gateway is not None:
            gateway.stop()
        for proxy in proxies:
            proxy.stop()


def run_emulate_vllm(argv: Sequence[str]) -> int:
    """Check ``argv`` (which holds ``--engine vllm``) with the vLLM emulator's parser (one-line errors, exit 2), then serve."""
    from resilience.testing.emulator.server import build_parser
    from resilience.testing.emulator.server import main as emulator_main
    from resilience.testing.emulator.vllm.config import vllm_config_from_namespace

    parser = build_parser("cpr emulate", "vllm")
    parser.__class__ = OneLineParser  # same parser, one-line errors
    add_router(parser, "SGLang engines only (smg 1.13.0 fans out SGLang's routes)")

    def check(args: argparse.Namespace) -> None:
        if args.router == "smg":
            parser.error("argument --router: smg is for SGLang engines only (smg 1.13.0 fans out SGLang's routes)")
        vllm_config_from_namespace(args).resolved_dev_mode()  # a bad VLLM_SERVER_DEV_MODE is named too
        _check_port(parser, args.port)

    parsed = _parse(parser, argv, check)
    if isinstance(parsed, int):
        return parsed
    return emulator_main(_without_router(argv), prog="cpr emulate")
