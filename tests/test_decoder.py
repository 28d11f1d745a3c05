"""int8dyn's native decoder layers (backends/cpu/native_layers.py, csrc/decoder.cpp): the torch layers' logits
up to rounding, and every row bit for bit independent of the rows fed beside it."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from mars_demo.engine.backends.cpu import int8gemm, lean, native_layers
from mars_demo.engine.backends.cpu.paths import convert, token_ids

from conftest import PROMPTS, make_lm

pytestmark = pytest.mark.skipif(native_layers.kernel() is None, reason="no C++ compiler: the kernel cannot be built")


def int8dyn(arch: str, native: bool, monkeypatch):
    """The tiny model on int8dyn, its lean forward on the native layers or on the torch layers."""
    if not native:
        monkeypatch.setenv(native_layers.DECODER_ENV, "0")
    native_layers.kernel.cache_clear()
    try:
        lm = make_lm(arch)
        convert(lm.model, "int8dyn", smoothing=token_ids(lm.tokenizer, PROMPTS))
    finally:
        monkeypatch.delenv(native_layers.DECODER_ENV, raising=False)
        native_layers.kernel.cache_clear()
    assert (lm.model.forward.native is not None) == native
    return lm


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def cached_passes(lm) -> list[torch.Tensor]:
    """A prefill longer than 16 rows, a one-token pass, a MARS-wide pass, a two-token pass, on one cache."""
    mask = lm.meta.mask_token_id
    prompt = lm.tokenizer(" ".join(PROMPTS)).input_ids
    assert len(prompt) > lean.ROW_EXACT_ROWS
    cache, out = DynamicCache(config=lm.model.config), []
    with torch.inference_mode():
        for fed in (prompt, [7], [8, mask, mask, mask], [9, 10]):
            out.append(lm.model(input_ids=torch.tensor([fed]), past_key_values=cache, use_cache=True).logits)
    held = [torch.stack([getattr(layer, part) for layer in cache.layers]) for part in ("keys", "values")]
    return out + held


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_native_layers_give_the_torch_layers_logits_and_cache_up_to_rounding(arch, monkeypatch):
    lm, calls = int8dyn(arch, True, monkeypatch), []
    layers = lm.model.forward.native
    function = layers.function
    layers.function = lambda *a: calls.append(1) or function(*a)
    native = cached_passes(lm)
    assert len(calls) == 4  # every pass went through the native layers
    for got, want in zip(native, cached_passes(int8dyn(arch, False, monkeypatch)), strict=True):
        close(got, want)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_rows_output_does_not_depend_on_the_rows_fed_beside_it(arch, monkeypatch):
    lm = int8dyn(arch, True, monkeypatch)
    model, mask = lm.model, lm.meta.mask_token_id
    prompt = torch.tensor([lm.tokenizer(" ".join(PROMPTS)).input_ids])
    with torch.inference_mode():
        # a prefill with masks after the prompt (MARS, exact mode) and without (AR)
        alone, masked = DynamicCache(config=model.config), DynamicCache(config=model.config)
        a = model(input_ids=prompt, past_key_values=alone, use_cache=True).logits
        b = model(input_ids=torch.cat([prompt, torch.tensor([[mask] * 3])], 1), past_key_values=masked,
                  use_cache=True).logits
        assert torch.equal(a, b[:, : prompt.shape[1]])
        masked.crop(-3)
        assert all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
                   for x, y in zip(alone.layers, masked.layers))
        # a four-token pass and four one-token passes
        fed = torch.tensor([[5, 6, 7, 8]])
        wide = model(input_ids=fed, past_key_values=alone, use_cache=True).logits
        one_by_one = [model(input_ids=fed[:, i : i + 1], past_key_values=masked, use_cache=True).logits
                      for i in range(4)]
        assert torch.equal(wide, torch.cat(one_by_one, 1))
        # an uncached call
        assert torch.equal(model(input_ids=prompt, use_cache=False).logits, a)


def test_the_thread_count_changes_no_bits(monkeypatch):
    """Every step splits its work over the team, each row, column or (row, head) whole on one thread."""
    lm = int8dyn("qwen2", True, monkeypatch)
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(cached_passes(lm))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))


def test_a_left_padded_batchs_rows_equal_each_sequence_alone(monkeypatch):
    lm = int8dyn("qwen2", True, monkeypatch)
    model = lm.model
    batch = lm.tokenizer([PROMPTS[0], PROMPTS[2]], return_tensors="pt", padding=True, padding_side="left")
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp_min(0)
    width = batch.input_ids.shape[1]
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        both = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions,
                     past_key_values=cache, use_cache=True).logits
        fed = torch.tensor([[5, 6], [7, 8]])
        step_mask = torch.cat([batch.attention_mask, torch.ones(2, 2, dtype=torch.long)], 1)
        step = model(input_ids=fed, attention_mask=step_mask, position_ids=positions[:, -1:] + torch.tensor([[1, 2]]),
                     past_key_values=cache, use_cache=True, logits_to_keep=2).logits
        for row in range(2):
            length = int(batch.attention_mask[row].sum())
            ids = batch.input_ids[row : row + 1, width - length :]
            own = DynamicCache(config=model.config)
            assert torch.equal(model(input_ids=ids, past_key_values=own, use_cache=True).logits,
                               both[row : row + 1, width - length :])
            assert torch.equal(model(input_ids=fed[row : row + 1], past_key_values=own, use_cache=True).logits,
                               step[row : row + 1])


def test_the_buffers_grow_crop_and_survive_a_replaced_cache(monkeypatch):
    native, plain = int8dyn("llama", True, monkeypatch), int8dyn("llama", False, monkeypatch)
    ids = torch.randint(10, 300, (1, lean.BUFFER_SLACK + 40))  # past the first buffer's room
    with torch.inference_mode():
        caches = DynamicCache(config=native.model.config), DynamicCache(config=plain.model.config)
        for start, stop in ((0, 30), (30, 200), (200, 230), (230, ids.shape[1])):
            got, want = (lm.model(input_ids=ids[:, start:stop], past_key_values=c, use_cache=True, logits_to_keep=1)
                         for lm, c in zip((native, plain), caches))
            close(got.logits, want.logits)
            for cache in caches:
                cache.crop(-3)  # the next pass overwrites the cropped columns of the buffer
        assert caches[0].layers[0].keys.shape[-2] == ids.shape[1] - 12
        for cache in caches:
            cache.batch_repeat_interleave(2)  # new tensors: the next pass copies them into new buffers
        got, want = (lm.model(input_ids=torch.tensor([[5], [6]]), past_key_values=c, use_cache=True)
                     for lm, c in zip((native, plain), caches))
        close(got.logits, want.logits)
        close(caches[0].layers[1].values, caches[1].layers[1].values)


@pytest.mark.parametrize("replace", ["batch_repeat_interleave", "torch_update"])
def test_a_lean_cache_decodes_as_a_dynamic_cache_does(replace, monkeypatch):
    """The same bits on either cache through growth past a buffer's room, crops and tensors put in from outside."""
    lm = int8dyn("llama", True, monkeypatch)
    model = lm.model
    assert type(lean.new_cache(model)) is lean.LeanCache
    ids = torch.randint(10, 300, (1, lean.BUFFER_SLACK + 40))
    with torch.inference_mode():
        caches = lean.new_cache(model), DynamicCache(config=model.config)
        for start, stop in ((0, 30), (30, 31), (31, 35), (35, 200), (200, ids.shape[1])):
            got, want = (model(input_ids=ids[:, start:stop], past_key_values=c, use_cache=True).logits for c in caches)
            assert torch.equal(got, want)
            for cache in caches:
                cache.crop(-2)
        lean_layer = caches[0].layers[-1]
        assert type(lean_layer) is lean.LeanLayer and lean_layer._buffers is not None
        assert caches[0].get_seq_length() == caches[1].get_seq_length() == ids.shape[1] - 10
        assert torch.equal(lean_layer.keys, caches[1].layers[-1].keys)  # views made when read
        memo = dict(caches[0].native_memo)
        model(input_ids=ids[:, :1], past_key_values=caches[0], use_cache=True)
        assert caches[0].native_memo["keys"] is memo["keys"]  # the same buffers: the same address arrays
        caches[0].crop(-1)
        for cache in caches:
            if replace == "batch_repeat_interleave":  # new tensors assigned from outside
                cache.batch_repeat_interleave(2)
            else:  # DynamicLayer's own update (transformers' layers): concatenated tensors
                for layer in cache.layers:
                    layer.update(layer.keys[:, :, -1:], layer.values[:, :, -1:])
        assert lean_layer._buffers is None and torch.equal(lean_layer.values, caches[1].layers[-1].values)
        batch = 2 if replace == "batch_repeat_interleave" else 1
        fed = torch.tensor([[5, 6]] * batch)
        got, want = (model(input_ids=fed, past_key_values=c, use_cache=True).logits for c in caches)
        assert torch.equal(got, want)
        assert lean_layer._buffers is not None and caches[0].native_memo["keys"] is not memo["keys"]


