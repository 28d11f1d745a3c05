"""int8dyn's decoder layers as one native call a pass (``csrc/decoder.cpp``).

With the native int8 linear and the row attention, a one-token pass of the bundled model on a
small CPU spent more time between the kernels than in them: some 25 torch ops a layer (RMSNorm, the
RoPE, the cache append, SiLU * up, the residuals, views and splits), each paying its dispatch cost
(docs/bench/history.md, "Native decoder layers"). ``csrc/decoder.cpp`` runs all the layers of a
pass in one call, the kernels and everything between them (and the model's final norm), so a pass's
Python is the embedding, the RoPE tables and the head.

It runs where every layer is int8dyn on the native kernels (fused q/k/v and gate/up linears, fp32
norms), the attention is row-exact and takes the pass row by row, and the cache is a plain
DynamicCache (or none). Every pass of such a model that the row attention takes goes through it, one-token
passes and prefills alike, so the rows that must agree (a prefill's prompt rows with and without
masks after them, a wide pass's rows with one-token passes) are computed by the same code. Its
logits differ from the torch layers' by float rounding (its RMSNorm and SiLU round differently);
``MARS_DEMO_DECODER=0`` switches it off (lean.py's torch layers then run).

The ctypes classes below copy decoder.cpp's ``Int8Weights``, ``Layer`` and ``Pass``; ``kernel()``
compares them with the layouts the library exports (``native.layout_mismatch``) and refuses the
native layers where they differ.
"""

from __future__ import annotations

import ctypes
import operator
from functools import cache

import torch

from .... import settings
from . import int8gemm, native, rowattn

