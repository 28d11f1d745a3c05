"""How likely a model finds an output: one teacher-forced forward pass over prompt + output (docs/METHOD.md,
"Measuring": nll_self and dNLL are read from it; the app's sampled race shows each side's NLL per token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..backends.base import Backend


@dataclass(frozen=True)
class Scored:
    """One teacher-forced pass over prompt + output: per output token, its NLL and the argmax there."""

    nll: tuple[float, ...]  # -log p(output[i] | prompt, output[:i])
    argmax: tuple[int, ...]  # argmax of p(. | prompt, output[:i]): what greedy AR would pick

    @property
    def total(self) -> float:
        return sum(self.nll)

    @property
    def tokens(self) -> int:
        return len(self.nll)


@torch.inference_mode()
def teacher_forced(backend: Backend, prompt: Sequence[int], output: Sequence[int]) -> Scored:
    """Score ``output`` after ``prompt`` with one causal forward pass of ``backend`` (no cache, no masks)."""
    if not prompt:
        raise ValueError("teacher forcing needs a non-empty prompt")
    if not output:
        return Scored((), ())
    ids = torch.tensor([list(prompt) + list(output)], dtype=torch.long, device=backend.device)
    # The prediction for output[i] is read at position len(prompt) - 1 + i: keep len(output) + 1
    # positions and drop the last, which predicts past the output.
    logits = backend.forward(ids, None, keep=len(output) + 1)[0, :-1].float()  # (len(output), vocab)
    logp = torch.log_softmax(logits, dim=-1)
    target = ids[0, len(prompt) :]
    nll = -logp.gather(1, target[:, None]).squeeze(1)  # (len(output),)
    packed = torch.cat([nll.double(), logits.argmax(dim=-1).double()]).tolist()  # one host sync
    n = len(output)
    return Scored(tuple(packed[:n]), tuple(int(t) for t in packed[n:]))
