"""Live serving: concurrent callers (the app's users) share one running batch, and tau follows their load.

A ``SharedBatch`` drives one ``loop.ServingLoop`` (continuous batching on the token-level
batch) from a background worker thread. Any thread may ``submit`` a prompt (token ids) and gets
a ``LiveRequest``: its own queue of ``LiveUpdate``s, which only that request's passes reach. The
worker starts with the first request and ends after ``idle`` seconds with nothing in flight.
Between two passes it takes in what arrived (new requests, cancellations), then runs one
iteration of the loop: newcomers are prefilled and join the running rows, the policy sets tau
from the live load (requests waiting, rows running), and one pass decodes every row. Each
request then gets the passes it took part in: per pass the tokens, their confidences and the
tau they were accepted at. ``SharedBatches`` keeps one SharedBatch per loaded model.
Each pass's width comes from the width controller on the model's measured cost surface
(width.py; measured once per machine, at the first live request), and the demand ladder
lowers tau only where wider passes pay at the rows running (loop.py, "priced").

Bounds: at most ``config.max_batch`` rows decode and ``max_queue`` requests wait; a request
beyond that is refused at once with ``Busy``. ``config.max_new_tokens`` bounds every request.
A cancelled request (Stop, a closed page) leaves the batch at the next pass boundary. A pass
that fails ends the requests in it with the error (loop.py); anything else that fails ends
the requests in flight with the error and the worker goes on with a fresh loop. Every request
ends exactly once: its last update has status "done", "stopped" or "error".
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from ..backends.base import Backend
from ..decoding.chat import pad_id
from ..decoding.loop import eos_ids
from ..decoding.surface import Surface, surface_for
from ..model import LoadedModel
from .loop import PassStep, Request, ServeConfig, ServingLoop
from .policies import ENDINGS, Load, Policy, parse_policy

logger = logging.getLogger(__name__)

LIVE_POLICY = "demand:2=0.9,3=0.8,5=0.7"  # 1 request: AR (tau 1.0); 2: 0.9; 3-4: 0.8; 5 or more: 0.7
HISTORY = 2000  # passes kept in SharedBatch.passes


class Busy(RuntimeError):
    """Every row and every queue place is taken: try again later."""


class Retired(RuntimeError):
    """The worker went idle and this SharedBatch takes no more requests (SharedBatches makes a new one)."""


@dataclass(frozen=True)
class LiveUpdate:
    """What happened to one request since its last update."""

    steps: tuple[PassStep, ...]  # its new passes, oldest first
    status: str  # "waiting", "running", or one of policies.ENDINGS (the last update)
    reason: str | None = None  # done: "eos" or "length"; error: the message
    load: Load | None = None  # the load the latest pass's tau was chosen for

    @property
    def ended(self) -> bool:
        return self.status in ENDINGS


@dataclass(frozen=True)
class LivePass:
    """One iteration of the shared loop: the load the policy saw and the tau it chose."""

    index: int
    tau: float
    load: Load
    running: int  # rows in the decoding pass
    width: int  # columns fed per row (0: no decoding pass)
    seconds: float


class LiveRequest:
    """A caller's handle: its updates (``next_update``), ``cancel``; ``arrival`` is on the loop's clock."""

    def __init__(self, request_id: int, prompt: tuple[int, ...], owner: str | None, batch: SharedBatch) -> None:
        self.id, self.prompt, self.owner, self._batch = request_id, prompt, owner, batch
        self.arrival: float | None = None
        self.status = "waiting"
        self.delivered = 0  # trace entries already sent
        self._updates: queue.Queue[LiveUpdate] = queue.Queue()
        self._ended = threading.Event()

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    def __deepcopy__(self, memo) -> LiveRequest:
        """A handle on a request in flight, never duplicated (a copied session state must not copy the model)."""
        return self

    def cancel(self) -> None:
        """Leave at the next pass boundary (nothing once ended)."""
        if not self.ended:
            self._batch.cancel(self.id)

    def next_update(self, timeout: float | None = None) -> LiveUpdate | None:
        """The next update, or None after ``timeout`` seconds without one."""
        try:
            return self._updates.get(timeout=timeout)
        except queue.Empty:
            return None

    def updates(self, timeout: float | None = None) -> Iterator[LiveUpdate]:
        """Every update up to and including the last (``timeout``: most seconds to wait for each)."""
        while True:
            update = self.next_update(timeout)
            if update is None:
                raise TimeoutError(f"no update for request {self.id} in {timeout} s")
            yield update
            if update.ended:
                return

    def _push(self, update: LiveUpdate) -> None:
        if self.ended:  # the accounting invariant: never reached, and loud if it ever is
            raise RuntimeError(f"live request {self.id} ended twice")
        self.status = update.status
        if update.ended:
            self._ended.set()
        self._updates.put(update)


def check_pace(pace: float) -> None:
    """A live batch's pace: seconds from one pass's start to the next at least, 0-1 (0: as fast as it decodes)."""
    if not 0 <= pace <= 1:
        raise ValueError(f"pace must be 0-1 seconds, got {pace}")


class SharedBatch:
    """One model's shared batch and its worker thread (see the module docstring)."""

    def __init__(
        self, backend: Backend, *, mask_id: int, pad_id: int, stop_ids: set[int], config: ServeConfig,
        policy: Policy | None = None, max_queue: int = 4, idle: float = 10.0, pace: float = 0.0, on_retire=None,
        surface: Surface | None = None,
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max queue must be at least 0, got {max_queue}")
        check_pace(pace)
        self.backend, self.mask_id, self.pad_id, self.stop_ids = backend, mask_id, pad_id, set(stop_ids)
        self.model = backend.model  # the weights this batch decodes with (SharedBatches keys batches by them)
        self.config, self.policy = config, policy or parse_policy(LIVE_POLICY)
        self.surface = surface  # what the width controller prices passes on (width.py)
        self.max_queue, self.idle, self._on_retire = max_queue, idle, on_retire
        # seconds from one pass's start to the next at least (0: as fast as it decodes): on a fast CPU a
        # 96-token answer streams in half a second; a pace lets visitors watch it stream
        self.pace = pace
        self.passes: deque[LivePass] = deque(maxlen=HISTORY)
        self.retired = False  # the worker went idle and this batch takes no more requests (SharedBatches)
        self._cond = threading.Condition()  # guards the inbox, the cancellations, the requests in flight
        self._step = threading.Lock()  # held by the worker for each iteration; ``paused`` takes it
        self._pausing = 0  # callers waiting in ``paused``: the worker starts no iteration meanwhile
        self._inbox: list[LiveRequest] = []
        self._cancels: set[int] = set()
        self._live: dict[int, LiveRequest] = {}  # submitted and not ended
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._loop: ServingLoop | None = None
        self._seen: Load | None = None
        self._t0 = time.monotonic()

    @classmethod
    def of(cls, lm: LoadedModel, config: ServeConfig, **kwargs) -> SharedBatch:
        return cls(lm.backend, mask_id=lm.meta.mask_token_id, pad_id=pad_id(lm.tokenizer),
                   stop_ids=eos_ids(lm.backend, lm.tokenizer), config=config, surface=surface_for(lm), **kwargs)

    # -- callers ----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.max_batch + self.max_queue

    def in_flight(self) -> int:
        with self._cond:
            return len(self._live)

    def submit(self, prompt: Sequence[int], owner: str | None = None) -> LiveRequest:
        """Queue a prompt; ``Busy`` when every row and queue place is taken, ``Retired`` once retired."""
        with self._cond:
            if self.retired:
                raise Retired("this shared batch has retired")
            if len(self._live) >= self.capacity:
                raise Busy(f"the shared batch is full ({self.config.max_batch} decoding, {self.max_queue} waiting)")
            live = LiveRequest(next(self._ids), tuple(int(t) for t in prompt), owner, self)
            self._live[live.id] = live
            self._inbox.append(live)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="mars-live-batch", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return live

    def cancel(self, request_id: int) -> None:
        with self._cond:
            if request_id in self._live:
                self._cancels.add(request_id)
                self._cond.notify_all()

    def cancel_owner(self, owner: str) -> int:
        """Cancel every request of one owner (a browser session that closed); how many."""
        with self._cond:
            ids = [i for i, r in self._live.items() if r.owner == owner]
        for i in ids:
            self.cancel(i)
        return len(ids)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No pass runs inside this block (requests submitted meanwhile join together when it ends).

        It starts at the end of the iteration under way: the worker lets a waiting pause go first.
        """
        with self._cond:
            self._pausing += 1
        try:
            with self._step:
                yield
        finally:
            with self._cond:
                self._pausing -= 1
                self._cond.notify_all()

    # -- the worker -------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: self._live, timeout=self.idle):
                    self._thread, self._loop, self.retired = None, None, True
                    break
                self._cond.wait_for(lambda: not self._pausing)
            started = time.monotonic()
            with self._step, torch.inference_mode():
                with self._cond:
                    inbox, self._inbox = self._inbox, []
                    cancels, self._cancels = self._cancels, set()
                self._iterate(inbox, cancels)
            if self.pace > 0:  # outside the step: ``paused`` and new requests get in meanwhile
                time.sleep(max(0.0, self.pace - (time.monotonic() - started)))
        if self._on_retire is not None:
            self._on_retire(self)

    def _iterate(self, inbox: list[LiveRequest], cancels: set[int]) -> None:
        loop = self._loop or self._new_loop()
        try:
            loop.clock = max(loop.clock, time.monotonic() - self._t0)  # the loop's clock follows the wall clock
            for live in inbox:
                live.arrival = loop.clock
                loop.submit(Request(live.id, live.prompt, loop.clock))
            for request_id in cancels:
                if request_id in loop.served:
                    loop.stop(request_id)
            if loop.queue or loop.rows:
                event = loop.step()
                self.passes.append(LivePass(event.index, event.tau, self._seen, event.running, event.width,
                                            event.seconds))
            self._deliver(loop)
        except Exception as err:  # the worker outlives any failure; the requests in flight end
            logger.exception("the shared batch failed; ending the requests in it")
            self._loop = None
            self._fail(loop, f"{type(err).__name__}: {err}")

    def _new_loop(self) -> ServingLoop:
        self._loop = ServingLoop(self.backend, mask_id=self.mask_id, pad_id=self.pad_id, stop_ids=self.stop_ids,
                                 config=self.config, policy=self._choose, surface=self.surface)
        return self._loop

    def _choose(self, load: Load) -> float:
        """The policy, recording the load it was asked about (LivePass)."""
        self._seen = load
        return self.policy(load)

    def _deliver(self, loop: ServingLoop) -> None:
        """Hand each request its new passes (and its ending), then forget the ended ones."""
        with self._cond:
            flight = list(self._live.values())
        for live in flight:
            served = loop.served.get(live.id)
            if served is None:
                continue  # not submitted to the loop yet
            new = tuple(served.trace[live.delivered :])
            if new or served.status != live.status:
                live.delivered = len(served.trace)
                live._push(LiveUpdate(new, served.status, served.reason, self._seen))
            if served.ended:
                with self._cond:
                    del self._live[live.id]
                loop.release(live.id)

    def _fail(self, loop: ServingLoop, message: str) -> None:
        """End every request in flight except those that arrived after this iteration began."""
        with self._cond:
            waiting = {live.id for live in self._inbox}
            failed = [live for i, live in self._live.items() if i not in waiting and not live.ended]
            for live in failed:
                del self._live[live.id]
        for live in failed:
            served = loop.served.get(live.id)
            new = tuple(served.trace[live.delivered :]) if served is not None else ()
            live._push(LiveUpdate(new, "error", message, self._seen))


class SharedBatches:
    """One SharedBatch per loaded model, made on first use and dropped when its worker retires."""

    def __init__(
        self, config: ServeConfig, *, policy: str = LIVE_POLICY, max_queue: int = 4, idle: float = 10.0,
        pace: float = 0.0,
    ) -> None:
        parse_policy(policy)  # a bad spec fails here, once
        check_pace(pace)
        self.config, self.policy, self.max_queue, self.idle, self.pace = config, policy, max_queue, idle, pace
        self._batches: dict[int, SharedBatch] = {}
        self._lock = threading.Lock()

    def submit(self, lm: LoadedModel, prompt: Sequence[int], owner: str | None = None) -> LiveRequest:
        """Queue a prompt in ``lm``'s shared batch (``Busy`` when full)."""
        with self._lock:
            try:
                return self._current(lm).submit(prompt, owner)
            except Retired:  # its worker went idle just now: a fresh batch
                del self._batches[id(lm.model)]
                return self._current(lm).submit(prompt, owner)

    def batch_for(self, lm: LoadedModel) -> SharedBatch:
        """``lm``'s shared batch, made if there is none (``paused`` on it holds every pass)."""
        with self._lock:
            return self._current(lm)

    def _current(self, lm: LoadedModel) -> SharedBatch:
        batch = self._batches.get(id(lm.model))
        if batch is None or batch.model is not lm.model or batch.retired:
            batch = self._batches[id(lm.model)] = self._new(lm)
        return batch

    def _new(self, lm: LoadedModel) -> SharedBatch:
        config = replace(self.config, block_size=lm.meta.block_size)  # the model's block size; the rest as set
        return SharedBatch.of(lm, config, policy=parse_policy(self.policy), max_queue=self.max_queue, idle=self.idle,
                              pace=self.pace, on_retire=self._retire)

    def _retire(self, batch: SharedBatch) -> None:
        with self._lock:
            if self._batches.get(id(batch.model)) is batch:
                del self._batches[id(batch.model)]

    def batches(self) -> list[SharedBatch]:
        with self._lock:
            return list(self._batches.values())

    def cancel_owner(self, owner: str) -> int:
        return sum(batch.cancel_owner(owner) for batch in self.batches())
