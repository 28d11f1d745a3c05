"""Would exact mode gain from verifying a tree of the masks' candidates? Measured before it was built (issue #37;
the trees themselves: engine/decoding/tree.py, ``DecodeConfig.tree``).

Teacher-forced on held-out rows (``validate --trees``): at every full block, mask d (d = 1 .. B - 1)
guesses the row's token d places past the AR token, and ``ranks[:, d - 1]`` is where the row's token
stands in that mask's distribution (0: its argmax). A verifying pass of tree shape ``(b_1, ..., b_D)``
drafts the top ``b_d`` candidates of mask d under every node of depth d - 1 (the masks see only the
committed prefix, so a node's children are the same whatever branch it is on), and it keeps the
longest path of drafts that are the tokens greedy AR would commit: depth d holds when every depth up
to d is within its top ``b``. A chain is the shape (1, ..., 1), exact mode today.

A pass commits the held drafts and the AR token after them, and it feeds the pending token, every
node of the tree and the next pass's ``B - 1`` masks; its cost is read off the compute path's
measured curve (ms by tokens fed), extended along its last step past the widest width measured.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..engine.decoding.tree_shape import MAX_BRANCH, nodes  # the shapes exact mode verifies (decoding/tree.py)

__all__ = ["MAX_BRANCH", "Shape", "best", "evaluate", "held", "hit_rates", "nodes", "pass_ms", "shapes"]


def held(ranks: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Drafts held per pass (passes,): the longest prefix of depths whose row token is within the shape's top b."""
    depth = len(shape)
    inside = ranks[:, :depth] < torch.tensor(shape, device=ranks.device)
    return inside.int().cumprod(dim=1).sum(dim=1)


def hit_rates(ranks: torch.Tensor, top: int = MAX_BRANCH) -> list[dict]:
    """Per depth: the share of passes whose row token is within the mask's top k (k = 1 .. ``top``), and
    that share for top 1 among the passes whose previous depth's top 1 held."""
    table = []
    for d in range(ranks.shape[1]):
        within = {f"top{k}": round(float((ranks[:, d] < k).float().mean()), 4) for k in range(1, top + 1)}
        row = {"depth": d + 1} | within
        if d:
            before = ranks[:, :d].eq(0).all(dim=1)
            row["top1_after_top1"] = round(float((ranks[before, d] == 0).float().mean()), 4) if before.any() else None
        table.append(row)
    return table


def pass_ms(costs: dict[int, float], fed: int) -> float:
    """The curve's ms for a pass feeding ``fed`` tokens; past its widest width, its last step extended."""
    widths = sorted(costs)
    if fed in costs:
        return costs[fed]
    if fed < widths[-1]:
        above = min(w for w in widths if w > fed)
        return costs[above]  # a pass that feeds less costs no more than a wider one
    step = (costs[widths[-1]] - costs[widths[-2]]) / (widths[-1] - widths[-2]) if len(widths) > 1 else 0.0
    return costs[widths[-1]] + max(step, 0.0) * (fed - widths[-1])


@dataclass(frozen=True)
class Shape:
    """One tree shape's expected figures on the measured passes."""

    shape: tuple[int, ...]
    nodes: int
    tokens_per_pass: float  # committed: the held drafts and the AR token
    tokens_per_ms: float | None  # None: no cost curve


def shapes(depth: int, branch: int = MAX_BRANCH) -> list[tuple[int, ...]]:
    """Every shape of depth 1 .. ``depth`` with 1 .. ``branch`` candidates per depth."""
    return [s for d in range(1, depth + 1) for s in itertools.product(range(1, branch + 1), repeat=d)]


def evaluate(ranks: torch.Tensor, block_size: int, costs: dict[int, float] | None) -> list[Shape]:
    """Every shape's expected tokens per pass and per ms (best first where there is a curve)."""
    out = []
    for shape in shapes(ranks.shape[1]):
        per_pass = 1.0 + float(held(ranks, shape).float().mean())
        fed = 1 + nodes(shape) + block_size - 1
        rate = per_pass / pass_ms(costs, fed) if costs else None
        out.append(Shape(shape, nodes(shape), round(per_pass, 4), None if rate is None else round(rate, 5)))
    return sorted(out, key=lambda s: -(s.tokens_per_ms if s.tokens_per_ms is not None else s.tokens_per_pass))


def best(results: list[Shape], chains: bool) -> Shape:
    """The best chain (every b = 1) or the best tree (some b > 1)."""
    pool = [s for s in results if (max(s.shape) == 1) == chains]
    return max(pool, key=lambda s: s.tokens_per_ms if s.tokens_per_ms is not None else s.tokens_per_pass)
