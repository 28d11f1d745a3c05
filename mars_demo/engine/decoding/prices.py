"""What passes cost against the cost surface's price, as a batch runs them (width.py's ``WidthController`` prices
every pass it weighs by these ratios)."""

from __future__ import annotations

from itertools import pairwise


class Prices:
    """What passes on a measured surface cost against its price: the running ratio of measured to priced ms, kept
    per row count and apart for one-token and wider passes (``WidthController``'s docstring), and within the wider
    ones per number of columns fed (``factor``).

    A surface measured once is off by different amounts at different row counts and widths as the machine's
    phase moves (on a 2-core VM, one morning: one-token passes at 1.12-1.35x its price, wide ones at 0.9-1.0x,
    by rows), so one ratio a kind, fed by every row count a batch passes through, priced 4-row passes by what
    1-row ones had cost. Nor is it off by one ratio across widths: a surface measured while memory was slow
    prices 3 columns at 4 rows (12 tokens a pass, past where the int8 GEMM stops being bound by the weights'
    bytes) little above 2, and a faster phase makes the 3-column pass 1.3x its price and the 2-column one 1.1x.
    One wide ratio learned from 3-column passes priced every 2-column layout out of reach.

    A wide pass also slows the passes after it: on a 2-core Xeon the one-token passes of an 8-row batch ran 1.1-1.5 ms
    (20-26%) over their price right after one, less each pass, level by the sixth, ~4 ms in all, about a plain pass
    more (``scripts/batch_turns.py --after-wide``). So the one-token passes within AFTER of a wide one that came after
    AFTER one-token passes or more leave the one-token ratio as it was, and what they cost over it is charged to
    that wide pass's ratio. (After a run of wide passes the one-token ratio is as old as the run, and a one-token
    pass then sets it: a look.)
    """

    DECAY = 0.9  # a ratio follows the last tens of passes
    STALE = 32  # passes of one kind in a row after which the other kind's ratio is due a look (``due``)
    AFTER = 6  # one-token passes after a wide one whose cost over the one-token price is the wide pass's

    def __init__(self) -> None:
        self.ratios: dict[int, dict[bool, float]] = {}  # rows -> {wide?: ratio}
        self.columns: dict[int, dict[tuple[bool, int], float]] = {}  # rows -> {(block?, columns of a wide pass): ratio}
        self.runs: dict[int, tuple[bool, int]] = {}  # rows -> (the last pass's kind, passes of it in a row)
        self.points: dict[tuple[int, bool], list[tuple[float, float]]] = {}  # factor's, until the next pass seen
        # rows -> the last wide pass's (block?, columns), its weight, its price over a one-token pass's, passes since
        self.after: dict[int, tuple[tuple[bool, int], float, float, int]] = {}

    def of(self, rows: int) -> dict[bool, float]:
        """{wide?: ratio} at ``rows`` rows: 1.0 (the surface as measured) until passes there are seen. (Started from
        the nearest row count's instead, a count would take over a ratio that had gone stale there, such as a
        2-row batch's one-token ratio, drifted while its wide passes ran.)"""
        return self.ratios.setdefault(rows, {False: 1.0, True: 1.0})

    def factor(self, rows: int, columns: float, block: bool = False) -> float:
        """What the surface's price of a pass feeding ``columns`` columns a row over ``rows`` rows is multiplied by;
        ``block``: a pass under a 4-D mask (a verifying pass's fallback group), whose mask a causal pass does not
        build or read, priced apart.

        One column: the one-token ratio. Wider: the ratio of the column counts seen (of passes of the same kind of
        mask), straight between them and from the one-token ratio at one column up to the narrowest seen; past the
        widest seen, the widest's. With none seen, a block pass is priced as a causal one, and a causal one at the
        wide kind's ratio.
        """
        kinds = self.of(rows)
        if columns <= 1:
            return kinds[False]
        points = self.points.get((rows, block))
        if points is None:  # (a verifying batch prices ~20 widths a pass: sorted once)
            seen = sorted((c, r) for (b, c), r in self.columns.get(rows, {}).items() if b == block)
            points = self.points[rows, block] = [(1, kinds[False]), *seen] if seen else []
        if not points:
            return self.factor(rows, columns) if block else kinds[True]
        for (c0, r0), (c1, r1) in pairwise(points):
            if columns <= c1:
                return r0 + (r1 - r0) * (columns - c0) / (c1 - c0)
        return points[-1][1]

    def seen(self, rows: int, wide: bool, ratio: float, columns: int = 0, block: bool = False, dearer: float = 1.0
             ) -> None:
        """A pass of this kind over ``rows`` rows (fed ``columns`` columns, where wide; ``block``: under a 4-D
        mask; ``dearer``: its price over a one-token pass's) took ``ratio`` times its price.

        The first pass of a kind after STALE of the other (a look: ``due``) counts for half, not a tenth: the old
        ratio is as old as that run. After STALE passes in a row, the other kind's ratios also drift toward this
        one's (the surface's own relative prices), so that one a burst of other load raised comes near enough
        to be looked at again.
        """
        ratios, decay, ratio = self.of(rows), self.DECAY, min(max(ratio, 0.25), 4.0)
        self.points.pop((rows, False), None)
        self.points.pop((rows, True), None)
        kind, run = self.runs.get(rows, (wide, 0))
        weight = 0.5 if kind != wide and run >= self.STALE else 1 - decay
        widths = self.columns.setdefault(rows, {})
        if not wide and (after := self.after.pop(rows, None)):  # the last wide pass's, charged to it (class docstring)
            key, charged, dearer_then, since = after
            extra = charged * (ratio - ratios[False]) / dearer_then
            widths[key] = max(widths.get(key, ratios[True]) + extra, 0.25)
            ratios[True] = max(ratios[True] + extra, 0.25)
            ratio = ratios[False]
            if since + 1 < self.AFTER:
                self.after[rows] = (key, charged, dearer_then, since + 1)
        ratios[wide] = (1 - weight) * ratios[wide] + weight * ratio
        if wide and columns > 1:
            key = (block, columns)
            widths[key] = (1 - weight) * widths.get(key, ratios[wide]) + weight * ratio
            self.after.pop(rows, None)
            if self.AFTER and not kind and run >= self.AFTER:  # the one-token ratio is current: what to charge against
                self.after[rows] = (key, weight, dearer, 0)
        run = run + 1 if kind == wide else 1
        self.runs[rows] = (wide, run)
        if run > self.STALE:
            ratios[not wide] = decay * ratios[not wide] + (1 - decay) * ratios[wide]
            if not wide:
                for c, r in widths.items():
                    widths[c] = decay * r + (1 - decay) * ratios[wide]

    def due(self, rows: int) -> bool | None:
        """The kind (wide?) whose ratio at ``rows`` has gone unmeasured for STALE passes, else None."""
        kind, run = self.runs.get(rows, (False, 0))
        return (not kind) if run >= self.STALE else None
