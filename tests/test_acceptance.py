"""Acceptance on hand-made confidences: the rule of docs/METHOD.md, for all three metrics."""

from __future__ import annotations

import math

import pytest
import torch

from mars_demo.engine.decoding import acceptance
from mars_demo.engine.decoding.acceptance import accept_count, accept_rows, choose, confidence


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


needs_greedy = pytest.mark.skipif(acceptance.greedy_kernel() is None, reason="no C++ compiler: no native greedy kernel")


@needs_greedy
@pytest.mark.parametrize("shape", [(1, 49152), (3, 4, 1000), (2, 5), (1, 37)])  # vector tails and short rows
def test_greedy_is_argmax_and_its_softmax_probability(shape):
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 4
    tokens, probs = acceptance.greedy(logits)
    expected = logits.argmax(-1)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(probs, torch.softmax(logits, -1).gather(-1, expected[..., None])[..., 0])


@needs_greedy
def test_greedy_takes_the_first_of_equal_maxima_and_rows_a_stride_apart():
    logits = torch.zeros(3, 200)
    logits[0, [40, 70, 199]] = 5.0  # three lanes and the tail hold the maximum
    logits[1, [150, 3]] = 1.0
    logits[2] = -1.0  # every entry the maximum
    tokens, probs = acceptance.greedy(logits)
    assert tokens.tolist() == [40, 3, 0]
    assert probs[2].item() == pytest.approx(1 / 200)
    assert torch.equal(acceptance.greedy(logits[:, :150])[0], logits[:, :150].argmax(-1))  # rows 200 floats apart
    assert acceptance.greedy(logits.double()) is None and acceptance.greedy(logits.T.contiguous().T) is None


@needs_greedy
def test_accept_rows_decides_the_same_with_and_without_the_kernel(monkeypatch):
    logits = torch.randn(3, 4, 300, generator=torch.Generator().manual_seed(1)) * 6
    start, cap = [0, 1, 3], [4, 2, 0]
    natively = [accept_rows(logits, start, cap, tau) for tau in (0.0, 0.3, 0.9, 1.0)]
    monkeypatch.setattr(acceptance, "greedy", lambda logits: None)
    by_torch = [accept_rows(logits, start, cap, tau) for tau in (0.0, 0.3, 0.9, 1.0)]
    for (tokens, confs), (torch_tokens, torch_confs) in zip(natively, by_torch):
        assert tokens == torch_tokens
        assert [c for row in confs for c in row] == pytest.approx([c for row in torch_confs for c in row], rel=1e-5)
    assert [len(row) for row in natively[0][0]] == [4, 2, 0]  # tau 0: everything up to each cap
    assert [len(row) for row in natively[3][0]] == [1, 1, 0]  # tau 1: one token


def test_accept_rows_compares_tau_as_the_fp32_confidences_are():
    """A confidence equal to fp32(tau) passes, as accept_count's tensor comparison has it."""
    logits = torch.tensor([[[0.0, 0.0], [math.log(9.0), 0.0]]])  # candidate 2's probability: fp32(0.9)
    tau = float(torch.softmax(logits[0, 1], -1)[0])
    assert accept_rows(logits, [0], [2], tau)[0] == [[0, 0]]
    assert accept_count(torch.tensor([[0.5, tau]]), tau).tolist() == [2]
