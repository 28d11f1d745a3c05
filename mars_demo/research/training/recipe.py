"""The hyper-parameters of one MARS fine-tuning run (docs/METHOD.md, "Training")."""

from __future__ import annotations

from dataclasses import asdict, dataclass

OBJECTIVES = ("mars", "ar")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one run; saved in the checkpoint and in training.json."""

    block_size: int = 4
    lora_rank: int | None = 64  # None: full fine-tuning
    lora_alpha: float | None = None  # None: equal to the rank
    epochs: float = 1.0
    lr: float = 1e-3
    batch_size: int = 4
    grad_accum: int = 1
    max_steps: int | None = None  # None: from epochs
    max_response_tokens: int = 128
    warmup: float = 0.03
    weight_decay: float = 0.0
    clip: float = 1.0
    ar_weight: float = 1.0
    save_every: int = 50
    seed: int = 0
    objective: str = "mars"  # "mars", or "ar": the AR-SFT baseline (clean stream only)

    def __post_init__(self) -> None:
        for name in ("block_size", "batch_size", "grad_accum", "max_response_tokens", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be at least 1, got {getattr(self, name)}")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {self.lora_rank}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max steps must be at least 1, got {self.max_steps}")
        if self.epochs <= 0 or self.lr <= 0:
            raise ValueError("epochs and learning rate must be positive")
        if self.ar_weight < 0:
            raise ValueError(f"AR weight must be >= 0, got {self.ar_weight}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.objective == "ar" and self.ar_weight == 0:
            raise ValueError("the AR-SFT objective trains the AR loss alone: it needs an AR weight above 0")
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"warm-up must be a fraction in [0, 1), got {self.warmup}")

    @property
    def alpha(self) -> float:
        return float(self.lora_alpha if self.lora_alpha is not None else self.lora_rank or 0)


def describe(config: TrainConfig) -> dict:
    """Hyper-parameters as written to training.json (alpha resolved)."""
    return asdict(config) | {"lora_alpha": config.alpha if config.lora_rank else None}
