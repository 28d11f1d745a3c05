"""Exact and hybrid modes (docs/METHOD.md, "Exact and hybrid modes").

They give greedy AR's output token for token, cached == uncached.

A random model's masks almost never guess the AR token, so most tests also run on a
"drafty" copy: a bias on the LM head towards four tokens makes the masks' guesses
right often enough that drafts are kept, rejected at every index, and cut.
"""

from __future__ import annotations

import re

import pytest
import torch

from mars_demo.engine.decoding import exact
from mars_demo.engine.decoding.batch import collect_batch, stream_batch
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import LiveTau, collect, decode_passes, eos_ids, generate, stream
from tests.reference import reference_exact

from conftest import PROMPTS, make_lm

MAX_NEW = 32
BLOCKS = (2, 4, 8)


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-drafty", "qwen2-drafty"])
def lm(request):
    arch, _, drafty = request.param.partition("-")
    lm = make_lm(arch)
    if drafty:
        bias = torch.zeros(lm.model.config.vocab_size)
        bias[[50, 60, 70, 80]] = 7.0
        lm.model.lm_head.bias = torch.nn.Parameter(bias)
    return lm


def ar_ids(lm, prompt: str, max_new: int = MAX_NEW, **extra) -> list[int]:
    return collect(generate(lm, prompt, DecodeConfig(mode="ar", max_new_tokens=max_new, **extra))).token_ids


def passes(lm, prompt: str, block_size: int, tau: float = 1.0, max_new: int = MAX_NEW, stop_ids=None) -> list:
    ids = prompt_ids(lm.tokenizer, prompt)
    config = DecodeConfig(mode="hybrid", tau=tau, max_new_tokens=max_new, max_fed=None)
    return list(decode_passes(
        lm.backend, ids, config, window=block_size, mask_id=lm.meta.mask_token_id, tau=LiveTau(tau),
        stop_ids=eos_ids(lm.backend, lm.tokenizer) if stop_ids is None else stop_ids,
    ))


@pytest.mark.parametrize("block_size", BLOCKS)
def test_exact_equals_greedy_ar_and_hybrid_at_tau_one(lm, block_size):
    for prompt in PROMPTS:
        expected = ar_ids(lm, prompt)
        config = DecodeConfig(mode="exact", block_size=block_size, max_new_tokens=MAX_NEW)
        ours = collect(generate(lm, prompt, config))
        hybrid = collect(generate(lm, prompt, config.with_(mode="hybrid", tau=1.0)))
        assert ours.token_ids == expected
        assert [s.token_ids for s in hybrid.steps] == [s.token_ids for s in ours.steps]
        assert all(s.tau == 1.0 and len(s.origins) == len(s.token_ids) for s in ours.steps)
        assert all(o != exact.MASK for s in ours.steps for o in s.origins)  # nothing taken on confidence


def test_exact_equals_transformers_greedy(tiny_lm):
    for prompt in PROMPTS:
        ids = torch.tensor([prompt_ids(tiny_lm.tokenizer, prompt)])
        hf = tiny_lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW)
        ours = collect(generate(tiny_lm, prompt, DecodeConfig(mode="exact", max_new_tokens=MAX_NEW)))
        assert ours.token_ids == hf[0, ids.shape[1]:].tolist()


