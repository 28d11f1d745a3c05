"""The tau sweep: decode a set of prompts at several tau values and measure the speed/quality frontier.

Quality is agreement with the tau = 1.0 output of the same prompt (one token per
pass, docs/METHOD.md "Decoding"): the common prefix of the two token-id sequences over
the longer one, the same measure as ``eval`` and ``bench`` report.
Exact mode (docs/METHOD.md, "Exact and hybrid modes") is a point of its own beside the tau
points: its agreement is measured against the AR baseline's own output of the same prompt on
the same path, the output it promises (greedy: 1.0 where the path is row-exact), never assumed.
Speed is tokens per forward pass, and tokens per second over the AR baseline on
the same weights, each clock counting only its own passes; rates are pooled over
the prompts (total tokens / total seconds), not averaged per prompt.

``sweep_passes`` is a generator of every forward pass, then each finished run, so a
caller (the app) can stop within one pass; ``sweep_runs`` gives the finished runs
only (tqdm, gr.Progress). ``frontier`` works on any prefix of their output.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..engine.decoding.config import DecodeConfig, check_tau
from ..engine.decoding.loop import Generation, StepEvent, generate
from ..engine.decoding.metrics import REFERENCE_TAU, Rates, agreement, exact_match, speedup
from ..engine.model import LoadedModel

EXACT = "exact"  # the exact-mode run's mode, and its point's label in the table and the chart
SWEEP_COLUMNS = ["tau", "prompts", "tokens / forward", "tokens / s", "speedup over AR", "agreement", "exact match"]


@dataclass(frozen=True)
class SweepRun:
    """One prompt decoded once: by MARS at ``tau``, or by the AR baseline or exact mode (tau None)."""

    prompt: str
    mode: str
    tau: float | None
    token_ids: tuple[int, ...]
    text: str
    forward_passes: int
    seconds: float

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def rates(self) -> Rates:
        return Rates(self.tokens, self.forward_passes, self.seconds)


@dataclass(frozen=True)
class FrontierPoint:
    """One tau (or exact mode), pooled over the prompts that have both this run and its reference."""

    tau: float | None  # None: exact mode
    prompts: int
    tokens_per_forward: float
    tokens_per_second: float
    speedup: float | None  # over AR tokens/s on the same prompts; None without AR runs
    agreement: float  # mean over prompts of agreement with the reference: tau = 1.0's output (exact mode: AR's)
    exact: float  # fraction of prompts whose output equals the reference output
    mode: str = "mars"  # "mars" (a tau point) or EXACT

    @property
    def label(self) -> str:
        """"exact", or the tau as the table and the chart show it."""
        return EXACT if self.mode == EXACT else f"{self.tau:g}"


def plan(prompts: Sequence[str], taus: Sequence[float]) -> list[tuple[str, str, float | None]]:
    """(prompt, mode, tau) of every run: per prompt the AR baseline, exact mode, then MARS from high tau to low.

    tau = 1.0 is always included: it is the reference the tau points' agreement is measured against. Exact
    mode is always included, whatever mode the sidebar has: it is the frontier's lossless point.
    """
    if not prompts:
        raise ValueError("choose at least one prompt for the sweep")
    if any(not p.strip() for p in prompts):
        raise ValueError("the sweep has an empty prompt")
    if not taus:
        raise ValueError("choose at least one tau for the sweep")
    levels = sorted({check_tau(float(t)) for t in taus} | {REFERENCE_TAU}, reverse=True)
    return [run for p in prompts for run in [(p, "ar", None), (p, EXACT, None)] + [(p, "mars", t) for t in levels]]


def sweep_passes(
    lm: LoadedModel, prompts: Sequence[str], taus: Sequence[float], config: DecodeConfig
) -> Iterator[StepEvent | SweepRun]:
    """Decode every planned run with ``config`` (its tau and mode replaced per run), one at a time: each
    forward pass's StepEvent as it is decoded, then the run's SweepRun. Closing this generator between two
    passes ends the run under way at once (its KV cache goes with its decoder)."""
    for prompt, mode, tau in plan(prompts, taus):
        run_config = config.with_(mode=mode, tau=REFERENCE_TAU if tau is None else tau)
        events, steps = generate(lm, prompt, run_config), []
        try:
            for event in events:
                steps.append(event)
                yield event
        finally:
            events.close()
        result = Generation(steps)
        yield SweepRun(
            prompt=prompt, mode=mode, tau=tau, token_ids=tuple(result.token_ids), text=result.text,
            forward_passes=result.stats.forward_passes, seconds=result.stats.seconds,
        )


def sweep_runs(
    lm: LoadedModel, prompts: Sequence[str], taus: Sequence[float], config: DecodeConfig
) -> Iterator[SweepRun]:
    """The finished runs of ``sweep_passes``."""
    return (item for item in sweep_passes(lm, prompts, taus, config) if isinstance(item, SweepRun))


def frontier(runs: Sequence[SweepRun]) -> list[FrontierPoint]:
    """Exact mode's point, then one point per tau (highest first), from whatever runs have finished so far
    (decoding.metrics definitions). A point pools the prompts that have its reference: the tau = 1.0 run for
    a tau, the AR baseline's run for exact mode."""
    reference = {r.prompt: r for r in runs if r.mode == "mars" and r.tau == REFERENCE_TAU}
    baseline = {r.prompt: r for r in runs if r.mode == "ar"}
    exact = _point([r for r in runs if r.mode == EXACT], baseline, baseline, None, EXACT)
    points = [] if exact is None else [exact]
    for tau in sorted({r.tau for r in runs if r.mode == "mars"}, reverse=True):
        point = _point([r for r in runs if r.mode == "mars" and r.tau == tau], reference, baseline, tau, "mars")
        if point is not None:
            points.append(point)
    return points


