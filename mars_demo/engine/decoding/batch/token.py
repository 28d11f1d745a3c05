"""Token-level batch decoding: every row runs the sliding window of loop.py on its own.

Each pass feeds, per row, [holes | tokens it accepted last pass | B-1 masks], right
aligned so that the masks are the last B-1 columns of every row; the masks are
cropped off after the pass, as in the single-sequence decoder. Rows advance
independently: a row that accepted fewer tokens than the longest pads its part
of the window on the left with holes (attention mask 0), and its position ids
count only its own real tokens. So the cache stays rectangular, no row waits at a
block boundary, and each row sees exactly the context it would see alone.
A finished row leaves the batch (its cache row is dropped) and stays finished.

Single-row semantics, which each row of a batch reproduces token for token:
loop.decode_passes (tests/reference.py's reference_decode without a cache).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

import numpy as np
import torch

from ...backends.base import Backend
from ...backends.placement import SeededGenerator
from .. import exact, speculative
from ..acceptance import accept_rows, greedy_confidence
from ..config import VERIFYING_MODES, DecodeConfig
from ..drift import fixed_share, spread
from ..sampling import Sampling
from ..width import GAIN, NEAR, Hits, Standing, WidthController
from .events import BatchEvent, RowStep
from .rows import BatchSpec, PaddedCache, RowBook, Window, left_pad, limit_new_tokens

PER_ROW = ("pending", "next_pos", "drafts", "proposals", "history", "hits")  # TokenBatch's lists by book row


def slide(
    pending: list[list[int]], next_pos: list[int], rooms: list[int], widths: list[int], mask_id: int, pad_id: int
) -> Window:
    """[holes | tokens accepted last pass | w - 1 masks | W - w holes] per row, W the widest row's width w.

    Candidates come from a row's last real token and its masks; the last W - 1 columns (masks and the
    trailing holes of narrower rows) are cropped after the pass. A row of width 1 is an AR pass.
    """
    real, real_attn = left_pad(pending, pad_id)  # (A, n), holes on the left
    n, most = len(real[0]), max(widths)
    return Window(
        ids=[row + [mask_id] * (w - 1) + [pad_id] * (most - w) for row, w in zip(real, widths)],
        attn=[row + [1] * (w - 1) + [0] * (most - w) for row, w in zip(real_attn, widths)],
        first_pos=[pos - (n - len(p)) for pos, p in zip(next_pos, pending)],
        keep=most, start=[0] * len(pending), cap=[min(w, room) for w, room in zip(widths, rooms)], drop=most - 1,
    )


def verify_block(
    pending: list[list[int]], drafts: list[list[int]], next_pos: list[int], L: int, mask_id: int, pad_id: int, device,
    fallback: bool = True, masks: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """[holes | pending | drafts | L masks | L fallback masks] per row (exact.verify_window, batched).

    Returns ids and position ids (rows, width), the attention among the fed columns, and n,
    the width of the real part. That attention is (rows, width, width) where a fallback group is
    fed, else the pass is causal and it is each column's 0/1 (rows, width), a 2-D padding mask's
    part (no 4-D mask to build and read back). A row's fallback masks
    sit right after its newest pending token and do not see its drafts or main masks;
    none are fed without ``fallback`` or when no row has drafts, and a row without drafts
    gets holes there (it reads no fallback: a backend that skips holes does no work for them).
    Without ``masks`` (a layout in turns, exact.Layout) a row is fed [holes | pending | drafts], or
    [holes | pending | L masks] when it has no drafts, and nothing after: no fallback group either.
    """
    trail = L if masks else 0  # masks after every row's real part
    real, real_attn = left_pad([p + c for p, c in zip(pending, _candidates(drafts, L, masks, mask_id))], pad_id)
    g = L if masks and fallback and any(drafts) else 0  # no fallback group asked for, or no row has drafts
    n = len(real[0])
    width = n + trail + g
    starts = [pos - (n - len(p) - a) for pos, p, a in zip(next_pos, pending, _afters(drafts, L, masks))]
    if not g:  # a causal pass: three small tables, made as lists (a batch's every verifying pass does this)
        tables = ([row + [mask_id] * trail for row in real], [[max(s + c, 0) for c in range(width)] for s in starts],
                  [row + [1] * trail for row in real_attn])
        ids, positions, attention = (torch.tensor(t, dtype=torch.int64, device=device) for t in tables)
        return ids, positions, attention, n
    # built in numpy, then handed to torch once (~20 torch ops before)
    ids = np.array([row + [mask_id] * (trail + g) for row in real], dtype=np.int64)
    positions = np.array(starts, dtype=np.int64)[:, None] + np.arange(width)  # real part and main masks continue
    after_pending = np.array([pos + len(p) for pos, p in zip(next_pos, pending)], dtype=np.int64)
    positions[:, n + trail :] = after_pending[:, None] + np.arange(g)
    drafted = np.array([len(d) > 0 for d in drafts])  # reads its fallback
    present = np.concatenate([np.array(real_attn, dtype=bool), np.ones((len(real), trail), dtype=bool),
                              np.repeat(drafted[:, None], g, axis=1)], axis=1)
    attention = np.tril(np.ones((width, width), dtype=bool))[None] & present[:, None, :]
    for r, d in enumerate(drafts):
        attention[r, n + L :, n - len(d) : n + L] = False  # fallback masks: not the drafts, not the main masks
    ids, positions, attention = (torch.from_numpy(a).to(device) for a in (ids, positions.clip(min=0), attention))
    return ids, positions, attention, n


def _candidates(drafts: list[list[int]], L: int, masks: bool, mask_id: int) -> list[list[int]]:
    """What each row feeds after its pending tokens in the real part of a verifying pass (verify_block): its drafts;
    in turns (no ``masks``), a row without drafts its L masks instead."""
    return [d if masks or d else [mask_id] * L for d in drafts]


def _afters(drafts: list[list[int]], L: int, masks: bool) -> list[int]:
    """How many columns follow each row's newest pending token in the real part (``_candidates``)."""
    return [len(d) if masks or d else L for d in drafts]


