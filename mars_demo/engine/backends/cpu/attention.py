"""The row-exact attention: each query row of a short pass attends alone, as in a one-token pass.

Exact mode, MARS at tau = 1.0 and batch rows equal one-token AR only if a row's output does not depend
on the rows fed beside it; SDPA's does (its blocking follows the rows and keys of the call). The lean
forward's torch layers (lean.py) call these functions on the bf16, int8 and int8dyn paths (the native
layers, native_layers.py, attend row by row themselves). On fp32 tensors the rows of a layer go in one
native call (rowattn.py) where the kernel is built; else SDPA row by row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import rowattn

ROW_EXACT = "row_exact"  # passes of up to ROW_EXACT_ROWS rows attend row by row; longer ones in one call
ROW_EXACT_ROWS = 16
# bf16, int8 and int8dyn: prefills up to this many rows attend row by row too. A MARS or exact prefill
# feeds the prompt and masks, AR's the prompt alone, a batch's prefill pads its prompts, and SDPA
# over a block of rows rounds by block size (~1e-6 in fp32): int8dyn's per-row scales can turn that
# into a flipped token (docs/bench/history.md, "Quality by compute path"), and so can int8's near ties (a live
# batch's row against the same prompt alone, tests/test_live.py). Longer prompts attend in one call.
ROW_EXACT_PREFILL = "row_exact_prefill"
ROW_EXACT_PREFILL_ROWS = 2048
MAX_ROWS = {ROW_EXACT: ROW_EXACT_ROWS, ROW_EXACT_PREFILL: ROW_EXACT_PREFILL_ROWS}


def _visible_keys(attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int) -> list[list]:
    """For every (row of the batch, query), a prefix length or an index tensor of the keys it may see."""
    if attention_mask is None:  # causal over a cache of kv_len - q_len tokens
        return [[kv_len - q_len + i + 1 for i in range(q_len)] for _ in range(batch)]
    allowed = rowattn.allowed_keys(attention_mask, batch, q_len, kv_len)
    counts = allowed.sum(-1).tolist()
    prefix = allowed.int().cumprod(-1).sum(-1).tolist()  # one host sync for the whole pass
    return [
        [counts[b][i] if prefix[b][i] == counts[b][i] else allowed[b, i].nonzero().squeeze(1) for i in range(q_len)]
        for b in range(batch)
    ]


_last_mask: tuple = (None, None, None)  # (mask, reader, what it read): every layer of a pass gets the same mask


def _read_mask(read, attention_mask: torch.Tensor, *shape: int):
    """``read(attention_mask, *shape)``, once per mask object (the layers of a pass share one)."""
    global _last_mask
    mask, reader, found = _last_mask
    if mask is not attention_mask or reader is not read:
        found = read(attention_mask, *shape)
        _last_mask = (attention_mask, read, found)
    return found


def _attend_alone(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling) -> torch.Tensor:
    """One query row (1, heads, 1, d) over the keys it sees, (1, 1, heads, d): what every row of a short pass runs."""
    groups = getattr(module, "num_key_value_groups", 1)
    out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=groups > 1)
    return out.view(1, 1, query.shape[1], value.shape[-1])


def row_exact_prefill_attention(module, query, key, value, attention_mask, **kwargs):
    """row_exact_attention with prefills of up to ROW_EXACT_PREFILL_ROWS rows attending row by row too."""
    return row_exact_attention(module, query, key, value, attention_mask, max_rows=ROW_EXACT_PREFILL_ROWS, **kwargs)


def row_exact_attention(module, query, key, value, attention_mask, max_rows: int = ROW_EXACT_ROWS, **kwargs):
    """SDPA in which each query row of a pass of up to ``max_rows`` attends alone, as in a one-token pass.

    On fp32 tensors it is the native kernel (rowattn.py) where that is built: all rows in one call per layer.
    """
    batch, _, q_len, _ = query.shape  # (batch, heads, q, head_dim)
    if q_len > max_rows:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    scaling = kwargs.get("scaling")
    native = rowattn.kernel()
    if native is not None and rowattn.supports(query, key, value):
        shape = batch, q_len, key.shape[2]
        visible = None if attention_mask is None else _read_mask(rowattn.Visible, attention_mask, *shape)
        return rowattn.attend(native, query, key, value, scaling, visible), None
    if batch == 1 and attention_mask is None:  # one sequence, causal over its cache: the commonest passes
        if q_len == 1:  # the one-token pass: the same call as every row's
            return _attend_alone(module, query, key, value, scaling), None
        first = key.shape[2] - q_len + 1  # keys the first row sees
        rows = [_attend_alone(module, query[:, :, i : i + 1], key[:, :, : first + i], value[:, :, : first + i], scaling)
                for i in range(q_len)]
        return torch.cat(rows, dim=1), None  # (1, q, heads, head_dim)
    shape = batch, q_len, key.shape[2]
    if attention_mask is None:
        visible = _visible_keys(None, *shape)
    else:
        visible = _read_mask(_visible_keys, attention_mask, *shape)
    rows = []
    for b in range(batch):
        for i, keys in enumerate(visible[b]):
            if isinstance(keys, int):
                k, v = key[b : b + 1, :, :keys], value[b : b + 1, :, :keys]
            else:
                k, v = key[b : b + 1, :, keys], value[b : b + 1, :, keys]
            rows.append(_attend_alone(module, query[b : b + 1, :, i : i + 1], k, v, scaling))
    out = torch.cat(rows, dim=1).reshape(batch, q_len, *rows[0].shape[2:])  # (batch, q, heads, head_dim)
    return out, None
