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
from .sampling import Sampling, draw, failed_test, held, one_hot, residual


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
        tempered, probs = self.sampling.split(logits)  # (keep, vocab): confidence is read from the first
        p, device = probs[: d + 1], probs.device
        x = torch.tensor(drafts, dtype=torch.long, device=device)
        q = one_hot(drafts, probs.shape[-1], device) if proposal is None else proposal.to(device)
        # the draws, in a fixed order: the masks' guesses, the rule's uniforms, a token for every place it may stop
        guesses = draw(probs[d + 1 :], generator)
        kept = held(p[:d], q, x, torch.rand(d, generator=generator, device=device))
        fixes = draw(torch.cat([residual(p[:d], q), p[d:]]), generator)  # (d + 1,)
        chosen = torch.cat([fixes, guesses])  # (keep,): row i <= d the token if the rule stops there, then guesses
        conf = confidence(tempered, chosen, metric)
        main, fallback = conf[d : d + 1 + L], torch.cat([conf[:1], conf[d + 1 + L :]])
        counts = torch.stack([kept, accept_count(main, tau, metric), accept_count(fallback, tau, metric)])
        packed = torch.cat([
            chosen.double(), conf.double(), confidence(tempered[:d], x, metric).double(), counts.double(),
        ]).tolist()  # the host sync
        keep = probs.shape[0]
        tok, cf, draft_cf = [int(t) for t in packed[:keep]], packed[keep : 2 * keep], packed[2 * keep : 2 * keep + d]
        a, n_main, n_fallback = (int(v) for v in packed[-3:])
        out_tokens, out_conf, origins = drafts[:a], draft_cf[:a], [DRAFT] * a
        back = d + 1 + L  # the first fallback row
        if 0 < a < d:  # a later draft failed: a token from the residual; the fallback guesses past it are drafts
            return Verdict(out_tokens + [tok[a]], out_conf + [cf[a]], origins + [RESAMPLED], a, tok[back + a :],
                           probs[back + a :])
        if a == d:  # every draft held (or there were none): the main group starts at the newest verified token
            group_tok, group_cf, rows, n = tok[d:back], cf[d:back], slice(d + 1, back), n_main
            first = BONUS if d else AR
        else:  # the first draft failed: the fallback group starts at the newest pending token
            group_tok, group_cf, rows, n = [tok[0]] + tok[back:], [cf[0]] + cf[back:], slice(back, None), n_fallback
            first = RESAMPLED
        left = slice(rows.start + n - 1, rows.stop)  # the rows of the guesses left as drafts
        return Verdict(
            out_tokens + group_tok[:n], out_conf + group_cf[:n], origins + [first] + [MASK] * (n - 1), a,
            group_tok[n:], _untested(probs[left], tempered[left], tau, metric),
        )


def _untested(q: torch.Tensor, tempered: torch.Tensor, tau: float, metric: str) -> torch.Tensor:
    """The q (d, vocab) of the guesses left as drafts: the first failed the confidence test when tau < 1."""
    if tau >= 1.0 or metric != "probability" or not q.shape[0]:
        return q
    return torch.cat([failed_test(q[0], tempered[0], tau)[None], q[1:]])
