"""The CPU engine's KV cache: per layer a key and a value buffer with room to grow, and one length.

A pass writes its keys and values at the end of every layer's buffers (``open``, then ``write`` or the
native layers' own writes) and attends over views of the first ``end`` columns, so a pass copies only
its own columns, never the cache (a concatenation would copy the whole context every layer of every
pass). Cropping moves ``end`` back: the next pass writes over the cropped columns. Buffers are
reallocated (with room to spare) only when a pass would not fit, and when rows are selected, stacked
or trimmed (a batch's rows leaving, joining, or a hole every row has left).
"""

from __future__ import annotations

import torch

from ..base import KVCache, check_compaction

SLACK = 256  # columns a buffer is allocated beyond what it holds (and at least half as many again)
SCALE_BYTES = 4  # an int8 record's fp32 scale, after its values


def to_records(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` (..., d) as int8 records (..., d + 4): x / scale rounded half to even, scale = max |x| / 127, then
    the scale's bytes; the bits decoder.cpp writes (lanes.h, ``to_record``)."""
    scale = x.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(x / scale), 0.0).clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def from_records(records: torch.Tensor) -> torch.Tensor:
    """int8 records (..., d + 4) as fp32 (..., d): each value times its record's scale."""
    scale = records[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return records[..., :-SCALE_BYTES].to(torch.float32) * scale


def record_width(dim: int, dtype: torch.dtype) -> int:
    """A cache column's last dim for a head of ``dim`` values stored as ``dtype``."""
    return dim + SCALE_BYTES if dtype == torch.int8 else dim


def _with_room(held: torch.Tensor, columns: int) -> torch.Tensor:
    """A new buffer holding ``held`` (rows, heads, n, dim) in its first n columns, with room for ``columns`` in all."""
    size = columns + max(SLACK, columns // 2)
    buffer = held.new_empty((*held.shape[:2], size, held.shape[-1]))
    buffer[:, :, : held.shape[-2]].copy_(held)
    return buffer


class CpuCache(KVCache):
    """``layers`` pairs of buffers (rows, kv heads, room, head dim) holding ``end`` columns each."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        # the tensors the buffers are the first rows of: rows to spare for rows that join (``stack``)
        self.bases: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.end = 0
        self.start = 0  # where the open pass writes
        self.native_memo: dict = {}  # the native layers' arrays of buffer addresses (native_layers.NativeLayers)

    def get_seq_length(self) -> int:
        return self.end

    @property
    def dtype(self) -> torch.dtype | None:
        """What the buffers hold (None before the first pass)."""
        return self.buffers[0][0].dtype if self.buffers else None

    def crop(self, columns: int) -> None:
        if columns > 0:
            self.end = max(self.end - columns, 0)

    def open(self, like: torch.Tensor, columns: int) -> int:
        """Room for ``columns`` more columns in every layer; the cache now holds them (to be written); their start.

        ``like``: (rows, kv heads, any, head dim), the dtype and device of the keys to come.
        """
        start, end = self.end, self.end + columns
        first = self.buffers[0][0] if self.buffers else None
        if (
            first is None or end > first.shape[-2] or first.shape[:2] != like.shape[:2]
            or first.shape[-1] != like.shape[-1] or first.dtype != like.dtype
        ):
            if first is not None and first.shape[:2] != like.shape[:2] and start:
                raise ValueError(f"a pass of {like.shape[0]} rows on a cache of {first.shape[0]} rows")
            if first is None or first.shape[:2] != like.shape[:2]:
                empty = like.new_empty((*like.shape[:2], 0, like.shape[-1]))
                self.buffers = [(_with_room(empty, end), _with_room(empty, end)) for _ in range(self.layers)]
            else:
                kind = like.dtype
                self.buffers = [(_with_room(k[:, :, :start].to(kind), end), _with_room(v[:, :, :start].to(kind), end))
                                for k, v in self.buffers]
            self.bases = self.buffers
        self.start, self.end = start, end
        return start

    def put(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A layer's columns of the open pass, as the buffers hold them (a stored prefix's), put in place."""
        k, v = self.buffers[layer]
        k[:, :, self.start : self.end].copy_(keys)
        v[:, :, self.start : self.end].copy_(values)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put a layer's keys and values of the open pass in place (as int8 records where the buffers hold those);
        the layer's whole cache (views, or fp32 copies of int8 records)."""
        k, v = self.buffers[layer]
        if k.dtype != torch.int8:
            self.put(layer, keys, values)
            return k[:, :, : self.end], v[:, :, : self.end]
        self.put(layer, to_records(keys.float()), to_records(values.float()))
        return from_records(k[:, :, : self.end]), from_records(v[:, :, : self.end])

    def keep_rows(self, index: torch.Tensor) -> None:
        """In place where rows only move into slots already vacated (``moves_in_place``): a leaving row costs the
        copy of at most one row's columns, not of every buffer. Other orders (a row repeated) get new buffers."""
        if not self.buffers:
            return
        order = index.tolist()
        if not moves_in_place(order, self.buffers[0][0].shape[0]):
            self.buffers = self.bases = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.buffers]
            return
        moves = [(to, source) for to, source in enumerate(order) if to != source]
        for k, v in self.buffers:
            for to, source in moves:
                k[to, :, : self.end].copy_(k[source, :, : self.end])
                v[to, :, : self.end].copy_(v[source, :, : self.end])
        self.buffers = [(k[: len(order)], v[: len(order)]) for k, v in self.buffers]

    def stack(self, others: list[KVCache], width: int) -> None:
        """Rows joining a running batch (continuous batching) go into rows its buffers keep spare, where the batch
        is at least as long as they are; otherwise new buffers with rows to spare (none for a first stack)."""
        if not all(isinstance(other, CpuCache) for other in others):
            raise TypeError("a CpuCache stacks only other CpuCaches")
        if self._stack_in_place(others, width):
            return
        parts = [self, *others] if self.buffers else list(others)
        rows = sum(part.buffers[0][0].shape[0] for part in parts)
        spare = max(2, rows // 2) if self.buffers else 0

        def joined(layer: int, i: int) -> torch.Tensor:  # each part copied once, into its rows' place
            first = parts[0].buffers[layer][i]
            base = first.new_empty((rows + spare, first.shape[1], width + max(SLACK, width // 2), first.shape[-1]))
            at = 0
            for part in parts:
                at = _place(base, at, part.buffers[layer][i], part.end, width)
            base[rows:, :, :width].zero_()
            return base

        self.bases = [(joined(layer, 0), joined(layer, 1)) for layer in range(self.layers)]
        self.buffers = [(k[:rows], v[:rows]) for k, v in self.bases]
        self.end = width

    def _stack_in_place(self, others: list[CpuCache], width: int) -> bool:
        if not self.buffers or width != self.end or any(other.dtype != self.dtype for other in others):
            return False
        rows, joining = self.buffers[0][0].shape[0], sum(other.buffers[0][0].shape[0] for other in others)
        if rows + joining > self.bases[0][0].shape[0] or self.bases[0][0].shape[2] != self.buffers[0][0].shape[2]:
            return False
        for layer, pair in enumerate(self.bases):
            for i, base in enumerate(pair):
                at = rows
                for other in others:
                    at = _place(base, at, other.buffers[layer][i], other.end, width)
        self.buffers = [(k[: rows + joining], v[: rows + joining]) for k, v in self.bases]
        return True

    def drop_front(self, columns: int) -> None:
        """Views that start ``columns`` later: nothing is copied until the buffers next need room."""
        if columns > 0:
            self.end -= columns
            rows = self.buffers[0][0].shape[0]
            self.bases = [(k[:, :, columns:], v[:, :, columns:]) for k, v in self.bases]
            self.buffers = [(k[:rows], v[:rows]) for k, v in self.bases]

    def compact(self, start: int, columns: list[int]) -> None:
        """In place: the listed columns are copied down to ``start`` (none where they are there already)."""
        columns = check_compaction(start, columns, self.end)
        if columns != list(range(start, start + len(columns))):
            index = torch.tensor(columns, dtype=torch.long, device=self.buffers[0][0].device)
            for k, v in self.buffers:
                k[:, :, start : start + len(columns)] = k.index_select(2, index)  # a copy first: overlap is safe
                v[:, :, start : start + len(columns)] = v.index_select(2, index)
        self.end = start + len(columns)


def _place(base: torch.Tensor, at: int, theirs: torch.Tensor, end: int, width: int) -> int:
    """``theirs``'s ``end`` columns into rows ``at``... of ``base``, ending at column ``width`` with holes (zeros) on
    their left; the row after them."""
    n, holes = theirs.shape[0], width - end
    base[at : at + n, :, :holes].zero_()
    base[at : at + n, :, holes:width].copy_(theirs[:, :, :end])
    return at + n


def moves_in_place(order: list[int], rows: int) -> bool:
    """Whether keeping rows ``order`` of ``rows`` can copy them in place, slot by slot in order: every row is kept
    once, and none is read after its slot was written."""
    if len(set(order)) != len(order) or any(not 0 <= r < rows for r in order):
        return False
    written = set()
    for to, source in enumerate(order):
        if to != source:
            if source in written:
                return False
            written.add(to)
    return True
