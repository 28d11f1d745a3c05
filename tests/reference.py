"""Uncached reference decoders: every pass recomputes the whole sequence plus the masks.

Slow and obviously right; the tests hold the cached decoders to them token for token.
The sliding window offers B candidates every pass; the block-capped variant (the
semantics of the block-level batch scheme) offers only those up to the end of the
current output block of B.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from mars_demo.engine.decoding import exact
from mars_demo.engine.decoding.acceptance import accept_count, choose, confidence
from mars_demo.engine.decoding.commit import EOS, commit_tokens
from mars_demo.engine.decoding.loop import capped_width


@torch.inference_mode()
def reference_decode(
    model: PreTrainedModel,
    prompt: list[int],
    *,
    block_size: int,
    mask_id: int,
    tau: float,
    max_new_tokens: int,
    stop_ids: set[int],
    metric: str = "probability",
    block_capped: bool = False,
    max_fed: int | None = None,
) -> tuple[list[int], list[int]]:
    """Greedy MARS decoding without a cache. Returns (generated ids, tokens accepted per pass).

    ``max_fed`` caps the tokens a cached pass would feed (see ``DecodeConfig``).
    """
    generated: list[int] = []
    per_pass: list[int] = []
    while len(generated) < max_new_tokens:
        window = block_size - len(generated) % block_size if block_capped else block_size
        if max_fed is not None and per_pass:
            window = capped_width(window, per_pass[-1], max_fed)  # the last pass's tokens are fed again
        fed = torch.tensor([prompt + generated + [mask_id] * (window - 1)], device=model.device)
        logits = model(input_ids=fed).logits[0, -window:]  # (window, vocab)
        tokens, probs = choose(logits)
        n = int(accept_count(confidence(probs, tokens, metric), tau, metric))
        if _commit(tokens[:n].tolist(), generated, per_pass, max_new_tokens, stop_ids):
            break
    return generated, per_pass


def _commit(
    accepted: list[int], generated: list[int], per_pass: list[int], max_new_tokens: int, stop_ids: set[int]
) -> bool:
    """Append one pass's tokens (commit.commit_tokens); True when decoding ends there at a stop token."""
    accepted, finish = commit_tokens(accepted, max_new_tokens - len(generated), stop_ids)
    generated += accepted
    per_pass.append(len(accepted))
    return finish == EOS


@torch.inference_mode()
def reference_exact(
    model: PreTrainedModel,
    prompt: list[int],
    *,
    block_size: int,
    mask_id: int,
    tau: float,
    max_new_tokens: int,
    stop_ids: set[int],
    metric: str = "probability",
) -> tuple[list[int], list[int]]:
    """Greedy verifying decoding (exact / hybrid) without a cache or a 4-D mask.

    Each pass runs the sequence + drafts + L masks, and (when there are drafts) the
    sequence + L masks for the fallback guesses: two plain causal forwards where the
    cached decoder runs one with a custom mask. Returns (generated ids, tokens per pass).
    """
    L = block_size - 1
    generated: list[int] = []
    drafts: list[int] = []
    per_pass: list[int] = []

    def candidates(ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -n:]  # (n, vocab)
        tokens, probs = choose(logits)
        return tokens.tolist(), confidence(probs, tokens, metric)

    while len(generated) < max_new_tokens:
        seq = prompt + generated
        if tau >= 1.0:  # exact passes also draft by lookup (exact.pick_drafts)
            drafts = exact.pick_drafts(seq, drafts, L)
        tokens, conf = candidates(seq + drafts + [mask_id] * L, 1 + len(drafts) + L)
        a = 0
        while a < len(drafts) and drafts[a] == tokens[a]:
            a += 1
        accepted = drafts[:a]
        if a == len(drafts):  # every draft held: MARS acceptance on the window after the last one
            group, group_conf = tokens[a:], conf[a:]
        else:
            group, group_conf = candidates(seq + [mask_id] * L, 1 + L)
            if a > 0:  # the AR token corrects draft a + 1; the fallback guesses past it are drafts
                group, group_conf = [tokens[a]] + group[1 + a :], None
        n = int(accept_count(group_conf, tau, metric)) if group_conf is not None else 1
        drafts = group[n:]
        if _commit(accepted + group[:n], generated, per_pass, max_new_tokens, stop_ids):
            break
    return generated, per_pass


@torch.inference_mode()
def reference_tree(
    model: PreTrainedModel,
    prompt: list[int],
    *,
    block_size: int,
    mask_id: int,
    shape: tuple[int, ...],
    tau: float,
    max_new_tokens: int,
    stop_ids: set[int],
    metric: str = "probability",
) -> tuple[list[int], list[int]]:
    """Greedy verification of candidate trees of a fixed ``shape`` (decoding/tree.py) without a cache or a 4-D mask.

    Depth by depth, AR's token after the path held so far is a plain causal forward over the sequence and that
    path; a depth holds when that token is among the depth's top b candidates. The main masks are another
    forward (after the main path), the fallback masks another (after the sequence). Returns (generated ids,
    tokens per pass).
    """
    L, exact_pass = block_size - 1, tau >= 1.0
    depth = len(shape[:L]) if exact_pass else L
    shape = shape[:L] if exact_pass else (shape + (1,) * L)[:L]
    branch = max(shape) if shape else 1
    generated, per_pass, candidates = [], [], []

    def read(ids: list[int], n: int) -> tuple[list[int], list[float], list[list[int]]]:
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -n:]  # (n, vocab)
        tokens, probs = choose(logits)
        top = logits.topk(branch, dim=-1).indices.tolist()
        ranked = [[t] + [c for c in row if c != t][: branch - 1] for t, row in zip(tokens.tolist(), top)]
        return tokens.tolist(), confidence(probs, tokens, metric).tolist(), ranked

    while len(generated) < max_new_tokens:
        seq = prompt + generated
        copied = exact.lookup(seq, depth, ngram=3) if exact_pass else []
        if copied:
            drafts = [[t] for t in copied]
        elif candidates[:depth] or not exact_pass:
            drafts = candidates[:depth]
        else:
            drafts = [[t] for t in exact.lookup(seq, depth, ngram=2)]
        path, ar = [], None  # the held drafts (tokens, ranks), AR's token after them
        for d, ranked in enumerate(drafts[: len(shape)]):  # depth by depth: a branch holds while AR agrees
            children = ranked[: shape[d]]
            ar = read(seq + [t for t, _ in path], 1)[0][-1]
            if ar not in children:
                break
            path.append((ar, children.index(ar)))
        else:
            ar = read(seq + [t for t, _ in path], 1)[0][-1]
        a = len(path)
        if a == min(len(shape), len(drafts)) and all(r == 0 for _, r in path):  # the main path held (or no drafts)
            tokens, conf, ranked = read(seq + [t for t, _ in path] + [mask_id] * depth, 1 + depth)
            n = int(accept_count(torch.tensor(conf), tau, metric))
            group, candidates = tokens[:n], ranked[n:]
        elif a == 0:
            tokens, conf, ranked = read(seq + [mask_id] * depth, 1 + depth)
            n = int(accept_count(torch.tensor(conf), tau, metric))
            group, candidates = tokens[:n], ranked[n:]
        else:
            group, candidates = [ar], read(seq + [mask_id] * depth, 1 + depth)[2][1 + a :]
        if _commit([t for t, _ in path] + group, generated, per_pass, max_new_tokens, stop_ids):
            break
    return generated, per_pass
