"""Fair to every visitor: the host's limits, the decoding slot, one job per session, a message for every bad call.

``Limits`` reads every limit once from the environment (declared in mars_demo/settings.py, listed in
docs/hosting.md). When the app believes it is public (``settings.hosted``: a Space, or GRADIO_SERVER_NAME
beyond this machine) the defaults are the hosted ones: a shorter time budget per run, fewer new tokens, a
smaller sweep, the compute path fixed to the one the shared model was loaded on, one decoding
job per session. Each one is the host's to override.

``DecodeSlot`` is the decoding slot as the work sees it. Gradio frees its concurrency slot when it
has closed a cancelled run's generator, but a run's work is what must end: every run holds this
slot from its first pass to the end of its generator, so a second run cannot decode while the first
one still does, whichever way the first ended. Each holder gets a cancel flag that its loop reads
before every pass (``cancel_owner``: a closed tab). The decoding loops yield once per forward pass
(a view when one is due, else nothing to draw), so Stop, a closed tab or a cancelled API call ends
the work within one pass: Gradio closes a cancelled generator at its next yield.

``ClearBlocks`` answers every call with a message: an API call with too few inputs or an input of
the wrong type gets one sentence naming the input (never the value it sent), and an error that is no
``gr.Error`` is logged and answered with a generic sentence, never Gradio's empty ``{"error": null}``.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import gradio as gr

from .. import settings
from ..engine.decoding.config import RANGES

logger = logging.getLogger(__name__)

LIMIT_SETTINGS = {  # each of Limits' fields -> its variable
    "run_seconds": settings.RUN_SECONDS,
    "max_new_tokens": settings.MAX_NEW_TOKENS,
    "sweep_runs": settings.SWEEP_RUNS,
    "sweep_tokens": settings.SWEEP_TOKENS,
    "paths": settings.PATHS,
    "session_jobs": settings.SESSION_JOBS,
    "upload_mb": settings.UPLOAD_MB,
}
# (variable, local default, hosted default) of every limit
SETTINGS = {key: (s.name, s.default, s.hosted_default) for key, s in LIMIT_SETTINGS.items()}
PATH_RULES = ("any", "shared")
SLOT_BUSY = "The decoding slot is still busy finishing another run: try again in a moment."
ONE_JOB = "You already have a run waiting or decoding: wait for it to end, or press Stop."
UNEXPECTED = "Something went wrong on the server while handling this call (the server log says what). Try again."


@dataclass(frozen=True)
class Limits:
    """The host's limits (``LIMIT_SETTINGS``): every value is checked here, once."""

    hosted: bool = False
    run_seconds: float = settings.RUN_SECONDS.default  # wall-clock budget of one run (race, sweep, serving, live)
    max_new_tokens: int = settings.MAX_NEW_TOKENS.default  # a race's max new tokens
    sweep_runs: int = settings.SWEEP_RUNS.default  # runs one sweep may plan (per prompt: AR, exact, tau 1.0, each tau)
    sweep_tokens: int = settings.SWEEP_TOKENS.default  # a sweep run's max new tokens
    paths: str = settings.PATHS.default  # "shared": only the path the shared model is on; "any": every path
    session_jobs: int = settings.SESSION_JOBS.default  # decoding jobs a session may have queued or running (0: any)
    upload_mb: float = settings.UPLOAD_MB.default  # Gradio's upload route refuses larger files (the app uploads none)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.run_seconds) and self.run_seconds > 0):
            raise ValueError(f"the run budget must be a positive number of seconds, got {self.run_seconds}")
        top = int(RANGES["max_new_tokens"][1])
        for name in ("max_new_tokens", "sweep_tokens", "sweep_runs"):
            value = getattr(self, name)
            if not 1 <= value <= (top if name != "sweep_runs" else 10_000):
                raise ValueError(f"{LIMIT_SETTINGS[name].name} is out of range, got {value}")
        if self.paths not in PATH_RULES:
            raise ValueError(f"{settings.PATHS.name} must be one of {', '.join(PATH_RULES)}, got {self.paths!r}")
        if self.session_jobs < 0 or not 0 <= self.upload_mb <= 10_000:
            raise ValueError("session jobs must be 0 or more and the upload limit 0-10000 MB")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Limits:
        """Hosted or local defaults, each overridden by its variable; a bad value is a ValueError naming it.

        ``env``: the environment (None: this process's)."""
        return cls(hosted=settings.hosted(env), **{key: s.read(env) for key, s in LIMIT_SETTINGS.items()})

    def over_budget(self, what: str) -> str:
        """The message for a run that the time budget ended."""
        return (f"This {what} reached this server's time limit of {self.run_seconds:g} s per run. "
                "What it decoded is kept.")

    @property
    def upload_bytes(self) -> int:
        return int(self.upload_mb * 2**20)


class SlotBusy(RuntimeError):
    """The slot did not come free in time (a run that ended is still being closed, or was never closed)."""


