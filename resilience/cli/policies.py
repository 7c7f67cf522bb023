"""``cpr policies``: print the effective policy table (SGLANG_POLICIES or a policy file's) and validate the file."""

from __future__ import annotations

import argparse

from resilience.cli.common import CliError, plural

__all__ = ["run_policies"]

_CAPTION = (
    "Requests no entry matches: GET, HEAD, PUT, DELETE, OPTIONS, TRACE are retried on 502/503/504 and transport errors; "
    "POST and PATCH only on failures before sending."
)


def run_policies(args: argparse.Namespace) -> int:
    """Show ``args.file``'s table (over SGLANG_POLICIES with ``args.over_sglang``), or SGLANG_POLICIES; an invalid file is a CliError."""
    from resilience.adapters.sglang import SGLANG_POLICIES
    from resilience.cli.render import POLICY_COLUMNS, make_console, policy_rows, rich_table
    from resilience.errors import ConfigError
    from resilience.policy_files import load_policy_file

    if args.over_sglang and not args.file:
        raise CliError("--over-sglang needs --file", 2)
    if args.file:
        try:
            table = load_policy_file(args.file, base=SGLANG_POLICIES if args.over_sglang else None)
        except ConfigError as exc:
            raise CliError(str(exc)) from None
        title = f"{args.file}{' over SGLANG_POLICIES' if args.over_sglang else ''}: valid, {plural(len(table), 'entry', 'entries')}"
    else:
        table, title = SGLANG_POLICIES, f"SGLANG_POLICIES ({plural(len(SGLANG_POLICIES), 'entry', 'entries')})"
    console = make_console()
    console.print(rich_table(title, POLICY_COLUMNS, policy_rows(table), caption=_CAPTION, wrap=[-1]))
    return 0
