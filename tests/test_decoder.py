"""int8dyn's native decoder layers (backends/cpu/native_layers.py, csrc/decoder.cpp): the torch layers' logits
up to rounding, and every row bit for bit independent of the rows fed beside it."""

from __future__ import annotations

import pytest
import torch

from mars_demo.engine.backends import CpuBackend, backend_for
from mars_demo.engine.backends.cpu import attention, int8gemm, lean, native_layers
from mars_demo.engine.backends.cpu.cache import SLACK
from mars_demo.engine.backends.cpu.calibration import token_ids
from mars_demo.engine.backends.cpu.paths import convert

from conftest import PROMPTS, make_lm

pytestmark = pytest.mark.skipif(native_layers.kernel() is None, reason="no C++ compiler: the kernel cannot be built")


def int8dyn(arch: str, native: bool, monkeypatch):
    """The tiny model on int8dyn, its CPU engine (``lm.backend``) on the native layers or on the torch layers."""
    if not native:
        monkeypatch.setenv(native_layers.DECODER_ENV, "0")
    native_layers.kernel.cache_clear()
    try:
        lm = make_lm(arch)
        convert(lm.model, "int8dyn", smoothing=token_ids(lm.tokenizer, PROMPTS))
        backend = lm.backend  # built here, while the switch holds; kept by lm while the weights stay
    finally:
        monkeypatch.delenv(native_layers.DECODER_ENV, raising=False)
        native_layers.kernel.cache_clear()
    assert isinstance(backend, CpuBackend) and lm.backend is backend
    assert backend.native == native and (backend.lean.native is not None) == native
    return lm


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def held(cache, part: int) -> list[torch.Tensor]:
    """Each layer's keys (0) or values (1) the cache holds."""
    return [pair[part][:, :, : cache.get_seq_length()] for pair in cache.buffers]


def cached_passes(lm, kind: torch.dtype | None = None) -> list[torch.Tensor]:
    """A prefill longer than 16 rows, a one-token pass, a MARS-wide pass, a two-token pass, on one cache.

    kind: the cache's dtype, set before the first pass (the torch layers keep what they find)."""
    mask = lm.meta.mask_token_id
    prompt = lm.tokenizer(" ".join(PROMPTS)).input_ids
    assert len(prompt) > attention.ROW_EXACT_ROWS
    backend = lm.backend
    cache, out = backend.new_cache(), []
    if kind is not None:
        first = backend.lean.layers[0]
        cache.open(torch.empty(1, first.kv_heads, 0, first.head_dim, dtype=kind), 0)
    with torch.inference_mode():
        for fed in (prompt, [7], [8, mask, mask, mask], [9, 10]):
            out.append(backend.forward(torch.tensor([fed]), cache, keep=0))
    return out + [torch.stack(held(cache, part)) for part in (0, 1)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_native_layers_give_the_torch_layers_logits_and_cache_up_to_rounding(arch, monkeypatch):
    lm, calls = int8dyn(arch, True, monkeypatch), []
    layers = lm.backend.lean.native
    function = layers.function
    layers.function = lambda *a: calls.append(1) or function(*a)
    native = cached_passes(lm)
    assert len(calls) == 4  # every pass went through the native layers
    kind = native[-1].dtype  # the cache's: fp16 where native_layers.half_cache()
    assert kind == (torch.float16 if native_layers.half_cache() else torch.float32)
    for got, want in zip(native, cached_passes(int8dyn(arch, False, monkeypatch), kind), strict=True):
        if got.dtype == torch.float16:  # the same keys rounded to halves: a rounding apart at most
            torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=2e-3)
        else:
            close(got, want)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_rows_output_does_not_depend_on_the_rows_fed_beside_it(arch, monkeypatch):
    lm = int8dyn(arch, True, monkeypatch)
    backend, mask = lm.backend, lm.meta.mask_token_id
    prompt = torch.tensor([lm.tokenizer(" ".join(PROMPTS)).input_ids])
    with torch.inference_mode():
        # a prefill with masks after the prompt (MARS, exact mode) and without (AR)
        alone, masked = backend.new_cache(), backend.new_cache()
        a = backend.forward(prompt, alone, keep=0)
        b = backend.forward(torch.cat([prompt, torch.tensor([[mask] * 3])], 1), masked, keep=0)
        assert torch.equal(a, b[:, : prompt.shape[1]])
        masked.crop(3)
        assert masked.get_seq_length() == alone.get_seq_length()
        assert all(torch.equal(x, y) for part in (0, 1) for x, y in zip(held(alone, part), held(masked, part)))
        # a four-token pass and four one-token passes
        fed = torch.tensor([[5, 6, 7, 8]])
        wide = backend.forward(fed, alone, keep=0)
        one_by_one = [backend.forward(fed[:, i : i + 1], masked) for i in range(4)]
        assert torch.equal(wide, torch.cat(one_by_one, 1))
        # an uncached call
        assert torch.equal(backend.forward(prompt, None, keep=0), a)


