"""Uncached reference decoder: every pass recomputes the whole sequence plus the masks.

Slow and obviously right; the tests hold the cached decoder to it token for token.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .acceptance import accept_count, choose, confidence


@torch.inference_mode()
def reference_decode(
    model: PreTrainedModel,
    prompt: list[int],
    *,
    block_size: int,
    mask_id: int,
    tau: float,
    max_new_tokens: int,
    stop_ids: set[int],
    metric: str = "probability",
) -> tuple[list[int], list[int]]:
    """Greedy MARS decoding without a cache. Returns (generated ids, tokens accepted per pass)."""
    sequence = list(prompt)
    per_pass: list[int] = []
    while len(sequence) - len(prompt) < max_new_tokens:
        fed = torch.tensor([sequence + [mask_id] * (block_size - 1)], device=model.device)
        logits = model(input_ids=fed).logits[0, -block_size:]  # (block_size, vocab)
        tokens, probs = choose(logits)
        n = int(accept_count(confidence(probs, tokens, metric), tau, metric))
        accepted = tokens[:n].tolist()[: max_new_tokens - (len(sequence) - len(prompt))]
        stop = next((i for i, t in enumerate(accepted) if t in stop_ids), None)
        if stop is not None:
            accepted = accepted[: stop + 1]
        sequence += accepted
        per_pass.append(len(accepted))
        if stop is not None:
            break
    return sequence[len(prompt) :], per_pass
