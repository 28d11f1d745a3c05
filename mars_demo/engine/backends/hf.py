"""The transformers backend: a model's own forward, as transformers defines it (base.py's interface).

Any architecture, any device, accelerate's dispatched models (placement.py), the fp32 reference.
Its cache is transformers' ``DynamicCache``, or a ``StaticCache`` where the decode passes run
compiled (``compiled``: ``bench --compile``).

Compiled passes: a MARS pass writes its masks' keys and values into the cache and must drop them
afterwards. A dynamic cache crops them; a static one moves its write position back: the masks'
entries stay in memory, the next pass overwrites them from that position on, and any left beyond its
window sit at positions later than every query, which the causal mask hides. So the static cache
feeds the model exactly what the dynamic one does. The prefill and verifying passes (4-D masks,
drafts) stay eager, on a dynamic cache. Compiled graphs are per pass width and cache length, so the
static cache's length is rounded up to ``STATIC_CACHE_STEP``: prompts of different lengths share graphs.
A width that a run meets only now and then (every mask accepted) would compile in the middle of it, so a
caller that times the passes compiles every steady shape first (``TransformersBackend.warm``).

Attention on a GPU: torch's SDPA may pick cuDNN's kernel, which builds a graph for every new shape of
its inputs. Decode passes change shape every pass (the cache grows; widths and rows vary), so each pass
would wait for a build that takes longer than the pass's own work. A backend on a GPU therefore switches
cuDNN's SDPA off for its process (``leave_out_cudnn_attention``: torch's switch is process-wide, so it is set
once, not around each pass, where threads decoding side by side would undo each other's); every other kernel
stays as torch chooses (BENCHMARKS.md, "GPU").
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache

from .base import Backend, KVCache, check_compaction, left_holes
from .placement import input_device

STATIC_CACHE_STEP = 256  # a static cache's length is a multiple of this (one graph for many prompt lengths)
RECOMPILE_LIMIT = 64  # graphs dynamo keeps for the forward: pass widths x cache lengths (its default, 8, is too few)


class HFCache(KVCache):
    """transformers' cache (``inner``) behind base.KVCache."""

    def __init__(self, inner: DynamicCache | StaticCache) -> None:
        self.inner = inner

    def get_seq_length(self) -> int:
        return self.inner.get_seq_length()

    def crop(self, columns: int) -> None:
        if columns <= 0:
            return
        if isinstance(self.inner, StaticCache):
            for layer in self.inner.layers:
                if layer.is_initialized:
                    layer.cumulative_length.sub_(columns)  # in place: the compiled graph reads this tensor's address
        else:
            self.inner.crop(-columns)

    def keep_rows(self, index: torch.Tensor) -> None:
        self.inner.batch_select_indices(index)

    def _layers(self) -> list:
        layers = self.inner.layers
        if isinstance(self.inner, StaticCache) or any(getattr(layer, "is_sliding", False) for layer in layers):
            raise ValueError("continuous batching needs a dynamic full-attention cache (no sliding-window layers)")
        return layers

    def stack(self, others: list[KVCache], width: int) -> None:
        layers = [other._layers() for other in others]
        for i, mine in enumerate(self._layers()):
            parts = ([mine] if mine.is_initialized else []) + [theirs[i] for theirs in layers]
            keys = torch.cat([left_holes(part.keys, width) for part in parts], dim=0)
            values = torch.cat([left_holes(part.values, width) for part in parts], dim=0)
            if not mine.is_initialized:
                mine.lazy_initialization(keys, values)
            mine.keys, mine.values = keys, values

    def drop_front(self, columns: int) -> None:
        if columns > 0:
            for layer in self._layers():
                layer.keys, layer.values = layer.keys[:, :, columns:], layer.values[:, :, columns:]

    def compact(self, start: int, columns: list[int]) -> None:
        """A dynamic cache's layers (each on its own device) rebuilt from their first ``start`` columns and the kept."""
        columns = check_compaction(start, columns, self.get_seq_length())
        for layer in self._layers():
            index = torch.tensor(columns, dtype=torch.long, device=layer.keys.device)
            layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys.index_select(2, index)], dim=2)
            layer.values = torch.cat([layer.values[:, :, :start], layer.values.index_select(2, index)], dim=2)


class TransformersBackend(Backend):
    """``model``'s own forward; ``compiled``: a compiled forward for the steady decode passes (module docstring).
    On a GPU it switches cuDNN's attention off for the process (module docstring)."""

    def __init__(self, model: PreTrainedModel, compute=None, compiled=None) -> None:
        self.model, self.compute, self.compiled = model, compute, compiled
        leave_out_cudnn_attention(input_device(model))

    @property
    def device(self) -> torch.device:
        return input_device(self.model)

    def new_cache(self, length: int | None = None) -> HFCache:
        if self.compiled is not None and length is not None:
            length = -(-length // STATIC_CACHE_STEP) * STATIC_CACHE_STEP
            return HFCache(StaticCache(config=self.model.config, max_cache_len=length))
        return HFCache(DynamicCache(config=self.model.config))

    def forward(self, ids, cache, *, positions=None, mask=None, keep=1, steady=False):
        static = cache is not None and isinstance(cache.inner, StaticCache)
        call = self.compiled if steady and static else self.model
        out = call(
            input_ids=ids, attention_mask=mask, position_ids=positions,
            past_key_values=None if cache is None else cache.inner, use_cache=cache is not None, logits_to_keep=keep,
        )
        return out.logits

    @torch.inference_mode()
    def warm(self, shapes: set[tuple[int, int]], length: int = STATIC_CACHE_STEP) -> int:
        """Run a steady pass of every (tokens fed, logits kept) in ``shapes`` on a throwaway static cache of
        ``length``, so that each compiles now and not in the middle of a timed run; the passes run (0 where
        nothing is compiled)."""
        if self.compiled is None:
            return 0
        device = input_device(self.model)
        for fed, keep in sorted(shapes):
            cache = self.new_cache(length)
            self.forward(torch.zeros((1, 1), dtype=torch.long, device=device), cache)  # a prefill: eager
            self.forward(torch.zeros((1, fed), dtype=torch.long, device=device), cache, keep=keep, steady=True)
        return len(shapes)


def leave_out_cudnn_attention(device: torch.device) -> None:
    """Where ``device`` is a GPU, SDPA without cuDNN's kernel from now on in this process (module docstring)."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def compile_passes(model: PreTrainedModel, *, backend: str = "inductor", mode: str | None = None, compute=None):
    """A TransformersBackend whose steady passes run ``torch.compile``d; ``mode="reduce-overhead"`` adds CUDA graphs."""
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    compiled = torch.compile(model.forward, backend=backend, mode=mode, dynamic=False)
    return TransformersBackend(model, compute, compiled)
