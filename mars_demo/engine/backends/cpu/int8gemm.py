"""int8dyn's linear as one native call: row scaling, coding, the int8 GEMM and its float ends together.

``quant.RowInt8Linear`` scales each row by its largest magnitude, codes it as uint8 and multiplies
it by 7-bit weights. Through fbgemm that is six torch ops and one fbgemm call, which packs its
input for every GEMM, 121 calls a pass, each costing several times its arithmetic.
``csrc/int8_linear.cpp`` does the same arithmetic in one call, on torch's own OpenMP threads
(native.py). Its integer sums are exact and its float
steps are fbgemm's (csrc comment), so its output is fbgemm's bit for bit where fbgemm is right;
fbgemm itself is not always (it sometimes returns one wrong row of a 64-row call:
tests/test_int8gemm.py and docs/bench/history.md, "Native int8 linear").

Built on first use (native.py). Without a compiler, or with ``MARS_DEMO_INT8GEMM=0``,
``kernel()`` is None and RowInt8Linear calls fbgemm as before.
"""

from __future__ import annotations

import ctypes
import time
from functools import cache, partial

import torch

from ...machine import last_level_cache
from . import native

INT8GEMM_ENV = "MARS_DEMO_INT8GEMM"  # "0": fbgemm (for comparisons, or where the kernel misbehaves)
INPUT_STEP = 2.0 / 255  # a row scaled to [-1, 1] is coded in 255 steps around 128
# fbgemm multiplies by the float reciprocal of the float step (127.49999..., not 127.5): so does the kernel
INVERSE_STEP = float(1.0 / torch.tensor(INPUT_STEP, dtype=torch.float32))
_I, _P = ctypes.c_int64, ctypes.c_void_p


ARGTYPES = [_P, _I, _I, _I, _P, _P, _P, _P, _I, _P, ctypes.c_float, _I]


@cache
def kernel():
    """The native int8 linear (a ctypes function), or None: switched off, no compiler, or the build failed."""
    found = native.function("int8_linear", INT8GEMM_ENV, ARGTYPES)
    if found is not None:
        tune()
    return found


def tune() -> None:
    """How the library that holds the linear tiles its rows, prefetches its weights and where it multiplies on AMX
    tiles: timed on this CPU, once a process (``tiling``, ``prefetching``, ``amx``)."""
    tiling()
    prefetching()
    amx()


def _holder() -> ctypes.CDLL | None:
    """The loaded library that holds the linear: the decoder's, where it is built (every native linear then runs
    as it is set), else its own."""
    return native.library(native.INCLUDED_IN.get("int8_linear", "int8_linear")) or native.library("int8_linear")


TILINGS = ("tall", "short")  # csrc/int8_linear.cpp's int8_tiling: 0, 1
TILING_ROUNDS = 9


@cache
def tiling() -> str | None:
    """How the GEMM tiles the rows of a wide call on this CPU: the faster of "tall" (AVX-512: tiles of 16 rows) and
    "short" (8, the last up to 12), timed in turns on a synthetic layer at 16 and 32 rows once a process, then set
    in the library that holds the linear (the decoder's, where it is built: every native linear then tiles so).
    None: no such library. The same bits either way; which is faster depends on the CPU's load ports and
    registers (BENCHMARKS.md, "Many requests at once")."""
    loaded = _holder()
    if loaded is None or not hasattr(loaded, "int8_tiling"):
        return None
    linear, choose = loaded.int8_linear, loaded.int8_tiling
    linear.argtypes, linear.restype, choose.argtypes, choose.restype = ARGTYPES, ctypes.c_int, [_I], None
    generator = torch.Generator().manual_seed(0)
    layer = Weights(torch.randint(-64, 64, (1536, 576), dtype=torch.int8, generator=generator),
                    torch.ones(1536), None)
    inputs = [torch.randn(rows, 576, generator=generator) for rows in (16, 32)]
    chosen = _fastest(len(TILINGS), TILING_ROUNDS, choose, lambda: [layer.linear(linear, x) for x in inputs])
    return TILINGS[chosen]


def _fastest(choices: int, rounds: int, choose, work) -> int:
    """The choice (0 .. choices - 1) under which ``work()`` ran fastest, each timed ``rounds`` times in turns (the
    order rotating every round; the fastest time of each), set by ``choose(choice)``; it is left set."""
    best = [float("inf")] * choices
    for round_ in range(rounds):
        for choice in [(round_ + k) % choices for k in range(choices)]:
            choose(choice)
            started = time.perf_counter()
            work()
            best[choice] = min(best[choice], time.perf_counter() - started)
    chosen = min(range(choices), key=best.__getitem__)
    choose(chosen)
    return chosen


