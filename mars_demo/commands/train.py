"""``train``: MARS fine-tuning of a base model on distilled JSONL data (see mars_demo/training.py)."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from ..cli import UserError
from ..data import read_jsonl
from ..evaluation import NGRAM, repetition
from ..loading import BUNDLED_BASE, load_model
from ..training import OBJECTIVES, TrainConfig, load_examples, train

HELP = "fine-tune a base model for MARS (LoRA by default) on a distilled JSONL file"
DEFAULTS = TrainConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", default=BUNDLED_BASE, help=f"base checkpoint spec (default: {BUNDLED_BASE})")
    parser.add_argument("--data", type=Path, required=True, help="JSONL with prompt_ids and response_ids (from distill)")
    parser.add_argument(
        "--skip-rows", type=int, default=0,
        help="leave out the first N rows of --data (e.g. the rows an --init-adapter was trained on)",
    )
    parser.add_argument(
        "--max-rows", type=int, default=None,
        help="use at most N rows (after --skip-rows): a stage stays reproducible as --data grows",
    )
    parser.add_argument(
        "--max-repeat", type=float, default=None, metavar="SHARE",
        help=f"leave out rows whose response repeats more than SHARE of its {NGRAM}-grams (the base model's loops)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory (adapter, logs, checkpoint)")
    parser.add_argument("--block-size", type=int, default=DEFAULTS.block_size, help="MARS block size B")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--lora-rank", type=int, default=DEFAULTS.lora_rank, help="LoRA rank on every linear layer")
    kind.add_argument("--full", action="store_true", help="train every weight instead of a LoRA adapter")
    parser.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: the rank)")
    parser.add_argument("--epochs", type=float, default=DEFAULTS.epochs)
    parser.add_argument("--lr", type=float, default=DEFAULTS.lr, help="peak learning rate (3%% warm-up, cosine decay)")
    parser.add_argument(
        "--ar-weight", type=float, default=DEFAULTS.ar_weight,
        help="weight of the clean stream's AR loss (METHOD.md: 1.0); more keeps tau = 1.0 closer to the base",
    )
    parser.add_argument(
        "--objective", choices=OBJECTIVES, default=DEFAULTS.objective,
        help="mars (default), or ar: the paper's AR-SFT baseline on the same data (clean stream only)",
    )
    parser.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size)
    parser.add_argument("--grad-accum", type=int, default=DEFAULTS.grad_accum, help="micro-batches per optimizer step")
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: from --epochs)")
    parser.add_argument("--max-response-tokens", type=int, default=DEFAULTS.max_response_tokens)
    parser.add_argument("--save-every", type=int, default=DEFAULTS.save_every, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue the interrupted run in --out")
    parser.add_argument("--init-adapter", type=Path, default=None, help="start from this adapter's weights")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def run(args: argparse.Namespace) -> int:
    config = TrainConfig(
        block_size=args.block_size, lora_rank=None if args.full else args.lora_rank, lora_alpha=args.lora_alpha,
        epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, grad_accum=args.grad_accum,
        max_steps=args.max_steps, max_response_tokens=args.max_response_tokens, save_every=args.save_every,
        ar_weight=args.ar_weight, seed=args.seed, objective=args.objective,
    )  # validates before anything loads
    if args.skip_rows < 0:
        raise UserError(f"--skip-rows must be >= 0, got {args.skip_rows}")
    if args.max_rows is not None and args.max_rows < 1:
        raise UserError(f"--max-rows must be >= 1, got {args.max_rows}")
    if args.max_repeat is not None and not 0 <= args.max_repeat <= 1:
        raise UserError(f"--max-repeat is a share of {NGRAM}-grams, between 0 and 1; got {args.max_repeat}")
    end = None if args.max_rows is None else args.skip_rows + args.max_rows
    if not args.data.is_file():
        raise UserError(f"data file not found: {args.data}")
    if args.init_adapter is not None and not (args.init_adapter / "adapter_config.json").is_file():
        raise UserError(f"--init-adapter {args.init_adapter} holds no adapter_config.json")
    if args.init_adapter is not None and args.full:
        raise UserError("--init-adapter needs LoRA training, not --full")
    if args.resume and not (args.out / "checkpoint" / "state.pt").is_file():
        raise UserError(f"nothing to resume: {args.out / 'checkpoint'} holds no checkpoint")
    try:
        rows = read_jsonl(args.data)[args.skip_rows : end]
        examples = load_examples(rows, config.max_response_tokens)
    except (KeyError, ValueError) as err:
        raise UserError(f"{args.data} is not a distilled JSONL file ({err})") from None
    span = f"[{args.skip_rows or ''}:{end or ''}]" if args.skip_rows or end else ""  # the rows used, as a slice
    if args.max_repeat is not None:
        kept = [ex for ex in examples if repetition([ex.response]) <= args.max_repeat]
        dropped = f"{len(examples) - len(kept)} of {len(examples)} rows"
        span += f" without loops (repeated {NGRAM}-grams > {args.max_repeat:g}: {dropped})"
        examples = kept
    if not examples:
        after = f" after row {args.skip_rows}" if args.skip_rows else ""
        raise UserError(f"no usable examples in {args.data}{after}")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # peft calls a deprecated name
    lm = load_model(args.base, block_size=config.block_size, device=args.device)
    result = train(
        lm, examples, config, args.out, base_spec=args.base, data_path=f"{args.data}{span}",
        init_adapter=args.init_adapter, resume=args.resume,
    )
    last = result.history[-1] if result.history else None
    if last is not None:
        print(
            f"{result.steps}/{result.total_steps} steps in {result.seconds:.0f} s "
            f"({result.seconds / max(result.steps, 1):.2f} s/step); last loss {last.loss:.3f} "
            f"(noisy {last.noisy_loss:.3f}, AR {last.ar_loss:.3f}); outputs in {args.out}"
        )
    return 0
