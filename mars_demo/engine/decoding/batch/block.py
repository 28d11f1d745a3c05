"""Block-level batch decoding, the paper's scheme (docs/METHOD.md, "Batches").

Blocks of B output tokens sit at the same columns in every row (left padding). While a block
fills, the prefix cache stays fixed: each pass re-feeds the block (accepted tokens, then masks)
and every row accepts its confident prefix, never past the block's end; fast rows wait at the
boundary. The cache is extended with the filled block in the next block's first pass
([filled block | B-1 masks]): exact, as attention is causal, and one pass fewer per block.
At tau = 1.0 no pass feeds masks: while the rows are level, "extend" passes keep each row's
newest token in the cache. Each row equals the block-capped sliding window decoded alone
(tests/batch_reference.py's reference_block_decode), token for token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from ...backends.base import Backend
from ...backends.placement import SeededGenerator
from ..acceptance import accept_rows
from ..config import DecodeConfig
from .events import BatchEvent
from .rows import BatchSpec, PaddedCache, RowBook, Window, left_pad, limit_new_tokens


def open_block(
    ext: list[list[int]], ext_attn: list[list[int]], first_pos: list[int], rooms: list[int], masks: int, mask_id: int
) -> Window:
    """[filled block (or prompt) | masks]: candidates from its last token and the masks, up to masks + 1 per row."""
    return Window(
        ids=[row + [mask_id] * masks for row in ext], attn=[row + [1] * masks for row in ext_attn],
        first_pos=first_pos, keep=masks + 1, start=[0] * len(ext), cap=[min(masks + 1, room) for room in rooms],
        drop=masks,
    )


def refill_block(
    blocks: list[list[int]], cached: int, first_pos: list[int], rooms: list[int], B: int, mask_id: int
) -> Window:
    """The block's slots ``cached``..B-2, accepted tokens then masks.

    A row's candidates start at its last accepted token. A row that has filled the block re-feeds it and may accept
    nothing: it waits.
    """
    slots = B - 1 - cached
    return Window(
        ids=[(b[cached:] + [mask_id] * B)[:slots] for b in blocks], attn=[[1] * slots for _ in blocks],
        first_pos=first_pos, keep=slots, start=[len(b) - 1 - cached for b in blocks],
        cap=[min(B - len(b), room) for b, room in zip(blocks, rooms)], drop=slots,
    )


def extend_block(blocks: list[list[int]], first_pos: list[int], rooms: list[int]) -> Window:
    """tau = 1.0, every row level: each row's newest token, which stays in the cache; candidate 1 only."""
    return Window(
        ids=[b[-1:] for b in blocks], attn=[[1] for _ in blocks], first_pos=first_pos, keep=1,
        start=[0] * len(blocks), cap=[min(1, room) for room in rooms], drop=0,
    )


@torch.inference_mode()
def block_passes(
    backend: Backend,
    prompts: Sequence[Sequence[int]],
    config: DecodeConfig,
    spec: BatchSpec,
) -> Iterator[BatchEvent]:
    """Decode token-id ``prompts`` together under ``config``, block by block; one BatchEvent per forward pass."""
    B, R, metric, temperature = spec.block_size, len(prompts), config.metric, config.temperature
    mask_id, tau = spec.mask_id, spec.tau
    max_new_tokens = limit_new_tokens(backend, prompts, config.max_new_tokens, 2 * B)
    ext, ext_attn = left_pad(prompts, spec.pad_id)  # (R, W): what the next block-start pass adds to the cache
    offset = [len(ext[0]) - len(p) for p in prompts]  # left padding: position id = column - offset
    generator = SeededGenerator(config.seed)  # on the logits' device (placement.py)
    book = RowBook(R, max_new_tokens, set(spec.stop_ids))
    kv = PaddedCache(backend, R)
    active = list(range(R))  # rows still decoding, in cache order
    block: list[list[int]] = [[] for _ in range(R)]  # the block being filled, per row
    cached = 0  # how many of the block's tokens the cache holds (extend passes, tau = 1.0)
    kind, index = "prefill", 0
    while True:
        tau_now = tau.get()
        masks = 0 if tau_now >= 1.0 else B - 1  # at tau = 1.0 only candidate 1 can pass
        started = time.perf_counter()
        first_pos, rooms = [kv.length - offset[r] for r in active], [book.room(r) for r in active]
        blocks = [block[r] for r in active]
        if kind == "refill" and not masks and all(len(b) == cached + 1 for b in blocks):
            kind, window = "extend", extend_block(blocks, first_pos, rooms)
        elif kind == "refill":
            window = refill_block(blocks, cached, first_pos, rooms, B, mask_id)
        else:
            window = open_block(ext, ext_attn, first_pos, rooms, masks, mask_id)
        logits = kv.forward(window)  # (A, keep, vocab)
        kv.crop(window.drop)  # masks or re-fed slots: the prefix stays fixed while the block fills
        cached += kind == "extend"  # an extend pass's token stays in the cache
        tokens, confs = accept_rows(
            logits, window.start, window.cap, tau_now, metric, temperature, generator.on(logits.device),
            config.top_p, config.top_k,
        )
        steps = book.commit_all(active, tokens, confs)
        for r in active:
            block[r] += steps[r].token_ids
        active = kv.drop_finished(book, active)
        seconds = time.perf_counter() - started
        book.end_pass(seconds)
        stats = book.stats() if not active else None
        yield BatchEvent(index, tuple(steps), tau_now, seconds, kind, window.width, stats)
        if stats:
            return
        index += 1
        kind = "block-start" if all(len(block[r]) == B for r in active) else "refill"
        if kind == "block-start":  # every live row has filled the block: the next pass extends the cache with it
            ext, ext_attn = [block[r][cached:] for r in active], [[1] * (B - cached) for _ in active]
            block, cached = [[] for _ in range(R)], 0
