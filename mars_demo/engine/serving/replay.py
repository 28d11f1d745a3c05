"""Replaying arrivals through the serving loop: seeded requests, the replay, and what it measured.

Arrivals are drawn once from the seed ("poisson": exponential gaps at ``rate`` per second;
"burst": groups of BURST requests arriving together every BURST / rate seconds, the same
mean rate), each with a prompt drawn from the pool. Every policy replays exactly these
requests, one after another, after one warm-up (research/simulation.py for the command,
ui/serving_tab.py for the app's Serving tab).

The clock is the loop's (serving/loop.py): by default it advances by the *measured* seconds of
every forward pass (prefills included) and jumps over idle time to the next arrival, so
the figures are what a server doing nothing but these passes would see, with no sleeps
and no scheduler noise; host work between passes (a few ms of Python per pass) is not
charged. A ``pass_cost`` model replaces the measured seconds (tests, projections).

Figures per policy (``summarise``; ``add_agreement``):
  tokens_per_second    tokens of finished requests / makespan (first arrival to last end)
  requests_per_second  finished requests / makespan
  latency_p50/p95/p99  arrival to last token, finished requests, seconds
  ttft_p50/p95         arrival to first token
  queue_max, queue_mean  requests waiting, per iteration (mean weighted by clock time)
  tau_mean             mean tau over request passes (what requests were decoded at)
  width_mean           mean candidates a request was offered per decoding pass (1: AR passes; the width
                       controller's choice, decoding/width.py)
  tokens_per_forward   tokens / request passes (metrics.per_forward)
  agreement            metrics.agreement (mean over requests of the common prefix) with the fixed:1.0
                       output of the same request (1.0 = identical)
research/simulation.py adds delta_nll_base (dNLL under the base model).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ..decoding.chat import pad_id
from ..decoding.loop import eos_ids
from ..decoding.metrics import agreement, per_forward, per_second
from ..decoding.surface import Surface
from ..model import LoadedModel
from .loop import LoopEvent, PassCost, Request, ServeConfig, ServingLoop
from .policies import mode_of, parse_policy

ARRIVALS = ("poisson", "burst")
BURST = 8
REFERENCE = "fixed:1"  # the tau = 1.0 run every quality figure compares with
# Bounds: a run is a few minutes on a CPU at most.
LIMITS = {
    "rate": (0.0, 1000.0), "requests": (1, 2000), "max_batch": (1, 64), "max_new_tokens": (1, 1024), "policies": (1, 8),
}


@dataclass(frozen=True)
class SimConfig:
    """One simulation: the arrivals and the loop settings every policy shares."""

    rate: float
    requests: int
    policies: tuple[str, ...] = ("fixed:1.0", "fixed:0.9", "adaptive")
    arrivals: str = "poisson"
    seed: int = 0
    max_batch: int = 8
    max_new_tokens: int = 64
    mode: str = "mars"

    def __post_init__(self) -> None:
        low, high = LIMITS["rate"]
        if not isinstance(self.rate, (int, float)) or not math.isfinite(self.rate) or not low < self.rate <= high:
            raise ValueError(f"rate must be above {low:g} and at most {high:g} requests per second, got {self.rate}")
        for name in ("requests", "max_batch", "max_new_tokens"):
            low, high = LIMITS[name]
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{name.replace('_', ' ')} must be an integer from {low} to {high}, got {value!r}")
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        low, high = LIMITS["policies"]
        if not low <= len(self.policies) <= high or len(set(self.policies)) != len(self.policies):
            raise ValueError(f"give {low} to {high} different policies, got {', '.join(self.policies) or 'none'}")
        for spec in self.policies:
            parse_policy(spec)
        ServeConfig(mode=self.mode, max_batch=self.max_batch, max_new_tokens=self.max_new_tokens)

    @property
    def names(self) -> tuple[str, ...]:
        """The policies' canonical names (fixed:1.0 -> fixed:1)."""
        return tuple(parse_policy(p).name for p in self.policies)


