"""The Serving tab: seeded arrivals replayed through the serving loop under several tau policies, live.

The run is the serve-sim command's replay (research/simulation.py) inside the app: the same
requests for every policy, one policy after another, on a clock driven by the measured
pass times. Charts (tau, queue, throughput, latency over time, one line per policy) are
redrawn about once a second and the totals table grows as each policy finishes.

Bounds: rate, request count, batch size, tokens and the time limit are capped, and the
time limit covers the whole run (warm-up included), so a run holds the shared decoding
slot, and so the Race tab, for at most that long. Stop takes effect between two passes
and still shows the totals of what was served. Quality here is agreement with the
fixed:1.0 output only (dNLL needs the base model: the serve-sim command has it).
app.py builds the tab's components (``SERVING_*`` below give their bounds and choices).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import partial
from html import escape

import gradio as gr

from ..engine.checkpoints.memory import trim_heap
from ..engine.decoding.chat import prompt_ids
from ..engine.decoding.surface import affordable_rate, surface_for
from ..engine.serving.policies import parse_policy, split_policies
from ..engine.serving.replay import (
    ARRIVALS,
    LIMITS,
    REFERENCE,
    SimConfig,
    add_agreement,
    live_replay,
    make_requests,
    series,
    summarise,
    take_turns,
    warm_up,
)
from .charts import serving_figures, surface_heatmap
from .examples import EXAMPLE_PROMPTS
from .messages import error, sentence

# (minimum, maximum, default) of the tab's numeric settings.
BOUNDS = {
    "rate": (0.05, 20.0, 1.0),
    "requests": (1, 60, 16),
    "time_limit": (5, 180, 60),
    "max_batch": (1, 8, 4),
    "max_new_tokens": (8, 128, 48),
}
POLICY_CHOICES = ("fixed:1.0", "fixed:0.95", "fixed:0.9", "fixed:0.8", "adaptive", "latency:10", "fixed:1.0@exact")
DEFAULT_POLICIES = ["fixed:1.0", "fixed:0.9", "adaptive"]
TOTALS = (  # (key, header, digits): the tab's totals table
    ("policy", "policy", None), ("done", "done", None), ("tokens_per_second", "tokens / s", 1),
    ("requests_per_second", "requests / s", 3), ("latency_p50", "latency p50 (s)", 2),
    ("latency_p95", "latency p95 (s)", 2), ("latency_p99", "latency p99 (s)", 2), ("ttft_p50", "TTFT p50 (s)", 2),
    ("queue_max", "queue max", None), ("tau_mean", "mean tau", 3), ("width_mean", "mean width", 2),
    ("tokens_per_forward", "tokens / forward", 2),
    ("agreement", "agreement with fixed:1", 3),
)
TOTAL_HEADERS = [header for _, header, _ in TOTALS]

SERVING_INTRO = """Requests arrive at the chosen **rate** (Poisson, or bursts of 8) and share one batch: a new
request is prefilled and joins the running batch between two passes, a finished one leaves at once. Each
**policy** sets tau before every pass from the load; **adaptive** lowers tau as requests wait (1.0 while
nobody waits, 0.95 from 1 waiting, 0.9 from 4, 0.8 from 8, 0.7 from 16). Every policy serves the same seeded
requests on a clock driven by the measured pass times, the policies taking turns pass by pass. Each pass's
**width** (tokens fed per row) is chosen from this machine's measured **cost surface** and the rows'
acceptance: plain AR passes where no mask pays, so adaptive lowers tau only where wider passes pay. With
**rate from this machine** on, the rate is set to 1.5x what batched AR sustains here (read off the surface),
so a queue builds and the policies part ways. Agreement compares each output with fixed:1.0's (tau 1.0 is the
AR output). A policy ending in **@exact** serves in exact mode: AR's own text, from passes that verify drafts.
The run holds the decoding slot, so races wait, for at most its time limit."""
OVERLOAD = 1.5  # "rate from this machine": arrivals at this multiple of what batched AR sustains
RUN_SECONDS = 6.0  # ... and enough requests to keep batched AR busy about this long


@dataclass
class ServingState:
    """One browser session's serving run: Stop sets ``stop``; the run's generator reads it between passes."""

    stop: threading.Event = field(default_factory=threading.Event)
    running: bool = False

    def __deepcopy__(self, memo) -> ServingState:
        """Gradio deep-copies a session's first state value, and an Event cannot be copied: a fresh state."""
        return ServingState()


