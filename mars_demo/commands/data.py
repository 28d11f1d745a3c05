"""``data``: the bundled adapter's training set, built chunk by chunk so any prefix of the work is usable.

Chunk c samples prompts with seed ``seed + c`` (so every chunk is reproducible on
its own), holds out every ``heldout_every``-th chunk, and distils the model's
greedy answers for the rest at once. Re-running continues after the last chunk
on disk, so the job can stop at any moment and go on in a later session; the
held-out prompts never reach the training file and are listed in ``heldout.json``
for ``eval`` and ``bench``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..cli import UserError
from ..engine.checkpoints.loading import BUNDLED_BASE, load_model
from ..research.distillation import distill, read_jsonl, sample_prompts

HELP = "sample prompts and distil the base model's answers, chunk by chunk (resumable)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=BUNDLED_BASE, help=f"model that writes prompts and answers (default: {BUNDLED_BASE})"
    )
    parser.add_argument("--out-dir", type=Path, required=True, help="gets prompts.jsonl and distill.jsonl")
    parser.add_argument("--chunks", type=int, required=True, help="chunks in all (existing ones count)")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--heldout-every", type=int, default=10, help="chunk c is held out when c %% N == 0")
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32, help="distillation batch size")
    parser.add_argument(
        "--sample-batch-size", type=int, default=32,
        help="prompt-sampling batch size; each batch shares one opener, "
             "so smaller batches mean more kinds of request per chunk",
    )


def run(args: argparse.Namespace) -> int:
    counts = (
        args.chunks, args.chunk_size, args.heldout_every, args.max_new_tokens, args.batch_size, args.sample_batch_size
    )
    if min(counts) < 1:
        raise UserError(
            "--chunks, --chunk-size, --heldout-every, --max-new-tokens and the batch sizes must be at least 1"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    prompts_path, distill_path = args.out_dir / "prompts.jsonl", args.out_dir / "distill.jsonl"
    rows = read_jsonl(prompts_path)
    seen = {row["prompt"] for row in rows}
    start = max((row["chunk"] for row in rows), default=-1) + 1
    lm = load_model(args.model)  # plain fp32, nothing to measure: data is decoded as trained
    for chunk in range(start, args.chunks):
        split = "heldout" if chunk % args.heldout_every == 0 else "train"
        sampled = sample_prompts(lm, args.chunk_size, seed=args.seed + chunk, batch_size=args.sample_batch_size)
        fresh = [p for p in sampled if p not in seen]
        if split == "train":
            distill(lm, fresh, distill_path, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
        with open(prompts_path, "a", encoding="utf-8") as sink:  # written last: a chunk on disk is a finished chunk
            sink.writelines(
                json.dumps({"prompt": prompt, "chunk": chunk, "split": split}, ensure_ascii=False) + "\n"
                for prompt in fresh
            )
        seen.update(fresh)
    heldout = [row["prompt"] for row in read_jsonl(prompts_path) if row["split"] == "heldout"]
    (args.out_dir / "heldout.json").write_text(
        json.dumps(heldout, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    print(f"{len(seen)} prompts in {prompts_path} ({len(heldout)} held out in heldout.json); answers in {distill_path}")
    return 0
