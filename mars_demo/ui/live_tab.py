"""The Serving tab's live section: the app's own visitors share one running batch, and tau follows them.

Send puts the visitor's prompt into the picked model's shared batch (engine/serving/shared.py): one
worker thread per loaded model decodes every visitor's request together, a newcomer joining
between two passes, and before every pass the live policy sets tau from the load (by default
``engine.serving.shared.LIVE_POLICY``: tau 1.0 while one request is in the batch, 0.9 with two, 0.8
with three or four, 0.7 once someone waits). Each visitor sees only their own stream: their
tokens, coloured by the pass that accepted them, with the tau of that pass in each token's
tooltip and in the chart's tau line. Stop (or closing the page) takes the request out of the
batch at the next pass boundary.

Bounds (MARS_DEMO_LIVE_ROWS, MARS_DEMO_LIVE_QUEUE, MARS_DEMO_LIVE_POLICY): rows decoding,
requests waiting beyond them (a visitor past both is told to try again), LIVE_NEW_TOKENS per
request, one request per visitor at a time, and the host's time budget per request
(hosting.Limits). The shared batch runs beside the decoding slot that races and sweeps take
turns on, so on a small CPU both go slower while both run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, replace
from html import escape

import gradio as gr

from .. import settings
from ..engine.checkpoints.memory import trim_heap
from ..engine.decoding.chat import prompt_ids
from ..engine.decoding.loop import Detokenizer, StepEvent
from ..engine.serving.loop import ServeConfig
from ..engine.serving.shared import Busy, LiveRequest, LiveUpdate, SharedBatches
from . import charts
from .handlers import outputs
from .messages import error, sentence, warning
from .render import mars_pane

LIVE_OUTPUTS = ("live_status", "live_pane", "live_plot")
LIVE_NEW_TOKENS = 96
MAX_PROMPT_CHARS = 4000
BUSY_LIVE = "The shared batch is full right now (every row is decoding and the queue is full): try again in a moment."
STATUS = {"waiting": "idle", "running": "running"}  # a request's status -> the pane's chip

LIVE_INTRO = """**Live: share one batch with the other visitors.** Send a prompt: it joins the batch that every
visitor's live requests decode in, between two forward passes. Before every pass tau is set from how many
requests are in the batch (1.0 alone, lower as more share it), so your tokens speed up when others join.
Hover a token for the tau its pass accepted it at; the chart draws tau per pass. Model from the sidebar;
greedy decoding, at most {tokens} new tokens, {rows} requests decoding and {queue} waiting. Policy: `{policy}`."""


@dataclass
class LiveState:
    """One browser session's live request (None before the first Send)."""

    request: LiveRequest | None = None
    view: LiveView | None = None  # what the request has streamed so far


def batches_from_env(env: Mapping[str, str] | None = None) -> SharedBatches:
    """The shared batches with MARS_DEMO_LIVE_ROWS (default 4), _QUEUE (4), _POLICY (serving.shared.LIVE_POLICY)
    and _PACE (0: seconds a pass takes at least); a bad value is a ValueError naming it. None: this process's."""
    rows = settings.LIVE_ROWS.read(env)
    return SharedBatches(ServeConfig(max_batch=rows, max_new_tokens=LIVE_NEW_TOKENS),
                         policy=settings.LIVE_POLICY.read(env), max_queue=settings.LIVE_QUEUE.read(env), idle=30.0,
                         pace=settings.LIVE_PACE.read(env))


class LiveView:
    """One request's passes as StepEvents (its own pass numbers, the loop's tau), for the pane and the chart."""

    def __init__(self, tokenizer, block_size: int) -> None:
        self.detok, self.block_size = Detokenizer(tokenizer), block_size
        self.steps: list[StepEvent] = []
        self.last: LiveUpdate | None = None
        self.clock: float | None = None  # the loop's clock after this request's latest pass

    def add(self, update: LiveUpdate, arrival: float | None) -> None:
        for step in update.steps:
            start = self.clock if self.clock is not None else arrival if arrival is not None else step.clock
            self.clock = step.clock
            self.steps.append(StepEvent(
                index=len(self.steps), token_ids=step.tokens, pieces=tuple(self.detok.push(t) for t in step.tokens),
                confidences=step.confidences, tau=step.tau, seconds=max(step.clock - start, 0.0),
            ))
        if update.ended and self.steps:
            held_back = self.detok.flush()  # a character split at the very end
            if held_back:
                last = self.steps[-1]
                self.steps[-1] = replace(last, pieces=(*last.pieces[:-1], (last.pieces[-1:] or ("",))[0] + held_back))
        self.last = update

    def status_text(self, policy: str) -> str:
        u = self.last
        if u is None or u.status == "waiting":
            return "Waiting to join the shared batch (at the next pass boundary with a free row)…"
        tokens = sum(len(s.token_ids) for s in self.steps)
        tau = f"tau {self.steps[-1].tau:.2f} on your latest pass" if self.steps else "no pass yet"
        if u.status == "running":
            load = u.load
            sharing = f"{load.running} request(s) decoding, {load.queue} waiting" if load is not None else ""
            return f"Decoding in the shared batch: {sharing}; {tau} (policy {policy}); {tokens} tokens so far."
        if u.status == "done":
            return f"Done ({u.reason}): {tokens} tokens in {len(self.steps)} passes; {tau}."
        if u.status == "stopped":
            return f"Stopped: your request left the shared batch after {tokens} tokens."
        return sentence(f"Ended with an error: {u.reason}")

    def outputs(self, policy: str, chart: bool) -> tuple:
        u = self.last
        status = "idle" if u is None else STATUS.get(u.status, u.status)
        finish = u.reason if u is not None and u.status == "done" else None
        kind = "error" if u is not None and u.status == "error" else "info"
        values = {
            "live_status": f'<div class="live-status {kind}">{escape(self.status_text(policy))}</div>',
            "live_pane": mars_pane(self.steps, status, finish),
        }
        if chart:
            values["live_plot"] = charts.tokens_per_pass(self.steps, self.block_size)
        return outputs(LIVE_OUTPUTS, **values)


