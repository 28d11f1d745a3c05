"""The race: MARS and the AR baseline decoding one prompt, their passes interleaved, and its trace.

Interleaving (one MARS pass, one AR pass, ...) keeps the race fair on a shared
CPU: both sides run under the same load, and each side's clock counts only its
own passes (the events' ``seconds``). A side that finishes drops out and the
other goes on alone. Nothing runs ahead: each pass is decoded when the consumer
asks for the next event, so stopping the consumer stops both decoders.
"""

from __future__ import annotations

import csv
import io
import json
import secrets
import threading
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import settings
from ..engine.checkpoints.loading import BUNDLED
from ..engine.decoding.config import VERIFYING_MODES, DecodeConfig
from ..engine.decoding.loop import LiveTau, StepEvent
from ..engine.decoding.metrics import Rates, speedup

SIDES = ("mars", "ar")
# The app's default for LaneCadence: a view per quarter second of each side's own decoding, about
# four a second (MARS_DEMO_VIEW_EVERY; docs/bench/history.md, "The UI's cost per lane").
VIEW_EVERY = settings.VIEW_EVERY.default  # 0.25
VIEW_SETTLE = settings.VIEW_SETTLE.default  # and the seconds the race waits after a view, off both clocks (0.1)
CSV_COLUMNS = ("side", "pass", "tokens", "tau", "seconds", "token_ids", "token_texts", "confidences", "origins")


def lanes(config: DecodeConfig) -> tuple[DecodeConfig, DecodeConfig]:
    """The MARS and AR lanes' configs. Sampled, each lane draws from its own seed (the config's, or a fresh
    one; AR's is the next), so the panes differ as two samples do and the trace says how to draw them again."""
    if config.temperature <= 0:
        return config, config.with_(mode="ar")
    seed = config.seed if config.seed is not None else secrets.randbelow(2**31 - 1)
    return config.with_(seed=seed), config.with_(mode="ar", seed=seed + 1)


def interleave(mars: Iterator[StepEvent], ar: Iterator[StepEvent] | None) -> Iterator[tuple[str, StepEvent]]:
    """("mars", event) and ("ar", event) in turn, one forward pass each, until both are done."""
    running = [("mars", mars)] + ([("ar", ar)] if ar is not None else [])
    while running:
        for side in list(running):
            name, events = side
            event = next(events, None)
            if event is None or event.done:
                running.remove(side)
            if event is not None:
                yield name, event


class LaneCadence:
    """When the race shows its panes: before a side's pass, once that side has decoded ``every``
    seconds (its own clock) since the last view that landed on it; ``every`` = 0: after every pass.

    The browser draws a view, and Gradio sends it, while the next forward pass runs, so each view
    slows the pass after it. Placed by the side's own clock, views land on each side in proportion
    to its decoding time, so both clocks pay the same share and the race's MARS / AR ratio is the
    one without a UI (docs/bench/history.md, "The UI's cost per lane"). After every pass instead, a view of
    the bigger MARS pane lands on each AR pass, and AR's shorter passes paid the most.
    """

    def __init__(self, every: float = 0.0) -> None:
        self.every = every
        self.owed = dict.fromkeys(SIDES, 0.0)  # each side's decoding seconds since a view last landed on it

    def after(self, side: str, seconds: float, upcoming: str | None) -> bool:
        """Record a pass of ``side``; True when the view is due now, before ``upcoming``'s pass."""
        self.owed[side] += seconds
        if upcoming is None:
            return self.every == 0  # the run's last pass: its final view follows at once
        if self.owed[upcoming] < self.every:
            return False
        self.owed[upcoming] = 0.0
        return True


def upcoming_side(trace: RaceTrace, side: str) -> str | None:
    """The side whose pass ``interleave`` runs after this pass of ``side`` (None: both are done)."""
    other = "ar" if side == "mars" else "mars"
    for candidate in (other, side):
        if (candidate == "mars" or trace.with_ar) and not trace.finish_reason(candidate):
            return candidate
    return None


