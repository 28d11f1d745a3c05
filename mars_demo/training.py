"""MARS fine-tuning (METHOD.md, "Training"): one causal LM learns to read masks as future tokens.

Each example x = prompt + response, length l. The model reads [noisy | clean]:
the clean stream is x at positions 0..l-1; the noisy stream is x with every
response position replaced by the mask token. Blocks of B positions are counted
from position 0, and one boolean attention mask (True = may attend) says
  1. clean -> clean: causal (pos_q >= pos_k);
  2. noisy -> noisy: causal and same block;
  3. noisy -> clean: only clean tokens of strictly earlier blocks;
  clean never sees noisy; padding keys are never seen.
Logits are right-shifted: the prediction for position i is read at position i-1
of the same stream. Loss = CE(noisy, response tokens) + ar_weight * CE(clean,
response tokens).

Choices this trainer makes, all allowed by METHOD.md:
  * Noisy block starts (in-block index 0) are left out of the noisy loss: their
    source is the previous block's last mask, a (B+1)-ahead target that
    decoding never reads. Noisy targets are response positions with index >= 1.
  * The noisy stream starts at the block holding the first response position;
    earlier noisy positions equal the prompt, carry no loss and are never
    attended (rule 2 keeps noisy queries inside their own block), so leaving
    them out changes nothing. The rules are written on positions, so the mask
    of the shortened layout is the exact sub-matrix of the full one.
  * Logits are computed only at the positions that carry a target (the vocab is
    large): hidden states from the decoder, then the LM head on those rows.

``objective="ar"`` trains the paper's AR-SFT baseline instead: the clean stream
alone (plain next-token CE on the response), same data, same adapter, so that
tau = 1.0 of a MARS adapter can be compared with fine-tuning without the masks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

OBJECTIVES = ("mars", "ar")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one run; saved in the checkpoint and in training.json."""

    block_size: int = 4
    lora_rank: int | None = 64  # None: full fine-tuning
    lora_alpha: float | None = None  # None: equal to the rank
    epochs: float = 1.0
    lr: float = 1e-3
    batch_size: int = 4
    grad_accum: int = 1
    max_steps: int | None = None  # None: from epochs
    max_response_tokens: int = 128
    warmup: float = 0.03
    weight_decay: float = 0.0
    clip: float = 1.0
    ar_weight: float = 1.0
    save_every: int = 50
    seed: int = 0
    objective: str = "mars"  # "mars", or "ar": the AR-SFT baseline (clean stream only)

    def __post_init__(self) -> None:
        for name in ("block_size", "batch_size", "grad_accum", "max_response_tokens", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be at least 1, got {getattr(self, name)}")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {self.lora_rank}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max steps must be at least 1, got {self.max_steps}")
        if self.epochs <= 0 or self.lr <= 0:
            raise ValueError("epochs and learning rate must be positive")
        if self.ar_weight < 0:
            raise ValueError(f"AR weight must be >= 0, got {self.ar_weight}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.objective == "ar" and self.ar_weight == 0:
            raise ValueError("the AR-SFT objective trains the AR loss alone: it needs an AR weight above 0")
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"warm-up must be a fraction in [0, 1), got {self.warmup}")

    @property
    def alpha(self) -> float:
        return float(self.lora_alpha if self.lora_alpha is not None else self.lora_rank or 0)


# --------------------------------------------------------------------------- data


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


# --------------------------------------------------------------------------- layout and mask


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
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return Batch(
        input_ids=torch.tensor(ids), position_ids=positions, attention=attention[:, None],
        noisy_rows=as_long(targets["noisy"][0]), noisy_sources=as_long(targets["noisy"][1]),
        noisy_targets=as_long(targets["noisy"][2]), noisy_positions=as_long(targets["noisy"][3]),
        clean_rows=as_long(targets["clean"][0]), clean_sources=as_long(targets["clean"][1]),
        clean_targets=as_long(targets["clean"][2]), clean_positions=as_long(targets["clean"][3]),
    )


