"""``eval``: MARS at several tau against its tau = 1.0 output, the AR decoder and the base model.

Prints one table row per tau and writes the full report (figures, definitions,
every output) as JSON with ``--out``. The figures are defined in mars_demo/engine/decoding/metrics.py and
mars_demo/research/evaluation.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..cli import UserError, add_max_fed_argument, add_model_argument, add_precision_argument
from ..engine.checkpoints.loading import BUNDLED_BASE, default_precision, load_model
from ..research.distillation import read_prompts
from ..research.evaluation import DEFAULT_TAUS, EvalConfig, evaluate
from ..research.tables import text_table

HELP = "evaluate MARS speed and quality per tau against tau = 1.0, the AR decoder and the base model"
DEFAULTS = EvalConfig()
NLL_TARGET = 0.02  # tau = 1.0 should lose at most this much NLL per token against the base model

COLUMNS = (  # (key, header, format)
    ("tau", "tau", "{:.2f}"),
    ("tokens_per_forward", "tok/fwd", "{:.2f}"),
    ("tokens_per_second", "tok/s", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("extra_ar_match", "extra=AR", "{:.3f}"),
    ("extra_tokens", "extras", "{:d}"),
    ("agreement", "agree", "{:.3f}"),
    ("exact_match", "exact", "{:.2f}"),
    ("nll_base", "NLL base", "{:.3f}"),
    ("delta_nll_base", "dNLL base", "{:+.4f}"),
    ("delta_nll_self", "dNLL self", "{:+.4f}"),
    ("repeated_ngrams", "rep4", "{:.3f}"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--prompts", type=Path, required=True, help="JSON list of prompts, or one prompt per line")
    parser.add_argument(
        "--taus", default=",".join(str(t) for t in DEFAULT_TAUS),
        help="comma-separated tau values; 1.0 (the reference) is always run",
    )
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N prompts")
    parser.add_argument(
        "--base", default=BUNDLED_BASE, help=f"model whose NLL scores the outputs (default: {BUNDLED_BASE})"
    )
    parser.add_argument("--block-size", type=int, default=None, help="candidates per pass (default: the checkpoint's)")
    parser.add_argument("--out", type=Path, default=None, help="write the full report here as JSON")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up decodes (timings then include it)")
    add_max_fed_argument(parser)
    add_precision_argument(parser)


def parse_taus(text: str) -> tuple[float, ...]:
    try:
        taus = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise UserError(f"--taus must be comma-separated numbers, got {text!r}") from None
    if not taus:
        raise UserError("--taus needs at least one value")
    return taus


def table(report: dict) -> str:
    """The per-tau rows, the AR baseline line and the tau = 1.0 quality line, as plain text."""
    lines = [text_table(report["taus"], COLUMNS)]
    ar = report["ar"]
    diff = report["tau1_vs_base_nll"]
    verdict = "within" if diff <= NLL_TARGET else "OUTSIDE"
    lines += [
        "",
        (f"model {report['model']} (block size {report['block_size']}), base {report['base']}, "
         f"{report['prompts']} prompts, up to {report['max_new_tokens']} new tokens, {report['device']}"),
        (f"AR decoder: {ar['tokens']} tokens in {ar['seconds']:.2f} s ({ar['tokens_per_second']:.1f} tok/s); "
         f"tau = 1.0 output equals it on {report['tau1_equals_ar']:.0%} of prompts"),
        (f"NLL per token under the base: tau = 1.0 {report['tau1_nll']:.4f}, base greedy "
         f"{report['base_greedy_nll']:.4f}, tau1_vs_base_nll {diff:+.4f} ({verdict} the {NLL_TARGET} target)"),
        (f"base greedy output: rep4 {report['base_greedy_repeated_ngrams']:.3f}; this model's teacher-forced argmax "
         f"reproduces {report['base_argmax_agreement']:.1%} of its tokens"),
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        config = EvalConfig(
            taus=parse_taus(args.taus), max_new_tokens=args.max_new_tokens, block_size=args.block_size,
            warmup=not args.no_warmup, max_fed=args.max_fed,
        )
    except ValueError as err:
        raise UserError(str(err)) from None
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be at least 1, got {args.limit}")
    if not args.prompts.is_file():
        raise UserError(f"prompts file not found: {args.prompts}")
    prompts = read_prompts(args.prompts)[: args.limit]
    if not prompts:
        raise UserError(f"no prompts in {args.prompts}")
    if any(not p.strip() for p in prompts):
        raise UserError("a prompt is empty")
    lm = load_model(args.model, block_size=args.block_size, precision=args.precision or default_precision())
    base = lm if args.base == args.model else load_model(args.base)  # the scorer: plain fp32 weights
    report = evaluate(lm, base, prompts, config)
    print(table(report), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {args.out}", flush=True)
    return 0
