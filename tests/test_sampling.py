"""Sampling without loss (docs/METHOD.md, "Sampling without loss"): top-p and top-k, and exact mode at a
temperature distributed as AR sampling.

The distribution tests draw a few thousand short outputs from a tiny "drafty" model (a bias on its LM
head towards four tokens, so the masks' guesses overlap the AR head's choices: drafts are kept, rejected
and resampled) and compare them with AR sampling's distribution, enumerated exactly from the model
(``ar_distribution``), by a chi-square test. A wrong rule moves the distribution far enough to fail it
clearly: ``test_a_broken_rule_is_caught`` breaks the rule three ways and checks that each is caught.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from mars_demo.engine.decoding import sampling, speculative
from mars_demo.engine.decoding.batch import collect_batch
from mars_demo.engine.decoding.batch.rows import BatchSpec
from mars_demo.engine.decoding.batch.token import token_passes
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.exact import AR, BONUS, DRAFT, MASK, RESAMPLED
from mars_demo.engine.decoding.loop import LiveTau, collect, decode_passes, eos_ids, generate
from mars_demo.engine.decoding.sampling import Sampling, nucleus
from mars_demo.engine.decoding.surface import Surface
from mars_demo.engine.decoding.width import WidthController

from conftest import PROMPTS, make_lm

TOP_K = Sampling(temperature=1.5, top_k=4)  # four tokens a place: 64 outputs of three tokens
TOP_P = Sampling(temperature=1.0, top_p=0.8)  # a nucleus of a few tokens a place
SIGNIFICANCE = 1e-4  # a right rule fails one run in 10,000; a broken one gets p-values below 1e-10 here


@pytest.fixture(scope="module")
def drafty():
    lm = make_lm("llama")
    bias = torch.zeros(lm.model.config.vocab_size)
    bias[[50, 60, 70, 80]] = 7.0
    lm.model.lm_head.bias = torch.nn.Parameter(bias)
    return lm


@torch.inference_mode()
def ar_distribution(lm, ids: list[int], how: Sampling, tokens: int) -> dict[tuple[int, ...], float]:
    """The exact distribution of AR sampling's first ``tokens`` tokens (shorter where a stop token ends it)."""
    stop = eos_ids(lm.backend, lm.tokenizer)
    done, frontier = {}, {(): 1.0}
    for _ in range(tokens):
        prefixes = list(frontier)
        rows = torch.tensor([ids + list(prefix) for prefix in prefixes])
        probs = how.probs(lm.model(input_ids=rows).logits[:, -1]).double()
        grown = {}
        for prefix, row in zip(prefixes, probs):
            for t in row.nonzero().flatten().tolist():
                (done if t in stop else grown)[prefix + (t,)] = frontier[prefix] * float(row[t])
        frontier = grown
    return done | frontier