# --------------------------------------------------------------------------- loss


def causal_lm(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model inside a PEFT wrapper (LoRA layers are injected in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def model_mask(attention: torch.Tensor, model: PreTrainedModel, dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask in the form the attention kernel adds or reads.

    transformers passes a 4D mask through untouched; sdpa reads booleans, but the
    eager kernel *adds* the mask to the scores, so it needs 0 / -inf-like floats.
    """
    implementation = model.config._attn_implementation
    if implementation == "sdpa":
        return attention
    if implementation == "eager":
        return torch.zeros(attention.shape, dtype=dtype, device=attention.device).masked_fill(
            ~attention, torch.finfo(dtype).min
        )
    raise ValueError(f"MARS training needs the sdpa or eager attention kernel, not {implementation!r}")


def hidden_states(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Final hidden states (batch, T, hidden) of the decoder under the MARS mask."""
    lm = causal_lm(model)
    decoder = lm.get_decoder()
    out = decoder(
        input_ids=batch.input_ids, position_ids=batch.position_ids,
        attention_mask=model_mask(batch.attention, lm, lm.dtype), use_cache=False,
    )
    return out.last_hidden_state


def target_logits(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, targets) at the loss targets, noisy ones first: logits (n_noisy + n_clean, vocab), fp32."""
    hidden = hidden_states(model, batch)  # (batch, T, hidden)
    selected = torch.cat([
        hidden[batch.noisy_rows, batch.noisy_sources],  # (n_noisy, hidden)
        hidden[batch.clean_rows, batch.clean_sources],  # (n_clean, hidden)
    ])
    logits = causal_lm(model).get_output_embeddings()(selected).float()
    return logits, torch.cat([batch.noisy_targets, batch.clean_targets])


def cuda_autocast(device: torch.device) -> torch.autocast:
    """bf16 autocast on CUDA (training and validation), a no-op elsewhere (CPU stays fp32)."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def mars_loss(model: torch.nn.Module, batch: Batch, ar_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, noisy_loss, ar_loss), token means; logits only where a target is."""
    logits, targets = target_logits(model, batch)
    losses = F.cross_entropy(logits, targets, reduction="none")
    n_noisy = batch.noisy_targets.numel()
    noisy_loss = losses[:n_noisy].sum() / max(n_noisy, 1)
    ar_loss = losses[n_noisy:].sum() / max(batch.clean_targets.numel(), 1)
    return noisy_loss + ar_weight * ar_loss, noisy_loss, ar_loss


# --------------------------------------------------------------------------- validation

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


@torch.no_grad()
def validate(
    model: torch.nn.Module, examples: list[Example], mask_id: int, pad_id: int, block_size: int,
    *, taus: tuple[float, ...] = (VAL_TAU,), batch_size: int = 8, step: int = 0,
) -> list[Validation]:
    """Losses, argmax agreement and, per tau, an acceptance estimate on ``examples`` (see ``Validation``)."""
    from .acceptance import accept_count
    from .config import check_tau

    if not examples:
        raise ValueError("no validation examples")
    taus = tuple(check_tau(tau) for tau in taus)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    totals = dict.fromkeys(("noisy", "clean", "n_noisy", "n_clean", "agree", "p_row", "passes"), 0.0)
    per_tau = {tau: dict.fromkeys(("accepted", "extra", "matched", "sure", "path"), 0.0) | {"reach": torch.zeros(block_size)}
               for tau in taus}
    try:
        for start in range(0, len(examples), batch_size):
            batch = collate(examples[start : start + batch_size], mask_id, pad_id, block_size)
            with cuda_autocast(device):
                logits, targets = target_logits(model, batch.to(device))
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
                continue
            index = torch.tensor([[at[True, row, p]] + [at[False, row, p + j] for j in range(1, block_size)]
                                  for row, p in full])  # (passes, B): where each candidate's conf / right sits
            on_path = torch.tensor([[at[True, row, p + j] - n_noisy for j in range(block_size)] for row, p in full])
            path = p_row[on_path].cumprod(dim=-1)  # (passes, B): the AR head's probability of x_p..x_{p+j}
            totals["passes"] += len(full)
            for tau, sums in per_tau.items():
                sums["path"] += accept_count(path, tau).sum().item()
                counts = accept_count(conf[index], tau)
                extra = torch.arange(block_size) < counts[:, None]
                extra[:, 0] = False
                sums["accepted"] += counts.sum().item()
                sums["extra"] += extra.sum().item()
                sums["matched"] += (right[index] & extra).sum().item()
                sums["reach"] += extra.sum(dim=0)
    finally:
        model.train(was_training)
    ratio = lambda num, den: round(num / den, 4) if den else None  # noqa: E731
    return [
        Validation(
            step=step, noisy_loss=ratio(totals["noisy"], totals["n_noisy"]), ar_loss=ratio(totals["clean"], totals["n_clean"]),
            ar_agreement=ratio(totals["agree"], totals["n_clean"]), tokens_per_pass=ratio(sums["accepted"], totals["passes"]),
            extra_match=ratio(sums["matched"], sums["extra"]), tau=tau,
            reach=[ratio(n, totals["passes"]) for n in sums["reach"][1:].tolist()] if totals["passes"] else None,
            ar_confidence=ratio(totals["p_row"], totals["n_clean"]), ar_sure=ratio(sums["sure"], totals["n_clean"]),
            ar_path_tokens_per_pass=ratio(sums["path"], totals["passes"]),
        )
        for tau, sums in per_tau.items()
    ]


# --------------------------------------------------------------------------- model


def attach_lora(model: PreTrainedModel, config: TrainConfig, mask_id: int, init_adapter: str | Path | None = None):
    """Wrap ``model`` for training: LoRA on every linear layer plus the mask token's embedding row,
    or every weight when ``config.lora_rank`` is None. ``init_adapter`` starts from saved adapter weights.
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    if config.lora_rank is None:
        for param in model.parameters():
            param.requires_grad_(True)
        return model
    if init_adapter is not None:
        peft_model = PeftModel.from_pretrained(model, str(init_adapter), is_trainable=True)
        saved = peft_model.peft_config["default"]
        if saved.r != config.lora_rank:
            logger.warning("the initial adapter has rank %d: using it instead of %d", saved.r, config.lora_rank)
        if list(saved.trainable_token_indices or []) != [mask_id]:
            logger.warning("the initial adapter trains token rows %s, but the mask token is %d",
                           saved.trainable_token_indices, mask_id)
        return peft_model
    lora = LoraConfig(
        r=config.lora_rank, lora_alpha=config.alpha, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
        trainable_token_indices=[mask_id], task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = [name for name, p in params.items() if p.requires_grad and name not in state]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} trainable tensors, e.g. {missing[0]}")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)


def cosine_schedule(optimizer: torch.optim.Optimizer, total_steps: int, warmup: float):
    """Linear warm-up over ``warmup`` of the steps, then cosine decay to zero."""
    warm = max(1, round(total_steps * warmup)) if warmup > 0 else 0

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --------------------------------------------------------------------------- run


@dataclass(frozen=True)
class StepLog:
    step: int
    loss: float
    noisy_loss: float
    ar_loss: float
    lr: float
    seconds: float  # training wall time so far, over resumes


CHECKPOINT = "checkpoint"
LOSS_LOG = "loss.jsonl"
VAL_LOG = "val.jsonl"
SMOOTHING = 25  # steps in the loss curve's running mean


def describe(config: TrainConfig) -> dict:
    """Hyper-parameters as written to training.json (alpha resolved)."""
    return asdict(config) | {"lora_alpha": config.alpha if config.lora_rank else None}


def total_steps(n_examples: int, config: TrainConfig, processes: int = 1) -> int:
    """Optimizer steps of a run; each takes ``grad_accum`` micro-batches on each of ``processes``."""
    if config.max_steps is not None:
        return config.max_steps
    per_epoch = math.ceil(n_examples / config.batch_size)
    return max(1, math.ceil(config.epochs * per_epoch / (config.grad_accum * processes)))


class MarsObjective(torch.nn.Module):
    """``mars_loss`` as a module: accelerate's DDP wrapper must see the forward that uses the weights.

    (``hidden_states`` calls the decoder and the output embeddings directly, not the model's forward.)
    Returns the stacked (loss, noisy_loss, ar_loss).
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


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(directory: Path, model, optimizer, scheduler, payload: dict) -> None:
    """Everything a resumed run needs, written atomically (a killed save leaves the old one)."""
    directory.mkdir(parents=True, exist_ok=True)
    state = payload | {
        "trainable": trainable_state(model), "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(), "rng": _rng_state(),
    }
    staging = directory / "state.pt.tmp"
    torch.save(state, staging)
    staging.replace(directory / "state.pt")
    (directory / "state.json").write_text(json.dumps({k: payload[k] for k in ("step", "seconds", "config")}, indent=2) + "\n")


def read_checkpoint(directory: Path) -> dict:
    path = directory / "state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint to resume: {path} does not exist")
    return torch.load(path, map_location="cpu", weights_only=False)


def save_model(model, lm, out_dir: Path, base_spec: str, block_size: int) -> None:
    """The trained weights in a form ``load_model(out_dir)`` reads: a fp16 adapter (or a fp16 full model) and mars.json."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    inner = causal_lm(model)
    if hasattr(model, "peft_config"):
        model.save_pretrained(str(out_dir))
        weights = out_dir / "adapter_model.safetensors"
        save_file({k: v.half().contiguous() for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
        config_path = out_dir / "adapter_config.json"
        adapter_config = json.loads(config_path.read_text())
        adapter_config["base_model_name_or_path"] = base_spec  # load_model resolves the base by spec
        config_path.write_text(json.dumps(adapter_config, indent=2) + "\n")
    else:
        halves: dict[int, torch.Tensor] = {}  # tied weights stay one tensor, so save_pretrained stores them once
        state = {k: halves.setdefault(v.data_ptr(), v.detach().half()) for k, v in inner.state_dict().items()}
        inner.save_pretrained(str(out_dir), state_dict=state)
        lm.tokenizer.save_pretrained(str(out_dir))
    from .loading import MarsMeta

    MarsMeta(block_size=block_size, mask_token_id=lm.meta.mask_token_id, mask_token=lm.meta.mask_token).save(out_dir)


def plot_losses(history: list[StepLog], path: Path, validation: list[Validation] = ()) -> None:
    """Training losses (raw and running mean) and, as markers, the held-out ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h.step for h in history]
    window = min(SMOOTHING, len(history))
    for name, label in (("loss", "total"), ("noisy_loss", "noisy (future tokens)"), ("ar_loss", "AR (next token)")):
        values = [getattr(h, name) for h in history]
        line, = ax.plot(steps, values, linewidth=0.6, alpha=0.35)
        means = [sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(values))]
        ax.plot(steps, means, color=line.get_color(), linewidth=1.6, label=f"{label}, mean of {window} steps")
        held_out = [(v.step, getattr(v, name)) for v in validation if getattr(v, name, None) is not None]
        if held_out:
            ax.plot(*zip(*held_out), "o--", color=line.get_color(), markersize=4, linewidth=0.8, label=f"{label}, held out")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("MARS fine-tuning")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_history(path: Path, up_to: int, kind: type = StepLog) -> list:
    """The rows of a JSONL log (``StepLog`` or ``Validation``) up to a step."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [kind(**row) for row in rows if row["step"] <= up_to]


def _write_history(path: Path, history: list) -> None:
    path.write_text("".join(json.dumps(asdict(h)) + "\n" for h in history))


@dataclass
class TrainResult:
    model: torch.nn.Module  # the PEFT-wrapped (or fully trained) model, in train mode
    history: list[StepLog]
    validation: list[Validation]
    steps: int
    total_steps: int
    seconds: float


def train(
    lm,
    examples: list[Example],
    config: TrainConfig,
    out_dir: str | Path,
    *,
    base_spec: str,
    data_path: str = "",
    init_adapter: str | Path | None = None,
    resume: bool = False,
    val_examples: list[Example] | None = None,
    val_every: int = 100,
    val_data: str = "",
    stop_after: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """Fine-tune ``lm`` (a LoadedModel of the base) with the MARS loss and write the outputs to ``out_dir``.

    ``resume`` continues from ``out_dir/checkpoint`` exactly (weights, optimizer,
    schedule, data order, RNG); the checkpoint's hyper-parameters win.
    ``val_examples`` (held-out rows) are measured by ``validate`` before the first
    step, every ``val_every`` steps and at the end, into ``val.jsonl``, the loss
    curve and training.json. ``stop_after`` ends the run early at that step as if
    interrupted (tests).
    """
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    ckpt_dir = out_dir / CHECKPOINT
    saved = None
    if resume:
        saved = read_checkpoint(ckpt_dir)
        changed = {k: v for k, v in saved["config"].items() if asdict(config)[k] != v}
        if changed:
            logger.warning("resuming with the checkpoint's settings %s", changed)
        config = TrainConfig(**saved["config"])
        examples = examples[: saved["examples"]]  # a distilled file may have grown since
        if len(examples) < saved["examples"] or examples_digest(examples) != saved["digest"]:
            raise ValueError("the data file no longer starts with the examples this run was trained on")
        started_from = saved.get("init_adapter")  # for training.json; the checkpoint holds the weights
        init_adapter = None
    elif (ckpt_dir / "state.pt").is_file():
        raise ValueError(f"{out_dir} holds a checkpoint: pass --resume to continue it, or choose another --out")
    else:
        started_from = str(init_adapter) if init_adapter is not None else None
    if not examples:
        raise ValueError("no training examples")
    out_dir.mkdir(parents=True, exist_ok=True)

    accelerator = make_accelerator(lm.model.device)
    device, main, processes = accelerator.device, accelerator.is_main_process, accelerator.num_processes
    torch.manual_seed(config.seed)
    model = attach_lora(lm.model.float().to(device), config, lm.meta.mask_token_id, init_adapter)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    steps = total_steps(len(examples), config, processes)
    scheduler = cosine_schedule(optimizer, steps, config.warmup)  # stepped once per optimizer step, not prepared
    objective, optimizer = accelerator.prepare(MarsObjective(model, config.ar_weight), optimizer)
    step, seconds = 0, 0.0
    if saved is not None:
        if saved.get("processes", 1) != processes:  # the data stream's offset counts them
            written = saved.get("processes", 1)
            raise ValueError(f"this checkpoint was written by {written} processes: resume with as many")
        load_trainable_state(model, saved["trainable"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        _set_rng_state(saved["rng"])
        step, seconds = saved["step"], saved["seconds"]
    history = read_history(out_dir / LOSS_LOG, step)
    val_history = read_history(out_dir / VAL_LOG, step, Validation)
    if main:
        _write_history(out_dir / LOSS_LOG, history)  # drops steps logged after the checkpoint
        if (out_dir / VAL_LOG).is_file():
            _write_history(out_dir / VAL_LOG, val_history)
    n_params = sum(p.numel() for p in params)
    logger.info("training %d of %d parameters for %d steps on %d examples", n_params,
                sum(p.numel() for p in model.parameters()), steps, len(examples))

    pad_id = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    lengths = [len(ex) for ex in examples]
    stream = shard(micro_batches(lengths, config.batch_size, config.seed, start=step * config.grad_accum * processes),
                   accelerator)
    payload = lambda: {  # noqa: E731
        "step": step, "seconds": seconds, "config": asdict(config), "examples": len(examples),
        "digest": examples_digest(examples), "base": base_spec, "data": data_path, "init_adapter": started_from,
        "processes": processes,
    }

    def checkpoint() -> None:
        if not main:
            return
        save_checkpoint(ckpt_dir, model, optimizer, scheduler, payload())
        save_model(model, lm, out_dir, base_spec, config.block_size)
        if history:
            plot_losses(history, out_dir / "loss.png", val_history)

    def measure() -> None:
        if not main or not val_examples or any(v.step == step for v in val_history):
            return
        result, = validate(model, val_examples, lm.meta.mask_token_id, pad_id, config.block_size, step=step)
        val_history.append(result)
        with open(out_dir / VAL_LOG, "a") as sink:
            sink.write(json.dumps(asdict(result)) + "\n")
        logger.info("validation at step %d: %s", step, asdict(result))

    if step == 0:
        measure()  # the starting point
    bar = tqdm(total=steps, initial=step, desc="train", disable=not (progress and main), dynamic_ncols=True)
    try:
        while step < steps and (stop_after is None or step < stop_after):
            started = torch_time()
            optimizer.zero_grad(set_to_none=True)
            sums = torch.zeros(3, device=device)
            for _ in range(config.grad_accum):
                batch = collate([examples[i] for i in next(stream)], lm.meta.mask_token_id, pad_id, config.block_size,
                                noisy=config.objective == "mars")
                with cuda_autocast(device):
                    losses = objective(batch.to(device))  # (loss, noisy_loss, ar_loss)
                accelerator.backward(losses[0] / config.grad_accum)
                sums += losses.detach().float() / config.grad_accum
            accelerator.clip_grad_norm_(params, config.clip)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            step += 1
            seconds += torch_time() - started
            total, noisy, ar = accelerator.gather(sums[None]).mean(dim=0).tolist()  # every process's; one sync
            log = StepLog(step, round(total, 5), round(noisy, 5), round(ar, 5), lr, round(seconds, 2))
            history.append(log)
            if main:
                with open(out_dir / LOSS_LOG, "a") as sink:
                    sink.write(json.dumps(asdict(log)) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{total:.3f}", noisy=f"{noisy:.3f}", ar=f"{ar:.3f}", lr=f"{lr:.2e}")
            if step % val_every == 0 or step == steps:
                measure()
            if step % config.save_every == 0 or step == steps:
                checkpoint()
    except KeyboardInterrupt:
        logger.warning("interrupted at step %d: saving a checkpoint (continue with --resume)", step)
        checkpoint()
        raise
    finally:
        bar.close()

    if step == steps and main:
        summary = describe(config) | {
            "data": data_path, "init_adapter": started_from, "examples": len(examples), "steps": step,
            "epochs": round(step * config.grad_accum * config.batch_size * processes / len(examples), 3),
            "wall_seconds": round(seconds, 1), "seconds_per_step": round(seconds / max(step, 1), 3),
            "hardware": hardware(device) if processes == 1 else f"{processes} processes x {hardware(device)}",
            "base": base_spec, "mask_token": lm.meta.mask_token,
            "mask_token_id": lm.meta.mask_token_id, "trainable_parameters": n_params,
            "final_loss": _tail_mean(history, "loss"), "final_noisy_loss": _tail_mean(history, "noisy_loss"),
            "final_ar_loss": _tail_mean(history, "ar_loss"),
        } | ({
            "noisy_stream": "restricted to the blocks holding response tokens",
            "noisy_block_starts": "left out of the loss ((B+1)-ahead targets decoding never reads)",
        } if config.objective == "mars" else {"noisy_stream": "none: the AR-SFT baseline"}) | ({
            "val_data": val_data, "val_examples": len(val_examples), "validation": asdict(val_history[-1]),
        } if val_history and val_examples else {})
        (out_dir / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return TrainResult(model=model, history=history, validation=val_history, steps=step, total_steps=steps, seconds=seconds)


def _tail_mean(history: list[StepLog], name: str, count: int = 10) -> float | None:
    tail = [getattr(h, name) for h in history[-count:]]
    return round(sum(tail) / len(tail), 4) if tail else None


def torch_time() -> float:
    """Wall time that counts queued GPU work."""
    import time

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()