def test_drafts_are_really_verified(lm):
    """The drafty models keep drafts, several in one pass, and reject some after keeping others."""
    if lm.model.lm_head.bias is None:
        pytest.skip("a random model's masks rarely guess right")
    kept = [sum(o == exact.DRAFT for o in p.origins) for prompt in PROMPTS for p in passes(lm, prompt, 8)]
    assert max(kept) >= 2 and kept.count(0) > 0
    fewer = collect(generate(lm, PROMPTS[0], DecodeConfig(mode="exact", block_size=4, max_new_tokens=MAX_NEW)))
    assert fewer.stats.forward_passes < fewer.stats.tokens


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("tau", [1.0, 0.7, 0.3])
def test_cached_equals_uncached_reference(lm, block_size, tau):
    stop = eos_ids(lm.backend, lm.tokenizer)
    for prompt in PROMPTS:
        ids = prompt_ids(lm.tokenizer, prompt)
        config = DecodeConfig(mode="hybrid", tau=tau, block_size=block_size, max_new_tokens=MAX_NEW)
        ours = collect(stream(lm.backend, lm.tokenizer, ids, config, mask_id=lm.meta.mask_token_id, block_size=4))
        expected, per_pass = reference_exact(
            lm.model, ids, block_size=block_size, mask_id=lm.meta.mask_token_id, tau=tau,
            max_new_tokens=MAX_NEW, stop_ids=stop,
        )
        assert ours.token_ids == expected
        assert [len(s.token_ids) for s in ours.steps] == per_pass


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_cache_holds_exactly_the_committed_tokens(lm, block_size, tau):
    """After every pass the cache holds the prompt and every committed token except those fed next
    pass: the AR token and any accepted on confidence (verified drafts stay where they were computed)."""
    for prompt in PROMPTS:
        produced = len(prompt_ids(lm.tokenizer, prompt))
        for p in passes(lm, prompt, block_size, tau)[:-1]:  # the last pass ends the run: nothing is fed after it
            produced += len(p.tokens)
            fed_next = len(p.tokens) - sum(o == exact.DRAFT for o in p.origins)
            assert p.cached == produced - fed_next


@pytest.mark.parametrize("block_size", BLOCKS)
def test_stop_tokens_and_length_cut_inside_drafts(lm, block_size):
    """Every token of the AR output, made a stop token, ends exact mode where it ends AR;
    every max_new_tokens cuts it where it cuts AR. A pass that is not cut ends with its AR
    token or a mask's, so a run whose last token is a draft was cut inside the drafts."""
    in_drafts = {"stop": 0, "length": 0}
    drafty = lm.model.lm_head.bias is not None
    for prompt in PROMPTS[:3] if drafty else PROMPTS[:1]:  # a random model's masks rarely draft: one prompt will do
        full = ar_ids(lm, prompt)
        for token in dict.fromkeys(full):
            out = passes(lm, prompt, block_size, stop_ids={token})
            assert [t for p in out for t in p.tokens] == full[: full.index(token) + 1]
            assert out[-1].finish == "eos"
            in_drafts["stop"] += out[-1].origins[-1] == exact.DRAFT
        for n in range(1, len(full) + 1):
            out = passes(lm, prompt, block_size, max_new=n, stop_ids=set())
            assert [t for p in out for t in p.tokens] == full[:n] and out[-1].finish == "length"
            in_drafts["length"] += out[-1].origins[-1] == exact.DRAFT
    if drafty:
        assert in_drafts["stop"] > 0 and in_drafts["length"] > 0


def test_eos_is_honoured_inside_drafts(lm):
    eos = lm.tokenizer.eos_token_id
    for prompt in PROMPTS:
        full = ar_ids(lm, prompt)
        if eos in full:
            assert collect(generate(lm, prompt, DecodeConfig(mode="exact", max_new_tokens=MAX_NEW))).token_ids == full
    bias = lm.model.lm_head.bias
    forced = torch.zeros(lm.model.config.vocab_size) if bias is None else bias.detach().clone()
    forced[eos] = 1e4  # EOS everywhere: the first pass ends with it
    lm.model.lm_head.bias = torch.nn.Parameter(forced)
    try:
        ended = collect(generate(lm, PROMPTS[2], DecodeConfig(mode="exact", max_new_tokens=MAX_NEW)))
    finally:
        lm.model.lm_head.bias = bias
    assert ended.token_ids == [eos] and ended.stats.finish_reason == "eos"


