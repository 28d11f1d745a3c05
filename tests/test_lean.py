"""The CPU engine's model code (lean.py, run as ``CpuBackend.forward``): the transformers forward's logits, bit for
bit, on every path and pass kind.

The reference is the model's own forward (``TransformersBackend``) with the attention the engine uses on that
path: transformers' SDPA on fp32, the row-exact attention (attention.py) on bf16, int8 and int8dyn. The package
registers nothing with transformers; these tests register the row-exact functions themselves (``row_exact``)
and set them on the reference side only.

These tests run the engine's torch layers: int8dyn's native decoder layers (native_layers.py), which round the
norms and the SiLU differently, are switched off here and tested in test_decoder.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, Qwen2Config, Qwen2ForCausalLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from mars_demo.engine.backends import CpuBackend, TransformersBackend, backend_for, cpu_engine_runs
from mars_demo.engine.backends.cpu import attention, lean
from mars_demo.engine.backends.cpu.cache import SLACK
from mars_demo.engine.backends.cpu.calibration import token_ids
from mars_demo.engine.backends.cpu.paths import ComputePath, convert
from mars_demo.engine.decoding import exact
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import collect, generate
from mars_demo.research.benchmark import profile_passes

from conftest import PROMPTS, make_lm

LEAN_ENV = "MARS_DEMO_LEAN"  # "0": backend_for gives every model transformers' forward


@pytest.fixture(autouse=True)
def on_torch_layers(torch_layers):
    """Every test here (conftest.torch_layers)."""


@pytest.fixture(autouse=True, scope="module")
def row_exact():
    """The row-exact attention known to transformers by name, for the reference forward (module docstring)."""
    names = {attention.ROW_EXACT: attention.row_exact_attention,
             attention.ROW_EXACT_PREFILL: attention.row_exact_prefill_attention}
    for name, function in names.items():
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)
    yield
    for name in names:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)


def on_path(arch: str, path: str):
    lm = make_lm(arch)
    convert(lm.model, path, smoothing=token_ids(lm.tokenizer, PROMPTS) if path == "int8dyn" else None)
    # a converted model decodes on the CPU engine; fp32 does where a compute path was measured
    assert isinstance(backend_for(lm.model), CpuBackend) == (path != "fp32") and cpu_engine_runs(lm.model)
    return lm


def engine_and_reference(lm) -> tuple[CpuBackend, TransformersBackend]:
    """The CPU engine on the model's path, and transformers' forward set to the attention the engine uses there."""
    ours = CpuBackend(lm.model)
    lm.model.set_attn_implementation(ours.lean.attention)
    return ours, TransformersBackend(lm.model)


def held(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) as a cache holds them: a CpuCache's buffers up to its end, or transformers'."""
    if hasattr(cache, "buffers"):
        return [(k[:, :, : cache.end], v[:, :, : cache.end]) for k, v in cache.buffers]
    return [(layer.keys, layer.values) for layer in cache.inner.layers]


def same_cache(a, b) -> bool:
    return a.get_seq_length() == b.get_seq_length() and all(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(held(a), held(b), strict=True)
    )


def passes(lm) -> list[dict]:
    """The calls a decoder makes, in order on one cache: a prefill, one-token and wide passes, a verifying pass."""
    prompt = lm.tokenizer(PROMPTS[0]).input_ids
    mask = lm.meta.mask_token_id
    calls = [{"ids": torch.tensor([prompt]), "keep": 1}]
    for fed in ([7], [8, mask, mask, mask], [9, 10], [11] + [mask] * 7):
        calls.append({"ids": torch.tensor([fed]), "keep": len(fed), "crop": len(fed) - 1})
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("path", ["fp32", "bf16", "int8", "int8dyn"])
def test_every_pass_gives_the_transformers_forwards_logits_bit_for_bit(arch, path):
    lm = on_path(arch, path)
    backends = engine_and_reference(lm)
    with torch.inference_mode():
        caches = tuple(b.new_cache() for b in backends)
        for call in passes(lm):
            crop = call.pop("crop", 0)
            got, want = (b.forward(call["ids"], c, keep=call["keep"]) for b, c in zip(backends, caches))
            assert got.shape == (1, call["keep"], lm.model.config.vocab_size)
            assert torch.equal(got, want), call
            for cache in caches:
                cache.crop(crop)
            assert caches[0].get_seq_length() == caches[1].get_seq_length()
        # exact mode's verifying pass: position ids and a 4-D mask
        fed = exact.verify_window([5], [6, 7], 3, lm.meta.mask_token_id, caches[0].get_seq_length(), lm.model.dtype,
                                  "cpu")
        got, want = (b.forward(fed.ids, c, positions=fed.position_ids, mask=fed.attention_mask, keep=fed.keep)
                     for b, c in zip(backends, caches))
        assert torch.equal(got, want)
        assert same_cache(*caches)


