"""What the decoders use of a model: one forward pass, a KV cache, and what a pass costs.

The decoding method (engine/decoding) and serving (engine/serving) reach a model only through a
``Backend``; nothing else of the model object. One implementation per backend:

- ``backends.hf.TransformersBackend``: a transformers model as it is (any architecture, any device,
  the fp32 reference, accelerate's dispatched models, the optional compiled passes);
- ``backends.cpu.CpuBackend``: the CPU engine's own model code (llama and qwen2 families) over the
  model's weights on a compute path (fp32, bf16, int8, int8dyn), with its native layers and its cache.

A pass takes token ids (rows, n), optional position ids (rows, n), a cache, and an attention mask:
None (each row sees the cache and the rows up to it), a 2-D (rows, cached + n) mask of 1 (attend)
and 0 (padding or a hole), or a prepared 4-D mask (rows, 1, n, cached + n): additive floats (0 or
the dtype's minimum) or booleans. It returns the logits of the last ``keep`` columns (rows, keep,
vocab) and leaves the pass's keys and values in the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from transformers import PreTrainedModel


def left_holes(t: torch.Tensor, width: int) -> torch.Tensor:
    """Keys or values (rows, heads, columns, dim) padded to ``width`` columns with zeros on the left (holes)."""
    missing = width - t.shape[-2]
    if missing <= 0:
        return t
    return torch.cat([t.new_zeros((*t.shape[:-2], missing, t.shape[-1])), t], dim=-2)


class KVCache(ABC):
    """The keys and values of every column a backend has been fed, all rows the same number of columns."""

    @abstractmethod
    def get_seq_length(self) -> int:
        """How many columns the cache holds."""

    @abstractmethod
    def crop(self, columns: int) -> None:
        """Drop the last ``columns`` columns (masks, rejected drafts): the next pass writes over them."""

    @abstractmethod
    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows ``index`` (a long tensor), in that order."""

    @abstractmethod
    def stack(self, others: list[KVCache], width: int) -> None:
        """Append the rows of ``others`` below ours, in order, all padded on the left to ``width`` columns (zeros:
        holes); an empty cache takes theirs."""

    @abstractmethod
    def drop_front(self, columns: int) -> None:
        """Drop the first ``columns`` columns of every row (holes every row has left behind)."""

    @abstractmethod
    def compact(self, start: int, columns: list[int]) -> None:
        """Keep the first ``start`` columns, then the listed absolute ``columns`` (increasing, each >= start) moved
        to start, start + 1, ...; drop every other column. A candidate tree's kept path (decoding/tree.py)."""


class Backend(ABC):
    """One model, as the decoders see it (module docstring).

    ``model`` stays reachable for what is not decoding: ``transformers.generate`` in ``bench``, scoring,
    saving. ``compute`` is the measured CPU compute path (its pass-cost curve), None where nothing was
    measured.
    """

    model: PreTrainedModel
    compute = None
    # Whether a padded column costs a pass as much as a real one (a CPU's compute-bound prefill): a batch's
    # first pass then feeds its rows one by one, without their left padding (decoding/batch/rows.py).
    padding_costs = False
    # Whether a prepared 4-D mask may be given as booleans (True = attend): the batch decoders then skip
    # building additive floats that the backend would only read back (transformers' eager attention adds them).
    bool_masks = False

    @property
    def config(self):
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        """Where a pass's inputs go."""
        return self.model.device

    @abstractmethod
    def new_cache(self, length: int | None = None) -> KVCache:
        """An empty cache; ``length``: the most columns it will hold (a static cache's size), if known."""

    @abstractmethod
    def forward(
        self, ids: torch.Tensor, cache: KVCache | None, *, positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None, keep: int = 1, steady: bool = False,
    ) -> torch.Tensor:
        """One pass (module docstring): logits (rows, keep, vocab). ``cache`` None: no cache, nothing kept.

        ``steady``: a decode pass after the prefill (a compiled backend runs those compiled).
        """

    def fill_prefix(self, rows: list[torch.Tensor], cache: KVCache, keep: int) -> int:
        """Put the keys and values of a stored prefix that all of ``rows`` (1-D token ids, positions from 0) start
        with into the empty ``cache`` (one cache row each), leaving at least ``keep`` tokens of each row to feed;
        its length (0: nothing stored, or no store: the default)."""
        return 0

    def costs_ms(self) -> dict[int, float] | None:
        """The measured pass-cost curve (ms by tokens fed), None where nothing was measured."""
        return getattr(self.compute, "costs_ms", None)


def check_compaction(start: int, columns: list[int], end: int) -> list[int]:
    """KVCache.compact's columns, checked: increasing, each at or after ``start`` and before ``end``."""
    columns = [int(c) for c in columns]
    if not 0 <= start <= end or any(not start <= c < end for c in columns) or columns != sorted(set(columns)):
        raise ValueError(f"compact: columns must increase within [{start}, {end}), got {columns}")
    return columns