def _lookahead(draft: list[int], L: int, masks: bool) -> int:
    """The masks a row's verdict reads after its drafts: L, or in turns none beside drafts (exact.read_verdict)."""
    return L if masks or not draft else 0


def verify_rows(
    logits: torch.Tensor, drafts: list[list[int]], L: int, tau: float, metric: str,
    rule: speculative.Rule | None = None, proposals: list[torch.Tensor | None] | None = None, fallback: bool = True,
    masks: bool = True,
) -> list[exact.Verdict]:
    """Each row's verdict; at a temperature by ``rule``, each row's drafts drawn from its ``proposals``.

    logits: (A, 1 + most + L + fallback, vocab), most the longest row's columns after its newest pending token
    (``_afters``), which sits at column most - that row's; ``fallback`` / ``masks``: what the pass fed
    (verify_block).
    """
    afters, greedy = _afters(drafts, L, masks), rule is None or rule.sampling.greedy
    most = max(afters)
    if greedy:  # every row's greedy tokens and confidences in one call and one sync
        tokens, conf = (t.tolist() for t in greedy_confidence(logits, metric))
    verdicts = []
    for r, d in enumerate(drafts):
        ahead, read_back = _lookahead(d, L, masks), bool(d) and fallback and masks  # its fallback group: last L
        start = most - afters[r]
        stop, back = start + 1 + len(d) + ahead, slice(-L, None) if read_back else slice(0, 0)
        if greedy:
            tok, cf = tokens[r], conf[r]
            verdicts.append(exact.read_verdict(tok[start:stop] + tok[back], cf[start:stop] + cf[back], d, ahead, tau,
                                               metric))
            continue
        rows = logits[r, start:stop]
        if read_back:
            rows = torch.cat([rows, logits[r, back]])
        verdicts.append(rule.verify(rows, d, ahead, tau, metric, proposals[r]))
    return verdicts


