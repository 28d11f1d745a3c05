"""The MARS loss: CE on the noisy stream's future tokens + ar_weight * CE on the clean stream's next tokens.

Logits are computed only at the positions that carry a target (the vocab is large):
hidden states from the decoder under the MARS mask, then the LM head on those rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from .layout import Batch


def causal_lm(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model inside a PEFT wrapper (LoRA layers are injected in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def model_mask(attention: torch.Tensor, model: PreTrainedModel, dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask in the form the attention kernel adds or reads.

    transformers passes a 4D mask through untouched; sdpa reads booleans, but the
    eager kernel *adds* the mask to the scores, so it needs 0 / -inf-like floats.
    """
    implementation = model.config._attn_implementation
    if implementation == "sdpa":
        return attention
    if implementation == "eager":
        return torch.zeros(attention.shape, dtype=dtype, device=attention.device).masked_fill(
            ~attention, torch.finfo(dtype).min
        )
    raise ValueError(f"MARS training needs the sdpa or eager attention kernel, not {implementation!r}")


def hidden_states(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Final hidden states (batch, T, hidden) of the decoder under the MARS mask."""
    lm = causal_lm(model)
    decoder = lm.get_decoder()
    out = decoder(
        input_ids=batch.input_ids, position_ids=batch.position_ids,
        attention_mask=model_mask(batch.attention, lm, lm.dtype), use_cache=False,
    )
    return out.last_hidden_state


def target_logits(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, targets) at the loss targets, noisy ones first: logits (n_noisy + n_clean, vocab), fp32."""
    hidden = hidden_states(model, batch)  # (batch, T, hidden)
    selected = torch.cat([
        hidden[batch.noisy_rows, batch.noisy_sources],  # (n_noisy, hidden)
        hidden[batch.clean_rows, batch.clean_sources],  # (n_clean, hidden)
    ])
    logits = causal_lm(model).get_output_embeddings()(selected).float()
    return logits, torch.cat([batch.noisy_targets, batch.clean_targets])


def cuda_autocast(device: torch.device) -> torch.autocast:
    """bf16 autocast on CUDA (training and validation), a no-op elsewhere (CPU stays fp32)."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def mars_loss(
    model: torch.nn.Module, batch: Batch, ar_weight: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, noisy_loss, ar_loss), token means; logits only where a target is."""
    logits, targets = target_logits(model, batch)
    losses = F.cross_entropy(logits, targets, reduction="none")
    n_noisy = batch.noisy_targets.numel()
    noisy_loss = losses[:n_noisy].sum() / max(n_noisy, 1)
    ar_loss = losses[n_noisy:].sum() / max(batch.clean_targets.numel(), 1)
    return noisy_loss + ar_weight * ar_loss, noisy_loss, ar_loss