def chi_square_p(samples: list[tuple[int, ...]], expected: dict[tuple[int, ...], float]) -> float:
    """p-value of the samples under ``expected``; outputs expected fewer than 5 times are pooled into one cell.

    An output outside the support gives 0: what top-p and top-k exclude must never be drawn.
    """
    counts, n = Counter(samples), len(samples)
    if set(counts) - {k for k, v in expected.items() if v > 0}:
        return 0.0
    cells, rest_o, rest_e = [], 0, 0.0
    for key, prob in expected.items():
        if n * prob >= 5:
            cells.append((counts[key], n * prob))
        else:
            rest_o, rest_e = rest_o + counts[key], rest_e + n * prob
    if rest_e > 0:
        cells.append((rest_o, rest_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def exact_runs(lm, ids, how: Sampling, n: int, tokens: int, block_size: int = 2, tau: float = 1.0) -> list[tuple]:
    """The first ``tokens`` tokens of ``n`` single-sequence verifying runs, seeds 0..n-1."""
    stop = eos_ids(lm.backend, lm.tokenizer)
    outputs = []
    for seed in range(n):
        config = DecodeConfig(mode="hybrid", tau=tau, temperature=how.temperature, top_p=how.top_p, top_k=how.top_k,
                              max_new_tokens=tokens, seed=seed, max_fed=None)
        passes = decode_passes(
            lm.backend, ids, config, window=block_size, mask_id=lm.meta.mask_token_id, tau=LiveTau(tau),
            stop_ids=stop,
        )
        outputs.append(tuple(t for p in passes for t in p.tokens))
    return outputs


def batch_runs(
    lm, ids, how: Sampling, n: int, tokens: int, block_size: int = 2, verifying: bool = True, controller=None
) -> list:
    """The first ``tokens`` tokens of ``n`` rows of one token-level batch (mode "ar" with block_size 1)."""
    config = DecodeConfig(mode="hybrid" if verifying else "mars", temperature=how.temperature, top_p=how.top_p,
                          top_k=how.top_k, max_new_tokens=tokens, seed=0)
    spec = BatchSpec(block_size, lm.meta.mask_token_id, 0, LiveTau(1.0), frozenset(eos_ids(lm.backend, lm.tokenizer)))
    batch = token_passes(lm.backend, [ids] * n, config, spec, controller)
    return [tuple(row) for row in collect_batch(batch).token_ids]


# -- the distribution ------------------------------------------------------------------------------


def test_exact_mode_samples_as_ar_sampling(drafty):
    """Single sequence, block 2: the first token from the AR head, the second a kept draft or a resample,
    the third a bonus, a kept fallback draft or a resample."""
    ids = prompt_ids(drafty.tokenizer, PROMPTS[0])
    samples = exact_runs(drafty, ids, TOP_K, 800, 3)
    assert chi_square_p(samples, ar_distribution(drafty, ids, TOP_K, 3)) > SIGNIFICANCE


def test_copied_drafts_sample_as_ar_sampling_too(drafty, monkeypatch):
    """The prompt's last two tokens occurred earlier, followed by 60 70 80: exact mode's first pass copies
    60 70 as drafts (lookup: a one-hot q), kept or rejected by the rule; the output is still AR sampling's."""
    base = prompt_ids(drafty.tokenizer, PROMPTS[0])
    ids = base + [60, 70, 80] + base[-2:]
    copied = []
    lookup = speculative.exact.lookup
    monkeypatch.setattr(speculative.exact, "lookup", lambda *a, **k: copied.append(found := lookup(*a, **k)) or found)
    samples = exact_runs(drafty, ids, TOP_K, 800, 3, block_size=3)
    assert sum(c == [60, 70] for c in copied) == 800  # every run's first pass
    assert chi_square_p(samples, ar_distribution(drafty, ids, TOP_K, 3)) > SIGNIFICANCE


@pytest.mark.parametrize("how", [TOP_K, TOP_P], ids=["top-k", "top-p"])
def test_batched_exact_mode_and_ar_sampling_sample_the_same_distribution(drafty, how):
    """Token-level batches, every row the same prompt: exact mode (three drafts a pass) and AR sampling."""
    ids = prompt_ids(drafty.tokenizer, PROMPTS[0])
    expected = ar_distribution(drafty, ids, how, 2)
    assert chi_square_p(batch_runs(drafty, ids, how, 2000, 2, block_size=4), expected) > SIGNIFICANCE
    assert chi_square_p(batch_runs(drafty, ids, how, 2000, 2, block_size=1, verifying=False), expected) > SIGNIFICANCE


def test_batched_exact_passes_in_turns_sample_as_ar_sampling(drafty, monkeypatch):
    """A cost surface where two tokens a row cost little more than one and three cost much more: the batch
    verifies and drafts in turns (exact.Layout, no masks beside the drafts), and still samples as AR does."""
    from mars_demo.engine.decoding.batch import token

    costs = {1: 10.0, 2: 10.5, 3: 16.0, 4: 20.0, 5: 24.0, 7: 32.0, 10: 44.0}
    jump = Surface.from_cost(lambda r, w: costs[w], rows=(1, 2, 4, 8), widths=tuple(costs), name="jump")
    seen, verify_block = [], token.verify_block
    monkeypatch.setattr(token, "verify_block", lambda *a: seen.append(a[-1]) or verify_block(*a))
    # priced as a batch that rows join: a static one of 2000 rows three tokens from its end waits for its unluckiest
    # row whatever it drafts (drift.py), and goes plain; the passes in turns are what is tested here
    monkeypatch.setattr(token, "spread", lambda *args: 1.0)
    ids = prompt_ids(drafty.tokenizer, PROMPTS[0])
    samples = batch_runs(drafty, ids, TOP_K, 2000, 3, block_size=4, controller=WidthController(jump, 4))
    assert seen[0] and seen[1:] and not any(seen[1:])  # the prefill's masks draft; later passes go in turns
    assert chi_square_p(samples, ar_distribution(drafty, ids, TOP_K, 3)) > SIGNIFICANCE


@torch.inference_mode()
def hybrid_distribution(lm, ids: list[int], how: Sampling, tau: float) -> dict[tuple[int, int], float]:
    """Hybrid mode's first two tokens at block 2, exactly: the first from p; the mask's guess g ~ q is taken on
    confidence when its tempered probability c(g) >= tau, else checked by the rule, which then gives p. So
    P(t2 = x | t1) = q(x) [c(x) >= tau] + P(c(g) < tau) p(x | t1)."""
    logits = lm.model(input_ids=torch.tensor([ids + [lm.meta.mask_token_id]])).logits[0, -1]
    tempered, q = (v.double() for v in how.split(logits))
    confident = q * (tempered >= tau)
    out = {}
    for (t1,), w in ar_distribution(lm, ids, how, 1).items():
        p2 = how.probs(lm.model(input_ids=torch.tensor([ids + [t1]])).logits[0, -1]).double()
        both = confident + (1 - confident.sum()) * p2
        out |= {(t1, x): w * float(both[x]) for x in both.nonzero().flatten().tolist()}
    return out


@pytest.mark.parametrize("broken", [False, True], ids=["the rule", "q not given the failed test"])
def test_hybrid_verifies_exactly_what_it_does_not_take_on_confidence(drafty, monkeypatch, broken):
    """Hybrid's guarantee (docs/METHOD.md): a guess kept back by its confidence is checked against the mask's
    q given that failure (sampling.failed_test); checked against q itself, the rule would be wrong."""
    ids = prompt_ids(drafty.tokenizer, PROMPTS[0])
    if broken:
        monkeypatch.setattr(speculative, "failed_test", lambda q, tempered, tau: q)
    tau = 0.2  # the mask's likeliest guess (c = 0.30) is taken on confidence, its others (c < 0.06) are checked
    p = chi_square_p(exact_runs(drafty, ids, TOP_K, 800, 2, tau=tau), hybrid_distribution(drafty, ids, TOP_K, tau))
    assert p < 1e-8 if broken else p > SIGNIFICANCE


def _always_accept(p, q, drafts, uniforms):
    return torch.full(drafts.shape[:-1], drafts.shape[-1])


def _ignore_q(p, q, drafts, uniforms):
    return sampling.held(p, torch.ones_like(q), drafts, uniforms)


def _never_resample(p, q):
    return p


BROKEN = {
    "always accept": {"held": _always_accept},
    "q ignored": {"held": _ignore_q, "residual": _never_resample},  # kept with probability p(x), else drawn from p
    "never resample": {"residual": _never_resample},  # a rejected draft's place drawn from p, not from p - q
}


def rule_samples(p: torch.Tensor, q: torch.Tensor, n: int, held=sampling.held, residual=sampling.residual) -> list:
    """``n`` outputs of the rule at one place, vectorised: a draft from q, kept or replaced from the residual."""
    gen = torch.Generator().manual_seed(0)
    drafts = sampling.draw(q.expand(n, -1), gen)
    kept = held(p.expand(n, 1, -1), q.expand(n, 1, -1), drafts[:, None], torch.rand(n, 1, generator=gen))
    fixes = sampling.draw(residual(p[None], q[None]).expand(n, -1), gen)
    return [(t,) for t in torch.where(kept.bool(), drafts, fixes).tolist()]


P = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
Q = {"masks": torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3]), "lookup": torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0])}


