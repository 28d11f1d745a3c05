"""The CPU engine as a backend (base.py): its own model code (lean.py) and cache (cache.py) over a model's weights.

The attention follows the compute path the weights are on (quant.path_of): fp32 keeps the model's own
(SDPA or eager), every other path attends row by row (attention.py), prefills of up to 2048 rows included
(a MARS or exact prefill feeds masks after the prompt, AR's does not), so a row's output does not depend
on the rows fed beside it and exact decoding equals one-token AR there.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .... import settings
from ..base import Backend
from .attention import ROW_EXACT_PREFILL
from .cache import CpuCache
from .lean import LeanForward, unsupported
from .prefixes import PrefixStore
from .quant import BF16_ROWS_ALONE, path_of

# bf16 included: its SDPA over a prefill rounds the prompt's rows otherwise with masks after them (~1e-2)
ATTENTION_BY_PATH = {"bf16": ROW_EXACT_PREFILL, "int8": ROW_EXACT_PREFILL, "int8dyn": ROW_EXACT_PREFILL}
# where a prefill may start from a stored prompt prefix (prefixes.py): its GEMMs give a row the same bits
# whatever rows are fed beside it (bf16's prefill GEMM does not: one call over every row)
PREFIX_PATHS = ("int8", "int8dyn")


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
        self.prefixes = PrefixStore() if path_of(model) in PREFIX_PATHS and settings.PREFIXES.read() else None

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
        if not self._plain_prefill(ids, cache, positions, mask, keep):
            return self._pass(ids, cache, positions, mask, keep)
        held = self.prefixes.fill([ids[0]], cache, keep)
        logits = self._pass(ids[:, held:], cache, None if positions is None else positions[:, held:], None, keep)
        self.prefixes.learn(ids, cache)
        return logits

    def fill_prefix(self, rows: list[torch.Tensor], cache: CpuCache, keep: int) -> int:
        """base.Backend.fill_prefix: from the prefix store, where the native layers leave padding out (on other
        paths a padded pass costs its padding: the rows are better fed apart, each from its prefix)."""
        if self.prefixes is None or not self.native:
            return 0
        return self.prefixes.fill(rows, cache, keep)

    def _plain_prefill(self, ids, cache, positions, mask, keep: int) -> bool:
        """A pass that may start from a stored prefix: one row on an empty cache, causal (no mask, or a padding
        mask without holes: a request joining a running batch alone), positions from 0."""
        if self.prefixes is None or cache is None or cache.end or ids.shape[0] != 1 or not keep:
            return False
        if mask is not None and not (mask.dim() == 2 and mask.shape[1] == ids.shape[1] and bool(mask.all())):
            return False
        n = ids.shape[1]
        return positions is None or bool((positions[0] == torch.arange(n, device=positions.device)).all())

    def _pass(self, ids, cache, positions, mask, keep: int) -> torch.Tensor:
        if not self.bf16:
            return self.lean(ids, cache, positions, mask, keep)
        decoding = cache is not None and cache.get_seq_length() > 0
        rows_alone = BF16_ROWS_ALONE.set(ids.numel() if decoding else 1)  # a prefill: one GEMM call
        try:
            return self.lean(ids, cache, positions, mask, keep)
        finally:
            BF16_ROWS_ALONE.reset(rows_alone)