def test_a_64_dim_key_groups_passes_agree_across_rows_and_instruction_sets(tmp_path, monkeypatch):
    """Heads of 64 dims in groups of three over an fp16 cache: AVX-512 scores a group's heads together (each key
    converted once), AVX2 one head at a time; a row's bits are the same either way and alone or among others."""
    import ctypes

    from transformers import LlamaConfig, LlamaForCausalLM

    from mars_demo.engine.backends.cpu import native
    from mars_demo.engine.checkpoints.loading import LoadedModel

    if not native_layers.half_cache():
        pytest.skip("this build keeps an fp32 cache")
    tiny = make_lm("llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tiny.tokenizer), hidden_size=384, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=6, num_key_value_heads=2, initializer_range=0.3, tie_word_embeddings=False)
    lm = LoadedModel(model=LlamaForCausalLM(config).eval(), tokenizer=tiny.tokenizer, meta=tiny.meta, name="tiny-64")
    convert(lm.model, "int8dyn", smoothing=token_ids(lm.tokenizer, PROMPTS))
    layers = lm.backend.lean.native
    assert layers is not None and layers.dim == 64 and layers.heads // layers.kv_heads == 3
    default = cached_passes(lm)
    assert default[-1].dtype == torch.float16
    prompt = torch.tensor([lm.tokenizer(" ".join(PROMPTS)).input_ids])
    with torch.inference_mode():  # four rows at once against one at a time, after the same prefill
        wide, narrow = lm.backend.new_cache(), lm.backend.new_cache()
        lm.backend.forward(prompt, wide), lm.backend.forward(prompt, narrow)
        fed = torch.tensor([[5, 6, 7, 8]])
        together = lm.backend.forward(fed, wide, keep=0)
        assert torch.equal(together, torch.cat([lm.backend.forward(fed[:, i : i + 1], narrow) for i in range(4)], 1))
    monkeypatch.setattr(native, "TUNE", ("-march=native", "-mno-avx512f"))
    built = native.build("decoder", native.compiler(), tmp_path)
    avx2 = ctypes.CDLL(str(built)).decoder
    avx2.argtypes, avx2.restype = layers.function.argtypes, ctypes.c_int
    layers.function = avx2
    assert all(torch.equal(a, b) for a, b in zip(cached_passes(lm), default, strict=True))


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
    backend = lm.backend
    batch = lm.tokenizer([PROMPTS[0], PROMPTS[2]], return_tensors="pt", padding=True, padding_side="left")
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp_min(0)
    width = batch.input_ids.shape[1]
    with torch.inference_mode():
        cache = backend.new_cache()
        both = backend.forward(batch.input_ids, cache, positions=positions, mask=batch.attention_mask, keep=0)
        fed = torch.tensor([[5, 6], [7, 8]])
        step_mask = torch.cat([batch.attention_mask, torch.ones(2, 2, dtype=torch.long)], 1)
        step = backend.forward(fed, cache, positions=positions[:, -1:] + torch.tensor([[1, 2]]), mask=step_mask,
                               keep=2)
        for row in range(2):
            length = int(batch.attention_mask[row].sum())
            ids = batch.input_ids[row : row + 1, width - length :]
            own = backend.new_cache()
            assert torch.equal(backend.forward(ids, own, keep=0), both[row : row + 1, width - length :])
            assert torch.equal(backend.forward(fed[row : row + 1], own, keep=0), step[row : row + 1])


def test_the_buffers_grow_crop_and_survive_a_reorder(monkeypatch):
    """The native layers beside the torch layers on the same passes: growth past a buffer's room, crops (the
    next pass overwrites), then rows selected (formerly a DynamicCache's tensors replaced from outside: the
    engine's cache changes only through ``keep_rows``, new buffers the next pass must use)."""
    native, plain = int8dyn("llama", True, monkeypatch), int8dyn("llama", False, monkeypatch)
    backends = native.backend, plain.backend
    ids = torch.randint(10, 300, (1, SLACK + 40))  # past the first buffer's room
    with torch.inference_mode():
        caches = tuple(b.new_cache() for b in backends)
        if native_layers.half_cache():  # the torch layers keep the dtype of the cache they find
            layer = plain.backend.lean.layers[0]
            caches[1].open(torch.empty(1, layer.kv_heads, 0, layer.head_dim, dtype=torch.float16), 0)
        first = None
        for start, stop in ((0, 30), (30, 200), (200, 230), (230, ids.shape[1])):
            got, want = (b.forward(ids[:, start:stop], c) for b, c in zip(backends, caches))
            close(got, want)
            first = caches[0].buffers[0][0] if first is None else first
            for cache in caches:
                cache.crop(3)  # the next pass overwrites the cropped columns of the buffer
        assert caches[0].get_seq_length() == caches[1].get_seq_length() == ids.shape[1] - 12
        assert caches[0].buffers[0][0].data_ptr() != first.data_ptr()  # it grew into a new buffer
        for cache in caches:
            cache.keep_rows(torch.tensor([0, 0]))  # new tensors: the native layers must write into them
        got, want = (b.forward(torch.tensor([[5], [6]]), c) for b, c in zip(backends, caches))
        close(got, want)
        torch.testing.assert_close(held(caches[0], 1)[1].float(), held(caches[1], 1)[1].float(), atol=1e-3, rtol=2e-3)


@pytest.mark.parametrize("change", ["keep_rows", "stack_and_drop_front"])
def test_a_changed_cache_decodes_as_a_fresh_one(change, monkeypatch):
    """Formerly "a LeanCache decodes as a DynamicCache does" (the LeanCache is gone: the engine has one cache).

    On the native layers, a CpuCache that grows past a buffer's room and is cropped, then has its rows changed
    (``keep_rows``: a row repeated; ``stack`` and ``drop_front``: a row joining with left holes, then the other
    leaving and the holes going), gives at every pass the bits of a fresh cache fed the columns it holds in one
    prefill; the native layers' arrays of buffer addresses are made once per set of buffers, again when they change.
    """
    lm = int8dyn("llama", True, monkeypatch)
    backend = lm.backend

    def as_fresh(tokens: list[int], fed: torch.Tensor) -> torch.Tensor:
        """``fed``'s logits after ``tokens`` on a fresh cache."""
        fresh = backend.new_cache()
        if tokens:
            backend.forward(torch.tensor([tokens]), fresh)
        return backend.forward(fed, fresh, keep=0)

    ids = torch.randint(10, 300, (SLACK + 40,)).tolist()
    with torch.inference_mode():
        cache, tokens, first = backend.new_cache(), [], None
        for start, stop in ((0, 30), (30, 31), (31, 35), (35, 200), (200, len(ids))):
            fed = torch.tensor([ids[start:stop]])
            assert torch.equal(backend.forward(fed, cache, keep=0), as_fresh(tokens, fed)), (start, stop)
            first = cache.buffers[0][0] if first is None else first
            tokens += ids[start:stop]
            cache.crop(2)
            del tokens[-2:]
        assert cache.get_seq_length() == len(tokens) == len(ids) - 10
        assert cache.buffers[0][0].data_ptr() != first.data_ptr()  # it grew into a new buffer
        memo = dict(cache.native_memo)
        backend.forward(torch.tensor([ids[:1]]), cache)
        assert cache.native_memo["keys"] is memo["keys"]  # the same buffers: the same address arrays
        cache.crop(1)
        fed = torch.tensor([[5, 6]])
        if change == "keep_rows":  # a row repeated: new tensors
            cache.keep_rows(torch.tensor([0, 0]))
            got = backend.forward(fed.repeat(2, 1), cache, keep=0)
            assert cache.native_memo["keys"] is not memo["keys"]
            want = as_fresh(tokens, fed)
            assert torch.equal(got[:1], want) and torch.equal(got[1:], want)
            return
        joining = [11, 12, 13, 14, 15, 16, 17]
        other = backend.new_cache()
        backend.forward(torch.tensor([joining]), other)
        width = cache.get_seq_length()
        holes = width - len(joining)
        cache.stack([other], width)
        mask = torch.ones(2, width + 2, dtype=torch.long)
        mask[1, :holes] = 0
        positions = torch.tensor([[width, width + 1], [len(joining), len(joining) + 1]])
        both = torch.tensor([[5, 6], [7, 8]])
        got = backend.forward(both, cache, positions=positions, mask=mask, keep=0)
        assert cache.native_memo["keys"] is not memo["keys"]
        assert torch.equal(got[:1], as_fresh(tokens, both[:1])) and torch.equal(got[1:], as_fresh(joining, both[1:]))
        cache.keep_rows(torch.tensor([1]))  # the first row leaves; the holes every row has left go
        cache.drop_front(holes)
        assert cache.get_seq_length() == len(joining) + 2
        fed = torch.tensor([[9]])
        assert torch.equal(backend.forward(fed, cache, keep=0), as_fresh(joining + [7, 8], fed))


def test_only_the_native_layers_run_where_they_are_built(torch_layers):
    """Formerly "only the native layers get a lean cache": the engine has one cache (CpuCache) whatever runs
    its layers; with the native decoder switched off, int8dyn's engine runs the torch layers."""
    lm = make_lm("llama")
    convert(lm.model, "int8dyn")
    backend = backend_for(lm.model)
    assert isinstance(backend, CpuBackend) and not backend.native and backend.lean.native is None


def test_only_int8dyn_on_the_native_linear_gets_the_native_layers(monkeypatch):
    for path in ("fp32", "int8"):
        lm = make_lm("llama")
        convert(lm.model, path)
        backend = CpuBackend(lm.model)  # fp32 too: the engine it decodes with on a measured path
        assert not backend.native and backend.lean.native is None
    monkeypatch.setenv(int8gemm.INT8GEMM_ENV, "0")  # fbgemm's linears: no weights the layers can read
    int8gemm.kernel.cache_clear()
    try:
        lm = make_lm("llama")
        convert(lm.model, "int8dyn")
        assert backend_for(lm.model).lean.native is None
    finally:
        monkeypatch.undo()
        int8gemm.kernel.cache_clear()


def test_the_rope_table_gives_the_rotary_modules_values():
    lm = make_lm("llama")
    convert(lm.model, "int8dyn")
    forward, x = backend_for(lm.model).lean, torch.zeros(1, 1, lm.model.config.hidden_size)
    positions = torch.tensor([[0, 5, 6, 300], [2, 3, 4, lean.ROPE_TABLE_START + 7]])  # past the first table
    cos, sin = forward._rope(x, positions)
    want_cos, want_sin = forward.rotary(x, position_ids=positions)
    half = want_sin.shape[-1] // 2
    assert torch.equal(cos, want_cos)
    assert torch.equal(sin, torch.cat((-want_sin[..., :half], want_sin[..., half:]), dim=-1))
    assert forward.rope_table[0].shape[0] >= lean.ROPE_TABLE_START + 8  # built for the largest position
    padded = torch.tensor([[-1, 0, 1]])  # a caller's padding positions: no row of the table, the module's values
    assert torch.equal(forward._rope(x, padded)[0], forward.rotary(x, position_ids=padded)[0])
