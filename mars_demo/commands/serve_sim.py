"""``serve-sim``: replay seeded arrivals through the serving loop under several tau policies.

Every policy serves the same requests in this process, the policies taking turns pass by pass, on a
simulated clock driven by the measured pass times (mars_demo/research/simulation.py says exactly how).
Prints the totals and writes serve-sim.json and a self-contained serve-sim.html (one curve per policy).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

from tqdm.auto import tqdm

from ..cli import UserError, add_model_argument, add_precision_argument
from ..engine.checkpoints.loading import BUNDLED_BASE, default_precision, load_model
from ..engine.decoding.chat import prompt_ids
from ..engine.decoding.config import VERIFYING_MODES
from ..engine.decoding.surface import read_surface, surface_for
from ..engine.serving.policies import DEFAULT_LADDER, POLICY_HELP, mode_of, parse_policy, split_policies
from ..engine.serving.replay import ARRIVALS, LIMITS, SimConfig
from ..research.distillation import read_prompts
from ..research.machine_record import row_exact
from ..research.simulation import CLOCKS, clock_surface, model_cost, simulate

HELP = "simulate serving: seeded arrivals, continuous batching, tau policies compared (latency, throughput, quality)"
DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "assets" / "data" / "heldout_varied32.json"
MAX_TIME_LIMIT = 3600


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--rate", type=float, required=True, help="mean arrivals per second (above 0)")
    parser.add_argument("--requests", type=int, default=40, help=f"requests per policy (1 to {LIMITS['requests'][1]})")
    parser.add_argument("--policies", default="fixed:1.0,fixed:0.9,adaptive",
                        help=f"comma-separated: {POLICY_HELP}; adaptive = {DEFAULT_LADDER} (requests waiting, tau)")
    parser.add_argument(
        "--arrivals", choices=ARRIVALS, default="poisson", help="poisson, or bursts of 8 at the same mean rate"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch", type=int, default=8, help="most rows decoding at once")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--mode", choices=("mars", "hybrid", "exact"), default="mars")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="prompt pool: JSON list or one per line")
    parser.add_argument("--base", default=BUNDLED_BASE, help="model whose NLL scores the outputs (dNLL)")
    parser.add_argument("--no-quality", action="store_true", help="skip dNLL and agreement (no base model load)")
    parser.add_argument(
        "--time-limit", type=float, default=600, help=f"wall seconds per policy (at most {MAX_TIME_LIMIT})"
    )
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="measured",
                        help="measured: the clock advances by measured pass times; tokens-fed / width-free: "
                        "deterministic cost models on the measured cost surface, this machine's shape (a pass costs "
                        "its rows and width) and a GPU's (a pass costs its rows, whatever its width)")
    parser.add_argument("--surface", type=Path, default=None,
                        help="price the cost-model clocks on the cost surface in this file (a cost-surfaces.json "
                        "entry, e.g. one measured on a GPU) instead of this machine's; needs --clock tokens-fed "
                        "or width-free")
    parser.add_argument(
        "--pass-costs", action="store_true", help="also list the cost surface's ms per pass at rows 1,2,4,8 x width 1-5"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/serve-sim"), help="folder for serve-sim.json and .html")
    add_precision_argument(parser)


def parse_config(args: argparse.Namespace) -> SimConfig:
    policies = tuple(split_policies(args.policies))
    if not 0 < args.time_limit <= MAX_TIME_LIMIT:
        raise UserError(f"--time-limit must be above 0 and at most {MAX_TIME_LIMIT} seconds, got {args.time_limit:g}")
    try:
        return SimConfig(
            rate=args.rate, requests=args.requests, policies=policies, arrivals=args.arrivals, seed=args.seed,
            max_batch=args.max_batch, max_new_tokens=args.max_new_tokens, mode=args.mode,
        )
    except ValueError as err:
        raise UserError(str(err)) from None


def command_line(args: argparse.Namespace) -> str:
    parts = ["python", "-m", "mars_demo", "serve-sim", "--model", args.model, "--rate", f"{args.rate:g}",
             "--requests", str(args.requests), "--policies", args.policies, "--arrivals", args.arrivals,
             "--seed", str(args.seed), "--max-batch", str(args.max_batch), "--max-new-tokens", str(args.max_new_tokens),
             "--mode", args.mode, "--clock", args.clock, "--out", str(args.out)]
    if args.precision:
        parts += ["--precision", args.precision]
    parts += ["--surface", str(args.surface)] if args.surface else []
    parts += ["--pass-costs"] if args.pass_costs else []
    parts += ["--no-quality"] if args.no_quality else []
    return shlex.join(parts)


def given_surface(args: argparse.Namespace) -> tuple | None:
    """--surface's (surface, where it was measured), checked before the model loads."""
    if args.surface is None:
        return None
    if args.clock == "measured":
        raise UserError("--surface prices a cost-model clock: add --clock tokens-fed or --clock width-free")
    try:
        return read_surface(args.surface)
    except ValueError as err:
        raise UserError(str(err)) from None


