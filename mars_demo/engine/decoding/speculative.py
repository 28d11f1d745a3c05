"""Exact and hybrid modes at a temperature: drafts checked by the speculative-sampling rule (docs/METHOD.md,
"Sampling without loss").

A verifying pass feeds what it feeds at temperature 0 (exact.verify_window); only the reading of its
logits (keep, vocab) changes. p, the sampling distribution of the AR head (temperature, top-k, top-p),
is read at the newest pending token and at each draft; every mask's guess is drawn from the mask's own
distribution at the same settings, and that distribution is kept as the guess's q for the pass that
checks it. The drafts are checked by the rule (sampling.held); the token after the kept ones is drawn
from max(0, p - q) after a rejection (RESAMPLED) or from p when every draft held (BONUS; AR when there
were none). Which group of guesses follows, and hybrid's acceptance on confidence, are exact.verify's.

In hybrid mode (tau < 1) the guesses that follow the AR head's token are accepted while confident, as in
MARS; the first one that is not becomes a draft, and by the probability metric its q is the mask's
distribution given that it failed the test (sampling.failed_test), so the rule stays exact for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends.placement import SeededGenerator
from . import exact
from .acceptance import accept_count, confidence
from .exact import AR, BONUS, DRAFT, MASK, RESAMPLED, Verdict
from .sampling import Sampling, draw, failed_test, held, residual


def pick_drafts(
    history: list[int], drafts: list[int], proposal: torch.Tensor | None, depth: int, lookup: bool
) -> tuple[list[int], torch.Tensor | None]:
    """exact.pick_drafts (``lookup``: an exact pass) or the first ``depth`` drafts, with the q of each.

    proposal: (d, vocab) the q each draft was drawn from; None for drafts copied from the text (one-hot)
    and at temperature 0, where nothing reads it.
    """
    if lookup and (copied := exact.lookup(history, depth, ngram=3)):
        return copied, None
    if drafts[:depth] or not lookup:
        return drafts[:depth], proposal[:depth] if proposal is not None else None
    return exact.lookup(history, depth, ngram=2), None


@dataclass(frozen=True)
class Rule:
    """What a sampled verifying pass draws with: the settings and the run's generator."""

    sampling: Sampling
    generator: SeededGenerator

    def verify(
        self, logits: torch.Tensor, drafts: list[int], lookahead: int, tau: float, metric: str,
        proposal: torch.Tensor | None,
    ) -> Verdict:
        """exact.verify by the rule; ``proposal`` (d, vocab) the drafts' q (None: copied, one-hot). One host sync.

        Rows of ``logits``: 0 the newest pending token, 1..d the drafts, L main masks, the fallback masks.
        """
        d, L = len(drafts), lookahead
        generator = self.generator.on(logits.device)
        tempered, support, probs = self.sampling.support(logits)  # (keep, vocab), (keep, k) and (keep, k)
        device = probs.device
        x = torch.tensor(drafts, dtype=torch.long, device=device)
        columns, p, q, at = _places(support[:d], probs[:d], x, proposal)
        # the draws, in a fixed order: the masks' guesses, the rule's uniforms, a token for every place it may stop
        guesses = _token(support[d + 1 :], draw(probs[d + 1 :], generator))
        kept = held(p, q, at, torch.rand(d, generator=generator, device=device))
        last = torch.nn.functional.pad(probs[d : d + 1], (0, 1)), torch.nn.functional.pad(support[d : d + 1], (0, 1))
        fixes = _token(torch.cat([columns, last[1]]), draw(torch.cat([residual(p, q), last[0]]), generator))
        chosen = torch.cat([fixes, guesses])  # (keep,): row i <= d the token if the rule stops there, then guesses
        conf = confidence(tempered, chosen, metric)
        main, fallback = conf[d : d + 1 + L], torch.cat([conf[:1], conf[d + 1 + L :]])
        counts = torch.stack([kept, accept_count(main, tau, metric), accept_count(fallback, tau, metric)])
        packed = torch.cat([
            chosen.double(), conf.double(), confidence(tempered[:d], x, metric).double(), counts.double(),
        ]).tolist()  # the host sync
        dense = _Dense(support, probs, tempered.shape[-1])  # rows read back as (n, vocab): the next pass's q
        keep = tempered.shape[0]
        tok, cf, draft_cf = [int(t) for t in packed[:keep]], packed[keep : 2 * keep], packed[2 * keep : 2 * keep + d]
        a, n_main, n_fallback = (int(v) for v in packed[-3:])
        out_tokens, out_conf, origins = drafts[:a], draft_cf[:a], [DRAFT] * a
        back = d + 1 + L  # the first fallback row
        if 0 < a < d:  # a later draft failed: a token from the residual; the fallback guesses past it are drafts
            return Verdict(out_tokens + [tok[a]], out_conf + [cf[a]], origins + [RESAMPLED], a, tok[back + a :],
                           dense[back + a :])
        if a == d:  # every draft held (or there were none): the main group starts at the newest verified token
            group_tok, group_cf, rows, n = tok[d:back], cf[d:back], slice(d + 1, back), n_main
            first = BONUS if d else AR
        else:  # the first draft failed: the fallback group starts at the newest pending token
            group_tok, group_cf, rows, n = [tok[0]] + tok[back:], [cf[0]] + cf[back:], slice(back, None), n_fallback
            first = RESAMPLED
        left = slice(rows.start + n - 1, rows.stop)  # the rows of the guesses left as drafts
        return Verdict(
            out_tokens + group_tok[:n], out_conf + group_cf[:n], origins + [first] + [MASK] * (n - 1), a,
            group_tok[n:], _untested(dense[left], tempered[left], tau, metric),
        )


