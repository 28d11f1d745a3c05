"""Uncached single-row reference for block-level decoding: slow and obviously right.

A pass feeds the whole sequence plus masks up to the end of the current block and
accepts the confident prefix of the remaining candidates, never past the block's
end. The tests hold every row of the cached batch decoders to it token for token.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..acceptance import accept_count, choose, confidence


@torch.inference_mode()
def reference_block_decode(
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
    """Greedy block-level MARS without a cache. Returns (generated ids, tokens accepted per pass)."""
    generated: list[int] = []
    per_pass: list[int] = []
    while len(generated) < max_new_tokens:
        left = block_size - len(generated) % block_size  # candidates before the block's end
        fed = torch.tensor([prompt + generated + [mask_id] * (left - 1)], device=model.device)
        logits = model(input_ids=fed).logits[0, -left:]  # (left, vocab)
        tokens, probs = choose(logits)
        n = int(accept_count(confidence(probs, tokens, metric), tau, metric))
        accepted = tokens[:n].tolist()[: max_new_tokens - len(generated)]
        stop = next((i for i, t in enumerate(accepted) if t in stop_ids), None)
        if stop is not None:
            accepted = accepted[: stop + 1]
        generated += accepted
        per_pass.append(len(accepted))
        if stop is not None:
            break
    return generated, per_pass
