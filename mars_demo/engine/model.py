"""A loaded checkpoint: the weights, how they decode (a backend), the tokenizer and MARS's settings.

``checkpoints/loading.py`` makes these; the decoders, serving, research and the UI take them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .backends import Backend, backend_for
from .backends.cpu.paths import ComputePath

META_FILE = "mars.json"


@dataclass(frozen=True)
class MarsMeta:
    """What a decoder needs to know about a MARS checkpoint beyond its weights."""

    block_size: int
    mask_token_id: int
    mask_token: str
    right_shift: bool = True

    def save(self, directory: str | os.PathLike) -> None:
        Path(directory, META_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @staticmethod
    def read(directory: str | os.PathLike) -> dict:
        path = Path(directory, META_FILE)
        return json.loads(path.read_text()) if path.is_file() else {}


def _layout(model: PreTrainedModel) -> tuple:
    """What a compute path's conversion changes in place: the modules' identities, the dtype, the device."""
    layers = getattr(getattr(model, "model", None), "layers", None) or [None]
    first = getattr(getattr(layers[0], "self_attn", None), "q_proj", None)
    return id(model.get_output_embeddings()), id(first), model.dtype, model.device


@dataclass
class LoadedModel:
    """A loaded checkpoint: the weights (``model``), how they decode (``backend``), the tokenizer, MARS's settings."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    meta: MarsMeta
    name: str
    load_seconds: float = 0.0
    compute: ComputePath | None = None  # the CPU compute path (backends/cpu/paths.py); None: weights as loaded
    chosen: Backend | None = field(default=None, repr=False)  # a backend set by the caller (compiled passes)
    _built: tuple = field(default=(None, None), repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def backend(self) -> Backend:
        """What the decoders run (backends.backend_for), built again if the weights were converted or ``compute``
        replaced since."""
        if self.chosen is not None:
            return self.chosen
        layout, built = self._built
        now = (_layout(self.model), id(self.compute))
        if built is None or layout != now:
            built = backend_for(self.model, self.compute)
            self._built = (now, built)
        return built
