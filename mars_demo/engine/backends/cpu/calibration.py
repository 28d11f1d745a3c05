"""The calibration texts and int8dyn's activation ranges: shipped for the bundled model, else measured once and cached.

auto's dNLL check (paths.py) reads ``calibration_texts``; int8dyn's smoothing (quant.py) needs each linear's
activation ranges, measured on other held-out texts (``smoothing_texts``) than the check's.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ... import progress
from ...machine import ASSETS
from .quant import activation_ranges, flushing_subnormals

# Calibration: CALIBRATION_TEXT and the first rows of held-out chat answers (none trained on).
CALIBRATION_FILE = ASSETS / "data" / "heldout_val64.jsonl"
CALIBRATION_ROWS = 4
# int8dyn's activation ranges (for smoothing) come from other held-out rows than the dNLL check's.
SMOOTHING_ROWS = range(8, 16)
SHIPPED_RANGES = ASSETS / "smollm2-135m-mars" / "int8dyn-ranges.safetensors"
CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
    "the members agreed to spend more on the library and the public parks, and less on new office "
    "furniture. To learn a new language, practise a little every day, read simple books, listen to "
    "native speakers and do not be afraid of mistakes. Water boils at one hundred degrees Celsius at sea "
    "level; at higher altitudes it boils at a lower temperature because the air pressure is lower. "
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
)


def _held_out_texts(rows: range) -> list[str]:
    if not CALIBRATION_FILE.is_file():
        return []
    lines = CALIBRATION_FILE.read_text().splitlines()
    return [f"{row['prompt']}\n\n{row['response']}" for row in (json.loads(lines[i]) for i in rows if i < len(lines))]


def calibration_texts() -> list[str]:
    """The dNLL check's texts: CALIBRATION_TEXT and the first CALIBRATION_ROWS held-out answers."""
    return [CALIBRATION_TEXT] + _held_out_texts(range(CALIBRATION_ROWS))


def smoothing_texts() -> list[str]:
    """int8dyn's activation-range texts: other held-out answers than the dNLL check's, if there are any."""
    return _held_out_texts(SMOOTHING_ROWS) or [CALIBRATION_TEXT]


def token_ids(tokenizer: PreTrainedTokenizerBase, texts: list[str], limit: int = 256) -> list[torch.Tensor]:
    return [tokenizer(text, return_tensors="pt").input_ids[:, :limit] for text in texts]


def shipped_ranges(model: PreTrainedModel) -> dict | None:
    """The bundled model's int8dyn activation ranges as shipped (``SHIPPED_RANGES``), or None for any other model.

    The ranges are maxima of the fp32 model's activations on the smoothing texts, the same on every CPU up
    to float rounding, so a first start need not measure them. The file names the merged model it was
    measured on (its cache folder carries the adapter's digest) and its parameter count.
    """
    name = Path(getattr(model.config, "_name_or_path", "") or "").name
    try:
        with safe_open(SHIPPED_RANGES, "pt") as shipped:
            meta = shipped.metadata() or {}
            if meta.get("model") != name or meta.get("params") != str(sum(p.numel() for p in model.parameters())):
                return None
            names = shipped.keys()  # a safe_open handle, not a dict: no iteration of its own
            return {name: shipped.get_tensor(name) for name in names}
    except (OSError, ValueError, SafetensorError):
        return None


def ranges_file(key: str, where: Path) -> Path:
    """Where ``smoothing_ranges`` caches the ranges it measured for a ``model_key``."""
    return where / "smoothing" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"


def smoothing_ranges(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, key: str, where: Path) -> dict:
    """int8dyn's activation ranges for ``model`` (fp32): measured before and cached, else shipped for the bundled
    model, else measured once on the smoothing texts and cached."""
    target = ranges_file(key, where)
    try:
        return load_file(target)
    except (OSError, ValueError, SafetensorError):
        ranges = shipped_ranges(model)
    if ranges is not None:
        return ranges
    progress.report("calibrating int8dyn (activation ranges)")
    with flushing_subnormals():
        ranges = activation_ranges(model, token_ids(tokenizer, smoothing_texts()))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    save_file({name: r.contiguous() for name, r in ranges.items()}, staging)
    staging.replace(target)
    return ranges
