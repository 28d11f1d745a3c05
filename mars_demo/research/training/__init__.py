"""MARS fine-tuning (docs/METHOD.md, "Training"): one causal LM learns to read masks as future tokens.

  config.py       TrainConfig, the objectives ("mars", or "ar": the AR-SFT baseline)
  layout.py       examples, their order, and the [noisy | clean] rows with the MARS attention mask
  loss.py         the MARS loss, with logits only where a target is
  validation.py   teacher-forced held-out figures (``validate``, ``train --val-data``)
  checkpoints.py  LoRA, exact resume (weights, optimizer, schedule, RNG) and the saved model
  logs.py         loss.jsonl, val.jsonl and the loss curve
  run.py          the loop: ``train``
"""

from __future__ import annotations

from .checkpoints import attach_lora, load_trainable_state, save_model, trainable_state
from .layout import (
    Batch,
    Example,
    collate,
    epoch_batches,
    examples_digest,
    load_examples,
    mars_attention_mask,
    micro_batches,
    noisy_start,
)
from .logs import StepLog, plot_losses, read_history
from .loss import causal_lm, cuda_autocast, hidden_states, mars_loss, model_mask, target_logits
from .recipe import LORA_TARGETS, OBJECTIVES, TrainConfig, describe
from .run import TrainResult, cosine_schedule, total_steps, train
from .validation import VAL_TAU, Validation, validate

__all__ = [
    "LORA_TARGETS", "OBJECTIVES", "VAL_TAU", "Batch", "Example", "StepLog", "TrainConfig", "TrainResult", "Validation",
    "attach_lora", "causal_lm", "collate", "cosine_schedule", "cuda_autocast", "describe", "epoch_batches",
    "examples_digest", "hidden_states", "load_examples", "load_trainable_state", "mars_attention_mask", "mars_loss",
    "micro_batches", "model_mask", "noisy_start", "plot_losses", "read_history", "save_model", "target_logits",
    "total_steps", "train", "trainable_state", "validate",
]
