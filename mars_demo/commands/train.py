"""``train``: MARS fine-tuning of a base model on distilled JSONL data (see mars_demo/research/training/)."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from .. import settings
from ..cli import UserError
from ..engine.checkpoints.loading import BUNDLED_BASE, load_model
from ..research.distillation import read_jsonl
from ..research.evaluation import NGRAM, repetition
from ..research.training import OBJECTIVES, Example, TrainConfig, load_examples, train

HELP = "fine-tune a base model for MARS (LoRA by default) on a distilled JSONL file"
DEFAULTS = TrainConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", default=BUNDLED_BASE, help=f"base checkpoint spec (default: {BUNDLED_BASE})")
    parser.add_argument(
        "--data", type=Path, required=True, help="JSONL with prompt_ids and response_ids (from distill)"
    )
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
        help="weight of the clean stream's AR loss (docs/METHOD.md: 1.0); more keeps tau = 1.0 closer to the base",
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
    parser.add_argument(
        "--val-data", type=Path, default=None,
        help="distilled JSONL of held-out prompts (e.g. distill --prompts assets/data/heldout_val64.json): "
        "losses, argmax agreement and an acceptance estimate at tau 0.9, logged to val.jsonl",
    )
    parser.add_argument(
        "--val-every", type=int, default=100,
        help="steps between validations (also before the first and after the last)",
    )
    parser.add_argument("--val-rows", type=int, default=64, help="use at most N rows of --val-data")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def read_distilled(path: Path, max_response_tokens: int, start: int = 0, end: int | None = None) -> list[Example]:
    """Rows ``start:end`` of a distilled JSONL file as training examples (a bad file is a UserError)."""
    try:
        return load_examples(read_jsonl(path)[start:end], max_response_tokens)
    except (KeyError, ValueError) as err:
        raise UserError(f"{path} is not a distilled JSONL file ({err})") from None


def _check(args: argparse.Namespace) -> None:
    """Every flag that can be refused before the model loads."""
    if args.skip_rows < 0:
        raise UserError(f"--skip-rows must be >= 0, got {args.skip_rows}")
    if args.max_rows is not None and args.max_rows < 1:
        raise UserError(f"--max-rows must be >= 1, got {args.max_rows}")
    if args.max_repeat is not None and not 0 <= args.max_repeat <= 1:
        raise UserError(f"--max-repeat is a share of {NGRAM}-grams, between 0 and 1; got {args.max_repeat}")
    if not args.data.is_file():
        raise UserError(f"data file not found: {args.data}")
    if args.init_adapter is not None and not (args.init_adapter / "adapter_config.json").is_file():
        raise UserError(f"--init-adapter {args.init_adapter} holds no adapter_config.json")
    if args.init_adapter is not None and args.full:
        raise UserError("--init-adapter needs LoRA training, not --full")
    if args.val_every < 1 or args.val_rows < 1:
        raise UserError("--val-every and --val-rows must be at least 1")
    if args.val_data is not None and not args.val_data.is_file():
        raise UserError(f"validation file not found: {args.val_data}")
    if args.resume and not (args.out / "checkpoint" / "state.pt").is_file():
        raise UserError(f"nothing to resume: {args.out / 'checkpoint'} holds no checkpoint")


def _report(result, out: Path) -> None:
    """The run's last step and, with --val-data, its last held-out figures."""
    last = result.history[-1] if result.history else None
    if last is not None:
        print(
            f"{result.steps}/{result.total_steps} steps in {result.seconds:.0f} s "
            f"({result.seconds / max(result.steps, 1):.2f} s/step); last loss {last.loss:.3f} "
            f"(noisy {last.noisy_loss:.3f}, AR {last.ar_loss:.3f}); outputs in {out}"
        )
    if result.validation:
        v = result.validation[-1]
        print(
            f"held out (step {v.step}): noisy {v.noisy_loss}, AR {v.ar_loss}, argmax agreement {v.ar_agreement}, "
            f"~{v.tokens_per_pass} tokens/pass at tau {v.tau} with {v.extra_match} of the extra tokens matching; "
            f"the AR head is that sure of {v.ar_sure} of the tokens"
        )


def run(args: argparse.Namespace) -> int:
    config = TrainConfig(
        block_size=args.block_size, lora_rank=None if args.full else args.lora_rank, lora_alpha=args.lora_alpha,
        epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, grad_accum=args.grad_accum,
        max_steps=args.max_steps, max_response_tokens=args.max_response_tokens, save_every=args.save_every,
        ar_weight=args.ar_weight, seed=args.seed, objective=args.objective,
    )  # validates before anything loads
    _check(args)
    end = None if args.max_rows is None else args.skip_rows + args.max_rows
    examples = read_distilled(args.data, config.max_response_tokens, args.skip_rows, end)
    span = f"[{args.skip_rows or ''}:{end or ''}]" if args.skip_rows or end else ""  # the rows used, as a slice
    if args.max_repeat is not None:
        kept = [ex for ex in examples if repetition([ex.response]) <= args.max_repeat]
        dropped = f"{len(examples) - len(kept)} of {len(examples)} rows"
        span += f" without loops (repeated {NGRAM}-grams > {args.max_repeat:g}: {dropped})"
        examples = kept
    if not examples:
        after = f" after row {args.skip_rows}" if args.skip_rows else ""
        raise UserError(f"no usable examples in {args.data}{after}")
    val_examples = None
    if args.val_data is not None:
        val_examples = read_distilled(args.val_data, config.max_response_tokens, 0, args.val_rows)
        if not val_examples:
            raise UserError(f"no usable rows in {args.val_data}")
        shared = {ex.prompt for ex in val_examples} & {ex.prompt for ex in examples}
        if shared:
            raise UserError(
                f"{len(shared)} prompts of {args.val_data} are also in the training rows: "
                "validation needs held-out prompts"
            )
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # peft calls a deprecated name
    lm = load_model(args.base, block_size=config.block_size, device=args.device or launched_device())
    result = train(
        lm, examples, config, args.out, base_spec=args.base, data_path=f"{args.data}{span}",
        init_adapter=args.init_adapter, resume=args.resume,
        val_examples=val_examples, val_every=args.val_every, val_data=str(args.val_data or ""),
    )
    if settings.RANK.read() != "0":
        return 0  # accelerate launch: the main process reports
    _report(result, args.out)
    return 0


def launched_device() -> str | None:
    """Under ``accelerate launch`` on GPUs, this process's own GPU (LOCAL_RANK); else None (the default)."""
    import torch

    local = settings.LOCAL_RANK.read()
    if local is not None and torch.cuda.is_available():
        return f"cuda:{local}"
    return None
