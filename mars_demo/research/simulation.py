"""The serve-sim command's measurements: quality under the base model, pass costs, the width-free clock.

The replay itself (seeded arrivals, every policy over the same requests, the simulated
clock, the figures) is engine/serving/replay.py. Here:
  delta_nll_base   pooled NLL per token under the base model (evaluation.Scorer,
                   teacher-forced) of a policy's outputs minus that of fixed:1.0's, over the
                   requests finished in both (metrics.delta_nll_key("base"))
  model_cost       the cost-model clocks (CLOCKS) on the measured cost surface (decoding/width.py):
                   "tokens-fed" charges every pass the surface's cost at its rows and width;
                   "width-free" projects the same replay onto hardware where a wider pass costs
                   no more than a one-token pass of the same rows (a GPU, for a model this small)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..engine.backends.base import Backend
from ..engine.decoding.metrics import delta_nll_key
from ..engine.decoding.surface import Surface
from ..engine.model import LoadedModel
from ..engine.serving.loop import LoopEvent, PassCost
from ..engine.serving.policies import parse_policy
from ..engine.serving.replay import (
    REFERENCE,
    PolicyRun,
    SimConfig,
    add_agreement,
    live_replay,
    make_requests,
    reference_done,
    replay,
    request_records,
    series,
    summarise,
    take_turns,
    warm_up,
)
from .evaluation import Scorer, pooled_nll


def add_quality(summaries: list[dict], runs: list[PolicyRun], reference: PolicyRun, base: Backend) -> None:
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


CLOCKS = {
    "measured": "simulated clock: advances by the measured seconds of every forward pass (prefills included), "
    "jumps idle time to the next arrival; host work between passes is not charged",
    "tokens-fed": "cost model (the surface's shape: this machine's, or --surface's): every pass, prefills included, "
    "is charged the measured cost surface's ms at its rows and tokens per row (interpolated; past the grid, its "
    "last slope). Deterministic; tokens, acceptance and quality are real, only the clock is modelled",
    "width-free": "cost model (GPU shape): a decoding pass of R rows is charged the surface's one-token cost at R "
    "rows, whatever its width, as on a GPU where a model this small is launch- or memory-bound; prefills as in "
    "tokens-fed",
}


def model_cost(surface: Surface, clock: str) -> PassCost:
    """The "tokens-fed" or "width-free" clock (CLOCKS) on a measured cost surface."""

    def cost(rows: int, width: int, kind: str, measured: float) -> float:
        return surface.ms(rows, 1 if clock == "width-free" and kind == "decode" else width) / 1000

    return cost


def clock_surface(pass_cost: PassCost, clock: str) -> Surface:
    """The surface a cost-model clock charges decoding passes by: what the width controller must price on."""
    return Surface.from_cost(lambda rows, width: pass_cost(rows, width, "decode", 0.0) * 1000, name=clock)


def interleaved(
    lm: LoadedModel, config: SimConfig, requests: Sequence, *, deadline: float | None = None,
    on_event: Callable[[str, LoopEvent], object] | None = None, pass_cost: PassCost | None = None,
    surface: Surface | None = None,
) -> list[PolicyRun]:
    """Every policy's replay, taking turns pass by pass: each policy's clock is its own, but on the measured
    clock a machine whose speed drifts (10-30% within minutes on a shared VM) slows every policy alike
    instead of the ones replayed last. ``deadline``: wall seconds per policy (the turns share the wall)."""
    names = [parse_policy(spec).name for spec in config.policies]
    wall = None if deadline is None else deadline * len(names)
    replays = [live_replay(lm, config, spec, requests, pass_cost=pass_cost, deadline=wall, surface=surface)
               for spec in config.policies]
    latest: list[PolicyRun | None] = [None] * len(replays)
    for passes in take_turns(replays):
        for i, run in passes:
            latest[i] = run
            if on_event is not None:
                on_event(names[i], run.events[-1])
    return [run or replay(lm, config, spec, [], surface=surface) for run, spec in zip(latest, config.policies)]


def simulate(
    lm: LoadedModel, config: SimConfig, pool: Sequence[Sequence[int]], *, base: Backend | None = None,
    deadline: float | None = None, on_event: Callable[[str, LoopEvent], object] | None = None,
    pass_cost: PassCost | None = None, surface: Surface | None = None,
) -> dict:
    """Warm up, replay the seeded requests under every policy, summarise; quality under ``base`` if given.

    ``deadline``: wall seconds per policy; ``surface``: what the width controller prices passes on.
    Returns {"requests", "policies": [{summary, series, requests}]}.
    """
    requests = make_requests(config, pool)
    warm_up(lm, config, requests)
    runs = interleaved(lm, config, requests, deadline=deadline, on_event=on_event, pass_cost=pass_cost,
                       surface=surface)
    summaries = [summarise(run) for run in runs]
    reference = next((r for r in runs if r.policy == REFERENCE), None)
    if base is not None:
        reference = reference or replay(
            lm, config, "fixed:1.0", requests, pass_cost=pass_cost, deadline=deadline, surface=surface
        )
        add_quality(summaries, runs, reference, base)
    elif reference is not None:
        add_agreement(summaries, runs, reference)
    return {
        "requests": [{"id": r.id, "arrival": r.arrival, "prompt_tokens": len(r.prompt)} for r in requests],
        "policies": [
            {"summary": s, "series": series(run), "requests": request_records(run)} for s, run in zip(summaries, runs)
        ],
    }
