"""Exact mode with candidate trees: a verifying pass checks a tree of the masks' candidates (docs/METHOD.md,
"Candidate trees").

A pass feeds [pending | tree nodes | L main masks | L fallback masks]. The nodes are the previous pass's
mask candidates: at depth d the top b_d of mask d under every node of depth d - 1 (the masks saw only the
committed prefix, so every branch gets the same children), breadth first, each parent's children most
likely first. A node's position is the newest pending token's plus its depth; a 4-D mask lets it see the
cache, the pending tokens, its ancestors and itself, so its AR output is the one a one-token pass after
its branch would give. The main masks follow the *main path* (every node of rank 0: exactly exact mode's
chain) and see it; the fallback masks sit right after the newest pending token and see only the prefix.

The AR argmax at the newest pending token and at every node decides which nodes hold (a node holds when
its parent held and it is AR's token there); the held nodes form one root-to-leaf path (siblings are
distinct tokens). Its tokens are committed with AR's token after its end; its keys and values are
compacted into place (KVCache.compact), everything else is dropped. The next drafts come from the main
masks when the whole main path held, otherwise from the fallback masks past the committed tokens, as
in the chain (exact.verify). At a temperature (exact mode) the nodes are checked by recursive rejection
instead (tree_sampled.py): each committed token is distributed as AR sampling's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backends.base import Backend, KVCache
from . import exact
from .acceptance import accept_count, greedy_confidence
from .exact import AR, DRAFT, MASK, Fed, Verdict
from .sampling import Sampling
from .speculative import Rule
from .tree_sampled import verify_tree_sampled
from .tree_shape import MAX_BRANCH, TreeShape

NOT_A_NODE = -1  # Verdict.branches of a token that is no tree node (AR's token, a mask accepted on confidence)


@dataclass(frozen=True)
class Tree:
    """Drafts as a tree, breadth first: per node its token, parent (-1: the newest pending token), depth
    (1-based) and rank among its mask's candidates; ``main``: the nodes of rank 0 at every depth; ``shape``:
    the branching it has at each depth (the shape asked for, where there were candidates enough)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    ranks: list[int]
    main: list[int]
    shape: tuple[int, ...]

    @property
    def depth(self) -> int:
        return len(self.main)


def build(candidates: list[list[int]], shape: tuple[int, ...]) -> Tree:
    """The tree of ``shape`` over ``candidates`` (per depth, most likely first); as deep as both allow."""
    tokens, parents, depths, ranks, main, fed = [], [], [], [], [], []
    level = [-1]  # the nodes of the depth above
    for d, (branch, ranked) in enumerate(zip(shape, candidates)):
        ranked = list(dict.fromkeys(ranked))[:branch]
        if not ranked:
            break
        below = []
        for parent in level:
            for rank, token in enumerate(ranked):
                below.append(len(tokens))
                tokens.append(token), parents.append(parent), depths.append(d + 1), ranks.append(rank)
        main.append(below[0])
        fed.append(len(ranked))
        level = below
    return Tree(tokens, parents, depths, ranks, main, tuple(fed))


