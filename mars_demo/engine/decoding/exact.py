"""Exact mode: the masks draft, the next pass verifies (docs/METHOD.md, "Exact and hybrid modes").

A verifying pass feeds [pending | drafts | L masks | L fallback masks], L = B - 1.
The AR outputs at the newest pending token and at each draft check the drafts;
the longest matching prefix is kept (its keys and values are already right) plus
the AR head's own next token. The masks after the drafts guess what follows when
every draft holds; the fallback masks sit right after the newest pending token
and see only the verified prefix (a 4-D attention mask), so a rejection still
leaves guesses for the next pass to verify. With tau < 1 (hybrid), the guesses of
the group that starts at the newest verified token are accepted on confidence as
in MARS, and the rest become drafts. Every committed token is the AR argmax given
the tokens before it, so at tau = 1.0 the output is greedy AR's. At a temperature the
same pass is read by the speculative-sampling rule instead (speculative.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from .acceptance import greedy_confidence
from .drift import moments
from .yields import Yields

# Where a committed token came from: the AR head of the pass, a verified draft, a mask accepted on confidence.
AR, DRAFT, MASK = "ar", "draft", "mask"
# At a temperature (speculative.py): drawn from max(0, p - q) after a rejected draft, or from p after every draft held.
RESAMPLED, BONUS = "resampled", "bonus"


@dataclass(frozen=True)
class Fed:
    """What one verifying pass feeds: ids (1, n), and where it needs them, position ids and a 4-D mask."""

    ids: torch.Tensor
    position_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    keep: int  # logits of the last ``keep`` columns: the newest pending token, the drafts and both mask groups

    @property
    def width(self) -> int:
        return self.ids.shape[1]


def verify_window(
    pending: list[int], drafts: list[int], lookahead: int, mask_id: int, cached: int, dtype: torch.dtype, device,
    fallback: bool = True,
) -> Fed:
    """[pending | drafts | L masks | L fallback masks]; no fallback group (and no custom mask) without drafts.

    The fallback masks take the positions right after the newest pending token and
    attend to the cache, the pending tokens and each other only. ``fallback=False``
    is the simpler scheme that leaves the pass after a rejection without drafts.
    """
    k, d, L = len(pending), len(drafts), lookahead
    g = L if d and fallback else 0
    ids = torch.tensor([pending + drafts + [mask_id] * (L + g)], dtype=torch.long, device=device)
    keep = 1 + d + L + g
    if not g:
        return Fed(ids, None, None, keep)
    main = k + d + L
    n = main + g
    positions = torch.cat([torch.arange(main), torch.arange(k, k + g)]).to(device) + cached  # (n,)
    allowed = torch.ones(n, cached + n, dtype=torch.bool, device=device)
    allowed[:, cached:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    allowed[main:, cached + k : cached + main] = False  # fallback masks do not see the drafts or the main masks
    mask = torch.zeros(n, cached + n, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return Fed(ids, positions[None], mask[None, None], keep)


@dataclass(frozen=True)
class Verdict:
    """The outcome of a verifying pass, host side.

    tokens, confidences, origins: committed tokens (verified drafts, the AR token,
      masks accepted on confidence), in order. cached: how many of them (the verified
      drafts) already have their keys and values in the cache. drafts: the next
      pass's drafts. proposal: at a temperature, the distribution (d, vocab) each of
      them was drawn from, for the rule (speculative.py); None at temperature 0.
    """

    tokens: list[int]
    confidences: list[float]
    origins: list[str]
    cached: int
    drafts: list[int]
    proposal: torch.Tensor | None = None
    branches: list[int] = field(default_factory=list)  # candidate trees (tree.py) only: per token its node's rank


def verify(logits: torch.Tensor, drafts: list[int], lookahead: int, tau: float, metric: str) -> Verdict:
    """Greedy verification of ``drafts`` and the next drafts, from the logits (keep, vocab) of verify_window.

    Rows: 0 the newest pending token, 1..d the drafts, then L main masks, then the
    fallback masks (L or none). One host sync.
    """
    tokens, conf = greedy_confidence(logits, metric)  # (keep,), (keep,)
    return read_verdict(tokens.tolist(), conf.tolist(), drafts, lookahead, tau, metric)


def read_verdict(
    tok: list[int], cf: list[float], drafts: list[int], lookahead: int, tau: float, metric: str
) -> Verdict:
    """``verify`` on the host: each row's greedy token and its (fp32) confidence, read in one sync for a whole batch."""
    d, L = len(drafts), lookahead
    a = 0  # drafts held: the leading drafts equal to the AR token before them
    while a < d and tok[a] == drafts[a]:
        a += 1
    out_tokens, out_conf = drafts[:a], cf[:a]  # a draft's confidence: the AR probability that verified it
    origins = [DRAFT] * a
    if a == d:  # every draft held: the main group starts at the newest verified token
        group_tok, group_cf = tok[d : d + 1 + L], cf[d : d + 1 + L]
    elif a == 0:  # the first draft failed: the fallback group starts at the newest pending token
        group_tok, group_cf = tok[:1] + tok[d + 1 + L :], cf[:1] + cf[d + 1 + L :]
    else:  # a later draft failed: the AR token corrects it; the fallback guesses past it are the next drafts
        return Verdict(out_tokens + [tok[a]], out_conf + [cf[a]], origins + [AR], a, tok[d + 1 + L + a :])
    n = accepted(group_cf, tau, metric)
    return Verdict(
        out_tokens + group_tok[:n], out_conf + group_cf[:n], origins + [AR] + [MASK] * (n - 1), a, group_tok[n:]
    )