@pytest.mark.parametrize("drafter", Q)
def test_the_rule_alone_gives_p(drafter):
    """One place, 20,000 draws at once: q the masks' distribution, or one-hot (a draft copied by lookup)."""
    expected = {(t,): float(v) for t, v in enumerate(P)}
    assert chi_square_p(rule_samples(P, Q[drafter], 20000), expected) > SIGNIFICANCE


@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_rule_is_caught(drafty, monkeypatch, name):
    """The mutation check: the rule broken three ways fails both tests above by far."""
    expected = {(t,): float(v) for t, v in enumerate(P)}
    assert chi_square_p(rule_samples(P, Q["masks"], 20000, **BROKEN[name]), expected) < 1e-10
    ids = prompt_ids(drafty.tokenizer, PROMPTS[0])
    for part, broken in BROKEN[name].items():
        monkeypatch.setattr(speculative, part, broken)
    samples = batch_runs(drafty, ids, TOP_K, 1000, 2, block_size=2)
    assert chi_square_p(samples, ar_distribution(drafty, ids, TOP_K, 2)) < 1e-8


# -- greedy limits and the filters -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ar", "mars", "exact", "hybrid"])
def test_top_k_one_at_temperature_one_is_greedy(drafty, mode):
    """top-k 1 leaves one token to draw; at temperature 1 confidences are greedy's too, so every mode is greedy."""
    greedy = DecodeConfig(mode=mode, tau=0.5, max_new_tokens=24, block_size=4)
    for prompt in PROMPTS[:2]:
        expected = collect(generate(drafty, prompt, greedy))
        sampled = collect(generate(drafty, prompt, greedy.with_(temperature=1.0, top_k=1, seed=5)))
        assert sampled.token_ids == expected.token_ids
        assert [s.token_ids for s in sampled.steps] == [s.token_ids for s in expected.steps]


