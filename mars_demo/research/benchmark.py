"""Benchmark: every decoder on the same prompts, model, device and dtype, warmed up, quality beside speed.

Runs (method, tau, batch size), each over all prompts:
  ar                this project's AR decoder (decoding.loop.stream, mode "ar"): the reference (batch 1)
  hf_generate       transformers ``generate``, greedy, KV cache, transformers' own forward on the same weights
  mars              MARS sliding window (decoding.loop.stream) at each tau
  mars_exact        exact mode (decoding.loop.stream, mode "exact"): greedy AR's output in fewer passes
  prompt_lookup     transformers prompt-lookup decoding: the training-free peer (batch 1 only)
  ar_batch          transformers ``generate`` with left padding, at each batch size > 1
  ar_batch_ours     decoding.batch.token_passes with window 1: our batched greedy AR
  mars_batch        block-level batch decoder (the paper's scheme) at each tau
  mars_batch_token  token-level batch decoder at each tau
  exact_batch       token-level batch decoder in exact mode: greedy AR's output, batched
  llama_cpp*        llama.cpp on the bundled GGUF, only when named (llama_cpp.py); llama_cpp and llama_cpp_q4 at
                    every batch size (batched AR's peers)
The token-level runs choose each pass's width with the width controller on the measured cost
surface (decoding/width.py; ``--max-fed none`` feeds the full window), recorded in ``machine``.

Figures per run: tokens_per_second, tokens_per_forward, speedup (over the faster AR run at the
same batch size, named in ``speedup_over``), delta_nll_self and agreement, as decoding/metrics.py
defines them, against our AR's outputs on the same backend and path (BENCHMARKS.md, "Columns"; docs/cli.md,
"bench", for how ``generate`` is compared); our batch decoders' runs add ``passes_by_fed`` and ``tail_share``.
Each run is warmed up (same code path, first prompts, a few tokens) before it is timed. The runs of
one batch size take turns prompt by prompt (batch by batch), so a drift in the machine's speed
slows them alike (``run_group``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..engine.decoding.batch import BatchEvent, collect_batch, stream_batch_ids
from ..engine.decoding.batch.rows import left_pad
from ..engine.decoding.chat import pad_id, prompt_ids
from ..engine.decoding.commit import commit_tokens
from ..engine.decoding.config import DecodeConfig, check_tau, resolve_max_fed
from ..engine.decoding.loop import collect, eos_ids, stream_ids
from ..engine.decoding.metrics import agreement, exact_match, per_forward, per_second, speedup
from ..engine.decoding.surface import surface_for
from ..engine.model import LoadedModel
from . import llama_cpp
from .evaluation import Scorer, pooled_nll
from .machine_record import machine, row_exact
from .profile import profile_passes, sync

logger = logging.getLogger(__name__)

SINGLE = ("hf_generate", "ar", "mars", "mars_exact", "prompt_lookup")
BATCHED = ("ar_batch", "ar_batch_ours", "mars_batch", "mars_batch_token", "exact_batch")
METHODS = SINGLE + BATCHED
KNOWN = METHODS + llama_cpp.METHODS  # llama.cpp's run only when named (an optional install)
AR_METHODS = ("hf_generate", "ar", "ar_batch", "ar_batch_ours")
TAU_METHODS = ("mars", "mars_batch", "mars_batch_token")
# Greedy methods that must return our AR's text token for token wherever every row is computed alone (the CPU
# engine's paths but fp32: docs/METHOD.md, "CPU compute paths"); elsewhere rounding may part them
LOSSLESS = ("ar_batch_ours", "exact_batch", "mars_exact")
SCHEME = {"ar_batch_ours": "token", "mars_batch": "block", "mars_batch_token": "token", "exact_batch": "token"}


@dataclass(frozen=True)
class BenchConfig:
    """What to run. Batch methods run at every batch size above 1; ar always runs (the reference)."""

    taus: tuple[float, ...] = (1.0, 0.95, 0.9, 0.8, 0.7)
    batch_sizes: tuple[int, ...] = (1, 4, 8)
    block_size: int | None = None  # None: the checkpoint's
    max_new_tokens: int = 256
    methods: tuple[str, ...] = METHODS
    prompt_lookup_tokens: int = 10
    warmup_tokens: int = 16
    profile_tau: float = 0.9
    max_fed: int | str | None = "auto"  # single-sequence MARS only; see DecodeConfig
    fp32_reference: bool = False  # add agreement_fp32: each batch-1 run against our AR on the fp32 path
    tree: str | None = None  # mars_exact only (one sequence): candidate trees; see DecodeConfig
    repeats: int = 1  # times over the prompts, in turns (run_group): speed over all of them, and each one's speedup

    def __post_init__(self) -> None:
        if not self.taus:
            raise ValueError("give at least one tau")
        for tau in self.taus + (self.profile_tau,):
            check_tau(tau)
        if int(self.repeats) != self.repeats or self.repeats < 1:
            raise ValueError(f"repeats must be an integer of at least 1, got {self.repeats}")
        if not self.batch_sizes or any(int(b) != b or b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be integers of at least 1, got {self.batch_sizes}")
        unknown = set(self.methods) - set(KNOWN)
        if unknown:
            raise ValueError(f"unknown method(s) {', '.join(sorted(unknown))}; known: {', '.join(KNOWN)}")
        # the same checks a decode with these settings gets
        DecodeConfig(block_size=self.block_size, max_new_tokens=self.max_new_tokens, max_fed=self.max_fed,
                     tree=self.tree)


@dataclass(frozen=True)
class Job:
    method: str
    tau: float | None
    batch_size: int


@dataclass
class Outcome:
    """One job over all prompts: outputs in prompt order, and what producing them cost."""

    outputs: list[list[int]] = field(default_factory=list)
    row_passes: list[int] = field(default_factory=list)  # per prompt: passes while its row was live
    forward_passes: int = 0  # batched forward calls
    seconds: float = 0.0
    passes: dict[int, list] = field(default_factory=dict)  # batch decoders: columns fed a row -> [passes, s, tokens]
    decoding_seconds: float = 0.0  # batch decoders: decoding passes' seconds, and those of passes with fewer rows
    tail_seconds: float = 0.0  # than the batch began with (a static batch waiting on its last rows)
    repeats: list[list] = field(default_factory=list)  # run_group: [seconds, tokens] of each time over the prompts

    def add(self, part: Outcome, repeat: int = 0) -> None:
        """Append ``part``: the same job over the next prompts, in time ``repeat`` over them (run_group). Only the
        first time's outputs and passes a row was live for are kept (a repeat decodes the same prompts again);
        every time's seconds and tokens count."""
        if repeat == 0:
            self.outputs += part.outputs
            self.row_passes += part.row_passes
            self.forward_passes += part.forward_passes
        self.repeats += [[0.0, 0] for _ in range(repeat + 1 - len(self.repeats))]
        self.repeats[repeat][0] += part.seconds
        self.repeats[repeat][1] += sum(map(len, part.outputs))
        self.seconds += part.seconds
        self.decoding_seconds += part.decoding_seconds
        self.tail_seconds += part.tail_seconds
        for fed, (n, seconds, tokens) in part.passes.items():
            seen = self.passes.setdefault(fed, [0, 0.0, 0])
            seen[0], seen[1], seen[2] = seen[0] + n, seen[1] + seconds, seen[2] + tokens


