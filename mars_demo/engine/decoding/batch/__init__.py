"""Batch decoding: several prompts per forward pass (docs/METHOD.md, "Batches").

Two schemes, one event type (events.BatchEvent), the same acceptance and cache:
  * "block" (block.py): the paper's block-level KV cache. Blocks of B; the prefix
    cache is fixed while a block fills, fast rows wait at block boundaries, and
    the filled block extends the cache in the next block's first pass.
  * "token" (token.py): every row runs the sliding window of loop.py at its
    own pace, with holes in a rectangular cache instead of waiting.
DEFAULT_SCHEME is the one that was faster on our benchmark (BENCHMARKS.md).
With window 1 (mode "ar") both are plain batched greedy AR decoding.
On the token scheme each pass's width comes from the width controller (decoding/width.py) when the
config's ``max_fed`` is "auto" and the model has a measured cost surface: from plain AR passes where
no mask pays on this machine to the full window where width is free. ``max_fed`` None feeds the
full window as the paper does; an integer caps it. The block scheme always feeds the full window.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from transformers import PreTrainedTokenizerBase

from ...backends.base import Backend
from ...model import LoadedModel
from ..chat import pad_id, prompt_ids
from ..config import VERIFYING_MODES, DecodeConfig
from ..loop import LiveTau, eos_ids
from ..surface import Surface, surface_for
from ..width import WidthController
from .block import block_passes
from .events import BatchEvent, BatchGeneration, BatchStats, RowStep, collect_batch
from .rows import BatchSpec
from .token import token_passes

SCHEMES = {"block": block_passes, "token": token_passes}
DEFAULT_SCHEME = "token"

__all__ = [
    "DEFAULT_SCHEME",
    "SCHEMES",
    "BatchEvent",
    "BatchGeneration",
    "BatchStats",
    "RowStep",
    "collect_batch",
    "decode_batch",
    "generate_batch",
    "stream_batch",
    "stream_batch_ids",
]


def decode_batch(
    backend: Backend, prompts: Sequence[Sequence[int]], config: DecodeConfig, *, scheme: str = DEFAULT_SCHEME,
    block_size: int, mask_id: int, pad_id: int, tau: LiveTau, stop_ids: set[int] = frozenset(), **settings,
) -> Iterator[BatchEvent]:
    """Token space: decode ``prompts`` (token ids) with ``scheme``; ``settings`` as in token_passes (controller)."""
    if scheme not in SCHEMES:
        raise ValueError(f"batch scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if config.tree is not None and config.mode in VERIFYING_MODES:
        raise ValueError("candidate trees (tree) verify one sequence at a time: a batch verifies chains (tree None)")
    spec = BatchSpec(block_size, mask_id, pad_id, tau, frozenset(stop_ids))
    return SCHEMES[scheme](backend, prompts, config, spec, **settings)


def stream_batch(
    backend: Backend,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    config: DecodeConfig,
    *,
    mask_id: int,
    block_size: int,
    scheme: str = DEFAULT_SCHEME,
    tau: LiveTau | None = None,
    surface: Surface | None = None,
) -> Iterator[BatchEvent]:
    """Decode token-id ``prompts`` under ``config``, one BatchEvent per batched forward pass.

    ``surface``: the cost surface the width controller prices passes on ("auto" ``max_fed``, token scheme).
    """
    if config.stop:
        raise ValueError("stop strings are not supported in batch decoding")
    settings: dict = {}
    if config.mode in VERIFYING_MODES and scheme != "token":
        raise ValueError(f"{config.mode} mode runs on the token-level batch scheme only")
    if config.mode == "exact":
        tau = LiveTau(1.0)  # lossless, whatever a live tau says (loop.stream)
    window = 1 if config.mode == "ar" else (config.block_size or block_size)
    if scheme == "token":
        widest = window if config.max_fed in (None, "auto") else min(window, config.max_fed)
        priced = surface if config.max_fed == "auto" else None
        settings["controller"] = WidthController(priced, widest, verifying=config.mode in VERIFYING_MODES)
    return decode_batch(
        backend, prompts, config, scheme=scheme, block_size=window, mask_id=mask_id, pad_id=pad_id(tokenizer),
        tau=tau or LiveTau(config.tau), stop_ids=eos_ids(backend, tokenizer), **settings,
    )


def generate_batch(
    lm: LoadedModel,
    prompts: Sequence[str | list[dict]],
    config: DecodeConfig = DecodeConfig(),
    *,
    scheme: str = DEFAULT_SCHEME,
    tau: LiveTau | None = None,
) -> Iterator[BatchEvent]:
    """Apply the chat template to each prompt and stream their decoding as one batch."""
    if any(isinstance(p, str) and not p.strip() for p in prompts):
        raise ValueError("the prompt is empty")
    return stream_batch_ids(lm, [prompt_ids(lm.tokenizer, p) for p in prompts], config, scheme=scheme, tau=tau)


def stream_batch_ids(
    lm: LoadedModel,
    prompts: Sequence[Sequence[int]],
    config: DecodeConfig = DecodeConfig(),
    *,
    scheme: str = DEFAULT_SCHEME,
    tau: LiveTau | None = None,
) -> Iterator[BatchEvent]:
    """Stream the batch decoding of token-id ``prompts`` (chat template applied) with a loaded model."""
    priced = scheme == "token" and config.mode != "ar" and config.max_fed == "auto"
    return stream_batch(
        lm.backend, lm.tokenizer, prompts, config, mask_id=lm.meta.mask_token_id,
        block_size=lm.meta.block_size, scheme=scheme, tau=tau, surface=surface_for(lm) if priced else None,
    )
