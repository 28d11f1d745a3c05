"""Candidate trees at a temperature: the masks' top candidates checked by recursive rejection (docs/METHOD.md,
"Candidate trees").

A tree's nodes are the masks' most likely candidates, a deterministic choice from the previous passes: each
is a draft with a one-hot proposal, as exact mode's copied drafts are. At a node that held (the newest
pending token first) with AR distribution p and children x_1 .. x_b (most likely first), child i is kept
with probability p_i(x_i), where p_i is p without x_1 .. x_{i-1}, renormalised (a uniform u kept while
u (1 - p(x_1) - ... - p(x_{i-1})) < p(x_i)); the first child kept becomes the node, and the walk goes on
below it. When every child is rejected the next token is drawn from p without the children, renormalised
(RESAMPLED); at a leaf, from p (BONUS; AR without drafts). By telescoping, child i is committed with
probability p(x_i) and any other token with p's, so each committed token is distributed as AR sampling's
next token given the text before it (SpecInfer's multi-draft rule, here with one-hot proposals).

One uniform per node and one draw per row (the residual of every place the walk may stop), drawn in that
fixed order before the walk, so a seeded run is reproducible; one host sync.
"""

from __future__ import annotations

import torch

from .acceptance import confidence
from .exact import AR, BONUS, DRAFT, RESAMPLED
from .sampling import Sampling, draw


def walk(children: list[list[int]], p_at: list[float], uniforms: list[float]) -> tuple[list[int], int]:
    """The kept path (node indices) and the row where the walk stops (0: the root, 1 + i: node i).

    ``children[r]``: the nodes under row r, most likely first; ``p_at[i]``: p(node i's token) at its parent.
    """
    path, row = [], 0
    while children[row]:
        left = 1.0  # p's mass not yet rejected at this row
        for node in children[row]:
            if uniforms[node] * left < p_at[node]:
                path.append(node)
                break
            left -= p_at[node]
        else:
            return path, row
        row = 1 + path[-1]
    return path, row


def verify_tree_sampled(logits: torch.Tensor, tree, lookahead: int, sampling: Sampling, generator, metric: str,
                        branch: int, rows_of_masks) -> tuple:
    """The sampled verdict's parts: (tokens, confidences, origins, branches, path, the masks' candidates).

    Rows of ``logits``: 0 the newest pending token, 1..N the nodes, then the main and the fallback masks.
    ``rows_of_masks(logits, tokens_of_masks)``: the masks' candidates, most likely first (tree._ranked).
    """
    N = len(tree.tokens)
    tempered, support, probs = sampling.support(logits[: 1 + N])  # (N + 1, vocab), (N + 1, k), (N + 1, k)
    device = probs.device
    tokens = torch.tensor(tree.tokens, dtype=torch.long, device=device)
    parents = torch.tensor([1 + p for p in tree.parents], dtype=torch.long, device=device)  # each node's row
    p_at = (probs[parents] * (support[parents] == tokens[:, None])).sum(-1)  # (N,) p(x) at its parent
    kids = [[-1] * max(branch, 1) for _ in range(1 + N)]  # each row's children's tokens, by rank
    for i, parent in enumerate(tree.parents):
        kids[1 + parent][tree.ranks[i]] = tree.tokens[i]
    kids = torch.tensor(kids, dtype=torch.long, device=device)
    outside = ~(support[:, :, None] == kids[:, None, :]).any(-1)  # (N + 1, k): not a child of the row
    rest = probs * outside
    rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, probs)  # children holding all of p: never rejected
    uniforms = torch.rand(N, generator=generator, device=device)
    drawn = support.gather(-1, draw(rest, generator)[:, None]).squeeze(-1)  # (N + 1,) a token where it may stop
    conf = confidence(tempered, drawn, metric)
    node_conf = confidence(tempered[parents], tokens, metric) if N else p_at
    greedy = logits[1 + N :].argmax(-1)
    top = logits[1 + N :].topk(branch, dim=-1).indices if branch > 1 else greedy[:, None]
    packed = torch.cat([p_at.double(), uniforms.double(), drawn.double(), conf.double(), node_conf.double(),
                        greedy.double(), top.flatten().double()]).tolist()  # the host sync
    p_list, u_list = packed[:N], packed[N : 2 * N]
    drawn_list = [int(t) for t in packed[2 * N : 3 * N + 1]]
    conf_list, node_list = packed[3 * N + 1 : 4 * N + 2], packed[4 * N + 2 : 5 * N + 2]
    masks = logits.shape[0] - 1 - N
    greedy_list = [int(t) for t in packed[5 * N + 2 : 5 * N + 2 + masks]]
    ranked = rows_of_masks(greedy_list, [int(t) for t in packed[5 * N + 2 + masks :]], branch)
    children = [[] for _ in range(1 + N)]
    for i, parent in enumerate(tree.parents):
        children[1 + parent].append(i)
    path, stop = walk(children, p_list, u_list)
    last = RESAMPLED if children[stop] else BONUS if N else AR
    out = [tree.tokens[i] for i in path] + [drawn_list[stop]]
    conf_out = [node_list[i] for i in path] + [conf_list[stop]]
    return out, conf_out, [DRAFT] * len(path) + [last], [tree.ranks[i] for i in path], path, ranked
