"""Shared prompt prefixes: a prefill starts from the keys and values of a prefix it shares with earlier prompts.

Chat prompts open alike: the bundled model's template puts the same 24-token system turn before every
question, a third of a short prompt. A prefill on a fresh cache (one row, plain causal, positions from 0)
looks for the longest prefix it shares with a stored one, copies that prefix's keys and values into its
cache and feeds only the rest. After such a prefill the prefix it shares with the previous one (at least
``MIN_SHARED`` tokens) is stored, so a prefix is kept once two prompts have shown it; and only where both
prompts go on for ``MIN_SHARED`` tokens past it: two methods decoding one prompt (the app's race, a
``bench`` turn; a MARS prefill is its prompt with masks after it) never store that prompt for each other,
so the one that runs second gets no cheaper prefill than the first. A batch's first pass starts all its rows
from a stored prefix they all share (``CpuBackend.fill_prefix``, decoding/batch/rows.py): the prefix's
columns once, then each row's padding and the rest of its prompt, in one pass.

Only on the engine's row-exact paths (backend.py: a row's keys and values do not depend on the rows fed
beside it): there the shortened prefill gives the cache and logits the whole one gives, bit for bit, so
every decoder and every baseline on this backend gets the same saving and the same text. llama.cpp's
Python binding reuses the previous prompt's common prefix the same way.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from .cache import CpuCache

MIN_SHARED = 8  # tokens: shorter shared prefixes save less than their lookup and copies
MAX_STORED = 512  # tokens kept of one prefix (the bundled model: 12 MB of fp16 keys and values at most)
ENTRIES = 4  # prefixes kept, least recently used dropped first


def shared_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens the 1-D id tensors ``a`` and ``b`` share."""
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


class PrefixStore:
    """Keys and values of recent prompt prefixes, by their token ids (module docstring)."""

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple[int, ...], tuple[torch.Tensor, list]] = OrderedDict()
        self.last: torch.Tensor | None = None  # the ids of the last prefill fed from scratch
        self.reused_tokens = 0  # tokens not fed thanks to a stored prefix, over this store's life
        self.lock = threading.Lock()  # the app's lanes share a backend

    def fill(self, rows: Sequence[torch.Tensor], cache: CpuCache, keep: int) -> int:
        """Copy the longest stored prefix that every one of ``rows`` (1-D token ids: a prefill's rows, without
        their padding) starts with into the empty ``cache``, leaving at least ``keep`` (>= 1) tokens of each to
        feed; how many tokens each row holds now (0: none stored, the prefill feeds them all)."""
        with self.lock:
            best, use = None, 0
            for key, entry in self.entries.items():
                shared = min(min(shared_length(entry[0], row), row.numel() - keep) for row in rows)
                if shared > use:
                    best, use = key, shared
            if use < MIN_SHARED:
                return 0
            self.entries.move_to_end(best)
            layers = self.entries[best][1]
            self.reused_tokens += use * len(rows)
        n = len(rows)
        cache.open(layers[0][0].expand(n, -1, -1, -1), use)
        for layer, (keys, values) in enumerate(layers):
            cache.put(layer, keys[:, :, :use].expand(n, -1, -1, -1), values[:, :, :use].expand(n, -1, -1, -1))
        return use

    def learn(self, ids: torch.Tensor, cache: CpuCache) -> None:
        """After a prefill of ``ids`` (1, n) fed from scratch into ``cache``: store the prefix it shares with
        the previous such prefill, unless a stored one covers it."""
        row = ids[0]
        with self.lock:
            last, self.last = self.last, row.clone()
            shared = 0 if last is None else shared_length(last, row)
            if shared < MIN_SHARED or shared + MIN_SHARED > min(last.numel(), row.numel()):
                return  # nothing shared, or one prompt (nearly) all of the other: the same prompt (docstring)
            shared = min(shared, MAX_STORED)
            if any(shared_length(e[0], row) >= shared for e in self.entries.values()):
                return
            layers = [(k[:, :, :shared].clone(), v[:, :, :shared].clone()) for k, v in cache.buffers]
            self.entries[tuple(row[:shared].tolist())] = (row[:shared].clone(), layers)
            while len(self.entries) > ENTRIES:
                self.entries.popitem(last=False)
