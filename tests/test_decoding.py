"""The cached decoders against transformers' greedy decoding and the uncached reference."""

from __future__ import annotations

import re

import pytest
import torch

from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import Detokenizer, LiveTau, collect, eos_ids, generate, stream
from tests.reference import reference_decode

from conftest import PROMPTS

MAX_NEW = 24


def hf_greedy(lm, prompt: str, max_new: int = MAX_NEW) -> list[int]:
    ids = torch.tensor([prompt_ids(lm.tokenizer, prompt)])
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("mode", ["mars", "ar"])
def test_tau_one_equals_transformers_greedy(tiny_lm, mode):
    for prompt in PROMPTS:
        ours = collect(generate(tiny_lm, prompt, DecodeConfig(mode=mode, tau=1.0, max_new_tokens=MAX_NEW)))
        assert ours.token_ids == hf_greedy(tiny_lm, prompt)
        assert ours.stats.forward_passes == len(ours.token_ids)


@pytest.mark.parametrize("max_fed", [None, 2, 3])
@pytest.mark.parametrize("block_size", [2, 4, 8])
@pytest.mark.parametrize("tau", [0.3, 0.7, 0.9])
def test_cached_equals_uncached_reference(tiny_lm, tau, block_size, max_fed):
    stop = eos_ids(tiny_lm.backend, tiny_lm.tokenizer)
    for prompt in PROMPTS:
        ids = prompt_ids(tiny_lm.tokenizer, prompt)
        config = DecodeConfig(tau=tau, block_size=block_size, max_new_tokens=MAX_NEW, max_fed=max_fed)
        ours = collect(
            stream(tiny_lm.backend, tiny_lm.tokenizer, ids, config, mask_id=tiny_lm.meta.mask_token_id, block_size=4)
        )
        expected, per_pass = reference_decode(
            tiny_lm.model, ids, block_size=block_size, mask_id=tiny_lm.meta.mask_token_id, tau=tau,
            max_new_tokens=MAX_NEW, stop_ids=stop, max_fed=max_fed,
        )
        assert ours.token_ids == expected
        assert [len(s.token_ids) for s in ours.steps] == per_pass


def test_low_tau_really_accepts_several_tokens(tiny_lm):
    result = collect(generate(tiny_lm, PROMPTS[0], DecodeConfig(tau=0.3, max_new_tokens=40)))
    assert max(len(s.token_ids) for s in result.steps) > 1
    assert result.stats.tokens_per_forward > 1.0


def test_streamed_events_add_up_to_the_output(tiny_lm):
    for tau in (1.0, 0.5, 0.0):
        result = collect(generate(tiny_lm, PROMPTS[1], DecodeConfig(tau=tau, max_new_tokens=30)))
        decoded = tiny_lm.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        assert result.text == decoded
        assert [s.done for s in result.steps] == [False] * (len(result.steps) - 1) + [True]
        stats = result.stats
        assert stats.tokens == len(result.token_ids) == sum(len(s.token_ids) for s in result.steps)
        assert stats.forward_passes == len(result.steps)
        assert stats.seconds == pytest.approx(sum(s.seconds for s in result.steps))
        assert all(len(s.confidences) == len(s.token_ids) == len(s.pieces) for s in result.steps)


def test_tau_changed_between_passes_is_used_from_the_next_pass(tiny_llama):
    live = LiveTau(0.0)  # tau 0 accepts every candidate: B tokens per pass
    events = generate(tiny_llama, PROMPTS[0], DecodeConfig(max_new_tokens=60, max_fed=None), tau=live)
    first = [next(events), next(events)]
    live.set(1.0)
    rest = list(events)
    assert [(e.tau, len(e.token_ids)) for e in first] == [(0.0, 4), (0.0, 4)]
    assert all(e.tau == 1.0 and len(e.token_ids) == 1 for e in rest)
    with pytest.raises(ValueError, match="tau"):
        live.set(1.5)