def _point(
    runs: list[SweepRun], reference: dict[str, SweepRun], baseline: dict[str, SweepRun], tau: float | None, mode: str
) -> FrontierPoint | None:
    """``runs``' point: their rates pooled, agreement with ``reference``'s run of each prompt (None without one)."""
    mine = [r for r in runs if r.prompt in reference]
    if not mine:
        return None
    outputs, references = [r.token_ids for r in mine], [reference[r.prompt].token_ids for r in mine]
    ar_runs = [baseline[r.prompt] for r in mine if r.prompt in baseline]
    rates = Rates.pool(r.rates for r in mine)
    return FrontierPoint(
        tau=tau,
        prompts=len(mine),
        tokens_per_forward=rates.tokens_per_forward,
        tokens_per_second=rates.tokens_per_second,
        speedup=speedup(rates, Rates.pool(r.rates for r in ar_runs)) if len(ar_runs) == len(mine) else None,
        agreement=agreement(outputs, references),
        exact=exact_match(outputs, references),
        mode=mode,
    )


def sweep_choices(prompts, taus) -> tuple[list[str], list[float]]:
    """The sweep's prompts (text) and taus (numbers), or a TypeError / ValueError that says which is wrong."""
    if not isinstance(prompts or [], list) or not all(isinstance(p, str) for p in prompts or []):
        raise TypeError("the prompts must be a list of the example prompts")
    if not isinstance(taus or [], list):
        raise TypeError("the tau values must be a list of numbers from 0 to 1")
    return list(prompts or []), [_tau(t) for t in taus or []]


def sweep_desc(planned: list, i: int, prompts: list[str]) -> str:
    if i >= len(planned):
        return "done"
    prompt, mode, tau = planned[i]
    which = f"prompt {prompts.index(prompt) + 1}/{len(prompts)}"
    return f"{which}: {'AR baseline' if mode == 'ar' else 'exact mode' if mode == EXACT else f'MARS tau {tau:g}'}"


def sweep_table(points) -> list[list]:
    return [
        [
            p.label if p.mode == EXACT else p.tau, p.prompts,
            round(p.tokens_per_forward, 3), round(p.tokens_per_second, 1),
            None if p.speedup is None else round(p.speedup, 3), round(p.agreement, 3), round(p.exact, 3),
        ]
        for p in points
    ]


def _tau(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError("each tau must be a number from 0 to 1")
    try:
        return check_tau(float(value))
    except (ValueError, OverflowError):
        raise ValueError("each tau must be a number from 0 to 1") from None
