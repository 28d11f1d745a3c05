"""``settings``: every environment variable the project reads, with its value here; or the docs' tables of them.

The variables are declared in ``mars_demo/settings.py``. Without flags, one line per variable: its value in
this environment (or its default), and every value that cannot be read on stderr (exit code 2), so a host
can check its set-up before it starts the app. ``--markdown`` prints docs/hosting.md's tables; ``--docs FILE``
rewrites the tables in FILE's ``<!-- settings:GROUP -->`` blocks from the declarations.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import settings

HELP = "the environment variables the project reads: each one's value here, or the docs' tables of them"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--markdown", action="store_true", help="print the docs' tables (one per group) instead")
    parser.add_argument("--docs", type=Path, default=None, metavar="FILE",
                        help="rewrite the tables in FILE's <!-- settings:GROUP --> blocks (docs/hosting.md)")


def run(args: argparse.Namespace) -> int:
    if args.docs is not None:
        text = args.docs.read_text(encoding="utf-8")
        args.docs.write_text(settings.fill_tables(text), encoding="utf-8")
        return 0
    if args.markdown:
        print("\n\n".join(f"### {title}\n\n{settings.markdown(group)}" for group, title in settings.GROUPS.items()))
        return 0
    problems = []
    width, on_host = max(len(name) for name in settings.DECLARED), settings.hosted()
    for name, setting in settings.DECLARED.items():
        shown, problem = _value_here(setting, on_host)
        print(f"{name:<{width}}  {shown}")
        if problem:
            problems.append(problem)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2 if problems else 0


def _value_here(setting: settings.Setting, on_host: bool) -> tuple[str, str]:
    """(the value in this environment, as text; why it cannot be read, or "")."""
    value, problem = setting.read_or_default()
    if not setting.raw():
        hosted = on_host and setting.hosted is not settings.SAME
        return f"{setting.default_text(hosted)} (the {'hosted ' if hosted else ''}default)", ""
    return (f"{setting.raw()!r}, which cannot be read" if problem else settings.as_text(value)), problem