def test_temperature_zero_ignores_the_filters_and_is_greedy_ar(drafty):
    ar = collect(generate(drafty, PROMPTS[0], DecodeConfig(mode="ar", max_new_tokens=24))).token_ids
    for mode in ("exact", "hybrid"):
        config = DecodeConfig(mode=mode, tau=1.0, max_new_tokens=24, top_p=0.3, top_k=2)
        assert collect(generate(drafty, PROMPTS[0], config)).token_ids == ar


def test_seeded_sampling_is_reproducible_in_every_verifying_path(drafty):
    for mode, tau in (("exact", 1.0), ("hybrid", 0.6)):
        config = DecodeConfig(mode=mode, tau=tau, temperature=0.9, top_p=0.95, seed=11, max_new_tokens=32)
        first = collect(generate(drafty, PROMPTS[1], config))
        again = collect(generate(drafty, PROMPTS[1], config))
        other = collect(generate(drafty, PROMPTS[1], config.with_(seed=12)))
        assert first.token_ids == again.token_ids != other.token_ids
        assert [s.origins for s in first.steps] == [s.origins for s in again.steps]
    ids = prompt_ids(drafty.tokenizer, PROMPTS[1])
    assert batch_runs(drafty, ids, TOP_P, 4, 16, block_size=4) == batch_runs(drafty, ids, TOP_P, 4, 16, block_size=4)


def test_origins_say_kept_resampled_or_bonus(drafty):
    config = DecodeConfig(mode="exact", temperature=1.0, top_k=4, max_new_tokens=48, block_size=4, seed=1)
    run = collect(generate(drafty, PROMPTS[0], config))
    origins = [o for s in run.steps for o in s.origins]
    assert {DRAFT, RESAMPLED, BONUS} <= set(origins) and MASK not in origins
    assert run.steps[0].origins == (AR,)  # the prefill: nothing to verify
    hybrid = collect(generate(drafty, PROMPTS[0], config.with_(mode="hybrid", tau=0.3)))
    assert MASK in {o for s in hybrid.steps for o in s.origins}


