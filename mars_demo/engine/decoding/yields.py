"""Tokens passes committed against what a model expected of them: a correction for choosers that plan on a model.

exact.DraftDepth chooses each verifying pass's layout from a model of what it will commit (a two-state chain of
verifying and drafting passes). The model misses what it does not describe (rows that copy their next drafts from
their own text, drafts from the fallback group that hold less often than copies), and a chooser that takes the
best of several estimates takes the one that is most over-estimated. So each choice's expected tokens are kept
beside the tokens its pass committed, per kind of choice, and the ratio scales that kind's expectation next time.
"""

from __future__ import annotations

from collections.abc import Hashable


class Yields:
    """Running sums (realized, expected) per key, fading by ``decay`` at each pass of that key, started from
    ``prior`` of each (a ratio of 1 until passes are seen). Shared by the batches of one controller."""

    def __init__(self, prior: float, decay: float) -> None:
        self.prior, self.decay = prior, decay
        self.sums: dict[Hashable, tuple[float, float]] = {}

    def ratio(self, key: Hashable) -> float:
        """What passes of ``key`` realized over what was expected of them."""
        realized, expected = self.sums.get(key, (0.0, 0.0))
        return (realized + self.prior) / (expected + self.prior)

    def add(self, key: Hashable, realized: float, expected: float) -> None:
        """A pass of ``key`` committed ``realized`` where ``expected`` was expected."""
        old_realized, old_expected = self.sums.get(key, (0.0, 0.0))
        self.sums[key] = (old_realized * self.decay + realized, old_expected * self.decay + expected)