def accepted(confidences: list[float], tau: float, metric: str = "probability") -> int:
    """acceptance.accept_count of one row of fp32 confidences read to the host: tau compared in fp32, as torch's
    comparison of an fp32 tensor with a Python float does."""
    if tau >= 1.0 or not confidences:
        return min(1, len(confidences))
    tau = float(np.float32(tau))
    n = 1  # candidate 1 is the AR token: always accepted
    while n < len(confidences) and (confidences[n] <= tau if metric == "entropy" else confidences[n] >= tau):
        n += 1
    return n


class Layout(NamedTuple):
    """What a verifying pass feeds (DraftDepth): ``depth`` drafts (0: a plain AR pass), the fallback group or not,
    and whether a pass with drafts also feeds the masks that guess the next ones (``masks``). Without them a row's
    pass is [pending | drafts] or, when it has none, [pending | depth masks]: every pass is 1 + depth wide, and
    a row verifies and drafts in turns (a copy from its text can still give it drafts two passes running)."""

    depth: int
    fallback: bool
    masks: bool = True


# (fallback, masks) of the layouts DraftDepth weighs: with the fallback group, a chain without it, and passes that
# verify and draft in turns (``Layout``)
WITH_FALLBACK, CHAIN, IN_TURNS = (True, True), (False, True), (False, False)