@pytest.mark.parametrize("path", ["int8", "int8dyn"])
def test_a_plainly_causal_short_pass_builds_no_mask_and_keeps_the_logits(path, monkeypatch):
    """One sequence, no padding, up to 16 rows: the row-exact attention's own causal rule, no mask built."""
    lm = on_path("llama", path)
    ours, reference = engine_and_reference(lm)
    built = []
    real = ours.lean._mask
    monkeypatch.setattr(ours.lean, "_mask", lambda x, padding, past: built.append(x.shape) or real(x, padding, past))
    prompt = lm.tokenizer(PROMPTS[0]).input_ids
    with torch.inference_mode():
        caches = ours.new_cache(), reference.new_cache()
        for fed in (prompt[:12], [7, lm.meta.mask_token_id, lm.meta.mask_token_id], [9]):
            got, want = (b.forward(torch.tensor([fed]), c, keep=len(fed)) for b, c in zip((ours, reference), caches))
            assert torch.equal(got, want)
        assert built == []
        padded = torch.ones(1, caches[0].get_seq_length() + 2, dtype=torch.long)
        got, want = (b.forward(torch.tensor([[5, 6]]), c, mask=padded) for b, c in zip((ours, reference), caches))
        assert len(built) == 1  # a padding mask given: transformers' mask is built from it
        assert torch.equal(got, want)


@pytest.mark.parametrize("path", ["fp32", "int8dyn"])
def test_left_padded_batches_and_uncached_calls_match_too(path):
    lm = on_path("qwen2", path)
    backends = engine_and_reference(lm)
    batch = lm.tokenizer([PROMPTS[0], PROMPTS[2]], return_tensors="pt", padding=True, padding_side="left")
    with torch.inference_mode():
        caches = tuple(b.new_cache() for b in backends)
        got, want = (b.forward(batch.input_ids, c, mask=batch.attention_mask, keep=0) for b, c in zip(backends, caches))
        assert torch.equal(got, want)
        step = torch.ones(2, batch.input_ids.shape[1] + 2, dtype=torch.long)
        step[:, : batch.input_ids.shape[1]] = batch.attention_mask
        fed = torch.tensor([[5, 6], [7, 8]])
        got, want = (b.forward(fed, c, mask=step, keep=2) for b, c in zip(backends, caches))
        assert torch.equal(got, want)
        ids = batch.input_ids[:1]
        got, want = (b.forward(ids, None, keep=0) for b in backends)
        assert torch.equal(got, want)


def test_the_key_value_buffer_grows_crops_and_survives_rows_selected_stacked_and_trimmed():
    """Formerly "survives a replaced cache" (a DynamicCache's tensors replaced from outside): the CPU engine owns
    its cache now, and the batch code changes it only through the interface. A CpuCache grows past its first
    room (a new buffer), crops (the next pass overwrites), and after ``keep_rows`` (a row repeated), ``stack``
    (a row joining, left holes) and ``drop_front`` (the holes every row left) gives transformers' forward's
    logits on its DynamicCache bit for bit; the trimmed row then decodes as that row on a fresh cache does."""
    lm = on_path("llama", "int8dyn")
    backends = engine_and_reference(lm)
    ids = torch.randint(10, 300, (1, SLACK + 40))  # past the first buffer's room
    with torch.inference_mode():
        caches = tuple(b.new_cache() for b in backends)
        first = None
        for start, stop in ((0, 30), (30, 200), (200, 230), (230, ids.shape[1])):
            got, want = (b.forward(ids[:, start:stop], c) for b, c in zip(backends, caches))
            assert torch.equal(got, want), (start, stop)
            first = caches[0].buffers[0][0] if first is None else first
            for cache in caches:
                cache.crop(3)  # the next pass overwrites the cropped columns of the buffer
        assert caches[0].get_seq_length() == ids.shape[1] - 12 and same_cache(*caches)
        assert caches[0].buffers[0][0].data_ptr() != first.data_ptr()  # it grew into a new buffer
        # a row repeated (the batch code's reorder): new tensors, the same columns
        keys = caches[0].buffers[0][0]
        for cache in caches:
            cache.keep_rows(torch.tensor([0, 0]))
        assert caches[0].buffers[0][0].data_ptr() != keys.data_ptr()
        got, want = (b.forward(torch.tensor([[5], [6]]), c) for b, c in zip(backends, caches))
        assert torch.equal(got, want)
        # a row joining: its own cache stacked below, padded on the left with holes
        prompt = torch.tensor([lm.tokenizer(PROMPTS[1]).input_ids])
        joining = tuple(b.new_cache() for b in backends)
        alone = [b.forward(prompt, c) for b, c in zip(backends, joining)]
        assert torch.equal(*alone)
        width = caches[0].get_seq_length()
        holes = width - prompt.shape[1]
        for cache, other in zip(caches, joining):
            cache.stack([other], width)
        assert caches[0].get_seq_length() == width and same_cache(*caches)
        mask = torch.ones(3, width + 1, dtype=torch.long)
        mask[2, :holes] = 0
        positions = torch.tensor([[width], [width], [prompt.shape[1]]])
        fed = torch.tensor([[7], [8], [9]])
        got, want = (b.forward(fed, c, positions=positions, mask=mask) for b, c in zip(backends, caches))
        assert torch.equal(got, want)
        # the first two rows leave; the holes every row has left go
        for cache in caches:
            cache.keep_rows(torch.tensor([2]))
            cache.drop_front(holes)
        assert caches[0].get_seq_length() == prompt.shape[1] + 1 and same_cache(*caches)
        # that row alone on a fresh cache: the same columns, then the same logits
        fresh = backends[0].new_cache()
        backends[0].forward(prompt, fresh)
        backends[0].forward(torch.tensor([[9]]), fresh)
        assert same_cache(fresh, caches[0])
        got, want = (b.forward(torch.tensor([[10]]), c) for b, c in zip(backends, caches))
        assert torch.equal(got, want)
        assert torch.equal(backends[0].forward(torch.tensor([[10]]), fresh), got)


