"""``python -m mars_demo COMMAND``: one entry point; each command lives in ``mars_demo/commands/``.

Every command module exposes ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. A user error (bad flag value, unknown model, empty prompt)
is one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

from . import commands
from .engine.backends.cpu.paths import PRECISION_ENV, PRECISIONS
from .engine.checkpoints.loading import BUNDLED, ModelLoadError
from .engine.decoding.config import DecodeConfig
from .engine.decoding.tree_shape import parse_tree


class UserError(Exception):
    """Bad input from the user: reported as one line, exit code 2."""


def command_modules() -> dict:
    found = {}
    for info in pkgutil.iter_modules(commands.__path__):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        if hasattr(module, "run"):
            found[info.name.replace("_", "-")] = module
    return found


def add_model_argument(parser: argparse.ArgumentParser, flag: str = "--model") -> None:
    parser.add_argument(flag, default=BUNDLED, help=f"checkpoint spec (default: the bundled {BUNDLED})")


def max_fed_value(text: str) -> int | str | None:
    """argparse type of ``--max-fed``: auto, none, or an integer of at least 2."""
    if text in ("auto", "none"):
        return None if text == "none" else "auto"
    if not text.isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"expected auto, none or an integer of at least 2, got {text!r}")
    return int(text)


def add_max_fed_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-fed", type=max_fed_value, default="auto", metavar="{auto,none,N}",
        help="how wide a MARS pass is: auto = each pass's width priced on the measured CPU compute path's cost "
        "(for expected tokens per ms; batches: the cost surface), the full window on a GPU; none = always B-1 "
        "masks, as in the paper; N = at most N tokens fed (accepted + masks) (default: auto)",
    )


def tree_value(text: str) -> str | None:
    """argparse type of ``--tree``: none (a chain), auto, or a shape such as 2,1,1 (DecodeConfig.tree's message)."""
    value = None if text == "none" else text
    try:
        parse_tree(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def add_tree_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tree", type=tree_value, default=None, metavar="{none,auto,SHAPE}",
        help="exact and hybrid modes, one sequence (at a temperature exact mode only): verify a tree of the masks' "
        "candidates. none = a chain "
        "(default); auto = the shape by expected tokens per ms on the measured cost curve (a chain where width "
        "costs, as on most CPUs); SHAPE = candidates per depth, e.g. 2,1,1",
    )


def add_sampling_arguments(parser: argparse.ArgumentParser, seeds: bool = False) -> None:
    """--temperature, --top-p, --top-k and --seed (``seeds``: --seeds, several); DecodeConfig checks the values."""
    defaults = DecodeConfig()
    parser.add_argument("--temperature", type=float, default=defaults.temperature,
                        help="0 = greedy; above 0 every mode samples (exact: distributed as AR sampling)")
    parser.add_argument("--top-p", type=float, default=defaults.top_p,
                        help="sample from the smallest set of tokens whose probability reaches P, 0 < P <= 1 (1 = off)")
    parser.add_argument("--top-k", type=int, default=defaults.top_k, help="sample from the K most likely (0 = off)")
    if seeds:
        parser.add_argument("--seeds", default="0", help="comma-separated seeds: one run per seed when sampling")
    else:
        parser.add_argument("--seed", type=int, default=None, help="seed for sampling")


def add_precision_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--precision", choices=PRECISIONS, default=None,
        help="CPU compute path: auto measures fp32, bf16, int8 (weight-only) and int8dyn (int8 x int8, per-row "
        "activation scales) on this machine once and picks the fastest that keeps quality "
        f"(default: ${PRECISION_ENV}, else auto)",
    )


def max_fed_text(value: int | str | None) -> str:
    return "none" if value is None else str(value)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (exit code 2), not the whole usage."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m mars_demo", description="MARS multi-token generation: decode, train, evaluate, benchmark."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in sorted(command_modules().items()):
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return command_modules()[args.command].run(args) or 0
    except (UserError, ModelLoadError, ValueError, FileNotFoundError) as err:
        if args.verbose:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