@torch.inference_mode()
def token_passes(
    backend: Backend,
    prompts: Sequence[Sequence[int]],
    config: DecodeConfig,
    spec: BatchSpec,
    controller: WidthController | None = None,
) -> Iterator[BatchEvent]:
    """Decode token-id ``prompts`` together under ``config``, each row at its own pace; one BatchEvent per pass.

    Exact / hybrid mode (loop.decode_passes): every row verifies its own drafts.
    ``controller``: chooses each pass's width (width.py); None feeds every pass the full window.
    """
    generator = SeededGenerator(config.seed)  # on the logits' device (placement.py)
    batch = TokenBatch(
        backend, prompts, config, block_size=spec.block_size, mask_id=spec.mask_id, pad_id=spec.pad_id,
        stop_ids=spec.stop_ids, generator=generator, controller=controller, static=True,
    )
    index = 0
    while True:
        tau_now = spec.tau.get()
        started = time.perf_counter()
        steps, fed = batch.step(tau_now)
        seconds = time.perf_counter() - started
        batch.book.end_pass(seconds)
        stats = batch.book.stats() if not batch.active else None
        yield BatchEvent(index, tuple(steps), tau_now, seconds, "prefill" if index == 0 else "window", fed, stats)
        if stats:
            return
        index += 1


