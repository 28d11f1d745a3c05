"""The lean forward (lean.py): the transformers forward's logits, bit for bit, on every path and pass kind.

These tests run the lean forward's torch layers: int8dyn's native decoder layers (native_layers.py), which
round the norms and the SiLU differently, are switched off here and tested in test_decoder.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from mars_demo.engine.backends.cpu import lean
from mars_demo.engine.backends.cpu.paths import convert, token_ids
from mars_demo.engine.decoding import exact
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.research.benchmark import profile_passes

from conftest import PROMPTS, make_lm


@pytest.fixture(autouse=True)
def on_torch_layers(torch_layers):
    """Every test here (conftest.torch_layers)."""


def on_path(arch: str, path: str):
    lm = make_lm(arch)
    convert(lm.model, path, smoothing=token_ids(lm.tokenizer, PROMPTS) if path == "int8dyn" else None)
    assert lean.installed(lm.model)
    return lm


def transformers_forward(model):
    return lambda **kwargs: type(model).forward(model, **kwargs)


def passes(lm) -> list[dict]:
    """The calls a decoder makes, in order on one cache: a prefill, one-token and wide passes, a verifying pass."""
    prompt = lm.tokenizer(PROMPTS[0]).input_ids
    mask = lm.meta.mask_token_id
    calls = [{"input_ids": torch.tensor([prompt]), "logits_to_keep": 1}]
    for fed in ([7], [8, mask, mask, mask], [9, 10], [11] + [mask] * 7):
        calls.append({"input_ids": torch.tensor([fed]), "logits_to_keep": len(fed), "crop": len(fed) - 1})
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("path", ["fp32", "bf16", "int8", "int8dyn"])
def test_every_pass_gives_the_transformers_forwards_logits_bit_for_bit(arch, path):
    lm = on_path(arch, path)
    model, reference = lm.model, transformers_forward(lm.model)
    with torch.inference_mode():
        caches = DynamicCache(config=model.config), DynamicCache(config=model.config)
        for call in passes(lm):
            crop = call.pop("crop", 0)
            got, want = (fn(past_key_values=c, use_cache=True, **call) for fn, c in zip((model, reference), caches))
            assert torch.equal(got.logits, want.logits), call
            for cache in caches:
                cache.crop(-crop)
            assert caches[0].get_seq_length() == caches[1].get_seq_length()
        # exact mode's verifying pass: position ids and a 4-D mask
        fed = exact.verify_window([5], [6, 7], 3, lm.meta.mask_token_id, caches[0].get_seq_length(), model.dtype, "cpu")
        call = {"input_ids": fed.ids, "attention_mask": fed.attention_mask, "position_ids": fed.position_ids,
                "logits_to_keep": fed.keep, "use_cache": True}
        got, want = model(past_key_values=caches[0], **call), reference(past_key_values=caches[1], **call)
        assert torch.equal(got.logits, want.logits)
        for layer_got, layer_want in zip(caches[0].layers, caches[1].layers):
            assert torch.equal(layer_got.keys, layer_want.keys) and torch.equal(layer_got.values, layer_want.values)


@pytest.mark.parametrize("path", ["int8", "int8dyn"])
def test_a_plainly_causal_short_pass_builds_no_mask_and_keeps_the_logits(path, monkeypatch):
    """One sequence, no padding, a DynamicCache, up to 16 rows: the row-exact attention's own causal rule."""
    lm = on_path("llama", path)
    built = []
    real = lean.create_causal_mask
    monkeypatch.setattr(lean, "create_causal_mask", lambda **kw: built.append(kw["inputs_embeds"].shape) or real(**kw))
    model, reference = lm.model, transformers_forward(lm.model)
    prompt = lm.tokenizer(PROMPTS[0]).input_ids
    with torch.inference_mode():
        caches = DynamicCache(config=model.config), DynamicCache(config=model.config)
        for fed in (prompt[:12], [7, lm.meta.mask_token_id, lm.meta.mask_token_id], [9]):
            call = {"input_ids": torch.tensor([fed]), "logits_to_keep": len(fed), "use_cache": True}
            got, want = model(past_key_values=caches[0], **call), reference(past_key_values=caches[1], **call)
            assert torch.equal(got.logits, want.logits)
        assert built == []
        padded = torch.ones(1, caches[0].get_seq_length() + 2, dtype=torch.long)
        model(input_ids=torch.tensor([[5, 6]]), attention_mask=padded, past_key_values=caches[0], use_cache=True)
        assert len(built) == 1  # a padding mask given: transformers builds it


@pytest.mark.parametrize("path", ["fp32", "int8dyn"])
def test_left_padded_batches_and_uncached_calls_match_too(path):
    lm = on_path("qwen2", path)
    model, reference = lm.model, transformers_forward(lm.model)
    batch = lm.tokenizer([PROMPTS[0], PROMPTS[2]], return_tensors="pt", padding=True, padding_side="left")
    with torch.inference_mode():
        caches = DynamicCache(config=model.config), DynamicCache(config=model.config)
        got, want = (fn(input_ids=batch.input_ids, attention_mask=batch.attention_mask, past_key_values=c,
                        use_cache=True) for fn, c in zip((model, reference), caches))
        assert torch.equal(got.logits, want.logits)
        step = torch.ones(2, batch.input_ids.shape[1] + 2, dtype=torch.long)
        step[:, : batch.input_ids.shape[1]] = batch.attention_mask
        fed = torch.tensor([[5, 6], [7, 8]])
        got, want = (fn(input_ids=fed, attention_mask=step, past_key_values=c, use_cache=True, logits_to_keep=2)
                     for fn, c in zip((model, reference), caches))
        assert torch.equal(got.logits, want.logits)
        ids = batch.input_ids[:1]
        got, want = (fn(input_ids=ids, use_cache=False) for fn in (model, reference))
        assert torch.equal(got.logits, want.logits)


