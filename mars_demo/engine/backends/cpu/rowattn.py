"""Row-exact attention as one native call per layer: every row of a short pass attends alone, cheaply.

Exact mode, MARS at tau = 1.0 and batch rows equal one-token AR only if a row's output does not
depend on the rows fed beside it. SDPA's does (its blocking follows the rows and keys of the call),
so ``attention.row_exact_attention`` used to call SDPA once per row and layer, which was most of
what a wider pass cost over a one-token pass. ``csrc/row_attention.cpp`` does all the rows of a
layer in one call, each row over its own visible keys in an order fixed by those keys alone (module
comment there; figures in docs/bench/history.md, "Native row-exact attention").

The kernel is built on first use (native.py). Without a compiler, or with
``MARS_DEMO_ROWATTN=0``, ``kernel()`` is None and the attention goes row by row through SDPA as
before.
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np
import torch

from . import native

ROWATTN_ENV = "MARS_DEMO_ROWATTN"  # "0": SDPA row by row (for comparisons, or where the kernel misbehaves)
# A call takes one more thread (up to torch's count) per this many visible (row, key, head) triples.
# The threads are torch's OpenMP team, awake between a pass's GEMMs, so splitting costs little: at
# context 200 and 1000 a threshold of 1,000 was as fast as 5,000 and faster than 20,000 (BENCHMARKS.md).
THREADED_WORK = 1_000
_I, _P = ctypes.c_int64, ctypes.c_void_p


@cache
def kernel():
    """The native row attention (a ctypes function), or None: switched off, no compiler, or the build failed."""
    tensors, sizes, visible = [_P, _I, _I, _I] * 3 + [_P], [_I] * 6, [_P, _P]
    return native.function("row_attention", ROWATTN_ENV, tensors + sizes + visible + [ctypes.c_float, _I])


@cache
def ranges_kernel(name: str):
    """A native ``Visible`` builder (a ctypes function, in the attention's library), or None: the numpy steps.

    "padding_ranges": from a 2-D padding mask (``Visible.padded``); "mask_ranges": from a full mask.
    """
    return native.function(name, ROWATTN_ENV, [_P, _I, _I, _I, _P, _P, _P, _P])


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel can run these tensors: fp32 on the CPU, key heads dividing query heads."""
    return (
        query.device.type == "cpu" and query.dtype == key.dtype == value.dtype == torch.float32
        and query.shape[1] % key.shape[1] == 0 and key.shape[1] == value.shape[1]
        and key.shape[-1] == value.shape[-1] == query.shape[-1]
    )


def allowed_keys(attention_mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """(batch, q, kv) bool: the keys each row may see, from a boolean or an additive 4-D mask."""
    mask = attention_mask[:, 0, :, :kv_len]  # a static cache's mask may run past the keys held
    allowed = mask if mask.dtype == torch.bool else mask == 0
    return allowed.expand(batch, q_len, kv_len)


class Visible:
    """The keys each row of a masked pass may see, as [start, end) ranges (batch padding, exact mode's groups).

    ranges: (N, 2) int64; offsets: (batch * rows + 1,) int64, row r owning ranges[offsets[r]:offsets[r + 1]].
    live: the rows (b * rows + i, ascending) that may see their own column, i.e. are fed a token, as int64;
    None when every row is. The others are holes: no row sees them, what they compute is not read, and they see
    no keys (no attention work for them).
    """

    def __init__(
        self, attention_mask: torch.Tensor | None, batch: int = 0, q_len: int = 0, kv_len: int = 0, *,
        allowed: torch.Tensor | None = None,
    ) -> None:
        """From a 4-D mask (see ``allowed_keys``), or from ``allowed`` (batch, q, kv) bool itself."""
        if allowed is None:
            allowed = allowed_keys(attention_mask, batch, q_len, kv_len)
        batch, q_len, keys = allowed.shape
        function = ranges_kernel("mask_ranges")
        if function is not None and allowed.dtype == torch.bool and allowed.device.type == "cpu":
            self._fill_natively(function, allowed.contiguous(), batch, keys, q_len)
            return
        # numpy: a pass's mask is small, and a dozen torch ops on it cost more than the attention they steer
        row, start, end = _runs(allowed.reshape(batch * q_len, keys).cpu().numpy())
        own = allowed.cpu().numpy()[:, np.arange(q_len), np.arange(keys - q_len, keys)].reshape(-1)
        self._set(row, start, end, batch * q_len, own)

    def _set(self, row: np.ndarray, start: np.ndarray, end: np.ndarray, rows: int, own: np.ndarray) -> None:
        """ranges, offsets, work and live from the visible runs (row, [start, end)) in row order and from whether each
        of the ``rows`` rows sees its own column (``own``); a row that does not (a hole) is given none."""
        fed = own[row]
        row, start, end = row[fed], start[fed], end[fed]
        self.ranges = torch.from_numpy(np.stack([start, end], axis=1).astype(np.int64))
        offsets = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(np.bincount(row, minlength=rows), out=offsets[1:])
        self.offsets = torch.from_numpy(offsets)
        self.work = int((end - start).sum())  # visible (row, key) pairs
        self.live = None if own.all() else torch.from_numpy(np.flatnonzero(own).astype(np.int64))

    @classmethod
    def padded(cls, padding: torch.Tensor, q_len: int) -> Visible:
        """A causal pass of ``q_len`` rows under a 2-D mask ``padding`` (batch, keys; 1 = attend, 0 = a hole) that
        covers the cache and the pass: what transformers' 4-D mask says, without building it.

        Built from each sequence's runs of attended keys, found once, then cut at each row's own column (row i of
        the pass sees keys up to keys - q_len + i): a batch's every pass does this, so it is one native call where
        the kernel builds (``_fill_natively``), else a few numpy ops.
        """
        function = ranges_kernel("padding_ranges")
        if function is not None and padding.dtype == torch.int64 and padding.device.type == "cpu":
            visible = cls.__new__(cls)
            visible._fill_natively(function, padding.contiguous(), padding.shape[0], padding.shape[1], q_len)
            return visible
        pad = padding.bool().cpu().numpy()
        batch, keys = pad.shape
        row, start, end = _runs(pad)
        if q_len > 1:  # each run once for each row of its sequence, in row order, cut at the row's own column
            row = np.repeat(row * q_len, q_len) + np.tile(np.arange(q_len), len(start))
            order = np.argsort(row, kind="stable")
            row, start, end = row[order], np.repeat(start, q_len)[order], np.repeat(end, q_len)[order]
            end = np.minimum(end, keys - q_len + row % q_len + 1)
            kept = start < end
            row, start, end = row[kept], start[kept], end[kept]
        visible = cls.__new__(cls)
        visible._set(row, start, end, batch * q_len, pad[:, keys - q_len :].reshape(-1))
        return visible

    def _fill_natively(self, function, source: torch.Tensor, batch: int, keys: int, q_len: int) -> None:
        """ranges, offsets, work and live in one native call (csrc/row_attention.cpp: ``padding_ranges`` from a 2-D
        padding mask, ``mask_ranges`` from a full one): what the numpy steps give, without the dozen array ops that
        follow a pass, and its cold caches, otherwise (~0.1 ms of a 4-5 ms batch pass on a 2-core CPU)."""
        rows = batch * q_len
        ranges = torch.empty(rows * ((keys + 1) // 2), 2, dtype=torch.int64)
        offsets, live = torch.empty(rows + 1, dtype=torch.int64), torch.empty(rows, dtype=torch.int64)
        counts = (_I * 2)()
        n = function(source.data_ptr(), batch, keys, q_len, ranges.data_ptr(), offsets.data_ptr(), live.data_ptr(),
                     counts)
        self.ranges, self.offsets, self.work = ranges[:n], offsets, counts[1]
        self.live = None if counts[0] == rows else live[: counts[0]]


def _runs(allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of True in each row of ``allowed`` (rows, keys) bool: (row, start, end) arrays in row order."""
    flat = np.zeros((allowed.shape[0], allowed.shape[1] + 2), dtype=np.int8)
    flat[:, 1:-1] = allowed
    edges = np.diff(flat, axis=1)  # +1 where a run starts, -1 after it ends
    row, start = np.nonzero(edges == 1)  # row-major: starts and ends pair up in order
    _, end = np.nonzero(edges == -1)
    return row, start, end


def threads(visible: Visible | None, batch: int, rows: int, keys: int, heads: int) -> int:
    """How many of torch's threads a call takes: one more per THREADED_WORK visible (row, key, head) triples.

    visible None: causal over a cache of ``keys`` (this pass's rows included).
    """
    work = visible.work if visible is not None else batch * (rows * (keys - rows) + rows * (rows + 1) // 2)
    most = torch.get_num_threads()
    return max(1, min(most, 1 + work * heads // THREADED_WORK if THREADED_WORK else most))


def attend(
    function, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
    visible: Visible | None = None,
) -> torch.Tensor:
    """Attention of ``query`` (batch, heads, rows, dim) over ``key``/``value`` (batch, kv heads, keys, dim).

    visible None: causal over a cache, row i sees keys[: keys - rows + i + 1]. Returns (batch, rows, heads, dim).
    """
    batch, heads, rows, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out = query.new_empty(batch, rows, heads, dim)
    failed = function(
        query.data_ptr(), *query.stride()[:3], key.data_ptr(), *key.stride()[:3], value.data_ptr(),
        *value.stride()[:3], out.data_ptr(), batch, heads, kv_heads, rows, keys, dim,
        None if visible is None else visible.ranges.data_ptr(), None if visible is None else visible.offsets.data_ptr(),
        dim**-0.5 if scale is None else scale, threads(visible, batch, rows, keys, heads),
    )
    if failed:
        raise MemoryError("row-exact attention: out of memory for its score buffer")
    return out