def test_only_the_native_layers_get_a_lean_cache(torch_layers):
    lm = make_lm("llama")
    convert(lm.model, "int8dyn")
    assert type(lean.new_cache(lm.model)) is DynamicCache


def test_only_int8dyn_on_the_native_linear_gets_the_native_layers(monkeypatch):
    for path in ("fp32", "int8"):
        lm = make_lm("llama")
        convert(lm.model, path)
        assert lean.installed(lm.model) and lm.model.forward.native is None
    monkeypatch.setenv(int8gemm.INT8GEMM_ENV, "0")  # fbgemm's linears: no weights the layers can read
    int8gemm.kernel.cache_clear()
    try:
        lm = make_lm("llama")
        convert(lm.model, "int8dyn")
        assert lm.model.forward.native is None
    finally:
        monkeypatch.undo()
        int8gemm.kernel.cache_clear()


def test_the_rope_table_gives_the_rotary_modules_values():
    lm = make_lm("llama")
    convert(lm.model, "int8dyn")
    forward, x = lm.model.forward, torch.zeros(1, 1, lm.model.config.hidden_size)
    positions = torch.tensor([[0, 5, 6, 300], [2, 3, 4, lean.ROPE_TABLE_START + 7]])  # past the first table
    cos, sin = forward._rope(x, positions)
    want_cos, want_sin = forward.rotary(x, position_ids=positions)
    half = want_sin.shape[-1] // 2
    assert torch.equal(cos, want_cos)
    assert torch.equal(sin, torch.cat((-want_sin[..., :half], want_sin[..., half:]), dim=-1))
    assert forward.rope_table[0].shape[0] >= lean.ROPE_TABLE_START + 8  # built for the largest position
    padded = torch.tensor([[-1, 0, 1]])  # a caller's padding positions: no row of the table, the module's values
    assert torch.equal(forward._rope(x, padded)[0], forward.rotary(x, position_ids=padded)[0])