def test_the_key_value_buffer_grows_crops_and_survives_a_replaced_cache():
    lm = on_path("llama", "int8dyn")
    model, reference = lm.model, transformers_forward(lm.model)
    ids = torch.randint(10, 300, (1, lean.BUFFER_SLACK + 40))  # past the first buffer's room
    with torch.inference_mode():
        caches = DynamicCache(config=model.config), DynamicCache(config=model.config)
        for start, stop in ((0, 30), (30, 200), (200, 230), (230, ids.shape[1])):
            got, want = (fn(input_ids=ids[:, start:stop], past_key_values=c, use_cache=True, logits_to_keep=1)
                         for fn, c in zip((model, reference), caches))
            assert torch.equal(got.logits, want.logits), (start, stop)
            for cache in caches:
                cache.crop(-3)  # the next pass overwrites the cropped columns of the buffer
        held = caches[0].layers[0].keys
        assert held.shape[-2] == ids.shape[1] - 12
        # the batch code replaces the cache's tensors (a reorder, a copy): the next pass starts a new buffer
        for cache in caches:
            cache.batch_repeat_interleave(2)
        fed = torch.tensor([[5], [6]])
        got, want = (fn(input_ids=fed, past_key_values=c, use_cache=True) for fn, c in zip((model, reference), caches))
        assert torch.equal(got.logits, want.logits)
        assert caches[0].layers[0].keys.data_ptr() != held.data_ptr()


def test_what_the_lean_forward_does_not_cover_goes_to_the_models_own_forward():
    lm = on_path("llama", "int8")
    ids = torch.tensor([lm.tokenizer(PROMPTS[1]).input_ids])
    with torch.inference_mode():
        out = lm.model(input_ids=ids, output_hidden_states=True)
        assert out.hidden_states is not None and len(out.hidden_states) == lm.model.config.num_hidden_layers + 1
        assert lm.model(input_ids=ids, labels=ids).loss is not None
        assert isinstance(lm.model(input_ids=ids, return_dict=False), tuple)
        mask = torch.ones_like(ids)
        assert torch.equal(lm.model(ids, mask).logits, lm.model(input_ids=ids, attention_mask=mask).logits)


def test_unsupported_models_and_the_switch_keep_the_models_own_forward(monkeypatch):
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
                         max_window_layers=0)
    sliding = Qwen2ForCausalLM(config).eval()
    assert "sliding" in lean.unsupported(sliding)
    assert not lean.install(sliding) and not lean.installed(sliding)
    lm = make_lm("llama")
    monkeypatch.setenv(lean.LEAN_ENV, "0")
    convert(lm.model, "int8")
    assert not lean.installed(lm.model)
    monkeypatch.delenv(lean.LEAN_ENV)
    assert lean.install(lm.model) and lean.installed(lm.model)
    lean.uninstall(lm.model)
    assert not lean.installed(lm.model) and "forward" not in lm.model.__dict__


def test_a_model_already_on_the_lean_forward_converts_like_a_plain_one():
    """int8dyn's smoothing reads activation ranges with hooks on the linears, which the lean forward bypasses."""
    plain, lean_first = make_lm("qwen2"), make_lm("qwen2")
    convert(lean_first.model, "fp32")  # auto measures fp32 on the lean forward, then converts copies of it
    assert lean.installed(lean_first.model)
    smoothing = token_ids(plain.tokenizer, PROMPTS)
    for lm in (plain, lean_first):
        convert(lm.model, "int8dyn", smoothing=smoothing)
    ids = torch.tensor([plain.tokenizer(PROMPTS[3]).input_ids])
    with torch.inference_mode():
        assert torch.equal(plain.model(input_ids=ids).logits, lean_first.model(input_ids=ids).logits)


def test_transformers_generate_on_a_left_padded_batch_matches_too():
    """generate makes left-padded rows' position ids only when the forward's signature shows ``position_ids``."""
    lm = on_path("llama", "int8dyn")
    texts = [" ".join(PROMPTS), "Count"]  # the second row padded by many columns
    batch = lm.tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    runs = []
    for on in (True, False):
        if not on:
            lean.uninstall(lm.model)
        with torch.inference_mode():
            runs.append(lm.model.generate(**batch, max_new_tokens=6, do_sample=False, output_logits=True,
                                          return_dict_in_generate=True, pad_token_id=lm.tokenizer.pad_token_id))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    # RoPE sees relative positions, so shifted ones change only the rounding: compare the bits
    assert all(torch.equal(a, b) for a, b in zip(runs[0].logits, runs[1].logits, strict=True))


def test_bench_profiles_the_body_and_the_head_of_the_lean_forward():
    """The lean forward calls neither the decoder module nor the head module, whose hooks the profiler used."""
    lm = on_path("qwen2", "int8dyn")
    prompts = [prompt_ids(lm.tokenizer, p) for p in PROMPTS[:2]]
    profile = profile_passes(lm, prompts, tau=0.5, block_size=4, max_new_tokens=6)
    for name in ("mars", "ar"):
        parts = profile[name]["ms_per_pass"]
        assert parts["forward_body"] > 0 and parts["lm_head"] > 0, parts
        assert parts["forward_body"] + parts["lm_head"] <= parts["total"]
    assert lm.model.forward.clock is None  # taken off afterwards
