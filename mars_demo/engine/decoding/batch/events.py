"""What a batch decoder yields: one BatchEvent per batched forward pass, the run's totals on the last.

Each event carries, per row, the tokens that pass accepted for it and their
confidences (a row waiting at a block boundary, or already finished, gets an empty
step), the tau in force and the pass's seconds, like loop.StepEvent does for
one sequence. Per-row totals are loop.RunStats, so one row of a batch reads
exactly like a single-sequence run; the batch's rates follow decoding/metrics.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..loop import RunStats
from ..metrics import Rates


@dataclass(frozen=True)
class RowStep:
    """What one pass did for one row."""

    token_ids: tuple[int, ...] = ()
    confidences: tuple[float, ...] = ()
    finish: str | None = None  # "eos" or "length" on the pass that ended the row
    origins: tuple[str, ...] = ()  # per token, as loop.StepEvent.origins
    width: int = 0  # candidates the row was offered (1: an AR pass; 0: it was not in the pass)


@dataclass(frozen=True)
class BatchStats:
    """Totals of a batch run.

    rows: per row, its tokens, the passes it was live for (waiting passes count: they
      cost it time), the seconds until it finished, and why it finished.
    forward_passes, seconds: batched forward passes and wall-clock seconds of the run.
    """

    rows: tuple[RunStats, ...]
    forward_passes: int
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(row.tokens for row in self.rows)

    @property
    def rates(self) -> Rates:
        """The rows pooled (tokens over the passes each row was live for), on the run's wall-clock seconds."""
        return Rates(self.tokens, sum(row.forward_passes for row in self.rows), self.seconds)

    @property
    def tokens_per_forward(self) -> float:
        """Tokens a row gains per pass while it is live, token-weighted over rows (1.0 for AR at any batch size)."""
        return self.rates.tokens_per_forward

    @property
    def tokens_per_second(self) -> float:
        return self.rates.tokens_per_second


@dataclass(frozen=True)
class BatchEvent:
    """One batched forward pass.

    kind: "prefill", "block-start" (extends the cache with the filled block and
      opens the next), "refill" (re-feeds the block being filled), "extend" (tau = 1.0:
      adds each row's newest token of the block to the cache) or "window"
      (token-level: accepted tokens + masks).
    fed: columns fed per row in this pass (the cost of the pass grows with it).
    """

    index: int
    rows: tuple[RowStep, ...]
    tau: float
    seconds: float
    kind: str
    fed: int
    stats: BatchStats | None = None  # totals, on the final event only

    @property
    def tokens(self) -> int:
        return sum(len(row.token_ids) for row in self.rows)

    @property
    def done(self) -> bool:
        return self.stats is not None


@dataclass
class BatchGeneration:
    """A finished batch run, collected from its events."""

    events: list[BatchEvent] = field(default_factory=list)

    @property
    def token_ids(self) -> list[list[int]]:
        rows = len(self.events[0].rows) if self.events else 0
        return [[t for e in self.events for t in e.rows[r].token_ids] for r in range(rows)]

    @property
    def stats(self) -> BatchStats:
        return self.events[-1].stats


def collect_batch(events: Iterable[BatchEvent]) -> BatchGeneration:
    return BatchGeneration(list(events))
