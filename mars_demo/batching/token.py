"""Token-level batch decoding: every row runs the sliding window of decoding.py on its own.

Each pass feeds, per row, [holes | tokens it accepted last pass | B-1 masks], right
aligned so that the masks are the last B-1 columns of every row; the masks are
cropped off after the pass, as in the single-sequence decoder. Rows advance
independently: a row that accepted fewer tokens than the longest pads its part
of the window on the left with holes (attention mask 0), and its position ids
count only its own real tokens. So the cache stays rectangular, no row waits at a
block boundary, and each row sees exactly the context it would see alone.
A finished row leaves the batch (its cache row is dropped) and stays finished.

Single-row semantics, which each row of a batch reproduces token for token:
decoding.decode_passes (reference.reference_decode without a cache).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedModel

from ..decoding import LiveTau
from .events import BatchEvent
from .rows import PaddedCache, RowBook, Window, accept_rows, left_pad, limit_new_tokens


def slide(pending: list[list[int]], next_pos: list[int], rooms: list[int], B: int, mask_id: int, pad_id: int) -> Window:
    """[holes | tokens accepted last pass | B-1 masks] per row: candidates from its last real token and the masks."""
    real, real_attn = left_pad(pending, pad_id)  # (A, n), holes on the left
    n = len(real[0])
    return Window(
        ids=[row + [mask_id] * (B - 1) for row in real], attn=[row + [1] * (B - 1) for row in real_attn],
        first_pos=[pos - (n - len(p)) for pos, p in zip(next_pos, pending)],
        keep=B, start=[0] * len(pending), cap=[min(B, room) for room in rooms], drop=B - 1,
    )


@torch.inference_mode()
def token_passes(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    block_size: int,
    mask_id: int,
    pad_id: int,
    tau: LiveTau,
    metric: str = "probability",
    temperature: float = 0.0,
    max_new_tokens: int = 256,
    stop_ids: set[int] = frozenset(),
    seed: int | None = None,
) -> Iterator[BatchEvent]:
    """Decode token-id ``prompts`` together, each row at its own pace; one BatchEvent per forward pass."""
    B, R = block_size, len(prompts)
    max_new_tokens = limit_new_tokens(model, prompts, max_new_tokens, B)
    generator = torch.Generator(device=model.device).manual_seed(seed) if seed is not None else None
    book = RowBook(R, max_new_tokens, set(stop_ids))
    kv = PaddedCache(model, R)
    active = list(range(R))  # rows still decoding, in cache order
    pending = [list(p) for p in prompts]  # fed next pass: the prompt first, then the tokens accepted last pass
    next_pos = [0] * R  # position id of each row's next real token
    index = 0
    while True:
        tau_now = tau.get()
        width = 1 if tau_now >= 1.0 else B  # at tau = 1.0 only candidate 1 can pass: no masks
        started = time.perf_counter()
        window = slide([pending[r] for r in active], [next_pos[r] for r in active], [book.room(r) for r in active], width, mask_id, pad_id)
        logits = kv.forward(window)  # (A, width, vocab): each row's last real token and its masks
        kv.crop(window.drop)  # the masks; the accepted tokens are fed next pass
        tokens, confs = accept_rows(logits, window.start, window.cap, tau_now, metric, temperature, generator)
        steps = book.commit_all(active, tokens, confs)
        for r in active:
            next_pos[r] += len(pending[r])
            pending[r] = list(steps[r].token_ids)
        active = kv.drop_finished(book, active)
        seconds = time.perf_counter() - started
        book.end_pass(seconds)
        stats = book.stats() if not active else None
        yield BatchEvent(index, tuple(steps), tau_now, seconds, "prefill" if index == 0 else "window", window.width, stats)
        if stats:
            return
        index += 1
