"""Serving simulation: replay seeded arrivals through the serving loop under several tau policies.

(Work in progress: the pass-cost table first.)
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel


@torch.inference_mode()
def batch_pass_costs(
    model: PreTrainedModel, rows: tuple[int, ...] = (1, 2, 4, 8), widths: tuple[int, ...] = (1, 2, 3, 4),
    *, context: int = 128, reps: int = 5,
) -> list[dict]:
    """Median ms of one cached pass feeding ``width`` tokens to each of ``rows`` rows after ``context`` tokens.

    The attention mask is passed as the batch decoders pass it (2-D, all ones here), so the
    compute path's attention runs as in a real pass. One record per (rows, width).
    """
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    out = []
    for r in rows:
        ids = torch.randint(vocab // 4, vocab // 2, (r, context + max(widths)), generator=gen).to(model.device)
        cache = DynamicCache(config=model.config)
        attn = torch.ones(r, context, dtype=torch.long, device=model.device)
        model(input_ids=ids[:, :context], attention_mask=attn, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for w in widths:
            fed = ids[:, context : context + w]
            mask = torch.ones(r, context + w, dtype=torch.long, device=model.device)
            positions = torch.arange(context, context + w, device=model.device)[None].expand(r, -1)
            times = []
            for _ in range(reps + 2):  # two warm-ups
                started = time.perf_counter()
                model(input_ids=fed, attention_mask=mask, position_ids=positions, past_key_values=cache,
                      use_cache=True, logits_to_keep=w)
                times.append(time.perf_counter() - started)
                cache.crop(-w)
            ms = sorted(times[2:])[reps // 2] * 1000
            out.append({"rows": r, "width": w, "tokens": r * w, "ms": round(ms, 2)})
    return out
