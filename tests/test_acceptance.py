"""Acceptance on hand-made confidences: the rule of docs/METHOD.md, for all three metrics."""

from __future__ import annotations

import math

import torch

from mars_demo.engine.acceptance import accept_count, choose, confidence


def test_probability_accepts_the_leading_run():
    conf = torch.tensor([[0.2, 0.95, 0.91, 0.5], [0.99, 0.3, 0.99, 0.99], [0.1, 0.95, 0.95, 0.95]])
    assert accept_count(conf, 0.9).tolist() == [3, 1, 4]


def test_first_candidate_is_always_accepted_even_below_tau():
    assert accept_count(torch.tensor([0.0, 0.0, 0.0]), 0.5).item() == 1


def test_tau_one_is_one_token_even_at_confidence_exactly_one():
    conf = torch.ones(2, 4)  # a saturated softmax
    for metric in ("probability", "margin", "entropy"):
        assert accept_count(conf if metric != "entropy" else torch.zeros(2, 4), 1.0, metric).tolist() == [1, 1]


def test_tau_zero_accepts_everything_by_probability():
    assert accept_count(torch.tensor([0.01, 0.0, 0.02, 0.0]), 0.0).item() == 4


def test_entropy_accepts_low_entropy_candidates():
    entropy = torch.tensor([[2.0, 0.1, 0.2, 0.9], [0.0, 0.5, 0.1, 0.1]])
    assert accept_count(entropy, 0.3, "entropy").tolist() == [3, 1]


def test_margin_metric_and_confidences():
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.34, 0.33, 0.33]])
    tokens = torch.tensor([0, 0])
    margin = confidence(probs, tokens, "margin")
    assert torch.allclose(margin, torch.tensor([0.3, 0.01]))
    assert accept_count(margin, 0.2, "margin").item() == 1  # second candidate's margin 0.01 < 0.2
    assert accept_count(torch.tensor([0.0, 0.3, 0.25]), 0.2, "margin").item() == 3
    p = confidence(probs, torch.tensor([1, 2]), "probability")
    assert torch.allclose(p, torch.tensor([0.3, 0.33]))
    uniform = torch.full((1, 4), 0.25)
    assert math.isclose(confidence(uniform, torch.tensor([0]), "entropy").item(), math.log(4), rel_tol=1e-5)


def test_choose_is_argmax_when_greedy_and_seeded_when_sampling():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    tokens, probs = choose(logits)
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(probs.sum(-1), torch.ones(2))
    draws = [choose(logits, 1.0, torch.Generator().manual_seed(s))[0].tolist() for s in (1, 1, 2)]
    assert draws[0] == draws[1]
    many = torch.stack([choose(torch.zeros(3), 1.0, torch.Generator().manual_seed(s))[0] for s in range(200)])
    assert set(many.tolist()) == {0, 1, 2}  # sampling really samples
