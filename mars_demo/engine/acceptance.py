"""Choosing the candidates of one pass and how many of them to accept (docs/METHOD.md, "Decoding").

Candidate 1 comes from the last real token and is always accepted; candidate k is
accepted while every candidate before it was and its confidence passes tau.
tau = 1.0 accepts exactly one token per pass for every metric, also where a
saturated softmax reports a confidence of exactly 1.0. ``choose``, ``confidence`` and
``accept_count`` are pure tensor functions; ``accept_rows`` puts them together for
every decoder, with the pass's one host sync.
"""

from __future__ import annotations

import torch


def choose(
    logits: torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per position: argmax, or Gumbel-max sampling at ``temperature``.

    logits: (..., vocab). Returns (tokens, probs): tokens (...), and the
    probabilities (..., vocab) of the distribution they were drawn from.
    """
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        uniform = torch.rand(logits.shape, generator=generator, device=logits.device).clamp(1e-10, 1 - 1e-7)
        gumbel = -torch.log(-torch.log(uniform))
        tokens = (logits + gumbel).argmax(dim=-1)
    else:
        tokens = logits.argmax(dim=-1)
    return tokens, probs


def confidence(probs: torch.Tensor, tokens: torch.Tensor, metric: str = "probability") -> torch.Tensor:
    """Per-position confidence (...,) of the chosen tokens under ``metric``.

    probability: p(chosen); margin: top1 - top2 probability; entropy: H in nats
    (for entropy, smaller is more confident).
    """
    if metric == "probability":
        return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if metric == "margin":
        top = probs.topk(2, dim=-1).values
        return top[..., 0] - top[..., 1]
    if metric == "entropy":
        return -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    raise ValueError(f"unknown acceptance metric {metric!r}")


def accept_count(conf: torch.Tensor, tau: float, metric: str = "probability") -> torch.Tensor:
    """How many leading candidates to accept, per row.

    conf: (..., window) confidences of candidates 1..window. Returns (...,) counts
    in [1, window]: 1 + the length of the run of passing candidates after the first.
    """
    if tau >= 1.0:
        return torch.ones(conf.shape[:-1], dtype=torch.long, device=conf.device)
    passing = conf <= tau if metric == "entropy" else conf >= tau
    passing[..., 0] = True  # candidate 1 is the AR token: always accepted
    return passing.long().cumprod(dim=-1).sum(dim=-1)


def accept_rows(
    logits: torch.Tensor,
    start: list[int],
    cap: list[int],
    tau: float,
    metric: str = "probability",
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's candidates and accepted prefix, with a single host sync for the whole pass.

    logits: (rows, window, vocab). Row r's candidates are the outputs at columns
    start[r], start[r] + 1, ... of the window; it may accept at most cap[r] of them
    (0 for a row that is waiting or finished). Candidate 1 is always accepted
    when cap[r] >= 1, the rest by ``accept_count``.
    """
    window = logits.shape[1]
    device = logits.device
    tokens, probs = choose(logits, temperature, generator)  # (rows, window), (rows, window, vocab)
    conf = confidence(probs, tokens, metric)  # (rows, window)
    index = (torch.tensor(start, device=device)[:, None] + torch.arange(window, device=device)).clamp(0, window - 1)
    tokens, conf = tokens.gather(1, index), conf.gather(1, index)  # candidates 1..window of each row
    n = accept_count(conf, tau, metric).minimum(torch.tensor(cap, device=device))  # (rows,)
    packed = torch.cat([tokens.double(), conf.double(), n.double()[:, None]], dim=1).tolist()
    out_tokens, out_conf = [], []
    for row in packed:
        k = int(row[-1])
        out_tokens.append([int(t) for t in row[:k]])
        out_conf.append(row[window : window + k])
    return out_tokens, out_conf


def accept_prefix(
    logits: torch.Tensor, tau: float, metric: str = "probability", temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[float]]:
    """One sequence's pass: logits (window, vocab) -> (accepted tokens, their confidences)."""
    tokens, confs = accept_rows(logits[None], [0], [logits.shape[0]], tau, metric, temperature, generator)
    return tokens[0], confs[0]
