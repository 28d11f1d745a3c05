"""What a run saves and resumes from: the trainable weights (LoRA), optimizer, schedule and RNG, and the model."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import torch
from transformers import PreTrainedModel

from .loss import causal_lm
from .recipe import LORA_TARGETS, TrainConfig

logger = logging.getLogger(__name__)
CHECKPOINT = "checkpoint"


def attach_lora(model: PreTrainedModel, config: TrainConfig, mask_id: int, init_adapter: str | Path | None = None):
    """Wrap ``model`` for training: LoRA on every linear layer plus the mask token's embedding row,
    or every weight when ``config.lora_rank`` is None. ``init_adapter`` starts from saved adapter weights.
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    if config.lora_rank is None:
        for param in model.parameters():
            param.requires_grad_(True)
        return model
    if init_adapter is not None:
        peft_model = PeftModel.from_pretrained(model, str(init_adapter), is_trainable=True)
        saved = peft_model.peft_config["default"]
        if saved.r != config.lora_rank:
            logger.warning("the initial adapter has rank %d: using it instead of %d", saved.r, config.lora_rank)
        if list(saved.trainable_token_indices or []) != [mask_id]:
            logger.warning("the initial adapter trains token rows %s, but the mask token is %d",
                           saved.trainable_token_indices, mask_id)
        return peft_model
    lora = LoraConfig(
        r=config.lora_rank, lora_alpha=config.alpha, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
        trainable_token_indices=[mask_id], task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = [name for name, p in params.items() if p.requires_grad and name not in state]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} trainable tensors, e.g. {missing[0]}")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(directory: Path, model, optimizer, scheduler, payload: dict) -> None:
    """Everything a resumed run needs, written atomically (a killed save leaves the old one)."""
    directory.mkdir(parents=True, exist_ok=True)
    state = payload | {
        "trainable": trainable_state(model), "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(), "rng": rng_state(),
    }
    staging = directory / "state.pt.tmp"
    torch.save(state, staging)
    staging.replace(directory / "state.pt")
    summary = {k: payload[k] for k in ("step", "seconds", "config")}
    (directory / "state.json").write_text(json.dumps(summary, indent=2) + "\n")


def read_checkpoint(directory: Path) -> dict:
    path = directory / "state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint to resume: {path} does not exist")
    return torch.load(path, map_location="cpu", weights_only=False)


def save_model(model, lm, out_dir: Path, base_spec: str, block_size: int) -> None:
    """The trained weights in a form ``load_model(out_dir)`` reads.

    A fp16 adapter (or a fp16 full model) and mars.json.
    """
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    inner = causal_lm(model)
    if hasattr(model, "peft_config"):
        model.save_pretrained(str(out_dir))
        weights = out_dir / "adapter_model.safetensors"
        save_file({k: v.half().contiguous() for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
        config_path = out_dir / "adapter_config.json"
        adapter_config = json.loads(config_path.read_text())
        adapter_config["base_model_name_or_path"] = base_spec  # load_model resolves the base by spec
        config_path.write_text(json.dumps(adapter_config, indent=2) + "\n")
    else:
        halves: dict[int, torch.Tensor] = {}  # tied weights stay one tensor, so save_pretrained stores them once
        state = {k: halves.setdefault(v.data_ptr(), v.detach().half()) for k, v in inner.state_dict().items()}
        inner.save_pretrained(str(out_dir), state_dict=state)
        lm.tokenizer.save_pretrained(str(out_dir))
    from ...engine.model import MarsMeta

    MarsMeta(block_size=block_size, mask_token_id=lm.meta.mask_token_id, mask_token=lm.meta.mask_token).save(out_dir)
