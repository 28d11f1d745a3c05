"""Teacher-forced held-out figures: a one-forward-per-batch preview of ``eval`` (``validate``, ``train --val-data``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...engine.decoding.acceptance import accept_count
from ...engine.decoding.config import check_tau
from .layout import Example, collate
from .loss import cuda_autocast, target_logits

VAL_TAU = 0.9  # the threshold the validation's acceptance estimate uses (the target tau)


@dataclass(frozen=True)
class Validation:
    """Teacher-forced measures on held-out rows: a one-forward-per-batch preview of ``eval``.

    Every full block (all B positions in the response) stands for one decoding pass
    that starts at its first position p: candidate 1 is the clean stream's guess for
    p (the AR token), candidate j the noisy stream's guess for p + j - 1. The pass
    accepts as decoding does (``accept_count`` at ``tau``, probability metric), but
    on the row's own tokens rather than the model's, so a wrong accepted guess does
    not derail what follows. On rows distilled from the base, ``ar_agreement`` is
    the share of tokens where the trained model's greedy choice is still the base's.
    """

    step: int
    noisy_loss: float | None  # None: no noisy targets (responses of one token)
    ar_loss: float
    ar_agreement: float  # clean argmax == the row's token, share of response tokens
    tokens_per_pass: float | None  # mean accepted per full block at tau (None: no full block)
    extra_match: float | None  # share of the extra accepted tokens equal to the row's token (None: none accepted)
    tau: float
    reach: list[float] | None = None  # per candidate 2..B: share of passes that accept it (where acceptance stops)
    # How sure the AR head is of the row's tokens: mean probability, and the share at >= tau. A mask guesses
    # a token from less context than the AR head gets for it, so ar_sure soft-bounds candidate 2's reach.
    ar_confidence: float | None = None
    ar_sure: float | None = None
    # tokens_per_pass if candidate j's confidence were the AR head's probability of the row's path
    # x_p..x_{p+j-1} (what masks exactly as sure as the AR head would give): a reference, not a bound
    ar_path_tokens_per_pass: float | None = None


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None


@torch.no_grad()
def validate(
    model: torch.nn.Module, examples: list[Example], mask_id: int, pad_id: int, block_size: int,
    *, taus: tuple[float, ...] = (VAL_TAU,), batch_size: int = 8, step: int = 0, ranks: list | None = None,
) -> list[Validation]:
    """Losses, argmax agreement and, per tau, an acceptance estimate on ``examples`` (see ``Validation``).

    ``ranks``: a list that gets, per batch, where the row's token stands in each mask's distribution at every
    full block ((passes, B - 1) tensors: research/candidate_trees.py).
    """
    if not examples:
        raise ValueError("no validation examples")
    taus = tuple(check_tau(tau) for tau in taus)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    totals = dict.fromkeys(("noisy", "clean", "n_noisy", "n_clean", "agree", "p_row", "passes"), 0.0)
    per_tau = {
        tau: dict.fromkeys(("accepted", "extra", "matched", "sure", "path"), 0.0) | {"reach": torch.zeros(block_size)}
        for tau in taus
    }
    try:
        for start in range(0, len(examples), batch_size):
            batch = collate(examples[start : start + batch_size], mask_id, pad_id, block_size)
            with cuda_autocast(device):
                logits, targets = target_logits(model, batch.to(device))
            _add_batch(batch, logits, targets, block_size, totals, per_tau, ranks)
    finally:
        model.train(was_training)
    return [
        Validation(
            step=step, tau=tau, noisy_loss=_ratio(totals["noisy"], totals["n_noisy"]),
            ar_loss=_ratio(totals["clean"], totals["n_clean"]), ar_agreement=_ratio(totals["agree"], totals["n_clean"]),
            ar_confidence=_ratio(totals["p_row"], totals["n_clean"]), ar_sure=_ratio(sums["sure"], totals["n_clean"]),
            tokens_per_pass=_ratio(sums["accepted"], totals["passes"]),
            extra_match=_ratio(sums["matched"], sums["extra"]),
            ar_path_tokens_per_pass=_ratio(sums["path"], totals["passes"]),
            reach=[_ratio(n, totals["passes"]) for n in sums["reach"][1:].tolist()] if totals["passes"] else None,
        )
        for tau, sums in per_tau.items()
    ]


def _add_batch(
    batch, logits: torch.Tensor, targets: torch.Tensor, block_size: int, totals: dict, per_tau: dict,
    ranks: list | None = None,
) -> None:
    """Add one batch's losses, agreement and, at every full block, each tau's acceptance to the running sums."""
    losses = F.cross_entropy(logits, targets, reduction="none").cpu()
    conf, guess = torch.softmax(logits, dim=-1).max(dim=-1)
    conf, right = conf.cpu(), (guess == targets).cpu()
    n_noisy = batch.noisy_targets.numel()
    totals["noisy"] += losses[:n_noisy].sum().item()
    totals["clean"] += losses[n_noisy:].sum().item()
    totals["n_noisy"] += n_noisy
    totals["n_clean"] += losses.numel() - n_noisy
    totals["agree"] += right[n_noisy:].sum().item()
    p_row = torch.exp(-losses[n_noisy:])  # the clean stream's probability of each row token
    totals["p_row"] += p_row.sum().item()
    for tau, sums in per_tau.items():
        sums["sure"] += (p_row >= tau).sum().item()
    # a full block at p: candidate 1 is the clean target at p, candidate j the noisy one at p + j - 1
    rows = torch.cat([batch.noisy_rows, batch.clean_rows]).tolist()
    positions = torch.cat([batch.noisy_positions, batch.clean_positions]).tolist()
    at = {(k >= n_noisy, row, pos): k for k, (row, pos) in enumerate(zip(rows, positions))}  # (clean?, row, pos)
    full = [(row, pos) for clean, row, pos in at if clean and pos % block_size == 0
            and all((False, row, pos + j) in at for j in range(1, block_size))]
    if not full:
        return
    index = torch.tensor([[at[True, row, p]] + [at[False, row, p + j] for j in range(1, block_size)]
                          for row, p in full])  # (passes, B): where each candidate's conf / right sits
    on_path = torch.tensor([[at[True, row, p + j] - n_noisy for j in range(block_size)] for row, p in full])
    path = p_row[on_path].cumprod(dim=-1)  # (passes, B): the AR head's probability of x_p..x_{p+j}
    totals["passes"] += len(full)
    if ranks is not None:
        ranks.append(_ranks(logits, targets, index[:, 1:]))
    for tau, sums in per_tau.items():
        sums["path"] += accept_count(path, tau).sum().item()
        counts = accept_count(conf[index], tau)
        extra = torch.arange(block_size) < counts[:, None]
        extra[:, 0] = False
        sums["accepted"] += counts.sum().item()
        sums["extra"] += extra.sum().item()
        sums["matched"] += (right[index] & extra).sum().item()
        sums["reach"] += extra.sum(dim=0)


def _ranks(logits: torch.Tensor, targets: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(passes, B - 1): how many tokens each mask's distribution puts above the row's token (0: its argmax)."""
    out = torch.empty(index.shape, dtype=torch.long)
    for d in range(index.shape[1]):
        at = index[:, d].to(logits.device)
        rows = logits[at]  # (passes, vocab)
        own = rows.gather(1, targets[at][:, None])
        out[:, d] = (rows > own).sum(dim=1).cpu()
    return out