class DraftDepth:
    """How many drafts an exact pass verifies (D <= B - 1), and what else it feeds (``Layout``).

    Chosen before every pass by expected tokens per millisecond, from the measured
    cost curve (ms per pass by tokens fed, paths.ComputePath) and the running share
    of drafts held at each depth. A layout with masks feeds 1 + 2D (+ D with the fallback group) tokens
    when there are drafts and 1 + D when there are none (the pass after a rejection without
    fallback masks). Its long-run rate is that of a two-state chain: with drafts, a
    pass commits 1 + sum_i P(first i held) tokens and, without fallback masks, leaves
    the next pass draft-less unless every draft held; without drafts, a pass commits
    one token and drafts D. In a batch (``rows`` > 1) a row without drafts rides in a pass that the
    rows with drafts make 1 + 2D wide, so its pass is priced at that width, not at 1 + D. A layout in turns
    (no masks beside the drafts) alternates the two states, each pass 1 + D wide: where a few more tokens a
    pass cost much more than a few (a CPU's int8 GEMM past 8 rows of a pass), its narrow passes can pay where the
    chain's do not. Without a
    curve (a GPU, an unmeasured model) passes are taken to cost the same at any width: the widest
    layout with fallback masks.
    A plain AR pass (D = 0) tries no draft, so it would learn nothing that could end a run of them:
    while they are chosen the counts fade towards where they started (FADE a pass: the prior, or in a
    batch the share earlier batches showed), and drafting is tried again after a few passes or, on much
    evidence against it, many (a sampled run's first rejections would otherwise leave it on AR passes
    for good). The layout changes the width of passes, never which
    tokens are committed.
    The chain model misses what a kind's passes do beyond it: a row whose pass verified without masks often
    copies its next drafts from its own text and verifies again, and the fallback group's drafts hold less
    often than copies. So each kind's rate is scaled by the tokens its passes realized against the model's
    expectation (``yields``: running sums per kind, shared across a controller's batches), learned only
    while that kind is taken.
    """

    PRIOR = (1, 2)  # pseudo-counts (held, tried) per depth: a first guess of one in two
    FADE = 0.9  # what an AR pass leaves of the counts past the prior
    YIELD_PRIOR = 8.0  # pseudo-passes of a kind's yield at the model's word (tokens a row)
    YIELD_DECAY = 0.98  # a kind's yield follows its last ~50 passes

    def __init__(
        self, most: int, costs: dict[int, float] | None, start: tuple[list[float], list[float]] | None = None,
        yields: Yields | None = None,
    ) -> None:
        """``start``: pseudo-counts (held, tried) per depth to begin from and fade back to; None: the prior.
        ``yields``: (realized, expected) tokens of passes per kind to share (class docstring); None: this run's."""
        self.most = most
        self.costs = dict(sorted(costs.items())) if costs else None
        self.start = start or ([float(self.PRIOR[0])] * most, [float(self.PRIOR[1])] * most)
        self.held, self.tried = list(self.start[0]), list(self.start[1])
        self.rows = 1  # rows decoding together (the class docstring): a batch sets it before each layout
        # ms of passes under a 4-D mask (those that feed the fallback group) where they differ from causal ones'
        # (a batch on a CPU: the mask is built and read; token.py); None: the same
        self.block_costs: dict[int, float] | None = None
        self.weighed: tuple[Layout, float, float] = (Layout(most, True), 1.0, 1.0)  # see layout
        self.yields = yields or Yields(self.YIELD_PRIOR, self.YIELD_DECAY)
        self.expected: tuple[Layout, float] | None = None  # the weighed drafting layout's tokens a pass, on the model

    def observe(self, drafted: int, held: int) -> None:
        """A pass verified ``drafted`` drafts and kept the first ``held``: depth j was tried if j - 1 held."""
        for j in range(min(held + 1, drafted)):
            self.tried[j] += 1
            self.held[j] += j < held

    def cost(self, width: int, block: bool = False) -> float:
        """Measured ms of a pass feeding ``width`` tokens (under a 4-D mask: ``block``); linear past the widest
        measured pass."""
        costs = self.block_costs if block and self.block_costs else self.costs
        if width in costs:
            return costs[width]
        widths = list(costs)
        last, before = widths[-1], widths[-2] if len(widths) > 1 else widths[-1]
        slope = max(0.0, (costs[last] - costs[before]) / max(last - before, 1))
        return costs[last] + slope * (width - last)

    def per_pass(self, depth: int, fallback: bool, masks: bool = True) -> tuple[float, float]:
        """The chain model's (tokens, ms) of the layout's average pass, in the long run."""
        reach, expected = 1.0, 1.0
        for j in range(depth):
            reach *= self.held[j] / self.tried[j]
            expected += reach
        if not masks:  # in turns: a verifying pass, then a drafting one, both 1 + depth wide
            return (expected + 1.0) / 2, self.cost(1 + depth)
        to_bare = 0.0 if fallback else 1.0 - reach  # chance a pass with drafts leaves the next without
        with_drafts = self.cost(1 + (3 if fallback else 2) * depth, block=fallback)
        bare = self.cost(1 + depth) if self.rows == 1 else with_drafts  # in a batch: the drafting rows' width
        return (expected + to_bare) / (1 + to_bare), (with_drafts + to_bare * bare) / (1 + to_bare)

    def pass_moments(self, layout: Layout) -> tuple[float, float]:
        """(tokens, variance) a row commits a pass in the long run of ``layout`` on the chain model: a verifying pass
        commits 1 + the drafts held, and its variance is spread over the passes that verify (a drafting pass, in turns
        or after a failed draft without the fallback group, commits one token and adds none)."""
        reach = [1.0]
        for j in range(layout.depth):
            reach.append(reach[-1] * self.held[j] / self.tried[j])
        verifying, variance = moments(reach)
        tokens = self.per_pass(*layout)[0]
        return tokens, variance * (tokens - 1) / (verifying - 1) if verifying > 1 else 0.0

    def rate(self, depth: int, fallback: bool, masks: bool = True) -> float:
        """Expected committed tokens per ms of the layout, in the long run, scaled by its kind's yield."""
        tokens, ms = self.per_pass(depth, fallback, masks)
        return tokens * self.correction((fallback, masks)) / ms if depth else tokens / ms

    def correction(self, kind: tuple[bool, bool]) -> float:
        """Tokens a kind's passes realized over what the model expected of them (1 until its passes are seen)."""
        return self.yields.ratio(kind)

    def observe_yield(self, layout: Layout, tokens: float) -> None:
        """A pass of ``layout`` committed ``tokens`` a row: its kind's yield, where ``layout`` is the drafting one
        last weighed (what the model expected of it then; a pass of any other layout shows nothing)."""
        if self.expected is None or self.expected[0] != layout:
            return
        self.yields.add((layout.fallback, layout.masks), tokens, self.expected[1])

    def drafting(self, kinds: tuple[tuple[bool, bool], ...] = (WITH_FALLBACK, CHAIN)) -> tuple[Layout, float]:
        """The drafting layout (D >= 1) of the best rate on the curve among ``kinds`` ((fallback, masks) pairs),
        and that rate."""
        rates = {Layout(d, *kind): self.rate(d, *kind) for d in range(1, self.most + 1) for kind in kinds}
        best = max(rates, key=rates.get)
        return best, rates[best]

    def layout(self, kinds: tuple[tuple[bool, bool], ...] = (WITH_FALLBACK, CHAIN)) -> Layout:
        """The next pass's layout among ``kinds``; depth 0 (a plain AR pass) where no draft pays on the curve.

        ``weighed`` keeps what it chose on: the best drafting layout, its rate and a plain AR pass's (a batch
        weighs them again, token.py)."""
        if not self.costs or self.most < 1:
            return Layout(self.most, True)
        (best, rate), plain = self.drafting(kinds), self.rate(0, True)
        self.weighed, self.expected = (best, rate, plain), (best, self.per_pass(*best)[0])
        if rate > plain:
            return best
        fade = self.FADE
        self.held = [h + (n - h) * fade for n, h in zip(self.held, self.start[0])]
        self.tried = [t + (n - t) * fade for n, t in zip(self.tried, self.start[1])]
        return Layout(0, True)


