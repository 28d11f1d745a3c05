"""Batches on the CPU engine: a first pass fed row by row without its padding, and rows that leave in place.

On the CPU engine's row-exact paths a row's logits and keys do not depend on the rows beside it, so
feeding the first pass's rows apart (``PaddedCache._feed_apart``) must give bit for bit what the padded
pass gives, and a batch must still decode every row as it would alone.
"""

from __future__ import annotations

import pytest
import torch

from mars_demo.engine.backends import CpuBackend
from mars_demo.engine.backends.cpu.cache import CpuCache, moves_in_place
from mars_demo.engine.backends.cpu.paths import convert, token_ids
from mars_demo.engine.decoding.batch import collect_batch, stream_batch
from mars_demo.engine.decoding.batch.rows import PaddedCache, fill_from_end
from mars_demo.engine.decoding.batch.token import slide
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import collect, stream

from conftest import PROMPTS, make_lm

MIXED = [PROMPTS[0], " ".join(PROMPTS) * 2, PROMPTS[2], PROMPTS[3][:5]]  # very different lengths: left padding


@pytest.fixture(scope="module", params=["int8dyn", "bf16"])
def on_path(request):
    lm = make_lm("llama")
    convert(lm.model, request.param, smoothing=token_ids(lm.tokenizer, PROMPTS))
    assert isinstance(lm.backend, CpuBackend) and lm.backend.padding_costs
    return lm


def _ids(lm) -> list[list[int]]:
    return [prompt_ids(lm.tokenizer, p) for p in MIXED]


def _first_pass(lm, apart: bool):
    backend, ids = lm.backend, _ids(lm)
    backend.padding_costs = apart  # the instance's choice; the class keeps its own
    try:
        kv = PaddedCache(backend, len(ids))
        window = slide(ids, [0] * len(ids), [8] * len(ids), [4] * len(ids), lm.meta.mask_token_id, 0)
        with torch.inference_mode():
            logits = kv.forward(window)
    finally:
        del backend.padding_costs
    return logits, kv


def test_a_first_pass_fed_apart_equals_the_padded_pass(on_path):
    """Bit for bit where the prefill's GEMMs are row-exact (int8dyn); bf16's round by the rows of the call, so
    there each row fed apart is what the row alone gets (the single-sequence decoder's prefill), and close."""
    (apart, kv_apart), (padded, kv_padded) = _first_pass(on_path, True), _first_pass(on_path, False)
    if on_path.model.dtype == torch.float32:
        assert torch.equal(apart, padded)
    else:
        torch.testing.assert_close(apart, padded, atol=0.1, rtol=0.05)
    mask_id = on_path.meta.mask_token_id
    for r, prompt in enumerate(_ids(on_path)):
        with torch.inference_mode():
            alone = on_path.backend.forward(torch.tensor([prompt + [mask_id] * 3]), on_path.backend.new_cache(), keep=4)
        assert torch.equal(apart[r], alone[0])
    assert torch.equal(kv_apart.attn, kv_padded.attn)
    assert kv_apart.cache.get_seq_length() == kv_padded.cache.get_seq_length() == kv_padded.length
    real = kv_padded.attn.bool()  # holes hold zeros in one and the padding's keys in the other: compare real columns
    same = torch.equal if on_path.model.dtype == torch.float32 else lambda a, b: torch.allclose(a, b, atol=0.1)
    for (k1, v1), (k2, v2) in zip(kv_apart.cache.buffers, kv_padded.cache.buffers):
        end = kv_padded.length
        for a, b in ((k1, k2), (v1, v2)):
            assert same(a[:, :, :end].transpose(1, 2)[real], b[:, :, :end].transpose(1, 2)[real])


@pytest.mark.parametrize("mode", ["ar", "mars", "exact"])
def test_every_row_of_a_batch_equals_that_row_alone(on_path, mode):
    config = DecodeConfig(mode=mode, max_new_tokens=20, tau=0.7 if mode == "mars" else 1.0, max_fed=None)
    lm, ids = on_path, _ids(on_path)
    batch = collect_batch(stream_batch(lm.backend, lm.tokenizer, ids, config, mask_id=lm.meta.mask_token_id,
                                       block_size=4, scheme="token"))
    assert len(batch.token_ids) == len(ids)
    for row, prompt in zip(batch.token_ids, ids):
        alone = collect(stream(lm.backend, lm.tokenizer, prompt, config, mask_id=lm.meta.mask_token_id, block_size=4))
        assert row == alone.token_ids


def test_rows_leave_in_place_and_the_others_keep_their_columns():
    cache = CpuCache(2)
    keys = torch.randn(5, 2, 6, 3)
    like = keys[:, :, :0]
    cache.open(like, 6)
    for layer in range(2):
        cache.write(layer, keys, -keys)
    before = [k.data_ptr() for k, _ in cache.buffers]
    order = fill_from_end([0, 2, 4])  # rows 1 and 3 leave: row 4 takes slot 1
    assert order == [0, 4, 2]
    cache.keep_rows(torch.tensor(order))
    assert [k.data_ptr() for k, _ in cache.buffers] == before  # no new buffers
    for k, v in cache.buffers:
        assert k.shape[0] == 3 and torch.equal(k[:, :, :6], keys[order]) and torch.equal(v[:, :, :6], -keys[order])
    cache.keep_rows(torch.tensor([0, 0]))  # a row repeated: new buffers
    assert torch.equal(cache.buffers[0][0][:, :, :6], keys[[0, 0]])


@pytest.mark.parametrize(("order", "rows", "in_place"), [
    ([0, 1, 2], 3, True), ([0, 2], 3, True), ([2, 0], 3, False), ([1, 0], 2, False), ([0, 0], 1, False),
    ([3, 1, 2], 4, True), ([1, 2], 2, False),
])
def test_which_orders_move_in_place(order, rows, in_place):
    assert moves_in_place(order, rows) is in_place


def test_fill_from_end_keeps_every_row_once():
    for kept in ([0], [1], [0, 1, 2], [2, 5, 6], [0, 3, 4, 7]):
        order = fill_from_end(kept)
        assert sorted(order) == kept and all(order[i] == i for i in range(len(order)) if i in kept)


def test_dropping_the_front_is_a_view_until_the_cache_grows():
    cache = CpuCache(1)
    keys = torch.randn(2, 1, 5, 4)
    cache.open(keys[:, :, :0], 5)
    cache.write(0, keys, keys)
    pointer = cache.buffers[0][0].data_ptr()
    cache.drop_front(2)
    assert cache.get_seq_length() == 3 and torch.equal(cache.buffers[0][0][:, :, :3], keys[:, :, 2:])
    assert cache.buffers[0][0].data_ptr() == pointer + 2 * 4 * keys.element_size()
    room = cache.buffers[0][0].shape[2]
    cache.open(keys[:, :, :0], room)  # past the room left: new buffers holding the same columns
    assert torch.equal(cache.buffers[0][0][:, :, :3], keys[:, :, 2:])
