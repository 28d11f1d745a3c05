"""``bench`` at a temperature: the single-sequence decoders, sampled, over several seeds (docs/METHOD.md,
"Sampling without loss").

Sampled outputs differ from run to run, so there is no greedy reference to agree with. A sampled bench
reports what sampling leaves comparable, per seed and over the seeds: tokens per second, tokens per
forward pass, the speedup over AR sampling, and the NLL per token of the outputs under the model that
decoded them (``nll_self``, teacher-forced, pooled over the prompts). Exact mode's outputs are distributed
as AR sampling's, so its NLL should fall within the seed-to-seed spread of AR's (``nll_self_min`` to
``nll_self_max``); MARS's is what its confidence acceptance costs.

Methods: ``ar``, ``mars`` (at each tau) and ``mars_exact``; the others are greedy-only here and are left
out with one line. Every run is warmed up first. For each seed the methods take turns prompt by prompt
(the first of the turn rotating), as benchmark.run_group does; prompt i under seed s decodes with the
seed ``s * SEED_STRIDE + i``, the same for every method.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from tqdm.auto import tqdm

from ..engine.checkpoints.loading import LoadedModel
from ..engine.decoding.chat import prompt_ids
from ..engine.decoding.config import DecodeConfig, resolve_max_fed
from ..engine.decoding.metrics import per_forward, per_second, speedup
from ..engine.decoding.sampling import Sampling
from .benchmark import BenchConfig, Outcome, nll_per_token, run_single
from .evaluation import Scorer
from .machine_record import machine

logger = logging.getLogger(__name__)

SAMPLED = ("ar", "mars", "mars_exact")
MODES = {"ar": "ar", "mars": "mars", "mars_exact": "exact"}
SEED_STRIDE = 100_003  # prompt i under seed s: s * SEED_STRIDE + i


@dataclass(frozen=True)
class SampledJob:
    method: str
    tau: float


def plan_sampled(config: BenchConfig) -> list[SampledJob]:
    """ar first (every speedup is over it), then mars at each tau, then mars_exact; methods not asked for left out."""
    taus = tuple(dict.fromkeys(config.taus))
    jobs = [SampledJob(m, t) for m in SAMPLED if m in config.methods for t in (taus if m == "mars" else (1.0,))]
    if not jobs:
        raise ValueError(f"at a temperature bench runs {', '.join(SAMPLED)}; none of them was asked for")
    skipped = [m for m in config.methods if m not in SAMPLED and m != "hf_generate"]
    if skipped:
        logger.warning("left out at a temperature (greedy only): %s", ", ".join(skipped))
    return jobs


def decode_config(job: SampledJob, config: BenchConfig, sampling: Sampling, seed: int, max_new: int) -> DecodeConfig:
    return DecodeConfig(
        mode=MODES[job.method], tau=job.tau, block_size=config.block_size, max_new_tokens=max_new,
        max_fed=config.max_fed, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        seed=seed, tree=config.tree if MODES[job.method] == "exact" else None,
    )


def run_seed(
    lm: LoadedModel, jobs: list[SampledJob], ids: list[list[int]], config: BenchConfig, sampling: Sampling,
    seed: int, tick: Callable[[int], object],
) -> dict[SampledJob, Outcome]:
    """Every job over every prompt under ``seed``, taking turns prompt by prompt."""
    outcomes = {job: Outcome() for job in jobs}
    for i, prompt in enumerate(ids):
        first = i % len(jobs)
        for job in jobs[first:] + jobs[:first]:
            decode = decode_config(job, config, sampling, seed * SEED_STRIDE + i, config.max_new_tokens)
            outcomes[job].add(run_single(lm, [prompt], decode, tick))
    return outcomes


def seed_row(job: SampledJob, seed: int, outcome: Outcome, scorer: Scorer) -> dict:
    tokens = sum(map(len, outcome.outputs))
    return {
        "method": job.method, "tau": job.tau, "seed": seed, "prompts": len(outcome.outputs), "tokens": tokens,
        "seconds": round(outcome.seconds, 4),
        "tokens_per_second": round(per_second(tokens, outcome.seconds), 3),
        "forward_passes": outcome.forward_passes,
        "tokens_per_forward": round(per_forward(tokens, sum(outcome.row_passes)), 4),
        "nll_self": round(nll_per_token(scorer, outcome.outputs), 5),
    }


def pooled_rows(rows: Sequence[dict]) -> list[dict]:
    """One row per (method, tau) over the seeds: rates pooled, NLL as the mean over seeds and its spread."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["method"], row["tau"]), []).append(row)
    out = []
    for (method, tau), items in groups.items():
        tokens, seconds = sum(r["tokens"] for r in items), sum(r["seconds"] for r in items)
        nlls = [r["nll_self"] for r in items]
        out.append({
            "method": method, "tau": tau, "seeds": len(items), "tokens": tokens, "seconds": round(seconds, 4),
            "tokens_per_second": round(per_second(tokens, seconds), 3),
            "tokens_per_forward": round(per_forward(tokens, sum(r["forward_passes"] for r in items)), 4),
            "nll_self": round(statistics.fmean(nlls), 5), "nll_self_min": min(nlls), "nll_self_max": max(nlls),
            "nll_self_std": round(statistics.stdev(nlls), 5) if len(nlls) > 1 else 0.0,
        })
    ar = next((r for r in out if r["method"] == "ar"), None)
    for row in out:
        gain = speedup(row["tokens_per_second"], ar["tokens_per_second"]) if ar else None
        row["speedup"] = round(gain, 4) if gain is not None else None
        row["nll_within_ar_spread"] = ar["nll_self_min"] <= row["nll_self"] <= ar["nll_self_max"] if ar else None
    return out


def run_sampled_benchmark(
    lm: LoadedModel, prompts: list[str], config: BenchConfig, sampling: Sampling, seeds: Sequence[int], *,
    progress: bool = True,
) -> dict:
    """Every sampled job on ``prompts`` (chat template applied) once per seed; the report (a dict)."""
    if sampling.greedy:
        raise ValueError("a sampled bench needs a temperature above 0")
    if not prompts or not seeds:
        raise ValueError("a sampled bench needs prompts and at least one seed")
    ids = [prompt_ids(lm.tokenizer, p) for p in prompts]
    jobs = plan_sampled(config)
    for job in jobs:  # warm-up, untimed
        run_single(lm, ids[:1], decode_config(job, config, sampling, 0, config.warmup_tokens))
    scorer, rows = Scorer(lm.backend, ids), []
    bar = tqdm(total=len(seeds) * len(jobs) * len(ids), desc="bench (sampled)", unit="prompt", disable=not progress)
    for seed in seeds:
        bar.set_postfix_str(f"seed {seed}")
        for job, outcome in run_seed(lm, jobs, ids, config, sampling, seed, bar.update).items():
            rows.append(seed_row(job, seed, outcome, scorer))
            logger.info("%s", rows[-1])
    bar.close()
    return {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": lm.name,
        "machine": machine(lm),
        "settings": {
            **asdict(config), **asdict(sampling), "seeds": list(seeds), "prompts": len(prompts),
            "block_size": config.block_size or lm.meta.block_size,
            "max_fed_resolved": resolve_max_fed(config.max_fed, lm.compute),
        },
        "runs": rows,
        "summary": pooled_rows(rows),
    }