def test_stops_at_max_tokens_eos_and_stop_strings(tiny_llama):
    lm = tiny_llama
    short = collect(generate(lm, PROMPTS[2], DecodeConfig(tau=0.0, max_new_tokens=5)))
    assert len(short.token_ids) == 5 and short.stats.finish_reason == "length"

    full = collect(generate(lm, PROMPTS[2], DecodeConfig(tau=1.0, max_new_tokens=40)))
    # A stop string from the middle of the output, made of plain characters.
    match = re.search(r"[A-Za-z ]{2}", full.text[3:])
    assert match, "the tiny model's output has plain letters to stop at"
    cut_at = match.group(0)
    stopped = collect(generate(lm, PROMPTS[2], DecodeConfig(tau=1.0, max_new_tokens=40, stop=(cut_at,))))
    assert stopped.stats.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(cut_at) + len(cut_at)]

    # Make EOS the greedy choice right away: decoding ends after one token.
    eos = lm.tokenizer.eos_token_id
    bias = torch.zeros(lm.model.config.vocab_size)
    bias[eos] = 1e4
    lm.model.lm_head.bias = torch.nn.Parameter(bias)
    try:
        ended = collect(generate(lm, PROMPTS[2], DecodeConfig(tau=0.0, max_new_tokens=40)))
    finally:
        lm.model.lm_head.bias = None
    assert ended.token_ids == [eos] and ended.stats.finish_reason == "eos" and ended.text == ""


def test_multi_turn_messages_use_the_chat_template(tiny_qwen):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": PROMPTS[0]},
    ]
    result = collect(generate(tiny_qwen, messages, DecodeConfig(tau=1.0, max_new_tokens=8)))
    ids = tiny_qwen.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    out = tiny_qwen.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8)
    assert result.token_ids == out[0, len(ids):].tolist()


def test_sampling_is_seeded(tiny_qwen):
    config = DecodeConfig(tau=0.5, temperature=1.0, seed=7, max_new_tokens=20)
    a = collect(generate(tiny_qwen, PROMPTS[0], config)).token_ids
    b = collect(generate(tiny_qwen, PROMPTS[0], config)).token_ids
    c = collect(generate(tiny_qwen, PROMPTS[0], config.with_(seed=8))).token_ids
    assert a == b and a != c


def test_bad_input_gets_clear_errors(tiny_llama):
    with pytest.raises(ValueError, match="empty"):
        generate(tiny_llama, "   ")
    with pytest.raises(ValueError, match="context"):
        generate(tiny_llama, "fox " * 600)  # the tiny model's context is 512 tokens
    for bad in ({"tau": 1.2}, {"tau": -0.1}, {"block_size": 0}, {"max_new_tokens": 0}, {"metric": "x"}, {"mode": "y"}):
        with pytest.raises(ValueError):
            DecodeConfig(**bad)
    with pytest.raises(TypeError, match="unknown"):
        DecodeConfig().with_(tua=0.5)


def test_detokenizer_streams_split_characters_whole(tiny_llama):
    tok = tiny_llama.tokenizer
    text = "Caf\u00e9 \u4f60\u597d \U0001f600 fox"
    ids = tok(text, add_special_tokens=False).input_ids
    detok = Detokenizer(tok)
    pieces = [detok.push(t) for t in ids]
    pieces[-1] += detok.flush()
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_max_fed_caps_the_tokens_accepted_after_a_wide_pass(tiny_lm):
    """tau 0 accepts every candidate: B per pass uncapped; under a cap of 3, a pass after
    one that accepted k tokens offers max(2, 4 - k) candidates (the prefill pass offers B)."""
    uncapped = collect(
        generate(tiny_lm, PROMPTS[0], DecodeConfig(tau=0.0, block_size=4, max_new_tokens=40, max_fed=None))
    )
    capped = collect(generate(tiny_lm, PROMPTS[0], DecodeConfig(tau=0.0, block_size=4, max_new_tokens=40, max_fed=3)))
    assert [len(s.token_ids) for s in uncapped.steps[:-1]] == [4] * (len(uncapped.steps) - 1)
    assert [len(s.token_ids) for s in capped.steps[:4]] == [4, 2, 2, 2]


def test_max_fed_values_are_checked():
    for bad in (1, 0, "3", True, 2.5):
        with pytest.raises(ValueError, match="max fed"):
            DecodeConfig(max_fed=bad)