def test_building_and_running_the_engine_leaves_the_model_as_transformers_made_it():
    """Formerly "what the lean forward does not cover goes to the model's own forward": the engine no longer
    replaces ``model.forward``, so there is nothing to fall back from. Building a backend and running passes
    sets nothing on the model (no attribute, no attention, no module changed), and the model's own forward
    keeps all it offers (hidden states, a loss, tuples, positional arguments)."""
    lm = on_path("llama", "int8")
    model = lm.model
    ids = torch.tensor([lm.tokenizer(PROMPTS[1]).input_ids])
    before = (dict(model.__dict__), model.config._attn_implementation, list(model.named_modules()))
    backend = backend_for(model)
    with torch.inference_mode():
        cache = backend.new_cache()
        backend.forward(ids, cache)
        backend.forward(torch.tensor([[5, 6]]), cache, keep=2)
    after = (dict(model.__dict__), model.config._attn_implementation, list(model.named_modules()))
    assert after == before and "forward" not in model.__dict__
    assert type(model).forward is type(make_lm("llama").model).forward
    with torch.inference_mode():
        out = model(input_ids=ids, output_hidden_states=True)
        assert out.hidden_states is not None and len(out.hidden_states) == model.config.num_hidden_layers + 1
        assert model(input_ids=ids, labels=ids).loss is not None
        assert isinstance(model(input_ids=ids, return_dict=False), tuple)
        mask = torch.ones_like(ids)
        assert torch.equal(model(ids, mask).logits, model(input_ids=ids, attention_mask=mask).logits)


def test_unsupported_models_and_the_switch_keep_transformers_forward(monkeypatch):
    """Formerly lean.install / uninstall: ``backend_for`` gives the CPU engine only where ``lean.unsupported`` is
    None and MARS_DEMO_LEAN is not "0", and only to a model on a compute path (converted, or fp32 with a measured
    curve); every other model decodes with its own forward, and neither choice changes the model."""
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
                         max_window_layers=0)
    sliding = convert(Qwen2ForCausalLM(config).eval(), "int8")
    assert "sliding" in lean.unsupported(sliding) and not cpu_engine_runs(sliding)
    assert type(backend_for(sliding)) is TransformersBackend
    with pytest.raises(ValueError, match="sliding"):
        CpuBackend(sliding)
    lm = make_lm("llama")
    measured = ComputePath(path="fp32", requested="fp32", costs_ms={1: 1.0, 2: 1.0})
    assert lean.unsupported(lm.model) is None
    assert type(backend_for(lm.model)) is TransformersBackend  # fp32 as loaded: nothing measured
    assert type(backend_for(lm.model, measured)) is CpuBackend
    monkeypatch.setenv(LEAN_ENV, "0")
    convert(lm.model, "int8")
    assert not cpu_engine_runs(lm.model) and type(backend_for(lm.model, measured)) is TransformersBackend
    assert type(lm.backend) is TransformersBackend
    monkeypatch.delenv(LEAN_ENV)
    assert cpu_engine_runs(lm.model) and type(backend_for(lm.model)) is CpuBackend
    assert "forward" not in lm.model.__dict__ and "forward" not in sliding.__dict__


