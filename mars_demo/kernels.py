"""A CPU fast path for the small matrix products of decoding.

On CPU, ``F.linear(x, W)`` with fp32 weights takes a much slower kernel as soon as
``x`` has 4 rows or more: on the development machine (2 cores, MKL) a 576 x 576
layer costs 15 us for 3 rows and 64 us for 4, while the same product against a
contiguous transposed copy of ``W`` (``x @ W.T``) costs 12 us for both. A MARS pass
feeds 4-7 tokens, so this step alone made it ~1.5x as costly as an AR pass. Keeping
both layouts and choosing by the number of rows removes the step: measured on the
bundled model, a pass over 4-7 tokens went from 49-53 ms to 41-47 ms, 1-3 tokens
unchanged (31-35 ms). BENCHMARKS.md has the numbers.

Decoding only: the transposed copy is a snapshot taken when it is installed (a later
in-place change of the weights, such as peft's merge, would not reach it), and it
costs one more copy of every projection's weights (~0.4 GB for SmolLM2-135M). So
``load_model`` installs it only when asked (``fast_cpu=True``: the commands that
decode and the app), never for training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows, F.linear's own kernel is as fast or faster.
SMALL_ROWS = 3


class DualLayoutLinear(nn.Linear):
    """An ``nn.Linear`` that also keeps its weight transposed and contiguous (buffer ``weight_t``)."""

    weight_t: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= SMALL_ROWS * self.in_features or (self.weight.requires_grad and torch.is_grad_enabled()):
            return F.linear(x, self.weight, self.bias)
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def install_dual_layout(model: nn.Module) -> int:
    """Turn the model's projections (not its LM head) into ``DualLayoutLinear`` in place; returns how many.

    The state dict does not change (the transposed copy is a non-persistent buffer).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and module is not head:
            module.__class__ = DualLayoutLinear
            module.register_buffer("weight_t", module.weight.detach().t().contiguous(), persistent=False)
            count += 1
    return count
