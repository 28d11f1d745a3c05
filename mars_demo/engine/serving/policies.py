"""Tau policies: what tau the next passes take, from the load the serving loop sees (loop.py's docstring).

A policy is a callable ``Load -> tau``; ``parse_policy`` reads the text form that ``serve-sim --policies``,
the Serving tab and the app's live batch share.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..decoding.config import check_tau
from ..decoding.width import WidthController

LEVELS = (1.0, 0.95, 0.9, 0.8, 0.7)  # the latency policy's steps
DEFAULT_LADDER = ((0, 1.0), (1, 0.95), (4, 0.9), (8, 0.8), (16, 0.7))  # (requests waiting, tau)
RECENT = 8  # recent latency: mean over this many latest finished requests
ENDINGS = ("done", "stopped", "error")


@dataclass(frozen=True)
class Load:
    """What a policy sees before a pass (times in seconds on the loop's clock)."""

    queue: int  # requests waiting
    running: int  # rows in the batch
    max_batch: int
    recent_latency: float | None  # mean latency of the last RECENT finished requests (None before any)
    oldest_wait: float  # how long the oldest waiting request has waited (0 when none waits)
    controller: WidthController | None = None  # prices wider passes at this row count (``gain``)

    def gain(self, tau: float) -> float:
        """Expected tokens per ms of the best width at ``tau`` over one-token passes, at the running rows."""
        return math.inf if self.controller is None else self.controller.gain(max(self.running, 1), tau)


class Named:
    """What every policy carries beside its call: its ``name`` and the mode it decodes in (parse_policy's "SPEC@MODE";
    None: the serving loop's)."""

    name: str
    mode: str | None = None


class Fixed(Named):
    def __init__(self, tau: float) -> None:
        self.tau = check_tau(tau)
        self.name = f"fixed:{self.tau:g}"

    def __call__(self, load: Load) -> float:
        return self.tau


class Ladder(Named):
    """tau of the highest step the waiting requests reach (``demand``: the running and waiting requests)."""

    def __init__(
        self, steps: Sequence[tuple[int, float]] = DEFAULT_LADDER, name: str | None = None, demand: bool = False,
        priced: bool = False,
    ) -> None:
        if not steps or any(int(q) != q or q < 0 for q, _ in steps):
            raise ValueError("ladder steps need queue depths that are integers of at least 0")
        self.steps = tuple(sorted((int(q), check_tau(t)) for q, t in steps))
        if self.steps[0][0] != 0:
            self.steps = ((0, 1.0), *self.steps)
        self.demand, self.priced = demand, priced
        kind = "demand:" if demand else "ladder:"
        self.name = name or kind + ",".join(f"{q}={t:g}" for q, t in self.steps)

    def __call__(self, load: Load) -> float:
        level = load.queue + load.running if self.demand else load.queue
        tau = [t for q, t in self.steps if level >= q][-1]
        if self.priced and tau < self.steps[0][1] and load.gain(tau) <= 1.0:
            return self.steps[0][1]  # wider passes do not pay at this row count: keep quality, stay narrow
        return tau


class LatencyTarget(Named):
    """Steps tau down LEVELS while latency is over ``target`` s, up once it is under target / 2 (stateful)."""

    def __init__(self, target: float, levels: Sequence[float] = LEVELS) -> None:
        if not (isinstance(target, (int, float)) and math.isfinite(target) and target > 0):
            raise ValueError(f"the latency target must be a positive number of seconds, got {target}")
        self.target, self.levels = float(target), tuple(check_tau(t) for t in levels)
        self.level = 0
        self.name = f"latency:{self.target:g}"

    def __call__(self, load: Load) -> float:
        signal = max(load.recent_latency or 0.0, load.oldest_wait)
        if signal > self.target:
            self.level = min(self.level + 1, len(self.levels) - 1)
        elif signal < self.target / 2:
            self.level = max(self.level - 1, 0)
        return self.levels[self.level]


Policy = Callable[[Load], float]
POLICY_HELP = (
    "fixed:T (0 <= T <= 1), ladder[:Q=T,...], demand:N=T,..., latency:SECONDS, adaptive (= the default ladder); "
    "any of them @MODE (mars, hybrid, exact) to decode in that mode instead of the run's (fixed:1.0@exact)"
)
MODES = ("mars", "hybrid", "exact")


def split_policies(text: str) -> list[str]:
    """Comma-separated policy specs; a ladder's own "Q=T" steps stay with it ("fixed:1,ladder:0=1,4=0.9")."""
    specs: list[str] = []
    for part in (p.strip() for p in (text or "").split(",")):
        if specs and specs[-1].startswith(("ladder:", "demand:")) and re.fullmatch(r"\d+\s*=.*", part):
            specs[-1] += "," + part
        elif part:
            specs.append(part)
    return specs


def parse_policy(text: str) -> Policy:
    """One policy from its spec (POLICY_HELP); a ValueError with one line for anything else.

    "SPEC@MODE" decodes the policy's requests in MODE rather than the serving loop's mode (its ``mode``
    attribute, None without one; its name keeps the suffix): modes side by side in one run take turns
    pass by pass (simulation.interleaved), as policies do, so the machine's drift slows them alike.
    """
    spec, at, mode = text.strip().partition("@")
    if at and mode.strip() not in MODES:
        raise ValueError(f"bad policy {text!r}: the mode after @ must be one of {', '.join(MODES)}")
    policy = _parse_spec(spec)
    if at:
        policy.name, policy.mode = f"{policy.name}@{mode.strip()}", mode.strip()
    return policy


def mode_of(policy: Policy, default: str) -> str:
    """The mode ``policy`` decodes in: its own ("SPEC@MODE"), else ``default``."""
    return getattr(policy, "mode", None) or default


def _parse_spec(text: str) -> Policy:
    """A policy without a mode (parse_policy)."""
    name, _, arg = text.strip().partition(":")
    try:
        if name == "fixed" and arg:
            return Fixed(float(arg))
        if name == "adaptive" and not arg:
            return Ladder(DEFAULT_LADDER, name="adaptive", priced=True)
        if name == "ladder":
            steps = [part.split("=") for part in arg.split(",")] if arg else DEFAULT_LADDER
            return Ladder([(int(q), float(t)) for q, t in steps])
        if name == "demand" and arg:
            steps = [(int(q), float(t)) for q, t in (part.split("=") for part in arg.split(","))]
            return Ladder(steps, demand=True, priced=True)
        if name == "latency" and arg:
            return LatencyTarget(float(arg))
    except ValueError as err:
        raise ValueError(f"bad policy {text!r}: {err}") from None
    raise ValueError(f"unknown policy {text!r}; expected {POLICY_HELP}")
