"""What a sampled pass draws from, and the speculative-sampling rule (docs/METHOD.md, "Sampling without loss").

The distribution: logits / temperature; with ``top_k`` only the k most likely tokens stay (ties at the
k-th stay too, as in transformers); with ``top_p`` only the smallest set of most likely tokens whose
probability reaches top_p (the nucleus, Holtzman et al. 2020); renormalised. At temperature 0 decoding
is greedy and neither filter applies: the argmax always survives both.

The rule (Leviathan et al. 2023; Chen et al. 2023): a draft x drawn from q is kept with probability
min(1, p(x) / q(x)); at the first rejection one token is drawn from max(0, p - q), normalised; when
every draft holds, one more (the bonus) from p. Each committed token is then distributed exactly as
sampling from p given the tokens before it. A draft copied from the text (lookup) has a one-hot q.
Pure tensor functions; the draws take a ``torch.Generator`` (None: torch's global one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FIRST_K = 64  # the nucleus is looked for among the top FIRST_K tokens, then 8x more, ...: no full sort


def check_top_p(top_p) -> float:
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top-p must be above 0 and at most 1 (1 = off), got {top_p}")
    return float(top_p)


def check_top_k(top_k) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, (int, float)) or not math.isfinite(top_k) \
            or top_k != int(top_k) or top_k < 0:
        raise ValueError(f"top-k must be a whole number of at least 0 (0 = off), got {top_k}")
    return int(top_k)


def check_temperature(temperature, most: float = math.inf) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not (math.isfinite(temperature) and 0.0 <= float(temperature) <= most):
        raise ValueError(f"temperature must be between 0 and {most:g}, got {temperature}")
    return float(temperature)


@dataclass(frozen=True)
class Sampling:
    """How a token is drawn: temperature (0: greedy), top_p (1: off), top_k (0: off).

    Confidence (MARS's tau, hybrid's) is read from the tempered distribution before the filters, so a
    filter changes which tokens can be drawn, not how sure the model is of them: with top_k = 1 every
    guess would otherwise look certain.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        check_top_p(self.top_p)
        check_top_k(self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def keep(self, scaled: torch.Tensor, tempered: torch.Tensor) -> torch.Tensor | None:
        """(..., vocab) bool, the tokens top-k and then top-p leave; None without filters.

        scaled: logits / temperature; tempered: their softmax.
        """
        keep = None
        if 0 < self.top_k < scaled.shape[-1]:
            keep = scaled >= scaled.topk(self.top_k, dim=-1).values[..., -1:]
        if self.top_p < 1.0:
            probs = tempered if keep is None else _normalised(tempered * keep)  # the nucleus of what top-k left
            kept = nucleus(probs, self.top_p)
            keep = kept if keep is None else keep & kept
        return keep

    def filter(self, scaled: torch.Tensor, tempered: torch.Tensor) -> torch.Tensor:
        """(..., vocab) ``scaled`` logits with -inf outside the top-k and the nucleus (``keep``)."""
        keep = self.keep(scaled, tempered)
        return scaled if keep is None else scaled.masked_fill(~keep, -math.inf)

    def split(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tempered, drawn), each (..., vocab): softmax(logits / temperature), which confidence is read from,
        and the distribution a token is drawn from (the filters applied; the same tensor without them)."""
        scaled = logits.float() / self.temperature
        tempered = torch.softmax(scaled, dim=-1)
        keep = self.keep(scaled, tempered)
        return tempered, tempered if keep is None else _normalised(tempered * keep)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., vocab) the distribution a token is drawn from."""
        return self.split(logits)[1]

    def support(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tempered, tokens, probs): ``split``'s distributions with the drawn one kept sparse.

        tempered (rows, vocab) as split's; tokens (rows, k) a set of tokens holding everything the filters
        leave, most likely first, and probs (rows, k) the distribution a token is drawn from over them (0 at
        those the filters drop). Without filters the set is the whole vocabulary, in its order; with them the
        top FIRST_K tokens, then 8x more, ..., until the set is sure to hold every token kept (ties included),
        so a pass's sampling work is over k columns, not the vocabulary.
        """
        scaled = logits.float() / self.temperature
        tempered = torch.softmax(scaled, dim=-1)
        rows, vocab = scaled.shape
        if not self.filtered:
            return tempered, torch.arange(vocab, device=scaled.device).expand(rows, vocab), tempered
        k = min(max(FIRST_K, self.top_k + 1), vocab)
        while True:
            values, tokens = scaled.topk(k, dim=-1)  # most likely first: softmax keeps the order
            kept, whole = _kept(values, tempered.gather(-1, tokens), self.top_k, self.top_p)
            if k == vocab or whole:
                return tempered, tokens, _normalised(kept)
            k = min(8 * k, vocab)


def _normalised(weights: torch.Tensor) -> torch.Tensor:
    return weights / weights.sum(-1, keepdim=True)


def _kept(values: torch.Tensor, top: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, bool]:
    """(rows, k) ``top`` (the tempered probabilities of the top k tokens by ``values``, their scaled logits)
    where top-k and then top-p keep them, else 0; and whether no token past the k can be kept.

    The same sets as ``Sampling.keep``: top-k keeps what reaches the top_k-th value, ties included; top-p the
    smallest set whose mass (of what top-k left, renormalised) reaches top_p, ties at its edge included.
    """
    k, whole = values.shape[-1], True
    if 0 < top_k < k:
        edge = values[..., top_k - 1 : top_k]
        top = top * (values >= edge)
        whole = bool((values[..., -1:] < edge).all())  # a tie past the k would be kept too
    elif top_k:
        whole = False
    if top_p < 1.0:
        probs = top / top.sum(-1, keepdim=True) if top_k else top  # without top-k, top is already of the vocabulary
        reach = probs.cumsum(-1)
        edge = probs.gather(-1, ((reach - probs) < top_p).sum(-1, keepdim=True) - 1)
        top = top * (probs >= edge)
        if not top_k:  # the nucleus must be reached within the k, and nothing past them tie its edge
            whole = bool(((reach[..., -1:] >= top_p) & (probs[..., -1:] < edge)).all())
    return top, whole


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(..., vocab) bool: the smallest set of most likely tokens whose mass reaches ``top_p`` (ties at its edge kept).

    A token stays when the mass of the tokens before it, most likely first, is below top_p; so the most
    likely token always stays. Looked for among the top FIRST_K tokens first, as a full sort of a large
    vocabulary costs more than the pass's other sampling work.
    """
    vocab = probs.shape[-1]
    k = min(FIRST_K, vocab)
    while True:
        top = probs.topk(k, dim=-1).values  # (..., k), most likely first
        reach = top.cumsum(-1)
        if k == vocab or bool((reach[..., -1] >= top_p).all()):
            break
        k = min(8 * k, vocab)
    kept = ((reach - top) < top_p).sum(-1, keepdim=True)  # (..., 1), at least 1
    return probs >= top.gather(-1, kept - 1)


BLOCK = 256  # draw: the cumulative sum is taken over blocks of BLOCK tokens, then inside the chosen one


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``weights`` (rows, vocab), non-negative and not all zero (normalised or not).

    By the inverse of the cumulative sum, one uniform per row (torch.multinomial draws one per token): the
    block whose cumulative mass first passes u, then the token inside it; a full cumulative sum over a
    large vocabulary costs more than the rest of a pass's sampling.
    """
    rows, vocab = weights.shape
    if vocab <= BLOCK:  # one block: the cumulative sum at once
        cdf = weights.double().cumsum(-1)
        u = torch.rand(rows, 1, generator=generator, device=weights.device, dtype=torch.float64) * cdf[:, -1:]
        return _first_past(cdf, u, weights > 0)
    blocks = -(-vocab // BLOCK)
    tiled = torch.nn.functional.pad(weights, (0, blocks * BLOCK - vocab)).view(rows, blocks, BLOCK)
    cdf = tiled.sum(-1, dtype=torch.float64).cumsum(-1)  # (rows, blocks)
    u = torch.rand(rows, 1, generator=generator, device=weights.device, dtype=torch.float64) * cdf[:, -1:]
    block = _first_past(cdf, u, cdf.diff(dim=-1, prepend=cdf.new_zeros(rows, 1)) > 0)  # (rows,)
    chosen = tiled[torch.arange(rows, device=weights.device), block]  # (rows, BLOCK)
    before = torch.where(block > 0, cdf.gather(-1, (block - 1).clamp_min(0)[:, None]).squeeze(-1), 0.0)
    inner = chosen.double().cumsum(-1) + before[:, None]
    return block * BLOCK + _first_past(inner, u, chosen > 0)


def _first_past(cdf: torch.Tensor, u: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """(rows,) the first place whose cumulative sum passes u (rows, 1), else, where rounding puts u at the very
    end, the last place with any weight (``positive``)."""
    index = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    last = cdf.shape[-1] - 1 - positive.flip(-1).long().argmax(-1)
    return torch.minimum(index, last)


def held(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """How many leading drafts the rule keeps, (...,).

    p, q: (..., d, vocab) the verifier's and the drafter's distributions at each draft's place; drafts
    (..., d); uniforms (..., d) in [0, 1). Draft i is kept when u_i * q_i(x_i) < p_i(x_i), i.e. with
    probability min(1, p/q), and only while every draft before it was.
    """
    at = drafts[..., None]
    kept = uniforms * q.gather(-1, at).squeeze(-1) < p.gather(-1, at).squeeze(-1)
    return kept.long().cumprod(-1).sum(-1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(d, vocab) max(0, p - q), unnormalised: what a rejected draft's place is drawn from.

    A row with nothing left (p and q equal to float rounding, where no rejection can happen) gives p.
    """
    rest = (p - q).clamp_min(0)
    empty = rest.sum(-1, keepdim=True) <= 0
    return torch.where(empty, p, rest)


def failed_test(q: torch.Tensor, tempered: torch.Tensor, tau: float) -> torch.Tensor:
    """q (vocab,) given that its draw failed the confidence test ``tempered(x) >= tau``: q where tempered < tau,
    renormalised.

    Hybrid mode offers a mask's guess as a draft only when its confidence failed, so by the probability
    metric the guess was drawn from this, not from q (the entropy and margin tests do not depend on the
    guess). tau is compared as fp32, the way ``accept_count`` compares it.
    """
    low = q * (tempered < tau)
    total = low.sum()
    return torch.where(total > 0, low / total.clamp_min(1e-30), q)

