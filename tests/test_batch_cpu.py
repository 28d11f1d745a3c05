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
from mars_demo.engine.backends.cpu.calibration import token_ids
from mars_demo.engine.backends.cpu.paths import convert
from mars_demo.engine.decoding.batch import collect_batch, decode_batch, stream_batch
from mars_demo.engine.decoding.batch.rows import PaddedCache, fill_from_end
from mars_demo.engine.decoding.batch.token import slide
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import LiveTau, collect, decode_passes, eos_ids, stream
from mars_demo.engine.decoding.width import WidthController
from mars_demo.engine.serving.loop import Request, ServeConfig, ServingLoop
from mars_demo.engine.serving.policies import parse_policy

from conftest import PROMPTS, make_lm

MIXED = [PROMPTS[0], " ".join(PROMPTS) * 2, PROMPTS[2], PROMPTS[3][:5]]  # very different lengths: left padding


@pytest.fixture(scope="module", params=["int8dyn", "bf16"])
def on_path(request):
    lm = make_lm("llama")
    convert(lm.model, request.param, smoothing=token_ids(lm.tokenizer, PROMPTS))
    assert isinstance(lm.backend, CpuBackend) and lm.backend.padding_costs
    return lm


def lm_native(lm) -> bool:
    return isinstance(lm.backend, CpuBackend) and lm.backend.native


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


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_verifying_batches_hand_the_cpu_engine_the_masks_its_attention_reads(attention):
    """Booleans where the attention reads them, additive floats for transformers' eager attention (which adds
    them): either way a verifying batch's rows are each row alone."""
    lm = make_lm("llama")
    lm.model.config._attn_implementation = attention
    backend = CpuBackend(lm.model)
    assert backend.lean.attention == attention and backend.bool_masks == (attention != "eager")
    config = DecodeConfig(mode="exact", max_new_tokens=12, max_fed=None)
    ids, forward, kinds = _ids(lm), backend.forward, set()

    def forward_seen(*args, mask=None, **kwargs):
        if mask is not None and mask.dim() == 4:
            kinds.add(mask.dtype)
        return forward(*args, mask=mask, **kwargs)

    backend.forward = forward_seen
    batch = collect_batch(stream_batch(backend, lm.tokenizer, ids, config, mask_id=lm.meta.mask_token_id,
                                       block_size=4, scheme="token"))
    assert kinds == ({torch.bool} if backend.bool_masks else {torch.float32})
    backend.forward = forward
    for row, prompt in zip(batch.token_ids, ids):
        alone = collect(stream(backend, lm.tokenizer, prompt, config, mask_id=lm.meta.mask_token_id, block_size=4))
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


def test_rows_join_into_spare_rows_with_holes_on_the_left():
    def filled(rows: int, columns: int, seed: int) -> tuple[CpuCache, torch.Tensor]:
        cache, keys = CpuCache(1), torch.randn(rows, 1, columns, 2, generator=torch.Generator().manual_seed(seed))
        cache.open(keys[:, :, :0], columns)
        cache.write(0, keys, keys + 1)
        return cache, keys

    (batch, mine), (first, a), (second, b) = filled(2, 6, 0), filled(1, 4, 1), filled(1, 3, 2)
    batch.stack([first], 6)  # a first join: new buffers, with rows to spare
    assert batch.buffers[0][0].shape[0] == 3 and batch.bases[0][0].shape[0] > 3
    spare_before = batch.bases[0][0].data_ptr()
    batch.stack([second], 6)  # the next: into a spare row, no new buffers
    assert batch.bases[0][0].data_ptr() == spare_before and batch.get_seq_length() == 6
    want = torch.cat([mine, torch.cat([torch.zeros(1, 1, 2, 2), a], 2), torch.cat([torch.zeros(1, 1, 3, 2), b], 2)])
    k, v = batch.buffers[0]
    assert torch.equal(k[:, :, :6], want) and torch.equal(v[:, :, 3:6][3], b[0] + 1)
    longer, _ = filled(1, 9, 3)
    batch.stack([longer], 9)  # longer than the batch: new buffers, the batch's rows get holes
    assert batch.get_seq_length() == 9 and torch.equal(batch.buffers[0][0][:4, :, 3:9], want)