class TokenBatch:
    """The token-level batch between two passes: its cache, its book, and what each row feeds next.

    Rows are the book's indices; ``active`` lists the live ones in cache order. ``step`` runs
    one pass for every active row. ``join`` merges another batch's rows (prompts prefilled by
    that batch's own first pass) into this one, and ``end`` takes a row out: the serving loop
    (serving/loop.py) admits and releases rows between passes with these, token_passes only steps.

    Each pass's width comes from ``controller`` (width.py): from 1 (an AR pass) to B for "mars", and
    the number of drafts and masks per group (0 to B - 1) for verifying passes; a prefill's masks are
    priced as a one-off (``WidthController.prefill``). A ``static`` batch (token_passes': no row joins it) prices
    its wide passes for its rows drifting apart (drift.py).
    """

    def __init__(
        self, backend: Backend, prompts: Sequence[Sequence[int]], config: DecodeConfig, *, block_size: int,
        mask_id: int, pad_id: int, stop_ids: set[int] = frozenset(), generator: SeededGenerator | None = None,
        controller: WidthController | None = None, static: bool = False,
    ) -> None:
        verifying = config.mode in VERIFYING_MODES
        self.static = static  # no row joins: the batch runs until its last row ends (drift.py)
        self.B, self.mask_id, self.pad_id, self.metric = block_size, mask_id, pad_id, config.metric
        self.sampling, self.verifying = Sampling(config.temperature, config.top_p, config.top_k), verifying
        self.generator = generator or SeededGenerator(None)
        self.rule = speculative.Rule(self.sampling, self.generator)  # verifying at a temperature: the rule
        limit = limit_new_tokens(backend, prompts, config.max_new_tokens, 2 * block_size if verifying else block_size)
        self.book = RowBook(len(prompts), limit, set(stop_ids))
        self.kv = PaddedCache(backend, len(prompts))
        self.active = list(range(len(prompts)))  # rows still decoding, in cache order
        self.pending = [list(p) for p in prompts]  # fed next pass: the prompt first, then the tokens accepted last pass
        self.next_pos = [0] * len(prompts)  # position id of each row's next real token
        # verifying: each row's guesses for the tokens after its pending ones
        self.drafts: list[list[int]] = [[] for _ in prompts]
        self.proposals: list[torch.Tensor | None] = [None] * len(prompts)  # at a temperature: each row's drafts' q
        # verifying: each row's committed tokens, where exact passes look up drafts
        self.history = [list(p) for p in prompts]
        self.controller = controller or WidthController(None, block_size)
        self.hits: list[Hits | None] = [None] * len(prompts)  # each row's running acceptance, made at its first use
        # verifying: the share of drafts held, from what earlier batches on this surface showed
        self.depths = exact.DraftDepth(
            block_size - 1, None, self.controller.start_drafts(block_size - 1), self.controller.draft_yields()
        )
        self.passes = 0
        self.plain = Standing()  # a layout that stands on (rows, tau): a plain pass, a look's verifying one (_layout)
        self.joins = 0  # rows of a running batch these join after their prefill (a server's newcomers): their
        # prefill's masks and drafts are priced at the rows they will decode among

    @torch.inference_mode()
    def step(self, tau: float) -> tuple[list[RowStep], int]:
        """One forward pass for every active row; (a step per book row, columns fed). Finished rows leave."""
        started, rows = time.perf_counter(), len(self.active)
        if self.verifying:
            steps, fed, block = self._verifying_step(tau)
        else:
            (steps, fed), block = self._window_pass(tau), False
        self.active = self.kv.drop_finished(self.book, self.active)
        if self.passes:  # what the pass cost against its price (the prefill is priced apart)
            self.controller.passed(rows, fed, time.perf_counter() - started, block)
        self.passes += 1
        return steps, fed

    def _verifying_step(self, tau: float) -> tuple[list[RowStep], int, bool]:
        """A verifying pass for every active row, or a plain AR pass where no draft pays: (steps, columns fed,
        whether the pass ran under a 4-D mask)."""
        layout, active = self._layout(tau), self.active
        if not layout.depth:  # nothing to verify and no masks: an AR pass, without a verifying pass's host work
            for r in active:  # (a draft kept from an earlier pass would be checked at the wrong place later)
                self.drafts[r], self.proposals[r] = [], None
            steps, fed = self._window_pass(1.0, exact.AR)
            for r in active:
                self.history[r] += steps[r].token_ids
            return steps, fed, False
        for r in active:  # exact passes also draft by lookup, as decode_passes does
            self.drafts[r], self.proposals[r] = speculative.pick_drafts(
                self.history[r], self.drafts[r], self.proposals[r], layout.depth, tau >= 1.0
            )
        drafted = {r: len(self.drafts[r]) for r in active}
        steps, fed, block = _verify_pass(
            self.kv, self.book, active, self.pending, self.drafts, self.next_pos, layout, self.mask_id, self.pad_id,
            tau, self.metric, self.rule, self.proposals,
        )
        for r, count in drafted.items():
            held = sum(o == exact.DRAFT for o in steps[r].origins)
            self.depths.observe(count, held)
            self.controller.observe_drafts(count, held)
            self.history[r] += steps[r].token_ids
        if self.passes and self.depths.costs:  # a layout the model weighed (the prefill's is priced apart)
            self.depths.observe_yield(layout, sum(len(steps[r].token_ids) for r in active) / len(active))
        return steps, fed, block

    def _layout(self, tau: float) -> exact.Layout:
        """The next verifying pass's drafts (and masks per group), fallback group and masks beside the drafts: by
        expected tokens per ms at this many rows (exact.DraftDepth; hybrid passes keep the fallback group, whose
        masks it may accept, as one sequence's do).

        The prefill feeds a full group of masks, the first drafts, where drafting pays at the rows they will be
        verified among (``joins`` more for a server's newcomers), and none where it does not (they would draft
        for passes that verify nothing).
        """
        surface, most = self.controller.surface, self.B - 1
        if surface is None:
            return exact.Layout(most, True)
        rows, depths = len(self.active) + (0 if self.passes else self.joins), self.depths
        if (standing := self.plain.get((rows, tau))) is not None:
            return standing
        # the surface's prices against the passes seen at this many rows (WidthController.passed)
        factor, widths = self.controller.prices.factor, range(1, 3 * most + 2)
        depths.costs, depths.rows = {w: surface.ms(rows, w) * factor(rows, w) for w in widths}, rows
        depths.block_costs = {w: surface.ms(rows, w) * factor(rows, w, True) for w in widths}
        kinds = (exact.WITH_FALLBACK, exact.CHAIN, exact.IN_TURNS) if tau >= 1.0 else (exact.WITH_FALLBACK,)
        depths.layout(kinds)  # where AR passes win, the shares fade back to where they began
        best, rate, plain = depths.weighed  # the best drafting layout, its rate and AR's
        gain = rate / plain
        if self.static and best.depth:  # what it keeps of that once the rows drift apart
            left = max(self.book.room(r) for r in self.active)
            gain *= spread(rows, *depths.pass_moments(best), left, fixed_share(surface, rows, 1 + best.depth))
        if not self.passes:  # as the MARS width: a layout priced within a few percent may not pay
            return exact.Layout(most if gain >= GAIN else 0, True)
        # (or a price is due a look; after AR passes no row has drafts, and a look's first pass only drafts)
        first = 0.0 if any(self.drafts[r] for r in self.active) else depths.cost(1 + best.depth) / depths.cost(1) - 1
        chosen = best if self.controller.settle(rows, gain, first) else best._replace(depth=0)
        self.controller.last = (1 + chosen.depth, gain if chosen.depth else 1.0)
        # a plain pass stands for the next RECHECK passes over these rows at this tau where no layout promised GAIN
        # and no look is due (or none came near, or the look's draft-only first pass is dear and its longer wait is not
        # over: after plain passes no row drafts): pricing every layout is host work a plain pass does not pay
        due = self.controller.prices.due(rows)
        looking = due is not None and gain >= NEAR and not (due and not self.controller.spaced(rows, first))
        stands = not chosen.depth and gain < GAIN and not looking
        self.plain.set((rows, tau), chosen, WidthController.RECHECK if stands else 0)
        if chosen.depth and first and gain < GAIN:  # a look that only drafts: the next pass verifies what it drafted
            self.plain.set((rows, tau), chosen, 1)
        return chosen

    def _window_pass(self, tau: float, origin: str | None = None) -> tuple[list[RowStep], int]:
        """A MARS window pass for every active row (an AR pass at width 1); ``origin``: what every committed token is
        marked as come from (a verifying batch's AR pass: exact.AR)."""
        active, book, controller = self.active, self.book, self.controller
        rooms = [book.room(r) for r in active]
        for r in active:
            self.hits[r] = self.hits[r] or controller.new_row(tau)
        hits = [self.hits[r] for r in active]
        prompt = max(len(self.pending[r]) for r in active) if not self.passes else None  # the prefill's columns
        width = controller.choose(hits, rooms, tau, prompt, self.joins, self.static)
        widths = [max(1, min(width, room)) for room in rooms]
        window = slide([self.pending[r] for r in active], [self.next_pos[r] for r in active], rooms, widths,
                       self.mask_id, self.pad_id)
        logits = self.kv.forward(window)  # (A, width, vocab): each row's last real token and its masks
        self.kv.crop(window.drop)  # the masks; the accepted tokens are fed next pass
        s = self.sampling
        tokens, confs = accept_rows(
            logits, window.start, window.cap, tau, self.metric, s.temperature, self.generator.on(logits.device),
            s.top_p, s.top_k,
        )
        steps = book.commit_all(active, tokens, confs)
        if tau < 1.0:
            controller.observe_pass(hits, tau, widths, [len(t) for t in tokens])
        for i, r in enumerate(active):
            self.next_pos[r] += len(self.pending[r])
            self.pending[r] = list(steps[r].token_ids)
            marked = {"origins": (origin,) * len(steps[r].token_ids)} if origin else {}
            steps[r] = replace(steps[r], width=widths[i], **marked)
        return steps, window.width

    @torch.inference_mode()
    def join(self, other: TokenBatch) -> list[int]:
        """Merge ``other``'s live rows into this batch (its cache rows below ours); their new book indices."""
        live = other.active
        if not live:
            return []
        first = self.book.extend(other.book, live)
        rows = list(range(first, first + len(live)))
        for name in PER_ROW:
            getattr(self, name).extend(getattr(other, name)[r] for r in live)
        if self.active:
            self.kv.merge(other.kv)
        else:
            self.kv = other.kv
        self.active += rows
        return rows

    def compact(self) -> dict[int, int]:
        """Forget the finished rows (book and per-row state): the live rows become 0, 1, ... in their cache order,
        which stays; returns {old book row: new}. A server's batch that never empties calls it now and then, or
        its book would grow with every request it has run (and each pass's steps with it)."""
        live = list(self.active)
        for name in PER_ROW:
            values = getattr(self, name)
            setattr(self, name, [values[r] for r in live])
        self.book.keep_only(live)
        self.active = list(range(len(live)))
        return {old: new for new, old in enumerate(live)}

    def end(self, row: int, reason: str) -> None:
        """Take a live row out of the batch now (a stopped request); it stays finished with ``reason``."""
        if self.book.live(row):
            self.book.finish[row] = reason
            self.active = self.kv.drop_finished(self.book, self.active)


