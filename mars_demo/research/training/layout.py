"""The training layout (docs/METHOD.md, "Training"): examples, their order, and the [noisy | clean] rows.

Each row is [noisy | clean] with position ids 0..l-1 twice; ``mars_attention_mask`` states the
method's three rules on positions. Our choices: no noisy loss at block starts, and the noisy
copy starts at the block holding the first response token (the mask of that shorter layout is
an exact sub-matrix of the full one). ``noisy=False`` lays out the AR-SFT baseline.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Example:
    prompt: tuple[int, ...]
    response: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.response)


def load_examples(rows: list[dict], max_response_tokens: int) -> list[Example]:
    """Rows of a distilled JSONL (``prompt_ids``, ``response_ids``), responses cut to a maximum length."""
    examples = []
    for row in rows:
        prompt, response = row["prompt_ids"], row["response_ids"][:max_response_tokens]
        if prompt and response:
            examples.append(Example(tuple(prompt), tuple(response)))
    return examples


def examples_digest(examples: list[Example]) -> str:
    """Fingerprint of the training set, so a resumed run can check it reads the same data."""
    digest = hashlib.sha256()
    for ex in examples:
        digest.update(json.dumps([ex.prompt, ex.response]).encode())
    return digest.hexdigest()[:16]


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Shuffled batches of example indices for one epoch, deterministic in (seed, epoch).

    Examples are grouped by length inside shuffled windows of 32 batches, which
    cuts padding (CPU time) while keeping the order random.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = 32 * batch_size
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: -lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def micro_batches(lengths: list[int], batch_size: int, seed: int, start: int = 0) -> Iterator[list[int]]:
    """The endless stream of micro-batches over epochs, from micro-batch number ``start``."""
    per_epoch = math.ceil(len(lengths) / batch_size)
    epoch, index = divmod(start, per_epoch)
    while True:
        batches = epoch_batches(lengths, batch_size, seed, epoch)
        yield from batches[index:]
        epoch, index = epoch + 1, 0


def noisy_start(prompt_len: int, block_size: int) -> int:
    """First position of the noisy stream: the start of the block holding the first response token."""
    return prompt_len // block_size * block_size


def mars_attention_mask(
    positions: torch.Tensor, noisy: torch.Tensor, valid: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The MARS attention rules over any layout of the two streams.

    positions, noisy, valid: (batch, T) position ids, stream flags and non-padding flags.
    Returns (batch, T, T) booleans, True where query t may attend to key s. Every
    query also sees itself, so padding rows never go fully masked (NaNs in sdpa).
    """
    pq, pk = positions[:, :, None], positions[:, None, :]
    nq, nk = noisy[:, :, None], noisy[:, None, :]
    bq, bk = pq // block_size, pk // block_size
    clean_clean = ~nq & ~nk & (pk <= pq)
    noisy_noisy = nq & nk & (pk <= pq) & (bk == bq)
    noisy_clean = nq & ~nk & (bk < bq)
    allowed = (clean_clean | noisy_noisy | noisy_clean) & valid[:, None, :]
    eye = torch.eye(positions.shape[1], dtype=torch.bool, device=positions.device)
    return allowed | eye


@dataclass
class Batch:
    """One padded micro-batch in the [noisy | clean] layout, with its loss targets.

    Targets are (row, source index, token) triples: the logits at ``source`` of row
    ``row`` predict ``token`` (right shift: the source holds position i-1).
    """

    input_ids: torch.Tensor  # (batch, T), T = noisy width + clean width
    position_ids: torch.Tensor  # (batch, T)
    attention: torch.Tensor  # (batch, 1, T, T) bool
    noisy_rows: torch.Tensor  # (n_noisy,)
    noisy_sources: torch.Tensor  # (n_noisy,)
    noisy_targets: torch.Tensor  # (n_noisy,)
    noisy_positions: torch.Tensor  # (n_noisy,) the position i each target sits at
    clean_rows: torch.Tensor  # (n_clean,)
    clean_sources: torch.Tensor  # (n_clean,)
    clean_targets: torch.Tensor  # (n_clean,)
    clean_positions: torch.Tensor  # (n_clean,)

    def to(self, device: torch.device) -> Batch:
        return Batch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def collate(
    examples: list[Example], mask_id: int, pad_id: int, block_size: int, restrict: bool = True, noisy: bool = True
) -> Batch:
    """Lay examples out as [noisy | clean] rows; ``restrict`` drops the loss-free noisy prefix,
    ``noisy=False`` the whole noisy stream (the AR-SFT baseline)."""
    if not noisy:
        starts = [len(ex) for ex in examples]
    else:
        starts = [noisy_start(len(ex.prompt), block_size) if restrict else 0 for ex in examples]
    noisy_width = max(len(ex) - s for ex, s in zip(examples, starts))
    clean_width = max(len(ex) for ex in examples)
    ids, pos, is_noisy, valid = [], [], [], []
    targets: dict[str, list[list[int]]] = {"noisy": [[], [], [], []], "clean": [[], [], [], []]}
    for row, (ex, start) in enumerate(zip(examples, starts)):
        tokens, n_prompt = list(ex.prompt + ex.response), len(ex.prompt)
        noisy_ids = [t if i < n_prompt else mask_id for i, t in enumerate(tokens)][start:]
        n_noisy = len(noisy_ids)
        ids.append(noisy_ids + [pad_id] * (noisy_width - n_noisy) + tokens + [pad_id] * (clean_width - len(tokens)))
        pos.append(list(range(start, len(tokens))) + [0] * (noisy_width - n_noisy)
                   + list(range(len(tokens))) + [0] * (clean_width - len(tokens)))
        is_noisy.append([True] * noisy_width + [False] * clean_width)
        valid.append([True] * n_noisy + [False] * (noisy_width - n_noisy)
                     + [True] * len(tokens) + [False] * (clean_width - len(tokens)))
        for i in range(n_prompt, len(tokens)):  # response positions
            if noisy and i % block_size:  # in-block index >= 1: the source i-1 is in the same block
                for part, value in zip(targets["noisy"], (row, i - 1 - start, tokens[i], i)):
                    part.append(value)
            for part, value in zip(targets["clean"], (row, noisy_width + i - 1, tokens[i], i)):
                part.append(value)
    positions = torch.tensor(pos)
    attention = mars_attention_mask(positions, torch.tensor(is_noisy), torch.tensor(valid), block_size)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)
    return Batch(
        input_ids=torch.tensor(ids), position_ids=positions, attention=attention[:, None],
        noisy_rows=as_long(targets["noisy"][0]), noisy_sources=as_long(targets["noisy"][1]),
        noisy_targets=as_long(targets["noisy"][2]), noisy_positions=as_long(targets["noisy"][3]),
        clean_rows=as_long(targets["clean"][0]), clean_sources=as_long(targets["clean"][1]),
        clean_targets=as_long(targets["clean"][2]), clean_positions=as_long(targets["clean"][3]),
    )
