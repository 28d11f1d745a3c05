"""The CPU engine as a backend (base.py): its own model code (lean.py) and cache (cache.py) over a model's weights.

The attention follows the compute path the weights are on (quant.path_of): fp32 keeps the model's own
(SDPA or eager), every other path attends row by row (attention.py), so a row's output does not depend
on the rows fed beside it and exact decoding equals one-token AR there.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..base import Backend
from .attention import ROW_EXACT, ROW_EXACT_PREFILL
from .cache import CpuCache
from .lean import LeanForward, unsupported
from .quant import path_of

ATTENTION_BY_PATH = {"bf16": ROW_EXACT, "int8": ROW_EXACT_PREFILL, "int8dyn": ROW_EXACT_PREFILL}


def attention_for(model: PreTrainedModel) -> str:
    """The attention a model's compute path decodes with (module docstring)."""
    own = model.config._attn_implementation
    return ATTENTION_BY_PATH.get(path_of(model), own if own in ("sdpa", "eager") else "sdpa")


class CpuBackend(Backend):
    """``model``'s weights run by the CPU engine; ``compute``: its measured compute path (paths.ComputePath)."""

    padding_costs = True

    def __init__(self, model: PreTrainedModel, compute=None) -> None:
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"the CPU engine cannot run this model: {why}")
        self.model, self.compute = model, compute
        self.lean = LeanForward(model, attention_for(model))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def native(self) -> bool:
        """Whether its layers run as one native call a pass (int8dyn on the native kernels)."""
        return self.lean.native is not None

    def new_cache(self, length: int | None = None) -> CpuCache:
        return CpuCache(len(self.lean.layers))

    def forward(self, ids, cache, *, positions=None, mask=None, keep=1, steady=False):
        return self.lean(ids, cache, positions, mask, keep)
