"""Shared prompt prefixes (backends/cpu/prefixes.py): a prefill that starts from a stored prefix gives what the
whole prefill gives, bit for bit, on the int8 paths; one prompt decoded twice stores nothing for itself."""

from __future__ import annotations

import pytest
import torch

from mars_demo.engine.backends import CpuBackend
from mars_demo.engine.backends.cpu.calibration import token_ids
from mars_demo.engine.backends.cpu.paths import convert
from mars_demo.engine.backends.cpu.prefixes import MIN_SHARED, PrefixStore, shared_length
from mars_demo.engine.decoding.batch import collect_batch, stream_batch_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import collect, stream_ids
from mars_demo.engine.serving.loop import Request

from conftest import PROMPTS, make_lm

OPENING = list(range(40, 60))  # 20 tokens every prompt starts with (a chat template's system turn)
TAILS = [list(range(100, 112)), list(range(200, 215)), list(range(300, 310)) + [70, 80, 90], list(range(360, 380))]
CONFIGS = [DecodeConfig(mode="ar", max_new_tokens=10), DecodeConfig(tau=0.7, max_new_tokens=10),
           DecodeConfig(mode="exact", max_new_tokens=10)]


@pytest.fixture(scope="module", params=["int8dyn", "int8"])
def on_path(request):
    lm = make_lm("llama")
    convert(lm.model, request.param, smoothing=token_ids(lm.tokenizer, PROMPTS))
    assert isinstance(lm.backend, CpuBackend) and lm.backend.prefixes is not None
    return lm


def _decode_all(lm) -> list:
    prompts = [OPENING + tail for tail in TAILS]
    out = []
    for config in CONFIGS:
        for ids in prompts:
            gen = collect(stream_ids(lm, ids, config))
            out.append((gen.token_ids, [step.confidences for step in gen.steps]))
        out.append(collect_batch(stream_batch_ids(lm, prompts, config, scheme="token")).token_ids)
    return out


def test_prefills_from_a_stored_prefix_decode_bit_for_bit(on_path):
    backend = on_path.backend
    backend.prefixes = None
    want = _decode_all(on_path)
    backend.prefixes = store = PrefixStore()
    got = _decode_all(on_path)
    assert store.reused_tokens >= len(OPENING) * 10  # most prefills started from the opening
    assert [len(key) for key in store.entries] == [len(OPENING)]
    assert got == want


@pytest.mark.parametrize("config", CONFIGS, ids=["ar", "mars", "exact"])
def test_a_batch_starts_all_its_rows_from_the_opening_in_one_pass(on_path, monkeypatch, config):
    """Where holes cost nothing (int8dyn's native layers), a batch's first pass copies the opening once for all its
    rows (rows.PaddedCache._feed_from_prefix) and feeds only the rest of each row, one pass for all; the rows'
    text is the one without the store. Elsewhere the rows are fed apart, each from the opening."""
    backend = on_path.backend
    prompts = [OPENING + tail for tail in TAILS]
    backend.prefixes = None
    want = collect_batch(stream_batch_ids(on_path, prompts, config, scheme="token")).token_ids
    backend.prefixes = store = PrefixStore()
    for tail in TAILS[:2]:  # two prompts show the store their opening
        collect(stream_ids(on_path, OPENING + tail, CONFIGS[0]))
    filled, fill = [], type(backend).fill_prefix

    def counted(self, rows, cache, keep):
        filled.append(fill(self, rows, cache, keep))
        return filled[-1]

    monkeypatch.setattr(type(backend), "fill_prefix", counted)
    reused = store.reused_tokens
    assert collect_batch(stream_batch_ids(on_path, prompts, config, scheme="token")).token_ids == want
    assert filled == ([len(OPENING)] if backend.native else [0])
    assert store.reused_tokens - reused == len(OPENING) * len(TAILS)  # once a row, one way or the other


def _served(lm) -> list[list[int]]:
    """Requests with one opening arriving while others decode: each joins a running batch alone."""
    from test_serving import make_loop

    loop = make_loop(lm, "fixed:0.7", max_batch=3, max_new=12)
    requests = [Request(i, tuple(OPENING + tail), 0.03 * i) for i, tail in enumerate(TAILS)]
    list(loop.run(requests))
    return [loop.served[i].token_ids for i in range(len(TAILS))]


def test_requests_joining_a_running_batch_start_from_the_opening(on_path):
    backend = on_path.backend
    backend.prefixes = None
    want = _served(on_path)
    backend.prefixes = store = PrefixStore()
    assert _served(on_path) == want
    assert store.reused_tokens >= len(OPENING) * (len(TAILS) - 2)


def test_one_prompt_decoded_twice_stores_nothing_for_itself(on_path):
    backend = on_path.backend
    backend.prefixes = store = PrefixStore()
    ids = OPENING + TAILS[0]
    for config in CONFIGS:  # AR feeds the prompt, MARS and exact the prompt and masks after it
        collect(stream_ids(on_path, ids, config))
    assert not store.entries and store.reused_tokens == 0


def test_a_prefill_keeps_the_tokens_it_must_score(on_path):
    backend = on_path.backend
    backend.prefixes = store = PrefixStore()
    for tail in TAILS[:2]:
        collect(stream_ids(on_path, OPENING + tail, CONFIGS[0]))
    cache = backend.new_cache()
    ids = torch.tensor([OPENING + [5]])
    with torch.inference_mode():
        logits = backend.forward(ids, cache, keep=3)
    assert logits.shape[1] == 3 and cache.end == ids.shape[1]
    assert store.reused_tokens == len(OPENING) + 1 - 3  # stored after the second prompt; all but the 3 to score


def test_only_plain_prefills_start_from_a_prefix(on_path):
    backend = on_path.backend
    backend.prefixes = PrefixStore()
    ids = torch.tensor([OPENING + [5, 6]])
    cache = backend.new_cache()
    assert backend._plain_prefill(ids, cache, None, None, 1)
    assert backend._plain_prefill(ids, cache, None, torch.ones(1, ids.shape[1], dtype=torch.long), 1)  # no holes
    holes = torch.ones(1, ids.shape[1], dtype=torch.long)
    holes[0, :2] = 0
    assert not backend._plain_prefill(ids, cache, None, holes, 1)
    assert not backend._plain_prefill(ids, cache, None, torch.ones(1, 1, ids.shape[1], ids.shape[1]).bool(), 1)
    assert not backend._plain_prefill(ids, cache, torch.arange(1, ids.shape[1] + 1)[None], None, 1)
    assert not backend._plain_prefill(ids.expand(2, -1), cache, None, None, 1)
    assert not backend._plain_prefill(ids, cache, None, None, 0)  # every position's logits


def test_no_store_off_the_int8_paths_or_when_switched_off(monkeypatch):
    lm = make_lm("llama")
    convert(lm.model, "bf16")
    assert lm.backend.prefixes is None  # bf16's prefill GEMM rounds a row by the rows beside it
    lm = make_lm("llama")
    monkeypatch.setenv("MARS_DEMO_PREFIXES", "0")
    convert(lm.model, "int8dyn", smoothing=token_ids(lm.tokenizer, PROMPTS))
    assert lm.backend.prefixes is None


def test_shared_length():
    a = torch.tensor([1, 2, 3, 4])
    assert shared_length(a, torch.tensor([1, 2, 9])) == 2
    assert shared_length(a, torch.tensor([1, 2])) == 2
    assert shared_length(a, torch.tensor([5])) == 0
    assert MIN_SHARED <= len(OPENING) and all(len(t) >= MIN_SHARED for t in TAILS)
