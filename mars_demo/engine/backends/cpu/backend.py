"""The CPU engine as a backend (base.py): its own model code (lean.py) and cache (cache.py) over a model's weights.

The attention follows the compute path the weights are on (quant.path_of): fp32 keeps the model's own
(SDPA or eager), every other path attends row by row (attention.py), prefills of up to 2048 rows included
(a MARS or exact prefill feeds masks after the prompt, AR's does not), so a row's output does not depend
on the rows fed beside it and exact decoding equals one-token AR there.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..base import Backend
from .attention import ROW_EXACT_PREFILL
from .cache import CpuCache
from .lean import LeanForward, unsupported
from .quant import BF16_ROWS_ALONE, path_of

# bf16 included: its SDPA over a prefill rounds the prompt's rows otherwise with masks after them (~1e-2)
ATTENTION_BY_PATH = {"bf16": ROW_EXACT_PREFILL, "int8": ROW_EXACT_PREFILL, "int8dyn": ROW_EXACT_PREFILL}


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
        self.bool_masks = self.lean.attention != "eager"  # the row-exact kernels and SDPA read booleans
        self.bf16 = path_of(model) == "bf16"  # its linears feed a decode pass's rows one at a time (quant.py)

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
        if not self.bf16:
            return self.lean(ids, cache, positions, mask, keep)
        decoding = cache is not None and cache.get_seq_length() > 0
        rows_alone = BF16_ROWS_ALONE.set(ids.numel() if decoding else 1)  # a prefill: one GEMM call
        try:
            return self.lean(ids, cache, positions, mask, keep)
        finally:
            BF16_ROWS_ALONE.reset(rows_alone)
