"""``distill``: the base model's own greedy answers to a prompt file, appended to a JSONL training set."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..cli import UserError
from ..engine.checkpoints.loading import BUNDLED_BASE, load_model
from ..research.distillation import distill, read_prompts

HELP = "write the base model's greedy answers to prompts as JSONL training data (resumable)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", default=BUNDLED_BASE, help=f"model that answers (default: {BUNDLED_BASE})")
    parser.add_argument("--prompts", type=Path, required=True, help="JSON list of prompts, or one prompt per line")
    parser.add_argument("--out", type=Path, required=True, help="JSONL to append to; prompts already there are skipped")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise UserError("--max-new-tokens and --batch-size must be at least 1")
    if not args.prompts.is_file():
        raise UserError(f"prompts file not found: {args.prompts}")
    prompts = read_prompts(args.prompts)
    if not prompts:
        raise UserError(f"no prompts in {args.prompts}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    lm = load_model(args.base, device=args.device)  # plain fp32
    written = distill(lm, prompts, args.out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    print(f"{written} new answers appended to {args.out} ({len(prompts) - written} already there)")
    return 0
