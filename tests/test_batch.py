"""Batch decoders: each row of a batch equals that row decoded alone, whatever else is in the batch.

Equalities that hold token for token (greedy, fp32; up to floating-point near-ties
of tau, which these tiny models do not hit):
  * tau = 1.0, both schemes: every row equals greedy AR of that row alone (HF generate);
  * block scheme, any tau: every row equals the uncached block-capped sliding window
    (batch_reference.reference_block_decode), hence a one-row run of the same decoder;
  * token scheme, any tau: every row equals the uncached sliding window (reference.reference_decode).
The block scheme is NOT the sliding window at tau < 1: it never accepts past a block's end.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mars_demo.engine.decoding.batch import (
    DEFAULT_SCHEME,
    SCHEMES,
    collect_batch,
    decode_batch,
    generate_batch,
    stream_batch,
)
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import LiveTau, eos_ids
from tests.batch_reference import reference_block_decode
from tests.reference import reference_decode

from conftest import PROMPTS

# Very different lengths, so left padding and per-row positions matter.
MIXED = [PROMPTS[0], " ".join(PROMPTS) * 2, PROMPTS[2], PROMPTS[3][:5]]
NEW = 24


def _ids(lm, prompts=MIXED) -> list[list[int]]:
    return [prompt_ids(lm.tokenizer, p) for p in prompts]


def _decode(lm, ids, scheme, tau, *, block_size=4, max_new=NEW, stop=None):
    return collect_batch(decode_batch(
        lm.backend, ids, DecodeConfig(max_new_tokens=max_new), scheme=scheme, block_size=block_size,
        mask_id=lm.meta.mask_token_id, pad_id=lm.tokenizer.pad_token_id, tau=LiveTau(tau),
        stop_ids=eos_ids(lm.backend, lm.tokenizer) if stop is None else stop,
    ))


def _greedy(lm, ids: list[int], max_new: int = NEW) -> list[int]:
    x = torch.tensor([ids])
    out = lm.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
                            pad_token_id=lm.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


def _reference(lm, ids, scheme, tau, block_size=4, max_new=NEW, stop=None):
    decode = reference_block_decode if scheme == "block" else reference_decode
    stop = eos_ids(lm.backend, lm.tokenizer) if stop is None else stop
    return decode(lm.model, ids, block_size=block_size, mask_id=lm.meta.mask_token_id, tau=tau,
                  max_new_tokens=max_new, stop_ids=stop)[0]


def test_prompts_have_different_lengths(tiny_llama):
    assert len({len(i) for i in _ids(tiny_llama)}) == len(MIXED)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_tau_one_equals_greedy_ar_per_row(tiny_lm, scheme):
    ids = _ids(tiny_lm)
    result = _decode(tiny_lm, ids, scheme, 1.0)
    for row, prompt in zip(result.token_ids, ids):
        assert row == _greedy(tiny_lm, prompt)
    assert all(len(step.token_ids) <= 1 for e in result.events for step in e.rows)


def test_ar_mode_batch_equals_greedy(tiny_qwen):
    ids = _ids(tiny_qwen)
    events = stream_batch(tiny_qwen.backend, tiny_qwen.tokenizer, ids, DecodeConfig(mode="ar", max_new_tokens=NEW),
                          mask_id=tiny_qwen.meta.mask_token_id, block_size=4)
    result = collect_batch(events)
    assert all(e.fed == 1 for e in result.events[1:])  # window 1: no masks, one token per row
    assert result.token_ids == [_greedy(tiny_qwen, p) for p in ids]


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("tau", [0.1, 0.2])
def test_rows_equal_single_row_semantics(tiny_lm, scheme, tau):
    ids = _ids(tiny_lm)
    result = _decode(tiny_lm, ids, scheme, tau)
    assert result.stats.tokens_per_forward > 1.05  # several tokens per pass really happened
    for row, prompt in zip(result.token_ids, ids):
        assert row == _reference(tiny_lm, prompt, scheme, tau)


@pytest.mark.parametrize("block_size", [1, 3])
def test_block_scheme_other_block_sizes(tiny_llama, block_size):
    ids = _ids(tiny_llama)
    result = _decode(tiny_llama, ids, "block", 0.15, block_size=block_size, max_new=NEW + 1)
    for row, prompt in zip(result.token_ids, ids):
        assert row == _reference(tiny_llama, prompt, "block", 0.15, block_size=block_size, max_new=NEW + 1)


def test_one_row_run_equals_the_row_in_a_batch(tiny_llama):
    ids = _ids(tiny_llama)
    batch = _decode(tiny_llama, ids, "block", 0.15)
    for r, prompt in enumerate(ids):
        alone = _decode(tiny_llama, [prompt], "block", 0.15)
        assert alone.token_ids[0] == batch.token_ids[r]
        assert all(e.kind != "refill" or all(s.token_ids for s in e.rows) for e in alone.events)  # alone: no waiting


def test_block_scheme_never_crosses_a_block_and_waits_for_all_rows(tiny_llama):
    B = 4
    result = _decode(tiny_llama, _ids(tiny_llama), "block", 0.15, block_size=B)
    produced = [0] * len(MIXED)
    live = [True] * len(MIXED)
    waited = 0
    for event in result.events:
        if event.kind == "block-start":  # every live row has filled the block before the next one opens
            assert len({produced[r] for r in range(len(produced)) if live[r]}) <= 1
            assert all(produced[r] % B == 0 for r in range(len(produced)) if live[r])
        for r, step in enumerate(event.rows):
            waited += live[r] and not step.token_ids  # a fast row waiting at the boundary
            before, produced[r] = produced[r], produced[r] + len(step.token_ids)
            assert step.token_ids == () or before // B == (produced[r] - 1) // B  # inside one block
            live[r] = live[r] and step.finish is None
    assert waited > 0


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_a_row_that_stops_early_leaves_the_others_alone(tiny_llama, scheme):
    ids = _ids(tiny_llama)
    free = _decode(tiny_llama, ids, scheme, 0.15, stop=set())
    others = {t for row in free.token_ids[1:] for t in row}
    stop_token = next(t for t in free.token_ids[0][2:] if t not in others)  # only row 0 produces it
    cut = free.token_ids[0].index(stop_token) + 1
    result = _decode(tiny_llama, ids, scheme, 0.15, stop={stop_token})
    assert result.token_ids[0] == free.token_ids[0][:cut]
    assert result.token_ids[1:] == free.token_ids[1:]
    rows = result.stats.rows
    assert rows[0].finish_reason == "eos" and all(r.finish_reason == "length" for r in rows[1:])
    finished_at = next(e.index for e in result.events if e.rows[0].finish)
    assert all(e.rows[0].token_ids == () for e in result.events[finished_at + 1 :])  # stays finished


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_events_add_up_to_the_totals(tiny_qwen, scheme):
    result = _decode(tiny_qwen, _ids(tiny_qwen), scheme, 0.3)
    stats = result.stats
    assert [e.index for e in result.events] == list(range(len(result.events)))
    assert stats.forward_passes == len(result.events) and stats.tokens == sum(e.tokens for e in result.events)
    assert [r.tokens for r in stats.rows] == [len(row) for row in result.token_ids]
    assert all(len(s.confidences) == len(s.token_ids) for e in result.events for s in e.rows)
    assert stats.seconds == pytest.approx(sum(e.seconds for e in result.events))
    assert all(r.forward_passes <= stats.forward_passes for r in stats.rows)
    assert result.events[0].kind == "prefill" and all(not e.done for e in result.events[:-1])


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_tau_is_read_before_every_pass(tiny_llama, scheme):
    tau = LiveTau(1.0)
    events = decode_batch(
        tiny_llama.backend, _ids(tiny_llama), DecodeConfig(max_new_tokens=NEW), scheme=scheme, block_size=4,
        mask_id=tiny_llama.meta.mask_token_id, pad_id=tiny_llama.tokenizer.pad_token_id, tau=tau, stop_ids=set(),
    )
    seen = []
    for event in events:
        seen.append(event.tau)
        tau.set(0.1)
    assert seen[0] == 1.0 and set(seen[1:]) == {0.1}


def test_no_deep_copies_of_the_cache(tiny_llama, monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("the cache must be rolled back by cropping, not copied")

    monkeypatch.setattr(copy, "deepcopy", refuse)
    for scheme in SCHEMES:
        _decode(tiny_llama, _ids(tiny_llama), scheme, 0.15)


def test_generate_batch_from_text(tiny_llama):
    result = collect_batch(generate_batch(tiny_llama, MIXED[:2], DecodeConfig(tau=1.0, max_new_tokens=8)))
    assert result.token_ids == [_greedy(tiny_llama, p, 8) for p in _ids(tiny_llama, MIXED[:2])]
    assert DEFAULT_SCHEME in SCHEMES


def test_bad_input_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="empty"):
        generate_batch(tiny_llama, ["hello", "  "])
    with pytest.raises(ValueError, match="scheme"):
        decode_batch(tiny_llama.backend, [[1, 2]], DecodeConfig(), scheme="nope", block_size=4, mask_id=3, pad_id=0,
                     tau=LiveTau(1.0))
    with pytest.raises(ValueError, match="stop strings"):
        generate_batch(tiny_llama, ["hello"], DecodeConfig(stop=("x",)))
    for scheme in SCHEMES:
        with pytest.raises(ValueError, match="empty"):
            _decode(tiny_llama, [[1, 2], []], scheme, 1.0)


def test_block_scheme_is_not_the_sliding_window(tiny_llama):
    """It never accepts past a block's end, so at tau < 1 some rows differ from the sliding window."""
    ids = _ids(tiny_llama)
    block, token = _decode(tiny_llama, ids, "block", 0.1), _decode(tiny_llama, ids, "token", 0.1)
    assert block.token_ids != token.token_ids
    assert block.stats.forward_passes > token.stats.forward_passes


