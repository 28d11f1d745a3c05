"""The parts both batch decoders share: padded cache, per-row acceptance, per-row bookkeeping.

Rows of different lengths live in one rectangular KV cache. A column a row does
not use (left padding, a hole) has attention mask 0, and every real column gets
the row's own position id, so each row sees exactly the context it would see
alone. Rolling back is cropping the cache's last columns together with their
attention-mask columns, never a copy. A row that finishes leaves the batch: its
cache row is dropped, so it costs nothing afterwards and cannot touch the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...backends.base import Backend
from ..commit import commit_tokens
from ..loop import LiveTau, RunStats, context_limit
from .events import BatchStats, RowStep


@dataclass(frozen=True)
class BatchSpec:
    """What a batch decodes with besides its DecodeConfig: the window, the special ids, the live tau."""

    block_size: int
    mask_id: int
    pad_id: int
    tau: LiveTau
    stop_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Window:
    """What one pass feeds, per active row, and where each row reads its candidates.

    ids, attn: (rows, width) tokens and their mask (0 = padding or hole).
    first_pos: position id of each row's first fed column (holes may get any position).
    keep: logits are read from the last ``keep`` columns; row r's candidate 1 is
      read at column start[r] of those, and it may accept at most cap[r] tokens.
    drop: columns cropped off the cache after the pass (masks, re-fed slots).
    """

    ids: list[list[int]]
    attn: list[list[int]]
    first_pos: list[int]
    keep: int
    start: list[int]
    cap: list[int]
    drop: int

    @property
    def width(self) -> int:
        return len(self.ids[0])


class PaddedCache:
    """A backend's cache plus the attention mask of its columns; both grow and crop together."""

    def __init__(self, backend: Backend, rows: int) -> None:
        self.backend = backend
        self.cache = backend.new_cache()
        self.attn = torch.zeros((rows, 0), dtype=torch.long, device=backend.device)  # (rows, columns)

    @property
    def length(self) -> int:
        return self.attn.shape[1]

    def forward(self, window: Window) -> torch.Tensor:
        """Feed one window (rows, width); logits (rows, keep, vocab) of its last ``keep`` columns."""
        device = self.attn.device
        attn = torch.tensor(window.attn, device=device)
        first = torch.tensor(window.first_pos, device=device)[:, None]
        positions = (first + torch.arange(window.width, device=device)).clamp_min(0)  # (rows, width)
        ids = torch.tensor(window.ids, device=device)
        return self.forward_padded(ids, positions, attn, window.keep)

    def forward_padded(self, ids: torch.Tensor, positions: torch.Tensor, attn: torch.Tensor, keep: int) -> torch.Tensor:
        """Feed ids (rows, width) causally, ``attn`` (rows, width) 1 where a column is fed and 0 for a hole; logits
        (rows, keep, vocab) of the last ``keep`` columns."""
        if self.length == 0 and attn.shape[0] > 1:
            logits = self._feed_from_prefix(ids, positions, attn, keep)
            if logits is not None:
                return logits
        if self._apart(attn, keep):
            return self._feed_apart(ids, positions, attn, None, keep)
        self.attn = torch.cat([self.attn, attn], dim=1)
        return self.backend.forward(ids, self.cache, positions=positions, mask=self.attn, keep=keep)

    def _feed_from_prefix(self, ids, positions, attn: torch.Tensor, keep: int) -> torch.Tensor | None:
        """The first pass of several rows from a stored prefix they all start with (``Backend.fill_prefix``), or
        None where there is none: the prefix's columns first, then each row's holes, then the rest of its row.

        Each row sees its prefix and its own tokens at their positions, as alone, so on a row-exact backend its
        logits and cache are the ones alone, bit for bit; the prefix is not fed again for every row. Only rows
        fed from position 0 after their holes qualify (a prefill).
        """
        width = ids.shape[1]
        columns = torch.arange(width, device=ids.device)
        lead = (attn == 0).long().argmin(dim=1, keepdim=True)  # each row's leading holes
        fed = columns >= lead
        if not torch.equal(attn.bool(), fed) or not bool((positions == columns - lead)[fed].all()):
            return None
        holes = lead.squeeze(1).tolist()
        held = self.backend.fill_prefix([ids[r, h:] for r, h in enumerate(holes)], self.cache, keep)
        if not held:
            return None
        rest = [torch.cat([columns[:h], columns[h + held :]]) for h in holes]  # the columns fed
        ids, positions, attn = (torch.stack([t[r, c] for r, c in enumerate(rest)]) for t in (ids, positions, attn))
        self.attn = torch.cat([attn.new_ones(attn.shape[0], held), attn], dim=1)
        return self.backend.forward(ids, self.cache, positions=positions, mask=self.attn, keep=keep)

    def forward_block(self, ids: torch.Tensor, positions: torch.Tensor, block: torch.Tensor, keep: int) -> torch.Tensor:
        """Feed ids (rows, width) whose attention among themselves is ``block`` (rows, width, width; True = may
        attend) and to the cache is the cache's own mask; logits (rows, keep, vocab) of the last ``keep`` columns.

        Every new column joins the cache's mask as attended (1): crop what must not stay, or hide() it.
        """
        rows, width = ids.shape
        present = block.diagonal(dim1=1, dim2=2).long()
        if self._apart(present, keep):
            return self._feed_apart(ids, positions, present, block, keep)
        # (rows, width, C + width)
        allowed = torch.cat([self.attn.bool()[:, None, :].expand(rows, width, -1), block], dim=2)
        self.attn = torch.cat([self.attn, present], dim=1)
        return self.backend.forward(ids, self.cache, positions=positions, mask=self._prepared(allowed), keep=keep)

    def _prepared(self, allowed: torch.Tensor) -> torch.Tensor:
        """(rows, 1, q, k) from ``allowed`` (rows, q, k): the booleans where the backend reads them (``bool_masks``),
        else 0 where allowed and the dtype's minimum elsewhere."""
        if self.backend.bool_masks:
            return allowed[:, None]
        dtype = self.backend.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]

    def _apart(self, attn: torch.Tensor, keep: int) -> bool:
        """Whether to feed this pass row by row: the first pass of several rows of which some start with holes
        (left padding), on a backend where padding costs as much as a real column (a CPU's prefill)."""
        return (
            self.length == 0 and attn.shape[0] > 1 and self.backend.padding_costs
            and bool((attn[:, : attn.shape[1] - keep] == 0).any())
        )

    def _feed_apart(self, ids, positions, attn: torch.Tensor, block: torch.Tensor | None, keep: int) -> torch.Tensor:
        """The first pass with each row fed alone, without its leading holes, then the rows' caches stacked.

        Each row gets what the single-sequence decoder's prefill gives it; where rows are independent bit for
        bit (int8dyn) that is also what the padded pass gives it, without the holes' work.
        """
        width, logits, caches = ids.shape[1], [], []
        for r in range(ids.shape[0]):
            holes = min(int(attn[r].argmax()), width - keep)  # never into the kept columns
            mask = attn[r : r + 1, holes:]
            if block is not None:
                mask = self._prepared(block[r : r + 1, holes:, holes:])
            elif bool(mask.all()):
                mask = None
            cache = self.backend.new_cache()
            logits.append(self.backend.forward(ids[r : r + 1, holes:], cache, positions=positions[r : r + 1, holes:],
                                               mask=mask, keep=keep))
            caches.append(cache)
        self.cache.stack(caches, width)
        self.attn = attn
        return torch.cat(logits)

    def hide(self, start: int, kept: list[int]) -> None:
        """Turn row i's columns from ``start + kept[i]`` to the last into holes (rejected drafts that other rows'
        columns keep), in one op for all rows."""
        most = max(kept, default=0)
        if any(k < most for k in kept):
            held = torch.tensor(kept, device=self.attn.device)[:, None]
            self.attn[:, start : start + most].masked_fill_(torch.arange(most, device=held.device) >= held, 0)

    def crop(self, columns: int) -> None:
        """Drop the last ``columns`` columns (masks, a re-fed block) from the cache and the mask."""
        if columns > 0:
            self.cache.crop(columns)
            self.attn = self.attn[:, :-columns]

    def merge(self, other: PaddedCache) -> None:
        """Append ``other``'s rows below ours (continuous batching); the shorter side gets holes on the left.

        A hole is a column with attention mask 0, so no row sees the other's columns and
        each keeps its own position ids: a merged row decodes exactly as it would alone.
        """
        width = max(self.length, other.length)
        self.cache.stack([other.cache], width)
        self.attn = torch.cat([_left_holes(self.attn, width), _left_holes(other.attn, width)], dim=0)

    def trim(self) -> None:
        """Drop the leading columns that are holes in every row (left behind by rows that left)."""
        used = self.attn.any(dim=0)  # (columns,)
        first = int(used.int().argmax()) if bool(used.any()) else 0
        if first:
            self.cache.drop_front(first)
            self.attn = self.attn[:, first:]

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows (finished rows leave the batch, so they stop costing compute)."""
        index = torch.tensor(rows, device=self.attn.device)
        self.cache.keep_rows(index)
        self.attn = self.attn[index]

    def drop_finished(self, book: RowBook, active: list[int]) -> list[int]:
        """The active rows that are still live, in their new cache order; the others leave the cache.

        The last live rows move into the slots of the rows that left (``fill_from_end``), so the cache copies
        one row per row that left instead of every row after it.
        """
        still = [i for i, r in enumerate(active) if book.live(r)]
        if still and len(still) < len(active):
            still = fill_from_end(still)
            self.keep_rows(still)
        return [active[i] for i in still]


def fill_from_end(kept: list[int]) -> list[int]:
    """The slots 0..len(kept)-1 filled with the ``kept`` rows (ascending): those already in a slot stay, the ones
    beyond move into the slots of the rows that left."""
    slots = len(kept)
    movers = iter(r for r in kept if r >= slots)
    staying = set(kept)
    return [r if r in staying else next(movers) for r in range(slots)]


def _left_holes(t: torch.Tensor, width: int) -> torch.Tensor:
    """Pad a mask's column axis (dim 1) to ``width`` with zeros on the left (holes)."""
    missing = width - t.shape[1]
    if missing <= 0:
        return t
    return torch.cat([t.new_zeros((t.shape[0], missing)), t], dim=1)


