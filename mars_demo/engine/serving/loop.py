"""Serving: continuous batching on the token-level batch decoder, with tau set per pass from the load.

Requests wait in a queue. Between two passes the loop admits the oldest waiting ones, up
to ``max_batch`` running rows: their prompts are prefilled by one pass of their own
(decoding/batch/token.py's TokenBatch) and merged into the running batch's cache (PaddedCache.merge,
holes on the left), so a row that joins decodes exactly as it would alone. Then one pass
decodes every running row; a row that finishes leaves the batch at once.

Before every iteration a **tau policy** reads the load (``Load``: queue depth, running
rows, recent latency, the oldest request's wait) and sets the tau of the next passes: the
paper's serving claim, a lower tau when requests pile up, with no model swap. Policies:
  fixed:T           tau = T always (fixed:1.0 is batched greedy AR: no masks are fed).
  ladder:Q=T,...    queue-depth ladder: the tau of the highest step Q <= requests waiting.
  demand:N=T,...    the same ladder on the requests in the system (running + waiting), priced as
                    adaptive is: the app's live shared batch (serving/shared.py), where a few users
                    share a few rows.
  latency:S         latency target: one level down (LEVELS) while the recent latency or the
                    oldest wait exceeds S seconds, one level up once both are below S / 2.
  adaptive          the default: ``DEFAULT_LADDER`` (tau 1.0 while nobody waits, then 0.95 from
                    1 waiting, 0.9 from 4, 0.8 from 8, 0.7 from 16), priced: the ladder's tau is
                    taken only where the cost surface says wider passes pay at the current row
                    count (``Load.gain`` > 1: the width controller expects more tokens per ms than
                    from one-token passes); elsewhere tau stays at the ladder's first step and the
                    passes stay narrow. tau decides quality, width decides cost.
Every pass's width comes from the width controller (width.py) on the loop's cost surface: the
measured one, or the simulated clock's own when a cost model drives the clock, so the controller
prices passes as the clock charges them.
Rows decode in one mode for the whole loop: "mars" (tau from the policy), "hybrid" (the
same, unaccepted guesses verified) or "exact" (tau fixed at 1.0: lossless; the policy is not
consulted). Every request ends exactly once, "done" (eos or length), "stopped" or "error", with its
tokens and its trace: per pass, the tau it was decoded at, the tokens accepted and the clock.

The loop keeps its own clock. By default it advances by the measured seconds of each
pass; ``pass_cost(rows, width, kind, measured)`` replaces them with a cost model (seconds;
kind is "prefill" or "decode"), which makes a replay deterministic (tests) or projects it
onto other hardware (research/simulation.model_cost). Arrivals are read off that clock: no sleeps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..backends.base import Backend
from ..backends.placement import SeededGenerator
from ..decoding.batch.token import TokenBatch
from ..decoding.config import MODES, RANGES, VERIFYING_MODES, DecodeConfig, check_tau
from ..decoding.loop import context_limit
from ..decoding.sampling import Sampling, check_temperature
from ..decoding.surface import Surface
from ..decoding.width import WidthController
from .policies import ENDINGS, RECENT, Load, Policy

PassCost = Callable[[int, int, str, float], float]  # (rows, columns per row, "prefill" | "decode", measured s) -> s
FORGET_AFTER = 64  # finished rows a running batch's book may hold before it forgets them (TokenBatch.compact)


@dataclass(frozen=True)
class Request:
    """A prompt (token ids) and when it arrives on the loop's clock."""

    id: int
    prompt: tuple[int, ...]
    arrival: float = 0.0


@dataclass(frozen=True)
class PassStep:
    """What one pass did for one request."""

    index: int  # the loop's pass index
    kind: str  # "prefill" (its first pass) or "decode"
    tau: float
    tokens: tuple[int, ...]
    clock: float  # the loop's clock when the pass ended
    confidences: tuple[float, ...] = ()  # of each accepted token
    width: int = 0  # candidates the request was offered in this pass (1: an AR pass)