DECODER_ENV = "MARS_DEMO_DECODER"  # "0": the torch layers (lean.py) around the kernels
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Int8Weights(ctypes.Structure):
    _fields_ = [("weight", _P), ("sums", _P), ("scale", _P), ("bias", _P), ("inp", _I), ("out", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("norm1", _P), ("norm2", _P), ("eps1", _F), ("eps2", _F),
        ("qkv", _Int8Weights), ("o", _Int8Weights), ("gate_up", _Int8Weights), ("down", _Int8Weights),
    ]


class _Pass(ctypes.Structure):
    _fields_ = [
        ("x", _P), ("batch", _I), ("rows", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("dim", _I),
        ("cos", _P), ("sin", _P), ("rope_batch_stride", _I),
        ("keys", ctypes.POINTER(_P)), ("values", ctypes.POINTER(_P)), ("cache_kind", _I),
        ("cache_batch_stride", _I), ("cache_head_stride", _I), ("cache_key_stride", _I), ("start", _I),
        ("ranges", _P), ("offsets", _P),
        ("scale", _F), ("inverse", _F), ("threads", _I), ("attention_threads", _I), ("live", _P), ("n_live", _I),
        ("final_norm", _P), ("final_eps", _F),
    ]


STRUCTS = {"Int8Weights": _Int8Weights, "Layer": _Layer, "Pass": _Pass}  # decoder.cpp's name: its ctypes copy
CACHE_KINDS = {torch.float32: 0, torch.float16: 1, torch.int8: 2}  # decoder.cpp's CacheKind


@cache
def kernel():
    """The native decoder layers (a ctypes function), or None: switched off, no compiler, the build failed, or a
    struct's layout differs from decoder.cpp's."""
    found = native.function("decoder", DECODER_ENV, [_P, _P, _I], STRUCTS)
    if found is not None:
        int8gemm.tune()  # its linears are int8_linear.cpp's: tiled and prefetching as measured on this CPU
    return found


@cache
def half_cache() -> bool:
    """Whether the native layers keep keys and values as fp16: switched on (MARS_DEMO_HALF_CACHE) and a build that
    reads them (F16C)."""
    if kernel() is None or not settings.HALF_CACHE.read():
        return False
    supported = native.library(native.INCLUDED_IN.get("decoder", "decoder")).half_cache_supported
    supported.restype = ctypes.c_int64
    return bool(supported())


@cache
def int8_cache() -> bool:
    """Whether the native layers keep keys and values as int8 records (cache.py, ``to_records``): switched on
    (MARS_DEMO_INT8_CACHE) and the native layers running."""
    return kernel() is not None and settings.INT8_CACHE.read()


def cache_dtype(default: torch.dtype) -> torch.dtype:
    """What a new cache of the native layers holds: int8 records, fp16, or ``default``."""
    return torch.int8 if int8_cache() else torch.float16 if half_cache() else default


def _int8_weights(gemm) -> int8gemm.Weights | None:
    """The kernel weights behind a lean GEMM call (a RowInt8Linear's bound forward), or None."""
    owner = getattr(gemm, "__self__", None)
    weights = getattr(owner, "weights", None)
    return weights if isinstance(weights, int8gemm.Weights) else None


def _struct(weights: int8gemm.Weights) -> _Int8Weights:
    bias = weights.bias
    return _Int8Weights(
        weights.packed.data_ptr(), weights.sums.data_ptr(), weights.scales.data_ptr(),
        None if bias is None else bias.data_ptr(), weights.in_features, weights.out_features,
    )


def _norm_weight(weight: torch.Tensor, hidden: int) -> bool:
    return (
        weight.dtype == torch.float32 and weight.is_contiguous() and weight.device.type == "cpu"
        and weight.shape == (hidden,)
    )


class NativeLayers:
    """A model's decoder layers as decoder.cpp reads them (``build``), and one pass through them (``run``)."""

    def __init__(self, layers: list, linears: list[list[int8gemm.Weights]], scale: float, function) -> None:
        self.function = function
        first = layers[0]
        self.heads, self.kv_heads, self.dim = first.heads, first.kv_heads, first.head_dim
        self.hidden = first.norm1.shape[0]
        self.scale = scale
        self.layers = (_Layer * len(layers))()
        self.keep = []  # the tensors the structs point into
        for i, (layer, parts) in enumerate(zip(layers, linears)):
            self.keep += [layer.norm1, layer.norm2, *parts]
            self.layers[i] = _Layer(layer.norm1.data_ptr(), layer.norm2.data_ptr(), layer.eps1, layer.eps2,
                                    *(_struct(p) for p in parts))

    @classmethod
    def build(cls, layers: list) -> NativeLayers | None:
        """The native layers for lean.py's ``layers``, or None where decoder.cpp cannot run them all."""
        function = kernel()
        if function is None or not layers:
            return None
        first = layers[0]
        heads, kv_heads, dim, hidden = first.heads, first.kv_heads, first.head_dim, first.norm1.shape[0]
        scales = {float(layer.attention.scaling) for layer in layers}
        if len(scales) != 1 or dim % 2 or heads % kv_heads:
            return None
        linears = []
        for layer in layers:
            parts = [_int8_weights(g) for g in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(p is None for p in parts):
                return None
            qkv, o, gate_up, down = parts
            intermediate = down.in_features
            if (
                (layer.heads, layer.kv_heads, layer.head_dim) != (heads, kv_heads, dim)
                or not (_norm_weight(layer.norm1, hidden) and _norm_weight(layer.norm2, hidden))
                or (qkv.in_features, qkv.out_features) != (hidden, (heads + 2 * kv_heads) * dim)
                or (o.in_features, o.out_features) != (heads * dim, hidden)
                or (gate_up.in_features, gate_up.out_features) != (hidden, 2 * intermediate)
                or down.out_features != hidden or layer.gate_up_sizes != [intermediate, intermediate]
            ):
                return None
            linears.append(parts)
        return cls(layers, linears, scales.pop(), function)

    def final_weight(self, weight: torch.Tensor) -> bool:
        """Whether ``run`` can apply a last RMSNorm with this weight: fp32, contiguous, on the CPU, hidden floats."""
        return _norm_weight(weight, self.hidden)

    @staticmethod
    def pointers(buffers: list, memo: dict | None = None):
        """The buffers' addresses as decoder.cpp reads them: (keys, values), each an array by layer.

        ``memo``: a dict kept by whoever owns the buffers (cache.CpuCache, its native_memo): the arrays are made again
        only when a layer's buffers were replaced (the same tuples, the same addresses).
        """
        if memo is not None:
            held = memo.get("buffers")
            if held is not None and len(held) == len(buffers) and all(map(operator.is_, held, buffers)):
                return memo["keys"], memo["values"]
        keys = (_P * len(buffers))(*(b[0].data_ptr() for b in buffers))
        values = (_P * len(buffers))(*(b[1].data_ptr() for b in buffers))
        if memo is not None:
            memo.update(buffers=list(buffers), keys=keys, values=values)
        return keys, values

    def run(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int, buffers: list, visible,
        memo: dict | None = None, final_norm: tuple[torch.Tensor, float] | None = None,
    ):
        """The decoder layers over ``x`` (batch, rows, hidden) fp32: a new tensor.

        cos / sin: (batch or 1, rows, head dim), sin's first half negated (lean.py's tables).
        buffers: per layer (keys, values), (batch, kv heads, room, head dim) with the head dim contiguous, fp32,
        fp16 (``half_cache``) or int8 records (``int8_cache``: the head dim and 4 bytes of scale), holding ``start``
        cached columns: the pass's keys and values are written at
        start .. start + rows.
        visible: rowattn.Visible for a masked pass, None for a causal one over the cache. The rows it finds fed
        no token (``Visible.live``) are left out of all but the attention: their outputs are not to be read.
        memo: see ``pointers``.
        final_norm: (weight, eps) of the model's last RMSNorm (fp32, hidden floats), applied to the fed rows after the
        layers in the same call (``final_weight`` says which weights it takes); None leaves the rows unnormalised.
        """
        batch, rows, _ = x.shape
        x = x.clone(memory_format=torch.contiguous_format)  # written in place
        keys, values = self.pointers(buffers, memo)
        cos, sin = cos.contiguous(), sin.contiguous()
        ranges, offsets = (None, None) if visible is None else (visible.ranges.data_ptr(), visible.offsets.data_ptr())
        live = visible.live if visible is not None else None  # the rows fed a token: holes are left out
        stride = buffers[0][0].stride()
        run = _Pass(
            x.data_ptr(), batch, rows, self.hidden, self.heads, self.kv_heads, self.dim,
            cos.data_ptr(), sin.data_ptr(), 0 if cos.shape[0] == 1 else rows * self.dim, keys, values,
            CACHE_KINDS[buffers[0][0].dtype],
            stride[0], stride[1], stride[2], start, ranges, offsets, self.scale, int8gemm.INVERSE_STEP,
            torch.get_num_threads(), rowattn.threads(visible, batch, rows, start + rows, self.heads),
            None if live is None else live.data_ptr(), 0 if live is None else live.numel(),
            None if final_norm is None else final_norm[0].data_ptr(), 0.0 if final_norm is None else final_norm[1],
        )
        failed = self.function(ctypes.byref(run), self.layers, len(self.layers))
        if failed == 1:
            raise MemoryError("native decoder layers: out of memory for a pass's buffers")
        if failed:
            raise RuntimeError("native decoder layers: this build cannot read an fp16 cache (no F16C)")
        return x
