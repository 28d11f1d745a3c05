"""``generate``: decode prompts with MARS or the AR baseline and print the text or JSON lines."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli import (
    UserError,
    add_max_fed_argument,
    add_model_argument,
    add_precision_argument,
    add_sampling_arguments,
    add_tree_argument,
)
from ..engine.backends.cpu.paths import ComputePath
from ..engine.checkpoints.loading import default_precision, load_model
from ..engine.decoding.config import METRICS, MODES, DecodeConfig
from ..engine.decoding.loop import Generation, collect, generate
from ..research.distillation import read_prompts

HELP = "generate text with MARS (or the AR baseline) and show what each forward pass accepted"
DEFAULTS = DecodeConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt")
    source.add_argument("--prompts-file", type=Path, help="JSON list of prompts, or one prompt per line")
    parser.add_argument("--mode", choices=MODES, default=DEFAULTS.mode)
    parser.add_argument(
        "--tau", type=float, default=DEFAULTS.tau, help="acceptance threshold in [0, 1]; 1.0 = one token per pass"
    )
    parser.add_argument("--block-size", type=int, default=None, help="candidates per pass (default: the checkpoint's)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    parser.add_argument("--metric", choices=METRICS, default=DEFAULTS.metric)
    add_sampling_arguments(parser)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--mask-token", default=None, help="mask token, for a checkpoint that does not record one")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own code to run")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    add_max_fed_argument(parser)
    add_tree_argument(parser)
    add_precision_argument(parser)


def record(prompt: str, result: Generation, model: str, compute: ComputePath | None = None) -> dict:
    stats = result.stats
    return {
        "prompt": prompt,
        "text": result.text,
        "token_ids": result.token_ids,
        "steps": [
            {
                "tokens": list(s.token_ids),
                "confidences": [round(c, 6) for c in s.confidences],
                "origins": list(s.origins),
                **({"branches": list(s.branches), "shape": list(s.shape)} if s.shape or s.branches else {}),
                "tau": s.tau, "seconds": round(s.seconds, 6),
            }
            for s in result.steps
        ],
        "forward_passes": stats.forward_passes,
        "tokens_per_forward": round(stats.tokens_per_forward, 4),
        "tokens_per_second": round(stats.tokens_per_second, 3),
        "seconds": round(stats.seconds, 6),
        "finish_reason": stats.finish_reason,
        "model": model,
        "compute_path": compute.record() if compute is not None else None,
    }


def run(args: argparse.Namespace) -> int:
    config = DecodeConfig(
        mode=args.mode, tau=args.tau, block_size=args.block_size, max_new_tokens=args.max_new_tokens,
        metric=args.metric, temperature=args.temperature, stop=tuple(args.stop), seed=args.seed,
        max_fed=args.max_fed, top_p=args.top_p, top_k=args.top_k, tree=args.tree,
    )  # validates every value before the model loads
    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            raise UserError(f"prompts file not found: {args.prompts_file}")
        prompts = read_prompts(args.prompts_file)
        if not prompts:
            raise UserError(f"no prompts in {args.prompts_file}")
    else:
        prompts = [args.prompt]
    if any(not p.strip() for p in prompts):
        raise UserError("the prompt is empty")
    lm = load_model(
        args.model, block_size=args.block_size, mask_token=args.mask_token,
        trust_remote_code=args.trust_remote_code, precision=args.precision or default_precision(),
    )
    for prompt in prompts:
        result = collect(generate(lm, prompt, config))
        if args.json:
            print(json.dumps(record(prompt, result, lm.name, lm.compute), ensure_ascii=False), flush=True)
        else:
            print(result.text, flush=True)
            if len(prompts) > 1:
                print(flush=True)
        s = result.stats
        print(
            f"[{args.mode}] {s.tokens} tokens, {s.forward_passes} passes, {s.tokens_per_forward:.2f} tokens/forward, "
            f"{s.tokens_per_second:.1f} tokens/s", file=sys.stderr,
        )
    return 0