def lookup(history: list[int], most: int, ngram: int) -> list[int]:
    """Drafts copied from the text so far: what followed the latest earlier match of its last ``ngram`` tokens.

    Prompt lookup's drafting (Saxena 2023), which costs no forward pass: answers often
    repeat names, code and phrases of the prompt. Up to ``most`` tokens; [] without a match.
    """
    if most < 1 or len(history) <= ngram:
        return []
    tail, end = history[-ngram:], len(history) - ngram  # a match starts before the tail itself
    found, start = -1, 0
    while True:  # list.index scans in C: the candidates are the earlier places of the tail's first token
        try:
            start = history.index(tail[0], start, end)
        except ValueError:
            break
        if history[start : start + ngram] == tail:
            found = start
        start += 1
    return history[found + ngram : found + ngram + most] if found >= 0 else []


def pick_drafts(history: list[int], drafts: list[int], depth: int) -> list[int]:
    """An exact pass's drafts: a copy after a 3-token match beats the masks' guesses; a 2-token one fills none."""
    copied = lookup(history, depth, ngram=3)
    if copied:
        return copied
    return drafts[:depth] or lookup(history, depth, ngram=2)


def decode_rate(costs: dict[int, float], block_size: int) -> float:
    """Tokens per ms of one sequence on a cost curve: AR's, or exact decoding's if that is more.

    Exact decoding's rate is its layout model's (DraftDepth) at its prior acceptance, one draft in
    two held: a flat curve turns the masks' guesses into speed, a steep one leaves AR's one-token pass.
    """
    depth = DraftDepth(max(block_size - 1, 1), costs)
    return max(1 / costs[1], depth.rate(*depth.layout()))
