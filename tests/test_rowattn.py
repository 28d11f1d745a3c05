"""The native row-exact attention (engine/backends/cpu/rowattn.py, csrc/row_attention.cpp)."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from mars_demo.engine.backends import CpuBackend, backend_for
from mars_demo.engine.backends.cpu import native, paths, rowattn
from mars_demo.engine.decoding import exact

from conftest import PROMPTS, make_lm

needs_kernel = pytest.mark.skipif(rowattn.kernel() is None, reason="no C++ compiler: the kernel cannot be built")


def tensors(batch=1, heads=9, kv_heads=3, rows=5, keys=203, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, rows, dim, generator=g)
    k = torch.randn(batch, kv_heads, keys, dim, generator=g)
    v = torch.randn(batch, kv_heads, keys, dim, generator=g)
    return q, k, v


def sdpa_rows(q, k, v, allowed):
    """Reference: SDPA one row at a time over the keys ``allowed`` (batch, rows, keys) lets it see."""
    out = torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    for b in range(q.shape[0]):
        for i in range(q.shape[2]):
            seen = allowed[b, i].nonzero().squeeze(1)
            if len(seen):
                one = F.scaled_dot_product_attention(q[b : b + 1, :, i : i + 1], k[b : b + 1, :, seen],
                                                     v[b : b + 1, :, seen], enable_gqa=True)
                out[b, i] = one[0, :, 0]
    return out


def causal(batch, rows, keys):
    return torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows).expand(batch, rows, keys)


def additive(allowed):
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]


# (heads, kv heads): SmolLM2's groups of 3, and groups of 8 that the values take in blocks of heads
GROUPS = [(9, 3), (16, 2)]


@needs_kernel
@pytest.mark.parametrize("dim", [64, 128, 12])  # the two unrolled head sizes and the generic loop
@pytest.mark.parametrize("keys", [1, 7, 203])
@pytest.mark.parametrize("heads,kv_heads", GROUPS)
def test_the_kernel_agrees_with_sdpa(dim, keys, heads, kv_heads):
    rows = min(5, keys)
    q, k, v = tensors(heads=heads, kv_heads=kv_heads, rows=rows, keys=keys, dim=dim)
    out = rowattn.attend(rowattn.kernel(), q, k, v, None)
    torch.testing.assert_close(out, sdpa_rows(q, k, v, causal(1, rows, keys)), atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dim", [64, 128, 12])
@pytest.mark.parametrize("heads,kv_heads", GROUPS)
def test_a_row_is_bit_for_bit_the_same_alone_and_among_others(dim, heads, kv_heads, monkeypatch):
    q, k, v = tensors(heads=heads, kv_heads=kv_heads, rows=8, keys=130, dim=dim)
    together = rowattn.attend(rowattn.kernel(), q, k, v, 0.3)
    monkeypatch.setattr(rowattn, "THREADED_WORK", 0)  # rows split over the threads
    threads = torch.get_num_threads()
    try:
        for n in (2, 3):  # three threads split a row's heads, and a key group's, at uneven places
            torch.set_num_threads(n)
            assert torch.equal(rowattn.attend(rowattn.kernel(), q, k, v, 0.3), together), n
    finally:
        torch.set_num_threads(threads)
    first = 130 - 8 + 1
    for i in range(8):
        alone = rowattn.attend(rowattn.kernel(), q[:, :, i : i + 1], k[:, :, : first + i], v[:, :, : first + i], 0.3)
        assert torch.equal(alone[0, 0], together[0, i]), i


@needs_kernel
@pytest.mark.parametrize("dim", [64, 128])
def test_an_avx2_build_gives_the_same_bits(dim, tmp_path, monkeypatch):
    """AVX2 sums 8 values a vector and one head's at a time, AVX-512 16 and several heads': same bits."""
    monkeypatch.setattr(native, "TUNE", ("-march=native", "-mno-avx512f"))
    function = ctypes.CDLL(str(native.build("row_attention", native.compiler(), tmp_path))).row_attention
    function.argtypes, function.restype = rowattn.kernel().argtypes, ctypes.c_int
    for heads, kv_heads in GROUPS:
        q, k, v = tensors(heads=heads, kv_heads=kv_heads, rows=6, keys=77, dim=dim)
        assert torch.equal(rowattn.attend(function, q, k, v, 0.3), rowattn.attend(rowattn.kernel(), q, k, v, 0.3))


@needs_kernel
def test_masked_rows_see_only_their_keys_and_nothing_leaks_from_the_others():
    q, k, v = tensors(batch=2, rows=4, keys=40)
    allowed = causal(2, 4, 40).clone()
    allowed[1, :, :6] = False  # left padding of the second row of the batch
    allowed[0, 3, 20:30] = False  # a row with two runs of keys
    allowed[1, 0] = False  # a row that sees nothing
    k[1, :, :6] = float("nan")  # what a padding position's keys may hold
    v[1, :, :6] = float("nan")
    mask = additive(allowed)
    visible = rowattn.Visible(mask, 2, 4, 40)
    out = rowattn.attend(rowattn.kernel(), q, k, v, None, visible)
    assert not out.isnan().any()
    assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))
    torch.testing.assert_close(out, sdpa_rows(q, k, v, allowed), atol=2e-6, rtol=1e-5)
    # the row with two runs equals that row alone over its keys gathered into one run
    seen = allowed[0, 3].nonzero().squeeze(1)
    alone = rowattn.attend(rowattn.kernel(), q[:1, :, 3:4], k[:1, :, seen], v[:1, :, seen], None)
    assert torch.equal(alone[0, 0], out[0, 3])


@needs_kernel
@pytest.mark.parametrize("dim", [64, 128, 12])
@pytest.mark.parametrize("heads,kv_heads", GROUPS)
def test_a_row_of_many_short_runs_equals_its_keys_gathered_into_one_run(dim, heads, kv_heads):
    """A batch row's keys are many runs (rejected drafts, a narrower row's holes): the kernel scores eight visible
    keys at a time across the runs' edges, and each key's score, so the row, stays what it is over one run."""
    q, k, v = tensors(heads=heads, kv_heads=kv_heads, rows=3, keys=97, dim=dim)
    allowed = causal(1, 3, 97).clone()
    for start, width in ((5, 1), (11, 3), (20, 2), (31, 5), (44, 1), (50, 7), (66, 2), (80, 4)):
        allowed[0, :, start : start + width] = False  # runs of 5, 7, 8, 6, 8, 5, 9, 10 ... keys between the gaps
    out = rowattn.attend(rowattn.kernel(), q, k, v, 0.3, rowattn.Visible(additive(allowed), 1, 3, 97))
    for i in range(3):
        seen = allowed[0, i].nonzero().squeeze(1)
        alone = rowattn.attend(rowattn.kernel(), q[:, :, i : i + 1], k[:, :, seen], v[:, :, seen], 0.3)
        assert torch.equal(alone[0, 0], out[0, i]), i


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", GROUPS)
def test_rows_of_unequal_lengths_split_by_their_keys_give_the_same_bits_on_any_team(heads, kv_heads, monkeypatch):
    """The units go to the threads by the keys they read (a long row's heads to one thread, many short rows' to
    the other), never by count alone: each row's output is still its own, bit for bit, however they split."""
    batch, rows, keys = 5, 2, 240
    q, k, v = tensors(batch=batch, heads=heads, kv_heads=kv_heads, rows=rows, keys=keys)
    allowed = causal(batch, rows, keys).clone()
    for b, holes in enumerate((235, 0, 200, 120, 237)):  # rows that see 3 to 240 keys
        allowed[b, :, :holes] = False
    visible = rowattn.Visible(additive(allowed), batch, rows, keys)
    monkeypatch.setattr(rowattn, "THREADED_WORK", 0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = rowattn.attend(rowattn.kernel(), q, k, v, None, visible)
        for n in (2, 3):
            torch.set_num_threads(n)
            assert torch.equal(rowattn.attend(rowattn.kernel(), q, k, v, None, visible), alone), n
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(alone, sdpa_rows(q, k, v, allowed), atol=2e-6, rtol=1e-5)


@needs_kernel
def test_a_boolean_mask_reads_as_the_additive_one():
    allowed = causal(1, 3, 10).clone()
    allowed[0, 2, 4] = False
    by_bool = rowattn.Visible(allowed[:, None], 1, 3, 10)
    by_add = rowattn.Visible(additive(allowed), 1, 3, 10)
    assert torch.equal(by_bool.ranges, by_add.ranges) and torch.equal(by_bool.offsets, by_add.offsets)
    assert by_bool.ranges.tolist() == [[0, 8], [0, 9], [0, 4], [5, 10]]
    assert by_bool.offsets.tolist() == [0, 1, 2, 4] and by_bool.work == 8 + 9 + 9


@needs_kernel
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("holes", [False, True], ids=["fed", "holes"])
def test_a_padding_mask_gives_the_ranges_of_transformers_4d_mask(q_len, holes):
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    generator = torch.Generator().manual_seed(q_len)
    padding = (torch.rand(5, 17, generator=generator) > 0.3).long()
    padding[:, -q_len:] = 1
    padding[2, :9] = 0  # left padding
    if holes:  # a narrower row's columns of this pass that it is not fed
        padding[1, -1] = padding[3, -q_len:] = 0
    four_d = sdpa_mask(batch_size=5, q_length=q_len, kv_length=17, q_offset=17 - q_len, kv_offset=0,
                       mask_function=causal_mask_function, attention_mask=padding.bool(), allow_is_causal_skip=False)
    want, got = rowattn.Visible(four_d, 5, q_len, 17), rowattn.Visible.padded(padding, q_len)
    assert torch.equal(got.ranges, want.ranges) and torch.equal(got.offsets, want.offsets) and got.work == want.work
    assert want.work < 5 * q_len * 17  # the holes are missing from both
    assert (got.live is None) == (want.live is None) == (not holes)
    if holes:
        assert torch.equal(got.live, want.live)
        fed = set(got.live.tolist())  # a hole row sees no keys: nothing reads its output
        assert [r for r in range(5 * q_len) if got.offsets[r + 1] > got.offsets[r]] == sorted(fed)


@needs_kernel
@pytest.mark.parametrize("q_len", [1, 2, 5])
def test_the_native_ranges_are_the_numpy_ones(q_len, monkeypatch):
    """``Visible`` in one native call gives what its numpy steps give, from a 2-D padding mask and from a full mask:
    runs cut at each row's own column, rows that see nothing, holes inside a row and at its end, and the rows fed no
    token."""
    assert rowattn.ranges_kernel("padding_ranges") is not None and rowattn.ranges_kernel("mask_ranges") is not None
    generator = torch.Generator().manual_seed(q_len)

    def both(make, *args):
        called = make(*args)
        monkeypatch.setattr(rowattn, "ranges_kernel", lambda name: None)
        stepped = make(*args)
        monkeypatch.undo()
        return called, stepped

    for trial in range(20):
        batch, keys = 1 + trial % 7, q_len + trial * 3
        padding = (torch.rand(batch, keys, generator=generator) > 0.25 + 0.05 * (trial % 4)).long()
        padding[0, :] = 1 if trial % 2 else 0  # a sequence that sees every key, or none
        allowed = torch.rand(batch, q_len, keys, generator=generator) > 0.4
        for called, stepped in (both(rowattn.Visible.padded, padding, q_len),
                                both(lambda a: rowattn.Visible(None, allowed=a), allowed)):
            assert torch.equal(called.ranges, stepped.ranges) and torch.equal(called.offsets, stepped.offsets), trial
            assert called.work == stepped.work and (called.live is None) == (stepped.live is None), trial
            assert stepped.live is None or torch.equal(called.live, stepped.live), trial


def test_exact_modes_verifying_window_rows_equal_one_token_passes():
    """The drafts' rows of a verifying pass (4-D mask, fallback masks) attend exactly as AR's one-token rows."""
    cached, dim = 30, 64
    fed = exact.verify_window([5], [7, 8], 3, 0, cached, torch.float32, "cpu")
    n = fed.width
    q, k, v = tensors(rows=n, keys=cached + n, dim=dim)
    visible = rowattn.Visible(fed.attention_mask, 1, n, cached + n)
    out = rowattn.attend(rowattn.kernel(), q, k, v, None, visible)
    for i in range(3):  # the pending token and the two drafts
        seen = cached + i + 1
        alone = rowattn.attend(rowattn.kernel(), q[:, :, i : i + 1], k[:, :, :seen], v[:, :, :seen], None)
        assert torch.equal(alone[0, 0], out[0, i])


def test_supports_only_fp32_on_the_cpu_with_whole_key_groups():
    q, k, v = tensors(heads=6, kv_heads=3, rows=2, keys=5, dim=8)
    assert rowattn.supports(q, k, v)
    assert not rowattn.supports(q.bfloat16(), k.bfloat16(), v.bfloat16())
    q4, k4, v4 = tensors(heads=4, kv_heads=3, rows=2, keys=5, dim=8)
    assert not rowattn.supports(q4, k4, v4)


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_int8_paths_decode_the_same_with_and_without_the_kernel_up_to_rounding(arch, monkeypatch, torch_layers):
    """The kernel replaces SDPA row by row: the same logits up to float rounding, and it is the one called.

    On the CPU engine's torch layers: the native decoder layers call the attention from C (test_decoder.py).
    """
    lm = make_lm(arch)
    paths.convert(lm.model, "int8dyn")
    backend = backend_for(lm.model)
    assert isinstance(backend, CpuBackend) and not backend.native
    ids = torch.tensor([lm.tokenizer(PROMPTS[0]).input_ids])
    calls = []
    real = rowattn.attend
    monkeypatch.setattr(rowattn, "attend", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.inference_mode():
        native = backend.forward(ids, None, keep=0)
        assert calls
        monkeypatch.setattr(rowattn, "kernel", lambda: None)
        calls.clear()
        by_rows = backend.forward(ids, None, keep=0)
        assert not calls
    torch.testing.assert_close(native, by_rows, atol=1e-4, rtol=1e-4)
