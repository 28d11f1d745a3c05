"""How wide a pass should be: the width controller, on the measured cost surface (surface.py).

A forward pass over R rows that feeds w tokens to each row costs ``Surface.ms(R, w)``. On a
GPU that surface is nearly flat in w until large batches, which is the paper's regime: masks
are free and every row should get all of them. On a small CPU a pass is bound by compute as
soon as a few rows are fed, and a mask that returns 0.2 tokens can cost more than the pass it
rides on. So the width is chosen, per pass, from what the surface says it costs and what the
rows' running acceptance says it returns:

    W = argmax_w  sum_r E_r(min(w, cap_r)) / ms(R, n_w - 1 + w)

E_r(w) is the tokens row r is expected to commit from a pass of width w (one, plus each mask
reached by an unbroken run of accepted ones: ``Hits``). W = 1 is plain (batched) AR, and it
is chosen whenever no mask pays. n_w is what a pass feeds before its masks: the tokens accepted
the pass before by the row that accepted most (the pass is a rectangle), which in the steady
state of width w is E[max_r accepted_r] = sum_k (1 - prod_r (1 - P_r(at least k))): every token
committed is fed once more, so a wide pass also widens the next one, and the more rows, the
likelier one of them widens it. A prefill's masks are a one-off, not a steady state: each is fed
where the tokens it is expected to commit are worth more, at the ms a token will cost once
decoding, than the ms it adds beside the longest prompt (``prefill``). In a batch a wider pass
must promise GAIN over width 1 (the surface is a
model); the controller corrects the surface's prices by the passes it sees (``passed``).
The width changes how many candidates a pass can accept, never which token a candidate is,
so exact mode stays greedy AR's text at any width.

A pass is a rectangle: every row is fed W columns, a row fed fewer gets holes (columns no one
attends to). A row's own width is therefore W, or less where its token limit leaves less room
(batch/token.py). The pass is priced by its rectangle, n_w - 1 + W columns a row, though the CPU
engine's native layers leave holes out of all but the attention (native_layers.py): pricing a pass
by the tokens its rows feed, with each row its own width, measured slower than the rectangle's
price on this project's CPUs (docs/bench/history.md, "Packed passes").
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

from .drift import kept
from .exact import DraftDepth
from .prices import Prices
from .surface import Surface
from .yields import Yields

GAIN = 1.05  # a wider pass is taken only where it promises this much over one-token passes: the
# surface is a model of what a pass costs, and a pass it prices within a few percent may not pay
NEAR = 0.9  # a pass of the kind whose price is due a look (Prices.due) is taken where it promises this much of
# the choice's rate: a look costs about a tenth of a pass every STALE passes
FIRST = 0.2  # and, where its first pass only drafts (a verifying look after AR passes, which leave no drafts), it
# is due after STALE one-token passes where that pass costs at most this much more than one of them, and as many
# times later as it costs more (at 8 rows on a 2-core CPU it costs 0.25-0.45 more, and looks every STALE passes
# cost exact-mode batches 1-2%)


class Hits:
    """Running share of candidates accepted at each depth (depth 1: the first mask or draft after the AR token).

    Depth j counts as tried when every depth before it held. ``decay`` (< 1) forgets old passes, so a
    row whose text turns from prose to code, or a tau that changes, moves the estimate within tens of
    passes. A pass that offered nothing (width 1) shows nothing, so it relaxes the estimate toward
    where it started instead (``start``: the prior, or the share the batch's rows had shown when the
    row began): a row narrowed to AR passes by a hard stretch is offered a mask again some tens of
    passes later, and keeps it if its text has turned easy; a row that began where masks do not pay
    is not pulled toward a share they would. PRIOR: pseudo-counts (held, tried), a first guess of one
    in two.
    """

    PRIOR = (1.0, 2.0)

    def __init__(self, depth: int, decay: float = 1.0, start: tuple[list[float], list[float]] | None = None) -> None:
        self.decay = decay
        self.start = start or ([self.PRIOR[0]] * depth, [self.PRIOR[1]] * depth)
        self.held, self.tried = list(self.start[0]), list(self.start[1])
        self.idle = 0  # passes that offered nothing, not yet applied (a pass of plain AR costs no host work here)

    def observe(self, offered: int, extra: int) -> None:
        """A pass offered ``offered`` candidates past the AR token and the first ``extra`` of them held."""
        if offered < 1:
            self.idle += 1
            return
        self._relax()
        if self.decay < 1:
            self.held = [h * self.decay for h in self.held]
            self.tried = [t * self.decay for t in self.tried]
        for j in range(min(extra + 1, offered, len(self.tried))):
            self.tried[j] += 1
            self.held[j] += j < extra

    def _relax(self) -> None:
        """The idle passes' pull toward the start, all at once: d^k of the way left after k of them."""
        if self.idle:
            left, (held, tried) = self.decay**self.idle, self.start
            self.held = [h0 + left * (h - h0) for h, h0 in zip(self.held, held)]
            self.tried = [t0 + left * (t - t0) for t, t0 in zip(self.tried, tried)]
            self.idle = 0

    def share(self, j: int) -> float:
        if self.idle:
            self._relax()
        return self.held[j] / self.tried[j]

    def reach(self, most: int) -> list[float]:
        """P(a pass commits at least k tokens), k = 1 .. most, when it offers every candidate it can: a pass of
        width w is expected to commit the sum of the first w."""
        out = [1.0]
        for j in range(min(most - 1, len(self.held))):
            out.append(out[-1] * self.share(j))
        return out


_POOLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # surface -> {most: {tau: pooled Hits}}


def _start_from(pooled: Hits, depth: int) -> tuple[list[float], list[float]]:
    """Pseudo-counts (held, tried) for ``depth`` depths at ``pooled``'s shares, weighted as the prior is."""
    tried = [Hits.PRIOR[1]] * depth
    return [t * pooled.share(j) for j, t in enumerate(tried)], tried


class Standing:
    """An answer that stands for the next ``times`` questions asked on the same footing (``on``): the controller's
    width-1 choices, a policy's gain (``WidthController.choose``, ``gain``) and a verifying batch's plain pass
    (batch/token.py)."""

    def __init__(self) -> None:
        self.on, self.answer, self.left = None, None, 0

    def get(self, on: tuple):
        """The answer, where it still stands for ``on`` (one question fewer left), else None."""
        if self.left and self.on == on:
            self.left -= 1
            return self.answer
        return None

    def set(self, on: tuple, answer, times: int) -> None:
        self.on, self.answer, self.left = on, answer, times


class WidthController:
    """Chooses each pass's width (module docstring) and keeps what it chose and why.

    ``surface`` None: width is taken to be free (an unmeasured device): every pass gets ``most``.
    Each row's acceptance is its own ``Hits``, started from the pooled share at the same tau, which every
    controller on the same surface shares (within this process): a new batch starts from what the
    model's rows have shown on this machine, not from the prior.

    On a measured surface the controller also checks it against the passes it sees (``passed``): the
    running ratio of a pass's measured time to the surface's price (``Prices``), kept per row count, apart
    for one-token and wider passes (the host work a real batch adds per column is not all in the surface)
    and for MARS windows and verifying passes (whose 4-D masks and fallback groups add their own), scales
    the price of every later pass of its kind at that row count. Each ratio is measured only while its
    passes are taken, so one that was off (a surface measured in another phase of the machine, a burst of
    other load) could keep them off, or on, for good. So after STALE passes in a row of one kind, the other
    kind is taken once where it promises NEAR of the choice's rate (``settle``), and that look sets its ratio
    again; further off, its ratio drifts toward the measured one until it comes near.
    A simulated surface is the clock itself and is taken as it is.
    """

    ROW_DECAY = 0.95  # a row's own share follows its last tens of passes
    POOLED_DECAY = 0.99  # the batch's, its last hundreds of row passes
    RECHECK = 8  # passes over which a choice of width 1 that nothing came near stands before it is made again

    def __init__(self, surface: Surface | None, most: int, *, verifying: bool = False) -> None:
        self.surface, self.most = surface, max(int(most), 1)
        shared = _POOLED.setdefault(surface, {}) if surface is not None else {}
        self.pooled: dict[float, Hits] = shared.setdefault(self.most, {})  # tau -> the pooled share
        self.shared = shared
        self.drafts: Hits | None = None  # verifying passes: the pooled share of drafts held (start_drafts)
        kind = "verify" if verifying else "window"
        self.prices: Prices = shared.setdefault(("prices", kind), Prices())  # the surface against the passes seen
        self.last: tuple[int, float] = (self.most, 1.0)  # (width, expected gain over width 1)
        self.shown = 0  # row passes that offered candidates (``observe``): what a standing answer is given on
        self.narrow, self.gains = Standing(), Standing()  # a width-1 choice nothing came near; a policy's gain

    def new_row(self, tau: float) -> Hits:
        """A row's acceptance, started from (and relaxing back to) what the batch's rows have shown at this tau."""
        pooled, depth = self.pooled.get(round(tau, 4)), self.most - 1
        return Hits(depth, self.ROW_DECAY, None if pooled is None else _start_from(pooled, depth))

    def observe(self, row: Hits, tau: float, offered: int, extra: int) -> None:
        row.observe(offered, extra)
        if offered:  # the pooled share learns from masks offered; a row's idle pass shows nothing about them
            self.shown += 1
            self.pooled.setdefault(round(tau, 4), Hits(self.most - 1, self.POOLED_DECAY)).observe(offered, extra)

    def observe_pass(self, rows: Sequence[Hits], tau: float, widths: Sequence[int], accepted: Sequence[int]) -> None:
        """``observe`` for every row of a pass that fed row i ``widths[i]`` tokens and committed ``accepted[i]``."""
        if max(widths, default=1) == 1:  # no row was offered a mask: each only idles (Hits.observe)
            for row in rows:
                row.idle += 1
            return
        for row, width, tokens in zip(rows, widths, accepted):
            self.observe(row, tau, width - 1, tokens - 1)

    def rates(self, rows: Sequence[Hits], caps: Sequence[int], static: bool = False) -> dict[int, float]:
        """Expected committed tokens per ms of steady passes of each width 1 .. most over these rows (module
        docstring); ``static``: a batch no row joins, ``caps`` the rows' room left, whose wide passes return less as
        its rows drift apart (drift.py)."""
        reach = [h.reach(self.most) for h in rows]
        rates = self._rates(reach, caps)
        return kept(rates, reach, caps, self.surface) if static else rates

    def _rates(self, reach: Sequence[list[float]], caps: Sequence[int]) -> dict[int, float]:
        """``rates`` from the rows' acceptance (``Hits.reach``: P(at least k tokens)), read once for every width.

        At width w, summed over candidates k <= w that a row's cap leaves it: the rows' expected tokens, and the
        expected tokens of the row that accepts most, n_w = sum_k (1 - prod_r (1 - P_r(at least k))).
        """
        out, rows, surface, factor = {}, len(reach), self.surface, self.prices.factor
        expected, widest = 0.0, 0.0
        for width in range(1, self.most + 1):
            offered = [r[width - 1] for r, cap in zip(reach, caps) if cap >= width]  # rows with a width-th candidate
            expected += sum(offered) if width > 1 else rows  # a row's first candidate is its AR token, always held
            none = 1.0
            for p in offered:
                none *= 1.0 - p
            widest += 1.0 - none
            columns = widest - 1 + width
            out[width] = expected / (surface.ms(rows, columns) * factor(rows, columns))
        return out

    def passed(self, rows: int, columns: int, seconds: float, block: bool = False) -> None:
        """A pass over ``rows`` rows fed ``columns`` columns (under a 4-D mask: ``block``) and took ``seconds``:
        correct the prices."""
        if self.surface is None or self.surface.simulated or rows < 1 or columns < 1 or seconds <= 0:
            return
        price = self.surface.ms(rows, columns)
        self.prices.seen(rows, columns > 1, seconds * 1000 / price, columns, block, price / self.surface.ms(rows, 1))

    def settle(self, rows: int, gain: float, first: float = 0.0) -> bool:
        """Whether the next pass over ``rows`` rows is wide, given the best wide choice's expected ``gain`` over
        one-token passes: where it promises GAIN (one row: any gain), or where a kind's price is due a look
        (``Prices.due``), the kind due wherever it promises NEAR of the other's rate; a wide look whose first pass
        only drafts costs ``first`` more than a one-token pass (in one-token passes) and is due only as often as
        that costs FIRST a STALE passes (``spaced``)."""
        due, pays = self.prices.due(rows), gain >= (GAIN if rows > 1 else 1.0)
        if due is None:
            return pays
        if due:  # the wide price: a look where it comes near, as often as its first pass allows
            return pays or (gain >= NEAR and self.spaced(rows, first))
        return gain > 1.0 / NEAR  # the one-token price: wide only well clear of it

    def spaced(self, rows: int, first: float) -> bool:
        """Whether one-token passes over ``rows`` rows have run long enough for a wide look whose first pass costs
        ``first`` more than theirs: STALE passes where that is at most FIRST, first / FIRST times as many where more
        (its cost spread as thin). Never where no one-token passes run (the wide kind's own runs)."""
        kind, run = self.prices.runs.get(rows, (True, 0))
        return not kind and run >= Prices.STALE * max(1.0, first / FIRST)

    def start_drafts(self, depth: int) -> tuple[list[float], list[float]]:
        """Pseudo-counts (held, tried) for ``depth`` depths that a verifying batch's DraftDepth starts from: the
        share of drafts held that earlier batches on this surface showed, weighted as the prior is."""
        self.drafts = self.shared.setdefault(("drafts", depth), Hits(depth, self.POOLED_DECAY))
        return _start_from(self.drafts, depth)

    def draft_yields(self) -> Yields:
        """Tokens verifying passes realized against DraftDepth's model, per layout kind: what earlier batches on this
        surface showed (exact.DraftDepth.observe_yield)."""
        return self.shared.setdefault("draft yields", Yields(DraftDepth.YIELD_PRIOR, DraftDepth.YIELD_DECAY))

    def observe_drafts(self, drafted: int, held: int) -> None:
        """A row's verifying pass checked ``drafted`` drafts and kept the first ``held``: the pooled share."""
        if drafted and self.drafts is not None:  # a row with no drafts shows nothing about them
            self.drafts.observe(drafted, held)

    def choose(
        self, rows: Sequence[Hits], caps: Sequence[int], tau: float, fed: int | None = None, joins: int = 0,
        static: bool = False,
    ) -> int:
        """The width of the next pass: 1 at tau = 1.0, else the best rate (``static``: a batch no row joins, ``rates``);
        in a prefill (``fed``: the longest prompt) the masks that are worth more than they add (``prefill``;
        ``joins``: running rows these join).

        Where width 1 won and no width promised GAIN, the choice stands for the next RECHECK - 1 passes over as
        many rows at the same tau until a row shows something (a prefill's masks), as a verifying batch's plain
        pass does (batch/token.py): a row fed one token shows nothing about its masks, and reading every row's
        acceptance every pass is host work that a plain AR pass does not pay (run after the native layers, with
        the host's caches cold, it made a MARS batch of AR's passes measurably slower than batched AR). Meanwhile
        the rows' shares relax toward where they started and a price may come due a look (``settle``); the next
        choice reads both.
        """
        if tau >= 1.0 or not rows:
            self.last = (1, 1.0)
        elif self.surface is None:
            self.last = (self.most, math.inf)
        elif fed is not None:
            self.last = self.prefill(rows, caps, fed, joins)
        elif self.narrow.get((len(rows), tau, self.shown)) is None:
            rates = self.rates(rows, caps, static)
            wide = max((w for w in rates if w > 1), key=lambda w: (rates[w], -w), default=1)
            gain = rates[wide] / rates[1]
            best = wide if wide > 1 and self.settle(len(rows), gain) else 1
            self.last = (best, rates[best] / rates[1])
            self.narrow.set((len(rows), tau, self.shown), 1, self.RECHECK - 1 if best == 1 and gain < GAIN else 0)
        return self.last[0]

    def prefill(self, rows: Sequence[Hits], caps: Sequence[int], fed: int, joins: int = 0) -> tuple[int, float]:
        """(width, gain) of a prefill of ``fed`` columns: its masks are a one-off, each worth the tokens it is
        expected to commit at what a token will cost once decoding (the best steady rate's ms a token, among the
        ``joins`` running rows these rows join too, taken to accept as they do), against the ms they add to the
        prefill. Priced as a pass's rate instead, masks beside a long prompt always looked free, and at 8 rows on a
        2-core CPU they cost more than the tokens they brought."""
        reach = [h.reach(self.most) for h in rows]
        among = (reach + reach[:1] * joins, list(caps) + [self.most] * joins)
        per_token, n, prices = 1.0 / max(self._rates(*among).values()), len(rows), self.prices
        base = self.surface.ms(n, fed) * prices.factor(n, fed)
        best, value = 1, 0.0
        for width in range(2, self.most + 1):
            tokens = sum(sum(r[1 : min(width, cap)]) for r, cap in zip(reach, caps))  # beyond each row's first
            added = self.surface.ms(n, fed - 1 + width) * prices.factor(n, fed - 1 + width) - base
            if tokens * per_token - added > value:
                best, value = width, tokens * per_token - added
        return best, 1.0 + value / base

    def gain(self, rows: int, tau: float) -> float:
        """How much faster than width 1 the best width is expected to be at ``rows`` rows and ``tau``.

        From the pooled acceptance at that tau (the prior where none was seen). inf without a surface. A serving
        policy asks before every pass; as a width-1 choice (``choose``), the answer stands for the next RECHECK - 1
        questions at the same rows and tau, or until a row shows something.
        """
        if self.surface is None:
            return math.inf
        if tau >= 1.0 or rows < 1:
            return 1.0
        on = (rows, round(tau, 4), self.shown)
        if (known := self.gains.get(on)) is not None:
            return known
        hits = self.pooled.get(on[1]) or Hits(self.most - 1)
        rates = self._rates([hits.reach(self.most)] * rows, [self.most] * rows)
        gain = max(rates.values()) / rates[1]
        gain = gain if gain >= GAIN else 1.0
        self.gains.set(on, gain, self.RECHECK - 1)
        return gain

    def why(self) -> str:
        """One line: the width chosen last and the reason."""
        width, gain = self.last
        if self.surface is None:
            return f"width {width}: no measured cost surface, so every mask is fed"
        if width == 1:
            return "width 1 (plain AR passes): on this machine's cost surface no mask pays for itself here"
        return f"width {width}: expected {gain:.2f}x the tokens per ms of one-token passes on the cost surface"


class OneRow:
    """The controller of one sequence (loop.decode_passes): its running acceptance and each pass's width."""

    def __init__(self, controller: WidthController) -> None:
        self.controller, self.hits = controller, None

    def choose(self, tau: float, room: int, pending: int, produced: int) -> int | None:
        """The next MARS pass's width (None at tau 1.0: an AR pass); ``pending`` is the prompt's length in the
        prefill (nothing ``produced`` yet), whose masks are priced as a one-off (``WidthController.prefill``)."""
        if tau >= 1.0:
            return None
        self.hits = self.hits or self.controller.new_row(tau)
        return self.controller.choose([self.hits], [room], tau, None if produced else pending)

    def observe(self, tau: float, width: int, accepted: int) -> None:
        self.controller.observe(self.hits, tau, width - 1, accepted - 1)


