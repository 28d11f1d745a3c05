"""Candidate trees, measured before they are built (research/candidate_trees.py, issue #37)."""

from __future__ import annotations

import pytest
import torch

from mars_demo.research import candidate_trees as trees
from mars_demo.research.training import validate

from conftest import make_lm


def test_a_shapes_nodes_are_its_candidates_at_every_depth():
    assert trees.nodes((1, 1, 1)) == 3  # a chain of depth 3: exact mode today
    assert trees.nodes((2, 1)) == 2 + 2
    assert trees.nodes((2, 3)) == 2 + 6
    assert len(trees.shapes(2, 3)) == 3 + 9 and (3, 3) in trees.shapes(2, 3)


def test_a_pass_holds_the_longest_prefix_of_depths_within_their_top_b():
    ranks = torch.tensor([
        [0, 0, 0],  # every depth the argmax: a chain holds all three
        [1, 0, 0],  # the row's token second at depth 1: a chain holds none, a tree (2, ...) all
        [0, 2, 0],  # third at depth 2: (1, 2, 1) holds one, (1, 3, 1) three
        [0, 0, 5],
    ])
    assert trees.held(ranks, (1, 1, 1)).tolist() == [3, 0, 1, 2]
    assert trees.held(ranks, (2, 1, 1)).tolist() == [3, 3, 1, 2]
    assert trees.held(ranks, (1, 3, 1)).tolist() == [3, 0, 3, 2]
    assert trees.held(ranks, (1,)).tolist() == [1, 0, 1, 1]


def test_hit_rates_and_the_conditional_top1():
    ranks = torch.tensor([[0, 0], [0, 1], [1, 0], [2, 0]])
    depth1, depth2 = trees.hit_rates(ranks, top=3)
    assert (depth1["top1"], depth1["top2"], depth1["top3"]) == (0.5, 0.75, 1.0)
    assert depth2["top1"] == 0.75 and depth2["top1_after_top1"] == 0.5  # of the 2 passes whose depth 1 held


def test_the_cost_curve_is_read_and_extended_past_its_widest_width():
    costs = {1: 2.0, 2: 2.2, 4: 2.6}
    assert trees.pass_ms(costs, 2) == 2.2
    assert trees.pass_ms(costs, 3) == 2.6  # between widths: the wider one's cost
    assert trees.pass_ms(costs, 6) == pytest.approx(2.6 + 0.2 * 2)  # the last step (0.4 over 2 widths) extended


def test_a_flat_curve_rewards_a_tree_and_a_steep_one_a_chain():
    """Where the row's token is often second at depth 1, a tree holds more; whether it pays is the curve's call."""
    ranks = torch.tensor([[0, 0, 0]] * 4 + [[1, 0, 0]] * 4 + [[5, 5, 5]] * 2)
    flat = {w: 1.0 for w in range(1, 12)}
    steep = {w: float(w * w) for w in range(1, 12)}
    on_flat = trees.evaluate(ranks, 4, flat)
    tree, chain = trees.best(on_flat, chains=False), trees.best(on_flat, chains=True)
    assert tree.tokens_per_pass > chain.tokens_per_pass and tree.tokens_per_ms > chain.tokens_per_ms
    on_steep = trees.evaluate(ranks, 4, steep)
    assert trees.best(on_steep, chains=True).tokens_per_ms > trees.best(on_steep, chains=False).tokens_per_ms
    assert on_steep[0].shape == trees.best(on_steep, chains=True).shape  # best first
    no_curve = trees.evaluate(ranks, 4, None)
    assert all(s.tokens_per_ms is None for s in no_curve) and no_curve[0].tokens_per_pass == max(
        s.tokens_per_pass for s in no_curve)


def test_validation_ranks_the_row_token_in_each_masks_distribution():
    """The ranks validate collects agree with ranking the same logits by hand: 0 where the mask's argmax is it."""
    from test_training import example

    from mars_demo.research.training.layout import collate
    from mars_demo.research.training.loss import target_logits
    from mars_demo.research.training.validation import _ranks

    lm = make_lm("qwen2")
    examples = [example(5, 13), example(3, 9, offset=40), example(7, 17, offset=90)]
    ranks: list = []
    validate(lm.model, examples, lm.meta.mask_token_id, 0, 4, ranks=ranks, batch_size=len(examples))
    got = torch.cat(ranks)
    assert got.shape[1] == 3 and len(got) > 0 and got.min() >= 0
    batch = collate(examples, lm.meta.mask_token_id, 0, 4)
    logits, targets = target_logits(lm.model, batch)
    every = torch.arange(len(targets))[:, None]
    by_hand = _ranks(logits, targets, every)[:, 0]
    assert set(got.flatten().tolist()) <= set(by_hand.tolist())
    assert ((logits.argmax(-1) == targets) == (by_hand == 0)).all()
