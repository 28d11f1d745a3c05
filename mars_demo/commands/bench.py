"""``bench``: time every decoder on the same prompts and write report.json, an offline HTML report and a table."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from ..cli import (
    UserError,
    add_max_fed_argument,
    add_model_argument,
    add_precision_argument,
    add_sampling_arguments,
    add_tree_argument,
    max_fed_text,
)
from ..engine.backends.hf import compile_passes
from ..engine.backends.placement import choose_host_threads
from ..engine.checkpoints.loading import default_precision, load_model
from ..engine.decoding.config import DecodeConfig, resolve_max_fed
from ..engine.decoding.loop import steady_shapes
from ..engine.decoding.sampling import Sampling
from ..research.benchmark import KNOWN, METHODS, BenchConfig, drift_message, run_benchmark
from ..research.distillation import read_prompts
from ..research.sampled_bench import plan_sampled, run_sampled_benchmark
from ..research.tables import text_table

HELP = "benchmark HF generate, our AR, MARS, batch decoding and prompt lookup: speed and quality"
DEFAULTS = BenchConfig()
SAMPLED_COLUMNS = (
    ("method", "method", "{}"), ("tau", "tau", "{:g}"), ("seeds", "seeds", "{}"), ("tokens", "tokens", "{}"),
    ("tokens_per_second", "tok/s", "{:.1f}"), ("speedup", "speedup", "{:.2f}"),
    ("tokens_per_forward", "tok/pass", "{:.2f}"), ("nll_self", "NLL (mean)", "{:.4f}"),
    ("nll_self_min", "NLL min", "{:.4f}"), ("nll_self_max", "NLL max", "{:.4f}"),
)


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--prompts", type=Path, required=True, help="JSON list of prompts, or one prompt per line")
    parser.add_argument(
        "--taus", default=",".join(f"{t:g}" for t in DEFAULTS.taus), help="comma-separated taus in [0, 1]"
    )
    parser.add_argument(
        "--batch-sizes", default=",".join(map(str, DEFAULTS.batch_sizes)), help="comma-separated batch sizes"
    )
    parser.add_argument(
        "--block-size", type=int, default=None, help="candidates per pass / block size (default: the checkpoint's)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated subset of: " + ", ".join(KNOWN) + " (llama_cpp*: requirements-llama.txt)")
    parser.add_argument(
        "--out", type=Path, default=Path("report.json"), help="report path; the HTML report goes beside it"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--compile", action="store_true",
                        help="CUDA: MARS and AR passes on a static KV cache through torch.compile (CUDA graphs); "
                        "run once with and once without to compare")
    parser.add_argument("--repeats", type=int, default=DEFAULTS.repeats,
                        help="go over the prompts this many times, the methods taking turns throughout: tok/s over "
                        "all of them, and each time's speedup (speedup_range) to show how far one run's ratios move")
    parser.add_argument("--fp32-reference", action="store_true",
                        help="also decode our AR on the fp32 path and add each batch-1 run's agreement with it "
                        "(agreement_fp32): llama.cpp's quantised weights beside ours")
    add_sampling_arguments(parser, seeds=True)
    add_max_fed_argument(parser)
    add_tree_argument(parser)
    add_precision_argument(parser)


def parse_sampling(args: argparse.Namespace) -> tuple[Sampling, tuple[int, ...]]:
    """--temperature, --top-p, --top-k (checked as ``generate`` checks them) and --seeds."""
    try:
        seeds = tuple(dict.fromkeys(int(s) for s in _csv(args.seeds)))
    except ValueError:
        raise UserError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    if not seeds:
        raise UserError("--seeds needs at least one seed")
    try:
        return DecodeConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k).sampling, seeds
    except ValueError as err:
        raise UserError(str(err)) from None


def parse_config(args: argparse.Namespace) -> BenchConfig:
    try:
        taus = tuple(float(t) for t in _csv(args.taus))
    except ValueError:
        raise UserError(f"--taus must be comma-separated numbers in [0, 1], got {args.taus!r}") from None
    try:
        batch_sizes = tuple(int(b) for b in _csv(args.batch_sizes))
    except ValueError:
        raise UserError(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}") from None
    try:
        return BenchConfig(
            taus=taus, batch_sizes=batch_sizes, block_size=args.block_size,
            max_new_tokens=args.max_new_tokens, methods=tuple(_csv(args.methods)), max_fed=args.max_fed,
            tree=getattr(args, "tree", None),
            fp32_reference=getattr(args, "fp32_reference", False), repeats=getattr(args, "repeats", 1),
        )
    except ValueError as err:
        raise UserError(str(err)) from None


def command_line(args: argparse.Namespace, config: BenchConfig) -> str:
    """The command that reproduces this run, every setting spelled out."""
    parts = ["python", "-m", "mars_demo", "bench", "--model", args.model, "--prompts", str(args.prompts),
             "--taus", ",".join(f"{t:g}" for t in config.taus), "--batch-sizes", ",".join(map(str, config.batch_sizes)),
             "--max-new-tokens", str(config.max_new_tokens), "--methods", ",".join(config.methods),
             "--max-fed", max_fed_text(config.max_fed), "--out", str(args.out)]
    if config.tree is not None:
        parts += ["--tree", config.tree]
    optional = (
        ("--precision", args.precision), ("--block-size", args.block_size), ("--limit", args.limit),
        ("--device", args.device), ("--threads", args.threads),
    )
    for flag, value in optional:
        if value is not None:
            parts += [flag, str(value)]
    if getattr(args, "compile", False):
        parts.append("--compile")
    if config.fp32_reference:
        parts.append("--fp32-reference")
    if config.repeats > 1:
        parts += ["--repeats", str(config.repeats)]
    sampling, seeds = parse_sampling(args)
    if not sampling.greedy:
        parts += ["--temperature", f"{sampling.temperature:g}", "--top-p", f"{sampling.top_p:g}",
                  "--top-k", str(sampling.top_k), "--seeds", ",".join(map(str, seeds))]
    return shlex.join(parts)


def run_sampled(args: argparse.Namespace, lm, prompts: list[str], config: BenchConfig) -> int:
    """A sampled bench (research/sampled_bench.py): the JSON report and a table of the seeds pooled."""
    sampling, seeds = parse_sampling(args)
    try:
        report = run_sampled_benchmark(lm, prompts, config, sampling, seeds)
    except ValueError as err:
        raise UserError(str(err)) from None
    report = {"command": command_line(args, config), "argv": sys.argv, **report}
    report["machine"]["compiled_decoding"] = bool(args.compile)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(text_table(report["summary"], SAMPLED_COLUMNS, left=1))
    print(f"\nsampled at temperature {sampling.temperature:g}, top-p {sampling.top_p:g}, top-k {sampling.top_k}, "
          f"seeds {', '.join(map(str, seeds))}; NLL per token under the model, mean over seeds and its spread")
    print(f"\nwrote {args.out}")
    return 0


def run(args: argparse.Namespace) -> int:
    from ..research.report import format_table, write_report

    config = parse_config(args)  # every value checked before the model loads
    sampled = not parse_sampling(args)[0].greedy
    if sampled:
        plan_sampled(config)  # refuses a list of greedy-only methods now, not after the load
        if config.repeats > 1:
            raise UserError("--repeats is for greedy runs; a sampled bench goes over the prompts once a seed (--seeds)")
    if not args.prompts.is_file():
        raise UserError(f"prompts file not found: {args.prompts}")
    prompts = read_prompts(args.prompts)
    if args.limit is not None:
        if args.limit < 1:
            raise UserError(f"--limit must be at least 1, got {args.limit}")
        prompts = prompts[: args.limit]
    if not prompts:
        raise UserError(f"no prompts in {args.prompts}")
    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be at least 1, got {args.threads}")
        choose_host_threads(args.threads)
    lm = load_model(  # auto chooses the path for the smallest batch measured (batch 1: AR's one-token pass)
        args.model, block_size=args.block_size, device=args.device, precision=args.precision or default_precision(),
        rows=1 if sampled else min(config.batch_sizes),  # a sampled bench decodes one sequence at a time
    )
    if args.compile:
        if lm.device.type != "cuda":
            raise UserError("--compile is for CUDA (static cache, CUDA graphs); on a CPU the compute paths apply")
        lm.chosen = compile_passes(lm.model, mode="reduce-overhead", compute=lm.compute)
        shapes = steady_shapes(lm.meta.block_size, resolve_max_fed(config.max_fed, lm.compute))
        print(f"compiling {len(shapes)} decode pass shapes before timing (minutes)", file=sys.stderr, flush=True)
        lm.chosen.warm(shapes)
    if sampled:
        return run_sampled(args, lm, prompts, config)
    report = run_benchmark(lm, prompts, config)
    report = {"command": command_line(args, config), "argv": sys.argv, **report}
    report["machine"]["compiled_decoding"] = bool(args.compile)
    html_path = write_report(report, args.out)
    print(format_table(report["runs"]))
    if report["drifted"]:
        print(f"\nwarning: {drift_message(report['drifted'], lm.compute.path)}")
    profile = report["profile"]["mars"]["ms_per_pass"]
    print(f"\nMARS pass at batch 1, tau {report['profile']['tau']:g}: "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in profile.items()))
    print(f"\nwrote {args.out}" + (f" and {html_path}" if html_path else " (no HTML page: plotly is not installed)"))
    return 0