def plan(config: BenchConfig) -> list[Job]:
    """The jobs in running order: our AR first (every run is compared with its outputs)."""
    taus = tuple(dict.fromkeys(config.taus))

    def jobs_for(methods: Sequence[str], batch_size: int) -> list[Job]:
        wanted = [m for m in methods if m in config.methods and not (m == "ar" and batch_size == 1)]
        fixed = lambda m: (None,) if m == "prompt_lookup" or m in llama_cpp.METHODS else (1.0,)
        return [Job(m, t, batch_size) for m in wanted for t in (taus if m in TAU_METHODS else fixed(m))]

    jobs = [Job("ar", 1.0, 1)]
    if 1 in config.batch_sizes:
        jobs += jobs_for(SINGLE + llama_cpp.METHODS, 1)
    for b in sorted(b for b in set(config.batch_sizes) if b > 1):
        jobs += jobs_for(BATCHED + llama_cpp.BATCHED, b)
    return jobs


def _chunks(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@contextmanager
def counting_forwards(model: PreTrainedModel) -> Iterator[list[int]]:
    """Count the model's forward calls while the block runs (a hook, removed afterwards)."""
    count = [0]
    handle = model.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    try:
        yield count
    finally:
        handle.remove()


def cut_at_stop(row: list[int], stop_ids: set[int]) -> list[int]:
    """A generated row up to and including its first stop token (transformers pads after it)."""
    return commit_tokens(row, len(row), stop_ids)[0]


Tick = Callable[[int], object]  # progress: called with the number of prompts just finished


def _no_tick(_: int) -> None:
    pass


def run_hf(
    lm: LoadedModel, prompts: list[list[int]], batch_size: int, max_new: int, tick: Tick = _no_tick, **extra
) -> Outcome:
    """transformers ``generate``, greedy, left-padded batches; ``extra`` e.g. prompt_lookup_num_tokens."""
    model, tok = lm.model, lm.tokenizer  # transformers' own forward over the same weights (docs/cli.md, "bench")
    stop = eos_ids(lm.backend, tok)
    pad = pad_id(tok)
    result = Outcome()
    for chunk in _chunks(prompts, batch_size):
        ids, attn = left_pad(chunk, pad)
        ids_t, attn_t = torch.tensor(ids, device=model.device), torch.tensor(attn, device=model.device)
        with counting_forwards(model) as count:
            started = time.perf_counter()
            out = model.generate(
                ids_t, attention_mask=attn_t, do_sample=False, max_new_tokens=max_new,
                eos_token_id=sorted(stop), pad_token_id=pad, **extra,
            )
            sync(model)
            result.seconds += time.perf_counter() - started
        rows = [cut_at_stop(row, stop) for row in out[:, len(ids[0]) :].tolist()]
        result.outputs += rows
        result.forward_passes += count[0]
        # greedy generate: one token per pass per live row; assisted (batch 1): its passes
        result.row_passes += [count[0]] if extra else [len(r) for r in rows]
        tick(len(chunk))
    return result


def run_single(lm: LoadedModel, prompts: list[list[int]], config: DecodeConfig, tick: Tick = _no_tick) -> Outcome:
    """decoding.loop.stream_ids, one prompt at a time."""
    result = Outcome()
    for ids in prompts:
        started = time.perf_counter()
        gen = collect(stream_ids(lm, ids, config))
        sync(lm.model)
        result.seconds += time.perf_counter() - started
        result.outputs.append(gen.token_ids)
        result.forward_passes += gen.stats.forward_passes
        result.row_passes.append(gen.stats.forward_passes)
        tick(1)
    return result


def run_batch(
    lm: LoadedModel, prompts: list[list[int]], batch_size: int, config: DecodeConfig, scheme: str, tick: Tick = _no_tick
) -> Outcome:
    """decoding.batch.stream_batch_ids over consecutive chunks of ``batch_size`` prompts."""
    result = Outcome()
    for chunk in _chunks(prompts, batch_size):
        part = Outcome()
        started = time.perf_counter()
        gen = collect_batch(_noting(stream_batch_ids(lm, chunk, config, scheme=scheme), part, len(chunk)))
        sync(lm.model)
        part.seconds = time.perf_counter() - started
        part.outputs, part.forward_passes = gen.token_ids, gen.stats.forward_passes
        part.row_passes = [row.forward_passes for row in gen.stats.rows]
        result.add(part)
        tick(len(chunk))
    return result


def _noting(events: Iterator[BatchEvent], part: Outcome, rows: int) -> Iterator[BatchEvent]:
    """``events`` as they come, each decoding pass's seconds and tokens added up in ``part`` under its columns fed a
    row, and its seconds as a pass of the whole batch (``rows``) or of fewer."""
    for event in events:
        if event.kind != "prefill":
            seen = part.passes.setdefault(event.fed, [0, 0.0, 0])
            seen[0], seen[1], seen[2] = seen[0] + 1, seen[1] + event.seconds, seen[2] + event.tokens
            part.decoding_seconds += event.seconds
            if sum(1 for row in event.rows if row.width) < rows:
                part.tail_seconds += event.seconds
        yield event


def run_job(
    lm: LoadedModel, job: Job, prompts: list[list[int]], config: BenchConfig, max_new: int, tick: Tick = _no_tick
) -> Outcome:
    if job.method in ("hf_generate", "ar_batch"):
        return run_hf(lm, prompts, job.batch_size, max_new, tick)
    if job.method in llama_cpp.METHODS:
        return llama_cpp.run(lm, job.method, prompts, max_new, tick, job.batch_size)
    if job.method == "prompt_lookup":
        return run_hf(lm, prompts, 1, max_new, tick, prompt_lookup_num_tokens=config.prompt_lookup_tokens)
    mode = "ar" if job.method in AR_METHODS else "exact" if job.method in ("mars_exact", "exact_batch") else "mars"
    decode = DecodeConfig(
        mode=mode, tau=job.tau, block_size=config.block_size, max_new_tokens=max_new, max_fed=config.max_fed,
        tree=config.tree if job.method == "mars_exact" else None,  # batches verify chains
    )
    if job.method in ("ar", "mars", "mars_exact"):
        return run_single(lm, prompts, decode, tick)
    return run_batch(lm, prompts, job.batch_size, decode, SCHEME[job.method], tick)


def nll_per_token(scorer: Scorer, outputs: list[list[int]]) -> float:
    """Teacher-forced NLL per token of all outputs, token-weighted over prompts (evaluation.py's definition)."""
    return pooled_nll([scorer(i, out) for i, out in enumerate(outputs)])


def drifted(runs: list[dict], exact: bool) -> list[dict]:
    """Where each row is computed alone (``exact``), the runs that must give our AR's text (LOSSLESS, and MARS at
    tau 1.0) and do not: (method, batch size, tau, agreement) of each."""
    if not exact:
        return []
    must = [r for r in runs if r["method"] in LOSSLESS or (r["method"] in TAU_METHODS and r["tau"] >= 1.0)]
    return [{k: r[k] for k in ("method", "batch_size", "tau", "agreement")} for r in must if r["agreement"] < 1]


def drift_message(off: list[dict], path: str) -> str:
    """One warning line naming the runs ``drifted`` found."""
    names = ", ".join(f"{r['method']} at {r['batch_size']} row(s) (agreement {r['agreement']:.3f})" for r in off)
    return (f"on the {path} path every row is computed alone, so these must give our AR's text and do not: {names}. "
            "A kernel or batching bug: the speed figures of these runs are not of AR's text")


def summarise(job: Job, outcome: Outcome, reference: list[list[int]], scorer: Scorer, ref_nll: float) -> dict:
    tokens = sum(map(len, outcome.outputs))
    timed = sum(n for _, n in outcome.repeats) if outcome.repeats else tokens  # every time over the prompts
    nll = nll_per_token(scorer, outcome.outputs)
    return {
        "method": job.method,
        "scheme": SCHEME.get(job.method),
        "tau": job.tau,
        "batch_size": job.batch_size,
        "prompts": len(outcome.outputs),
        "tokens": tokens,
        "seconds": round(outcome.seconds, 4),
        "tokens_per_second": round(per_second(timed, outcome.seconds), 3),
        **({"repeat_tokens_per_second": [round(per_second(n, sec), 3) for sec, n in outcome.repeats]}
           if len(outcome.repeats) > 1 else {}),
        "forward_passes": outcome.forward_passes,
        "tokens_per_forward": round(per_forward(tokens, sum(outcome.row_passes)), 4),
        "nll_self": round(nll, 5),
        "delta_nll_self": round(nll - ref_nll, 5),
        "agreement": round(agreement(outcome.outputs, reference), 4),
        "exact_match": round(exact_match(outcome.outputs, reference), 4),
        **({"passes_by_fed": by_fed(outcome.passes)} if outcome.passes else {}),
        **({"tail_share": round(outcome.tail_seconds / outcome.decoding_seconds, 4)}
           if outcome.decoding_seconds > 0 else {}),
    }


def by_fed(passes: dict[int, list]) -> dict[str, dict]:
    """A batch decoder's decoding passes by columns fed a row: how many, ms a pass, tokens a ms."""
    return {str(fed): {"passes": n, "ms_per_pass": round(seconds * 1000 / n, 3),
                       "tokens_per_ms": round(tokens / (seconds * 1000), 4) if seconds > 0 else None}
            for fed, (n, seconds, tokens) in sorted(passes.items())}


def add_speedups(runs: list[dict]) -> None:
    """speedup = tokens/s over the faster AR run at the same batch size (None where there is none)."""
    for run in runs:
        ars = [r for r in runs if r["method"] in AR_METHODS and r["batch_size"] == run["batch_size"]]
        best = max(ars, key=lambda r: r["tokens_per_second"], default=None)
        ok = best is not None and best["tokens_per_second"] > 0
        gain = speedup(run["tokens_per_second"], best["tokens_per_second"]) if ok else None
        run["speedup"] = round(gain, 4) if gain is not None else (0.0 if ok else None)
        run["speedup_over"] = best["method"] if ok else None
        mine, theirs = run.get("repeat_tokens_per_second"), best and best.get("repeat_tokens_per_second")
        if ok and mine and theirs and len(mine) == len(theirs) and all(theirs):  # each time over the prompts alone
            ratios = [round(speedup(a, b), 4) for a, b in zip(mine, theirs)]
            run["speedup_by_repeat"], run["speedup_range"] = ratios, [min(ratios), max(ratios)]


def interleaved(jobs: list[Job]) -> list[list[Job]]:
    """The jobs in groups that ``run_group`` takes turns over: those of one batch size, in plan order."""
    groups: dict[int, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.batch_size, []).append(job)
    return list(groups.values())


def run_group(
    lm: LoadedModel, group: list[Job], prompts: list[list[int]], config: BenchConfig, tick: Tick = _no_tick
) -> dict[Job, Outcome]:
    """Every job of ``group`` (one batch size) over ``prompts``, taking turns chunk by chunk.

    Each chunk of ``batch_size`` prompts runs every job before the next chunk starts, the first job
    of the turn rotating, so a machine whose speed drifts (a shared VM: 15% within a session here)
    slows every method alike instead of the ones that happened to run late. Every job is warmed
    up first, untimed. With ``config.repeats`` above one the prompts are gone over that many times, the
    turns rotating on, one place further each time, so that a job does not run in the same place on a chunk every
    time (two jobs over two chunks would: the first job first on the first chunk, always). At 8 rows 16 prompts
    are only two turns, and one run's ratios move by +-5-10%.
    """
    size = group[0].batch_size
    for job in group:
        run_job(lm, job, prompts[:size], config, config.warmup_tokens)
    outcomes = {job: Outcome() for job in group}
    chunks = list(_chunks(prompts, size))
    for turn in range(config.repeats * len(chunks)):
        first = (turn + turn // len(chunks)) % len(group)  # shifted each repeat: a job's place on a chunk moves
        for job in group[first:] + group[:first]:
            part = run_job(lm, job, chunks[turn % len(chunks)], config, config.max_new_tokens, tick)
            outcomes[job].add(part, repeat=turn // len(chunks))
    return outcomes


def run_benchmark(lm: LoadedModel, prompts: list[str], config: BenchConfig = BenchConfig(), *, progress: bool = True,
                  on_run: Callable[[dict], None] | None = None) -> dict:
    """Run every planned job on ``prompts`` (chat template applied) and return the report (a dict)."""
    if not prompts:
        raise ValueError("no prompts to benchmark")
    ids = [prompt_ids(lm.tokenizer, p) for p in prompts]
    if any(m in llama_cpp.METHODS for m in config.methods) and (why := llama_cpp.missing(lm)):
        logger.warning("%s", why)  # one line; the other methods run
        config = replace(config, methods=tuple(m for m in config.methods if m not in llama_cpp.METHODS))
    jobs = plan(config)
    runs, outcomes = [], {}
    scorer = Scorer(lm.backend, ids)
    if config.max_fed == "auto" and any(b > 1 for b in config.batch_sizes):
        surface_for(lm)  # measured (or read) before any run is timed
    bar = tqdm(total=len(jobs) * len(ids) * config.repeats, desc="bench", unit="prompt", disable=not progress)
    for group in interleaved(jobs):
        bar.set_postfix_str(f"{len(group)} methods b={group[0].batch_size}")
        outcomes.update(run_group(lm, group, ids, config, bar.update))
        reference = outcomes[jobs[0]].outputs
        ref_nll = nll_per_token(scorer, reference)
        for job in group:
            runs.append(summarise(job, outcomes[job], reference, scorer, ref_nll))
            logger.info("%s", runs[-1])
            if on_run:
                on_run(runs[-1])
    bar.close()
    add_speedups(runs)
    if config.fp32_reference:
        by_run = {(job.method, job.tau): o.outputs for job, o in outcomes.items() if job.batch_size == 1}
        llama_cpp.fp32_agreement(lm, ids, config.max_new_tokens, runs, by_run)
    block = config.block_size or lm.meta.block_size
    profile = profile_passes(
        lm, ids, config.profile_tau, block, config.max_new_tokens, max_fed=config.max_fed, progress=progress
    )
    return {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": lm.name,
        "machine": machine(lm),
        "drifted": drifted(runs, row_exact(lm)),  # the bench command names them in a warning
        "settings": {
            **asdict(config), "block_size": block, "prompts": len(prompts),
            "max_fed_resolved": resolve_max_fed(config.max_fed, lm.compute),
        },
        "runs": runs,
        "profile": profile,
    }