@pytest.mark.parametrize("mode", ["mars", "exact"])
def test_requests_joining_and_leaving_a_running_batch_decode_as_alone(on_path, mode):
    """Continuous batching on the CPU engine: rows join into spare rows, leave in place, and each request's
    text is that of the single-sequence decoder."""
    lm, texts = on_path, [*MIXED, PROMPTS[1], PROMPTS[3], PROMPTS[0][:9]]
    stop = eos_ids(lm.backend, lm.tokenizer)
    loop = ServingLoop(
        lm.backend, mask_id=lm.meta.mask_token_id, pad_id=lm.tokenizer.pad_token_id, stop_ids=stop,
        config=ServeConfig(mode=mode, max_batch=3, max_new_tokens=16), policy=parse_policy("fixed:1.0"),
        pass_cost=lambda rows, width, kind, measured: 0.01 + 0.001 * rows * width,
    )
    arrivals = (0.0, 0.0, 0.02, 0.03, 0.05, 0.06, 0.2)
    events = list(loop.run([Request(i, tuple(prompt_ids(lm.tokenizer, t)), a)
                            for i, (t, a) in enumerate(zip(texts, arrivals))]))
    assert any(e.admitted and e.running > len(e.admitted) for e in events)  # someone joined a running batch
    for served in loop.served.values():
        assert served.status == "done"
        passes = decode_passes(lm.backend, list(served.request.prompt),
                               DecodeConfig(mode=mode, max_new_tokens=16, max_fed=None), window=4,
                               mask_id=lm.meta.mask_token_id, tau=LiveTau(1.0), stop_ids=stop)
        assert served.token_ids == [t for p in passes for t in p.tokens]


class Cycle(WidthController):
    """Widths 4, 2, 1, 3, pass after pass: rows that accepted unevenly, or have little room left, get holes."""

    def __init__(self):
        super().__init__(None, 4)
        self.calls = 0

    def choose(self, rows, caps, tau, fed=None, joins=0, static=False):
        self.calls += 1
        return (4, 2, 1, 3)[(self.calls - 1) % 4]


@pytest.mark.parametrize("mode", ["mars", "hybrid"])
def test_rows_fed_different_widths_in_one_pass_each_equal_decoding_alone(on_path, mode):
    """The native layers leave a pass's holes out of its work (int8dyn); every row still decodes as alone."""
    lm, ids = on_path, _ids(on_path)
    config = DecodeConfig(mode=mode, max_new_tokens=9, tau=0.3, max_fed="auto")

    def decode(prompts):
        return collect_batch(decode_batch(
            lm.backend, prompts, config, scheme="token", block_size=4, mask_id=lm.meta.mask_token_id,
            pad_id=lm.tokenizer.pad_token_id, tau=LiveTau(config.tau), stop_ids=eos_ids(lm.backend, lm.tokenizer),
            controller=Cycle(),
        ))

    together = decode(ids)
    widths = [{s.width for s in e.rows if s.width} for e in together.events[1:]]
    assert any(len(w) > 1 for w in widths), "rows should take different widths in some pass"
    for row, prompt in zip(together.token_ids, ids):
        assert row == decode([prompt]).token_ids[0]


def test_a_pass_with_holes_computes_its_fed_rows_as_the_pass_without_them(on_path, monkeypatch):
    """Bit for bit: the fed rows of a pass whose narrower rows' holes are left out (Visible.live) against the same
    pass with every column computed."""
    if not lm_native(on_path):
        pytest.skip("holes are left out by the native layers only (int8dyn)")
    from mars_demo.engine.backends.cpu import native_layers

    ids, run = _ids(on_path), native_layers.NativeLayers.run
    seen = []

    def passes(packed: bool):
        def run_with(self, x, cos, sin, start, buffers, visible, memo=None, final_norm=None):
            if visible is not None and start:  # a decoding pass (the prefill is fed apart)
                seen.append(visible.live)
                if not packed:
                    visible.live = None
            return run(self, x, cos, sin, start, buffers, visible, memo, final_norm)

        monkeypatch.setattr(native_layers.NativeLayers, "run", run_with)
        kv = PaddedCache(on_path.backend, len(ids))
        mask_id = on_path.meta.mask_token_id
        with torch.inference_mode():
            kv.forward(slide(ids, [0] * len(ids), [8] * len(ids), [1] * len(ids), mask_id, 0))
            window = slide([[5], [6, 7], [8], [9]], [len(p) for p in ids], [8] * 4, [4, 1, 2, 3], mask_id, 0)
            return kv.forward(window), window

    (packed, window), (full, _) = passes(True), passes(False)
    assert seen[0] is not None and seen[0].numel() == sum(map(sum, window.attn))  # holes were left out
    fed = torch.tensor(window.attn, dtype=torch.bool)[:, -window.keep:]
    assert torch.equal(packed[fed], full[fed])
