"""Tree shapes for exact mode's candidate trees: parsing, the shapes on offer, and the choice of the next one.

A shape ``(b_1, ..., b_D)`` drafts the top ``b_1`` candidates of the first mask, under each of them the
top ``b_2`` of the second mask, and so on (docs/METHOD.md, "Candidate trees"); ``(1,) * D`` is exact mode's
chain of D drafts. ``TreeShape`` generalises ``exact.DraftDepth``: before every pass it picks the shape
(and whether the pass carries fallback masks) with the most expected committed tokens per millisecond,
from running per-depth hit rates by candidate rank and the backend's measured cost curve. A chain is a
tree with branching 1, so on a steep CPU curve it picks chains; where width is free it grows the tree.
The shape changes how many drafts are tried, never which tokens are committed.
"""

from __future__ import annotations

import math

from .exact import DraftDepth

MAX_BRANCH = 3  # candidates per depth a tree may take
MAX_NODES = 64  # drafts an explicit shape may feed
AUTO_NODES = 16  # drafts the chosen ("auto") shape may feed: it matters where width is free (no curve)
AUTO = "auto"


def nodes(shape: tuple[int, ...]) -> int:
    """Drafts a tree of ``shape`` feeds: b_1 + b_1 b_2 + ... (a chain of depth D: D)."""
    return sum(math.prod(shape[: d + 1]) for d in range(len(shape)))


def parse_tree(value) -> tuple[int, ...] | str | None:
    """A config's ``tree``: None (a chain, DraftDepth's), "auto", or a shape "2,1,1"; one message for bad input."""
    if value is None or value == AUTO:
        return value
    text = value if isinstance(value, str) else None
    try:
        shape = tuple(int(part) for part in text.split(","))
    except (AttributeError, ValueError):
        shape = ()
    if (
        not shape or len(shape) > 15 or any(b < 1 or b > MAX_BRANCH for b in shape) or nodes(shape) > MAX_NODES
        or not all(part.strip().isdigit() for part in text.split(","))
    ):
        raise ValueError(
            f"tree must be None, 'auto' or a shape of comma-separated branchings, each 1 to {MAX_BRANCH}, at most "
            f"15 deep and {MAX_NODES} drafts in all (e.g. '2,1,1'), got {value!r}"
        )
    return shape


def auto_shapes(depth: int) -> list[tuple[int, ...]]:
    """The shapes "auto" chooses from: depth 1 .. ``depth``, branching non-increasing with depth, <= AUTO_NODES."""
    found, frontier = [], [(b,) for b in range(1, MAX_BRANCH + 1)]
    while frontier:
        found += frontier
        frontier = [s + (b,) for s in frontier if len(s) < depth for b in range(1, s[-1] + 1)
                    if nodes(s + (b,)) <= AUTO_NODES]
    return found


class TreeShape:
    """The next pass's (shape, fallback): a fixed shape, or the best by expected tokens per ms (module docstring).

    ``hits[j][r]``: passes in which depth j + 1 was reached (the path held up to it) and AR's token there
    was the mask's candidate of rank r; ``tried[j]``: passes that reached depth j + 1. A shape of depth D
    feeds the pending token, its nodes, D main masks and (with fallback) D fallback masks; it commits
    1 + sum_t prod_{j <= t} P(rank < b_j at depth j) tokens. Without fallback masks the next pass drafts
    only when the main path (every rank 0) held: the rest is DraftDepth's two-state chain. While a plain
    AR pass is chosen the counts fade towards the prior, as in DraftDepth.
    """

    PRIOR = (1.0, 0.2, 0.1)  # pseudo-hits by rank per depth, of PRIOR_TRIED: one in two for the top candidate
    PRIOR_TRIED = 2.0

    def __init__(self, most: int, costs: dict[int, float] | None, fixed: tuple[int, ...] | None = None) -> None:
        self.most, self.fixed = most, fixed[:most] if fixed else None
        self.curve = DraftDepth(most, costs) if costs else None  # its cost(): the measured curve, extended
        self.priced: dict[int, float] = {}  # cost() by width: the curve does not change during a run
        self.hits = [list(self.PRIOR) for _ in range(most)]
        self.tried = [self.PRIOR_TRIED] * most
        self.options = [(s, f) for s in auto_shapes(most) for f in ((True, False) if max(s) == 1 else (True,))]

    def observe(self, candidates: list[list[int]], truth: list[int]) -> None:
        """A pass reached depths 1 .. len(truth); ``truth[j]``: AR's token at depth j + 1, ``candidates[j]`` the
        candidates drafted for it (most likely first)."""
        for j, token in enumerate(truth[: self.most]):
            self.tried[j] += 1
            ranked = candidates[j] if j < len(candidates) else []
            if token in ranked[:MAX_BRANCH]:
                self.hits[j][ranked.index(token)] += 1

    def within(self, depth: int, branch: int) -> float:
        """P(AR's token is among the top ``branch`` candidates at ``depth`` (0-based) | the depth was reached)."""
        return sum(self.hits[depth][:branch]) / self.tried[depth]

    def table(self) -> list[list[float]]:
        return [[self.within(j, b) for b in range(1, MAX_BRANCH + 1)] for j in range(self.most)]

    def cost(self, width: int) -> float:
        """The curve's ms (DraftDepth.cost) up to its widest measured pass; past it, a tree is often wider than
        anything measured (auto measures up to 2B), so the larger of the last step's and the whole curve's
        mean slope prices the rest: one flat or noisy last step must not make wide trees look free."""
        if not self.curve:
            return 1.0
        if width not in self.priced:
            self.priced[width] = self._extended(width)
        return self.priced[width]

    def _extended(self, width: int) -> float:
        costs = self.curve.costs
        widths = list(costs)
        last, first = widths[-1], widths[0]
        if width <= last or last == first:
            return self.curve.cost(width)
        mean = (costs[last] - costs[first]) / (last - first)
        return max(self.curve.cost(width), costs[last] + max(mean, 0.0) * (width - last))

    def rate(self, shape: tuple[int, ...], fallback: bool, table: list[list[float]] | None = None) -> float:
        """Expected committed tokens per ms of passes of this shape, in the long run (DraftDepth.rate).

        ``table[j][b - 1]``: within(j, b), read once per layout for all the shapes it compares.
        """
        table = table or self.table()
        reach, main, expected = 1.0, 1.0, 1.0
        for j, b in enumerate(shape):
            reach *= table[j][b - 1]
            main *= table[j][0]
            expected += reach
        depth = len(shape)
        to_bare = 0.0 if fallback else 1.0 - main
        with_drafts = self.cost(1 + nodes(shape) + depth * (2 if fallback else 1))
        return (expected + to_bare) / (with_drafts + to_bare * self.cost(1 + depth))

    def layout(self) -> tuple[tuple[int, ...], bool]:
        """(shape, fallback) for the next pass; () is a plain AR pass, where no draft pays on the curve."""
        if self.fixed or self.most < 1:
            return self.fixed or (), True
        bare, table = 1.0 / self.cost(1), self.table()
        shape, fallback = max(self.options, key=lambda option: self.rate(*option, table))
        if self.curve and bare >= self.rate(shape, fallback, table):
            (h, t), fade = (self.PRIOR, self.PRIOR_TRIED), DraftDepth.FADE
            self.hits = [[p + (n - p) * fade for p, n in zip(h, row)] for row in self.hits]
            self.tried = [t + (n - t) * fade for n in self.tried]
            return (), True
        return shape, fallback