def tree_window(
    pending: list[int], tree: Tree, lookahead: int, mask_id: int, cached: int, dtype: torch.dtype, device,
    fallback: bool = True,
) -> Fed:
    """[pending | nodes | L main masks | L fallback masks] with positions by depth and the ancestry mask."""
    k, N, L = len(pending), len(tree.tokens), lookahead
    if not N:
        return exact.verify_window(pending, [], L, mask_id, cached, dtype, device)
    g = L if fallback else 0
    ids = torch.tensor([pending + tree.tokens + [mask_id] * (L + g)], dtype=torch.long, device=device)
    last = cached + k - 1  # the newest pending token's position
    positions = torch.cat([
        torch.arange(cached, cached + k), last + torch.tensor(tree.depths),
        last + tree.depth + 1 + torch.arange(L), last + 1 + torch.arange(g),
    ]).to(device)
    n = k + N + L + g
    see = torch.zeros(n - k, n - k, dtype=torch.bool)  # the drafted part: nodes, main masks, fallback masks
    for i, parent in enumerate(tree.parents):
        if parent >= 0:
            see[i, :N] = see[parent, :N]
        see[i, i] = True
    see[N : N + L, tree.main] = True
    see[N : N + L, N : N + L] = torch.ones(L, L, dtype=torch.bool).tril()
    see[N + L :, N + L :] = torch.ones(g, g, dtype=torch.bool).tril()
    allowed = torch.ones(n, cached + n, dtype=torch.bool)
    allowed[:, cached:] = False
    allowed[:, cached : cached + k] = torch.ones(n, k, dtype=torch.bool).tril()
    allowed[k:, cached + k :] = see
    mask = torch.zeros(n, cached + n, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return Fed(ids, positions[None], mask.to(device)[None, None], 1 + N + L + g)


@dataclass(frozen=True)
class TreeVerdict(Verdict):
    """exact.Verdict (its ``branches``: per committed token the rank of the node it was, NOT_A_NODE: none), and:
    ``path`` the kept nodes; ``candidates`` per next draft its candidates (most likely first); ``truth`` AR's
    token at each depth the pass reached (for TreeShape.observe)."""

    path: list[int] = field(default_factory=list)
    candidates: list[list[int]] = field(default_factory=list)
    truth: list[int] = field(default_factory=list)


def _read(logits: torch.Tensor, tree: Tree, lookahead: int, tau: float, metric: str, branch: int) -> tuple:
    """The pass's argmaxes, confidences, the masks' top ``branch`` and both groups' confident counts: one sync."""
    N, L = len(tree.tokens), lookahead
    tokens, conf = greedy_confidence(logits, metric)  # (keep,), (keep,)
    leaf = 1 + tree.main[-1] if tree.main else 0  # the main group starts at the main path's end
    main = torch.cat([conf[leaf : leaf + 1], conf[1 + N : 1 + N + L]])
    fallback = torch.cat([conf[:1], conf[1 + N + L :]])
    top = logits[1 + N :].topk(branch, dim=-1).indices if branch > 1 else tokens[1 + N :, None]  # (masks, branch)
    counts = torch.stack([accept_count(main, tau, metric), accept_count(fallback, tau, metric)])
    packed = torch.cat([tokens.double(), conf.double(), top.flatten().double(), counts.double()]).tolist()
    keep = tokens.shape[0]
    tok, cf = [int(t) for t in packed[:keep]], packed[keep : 2 * keep]
    flat = [int(t) for t in packed[2 * keep : -2]]
    return tok, cf, ranked_candidates(tok[1 + N :], flat, branch), int(packed[-2]), int(packed[-1])


def ranked_candidates(greedy: list[int], flat: list[int], branch: int) -> list[list[int]]:
    """Each mask's candidates, most likely first, from its argmax and its top ``branch`` (flat, row by row):
    the argmax (the chain's draft, ties as argmax takes them) first."""
    rows = [flat[m * branch : (m + 1) * branch] for m in range(len(greedy))]
    return [[g] + [t for t in row if t != g][: branch - 1] for g, row in zip(greedy, rows)]


def verify_tree(
    logits: torch.Tensor, tree: Tree, lookahead: int, tau: float, metric: str, branch: int = MAX_BRANCH
) -> TreeVerdict:
    """Greedy verification of ``tree`` from the logits (keep, vocab) of tree_window (module docstring).

    Rows: 0 the newest pending token, 1..N the nodes, then L main masks, then the fallback masks (L or none).
    """
    N, L = len(tree.tokens), lookahead
    tok, cf, ranked, n_main, n_fallback = _read(logits, tree, L, tau, metric, branch)
    held = [False] * N
    for i, parent in enumerate(tree.parents):  # breadth first: a parent is settled before its children
        held[i] = (parent < 0 or held[parent]) and tree.tokens[i] == tok[1 + parent]
    leaf = max((i for i in range(N) if held[i]), default=-1)
    path = []
    while leaf >= 0:
        path.insert(0, leaf)
        leaf = tree.parents[leaf]
    a, end = len(path), 1 + path[-1] if path else 0  # drafts kept; the row of AR's token after them
    rows = [0] + [1 + i for i in path]
    truth = [tok[r] for r in rows[: tree.depth]]
    out = [tree.tokens[i] for i in path]
    conf = [cf[r] for r in rows[:a]]  # a draft's confidence: the AR probability that verified it
    branches, origins = [tree.ranks[i] for i in path], [DRAFT] * a
    g = len(ranked) - L
    if path == tree.main:  # every main draft held: the main group starts at the newest verified token
        group, group_cf, n, masks = [tok[end]] + tok[1 + N : 1 + N + L], [cf[end]] + cf[1 + N : 1 + N + L], n_main, 0
    elif a == 0:  # the first depth failed: the fallback group starts at the newest pending token
        group, group_cf, n, masks = [tok[0]] + tok[1 + N + L :], [cf[0]] + cf[1 + N + L :], n_fallback, L
    else:  # a branch ended early, or off the main path: AR's token, then the fallback guesses past it
        out, conf = out + [tok[end]], conf + [cf[end]]
        return TreeVerdict(out, conf, origins + [AR], a, [r[0] for r in ranked[L + a :]], None,
                           branches + [NOT_A_NODE], path, ranked[L + a : L + g], truth)
    chosen = [ranked[masks + i - 1] for i in range(n, len(group))]  # the guesses left: group index i >= 1
    return TreeVerdict(
        out + group[:n], conf + group_cf[:n], origins + [AR] + [MASK] * (n - 1), a, group[n:], None,
        branches + [NOT_A_NODE] * n, path, chosen, truth,
    )


def verify_sampled(
    logits: torch.Tensor, tree: Tree, lookahead: int, sampling: Sampling, generator, metric: str, branch: int
) -> TreeVerdict:
    """verify_tree at a temperature (exact mode): recursive rejection of the candidates (tree_sampled.py)."""
    out, conf, origins, branches, path, ranked = verify_tree_sampled(
        logits, tree, lookahead, sampling, generator, metric, branch, ranked_candidates
    )
    L, a = lookahead, len(path)
    chosen = ranked[:L] if path == tree.main else ranked[L + a :]  # as verify_tree's, every group read at tau 1
    return TreeVerdict(out, conf, origins, a, [r[0] for r in chosen], None, branches + [NOT_A_NODE], path, chosen,
                       out[: tree.depth])


@dataclass
class TreeRun:
    """One run's trees: the candidates for the next pass, the shape chooser (tree_shape.TreeShape) and, at a
    temperature, what the rule draws with (speculative.Rule: the settings and the run's generator)."""

    shapes: TreeShape
    window: int  # B
    mask_id: int
    rule: Rule | None = None
    candidates: list[list[int]] = field(default_factory=list)

    @property
    def branch(self) -> int:
        """Candidates kept per mask: a fixed shape's widest branching, else all a chosen shape may take."""
        return max(self.shapes.fixed) if self.shapes.fixed else MAX_BRANCH

    def drafts(self, history: list[int], depth: int, exact_pass: bool) -> list[list[int]]:
        """exact.pick_drafts over candidates: a copy after a 3-token match (a chain) beats the masks' trees."""
        if exact_pass and (copied := exact.lookup(history, depth, ngram=3)):
            return [[t] for t in copied]
        if self.candidates[:depth] or not exact_pass:
            return self.candidates[:depth]
        return [[t] for t in exact.lookup(history, depth, ngram=2)]

    def step(
        self, backend: Backend, cache: KVCache, pending: list[int], history: list[int], tau: float, metric: str
    ) -> tuple[TreeVerdict, int, tuple[int, ...]]:
        """One verifying pass over a tree; returns its verdict, its width (StepEvent.width) and the shape fed.

        Exact passes feed the chosen shape's depth of masks in each group; hybrid ones (tau < 1) the full window.
        """
        shape, fallback = self.shapes.layout()
        exact_pass = tau >= 1.0
        lookahead = len(shape) if exact_pass else self.window - 1
        if not exact_pass:
            shape, fallback = (shape + (1,) * lookahead)[:lookahead], True
        candidates = self.drafts(history, len(shape), exact_pass)
        tree = build(candidates, shape)
        cached = cache.get_seq_length()
        fed = tree_window(pending, tree, lookahead, self.mask_id, cached, backend.dtype, backend.device, fallback)
        logits = backend.forward(fed.ids, cache, positions=fed.position_ids, mask=fed.attention_mask, keep=fed.keep)
        if self.rule is None or self.rule.sampling.greedy:
            verdict = verify_tree(logits[0], tree, lookahead, tau, metric, self.branch)
        elif exact_pass:
            generator = self.rule.generator.on(logits.device)
            verdict = verify_sampled(logits[0], tree, lookahead, self.rule.sampling, generator, metric, self.branch)
        else:
            raise ValueError("candidate trees at a temperature: exact mode only (hybrid verifies chains there)")
        start = cached + len(pending)
        cache.compact(start, [start + i for i in verdict.path])
        self.shapes.observe(candidates, verdict.truth)
        self.candidates = verdict.candidates
        return verdict, fed.width - len(pending) + 1, tree.shape