def _places(
    support: torch.Tensor, probs: torch.Tensor, drafts: torch.Tensor, proposal: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafts' places over their support and one more column: (columns, p, q, at), each (d, k + 1) but
    ``at`` (d,), the column of each draft.

    The extra column is the draft itself where p leaves it out (p 0 there, q its q), so held reads p(x) and
    q(x) and the residual max(0, p - q) keeps all its mass (p's support) in the columns.
    """
    match = support == drafts[:, None]
    outside = ~match.any(-1, keepdim=True)  # (d, 1)
    columns = torch.cat([support, drafts[:, None]], -1)
    p = torch.nn.functional.pad(probs, (0, 1))
    q = (columns == drafts[:, None]).float() if proposal is None else proposal.to(probs.device).gather(-1, columns)
    q = torch.cat([q[:, :-1], q[:, -1:] * outside], -1)
    at = torch.where(outside.squeeze(-1), support.shape[-1], match.long().argmax(-1))
    return columns, p, q, at


def _token(columns: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(rows,) the tokens at ``index`` (rows,) in ``columns`` (rows, k)."""
    return columns.gather(-1, index[:, None]).squeeze(-1)


@dataclass(frozen=True)
class _Dense:
    """A pass's sparse sampling distributions, read back by rows as dense (n, vocab): the q of next pass's drafts."""

    support: torch.Tensor
    probs: torch.Tensor
    vocab: int

    def __getitem__(self, rows: slice) -> torch.Tensor:
        support, probs = self.support[rows], self.probs[rows]
        dense = torch.zeros(probs.shape[0], self.vocab, dtype=probs.dtype, device=probs.device)
        return dense.scatter_(1, support, probs)


def _untested(q: torch.Tensor, tempered: torch.Tensor, tau: float, metric: str) -> torch.Tensor:
    """The q (d, vocab) of the guesses left as drafts: the first failed the confidence test when tau < 1."""
    if tau >= 1.0 or metric != "probability" or not q.shape[0]:
        return q
    return torch.cat([failed_test(q[0], tempered[0], tau)[None], q[1:]])