def _number(value, name: str, label: str, integer: bool = False) -> float:
    low, high, _ = BOUNDS[name]
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{label} must be a number from {low:g} to {high:g}") from None
    if not low <= number <= high or (integer and number != int(number)):
        kind = "a whole number" if integer else "a number"
        raise ValueError(f"{label} must be {kind} from {low:g} to {high:g}, got {value}")
    return int(number) if integer else number


def parse_settings(
    arrivals, rate, policies, extra, requests, time_limit, max_batch, max_new_tokens
) -> tuple[SimConfig, float]:
    """The tab's values as a SimConfig and a time limit; a ValueError with one clear sentence otherwise."""
    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {', '.join(ARRIVALS)}")
    chosen = list(policies or []) + split_policies(extra)
    if not chosen:
        raise ValueError("pick at least one policy")
    if len(chosen) > 6:
        raise ValueError("pick at most 6 policies")
    for spec in chosen:
        parse_policy(spec)
    names = [parse_policy(spec).name for spec in chosen]
    if len(set(names)) != len(names):
        raise ValueError("a policy is listed twice")
    config = SimConfig(
        rate=_number(rate, "rate", "Rate"), requests=_number(requests, "requests", "Requests", True),
        policies=tuple(chosen), arrivals=arrivals, max_batch=_number(max_batch, "max_batch", "Max batch", True),
        max_new_tokens=_number(max_new_tokens, "max_new_tokens", "Max new tokens", True),
    )
    return config, _number(time_limit, "time_limit", "Time limit", True)


