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
    """Fastest ms (of ``reps``) of one cached pass feeding ``width`` tokens to each of ``rows`` rows.

    Each row has ``context`` tokens in the cache before the pass.

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
    "tokens-fed": "cost model (CPU shape): every pass, prefills included, is charged what one row feeding "
    "rows x width tokens costs on the compute path's measured curve (curve_ms; past its end, its last slope). "
    "Deterministic; tokens, acceptance and quality are real, only the clock is modelled",
    "width-free": "cost model (GPU shape): a decoding pass of R rows is charged the curve's R-token cost, whatever its "
    "width, as on a GPU where a model this small is launch- or memory-bound; prefills as in tokens-fed",
}


def curve_ms(curve: dict[int, float], tokens: int) -> float:
    """ms of a pass feeding ``tokens`` on a measured curve {tokens fed: ms}: interpolated, extrapolated past the end."""
    points = sorted(curve.items())
    (x0, y0), (x1, y1) = points[-2], points[-1]
    if tokens >= x1:
        return y1 + (y1 - y0) / (x1 - x0) * (tokens - x1)
    low = max((p for p in points if p[0] <= tokens), default=points[0])
    high = min(p for p in points if p[0] >= tokens)
    return low[1] if high[0] == low[0] else low[1] + (high[1] - low[1]) * (tokens - low[0]) / (high[0] - low[0])


def model_cost(curve: dict[int, float], clock: str) -> PassCost:
    """The "tokens-fed" or "width-free" clock on ``curve`` (ms by tokens fed, one row: kernels.ComputePath.costs_ms)."""
    if len(curve) < 2:
        raise ValueError("a cost-model clock needs the measured compute path's curve (--precision on a CPU)")

    def cost(rows: int, width: int, kind: str, measured: float) -> float:
        fed = rows if clock == "width-free" and kind == "decode" else rows * width
        return curve_ms(curve, fed) / 1000

    return cost


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
