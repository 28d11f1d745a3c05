"""The native int8 linear (backends/cpu/int8gemm.py, csrc/int8_linear.cpp) and how kernels are built (native.py)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from transformers import DynamicCache

from mars_demo.engine import machine
from mars_demo.engine.backends.cpu import int8gemm, native, native_layers, paths, rowattn
from mars_demo.engine.backends.cpu.quant import DYN_WEIGHT_QMAX, RowInt8Linear
from mars_demo.engine.decoding import acceptance

from conftest import make_lm

needs_kernel = pytest.mark.skipif(int8gemm.kernel() is None, reason="no C++ compiler: the kernel cannot be built")


def weights(out: int, inp: int, seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g), (torch.randn(out, generator=g) if bias else None)


def reference(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """RowInt8Linear's arithmetic in torch, the integer sums in int64: what either engine must return."""
    scale = weight.abs().amax(dim=1).clamp_min(1e-8) / DYN_WEIGHT_QMAX
    ints = torch.round(weight / scale[:, None]).clamp(-DYN_WEIGHT_QMAX, DYN_WEIGHT_QMAX).to(torch.int64)
    return integer_reference(ints, scale, bias, x)


def integer_reference(ints: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor):
    """``reference`` from the integer weights and their channel scales."""
    row_max = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    codes = torch.clamp(torch.round((x / row_max) * int8gemm.INVERSE_STEP), -128, 127).to(torch.int64)
    y = ((codes @ ints.T).float() * (torch.tensor(int8gemm.INPUT_STEP) * scale)) * row_max
    return y if bias is None else y + bias