def left_pad(
    rows: Sequence[Sequence[int]], pad_id: int, width: int | None = None
) -> tuple[list[list[int]], list[list[int]]]:
    """Token rows padded on the left to ``width`` (default: the longest), and their 0/1 attention masks."""
    width = max(len(r) for r in rows) if width is None else width
    ids = [[pad_id] * (width - len(r)) + list(r) for r in rows]
    attn = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
    return ids, attn


def limit_new_tokens(
    backend: Backend, prompts: Sequence[Sequence[int]], max_new_tokens: int, lookahead: int
) -> int:
    """``max_new_tokens``, lowered so that no fed column (``lookahead`` past the last token) passes the context."""
    if not prompts:
        raise ValueError("no prompts to decode")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("the prompt is empty")
    width = max(len(p) for p in prompts)
    room = context_limit(backend) - width - lookahead
    if room < 1:
        limit = context_limit(backend)
        raise ValueError(f"the longest prompt is {width} tokens; this model's context is {limit} tokens")
    return min(max_new_tokens, room)


class RowBook:
    """Host-side account of every row: tokens produced, whether and why it finished, its passes and time."""

    PER_ROW = ("produced", "finish", "passes", "seconds", "limits")  # its lists by row

    def __init__(self, rows: int, max_new_tokens: int, stop_ids: set[int]) -> None:
        self.max_new_tokens = max_new_tokens
        self.limits = [max_new_tokens] * rows  # per row: rows that join later bring their own
        self.stop_ids = stop_ids
        self.produced = [0] * rows
        self.finish: list[str | None] = [None] * rows
        self.passes = [0] * rows
        self.seconds = [0.0] * rows
        self.total_passes = 0
        self.total_seconds = 0.0
        self._in_pass: list[int] = []

    def live(self, r: int) -> bool:
        return self.finish[r] is None

    def room(self, r: int) -> int:
        return self.limits[r] - self.produced[r] if self.live(r) else 0

    def commit(self, r: int, tokens: list[int], confs: list[float]) -> RowStep:
        """Record what one pass accepted for row r, cut at its first stop token or its token limit."""
        if not self.live(r):
            return RowStep()
        self.passes[r] += 1
        self._in_pass.append(r)
        tokens, finish = commit_tokens(tokens, self.room(r), self.stop_ids)
        self.produced[r] += len(tokens)
        self.finish[r] = finish
        return RowStep(tuple(tokens), tuple(confs[: len(tokens)]), finish)

    def extend(self, other: RowBook, rows: list[int]) -> int:
        """Take over ``other``'s ``rows`` (a batch that joins this one); returns the first new index."""
        first = len(self.produced)
        for name in self.PER_ROW:
            getattr(self, name).extend(getattr(other, name)[r] for r in rows)
        return first

    def commit_all(self, active: list[int], tokens: list[list[int]], confs: list[list[float]]) -> list[RowStep]:
        """One step per row of the batch: the active rows' accepted tokens, empty steps for the rest."""
        steps = [RowStep()] * len(self.produced)
        for i, r in enumerate(active):
            steps[r] = self.commit(r, tokens[i], confs[i])
        return steps

    def end_pass(self, seconds: float) -> None:
        """Close a pass: it cost ``seconds`` to the batch and to every row that was live in it."""
        self.total_passes += 1
        self.total_seconds += seconds
        for r in self._in_pass:
            self.seconds[r] = self.total_seconds
        self._in_pass = []

    def keep_only(self, rows: list[int]) -> None:
        """Forget every row but ``rows``, which become rows 0, 1, ... in that order (a long-lived server's batch
        whose finished rows would otherwise pile up: TokenBatch.compact). The totals stay."""
        for name in self.PER_ROW:
            values = getattr(self, name)
            setattr(self, name, [values[r] for r in rows])

    def stats(self) -> BatchStats:
        rows = tuple(
            RunStats(self.produced[r], self.passes[r], self.seconds[r], self.finish[r] or "length")
            for r in range(len(self.produced))
        )
        return BatchStats(rows, self.total_passes, self.total_seconds)