def test_a_model_the_engine_has_run_converts_like_a_plain_one():
    """int8dyn's smoothing reads activation ranges with hooks on the linears, which the engine's passes bypass.

    Formerly "a model already on the lean forward converts like a plain one": a model the CPU engine has run
    (fp32 decoding on a measured path, then put on another) converts exactly as a fresh one: the same logits,
    bit for bit, through the engine and through transformers' forward."""
    plain, used = make_lm("qwen2"), make_lm("qwen2")
    ids = torch.tensor([plain.tokenizer(PROMPTS[3]).input_ids])
    engine = CpuBackend(used.model)
    with torch.inference_mode():
        engine.forward(ids, engine.new_cache())
    smoothing = token_ids(plain.tokenizer, PROMPTS)
    for lm in (plain, used):
        convert(lm.model, "int8dyn", smoothing=smoothing)
    with torch.inference_mode():
        assert torch.equal(backend_for(plain.model).forward(ids, None, keep=0),
                           backend_for(used.model).forward(ids, None, keep=0))
        assert torch.equal(plain.model(input_ids=ids).logits, used.model(input_ids=ids).logits)


@pytest.mark.parametrize("path", ["fp32", "int8dyn"])
def test_every_pass_of_transformers_generate_on_a_left_padded_batch_gives_the_engines_logits(path):
    """Formerly generate with the lean forward on and off: generate now always runs transformers' own forward
    (bench's reference, on any path). Every pass it makes on a left-padded batch (its position ids from the
    padding, its 2-D masks), fed to the CPU engine on one cache, gives the logits generate saw bit for bit (the
    row-exact attention set on transformers' side), so its greedy tokens are the engine's."""
    lm = on_path("llama", path)
    ours, _ = engine_and_reference(lm)
    texts = [" ".join(PROMPTS), "Count"]  # the second row padded by many columns
    batch = lm.tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    seen = []

    def record(module, args, kwargs):
        seen.append({name: kwargs.get(name) for name in ("input_ids", "attention_mask", "position_ids")})

    hook = lm.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.inference_mode():
            run = lm.model.generate(**batch, max_new_tokens=6, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True, pad_token_id=lm.tokenizer.pad_token_id)
    finally:
        hook.remove()
    assert len(seen) == len(run.logits) == 6
    assert seen[0]["position_ids"] is not None  # generate made the padded rows' positions
    cache = ours.new_cache()
    with torch.inference_mode():
        for call, want in zip(seen, run.logits, strict=True):
            got = ours.forward(call["input_ids"], cache, positions=call["position_ids"], mask=call["attention_mask"])
            assert torch.equal(got[:, -1], want)
    width = batch.input_ids.shape[1]
    assert torch.equal(run.sequences[:, width:], torch.stack([logits.argmax(-1) for logits in run.logits], 1))


def test_transformers_generate_on_fp32_gives_our_ar_decoders_tokens():
    """bench's fair reference: generate (transformers' forward, fp32) beside our AR on the fp32 CPU engine."""
    lm = make_lm("qwen2")
    lm.compute = ComputePath(path="fp32", requested="fp32", costs_ms={1: 1.0, 2: 1.0})  # measured: the CPU engine
    assert isinstance(lm.backend, CpuBackend)
    config = DecodeConfig(mode="ar", max_new_tokens=8)
    for prompt in PROMPTS:
        ids = prompt_ids(lm.tokenizer, prompt)
        with torch.inference_mode():
            out = lm.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        assert out[0, len(ids) :].tolist() == collect(generate(lm, prompt, config)).token_ids


def test_bench_profiles_the_body_and_the_head_of_the_engines_forward():
    """The engine calls neither the decoder module nor the head module, whose hooks the profiler used."""
    lm = on_path("qwen2", "int8dyn")
    assert isinstance(lm.backend, CpuBackend)
    prompts = [prompt_ids(lm.tokenizer, p) for p in PROMPTS[:2]]
    profile = profile_passes(lm, prompts, tau=0.5, block_size=4, max_new_tokens=6)
    for name in ("mars", "ar"):
        parts = profile[name]["ms_per_pass"]
        assert parts["forward_body"] > 0 and parts["lm_head"] > 0, parts
        assert parts["forward_body"] + parts["lm_head"] <= parts["total"]
    assert lm.backend.lean.clock is None  # taken off afterwards


def test_a_pass_whose_rows_differ_from_the_caches_is_refused():
    """Rows change only through keep_rows and stack; a pass that disagrees would drop the cached columns."""
    from mars_demo.engine.backends.cpu.cache import CpuCache

    cache = CpuCache(layers=2)
    cache.open(torch.zeros(1, 2, 0, 8), 5)
    with pytest.raises(ValueError, match="a pass of 2 rows on a cache of 1 rows"):
        cache.open(torch.zeros(2, 2, 0, 8), 1)
    assert cache.get_seq_length() == 5
