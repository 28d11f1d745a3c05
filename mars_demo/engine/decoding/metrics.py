"""What the figures mean, defined once: rates, speedup, agreement and dNLL (docs/METHOD.md, "Measuring").

Every command and the app read their figures from here, so a name means one thing:

- ``tokens_per_forward``: tokens / forward passes, pooled (total tokens over total
  passes, so token-weighted). In a batch a row's passes are the passes it was live
  for, waiting ones included: AR is 1.0 at any batch size.
- ``tokens_per_second``: tokens / the decoder's own seconds, pooled.
- ``speedup``: tokens per second over the tokens per second of an AR baseline on the
  same prompts and weights; whoever reports it names the baseline.
- ``agreement``: common prefix with the reference output (the same model's greedy AR
  output, i.e. tau = 1.0) over the longer of the two, averaged over prompts.
- ``delta_nll_<scorer>``: teacher-forced NLL per token (pooled) of the outputs minus
  that of the reference outputs, both scored by ``<scorer>``: ``base`` (the base model
  the adapter was trained from) or ``self`` (the model that decoded them).

Pure Python: no torch, nothing above the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

REFERENCE_TAU = 1.0  # one token per pass: the greedy AR output every agreement and dNLL is measured against
SCORERS = ("base", "self")


def per_forward(tokens: int, passes: int) -> float:
    """Tokens per forward pass (0.0 before any pass)."""
    return tokens / passes if passes else 0.0


def per_second(tokens: int, seconds: float) -> float:
    """Tokens per second (0.0 before any time has passed)."""
    return tokens / seconds if seconds > 0 else 0.0


@dataclass(frozen=True)
class Rates:
    """Tokens, forward passes and seconds of one run or of a pool of runs, and the rates they give."""

    tokens: int = 0
    forward_passes: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_forward(self) -> float:
        return per_forward(self.tokens, self.forward_passes)

    @property
    def tokens_per_second(self) -> float:
        return per_second(self.tokens, self.seconds)

    def __add__(self, other: Rates) -> Rates:
        return Rates(
            self.tokens + other.tokens, self.forward_passes + other.forward_passes, self.seconds + other.seconds
        )

    @staticmethod
    def pool(items: Iterable[Rates]) -> Rates:
        """Totals over several runs: their rates are then pooled (token-weighted), not averaged."""
        return sum(items, Rates())

    @staticmethod
    def of_steps(steps: Iterable) -> Rates:
        """Totals of decoding events (anything with ``token_ids`` and ``seconds``), one forward pass each."""
        steps = list(steps)
        return Rates(sum(len(s.token_ids) for s in steps), len(steps), sum(s.seconds for s in steps))

    def record(self) -> dict:
        """The totals and rates as a JSON-ready dict, rounded for reading."""
        return {
            "tokens": self.tokens,
            "forward_passes": self.forward_passes,
            "seconds": round(self.seconds, 6),
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
        }


def speedup(rates: Rates | float, baseline: Rates | float | None) -> float | None:
    """Tokens per second over the AR baseline's; None without a baseline or while either rate is 0."""
    mine = rates.tokens_per_second if isinstance(rates, Rates) else rates
    theirs = baseline.tokens_per_second if isinstance(baseline, Rates) else baseline
    if not mine or not theirs:
        return None
    return mine / theirs


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefix_agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Common prefix / length of the longer sequence.

    1.0 iff equal (also both empty), 0.0 if the first tokens differ.
    """
    longer = max(len(a), len(b))
    return common_prefix(a, b) / longer if longer else 1.0


def agreement(outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> float:
    """Mean over prompts of ``prefix_agreement`` with the reference output (1.0 for no prompts)."""
    scores = [prefix_agreement(o, r) for o, r in zip(outputs, references)]
    return sum(scores) / len(scores) if scores else 1.0


def exact_match(outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> float:
    """Share of prompts whose output equals the reference output (1.0 for no prompts)."""
    pairs = list(zip(outputs, references))
    return sum(list(o) == list(r) for o, r in pairs) / len(pairs) if pairs else 1.0


def pooled_nll(totals: Iterable[tuple[float, int]]) -> float:
    """NLL per token over several outputs from (summed NLL, tokens) pairs: total NLL / total tokens (0.0 if none)."""
    nll = tokens = 0
    for total, count in totals:
        nll, tokens = nll + total, tokens + count
    return nll / tokens if tokens else 0.0


def delta_nll_key(scorer: str) -> str:
    """The report key of a dNLL scored by ``scorer`` ("base" or "self")."""
    if scorer not in SCORERS:
        raise ValueError(f"dNLL scorer must be one of {', '.join(SCORERS)}, got {scorer!r}")
    return f"delta_nll_{scorer}"
