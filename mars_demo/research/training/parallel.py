"""Training on accelerate: one process as before, or several under ``accelerate launch`` (DDP).

Every process draws its micro-batches from the same seeded, resumable stream, in turn
(``shard``), so N processes with batch b see per optimizer step what one process sees
with ``--grad-accum N``; DDP averages the gradients as accumulation does. The loss runs
as a module (``MarsObjective``) because DDP must see the forward that uses the weights.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .layout import Batch
from .loss import mars_loss


class MarsObjective(torch.nn.Module):
    """``mars_loss`` as a module for accelerate's DDP wrapper; returns the stacked (loss, noisy_loss, ar_loss).

    (``hidden_states`` calls the decoder and the output embeddings directly, not the model's forward.)
    """

    def __init__(self, model: torch.nn.Module, ar_weight: float) -> None:
        super().__init__()
        self.model = model
        self.ar_weight = ar_weight

    def forward(self, batch: Batch) -> torch.Tensor:
        return torch.stack(mars_loss(self.model, batch, self.ar_weight))


def make_accelerator(device: torch.device):
    """One process as today, or one of ``accelerate launch``'s (DDP; mixed precision as launched).

    A model loaded on the CPU trains on the CPU even where a GPU is present. Unused
    parameters are allowed: the mask row's delta gets no gradient under ``--objective ar``.
    """
    from accelerate import Accelerator, DistributedDataParallelKwargs

    return Accelerator(cpu=device.type == "cpu",
                       kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])


def shard(stream: Iterator[list[int]], accelerator) -> Iterator[list[int]]:
    """This process's share of the shared stream: of each ``num_processes`` micro-batches, the ``process_index``-th."""
    while True:
        group = [next(stream) for _ in range(accelerator.num_processes)]
        yield group[accelerator.process_index]