def test_stop_strings_end_exact_mode_where_they_end_ar(tiny_llama):
    full = collect(generate(tiny_llama, PROMPTS[2], DecodeConfig(mode="ar", max_new_tokens=40)))
    cut_at = re.search(r"[A-Za-z ]{2}", full.text[3:]).group(0)
    config = DecodeConfig(mode="exact", max_new_tokens=40, stop=(cut_at,))
    stopped = collect(generate(tiny_llama, PROMPTS[2], config))
    assert stopped.stats.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(cut_at) + len(cut_at)]


def test_exact_ignores_a_live_tau_and_hybrid_reads_it(tiny_llama):
    live = LiveTau(0.0)
    exact_run = collect(generate(tiny_llama, PROMPTS[0], DecodeConfig(mode="exact", max_new_tokens=MAX_NEW), tau=live))
    assert exact_run.token_ids == ar_ids(tiny_llama, PROMPTS[0])
    hybrid = collect(generate(tiny_llama, PROMPTS[0], DecodeConfig(mode="hybrid", max_new_tokens=MAX_NEW), tau=live))
    assert all(s.tau == 0.0 for s in hybrid.steps) and hybrid.stats.tokens_per_forward > 2


def test_sampling_is_accepted_in_both_verifying_modes(tiny_llama):
    """At a temperature drafts are checked by the speculative-sampling rule (test_sampling.py has the distribution)."""
    for mode in ("exact", "hybrid"):
        config = DecodeConfig(mode=mode, temperature=0.7, top_p=0.9, seed=3, max_new_tokens=12)
        assert len(collect(generate(tiny_llama, PROMPTS[0], config)).token_ids) == 12


MIXED = [PROMPTS[0], " ".join(PROMPTS) * 2, PROMPTS[2], PROMPTS[3][:5]]  # very different lengths


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_every_batch_row_equals_that_row_alone(lm, block_size, tau):
    """Token-level batch, verifying: each row keeps, rejects and re-drafts on its own, pass for pass."""
    ids = [prompt_ids(lm.tokenizer, p) for p in MIXED]
    mode = "exact" if tau == 1.0 else "hybrid"
    config = DecodeConfig(mode=mode, tau=tau, block_size=block_size, max_new_tokens=MAX_NEW)
    batch = collect_batch(
        stream_batch(lm.backend, lm.tokenizer, ids, config, mask_id=lm.meta.mask_token_id, block_size=4)
    )
    for r, row in enumerate(ids):
        alone = collect(stream(lm.backend, lm.tokenizer, row, config, mask_id=lm.meta.mask_token_id, block_size=4))
        steps = [e.rows[r] for e in batch.events][: alone.stats.forward_passes]
        assert [s.token_ids for s in steps] == [s.token_ids for s in alone.steps]
        assert [s.origins for s in steps] == [s.origins for s in alone.steps]
        assert batch.stats.rows[r].finish_reason == alone.stats.finish_reason
    assert all(e.fed >= 1 for e in batch.events)


def test_batch_exact_needs_the_token_scheme(tiny_llama):
    ids = [prompt_ids(tiny_llama.tokenizer, p) for p in PROMPTS[:2]]
    with pytest.raises(ValueError, match="token-level"):
        stream_batch(
            tiny_llama.backend, tiny_llama.tokenizer, ids, DecodeConfig(mode="exact"), mask_id=3, block_size=4,
            scheme="block",
        )


def test_draft_depth_follows_the_cost_curve_and_the_drafts_held():
    assert exact.DraftDepth(3, None).layout() == (3, True, True)  # no curve: the widest layout
    flat = exact.DraftDepth(3, {w: 30.0 for w in range(1, 9)})
    assert flat.layout() == (3, True, True)  # wide passes are free: verify every draft, keep the fallback masks
    steep = exact.DraftDepth(3, {w: 10.0 * w for w in range(1, 9)})
    assert steep.layout() == (0, True, True)  # every token fed costs a whole pass: no draft pays, a plain AR pass
    assert steep.cost(10) == pytest.approx(100.0)  # past the measured widths: the last slope
    gentle = exact.DraftDepth(3, {w: 10.0 + 2.0 * w for w in range(1, 9)})
    assert gentle.layout() == (1, False, True)  # one draft in two holds: deeper passes do not pay yet
    for _ in range(200):  # drafts that always hold do
        gentle.observe(drafted=3, held=3)
    assert gentle.layout() == (3, False, True)
    depth = exact.DraftDepth(3, {1: 10.0, 2: 11.0})
    depth.observe(drafted=3, held=1)  # depth 1 held, depth 2 failed, depth 3 was never reached
    assert depth.held == [2, 1, 1] and depth.tried == [3, 3, 2]