class DecodeSlot:
    """At most ``size`` runs decode at once; each holds the slot until its work has ended (module docstring)."""

    def __init__(self, size: int = 1, wait: float = 10.0) -> None:
        if size < 1:
            raise ValueError(f"the decoding slot takes at least one run, got {size}")
        self.size, self.wait = size, wait  # wait: most seconds a run waits for a run that is ending
        self._free = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._runs: dict[str | None, set[threading.Event]] = {}

    @contextmanager
    def hold(self, owner: str | None = None) -> Iterator[threading.Event]:
        """The slot for one run's whole decoding; yields the run's cancel flag (read it before every pass)."""
        if not self._free.acquire(timeout=self.wait):
            raise SlotBusy(SLOT_BUSY)
        cancel = threading.Event()
        with self._lock:
            self._runs.setdefault(owner, set()).add(cancel)
        try:
            yield cancel
        finally:
            with self._lock:
                self._runs[owner].discard(cancel)
                if not self._runs[owner]:
                    del self._runs[owner]
            self._free.release()

    def running(self) -> int:
        """Runs holding the slot now."""
        with self._lock:
            return sum(len(flags) for flags in self._runs.values())

    def cancel_owner(self, owner: str | None) -> int:
        """Cancel every run of one owner (a browser session that closed): each ends before its next pass."""
        with self._lock:
            flags = list(self._runs.get(owner, ()))
        for flag in flags:
            flag.set()
        return len(flags)


def slot_cleanup(slot: DecodeSlot) -> Callable:
    """The unload handler that cancels a closed tab's runs (a plain function: Gradio copies a method's object)."""

    def cancel_tab_runs(request: gr.Request) -> None:
        slot.cancel_owner(request.session_hash)

    return cancel_tab_runs


def one_job_per_session(blocks: gr.Blocks, limit: int, concurrency_id: str = "decode") -> Callable:
    """An event validator (runs when a call joins the queue): refuses a call from a session that already has
    ``limit`` calls on the decoding slot waiting or running. Gradio injects the request into the first
    parameter (it must be positional); the event's own inputs follow and are not read. It answers one
    value per input (Gradio checks the count): the verdict on the first, nothing on the rest."""

    def one_job(request: gr.Request, *inputs):
        queue = blocks._queue
        pending = queue.pending_event_ids_session.get(request.session_hash, set())
        events = [queue.event_ids_to_events.get(event_id) for event_id in list(pending)]
        mine = sum(1 for e in events if e is not None and e.fn.concurrency_id == concurrency_id)
        verdict = gr.validate(False, ONE_JOB) if mine >= limit else None
        return (verdict, *[None] * (len(inputs) - 1))

    return one_job


def _input_names(block_fn) -> list[str]:
    """The handler's parameter names for its inputs, in order (gr.Request and gr.Progress are not inputs)."""
    try:
        params = list(inspect.signature(block_fn.fn).parameters.values())
    except (TypeError, ValueError):
        return []
    skip = {"request", "progress"}
    return [p.name for p in params if p.name not in skip and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _endpoint(block_fn) -> str:
    return f"/{block_fn.api_name}" if getattr(block_fn, "api_name", None) else "this event"


class ClearBlocks(gr.Blocks):
    """gr.Blocks whose every failure reaches the caller as a sentence (module docstring).

    Gradio answers a call with too few inputs, an input its component cannot read, or any error that
    is not a gr.Error with ``{"error": null}``; these three overrides turn each into a gr.Error that
    names the endpoint and the input, never the value sent (it may be huge, or markup).
    """

    def validate_inputs(self, block_fn, inputs: list) -> None:
        wanted = len(block_fn.inputs)
        if len(inputs) < wanted:
            names = _input_names(block_fn)[:wanted]
            if len(names) == wanted:  # a state's place takes null: the server keeps its value
                names = [f"{n} (null)" if getattr(b, "stateful", False) else n for n, b in zip(names, block_fn.inputs)]
            listed = f" ({', '.join(names)})" if len(names) == wanted else ""
            raise gr.Error(f"{_endpoint(block_fn)} takes {wanted} values{listed}; this call sent {len(inputs)}.",
                           title="Bad call")

    async def preprocess_data(self, block_fn, inputs, state, explicit_call: bool = False):
        validator = getattr(block_fn, "is_validator_function", False)
        if not validator:
            self.validate_inputs(block_fn, inputs)  # its own message, not the one below
        try:
            return await super().preprocess_data(block_fn, inputs, state, explicit_call)
        except Exception as err:
            if validator:  # validators read no input: the call itself gets the message
                return [*inputs, *[None] * (len(block_fn.inputs) - len(inputs))][: len(block_fn.inputs)]
            raise gr.Error(_preprocess_message(block_fn, inputs), title="Bad call") from err

    async def call_function(self, block_fn, *args, **kwargs):
        try:
            return await super().call_function(block_fn, *args, **kwargs)
        except gr.Error:
            raise
        except Exception as err:
            logger.exception("%s failed", _endpoint(block_fn))
            raise gr.Error(UNEXPECTED, title="Server error") from err


def _preprocess_message(block_fn, inputs: list) -> str:
    """Which input could not be read, and what it takes."""
    names = _input_names(block_fn)
    for i, block in enumerate(block_fn.inputs):
        if getattr(block, "stateful", False) or i >= len(inputs):
            continue
        try:
            block.preprocess(inputs[i])
        except Exception:  # noqa: BLE001 - this is the input that fails
            name = names[i] if i < len(names) else f"input {i + 1}"
            kind = type(inputs[i]).__name__ if inputs[i] is not None else "nothing (null)"
            return (f"{_endpoint(block_fn)} could not read its input '{name}' (a {block.get_block_name()}): "
                    f"this call sent {kind} that it does not take. See the API page for each input's type.")
    return f"{_endpoint(block_fn)} could not read its inputs: see the API page for each input's type."
