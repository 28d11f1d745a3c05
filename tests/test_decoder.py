"""int8dyn's native decoder layers (backends/cpu/native_layers.py, csrc/decoder.cpp): the torch layers' logits
up to rounding, and every row bit for bit independent of the rows fed beside it."""

from __future__ import annotations

import pytest
import torch

from mars_demo.engine.backends import CpuBackend, backend_for
from mars_demo.engine.backends.cpu import attention, int8gemm, lean, native_layers
from mars_demo.engine.backends.cpu.cache import SLACK, CpuCache, from_records, record_width, to_records
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


@pytest.fixture
def no_int8_cache(monkeypatch):
    """An fp16 (or fp32) cache for a test that holds the native layers to the torch layers: they agree up to a
    rounding, and an int8 record can turn such a rounding into a step of its scale (the int8 cache's own tests:
    below)."""
    from mars_demo import settings

    monkeypatch.setenv(settings.INT8_CACHE.name, "0")
    native_layers.int8_cache.cache_clear()
    yield
    monkeypatch.delenv(settings.INT8_CACHE.name)
    native_layers.int8_cache.cache_clear()


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
        cache.open(torch.empty(1, first.kv_heads, 0, record_width(first.head_dim, kind), dtype=kind), 0)
    with torch.inference_mode():
        for fed in (prompt, [7], [8, mask, mask, mask], [9, 10]):
            out.append(backend.forward(torch.tensor([fed]), cache, keep=0))
    return out + [torch.stack(held(cache, part)) for part in (0, 1)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_native_layers_give_the_torch_layers_logits_and_cache_up_to_rounding(arch, monkeypatch, no_int8_cache):
    lm, calls = int8dyn(arch, True, monkeypatch), []
    layers = lm.backend.lean.native
    function = layers.function
    layers.function = lambda *a: calls.append(1) or function(*a)
    native = cached_passes(lm)
    assert len(calls) == 4  # every pass went through the native layers
    kind = native[-1].dtype  # the cache's: native_layers.cache_dtype
    assert kind == native_layers.cache_dtype(torch.float32)
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


def test_a_64_dim_key_groups_passes_agree_across_rows_and_instruction_sets(tmp_path, monkeypatch, cache_kind):
    """Heads of 64 dims in groups of three over an fp16 cache or int8 records: AVX-512 scores a group's heads together
    (each key converted once), AVX2 one head at a time; a row's bits are the same either way and alone or among
    others."""
    import ctypes

    from transformers import LlamaConfig, LlamaForCausalLM

    from mars_demo.engine.backends.cpu import native
    from mars_demo.engine.checkpoints.loading import LoadedModel

    if not native_layers.half_cache() and cache_kind == "fp16":
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
    assert default[-1].dtype == (torch.int8 if cache_kind == "int8" else torch.float16)
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


def test_the_buffers_grow_crop_and_survive_a_reorder(monkeypatch, no_int8_cache):
    """The native layers beside the torch layers on the same passes: growth past a buffer's room, crops (the
    next pass overwrites), then rows selected (formerly a DynamicCache's tensors replaced from outside: the
    engine's cache changes only through ``keep_rows``, new buffers the next pass must use)."""
    native, plain = int8dyn("llama", True, monkeypatch), int8dyn("llama", False, monkeypatch)
    backends = native.backend, plain.backend
    ids = torch.randint(10, 300, (1, SLACK + 40))  # past the first buffer's room
    with torch.inference_mode():
        caches = tuple(b.new_cache() for b in backends)
        kind = native_layers.cache_dtype(torch.float32)
        if kind != torch.float32:  # the torch layers keep the dtype of the cache they find
            layer = plain.backend.lean.layers[0]
            caches[1].open(torch.empty(1, layer.kv_heads, 0, record_width(layer.head_dim, kind), dtype=kind), 0)
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


@pytest.fixture(params=["int8", "fp16"])
def cache_kind(request, monkeypatch):
    """The native layers' cache: int8 records (MARS_DEMO_INT8_CACHE), or fp16 where this build reads halves (else
    fp32)."""
    from mars_demo import settings

    monkeypatch.setenv(settings.INT8_CACHE.name, "1" if request.param == "int8" else "0")
    native_layers.int8_cache.cache_clear()
    yield request.param
    monkeypatch.delenv(settings.INT8_CACHE.name, raising=False)
    native_layers.int8_cache.cache_clear()


def test_int8_records_are_the_bits_the_native_layers_write():
    import ctypes

    from mars_demo.engine.backends.cpu import native

    function = native.library(native.INCLUDED_IN.get("decoder", "decoder")).int8_record
    function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p], None
    torch.manual_seed(0)
    x = torch.randn(6, 64) * torch.tensor([[1e-3], [0.1], [1.0], [30.0], [0.0], [1.0]])
    x[5, :8] = torch.tensor([127.0, -127.0, 0.5, 1.5, -2.5, 63.5, -0.5, 126.5])  # ties: x / scale at .5 exactly
    want = to_records(x)
    assert want.shape == (6, 68) and want.dtype == torch.int8
    for row, record in zip(x, want):
        got = torch.empty(68, dtype=torch.int8)
        function(row.contiguous().data_ptr(), 64, got.data_ptr())
        assert torch.equal(got, record)
    back = from_records(want)
    assert torch.equal(back[4], torch.zeros(64))  # an all-zero head: scale 0, values 0
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 * (1 + 1e-6)).all()  # within half a step of the head's scale
    assert torch.equal(want[5, :8], torch.tensor([127, -127, 0, 2, -2, 64, 0, 126], dtype=torch.int8))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_cache_kind_keeps_a_rows_bits_its_own(arch, cache_kind, monkeypatch):
    """The row-independence checks above, on each kind of cache; an int8 cache holds records of head dim + 4."""
    test_a_rows_output_does_not_depend_on_the_rows_fed_beside_it(arch, monkeypatch)
    if arch == "qwen2":
        test_a_left_padded_batchs_rows_equal_each_sequence_alone(monkeypatch)
    lm = int8dyn(arch, True, monkeypatch)
    cache = lm.backend.new_cache()
    with torch.inference_mode():
        lm.backend.forward(torch.tensor([[5, 6, 7]]), cache)
    keys, dim = cache.buffers[0][0], lm.backend.lean.native.dim
    assert (keys.dtype, keys.shape[-1]) == ((torch.int8, dim + 4) if cache_kind == "int8" else (keys.dtype, dim))
    assert keys.dtype != torch.int8 or cache_kind == "int8"