def test_nucleus_keeps_the_smallest_set_that_reaches_top_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.25, 0.25, 0.25, 0.25]])
    assert nucleus(probs, 0.8).tolist() == [[False, True, False, True], [True, True, True, True]]
    assert nucleus(probs, 0.81).tolist()[0] == [False, True, True, True]
    assert nucleus(probs, 0.01).tolist()[0] == [False, True, False, False]  # the most likely always stays
    assert nucleus(probs, 0.5).tolist()[1] == [True, True, True, True]  # ties at the edge stay
    flat = torch.softmax(torch.randn(3, 5000, generator=torch.Generator().manual_seed(1)) * 0.1, -1)
    ordered = flat.sort(-1, descending=True)  # brute force: a full sort, past FIRST_K
    reach = ordered.values.cumsum(-1) - ordered.values
    expected = torch.zeros_like(flat, dtype=torch.bool).scatter(-1, ordered.indices, reach < 0.9)
    assert torch.equal(nucleus(flat, 0.9), expected)


def test_top_k_and_top_p_exclude_what_they_must():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, 2.0]])
    assert (Sampling(1.0, top_k=2).probs(logits) > 0).tolist() == [[True, False, True, False, True]]  # a tie stays
    probs = Sampling(1.0, top_p=0.7).probs(logits)
    assert (probs > 0).tolist() == [[True, False, True, False, True]]  # 0.52 + 0.19 reach 0.7; the tied 0.19 stays
    assert math.isclose(float(probs.sum()), 1.0, abs_tol=1e-6)
    gen = torch.Generator().manual_seed(0)
    tokens = set(sampling.draw(Sampling(2.0, top_k=3, top_p=0.5).probs(logits).expand(500, -1), gen).tolist())
    assert tokens <= {0, 2, 4} and len(tokens) > 1


def test_draw_follows_the_weights_across_blocks():
    """Inverse CDF by blocks: weights spread over several blocks, empty blocks between them, unnormalised."""
    weights = torch.zeros(1000)
    weights[[3, 255, 256, 600, 999]] = torch.tensor([1.0, 2.0, 3.0, 0.5, 1.5])
    samples = sampling.draw(weights.expand(16000, -1), torch.Generator().manual_seed(2)).tolist()
    expected = {(t,): float(w) / float(weights.sum()) for t, w in enumerate(weights) if w > 0}
    assert chi_square_p([(t,) for t in samples], expected) > SIGNIFICANCE
    one = torch.zeros(2, 300)
    one[0, 299], one[1, 0] = 1e-30, 5.0  # a single token, however small its weight, is the draw
    assert sampling.draw(one, None).tolist() == [299, 0]


def test_hybrid_drafts_keep_q_given_the_failed_test():
    q = torch.tensor([0.6, 0.25, 0.1, 0.05])
    assert torch.allclose(sampling.failed_test(q, q, 0.5), torch.tensor([0.0, 0.625, 0.25, 0.125]))
    assert torch.equal(sampling.failed_test(q, q, 0.01), q)  # nothing could fail: q unchanged


@pytest.mark.parametrize("bad", [
    {"top_p": 0.0}, {"top_p": -0.1}, {"top_p": 1.5}, {"top_p": math.nan}, {"top_p": "0.5"}, {"top_p": True},
    {"top_k": -1}, {"top_k": 2.5}, {"top_k": math.nan}, {"temperature": math.nan}, {"temperature": -1.0},
])
def test_bad_sampling_settings_get_one_clear_line(bad):
    name = next(iter(bad)).replace("_", "-")
    with pytest.raises(ValueError, match=name) as caught:
        DecodeConfig(**bad)
    assert "\n" not in str(caught.value)