def arrival_times(kind: str, rate: float, n: int, seed: int) -> list[float]:
    """``n`` arrival times (seconds) at a mean of ``rate`` per second, from ``seed``."""
    if kind == "burst":
        return [(i // BURST) * BURST / rate for i in range(n)]
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def make_requests(config: SimConfig, pool: Sequence[Sequence[int]]) -> list[Request]:
    """The seeded requests: arrival times and a prompt from ``pool`` for each (its index is the request's prompt)."""
    if not pool:
        raise ValueError("no prompts to serve")
    rng = random.Random(config.seed + 1)
    times = arrival_times(config.arrivals, config.rate, config.requests, config.seed)
    return [Request(i, tuple(pool[rng.randrange(len(pool))]), round(t, 6)) for i, t in enumerate(times)]


@dataclass
class PolicyRun:
    """One policy's replay: its iterations and every request's record."""

    policy: str
    events: list[LoopEvent]
    loop: ServingLoop
    wall_seconds: float


def new_loop(lm: LoadedModel, config: SimConfig, policy: str, pass_cost=None, surface: Surface | None = None
             ) -> ServingLoop:
    """A serving loop for one policy spec, in the policy's own mode where it names one (policies.parse_policy)."""
    parsed = parse_policy(policy)
    return ServingLoop(
        lm.backend, mask_id=lm.meta.mask_token_id, pad_id=pad_id(lm.tokenizer),
        stop_ids=eos_ids(lm.backend, lm.tokenizer),
        policy=parsed, pass_cost=pass_cost, surface=surface,
        config=ServeConfig(mode=mode_of(parsed, config.mode), max_batch=config.max_batch,
                           max_new_tokens=config.max_new_tokens, block_size=lm.meta.block_size),
    )


def live_replay(
    lm: LoadedModel, config: SimConfig, policy: str, requests: Sequence[Request], *,
    pass_cost: PassCost | None = None, deadline: float | None = None,
    stop: Callable[[], bool] | None = None, surface: Surface | None = None,
) -> Iterator[PolicyRun]:
    """Replay ``requests`` under ``policy``, yielding the run so far after every iteration.

    ``deadline`` (wall seconds) or ``stop()``: what is left is stopped (ServingLoop.run). ``surface``: what
    the width controller prices passes on (the clock's own under a cost model).
    """
    loop = new_loop(lm, config, policy, pass_cost, surface)
    run, started = PolicyRun(loop.policy.name, [], loop, 0.0), time.perf_counter()
    for event in loop.run(requests, deadline=deadline, stop=stop):
        run.events.append(event)
        run.wall_seconds = time.perf_counter() - started
        yield run


def replay(
    lm: LoadedModel, config: SimConfig, policy: str, requests: Sequence[Request], *,
    pass_cost: PassCost | None = None, deadline: float | None = None,
    on_event: Callable[[LoopEvent], object] | None = None, surface: Surface | None = None,
) -> PolicyRun:
    """The whole replay of ``requests`` under ``policy`` (live_replay to the end)."""
    run = None
    for run in live_replay(lm, config, policy, requests, pass_cost=pass_cost, deadline=deadline, surface=surface):
        if on_event is not None:
            on_event(run.events[-1])
    return run or PolicyRun(parse_policy(policy).name, [], new_loop(lm, config, policy, pass_cost, surface), 0.0)


def in_turn(going: Sequence[int], turn: int) -> list[int]:
    """The replays still going (their indices), in the order they take their passes in round ``turn``: each round
    one place further, so that no policy always passes first, after whatever ran between rounds (a UI's redraw, a
    progress line), nor always after the same other policy."""
    first = turn % len(going) if going else 0
    return [*going[first:], *going[:first]]


def take_turns(replays: Sequence[Iterator[PolicyRun]]) -> Iterator[list[tuple[int, PolicyRun]]]:
    """Live replays (``live_replay``) taking turns pass by pass: each round, every replay still going takes one pass
    (``in_turn``'s order); yields the round's (index, run) pairs until every replay has ended."""
    going, turn = list(range(len(replays))), 0
    while going:
        done = []
        for i in in_turn(going, turn):
            run = next(replays[i], None)
            if run is None:
                going.remove(i)
            else:
                done.append((i, run))
        turn += 1
        yield done


def warm_up(lm: LoadedModel, config: SimConfig, requests: Sequence[Request]) -> None:
    """A short untimed replay (two requests, a few tokens, both widths) in every mode the policies decode in, so no
    policy pays first-call costs."""
    modes = dict.fromkeys(mode_of(parse_policy(spec), config.mode) for spec in config.policies)
    for mode in modes:
        short = SimConfig(
            rate=config.rate, requests=2, max_batch=2, max_new_tokens=4, policies=("fixed:0.5",), mode=mode
        )
        for policy in ("fixed:1.0", "fixed:0.5"):
            replay(lm, short, policy, [Request(i, r.prompt, 0.0) for i, r in enumerate(requests[:2])])


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarise(run: PolicyRun) -> dict:
    """Throughput, latency, queue and tau figures of one replay (module docstring)."""
    served = list(run.loop.served.values())
    done = [s for s in served if s.status == "done"]
    start = min((s.request.arrival for s in served), default=0.0)
    makespan = max((s.finished for s in served if s.finished is not None), default=start) - start
    tokens = sum(len(s.token_ids) for s in done)
    passes = [p for s in served for p in s.trace]
    decoding = [p for p in passes if p.kind == "decode"]
    weights = [e.seconds for e in run.events]
    latency, ttft = [s.latency for s in done], [s.ttft for s in done]
    r = lambda x, n=4: None if x is None else round(x, n)
    return {
        "policy": run.policy,
        "requests": len(served),
        **{status: sum(s.status == status for s in served) for status in ("done", "stopped", "error")},
        "tokens": tokens,
        "makespan_s": r(makespan, 3),
        "tokens_per_second": r(per_second(tokens, makespan), 2),
        "requests_per_second": r(per_second(len(done), makespan), 3),
        **{f"latency_p{q}": r(percentile(latency, q), 3) for q in (50, 95, 99)},
        **{f"ttft_p{q}": r(percentile(ttft, q), 3) for q in (50, 95)},
        "queue_max": max((e.queue for e in run.events), default=0),
        "queue_mean": r(
            sum(e.queue * w for e, w in zip(run.events, weights)) / sum(weights) if sum(weights) else 0.0, 2
        ),
        "tau_mean": r(sum(p.tau for p in passes) / len(passes) if passes else None),
        "width_mean": r(sum(p.width for p in decoding) / len(decoding) if decoding else None),
        "tokens_per_forward": r(per_forward(sum(len(p.tokens) for p in passes), len(passes)) if passes else None),
        "iterations": len(run.events),
        "wall_seconds": r(run.wall_seconds, 2),
    }


def series(run: PolicyRun) -> dict:
    """Time series for the charts: per iteration (clock, tau, queue, running, tokens) and per finished request."""
    done = sorted((s for s in run.loop.served.values() if s.status == "done"), key=lambda s: s.finished)
    return {
        "clock": [round(e.clock, 4) for e in run.events],
        "tau": [e.tau for e in run.events],
        "width": [e.width for e in run.events],
        "queue": [e.queue for e in run.events],
        "running": [e.running for e in run.events],
        "tokens": [e.tokens for e in run.events],
        "finished_at": [round(s.finished, 4) for s in done],
        "latency": [round(s.latency, 4) for s in done],
    }


def request_records(run: PolicyRun) -> list[dict]:
    """Every request: when it arrived, started, produced its first token and ended; its tokens and per-pass taus."""
    return [
        {
            "id": s.request.id, "arrival": s.request.arrival, "status": s.status, "reason": s.reason,
            "admitted": s.admitted, "first_token": s.first_token, "finished": s.finished,
            "latency": s.latency, "ttft": s.ttft, "token_ids": s.token_ids,
            "passes": [{"index": p.index, "kind": p.kind, "tau": p.tau, "width": p.width, "tokens": len(p.tokens)}
                       for p in s.trace],
        }
        for s in sorted(run.loop.served.values(), key=lambda s: s.request.id)
    ]


def reference_done(reference: PolicyRun) -> dict:
    """The reference replay's finished requests by id (the outputs quality is measured against)."""
    return {i: s for i, s in reference.loop.served.items() if s.status == "done"}


def add_agreement(summaries: list[dict], runs: list[PolicyRun], reference: PolicyRun) -> None:
    """agreement with ``reference`` (fixed:1.0), over the requests finished in both."""
    ref = reference_done(reference)
    for summary, run in zip(summaries, runs):
        both = [(s, ref[i]) for i, s in run.loop.served.items() if s.status == "done" and i in ref]
        summary["quality_requests"] = len(both)
        outputs, references = [s.token_ids for s, _ in both], [r.token_ids for _, r in both]
        summary["agreement"] = round(agreement(outputs, references), 4) if both else None
