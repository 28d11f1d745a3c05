"""The serve-sim command's measurements: quality under the base model, pass costs, the width-free clock.

The replay itself (seeded arrivals, every policy over the same requests, the simulated
clock, the figures) is engine/replay.py. Here:
  delta_nll_base   pooled NLL per token under the base model (evaluation.Scorer,
                   teacher-forced) of a policy's outputs minus that of fixed:1.0's, over the
                   requests finished in both (metrics.delta_nll_key("base"))
  batch_pass_costs the measured cost of one pass by rows and width
  width-free       a clock (CLOCKS) that projects the same replay onto hardware where a wider
                   pass costs no more than a one-token pass of the same rows (a GPU, for a
                   model this small), from costs measured here
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from ..engine.loading import LoadedModel
from ..engine.metrics import delta_nll_key
from ..engine.replay import (
    REFERENCE,
    PolicyRun,
    SimConfig,
    add_agreement,
    make_requests,
    reference_done,
    replay,
    request_records,
    series,
    summarise,
    warm_up,
)
from ..engine.serving import LoopEvent, PassCost, parse_policy
from .evaluation import Scorer, pooled_nll


def add_quality(summaries: list[dict], runs: list[PolicyRun], reference: PolicyRun, base: PreTrainedModel) -> None:
    """agreement, and delta_nll_base scored by ``base``, against ``reference`` (fixed:1.0)."""
    add_agreement(summaries, runs, reference)
    ref = reference_done(reference)
    prompts = sorted({s.request.prompt for s in ref.values()})
    index = {p: i for i, p in enumerate(prompts)}
    scorer = Scorer(base, [list(p) for p in prompts])
    ref_nll = pooled_nll([scorer(index[s.request.prompt], s.token_ids) for s in ref.values()])
    for summary, run in zip(summaries, runs):
        both = [s for i, s in run.loop.served.items() if s.status == "done" and i in ref]
        nll = pooled_nll([scorer(index[s.request.prompt], s.token_ids) for s in both])
        summary[delta_nll_key("base")] = round(nll - ref_nll, 5) if both else None


@torch.inference_mode()
def batch_pass_costs(
    model: PreTrainedModel, rows: tuple[int, ...] = (1, 2, 4, 8), widths: tuple[int, ...] = (1, 2, 3, 4),
    *, context: int = 128, reps: int = 5,
) -> list[dict]:
    """Fastest ms (of ``reps``) of one cached pass feeding ``width`` tokens to each of ``rows`` rows after ``context`` tokens.

    The attention mask and position ids are passed as the batch decoder passes them, so the
    compute path's attention runs as in a real pass. One record per (rows, width).
    """
    gen = torch.Generator().manual_seed(0)
    vocab, device = model.config.vocab_size, model.device
    out = []
    for r in rows:
        ids = torch.randint(vocab // 4, vocab // 2, (r, context + max(widths)), generator=gen).to(device)
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :context], attention_mask=torch.ones(r, context, dtype=torch.long, device=device),
              past_key_values=cache, use_cache=True, logits_to_keep=1)
        for w in widths:
            mask = torch.ones(r, context + w, dtype=torch.long, device=device)
            positions = torch.arange(context, context + w, device=device)[None].expand(r, -1)
            times = []
            for _ in range(reps + 2):  # two warm-ups
                started = time.perf_counter()
                model(input_ids=ids[:, context : context + w], attention_mask=mask, position_ids=positions,
                      past_key_values=cache, use_cache=True, logits_to_keep=w)
                times.append(time.perf_counter() - started)
                cache.crop(-w)
            # the fastest repetition: on a shared CPU, the one least disturbed by other work
            out.append({"rows": r, "width": w, "tokens": r * w, "ms": round(min(times[2:]) * 1000, 2)})
    return out


CLOCKS = {
    "measured": "simulated clock: advances by the measured seconds of every forward pass (prefills included), "
    "jumps idle time to the next arrival; host work between passes is not charged",
    "width-free": "projection: a decoding pass of R rows is charged the measured cost of a pass of R rows x 1 token "
    "(width_cost), whatever its width, as on a GPU where a model this small is launch- or memory-bound; prefills "
    "are charged as measured. Tokens, acceptance and quality are real; only the clock is modelled",
}


def width_free_cost(model: PreTrainedModel, max_batch: int) -> tuple[PassCost, dict[int, float]]:
    """The "width-free" clock: (pass_cost, {rows: seconds of a 1-token pass of that many rows}), measured now."""
    table = {c["rows"]: c["ms"] / 1000 for c in batch_pass_costs(model, tuple(range(1, max_batch + 1)), (1,))}

    def cost(rows: int, width: int, kind: str, measured: float) -> float:
        return measured if kind == "prefill" else table[rows]

    return cost, table


def simulate(
    lm: LoadedModel, config: SimConfig, pool: Sequence[Sequence[int]], *, base: PreTrainedModel | None = None,
    deadline: float | None = None, on_event: Callable[[str, LoopEvent], object] | None = None,
    pass_cost: PassCost | None = None,
) -> dict:
    """Warm up, replay the seeded requests under every policy, summarise; quality under ``base`` if given.

    ``deadline``: wall seconds per policy. Returns {"requests", "policies": [{summary, series, requests}]}.
    """
    requests = make_requests(config, pool)
    warm_up(lm, config, requests)
    runs = []
    for spec in config.policies:
        name = parse_policy(spec).name
        hook = None if on_event is None else (lambda event, name=name: on_event(name, event))
        runs.append(replay(lm, config, spec, requests, pass_cost=pass_cost, deadline=deadline, on_event=hook))
    summaries = [summarise(run) for run in runs]
    reference = next((r for r in runs if r.policy == REFERENCE), None)
    if base is not None:
        reference = reference or replay(lm, config, "fixed:1.0", requests, pass_cost=pass_cost, deadline=deadline)
        add_quality(summaries, runs, reference, base)
    elif reference is not None:
        add_agreement(summaries, runs, reference)
    return {
        "requests": [{"id": r.id, "arrival": r.arrival, "prompt_tokens": len(r.prompt)} for r in requests],
        "policies": [
            {"summary": s, "series": series(run), "requests": request_records(run)} for s, run in zip(summaries, runs)
        ],
    }