@pytest.mark.parametrize("cache_kind", ["int8"], indirect=True)
def test_an_int8_cache_grows_crops_and_reorders_as_its_rows_alone(monkeypatch, cache_kind):
    """Growth past a buffer's room, crops and a reorder on int8 records: a repeated row decodes as the row alone
    (the fp16 cache: test_the_buffers_grow_crop_and_survive_a_reorder)."""
    backend = int8dyn("llama", True, monkeypatch).backend
    ids = torch.randint(10, 300, (1, SLACK + 40))
    with torch.inference_mode():
        batch, alone = backend.new_cache(), backend.new_cache()
        for start, stop in ((0, 30), (30, 200), (200, 230), (230, ids.shape[1])):
            for cache in (batch, alone):
                backend.forward(ids[:, start:stop], cache)
                cache.crop(3)
        assert batch.buffers[0][0].dtype == torch.int8 and batch.get_seq_length() == ids.shape[1] - 12
        batch.keep_rows(torch.tensor([0, 0]))
        both = backend.forward(torch.tensor([[5], [5]]), batch)
        assert torch.equal(both[0], both[1]) and torch.equal(both[:1], backend.forward(torch.tensor([[5]]), alone))


def test_the_torch_layers_write_and_read_int8_records():
    """What a prefill too long for the native layers does with an int8 cache: records written, floats read back."""
    cache = CpuCache(1)
    torch.manual_seed(1)
    keys, values = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 5, 16)
    cache.open(torch.empty(2, 3, 0, record_width(16, torch.int8), dtype=torch.int8), 5)
    k, v = cache.write(0, keys, values)
    assert torch.equal(cache.buffers[0][0][:, :, :5], to_records(keys))
    assert torch.equal(k, from_records(to_records(keys))) and torch.equal(v, from_records(to_records(values)))
    cache.open(torch.empty(2, 3, 0, 20, dtype=torch.int8), 1)  # a stored prefix's records go in as they are
    cache.put(0, to_records(keys[:, :, :1]), to_records(values[:, :, :1]))
    assert torch.equal(cache.buffers[0][1][:, :, 5:6], to_records(values[:, :, :1]))
