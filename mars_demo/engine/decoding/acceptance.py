"""Choosing the candidates of one pass and how many of them to accept (docs/METHOD.md, "Decoding").

Candidate 1 comes from the last real token and is always accepted; candidate k is
accepted while every candidate before it was and its confidence passes tau.
tau = 1.0 accepts exactly one token per pass for every metric, also where a
saturated softmax reports a confidence of exactly 1.0. ``choose``, ``confidence`` and
``accept_count`` are pure tensor functions; ``accept_rows`` puts them together for
every decoder, with the pass's one host sync.

Greedy decoding by probability (the default) needs only each row's argmax and its probability, not
the whole softmax: ``greedy`` gets both in one native call (``csrc/greedy.cpp``, built on first use
like the other kernels; ``MARS_DEMO_GREEDY=0`` or no compiler: the torch ops). The tokens are
argmax's; the probabilities agree with softmax's to float rounding.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from ..backends.cpu.greedy import GREEDY_ENV, greedy_kernel  # noqa: F401 - GREEDY_ENV: the switch's name
from .sampling import Sampling

_I, _P = ctypes.c_int64, ctypes.c_void_p


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(tokens, probabilities) (...,) of the argmax of fp32 CPU ``logits`` (..., vocab), natively; None where
    the kernel cannot take them (another dtype or device, no kernel)."""
    function = greedy_kernel()
    if function is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(-1) != 1:
        return None
    rows = logits.reshape(-1, logits.shape[-1])  # a view where the logits are contiguous
    tokens = torch.empty(rows.shape[0], dtype=torch.long)
    probs = torch.empty(rows.shape[0], dtype=torch.float32)
    function(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), tokens.data_ptr(), probs.data_ptr(),
             torch.get_num_threads())
    return tokens.view(logits.shape[:-1]), probs.view(logits.shape[:-1])


def greedy_confidence(logits: torch.Tensor, metric: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens (...,) and their confidences (...,) under ``metric``: ``greedy`` where it applies."""
    found = greedy(logits) if metric == "probability" else None
    if found is not None:
        return found
    tokens, probs = choose(logits)
    return tokens, confidence(probs, tokens, metric)


def choose(
    logits: torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None,
    top_p: float = 1.0, top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per position: argmax, or Gumbel-max sampling at ``temperature`` (within top_p and top_k).

    logits: (..., vocab). Returns (tokens, probs): tokens (...), and the probabilities (..., vocab) of
    softmax(logits / temperature), which confidence is read from (before top_p and top_k: sampling.Sampling).
    """
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        uniform = torch.rand(logits.shape, generator=generator, device=logits.device).clamp(1e-10, 1 - 1e-7)
        gumbel = -torch.log(-torch.log(uniform))
        drawn = Sampling(temperature, top_p, top_k).filter(logits, probs)  # -inf outside top-k and top-p
        tokens = (drawn + gumbel).argmax(dim=-1)
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


@lru_cache(maxsize=256)  # a serving policy's taus are many; a slider's, a few
def _as_fp32(tau: float) -> float:
    return float(torch.tensor(tau, dtype=torch.float32))


def accept_rows(
    logits: torch.Tensor,
    start: list[int],
    cap: list[int],
    tau: float,
    metric: str = "probability",
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's candidates and accepted prefix, with a single host sync for the whole pass.

    logits: (rows, window, vocab). Row r's candidates are the outputs at columns
    start[r], start[r] + 1, ... of the window; it may accept at most cap[r] of them
    (0 for a row that is waiting or finished). Candidate 1 is always accepted
    when cap[r] >= 1, the rest by ``accept_count``. Sampled confidences are read from the tempered
    distribution, before top_p and top_k.
    """
    window = logits.shape[1]
    if temperature > 0:
        tokens, probs = choose(logits, temperature, generator, top_p, top_k)  # (rows, window), (rows, window, vocab)
        conf = confidence(probs, tokens, metric)  # (rows, window)
    else:
        tokens, conf = greedy_confidence(logits, metric)
    if tokens.device.type == "cpu":  # nothing to wait for: two lists, not four ops to make one
        tokens, conf = tokens.tolist(), conf.tolist()
    else:
        tokens, conf = torch.stack([tokens.double(), conf.double()]).tolist()  # the host sync, one for both
    # a few numbers a row: host lists beat tensor ops here
    bar = _as_fp32(tau)  # tau as accept_count compares fp32 confidences
    out_tokens, out_conf = [], []
    for r in range(len(start)):
        at = [min(max(start[r] + k, 0), window - 1) for k in range(window)]  # candidates 1..window
        passing = [(conf[r][i] <= bar) if metric == "entropy" else (conf[r][i] >= bar) for i in at]
        n = 1 if tau >= 1.0 else next((k for k in range(1, window) if not passing[k]), window)
        n = min(n, cap[r])
        out_tokens.append([int(tokens[r][i]) for i in at[:n]])
        out_conf.append([conf[r][i] for i in at[:n]])
    return out_tokens, out_conf


def accept_prefix(
    logits: torch.Tensor, tau: float, metric: str = "probability", temperature: float = 0.0,
    generator: torch.Generator | None = None, top_p: float = 1.0, top_k: int = 0,
) -> tuple[list[int], list[float]]:
    """One sequence's pass: logits (window, vocab) -> (accepted tokens, their confidences)."""
    tokens, confs = accept_rows(
        logits[None], [0], [logits.shape[0]], tau, metric, temperature, generator, top_p, top_k
    )
    return tokens[0], confs[0]