PREFETCHES = ("none", "L1", "L2")  # csrc/int8_linear.cpp's int8_prefetch: 0, 1, 2
ONE_ROW_PREFETCH = "L1"  # a one-row tile's, as it was: timed the synthetic way, asking nowhere read faster, but
# inside the decoder the two were level (BENCHMARKS.md, "Many requests at once")
# the rows that time a tile of a few rows (2-4: csrc/int8_linear.cpp's MANY_ROWS) and a tile of many
PREFETCH_ROWS = (2, 16)
PREFETCH_ROUNDS = 7
STREAM_LAYER = (3072, 576)  # the synthetic layers prefetching streams: the bundled model's gate/up linear
STREAM_LEAST = 64 << 20  # bytes streamed where the CPU does not say its last-level cache's size
# ... and at most: where the last-level cache holds more than half of this, a small model's weights stay in it and a
# pass streams them from there, not from memory (and twice a cache of hundreds of MB takes seconds at every load)
STREAM_MOST = 128 << 20


@cache
def prefetching() -> tuple[str, str] | None:
    """Where the GEMM's tiles of a few rows and of many ask for the next tile's weights (each the fastest of
    PREFETCHES), timed in turns on this CPU once a process and set in the library that holds the linear
    (``set_prefetch``); tiles of one row ask into ONE_ROW_PREFETCH. None: no such library.

    A decoding pass streams its weights from memory layer by layer, so they are timed so: synthetic layers of
    STREAM_LAYER's shape, twice the last-level cache's bytes in all (``machine.last_level_cache``; at most
    STREAM_MOST), swept PREFETCH_ROUNDS times under each choice for each kind of tile (~2-4 ms a sweep). One large
    layer is no stand-in: the CPU's own prefetchers keep up with one long stream and not with many short ones. A
    tile of many rows does that many dot products a line it reads, and an ask into L1 can displace what it is
    reading; which ask is fastest differs with a tile's rows, so each kind is timed alone, at the rows PREFETCH_ROWS
    gives, where the choices lie far enough apart to be told. One choice for every tile of several rows, timed at 8
    rows where they read nearly level, could settle on the slowest for 2-4 rows or for 12-32 (BENCHMARKS.md, "Many
    requests at once"). The same bits either way."""
    loaded = _holder()
    if loaded is None or not hasattr(loaded, "int8_prefetch"):
        return None
    linear = loaded.int8_linear
    linear.argtypes, linear.restype = ARGTYPES, ctypes.c_int
    layers = _stream_layers(min(2 * (last_level_cache() or STREAM_LEAST // 2), STREAM_MOST))
    width = STREAM_LAYER[1]
    generator = torch.Generator().manual_seed(0)
    chosen = [ONE_ROW_PREFETCH] * len(PREFETCH_ROWS)  # as the library starts: every tile into L1
    for kind, rows in enumerate(PREFETCH_ROWS):
        x = torch.randn(rows, width, generator=generator)

        def choose(choice: int, kind: int = kind) -> None:
            chosen[kind] = PREFETCHES[choice]
            set_prefetch(loaded, (chosen[0], chosen[1]))

        _fastest(len(PREFETCHES), PREFETCH_ROUNDS, choose, partial(_sweep, linear, layers, x))
    return chosen[0], chosen[1]


AMX_ROWS = (2, 4, 8, 12, 16, 24, 32)  # the rows a call is timed at, under the vector tiles and under AMX's
AMX_ROUNDS = 5


@cache
def amx() -> int:
    """From how many rows a call of the GEMM multiplies on AMX tiles (csrc/int8_linear.cpp's int8_amx), set in the
    library that holds the linear; 0: never (no tiles on this CPU, Linux does not grant them, or they were slower).

    Each of AMX_ROWS is timed under both, in turns (``_fastest``), on a sweep of synthetic layers of STREAM_LAYER's
    shape, STREAM_LEAST bytes in all (a small model's weights: a pass streams them layer by layer, and the tiles'
    loads keep up with a stream less well than the vector tiles' at a few rows); the tiles take every call from the
    fewest rows at which they were faster there and at every larger count timed. The same bits either way (exact
    integer sums)."""
    loaded = _holder()
    if loaded is None or not hasattr(loaded, "int8_amx"):
        return 0
    linear, choose = loaded.int8_linear, loaded.int8_amx
    linear.argtypes, linear.restype, choose.argtypes, choose.restype = ARGTYPES, ctypes.c_int, [_I], _I
    if not choose(1):
        return 0
    layers, width = _stream_layers(STREAM_LEAST), STREAM_LAYER[1]
    generator = torch.Generator().manual_seed(0)
    tiles_won = []
    for rows in AMX_ROWS:
        x = torch.randn(rows, width, generator=generator)
        tiles_won.append(_fastest(2, AMX_ROUNDS, choose, partial(_sweep, linear, layers, x)) == 1)
    start = len(AMX_ROWS)
    while start and tiles_won[start - 1]:
        start -= 1
    return choose(AMX_ROWS[start] if start < len(AMX_ROWS) else 0)


def record() -> dict | None:
    """How this process's int8 GEMM tiles its rows and where its tiles ask for weights (``bench``'s machine record);
    None where the kernel was not loaded."""
    if not kernel.cache_info().currsize or kernel() is None:
        return None
    few, many = prefetching() or (None, None)
    return {"tiling": tiling(), "prefetch": {"one_row": ONE_ROW_PREFETCH, "few_rows": few, "many_rows": many},
            "amx_from_rows": amx()}


def _stream_layers(size: int) -> list[Weights]:
    """Synthetic layers of STREAM_LAYER's shape, at least ``size`` bytes in all: what ``prefetching`` and ``amx`` sweep,
    as a pass streams its layers."""
    out, width = STREAM_LAYER
    return [Weights.filled(out, width) for _ in range(-(-size // (out * width)))]


def _sweep(linear, layers: list[Weights], x: torch.Tensor) -> None:
    for layer in layers:
        layer.linear(linear, x)


def set_prefetch(library: ctypes.CDLL, chosen: tuple[str, str]) -> None:
    """Where ``library``'s tiles ask for the next tile's weights: one row's into ONE_ROW_PREFETCH, a few rows' and
    many rows' as ``chosen`` says (names from PREFETCHES)."""
    library.int8_prefetch.argtypes, library.int8_prefetch.restype = [_I, _I, _I], None
    library.int8_prefetch(*(PREFETCHES.index(where) for where in (ONE_ROW_PREFETCH, *chosen)))


DEPTH, TILE = 4, 16  # csrc/int8_linear.cpp's packing: blocks of 16 columns by 4 inputs


def pack(ints: torch.Tensor) -> torch.Tensor:
    """int8 (out, in) -> the kernel's layout: [block of 16 columns][in / 4][16 columns][4 inputs], zero-padded.

    Columns are padded to a multiple of 16 and inputs to a multiple of 4 with zero weights, which add
    nothing to any sum.
    """
    out, inp = ints.shape
    padded = ints.new_zeros(-(-out // TILE) * TILE, -(-inp // DEPTH) * DEPTH)
    padded[:out, :inp] = ints
    blocks = padded.view(-1, TILE, padded.shape[1] // DEPTH, DEPTH)  # [block][column][step][input]
    return blocks.permute(0, 2, 1, 3).contiguous().view(-1)


class Weights:
    """A linear's weights as the kernel reads them: int8 packed (``pack``), 128 x each channel's sum, float scales."""

    def __init__(self, ints: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.bias = bias  # fp32 (RowInt8Linear's own buffer: read, never written)
        self.out_features, self.in_features = ints.shape
        if ints.is_meta:  # a skeleton that stored.py fills: the shapes, no arithmetic
            padded = -(-self.out_features // TILE) * TILE * -(-self.in_features // DEPTH) * DEPTH
            self.packed = ints.new_empty(padded)
            self.sums = ints.new_empty(self.out_features, dtype=torch.int32)
            self.scales = ints.new_empty(self.out_features, dtype=torch.float32)
            return
        self.packed = pack(ints)
        # the codes are stored as code + 128: their sums carry 128 x the weight sums, taken back here
        self.sums = (ints.to(torch.int32).sum(dim=1) * 128).to(torch.int32).contiguous()
        # fbgemm's factor: the float step times the float channel scale, one rounding
        self.scales = (torch.tensor(INPUT_STEP, dtype=torch.float32) * weight_scale.float()).contiguous()

    @classmethod
    def filled(cls, out: int, inp: int) -> Weights:
        """``out`` x ``inp`` weights of ones, made in the packed layout (whose order ones do not show) with no packing:
        to time the kernel on more bytes than a layer holds (``prefetching``)."""
        weights = cls.__new__(cls)
        weights.bias, weights.out_features, weights.in_features = None, out, inp
        weights.packed = torch.ones(-(-out // TILE) * TILE * -(-inp // DEPTH) * DEPTH, dtype=torch.int8)
        weights.sums = torch.full((out,), 128 * inp, dtype=torch.int32)
        weights.scales = torch.full((out,), INPUT_STEP, dtype=torch.float32)
        return weights

    def linear(self, function, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (n, in) fp32 with unit stride along ``in`` -> (n, out)."""
        n = rows.shape[0]
        y = rows.new_empty(n, self.out_features)
        failed = function(
            rows.data_ptr(), n, self.in_features, rows.stride(0), self.packed.data_ptr(), self.sums.data_ptr(),
            self.scales.data_ptr(), None if self.bias is None else self.bias.data_ptr(), self.out_features,
            y.data_ptr(), INVERSE_STEP, torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("int8 linear: out of memory for its coded rows")
        return y