def test_a_kind_whose_passes_yield_less_than_the_model_expects_gives_way():
    kinds = (exact.WITH_FALLBACK, exact.CHAIN, exact.IN_TURNS)
    depths = exact.DraftDepth(3, {1: 10.0, 2: 10.5, 3: 11.0, 4: 13.0, 5: 16.0, 7: 20.0, 10: 25.0})
    depths.rows = 4
    turns = depths.layout(kinds)
    assert turns == (2, False, False) and depths.correction(exact.IN_TURNS) == 1.0  # on the model alone
    on_the_model, expected = depths.rate(*turns), depths.expected[1]
    depths.observe_yield(exact.Layout(1, True), 5.0)  # a layout other than the one weighed shows nothing
    assert depths.yields.sums == {}
    passes = 0
    while depths.layout(kinds) == turns:  # its passes commit 0.8 of the tokens the model expects of them
        depths.observe_yield(turns, 0.8 * expected)
        passes += 1
        assert passes < 20
    assert depths.layout(kinds) == (1, False, True)  # the chain with masks takes over
    correction = depths.correction(exact.IN_TURNS)
    assert 0.8 < correction < 0.98 and depths.correction(exact.CHAIN) == 1.0
    assert depths.rate(*turns) == pytest.approx(on_the_model * correction)
    assert depths.rate(0, True) == pytest.approx(1 / 10.0)  # a plain AR pass is never scaled


def test_exact_on_a_linear_curve_feeds_one_token_passes_and_stays_exact(lm, monkeypatch):
    from mars_demo.engine.backends.cpu.paths import ComputePath

    config = DecodeConfig(mode="exact", block_size=4, max_new_tokens=MAX_NEW)
    wide_runs = [list(generate(lm, prompt, config)) for prompt in PROMPTS]
    curve = ComputePath(path="fp32", requested="fp32", costs_ms={w: 10.0 * w for w in range(1, 9)})
    monkeypatch.setattr(lm, "compute", curve)
    narrow_runs = [list(generate(lm, prompt, config)) for prompt in PROMPTS]
    wide = [collect(events).token_ids for events in wide_runs]
    narrow = [collect(events).token_ids for events in narrow_runs]
    assert narrow == wide == [ar_ids(lm, prompt) for prompt in PROMPTS]
    # after the prefill (the prompt alone: no draft pays where every token fed costs as much as a pass),
    # plain AR passes only
    assert {e.width for events in narrow_runs for e in events[1:]} == {1}
    assert max(e.width for events in wide_runs for e in events) > 3


def test_lookup_copies_what_followed_the_latest_earlier_match():
    history = [5, 6, 7, 8, 9, 1, 5, 6, 7, 3, 4, 2, 5, 6, 7]
    assert exact.lookup(history, 2, ngram=3) == [3, 4]  # the latest match wins, not the first
    assert exact.lookup(history, 9, ngram=3) == [3, 4, 2, 5, 6, 7]  # up to the end of the text
    assert exact.lookup([1, 2, 3, 4], 2, ngram=2) == []  # no earlier match
    assert exact.pick_drafts(history, [11, 12, 13], 2) == [3, 4]  # a 3-token match beats the masks' guesses
    assert exact.pick_drafts([1, 2, 9, 1, 2], [11, 12, 13], 2) == [11, 12]  # a 2-token one does not...
    assert exact.pick_drafts([1, 2, 9, 1, 2], [], 2) == [9, 1]  # ...but fills an empty draft list
