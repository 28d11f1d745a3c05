"""Exact mode: the masks draft, the next pass verifies (docs/METHOD.md, "Exact and hybrid modes").

A verifying pass feeds [pending | drafts | L masks | L fallback masks], L = B - 1.
The AR outputs at the newest pending token and at each draft check the drafts;
the longest matching prefix is kept (its keys and values are already right) plus
the AR head's own next token. The masks after the drafts guess what follows when
every draft holds; the fallback masks sit right after the newest pending token
and see only the verified prefix (a 4-D attention mask), so a rejection still
leaves guesses for the next pass to verify. With tau < 1 (hybrid), the guesses of
the group that starts at the newest verified token are accepted on confidence as
in MARS, and the rest become drafts. Every committed token is the AR argmax given
the tokens before it, so at tau = 1.0 the output is greedy AR's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import accept_count, choose, confidence

# Where a committed token came from: the AR head of the pass, a verified draft, a mask accepted on confidence.
AR, DRAFT, MASK = "ar", "draft", "mask"


@dataclass(frozen=True)
class Fed:
    """What one verifying pass feeds: ids (1, n), and where it needs them, position ids and a 4-D mask."""

    ids: torch.Tensor
    position_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    keep: int  # logits of the last ``keep`` columns: the newest pending token, the drafts and both mask groups

    @property
    def width(self) -> int:
        return self.ids.shape[1]


def verify_window(
    pending: list[int], drafts: list[int], lookahead: int, mask_id: int, cached: int, dtype: torch.dtype, device,
    fallback: bool = True,
) -> Fed:
    """[pending | drafts | L masks | L fallback masks]; no fallback group (and no custom mask) without drafts.

    The fallback masks take the positions right after the newest pending token and
    attend to the cache, the pending tokens and each other only. ``fallback=False``
    is the simpler scheme that leaves the pass after a rejection without drafts.
    """
    k, d, L = len(pending), len(drafts), lookahead
    g = L if d and fallback else 0
    ids = torch.tensor([pending + drafts + [mask_id] * (L + g)], dtype=torch.long, device=device)
    keep = 1 + d + L + g
    if not g:
        return Fed(ids, None, None, keep)
    main = k + d + L
    n = main + g
    positions = torch.cat([torch.arange(main), torch.arange(k, k + g)]).to(device) + cached  # (n,)
    allowed = torch.ones(n, cached + n, dtype=torch.bool, device=device)
    allowed[:, cached:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    allowed[main:, cached + k : cached + main] = False  # fallback masks do not see the drafts or the main masks
    mask = torch.zeros(n, cached + n, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return Fed(ids, positions[None], mask[None, None], keep)


@dataclass(frozen=True)
class Verdict:
    """The outcome of a verifying pass, host side.

    tokens, confidences, origins: committed tokens (verified drafts, the AR token,
      masks accepted on confidence), in order. cached: how many of them (the verified
      drafts) already have their keys and values in the cache. drafts: the next
      pass's drafts.
    """

    tokens: list[int]
    confidences: list[float]
    origins: list[str]
    cached: int
    drafts: list[int]


def verify(logits: torch.Tensor, drafts: list[int], lookahead: int, tau: float, metric: str) -> Verdict:
    """Greedy verification of ``drafts`` and the next drafts, from the logits (keep, vocab) of verify_window.

    Rows: 0 the newest pending token, 1..d the drafts, then L main masks, then the
    fallback masks (L or none). One host sync.
    """
    d, L = len(drafts), lookahead
    g = logits.shape[0] - (1 + d + L)
    tokens, probs = choose(logits)  # (keep,), (keep, vocab)
    conf = confidence(probs, tokens, metric)  # (keep,)
    held = (tokens[:d] == torch.tensor(drafts, dtype=torch.long, device=tokens.device)).long().cumprod(0).sum()
    main = slice(d, d + 1 + L)  # the AR token after the last draft, then the main masks' guesses
    fallback = torch.cat([tokens[:1], tokens[d + 1 + L :]]), torch.cat([conf[:1], conf[d + 1 + L :]])
    n_main = accept_count(conf[main], tau, metric)
    n_fallback = accept_count(fallback[1], tau, metric)
    packed = torch.cat([
        tokens.double(), conf.double(), fallback[0].double(), fallback[1].double(),
        torch.stack([held, n_main, n_fallback]).double(),
    ]).tolist()
    keep = tokens.shape[0]
    tok, cf = [int(t) for t in packed[:keep]], packed[keep : 2 * keep]
    fb_tok, fb_cf = [int(t) for t in packed[2 * keep : 2 * keep + 1 + g]], packed[2 * keep + 1 + g : -3]
    a, n_main, n_fallback = (int(x) for x in packed[-3:])
    out_tokens, out_conf = drafts[:a], cf[:a]  # a draft's confidence: the AR probability that verified it
    origins = [DRAFT] * a
    if a == d:  # every draft held: the main group starts at the newest verified token
        group_tok, group_cf, n = tok[d : d + 1 + L], cf[d : d + 1 + L], n_main
    elif a == 0:  # the first draft failed: the fallback group starts at the newest pending token
        group_tok, group_cf, n = fb_tok, fb_cf, n_fallback
    else:  # a later draft failed: the AR token corrects it; the fallback guesses past it are the next drafts
        return Verdict(out_tokens + [tok[a]], out_conf + [cf[a]], origins + [AR], a, fb_tok[1 + a :])
    return Verdict(
        out_tokens + group_tok[:n], out_conf + group_cf[:n], origins + [AR] + [MASK] * (n - 1), a, group_tok[n:]
    )