def awkward_rows(n: int, inp: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(n, inp, generator=torch.Generator().manual_seed(seed)) * 3
    x[0] = 0.0  # an all-zero row
    if n > 3:
        x[1] *= 1e4  # a loud row and a quiet one
        x[2] *= 1e-6
        x[3, inp // 2] = -500.0  # an outlier channel
    return x


def fbgemm_linear(weight, bias, monkeypatch) -> RowInt8Linear:
    int8gemm.kernel.cache_clear()
    try:
        monkeypatch.setenv(int8gemm.INT8GEMM_ENV, "0")
        return RowInt8Linear(weight, bias)
    finally:
        monkeypatch.delenv(int8gemm.INT8GEMM_ENV)
        int8gemm.kernel.cache_clear()


@needs_kernel
@pytest.mark.parametrize("out, inp", [(80, 96), (37, 101), (960, 576), (7, 1536)])  # tails in both dimensions
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_returns_the_exact_integer_arithmetic_for_every_row_count(out, inp, bias):
    weight, b = weights(out, inp, bias=bias)
    linear = RowInt8Linear(weight, b)
    assert linear.native is not None and linear.packed is None  # no fbgemm copy of the weights
    for n in (1, 2, 3, 5, 8, 17, 70):
        x = awkward_rows(n, inp, seed=n)
        assert torch.equal(linear(x), reference(weight, b, x)), n


@needs_kernel
@pytest.mark.parametrize("tiles", int8gemm.TILINGS)
def test_both_tilings_return_the_exact_integer_arithmetic_for_every_row_count(tiles):
    """Tall tiles (16 rows with AVX-512) and short ones (8, the last up to 12) add the same integers."""
    loaded, chosen = native.library(native.INCLUDED_IN["int8_linear"]), int8gemm.tiling()
    assert chosen in int8gemm.TILINGS  # measured on this CPU when the kernel was loaded
    weight, b = weights(80, 96)
    linear = RowInt8Linear(weight, b)
    try:
        loaded.int8_tiling(int8gemm.TILINGS.index(tiles))
        for n in (1, 7, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 33, 70):
            x = awkward_rows(n, 96, seed=n)
            assert torch.equal(linear(x), reference(weight, b, x)), n
    finally:
        loaded.int8_tiling(int8gemm.TILINGS.index(chosen))


@needs_kernel
@pytest.mark.parametrize("into", int8gemm.PREFETCHES)
def test_every_prefetch_returns_the_exact_integer_arithmetic(into):
    """Tiles asking for the next tile's weights nowhere, into L1 or into L2 add the same integers, one row or many;
    the weights of ones that prefetching times on give each row's exact sums too."""
    loaded, chosen = int8gemm._holder(), int8gemm.prefetching()
    assert len(chosen) == 2 and set(chosen) <= set(int8gemm.PREFETCHES)  # timed on this CPU at load
    weight, b = weights(80, 96)
    linear = RowInt8Linear(weight, b)
    ones, all_ones = int8gemm.Weights.filled(40, 96), torch.ones(40, 96, dtype=torch.int64)
    try:
        loaded.int8_prefetch(*[int8gemm.PREFETCHES.index(into)] * 3)
        for n in (1, 2, 4, 5, 8, 13, 33):  # tiles of one row, a few (2-4) and many
            x = awkward_rows(n, 96, seed=n)
            assert torch.equal(linear(x), reference(weight, b, x)), n
            filled = ones.linear(int8gemm.kernel(), x)
            assert torch.equal(filled, integer_reference(all_ones, torch.ones(40), None, x))
    finally:
        int8gemm.set_prefetch(loaded, chosen)


class FakeLibrary:
    """A library whose int8_linear costs, on a fake clock, what the ask set for its tile's kind says (``costs``)."""

    def __init__(self) -> None:
        self.costs = {"few": {"none": 1.0, "L1": 1.2, "L2": 1.5}, "many": {"none": 3.0, "L1": 2.5, "L2": 2.0}}
        self.now, self.set = 0.0, (1, 1, 1)
        self.int8_linear = lambda x, rows, *rest: self.run(rows)
        self.int8_prefetch = lambda *into: setattr(self, "set", into)

    def run(self, rows: int) -> int:
        kind, into = ("few", self.set[1]) if rows < 5 else ("many", self.set[2])  # csrc's MANY_ROWS
        self.now += self.costs[kind][int8gemm.PREFETCHES[into]]
        return 0


def test_prefetching_times_tiles_of_a_few_rows_and_of_many_apart(monkeypatch):
    """Each kind of tile gets the ask that ran it fastest, timed where it is the only kind; one row's keeps its own."""
    fake = FakeLibrary()
    monkeypatch.setattr(int8gemm, "_holder", lambda: fake)
    monkeypatch.setattr(int8gemm, "last_level_cache", lambda: 1 << 20)
    monkeypatch.setattr(int8gemm.time, "perf_counter", lambda: fake.now)
    assert int8gemm.prefetching.__wrapped__() == ("none", "L2")
    assert fake.set == tuple(int8gemm.PREFETCHES.index(p) for p in (int8gemm.ONE_ROW_PREFETCH, "none", "L2"))
    fake.costs["few"]["L1"] = 0.5  # now asking into L1 pays for a few rows
    assert int8gemm.prefetching.__wrapped__() == ("L1", "L2")


def amx_switch():
    """The library's int8_amx, typed, and the rows from which this process's timing set the tiles."""
    loaded = int8gemm._holder()
    loaded.int8_amx.argtypes, loaded.int8_amx.restype = [ctypes.c_int64], ctypes.c_int64
    return loaded.int8_amx, int8gemm.amx()


@needs_kernel
@pytest.mark.parametrize("out, inp", [(80, 128), (37, 192), (960, 576), (7, 1536), (40, 101)])
def test_amx_tiles_return_the_exact_integer_arithmetic_for_every_row_count(out, inp):
    """AMX tiles (32 rows by two blocks of columns at a time) add the same integers as the vector tiles; a depth that
    is not a multiple of 64 inputs (101) stays on the vector tiles."""
    switch, chosen = amx_switch()
    if not switch(1):
        switch(chosen)
        pytest.skip("this CPU has no AMX tiles, or Linux does not grant them")
    weight, b = weights(out, inp)
    linear = RowInt8Linear(weight, b)
    try:
        for n in (1, 2, 15, 16, 17, 31, 32, 33, 47, 70):  # one tile, two, a partial second, several sweeps
            x = awkward_rows(n, inp, seed=n)
            assert torch.equal(linear(x), reference(weight, b, x)), n
    finally:
        switch(chosen)


class FakeAmxLibrary:
    """A library whose int8_linear costs, on a fake clock, ``vector(rows)`` or ``tiles(rows)`` as int8_amx set."""

    def __init__(self, vector, tiles, granted: bool = True) -> None:
        self.vector, self.tiles, self.granted = vector, tiles, granted
        self.now, self.amx_from = 0.0, 0
        self.int8_linear = lambda x, rows, *rest: self.run(rows)
        self.int8_amx = lambda rows: self.switch(rows)

    def switch(self, rows: int) -> int:
        self.amx_from = rows if self.granted else 0
        return self.amx_from

    def run(self, rows: int) -> int:
        self.now += self.tiles(rows) if self.amx_from and rows >= self.amx_from else self.vector(rows)
        return 0


@pytest.mark.parametrize(
    "tiles, granted, expected",
    [
        (lambda rows: 5.0 + 0.1 * rows, True, 8),  # dearer at 2-4 rows, cheaper from 8 on
        (lambda rows: 0.5 if rows == 2 else 5.0 + 0.1 * rows, True, 8),  # a win at 2 rows alone is not a start
        (lambda rows: 1.5 * rows, True, 0),  # never cheaper
        (lambda rows: 0.1, False, 0),  # not granted: nothing timed
    ],
)
def test_amx_takes_calls_from_the_fewest_rows_at_which_its_tiles_stay_faster(monkeypatch, tiles, granted, expected):
    fake = FakeAmxLibrary(lambda rows: 1.0 * rows, tiles, granted)
    monkeypatch.setattr(int8gemm, "_holder", lambda: fake)
    monkeypatch.setattr(int8gemm.time, "perf_counter", lambda: fake.now)
    assert int8gemm.amx.__wrapped__() == expected
    assert fake.amx_from == expected  # left set as chosen
    if not granted:
        assert fake.now == 0.0


@pytest.mark.parametrize("cache_bytes, streamed", [(1 << 20, 2 << 20), (None, 64 << 20), (1 << 30, 128 << 20)])
def test_prefetching_streams_twice_the_last_level_cache_up_to_a_bound(monkeypatch, cache_bytes, streamed):
    """Twice the cache's bytes of synthetic layers (STREAM_LEAST where the CPU does not say), at most STREAM_MOST: a
    cache that holds a small model's weights is where a pass streams them from."""
    fake, made = FakeLibrary(), []
    monkeypatch.setattr(int8gemm, "_holder", lambda: fake)
    monkeypatch.setattr(int8gemm, "last_level_cache", lambda: cache_bytes)
    monkeypatch.setattr(int8gemm.time, "perf_counter", lambda: fake.now)
    filled = int8gemm.Weights.filled
    monkeypatch.setattr(int8gemm.Weights, "filled", lambda out, inp: made.append(out * inp) or filled(out, inp))
    int8gemm.prefetching.__wrapped__()
    assert streamed <= sum(made) < streamed + made[0]  # whole layers, the last one past the bytes asked for


@pytest.mark.parametrize(
    "text, size",
    [("32768K", 32 << 20), ("1M", 1 << 20), ("512\n", 512), ("2G", 2 << 30), ("", None), ("big", None), ("K", None)],
)
def test_cache_sizes_are_read_as_sysfs_writes_them(text, size):
    assert machine.cache_bytes(text) == size


# What CPUs with fewer instruction sets than this one run, built here with them switched off: the
# scalar loop (no AVX2), AVX2's 4-row tiles with three-step dot products or AVX-VNNI's one, and
# AVX-512's 8-row tiles without int8 dot products. Where this CPU lacks a set, a build is what it runs.
LESSER_BUILDS = {
    "scalar": ("-mno-avx2",),
    "avx2": ("-march=native", "-mno-avx512f", "-mno-avxvnni"),
    "avx2-vnni": ("-march=native", "-mno-avx512f"),
    "avx512-no-vnni": ("-march=native", "-mno-avx512vnni", "-mno-avxvnni"),
}


@needs_kernel
@pytest.mark.parametrize("build", LESSER_BUILDS)
def test_the_loops_of_lesser_cpus_return_the_same_arithmetic(build, tmp_path, monkeypatch):
    """Each loop reads the same packed weights and gives the same exact sums, whatever its tile's rows."""
    monkeypatch.setattr(native, "TUNE", LESSER_BUILDS[build])
    built = ctypes.CDLL(str(native.build("int8_linear", native.compiler(), tmp_path)))
    function, tiling = built.int8_linear, built.int8_tiling
    function.argtypes, function.restype, tiling.argtypes = int8gemm.kernel().argtypes, ctypes.c_int, [ctypes.c_int64]
    weight, b = weights(37, 101)
    kernel_weights = RowInt8Linear(weight, b).weights
    built.int8_prefetch.argtypes = [ctypes.c_int64] * 3
    for tiles in range(len(int8gemm.TILINGS)):
        tiling(tiles)
        built.int8_prefetch(tiles, 2 - tiles, tiles + 1)  # every ask, for one row, a few rows and many
        for n in (1, 5, 13, 21):  # tiles of 4, 8 or 16 rows, and the rest
            x = awkward_rows(n, 101, seed=n)
            assert torch.equal(kernel_weights.linear(function, x), reference(weight, b, x)), (tiles, n)


@needs_kernel
def test_a_rows_output_is_the_same_alone_in_a_batch_and_on_any_number_of_threads():
    weight, b = weights(3072, 576)
    linear = RowInt8Linear(weight, b)
    x = awkward_rows(9, 576)
    together = linear(x[None])[0]  # (batch, rows, in) as a model feeds it
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.stack([linear(x[i : i + 1])[0] for i in range(9)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)
    assert torch.equal(linear(x[:, ::1].T.contiguous().T), together)  # a column-major input
    assert torch.equal(linear(x[::2]), together[::2])  # rows a stride apart


@needs_kernel
def test_one_row_gives_fbgemms_very_bits(monkeypatch):
    """fbgemm is the path without a compiler: the same bits, so no figure depends on which one ran."""
    weight, b = weights(960, 576)
    mine, theirs = RowInt8Linear(weight, b), fbgemm_linear(weight, b, monkeypatch)
    assert mine.native is not None and theirs.native is None and theirs.packed is not None
    x = awkward_rows(24, 576)
    for i in range(24):
        assert torch.equal(mine(x[i : i + 1]), theirs(x[i : i + 1])), i


@needs_kernel
def test_bf16_input_is_taken_as_fp32():
    weight, b = weights(64, 96)
    linear = RowInt8Linear(weight, b)
    x = awkward_rows(4, 96).bfloat16()
    assert torch.equal(linear(x), linear(x.float()))


@needs_kernel
def test_one_token_passes_give_the_same_logits_with_the_kernel_and_with_fbgemm(torch_layers, monkeypatch):
    """Token by token on a cache every GEMM gets one row, where fbgemm is right: the same bits end to end.

    Both models run the lean forward's torch layers around their GEMMs: the native decoder layers
    (test_decoder.py), which only the kernel's weights can run, round the norms differently.
    """

    def logits_token_by_token(lm) -> list[torch.Tensor]:
        paths.convert(lm.model, "int8dyn")
        cache, out = DynamicCache(config=lm.model.config), []
        with torch.inference_mode():
            for token in (5, 17, 29, 3, 11, 40):
                out.append(lm.model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits)
        return out

    mine = logits_token_by_token(make_lm("llama"))
    int8gemm.kernel.cache_clear()
    try:
        monkeypatch.setenv(int8gemm.INT8GEMM_ENV, "0")
        fb = make_lm("llama")
        theirs = logits_token_by_token(fb)
        assert all(getattr(m, "native", None) is None for m in fb.model.modules())
    finally:
        monkeypatch.delenv(int8gemm.INT8GEMM_ENV)
        int8gemm.kernel.cache_clear()
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


KERNELS = {  # each native kernel's cached accessor and the variable that switches it off
    "int8_linear": (int8gemm.kernel, int8gemm.INT8GEMM_ENV),
    "row_attention": (rowattn.kernel, rowattn.ROWATTN_ENV),
    "decoder": (native_layers.kernel, native_layers.DECODER_ENV),
    "greedy": (acceptance.greedy_kernel, acceptance.GREEDY_ENV),
}


@pytest.mark.parametrize("name", KERNELS)
def test_switched_off_or_without_a_compiler_there_is_no_kernel(name, monkeypatch):
    kernel, switch = KERNELS[name]
    kernel.cache_clear()
    native.library.cache_clear()
    try:
        monkeypatch.setenv(switch, "0")
        assert kernel() is None
        kernel.cache_clear()
        monkeypatch.delenv(switch)
        monkeypatch.setattr(native, "compiler", lambda: None)
        assert kernel() is None
    finally:
        monkeypatch.undo()
        kernel.cache_clear()
        native.library.cache_clear()


def test_without_the_kernel_int8dyn_runs_fbgemm(monkeypatch):
    weight, b = weights(8, 32)
    linear = fbgemm_linear(weight, b, monkeypatch)
    assert linear.native is None and linear.packed is not None
    x = awkward_rows(5, 32)
    for i in range(5):  # one row a call: fbgemm is right there (at 4 rows and more not always: BENCHMARKS.md)
        assert torch.equal(linear(x[i : i + 1]), reference(weight, b, x[i : i + 1]))


@pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")
@pytest.mark.parametrize("name", KERNELS)
def test_the_build_is_cached_by_source_compiler_and_cpu(name, tmp_path, monkeypatch):
    compiler = native.compiler()
    first = native.build(name, compiler, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native.build(name, compiler, tmp_path) == first and first.stat().st_mtime_ns == stamp  # found, not rebuilt
    monkeypatch.setattr(native, "cpu_features", lambda: "another instruction set")
    second = native.build(name, compiler, tmp_path)
    assert second != first and second.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, second.name])  # no scraps left


def test_a_failing_compiler_leaves_the_torch_paths(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MARS_DEMO_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # exits 1 whatever it is asked
    caches = (native.library, *(kernel for kernel, _ in KERNELS.values()))
    for cached in caches:
        cached.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert all(kernel() is None for kernel, _ in KERNELS.values())
        for name in KERNELS:
            assert f"native {name} kernel unavailable" in caplog.text
        assert RowInt8Linear(*weights(8, 32)).packed is not None  # fbgemm's weights instead
        logits = torch.randn(2, 3, 50)
        tokens, _ = acceptance.accept_rows(logits, [0, 0], [3, 3], 0.0)  # softmax and argmax through torch
        assert [row[0] for row in tokens] == logits[:, 0].argmax(-1).tolist()
    finally:
        monkeypatch.undo()
        for cached in caches:
            cached.cache_clear()
