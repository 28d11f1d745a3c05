"""``prompts``: sample distinct user requests from the model itself, split into train and held-out JSON lists."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from ..cli import UserError
from ..engine.checkpoints.loading import BUNDLED_BASE, load_model
from ..research.distillation import sample_prompts

HELP = "sample prompts written by the model itself into DIR/train.json and DIR/heldout.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=BUNDLED_BASE, help=f"model that writes the prompts (default: {BUNDLED_BASE})"
    )
    parser.add_argument("--count", type=int, required=True, help="prompts in all")
    parser.add_argument("--heldout", type=int, default=0, help="how many of them go to heldout.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def split(prompts: list[str], heldout: int, seed: int) -> tuple[list[str], list[str]]:
    """(held-out, train): a seeded shuffle, the first ``heldout`` held out."""
    shuffled = list(prompts)
    random.Random(seed).shuffle(shuffled)
    return shuffled[:heldout], shuffled[heldout:]


def run(args: argparse.Namespace) -> int:
    if args.count < 1 or args.batch_size < 1:
        raise UserError("--count and --batch-size must be at least 1")
    if not 0 <= args.heldout <= args.count:
        raise UserError(f"--heldout must be between 0 and --count ({args.count}), got {args.heldout}")
    lm = load_model(args.model, device=args.device)  # plain fp32
    prompts = sample_prompts(lm, args.count, seed=args.seed, batch_size=args.batch_size)
    heldout, train = split(prompts, args.heldout, args.seed)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, items in (("heldout.json", heldout), ("train.json", train)):
        (args.out_dir / name).write_text(json.dumps(items, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{len(train)} train and {len(heldout)} held-out prompts in {args.out_dir}")
    return 0