@dataclass
class Served:
    """One request's whole story; ``status`` ends in ENDINGS exactly once."""

    request: Request
    status: str = "waiting"  # waiting, running, done, stopped, error
    reason: str | None = None  # done: "eos" or "length"; error: the message
    token_ids: list[int] = field(default_factory=list)
    trace: list[PassStep] = field(default_factory=list)
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def ended(self) -> bool:
        return self.status in ENDINGS

    @property
    def latency(self) -> float | None:
        return None if self.finished is None else self.finished - self.request.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.request.arrival


@dataclass(frozen=True)
class LoopEvent:
    """One iteration of the loop: admissions (with their prefill pass) and one decoding pass."""

    index: int
    clock: float  # after the iteration
    tau: float
    queue: int  # requests waiting after admission
    running: int  # rows in the decoding pass
    width: int  # columns the decoding pass fed per row (0: no pass)
    seconds: float  # clock time the iteration charged (prefill + pass)
    tokens: int  # tokens accepted, all requests, prefill included
    admitted: tuple[int, ...] = ()
    ended: tuple[int, ...] = ()
    why: str = ""  # the width controller's reason for the decoding pass's width


@dataclass(frozen=True)
class ServeConfig:
    """How the loop decodes: one mode for every row; ``max_batch`` bounds the running rows.

    temperature, top_p, top_k: as in DecodeConfig (exact mode samples as AR does); ``seed``: one generator
    for the loop's every draw, so a replay on a simulated clock samples the same tokens again.
    """

    mode: str = "mars"
    max_batch: int = 8
    max_new_tokens: int = 128
    block_size: int = 4
    metric: str = "probability"
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_temperature(self.temperature, RANGES["temperature"][1])
        Sampling(self.temperature, self.top_p, self.top_k)  # checks top_p and top_k
        if self.mode not in MODES or self.mode == "ar":
            raise ValueError(f"serving mode must be one of mars, hybrid, exact (AR is fixed:1.0), got {self.mode!r}")
        for name in ("max_batch", "max_new_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be an integer of at least 1, got {value!r}")

    def decode_config(self) -> DecodeConfig:
        """The DecodeConfig every row of the batch decodes under (its tau comes from the policy, pass by pass)."""
        return DecodeConfig(mode=self.mode, metric=self.metric, max_new_tokens=self.max_new_tokens,
                            block_size=self.block_size, temperature=self.temperature, top_p=self.top_p,
                            top_k=self.top_k, seed=self.seed)


