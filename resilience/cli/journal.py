"""``cpr journal show PATH``: a barrier journal in a readable form (every record, then each engine as the journal leaves it).

It reads the file without taking its lock, so it may run beside the controller that writes it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from resilience.cli.common import CliError
from resilience.cli.errors_text import safe_url

__all__ = ["run_journal"]


def _facts_cell(facts: dict[str, Any]) -> str:
    parts = []
    if facts.get("released"):
        parts.append("released " + ",".join(facts["released"]))
    if facts.get("unknown"):
        parts.append("unknown " + ",".join(facts["unknown"]))
    if facts.get("holds"):
        parts.append("held by " + ",".join(sorted(set(facts["holds"].values()))))
    if facts.get("in_flight"):
        parts.append(f"in flight: {facts['in_flight']}")
    if facts.get("dead"):
        parts.append(f"dead: {facts['dead']}")
    if facts.get("retired"):
        parts.append("retired")
    return "; ".join(parts) or "-"


def run_journal(args: argparse.Namespace) -> int:
    """Print ``args.path``'s records (``--last N`` of them) and the engines' final state; exit 1 when it cannot be read."""
    from resilience.barrier.journal import FORMAT, knowledge_from
    from resilience.barrier.journal_store import JournalCorrupt, unframe
    from resilience.cli.render import make_console, rich_table

    path = Path(args.path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read journal {path}: {exc.strerror or exc}") from None
    not_ours = CliError(f"{path} is not a barrier journal (no {FORMAT} header)")
    try:
        loaded = unframe(data, str(path))
    except JournalCorrupt as exc:  # a damaged record that is not a torn tail: named, as a controller would refuse it
        raise (not_ours if exc.record == 0 else CliError(str(exc))) from None
    try:
        records = [json.loads(r) for r in loaded.records]
    except ValueError:
        raise not_ours from None
    if not records or not isinstance(records[0], dict) or records[0].get("k") != "header" or records[0].get("format") != FORMAT:
        raise not_ours
    header = records[0]
    console = make_console()
    rows: list[list[str]] = []
    final: dict[str, dict[str, Any]] = {}
    for i, rec in enumerate(records[1:], start=1):
        for name, facts in sorted(rec.get("engines", {}).items()):
            final[name] = facts
            state = str(knowledge_from(name, facts).state)
            stamp = time.strftime("%H:%M:%S", time.localtime(rec.get("t", 0)))
            rows.append([str(i), stamp, str(rec.get("why", "")), safe_url(name), state, _facts_cell(facts)])
    shown = rows[-args.last :] if args.last else rows
    by = header.get("by", {})
    title = (
        f"journal {path}: {len(records)} record(s) for {len(header.get('engines', []))} engine(s), "
        f"started by pid {by.get('pid')} on {by.get('host')}"
        + (f" (last {len(shown)} of {len(rows)} rows)" if len(shown) < len(rows) else "")
    )
    console.print(rich_table(title, ["#", "time", "why", "engine", "state", "facts"], shown, wrap=[-1]))
    now = [[safe_url(n), str(knowledge_from(n, f).state), _facts_cell(f)] for n, f in sorted(final.items())]
    never = [[safe_url(n), "serving", "no record yet"] for n in header.get("engines", []) if n not in final]
    console.print(rich_table("what a controller started on this journal would know", ["engine", "state", "facts"], now + never, wrap=[-1]))
    if loaded.dropped:
        console.print(f"note: {loaded.dropped}")
    return 0