def lossless_drift(summaries: list[dict], mode: str, exact: bool) -> list[str]:
    """Exact mode gives greedy AR's text whatever the policy and the batch a request shared: where each row is
    computed alone (``exact``: machine_record.row_exact), the exact-mode policies (``mode``, or their own "@exact")
    whose requests' texts differ from fixed:1.0's."""
    if not exact:
        return []
    lossless = [s for s in summaries if mode_of(parse_policy(s["policy"]), mode) == "exact"]
    return [s["policy"] for s in lossless if s.get("agreement") is not None and s["agreement"] < 1.0]


def run(args: argparse.Namespace) -> int:
    from ..research.machine_record import machine
    from ..research.simulation_report import format_totals, pio, write_report

    config = parse_config(args)  # every value checked before the model loads
    if not args.prompts.is_file():
        raise UserError(f"prompts file not found: {args.prompts}")
    elsewhere = given_surface(args)
    lm = load_model(args.model, precision=args.precision or default_precision(), rows=config.max_batch)
    pool = [prompt_ids(lm.tokenizer, p) for p in read_prompts(args.prompts) if p.strip()]
    if not pool:
        raise UserError(f"no prompts in {args.prompts}")
    base = None if args.no_quality else (lm.backend if args.base == args.model else load_model(args.base).backend)
    measured = elsewhere[0] if elsewhere else surface_for(lm)
    if args.clock != "measured" and measured is None:
        raise UserError(f"--clock {args.clock} needs a measured cost surface: pass --precision on a CPU, or --surface")
    pass_cost = model_cost(measured, args.clock) if args.clock != "measured" else None
    surface = clock_surface(pass_cost, args.clock) if pass_cost is not None else measured
    bar = tqdm(total=config.requests * len(config.policies), desc="serve-sim", unit="request")
    result = simulate(lm, config, pool, base=base, deadline=args.time_limit, pass_cost=pass_cost, surface=surface,
                      on_event=lambda name, event: bar.update(len(event.ended)))
    bar.close()
    verifying = config.mode in VERIFYING_MODES
    report = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(args), "argv": sys.argv, "model": lm.name, "machine": machine(lm),
        "clock": CLOCKS[args.clock] + (f" The surface was measured on another machine: {elsewhere[1]}"
                                       if elsewhere else ""),
        "curve_ms": lm.compute.costs_ms if lm.compute else None,
        "surface": surface.record() if surface is not None else None,
        "settings": {**vars(config), "policies": list(config.policies), "block_size": lm.meta.block_size,
                     "prompts": str(args.prompts), "pool": len(pool), "base": None if base is None else args.base,
                     "adaptive": DEFAULT_LADDER, "time_limit_s": args.time_limit, "verifying": verifying,
                     "clock": args.clock},
        **result,
    }
    if args.pass_costs:
        report["pass_costs"] = [
            {"rows": r, "width": w, "tokens": r * w, "ms": round(measured.ms(r, w), 2)}
            for r in (1, 2, 4, 8) for w in (1, 2, 3, 4, 5)
        ] if measured is not None else None
    figures = []
    if pio is not None:  # the page's charts; without plotly the JSON alone
        from ..ui.charts import serving_figures, surface_heatmap

        figures = serving_figures({p["summary"]["policy"]: p["series"] for p in report["policies"]})
        figures += [surface_heatmap(surface)] if surface is not None else []
    report["drifted"] = off = lossless_drift([p["summary"] for p in report["policies"]], config.mode, row_exact(lm))
    json_path, html_path = write_report(report, args.out, figures)
    print(format_totals([p["summary"] for p in report["policies"]]))
    if off:
        print(f"\nwarning: exact mode on the {lm.compute.path} path gives greedy AR's text under any policy, and the "
              f"requests of {', '.join(off)} differ from fixed:1.0's: a kernel or batching bug")
    print(f"\nwrote {json_path}" + (f" and {html_path}" if html_path else " (no HTML page: plotly is not installed)"))
    return 0
