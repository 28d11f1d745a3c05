"""``validate``: a one-minute, teacher-forced preview of ``eval`` on distilled held-out rows.

One forward pass per batch of rows in the training layout ([noisy | clean]) gives
the held-out losses, how often the model's greedy choice is still the row's token
(on rows distilled from the base: agreement with the base), and, per tau, the tokens
a decoding pass would accept at every full block with the share of its extra tokens
that match the row; beside them, how sure the AR head itself is of the row's tokens
(which soft-bounds what the masks can accept). See ``mars_demo.research.training.Validation``;
``train --val-data`` logs the same figures during training.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from ..cli import UserError, add_model_argument, add_precision_argument
from ..engine.checkpoints.loading import load_model
from ..engine.decoding.chat import pad_id
from ..engine.decoding.config import check_tau
from ..research import candidate_trees
from ..research.tables import text_table
from ..research.training import TrainConfig, validate
from .eval import parse_taus
from .train import read_distilled

HELP = "teacher-forced held-out losses, agreement with the data and accepted tokens per pass, in one forward per batch"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    add_precision_argument(parser)
    parser.add_argument(
        "--data", type=Path, required=True,
        help="distilled JSONL of held-out prompts (e.g. assets/data/heldout_val64.jsonl)",
    )
    parser.add_argument("--taus", default="0.95,0.9,0.7", help="comma-separated tau values for the acceptance estimate")
    parser.add_argument("--rows", type=int, default=None, help="use only the first N rows")
    parser.add_argument("--block-size", type=int, default=None, help="candidates per pass (default: the checkpoint's)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print one JSON object per tau instead of a table")
    parser.add_argument(
        "--trees", action="store_true",
        help="also: each mask's top-k hit rates and exact mode's expected tokens per pass and per ms for chains and "
             "trees of the masks' candidates, on the compute path's cost curve (docs/METHOD.md, \"Candidate trees\")",
    )


def run(args: argparse.Namespace) -> int:
    taus = tuple(check_tau(tau) for tau in parse_taus(args.taus))  # before the model loads
    if (args.rows is not None and args.rows < 1) or args.batch_size < 1:
        raise UserError("--rows and --batch-size must be at least 1")
    if not args.data.is_file():
        raise UserError(f"data file not found: {args.data}")
    examples = read_distilled(args.data, TrainConfig().max_response_tokens, 0, args.rows)
    if not examples:
        raise UserError(f"no usable rows in {args.data}")
    lm = load_model(args.model, block_size=args.block_size, precision=args.precision)
    block = lm.meta.block_size
    ranks: list | None = [] if args.trees else None
    results = validate(
        lm.model, examples, lm.meta.mask_token_id, pad_id(lm.tokenizer), block, taus=taus, batch_size=args.batch_size,
        ranks=ranks,
    )
    if args.trees:
        return print_trees(lm, torch.cat(ranks) if ranks else torch.empty(0, block - 1, dtype=torch.long), args.json)
    if args.json:
        for result in results:
            print(json.dumps({"model": lm.name, "block_size": block, "rows": len(examples)} | asdict(result)))
        return 0
    first = results[0]
    print(f"model {lm.name} (block size {block}), {len(examples)} rows of {args.data}")
    print(f"held-out loss: noisy {first.noisy_loss}, AR {first.ar_loss}; greedy choice = the row's token on "
          f"{first.ar_agreement:.1%} of tokens; the AR head gives the row's token {first.ar_confidence:.3f} on average")
    columns = [("tau", "tau", "{:.2f}"), ("tokens_per_pass", "tok/pass", "{:.3f}"),
               ("extra_match", "extra=row", "{:.3f}"), ("ar_sure", "AR sure", "{:.3f}"),
               ("ar_path_tokens_per_pass", "AR path", "{:.3f}")]
    columns += [(f"cand {j}", f"cand {j}", "{:.3f}") for j in range(2, block + 1)]
    rows = [asdict(r) | dict(zip([f"cand {j}" for j in range(2, block + 1)], r.reach or [])) for r in results]
    print(text_table(rows, columns))
    print("AR sure: share of the row's tokens the AR head gives >= tau. "
          "AR path: tok/pass if every mask were exactly as\n"
          "sure as the AR head is of the row's path to its token. cand j: share of passes that accept candidate j.")
    return 0


def print_trees(lm, ranks: torch.Tensor, as_json: bool) -> int:
    """``--trees``: hit rates per depth, then the best chains and trees on the measured cost curve."""
    if not len(ranks):
        raise UserError("no full block in these rows: nothing to measure trees on")
    costs = lm.compute.costs_ms if lm.compute is not None else None
    results = candidate_trees.evaluate(ranks, lm.meta.block_size, costs)
    chain, tree = candidate_trees.best(results, chains=True), candidate_trees.best(results, chains=False)
    if as_json:
        print(json.dumps({"model": lm.name, "passes": len(ranks), "costs_ms": costs,
                          "hits": candidate_trees.hit_rates(ranks), "shapes": [asdict(s) for s in results]}))
        return 0
    print(f"{len(ranks)} passes; where the row's token stands in each mask's distribution:")
    print(text_table(candidate_trees.hit_rates(ranks), [(k, k, "{}") for k in
                                                        ("depth", "top1", "top2", "top3", "top1_after_top1")]))
    where = f"on {lm.compute.path}'s measured curve" if costs else "no cost curve (--precision for one)"
    print(f"\nexact mode's verifying pass by shape ({where}); the best 8, then the best chain and tree:")
    columns = [("shape", "shape", "{}"), ("nodes", "nodes", "{}"), ("tokens_per_pass", "tok/pass", "{:.3f}"),
               ("tokens_per_ms", "tok/ms", "{}")]
    print(text_table([asdict(s) for s in results[:8]] + [asdict(chain), asdict(tree)], columns))
    if costs:
        print(f"best tree over best chain: {tree.tokens_per_ms / chain.tokens_per_ms:.3f}x tokens per ms")
    return 0