def test_token_scheme_rows_equal_the_cached_single_sequence_decoder(tiny_qwen):
    from mars_demo.engine.decoding.loop import collect, stream

    ids = _ids(tiny_qwen)
    config = DecodeConfig(tau=0.2, max_new_tokens=NEW, max_fed=None)  # batch passes take no cap
    batch = collect_batch(stream_batch(tiny_qwen.backend, tiny_qwen.tokenizer, ids, config,
                                       mask_id=tiny_qwen.meta.mask_token_id, block_size=4, scheme="token"))
    for row, prompt in zip(batch.token_ids, ids):
        alone = collect(stream(tiny_qwen.backend, tiny_qwen.tokenizer, prompt, config,
                               mask_id=tiny_qwen.meta.mask_token_id, block_size=4))
        assert row == alone.token_ids


def test_token_scheme_feeds_no_masks_at_tau_one(tiny_llama):
    """At tau = 1.0 only candidate 1 can pass, so the pass is plain batched AR: one column per row."""
    ids = _ids(tiny_llama)
    live = LiveTau(1.0)
    events = list(decode_batch(
        tiny_llama.backend, ids, DecodeConfig(max_new_tokens=8), scheme="token", block_size=4,
        mask_id=tiny_llama.meta.mask_token_id, pad_id=tiny_llama.tokenizer.pad_token_id, tau=live,
        stop_ids=eos_ids(tiny_llama.backend, tiny_llama.tokenizer),
    ))
    assert all(e.fed == 1 for e in events[1:])