class ServingLoop:
    """Continuous batching over one model (see the module docstring); ``run`` replays a list of requests."""

    def __init__(
        self, backend: Backend, *, mask_id: int, pad_id: int, stop_ids: set[int], config: ServeConfig,
        policy: Policy, pass_cost: PassCost | None = None, surface: Surface | None = None,
    ) -> None:
        """``surface``: what a pass costs by rows and width (width.py); None takes width to be free."""
        self.backend, self.mask_id, self.pad_id, self.stop_ids = backend, mask_id, pad_id, set(stop_ids)
        self.config, self.policy, self.pass_cost = config, policy, pass_cost
        self.controller = WidthController(surface, config.block_size, verifying=config.mode in VERIFYING_MODES)
        self.generator = SeededGenerator(config.seed)  # every batch's draws, newcomers' included
        self.clock = 0.0
        self.served: dict[int, Served] = {}
        self.queue: deque[int] = deque()
        self.batch: TokenBatch | None = None
        self.rows: dict[int, int] = {}  # batch book row -> request id
        self.finished: list[float] = []  # latencies, in finishing order
        self.passes = 0

    # -- requests in and out ------------------------------------------------------------------
    def submit(self, request: Request) -> Served:
        """Queue a request (its arrival is due); a prompt the model cannot take ends at once with an error."""
        if request.id in self.served:
            raise ValueError(f"request {request.id} was already submitted")
        served = self.served[request.id] = Served(request)
        room = context_limit(self.backend) - len(request.prompt) - 2 * self.config.block_size
        if not request.prompt or room < 1:
            size = len(request.prompt)
            why = "the prompt is empty" if not size else f"the prompt is {size} tokens: too long"
            self._end(served, "error", why)
        else:
            self.queue.append(request.id)
        return served

    def stop(self, request_id: int) -> None:
        """End one request now, waiting or running ("stopped"); nothing if it has ended."""
        served = self.served[request_id]
        if served.ended:
            return
        if served.status == "waiting":
            self.queue.remove(request_id)
        else:
            row = next(r for r, i in self.rows.items() if i == request_id)
            self.batch.end(row, "stopped")
            del self.rows[row]
        self._end(served, "stopped", None)

    def release(self, request_id: int) -> Served:
        """Forget an ended request (a long-lived loop, serving/shared.py, keeps only what is in flight)."""
        if not self.served[request_id].ended:
            raise ValueError(f"request {request_id} has not ended")
        del self.finished[:-RECENT]
        return self.served.pop(request_id)

    def stop_all(self) -> None:
        for request_id in [*self.queue, *self.rows.values()]:
            self.stop(request_id)

    def _end(self, served: Served, status: str, reason: str | None) -> None:
        if served.ended:  # the accounting invariant: never reached, and loud if it ever is
            raise RuntimeError(f"request {served.request.id} ended twice")
        served.status, served.reason, served.finished = status, reason, self.clock
        if status == "done":
            self.finished.append(served.latency)

    # -- one iteration -----------------------------------------------------------------------
    def load(self, admitting: int = 0) -> Load:
        recent = self.finished[-RECENT:]
        oldest = self.clock - self.served[self.queue[0]].request.arrival if self.queue else 0.0
        return Load(len(self.queue), len(self.rows) + admitting, self.config.max_batch,
                    sum(recent) / len(recent) if recent else None, max(oldest, 0.0), self.controller)

    def step(self) -> LoopEvent:
        """Admit what fits, pick tau from the load that remains, prefill the newcomers, then one decoding pass."""
        take = max(min(len(self.queue), self.config.max_batch - len(self.rows)), 0)
        admitted = [self.queue.popleft() for _ in range(take)]
        load = self.load(len(admitted))
        tau = 1.0 if self.config.mode == "exact" else check_tau(self.policy(load))
        index, started_clock = self.passes, self.clock
        if admitted:
            self._admit(admitted, tau)
        tokens = sum(len(self.served[i].token_ids) for i in admitted)
        ended = [i for i in admitted if self.served[i].ended]
        running, width = len(self.rows), 0
        if self.rows:
            width, got, done = self._decode(tau)
            tokens, ended = tokens + got, ended + done
        self.passes += 1
        why = self.controller.why() if width else ""
        return LoopEvent(index, self.clock, tau, load.queue, running, width, self.clock - started_clock,
                         tokens, tuple(admitted), tuple(ended), why)

    def _charge(self, measured: float, rows: int, width: int, kind: str) -> float:
        seconds = self.pass_cost(rows, width, kind, measured) if self.pass_cost is not None else measured
        self.clock += seconds
        return seconds

    def _admit(self, ids: list[int], tau: float) -> None:
        """Prefill these requests together in one pass of their own, then merge their rows into the batch."""
        for i in ids:
            self.served[i].status, self.served[i].admitted = "running", self.clock
        newcomers = self._new_batch([self.served[i].request.prompt for i in ids])
        newcomers.joins = len(self.rows)  # the running rows: its prefill's drafts are for passes among them
        steps, _ = self._guarded(lambda: newcomers.step(tau), ids, len(ids), "prefill")
        if steps is None:
            return
        rows = dict(enumerate(ids))  # newcomers' book row -> request id
        self._record(rows, steps, "prefill", tau, newcomers)
        if self.batch is None or not self.rows:
            self.batch, self.rows = newcomers, {r: rows[r] for r in newcomers.active}
        else:
            joined = self.batch.join(newcomers)
            self.rows.update({new: rows[old] for new, old in zip(joined, newcomers.active)})

    def _decode(self, tau: float) -> tuple[int, int, list[int]]:
        """One pass over the running rows: (columns fed per row, tokens accepted, requests that ended)."""
        rows = dict(self.rows)
        steps, width = self._guarded(lambda: self.batch.step(tau), list(rows.values()), len(rows), "decode")
        if steps is None:
            return 0, 0, list(rows.values())
        ended = self._record(rows, steps, "decode", tau, self.batch)
        self.batch.kv.trim()
        if len(self.batch.book.produced) - len(self.rows) >= FORGET_AFTER:  # a batch that never empties
            moved = self.batch.compact()
            self.rows = {moved[r]: i for r, i in self.rows.items()}
        return width, sum(len(steps[r].token_ids) for r in rows), ended

    def _guarded(self, run_pass: Callable, ids: list[int], rows: int, kind: str):
        """Run one pass and charge it; if it raises, its requests end with the error and their rows go."""
        started = time.perf_counter()
        try:
            steps, width = run_pass()
        except Exception as err:  # noqa: BLE001 - a failed pass must still end every request in it exactly once
            self._charge(time.perf_counter() - started, rows, 1, kind)
            for i in ids:
                self._end(self.served[i], "error", f"{type(err).__name__}: {err}")
            self.rows = {r: i for r, i in self.rows.items() if i not in ids}
            if not self.rows:
                self.batch = None
            return None, 0
        self._charge(time.perf_counter() - started, rows, width, kind)
        return steps, width

    def _record(self, rows: dict[int, int], steps, kind: str, tau: float, batch: TokenBatch) -> list[int]:
        """Add each row's step to its request; end the requests whose rows finished. Returns those ids."""
        ended = []
        for row, request_id in rows.items():
            step, served = steps[row], self.served[request_id]
            if served.ended:
                continue
            served.token_ids += step.token_ids
            served.trace.append(
                PassStep(self.passes, kind, tau, tuple(step.token_ids), self.clock, tuple(step.confidences),
                         step.width)
            )
            if step.token_ids and served.first_token is None:
                served.first_token = self.clock
            if step.finish:
                self._end(served, "done", step.finish)
                ended.append(request_id)
                if batch is self.batch:
                    self.rows.pop(row, None)
        return ended

    def _new_batch(self, prompts: list[tuple[int, ...]]) -> TokenBatch:
        c = self.config
        return TokenBatch(
            self.backend, prompts, c.decode_config(), block_size=c.block_size, mask_id=self.mask_id,
            pad_id=self.pad_id, stop_ids=self.stop_ids, controller=self.controller, generator=self.generator,
        )

    # -- a whole replay ------------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self, requests: Sequence[Request], *, deadline: float | None = None, stop: Callable[[], bool] | None = None,
    ) -> Iterator[LoopEvent]:
        """Submit ``requests`` as the clock reaches their arrivals and step until every one has ended.

        ``deadline`` (wall-clock seconds from now) or ``stop()`` returning True: every request
        not yet ended is stopped, between two iterations. Idle time (nothing running, nothing
        waiting) jumps to the next arrival.
        """
        due = deque(sorted(requests, key=lambda r: (r.arrival, r.id)))
        stop_at = None if deadline is None else time.monotonic() + deadline
        while due or self.queue or self.rows:
            if (stop_at is not None and time.monotonic() > stop_at) or (stop is not None and stop()):
                for request in due:
                    self.submit(request)
                due.clear()
                self.stop_all()
                break
            if not self.queue and not self.rows and due:
                self.clock = max(self.clock, due[0].arrival)
            while due and due[0].arrival <= self.clock:
                self.submit(due.popleft())
            if self.queue or self.rows:
                yield self.step()