class ServingHandlers:
    """The tab's Run and Stop; ``demo_handlers`` (ui.handlers.DemoHandlers) lends the model cache and policy."""

    def __init__(self, demo_handlers, chart_every: float = 1.0) -> None:
        self.demo = demo_handlers
        self.chart_every = chart_every

    def stop(self, state: ServingState) -> None:
        state.stop.set()

    def run(
        self, arrivals, rate, policies, extra, requests, time_limit, max_batch, max_new_tokens, spec,
        state: ServingState, precision: str | None = None, from_machine: bool = False, request: gr.Request = None,
    ) -> Iterator[tuple]:
        """Replay the seeded requests under each policy; yields (status, tau, queue, throughput, latency, width,
        surface, totals). ``from_machine``: rate and request count from the measured cost surface."""
        try:
            config, limit = parse_settings(
                arrivals, rate, policies, extra, requests, time_limit, max_batch, max_new_tokens
            )
        except ValueError as err:
            raise error(sentence(str(err)), "Bad setting", request) from None
        path = self.demo._path(precision, request)  # checked as --precision is; the model cache's key
        state.stop.clear()
        state.running = True
        try:
            with ExitStack() as held:
                cancel = self.demo._slot(held, request)  # the decoding slot until this run's work has ended
                lm = self.demo._hold(spec, held, request, path)
                stop_at = time.monotonic() + min(limit, self.demo.limits.run_seconds)  # the host's budget caps it
                yield self._view("Reading this machine's cost surface (measured once per machine)…", {}, [])
                surface = surface_for(lm)
                note = ""
                if from_machine and surface is not None:
                    config, note = machine_load(config, surface)
                yield from self._replays(lm, config, stop_at, state, cancel, surface, note)
        finally:
            state.running = False
            trim_heap()

    def _replays(self, lm, config: SimConfig, stop_at: float, state: ServingState, cancel, surface=None,
                 note: str = "") -> Iterator[tuple]:
        """Every policy's replay, taking turns pass by pass as serve-sim's (simulation.interleaved): a machine whose
        speed drifts slows every policy alike, not the ones replayed last."""
        requests = make_requests(config, [prompt_ids(lm.tokenizer, p) for p in EXAMPLE_PROMPTS])
        heatmap = surface_heatmap(surface) if surface is not None else None
        view = partial(self._view, heatmap=heatmap, note=note)
        yield view("Warming up…", {}, [])
        warm_up(lm, config, requests)
        stop = lambda: state.stop.is_set() or cancel.is_set()  # read by every replay between its passes
        replays = [live_replay(lm, config, spec, requests, deadline=max(stop_at - time.monotonic(), 0.0), stop=stop,
                               surface=surface) for spec in config.policies]
        latest: list = [None] * len(replays)
        shown = 0.0
        for passes in take_turns(replays):
            for i, run in passes:
                latest[i] = run
            if time.monotonic() - shown >= self.chart_every:
                shown = time.monotonic()
                yield view(*self._progress([run for run in latest if run is not None], config))
            else:
                yield (gr.skip(),) * 8  # nothing to draw: a cancelled run ends here, before its next pass
        runs = [run for run in latest if run is not None and run.events]
        summaries = [summarise(run) for run in runs]
        reference = next((r for r in runs if r.policy == REFERENCE), None)
        if reference is not None:
            add_agreement(summaries, runs, reference)
        stopped = state.stop.is_set() or time.monotonic() > stop_at
        note = "Stopped" if state.stop.is_set() else "Time limit reached" if stopped else "Finished"
        line = f"{note}: {len(runs)} of {len(config.policies)} policies served"
        line += " (their totals so far)." if stopped else "."
        yield view(line, _all_series(runs), summaries)

    def _progress(self, runs: list, config: SimConfig) -> tuple:
        """(status text, series, totals) of the runs so far."""
        parts = []
        for run in runs:
            ended = sum(s.ended for s in run.loop.served.values())
            last = run.events[-1] if run.events else None
            parts.append(f"{run.policy} {ended} of {config.requests} ended (clock {run.loop.clock:.1f} s"
                         + (f", tau {last.tau:g}, width {last.width or '-'})" if last else ")"))
        text = "Policies taking turns pass by pass: " + "; ".join(parts) + "."
        return text, _all_series(runs), [summarise(run) for run in runs if run.events]

    def _view(self, text: str, all_series: dict[str, dict], summaries: list[dict], heatmap=None, note: str = ""
              ) -> tuple:
        """The tab's outputs: status, five charts, the cost surface's heat map, totals."""
        figures = serving_figures(all_series) if all_series else [gr.skip()] * 5
        status = f'<div class="serving-status">{escape(text)}{"<br>" + escape(note) if note else ""}</div>'
        return (status, *figures, gr.skip() if heatmap is None else heatmap, totals_rows(summaries))


def machine_load(config: SimConfig, surface) -> tuple[SimConfig, str]:
    """The config with its rate at OVERLOAD x what batched AR sustains on ``surface`` and requests to last
    about RUN_SECONDS of batched AR (within the tab's bounds); and one line that says so."""
    sustained = affordable_rate(surface, config.max_batch, config.max_new_tokens)
    low, high, _ = BOUNDS["requests"]
    requests = int(min(max(round(sustained * RUN_SECONDS), low), high))
    rate = round(min(OVERLOAD * sustained, LIMITS["rate"][1]), 2)
    line = (f"Rate {rate:g} requests/s, {requests} requests: {OVERLOAD:g}x the {sustained:.1f} requests/s that "
            f"batched AR sustains on this machine ({config.max_batch} rows, {config.max_new_tokens} tokens each, "
            "read off the cost surface).")
    return replace(config, rate=rate, requests=requests), line


def totals_rows(summaries: list[dict]) -> list[list]:
    """One row per policy for the totals table (None where a figure does not apply)."""
    return [[s.get(key) if digits is None or s.get(key) is None else round(s[key], digits) for key, _, digits in TOTALS]
            for s in summaries]


def _all_series(runs: list) -> dict[str, dict]:
    return {run.policy: series(run) for run in runs if run.events}
