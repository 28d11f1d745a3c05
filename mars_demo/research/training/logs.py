"""A run's logs: the loss per step (loss.jsonl), the held-out figures (val.jsonl) and the loss curve (loss.png)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .validation import Validation


@dataclass(frozen=True)
class StepLog:
    step: int
    loss: float
    noisy_loss: float
    ar_loss: float
    lr: float
    seconds: float  # training wall time so far, over resumes


LOSS_LOG = "loss.jsonl"
VAL_LOG = "val.jsonl"
SMOOTHING = 25  # steps in the loss curve's running mean


def plot_losses(history: list[StepLog], path: Path, validation: list[Validation] = ()) -> None:
    """Training losses (raw and running mean) and, as markers, the held-out ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h.step for h in history]
    window = min(SMOOTHING, len(history))
    for name, label in (("loss", "total"), ("noisy_loss", "noisy (future tokens)"), ("ar_loss", "AR (next token)")):
        values = [getattr(h, name) for h in history]
        line, = ax.plot(steps, values, linewidth=0.6, alpha=0.35)
        means = [sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(values))]
        ax.plot(steps, means, color=line.get_color(), linewidth=1.6, label=f"{label}, mean of {window} steps")
        held_out = [(v.step, getattr(v, name)) for v in validation if getattr(v, name, None) is not None]
        if held_out:
            ax.plot(*zip(*held_out), "o--", color=line.get_color(), markersize=4, linewidth=0.8,
                    label=f"{label}, held out")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("MARS fine-tuning")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_history(path: Path, up_to: int, kind: type = StepLog) -> list:
    """The rows of a JSONL log (``StepLog`` or ``Validation``) up to a step."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [kind(**row) for row in rows if row["step"] <= up_to]


def write_history(path: Path, history: list) -> None:
    path.write_text("".join(json.dumps(asdict(h)) + "\n" for h in history))