def _verify_pass(
    kv: PaddedCache, book: RowBook, active: list[int], pending: list[list[int]], drafts: list[list[int]],
    next_pos: list[int], layout: exact.Layout, mask_id: int, pad_id: int, tau: float, metric: str,
    rule: speculative.Rule | None = None, proposals: list[torch.Tensor | None] | None = None,
) -> tuple[list[RowStep], int, bool]:
    """One verifying pass for every active row: feed, verify, commit, and keep in the cache only verified columns.

    ``layout``: its depth L (drafts, and masks per group), the fallback group, masks beside the drafts. Updates
    pending, drafts, proposals (each row's drafts' q, at a temperature) and next_pos in place; returns the steps, the
    columns fed and whether the pass ran under a 4-D mask (a fallback group).
    """
    L, fallback, masks = layout
    rows_pending, rows_drafts = [pending[r] for r in active], [drafts[r] for r in active]
    cached, afters = kv.length, _afters(rows_drafts, L, masks)
    ids, positions, attention, n = verify_block(
        rows_pending, rows_drafts, [next_pos[r] for r in active], L, mask_id, pad_id, kv.attn.device, fallback, masks
    )
    keep = 1 + max(afters) + ids.shape[1] - n
    if attention.dim() == 2:  # no fallback group: a causal pass, under the cache's 2-D padding mask
        logits = kv.forward_padded(ids, positions, attention, keep)
    else:
        logits = kv.forward_block(ids, positions, attention, keep)
    rows_q = [proposals[r] for r in active] if proposals is not None else None
    verdicts = verify_rows(logits, rows_drafts, L, tau, metric, rule, rows_q, fallback, masks)
    steps = book.commit_all(active, [v.tokens for v in verdicts], [v.confidences for v in verdicts])
    # each row's columns up to its last verified draft
    kept = [n - after + v.cached for after, v in zip(afters, verdicts)]
    kv.crop(ids.shape[1] - max(kept))  # both mask groups and the drafts no row kept
    kv.hide(cached, kept)  # each row's rejected drafts, kept for another row's sake
    for i, (r, v) in enumerate(zip(active, verdicts)):
        width = 1 + len(rows_drafts[i]) + _lookahead(rows_drafts[i], L, masks)
        steps[r] = replace(steps[r], origins=tuple(v.origins[: len(steps[r].token_ids)]), width=width)
        next_pos[r] += len(pending[r]) + v.cached
        pending[r], drafts[r] = v.tokens[v.cached :], v.drafts
        if proposals is not None:
            proposals[r] = v.proposal
    return steps, ids.shape[1], attention.dim() > 2