def _scheduled(lm, ids, scheme, schedule, max_new=NEW):
    """Decode with tau = schedule[pass index % len(schedule)], set before every pass."""
    tau = LiveTau(schedule[0])
    events = []
    for event in decode_batch(
        lm.backend, ids, DecodeConfig(max_new_tokens=max_new), scheme=scheme, block_size=4,
        mask_id=lm.meta.mask_token_id, pad_id=lm.tokenizer.pad_token_id, tau=tau,
        stop_ids=eos_ids(lm.backend, lm.tokenizer),
    ):
        events.append(event)
        tau.set(schedule[(event.index + 1) % len(schedule)])
    return [[t for e in events for t in e.rows[r].token_ids] for r in range(len(ids))], events


def test_block_scheme_feeds_no_masks_at_tau_one(tiny_llama):
    ids = _ids(tiny_llama)
    tokens, events = _scheduled(tiny_llama, ids, "block", [1.0], max_new=10)
    assert tokens == [_greedy(tiny_llama, p, 10) for p in ids]
    assert {e.kind for e in events[1:]} == {"extend", "block-start"} and all(e.fed == 1 for e in events[1:])


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("schedule", [[1.0, 0.15], [0.15, 0.15, 1.0, 1.0, 1.0], [1.0, 1.0, 0.1]])
def test_tau_one_passes_without_masks_accept_what_masked_passes_would(tiny_llama, scheme, schedule):
    """Just below 1.0, masks are fed but none of these tiny models' candidates is that confident:
    the same tokens, pass for pass, as tau = 1.0 passes that feed no masks at all."""
    ids = _ids(tiny_llama)
    fast, fast_events = _scheduled(tiny_llama, ids, scheme, schedule)
    slow, slow_events = _scheduled(tiny_llama, ids, scheme, [1 - 1e-6 if t == 1.0 else t for t in schedule])
    assert fast == slow and len(fast_events) == len(slow_events)
    assert sum(e.fed for e in fast_events) < sum(e.fed for e in slow_events)


@pytest.mark.parametrize(
    "scheme, mode", [("block", "mars"), ("token", "mars"), ("token", "exact"), ("token", "hybrid")]
)
def test_batches_take_the_sampling_settings(tiny_qwen, scheme, mode):
    """top-k 1 at temperature 1 leaves one token to draw and greedy's confidences: the greedy batch, pass for
    pass; other settings sample, seeded (tests/test_sampling.py holds exact mode's distribution to AR's)."""
    ids = _ids(tiny_qwen)

    def run(config):
        return collect_batch(stream_batch(
            tiny_qwen.backend, tiny_qwen.tokenizer, ids, config, mask_id=tiny_qwen.meta.mask_token_id, block_size=4,
            scheme=scheme,
        ))

    greedy = DecodeConfig(mode=mode, tau=0.5, max_new_tokens=NEW, max_fed=None)
    expected = run(greedy)
    assert run(greedy.with_(temperature=1.0, top_k=1, seed=3)).token_ids == expected.token_ids
    sampled = greedy.with_(temperature=0.9, top_p=0.9, top_k=40, seed=3)
    first, again, other = run(sampled), run(sampled), run(sampled.with_(seed=4))
    assert first.token_ids == again.token_ids != other.token_ids