@dataclass
class RaceTrace:
    """Everything one run decoded, pass by pass; the app keeps the latest one per session."""

    prompt: str
    model: str
    config: DecodeConfig
    with_ar: bool = True
    compute: str = ""  # the compute path both sides decoded on (ComputePath.summary; empty on a GPU)
    mars: list[StepEvent] = field(default_factory=list)
    ar: list[StepEvent] = field(default_factory=list)
    status: str = "running"  # "running", "done", "stopped" or "error"
    ar_seed: int | None = None  # sampled: the AR lane's seed (the MARS lane's is config.seed)
    nll: dict[str, float] = field(default_factory=dict)  # sampled: each side's NLL per token under the model
    # Set when the run's generator has ended, whichever way: Stop waits for it.
    ended: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)

    def add(self, side: str, event: StepEvent) -> None:
        getattr(self, side).append(event)

    def __getstate__(self) -> dict:
        """Picklable (ZeroGPU pickles a GPU handler's arguments); the Event belongs to one process."""
        return {k: v for k, v in self.__dict__.items() if k != "ended"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.ended = threading.Event()

    def steps(self, side: str) -> list[StepEvent] | None:
        """A snapshot of one side's events (None for an AR side that is switched off)."""
        if side == "ar" and not self.with_ar:
            return None
        return list(getattr(self, side))

    def finish_reason(self, side: str) -> str | None:
        steps = getattr(self, side)
        return steps[-1].stats.finish_reason if steps and steps[-1].done else None

    def to_json(self) -> dict:
        """The whole trace; passes are numbered from 1 (pass 1 is the prefill)."""
        sides = {}
        for side in SIDES:
            steps = self.steps(side)
            if steps is None:
                continue
            sides[side] = {
                "passes": [_step_record(s) for s in steps],
                **Rates.of_steps(steps).record(),
                "finish_reason": self.finish_reason(side),
                "text": "".join(s.text for s in steps),
            }
        gain = speedup(Rates.of_steps(self.mars), Rates.of_steps(self.ar) if self.with_ar else None)
        for side, nll in self.nll.items():
            if side in sides:
                sides[side]["nll_per_token"] = round(nll, 5)
        return {
            "prompt": self.prompt,
            "model": self.model,
            "compute_path": self.compute,
            "config": asdict(self.config),
            "ar_seed": self.ar_seed,
            "status": self.status,
            "speedup_over_ar": round(gain, 4) if gain else None,
            "sides": sides,
        }

    @property
    def sampled(self) -> bool:
        return self.config.temperature > 0

    @property
    def verifying(self) -> bool:
        """Exact or hybrid mode: passes verify drafts (a chain, or candidate trees), so they have shapes."""
        return self.config.mode in VERIFYING_MODES

    def to_csv(self) -> str:
        """One row per forward pass; list cells hold JSON (token texts keep their spaces and newlines)."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for side in SIDES:
            for rec in map(_step_record, self.steps(side) or []):
                writer.writerow([
                    side, rec["pass"], rec["tokens"], rec["tau"], rec["seconds"],
                    json.dumps(rec["token_ids"]), json.dumps(rec["token_texts"], ensure_ascii=False),
                    json.dumps(rec["confidences"]), json.dumps(rec["origins"]),
                ])
        return out.getvalue()

    def write(self, directory: str | Path, stem: str) -> tuple[Path, Path]:
        """Write ``stem``.json and ``stem``.csv under ``directory``; returns both paths."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        json_path, csv_path = directory / f"{stem}.json", directory / f"{stem}.csv"
        json_path.write_text(json.dumps(self.to_json(), ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        csv_path.write_text(self.to_csv(), encoding="utf-8")
        return json_path, csv_path


def _step_record(step: StepEvent) -> dict:
    return {
        "pass": step.index + 1,
        "tokens": len(step.token_ids),
        "token_ids": list(step.token_ids),
        "token_texts": list(step.pieces),
        "confidences": [round(c, 6) for c in step.confidences],
        "origins": list(step.origins),  # per token: ar, mask, draft (kept), resampled or bonus (decoding/exact.py)
        "tau": step.tau,
        "seconds": round(step.seconds, 6),
        # verifying passes, as generate --json: per token its tree node's rank (-1: none), the shape verified
        **({"branches": list(step.branches), "shape": list(step.shape)} if step.shape or step.branches else {}),
    }


@dataclass
class Session:
    """One browser session's own state (held in gr.State): its live tau, model choice and last run.

    The run generator and the tau slider's event handler receive this same object, so
    ``tau.set`` from the slider is read by the decoder before its next pass; another
    session has another Session and another LiveTau.
    """

    tau: LiveTau = field(default_factory=lambda: LiveTau(DecodeConfig().tau))
    spec: str = BUNDLED
    precision: str | None = None  # the compute-path setting of the model last shown (None: the default)
    trace: RaceTrace | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