class LiveHandlers:
    """Send and Stop of the live section; ``demo_handlers`` (ui.handlers.DemoHandlers) lends the model cache."""

    def __init__(self, demo_handlers, batches: SharedBatches | None = None, *, chart_every: float = 1.0,
                 poll: float = 1.0) -> None:
        self.demo, self.batches = demo_handlers, batches or batches_from_env()
        self.chart_every, self.poll = chart_every, poll

    def intro(self) -> str:
        c = self.batches.config
        return LIVE_INTRO.format(tokens=c.max_new_tokens, rows=c.max_batch, queue=self.batches.max_queue,
                                 policy=self.batches.policy)

    def stop(self, state: LiveState) -> None:
        """The request leaves the batch at the next pass boundary; its stream shows the final view."""
        if state.request is not None:
            state.request.cancel()

    def send(self, prompt, spec, state: LiveState, request: gr.Request = None,
             precision: str | None = None) -> Iterator[tuple]:
        """Queue the prompt in the shared batch of the model on the sidebar's compute path (``precision``)
        and stream this visitor's passes (LIVE_OUTPUTS)."""
        text = prompt if isinstance(prompt, str) else ""
        if not text.strip():
            raise error("Type a prompt first, or pick one of the examples.", "Empty prompt", request)
        if len(text) > MAX_PROMPT_CHARS:
            raise error(f"The prompt is {len(text)} characters; the live batch takes at most {MAX_PROMPT_CHARS}.",
                        "Prompt too long", request)
        if state.request is not None and not state.request.ended:
            raise error("Your previous request is still in the shared batch: wait for it, or press Stop.",
                        "Already sent", request)
        path = self.demo._path(precision, request)  # checked as --precision is; the model cache's key
        with ExitStack() as held:
            lm = self.demo._hold(spec, held, request, path)
            try:
                live = self.batches.submit(lm, prompt_ids(lm.tokenizer, text),
                                           request.session_hash if request is not None else None)
            except Busy:
                raise error(BUSY_LIVE, "Shared batch busy", request) from None
            state.request, state.view = live, LiveView(lm.tokenizer, lm.meta.block_size)
            try:
                yield from self._stream(live, state.view, request)
            finally:
                live.cancel()  # a closed page or a cancelled event: out at the next pass (no-op once ended)
                trim_heap()

    def _stream(self, live: LiveRequest, view: LiveView, request: gr.Request | None) -> Iterator[tuple]:
        """This request's passes as views; at the host's time budget it leaves the batch (what it got is kept)."""
        policy = self.batches.policy
        yield view.outputs(policy, True)
        charted = deadline = time.monotonic()
        deadline += self.demo.limits.run_seconds
        while True:
            if time.monotonic() >= deadline and not live.ended:
                deadline = float("inf")
                live.cancel()  # out at the next pass boundary; its last update ends this stream
                warning(self.demo.limits.over_budget("request"), "Time limit", request)
            update = live.next_update(self.poll)
            if update is None:
                yield outputs(LIVE_OUTPUTS)  # nothing new (waiting, or a slow pass): every output skipped
                continue
            batch = [update]
            while not batch[-1].ended and (more := live.next_update(0)) is not None:
                batch.append(more)  # passes that piled up while the page was drawing: one redraw
            for u in batch:
                view.add(u, live.arrival)
            ended = batch[-1].ended
            due = ended or time.monotonic() - charted >= self.chart_every
            if due:
                charted = time.monotonic()
            yield view.outputs(policy, due)
            if ended:
                if batch[-1].status == "error":
                    warning(view.status_text(policy), "Request ended", request)
                return


def live_cleanup(batches: SharedBatches):
    """The unload handler: cancels a closed tab's requests (a plain function: Gradio copies a method's object)."""

    def forget_live(request: gr.Request) -> None:
        batches.cancel_owner(request.session_hash)

    return forget_live


LIVE_CSS = """
.live-status { font-size: 13px; padding: 6px 10px; border-radius: 8px; background: var(--background-fill-secondary); }
.live-status.error { background: #fef2f2; color: #991b1b; }
"""
