"""Optional static KV cache + ``torch.compile`` for the decode passes (``bench`` / ``generate --compile``).

Off by default. ``enable_compiled_decoding(model)`` compiles the model's forward once;
MARS and AR runs on that model then keep their KV cache in a ``StaticCache`` (fixed
shapes, fixed addresses: what CUDA graphs need) and run every pass after the prefill
through the compiled forward. The prefill stays eager (its width is the prompt's).

A MARS pass writes its masks' keys and values into the cache and must drop them
afterwards. A dynamic cache crops them; a static one moves its write position back
(``rewind``): the masks' entries stay in memory, but the next pass overwrites them from
that position on, and any left beyond its window sit at positions later than every
query, which the causal mask hides. So the static path feeds the model exactly what the
dynamic one does. Exact and hybrid modes (4-D masks, drafts) stay on the dynamic path.

Compiled graphs are per pass width: a MARS run uses the full window (and 1 at tau = 1.0),
an AR run width 1; a width cap (``max_fed``) adds one graph per capped width.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache

from .cpu import lean

COMPILED = "mars_compiled"  # the model attribute holding the compiled forward


def enable_compiled_decoding(model: PreTrainedModel, *, backend: str = "inductor", mode: str | None = None) -> None:
    """Compile ``model.forward`` for the decode passes; ``mode="reduce-overhead"`` adds CUDA graphs."""
    setattr(model, COMPILED, torch.compile(model.forward, backend=backend, mode=mode, dynamic=False))


def compiled_forward(model: PreTrainedModel):
    """The compiled forward set by ``enable_compiled_decoding``, else None."""
    return getattr(model, COMPILED, None)


def new_cache(model: PreTrainedModel, length: int) -> DynamicCache | StaticCache:
    """A static cache of ``length`` positions when the model is compiled for decoding, else a dynamic one
    (lean.new_cache: a LeanCache on the native layers)."""
    if compiled_forward(model) is None:
        return lean.new_cache(model)
    return StaticCache(config=model.config, max_cache_len=length)


def rewind(cache: DynamicCache | StaticCache, tokens: int) -> None:
    """Drop the last ``tokens`` entries: crop a dynamic cache, move a static one's write position back."""
    if tokens <= 0:
        return
    if isinstance(cache, StaticCache):
        for layer in cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.sub_(tokens)  # in place: the compiled graph reads this tensor's address
    else:
        cache.crop(-tokens)
