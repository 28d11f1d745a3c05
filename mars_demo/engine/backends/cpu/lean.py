"""The CPU engine's model code: llama-family decoder layers over a transformers model's weights, lean.

On a small CPU a cached pass of the bundled 135M model is mostly not arithmetic. Each small op
pays a fixed dispatch cost whatever its size, and a transformers forward runs well over a thousand
of them plus its module plumbing (hooks, output capture, keyword arguments; BENCHMARKS.md and
docs/bench/history.md, "Lean forward", have the figures).
``LeanForward`` runs the decoder layers as one loop over the model's own weights:

- RMSNorm as ``torch.rms_norm`` (one op, the same arithmetic) where the model is fp32;
- RoPE on q and k together, the half rotation as one ``flip`` against a sine whose first half is
  negated (``-a * s == a * -s`` in IEEE arithmetic): 4 ops a layer instead of 14;
- sibling GEMMs (quant.FusedLinears) called once, without the module machinery;
- keys and values written into the cache's buffers (cache.py), never concatenated.

The logits are bit for bit those of the transformers forward on the same weights with the same
attention (tests/test_lean.py), so every property the compute paths have (row-exactness, exact mode
equal to AR) holds here too. On int8dyn with the native kernels the layers themselves are one native
call a pass (native_layers.py): the same layers, rounded a little differently (RMSNorm, SiLU), rows
still independent bit for bit. The model object is read, never changed: its ``forward`` stays
transformers' own (``bench`` runs ``generate`` on it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, eager_mask, sdpa_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from . import rowattn
from .attention import MAX_ROWS, ROW_EXACT, ROW_EXACT_PREFILL, row_exact_attention, row_exact_prefill_attention
from .cache import CpuCache, record_width
from .native_layers import NativeLayers, cache_dtype

ARCHITECTURES = ("llama", "qwen2")  # RMSNorm, RoPE, q/k/v/o attention and a gated SiLU MLP
# The attention functions by name: transformers' own two, and the row-exact ones (attention.py)
ATTEND = {
    "sdpa": sdpa_attention_forward, "eager": eager_attention_forward,
    ROW_EXACT: row_exact_attention, ROW_EXACT_PREFILL: row_exact_prefill_attention,
}
ROPE_TABLE_START = 1024  # positions in the first RoPE table (it doubles as needed)


def unsupported(model: PreTrainedModel) -> str | None:
    """Why the lean forward cannot run ``model`` (None: it can)."""
    config = model.config
    if config.model_type not in ARCHITECTURES:
        return f"model type {config.model_type!r}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {config.hidden_act!r}"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return "sliding-window layers"
    if any(hasattr(module, "_hf_hook") for module in model.modules()):
        return "dispatched by accelerate (its hooks move weights and inputs on every module call)"
    if model.device.type not in ("cpu", "meta"):  # meta: a skeleton to be filled with CPU tensors (stored.py)
        return f"on {model.device.type}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return "not a decoder laid out as model.layers"
    for layer in layers:
        if not all(hasattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            return "an attention without q/k/v/o projections"
        if not all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "an MLP without gate/up/down projections"
    return None


def _gemm(module: nn.Module):
    """The cheapest call of a projection: F.linear on nn.Linear's tensors, else the module's own forward."""
    if type(module) is nn.Linear:
        weight, bias = module.weight, module.bias
        return lambda x: F.linear(x, weight, bias)
    return module.forward


def _siblings(parent: nn.Module, names: tuple[str, ...]):
    """(one GEMM for all siblings or None, each sibling's GEMM, the split sizes of the fused output).

    Siblings fused by quant.FusedLinears are FusedSlices carrying ``fused`` = (group, its GEMM).
    """
    slices = [getattr(parent, n) for n in names]
    fused = [getattr(s, "fused", None) for s in slices]
    if all(f is not None for f in fused) and len({id(f[0]) for f in fused}) == 1:
        starts = [s.start for s in slices]
        if starts == sorted(starts) and starts[0] == 0:
            return fused[0][1], None, [s.out_features for s in slices]
    return None, [_gemm(s) for s in slices], None


@dataclass
class _Layer:
    """One decoder layer's weights and calls, read once when the lean forward is built."""

    attention: nn.Module
    norm1: torch.Tensor
    eps1: float
    qkv: object  # one GEMM for q, k and v, or None
    q_k_v: list | None  # else each one's
    o: object
    norm2: torch.Tensor
    eps2: float
    gate_up: object
    gate_and_up: list | None
    gate_up_sizes: list[int] | None
    down: object
    heads: int
    kv_heads: int
    head_dim: int
    index: int


def _layer(layer: nn.Module, index: int) -> _Layer:
    attention, mlp = layer.self_attn, layer.mlp
    qkv, q_k_v, _ = _siblings(attention, ("q_proj", "k_proj", "v_proj"))
    gate_up, gate_and_up, gate_up_sizes = _siblings(mlp, ("gate_proj", "up_proj"))
    head_dim = attention.head_dim
    return _Layer(
        attention, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon, qkv, q_k_v,
        _gemm(attention.o_proj), layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
        gate_up, gate_and_up, gate_up_sizes, _gemm(mlp.down_proj),
        attention.q_proj.out_features // head_dim, attention.k_proj.out_features // head_dim, head_dim, index,
    )


def _negate_first_half(sin: torch.Tensor) -> torch.Tensor:
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: fp32 as torch's own op (the same arithmetic, one dispatch), else op by op."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class LeanForward:
    """The decoder's pass on ``attention`` (a name in ATTEND), over the model's own weights (module docstring)."""

    def __init__(self, model: PreTrainedModel, attention: str) -> None:
        self.config = model.config
        self.attention, self.attend = attention, ATTEND[attention]
        # a profiler's clock(part, starting), called around the body and the head (research/benchmark.py's
        # PassClock): no module hooks run here
        self.clock = None
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.layers = [_layer(layer, i) for i, layer in enumerate(inner.layers)]
        # all layers in one native call where they are int8dyn's on the native kernels (native_layers.py)
        self.native = NativeLayers.build(self.layers)
        self.norm, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        # the last norm in the native call too, where the native layers take its weight
        self.final = (self.norm, self.norm_eps) if self.native and self.native.final_weight(self.norm) else None
        self.rope_table = None  # (cos, sin with its first half negated) by position
        self.head = _gemm(model.lm_head)
        self.vocab = getattr(model.lm_head, "out_features", None) or model.config.vocab_size

    def __call__(self, ids: torch.Tensor, cache: CpuCache | None, positions=None, mask=None, keep: int = 1):
        """Logits (rows, keep, vocab) of one pass (base.Backend.forward); its keys and values go into ``cache``."""
        clock = self.clock
        if clock is not None:
            clock("forward_body", True)
        x = self.embed(ids)  # (batch, n, hidden)
        past = cache.get_seq_length() if cache is not None else 0
        if positions is None:
            positions = (torch.arange(x.shape[1], device=x.device) + past).unsqueeze(0)
        native = self._runs_natively(x)
        if self._plainly_causal(x, mask, native):
            mask = None  # the row-exact attention's own causal rule: no mask to build and read every pass
        elif native:  # the native layers read the keys each row sees, not a mask: a 2-D one gives them directly
            mask = self._visible(x, mask, past)
        elif mask is None or mask.dim() == 2:
            mask = self._mask(x, mask, past)
        if native:
            x = self._native_pass(cache, x, *self._rope(x, positions), mask, self.final)
            if self.final is None:
                x = _norm(x, self.norm, self.norm_eps)
        else:
            cos, sin = self.rotary(x, position_ids=positions)  # (batch, n, head_dim)
            x = _norm(self._layers(x, cos, sin, mask, cache), self.norm, self.norm_eps)
        if clock is not None:
            clock("forward_body", False)
            clock("lm_head", True)
        live = mask.live if native and isinstance(mask, rowattn.Visible) else None
        logits = self.head(x[:, -keep:, :] if keep else x) if live is None else self._fed_head(x, live, keep)
        if clock is not None:
            clock("lm_head", False)
        return logits

    def _fed_head(self, x: torch.Tensor, live: torch.Tensor, keep: int) -> torch.Tensor:
        """Logits (batch, keep, vocab) of the last ``keep`` columns, computed for the fed rows (``live``) only:
        a hole's logits are left as they come (nothing reads them), as the native layers left its state."""
        batch, n, hidden = x.shape
        keep = keep or n
        row, column = live // n, live % n - (n - keep)
        index = row[column >= 0] * keep + column[column >= 0]
        tail = x[:, n - keep :, :].reshape(batch * keep, hidden)
        logits = tail.new_empty(batch * keep, self.vocab)
        logits[index] = self.head(tail[index])
        return logits.view(batch, keep, -1)

    def _mask(self, x: torch.Tensor, padding: torch.Tensor | None, past: int):
        """transformers' mask for a pass of x's rows after ``past`` cached columns; ``padding`` (rows, past + n)."""
        batch, n = x.shape[:2]
        if padding is not None:
            padding = padding.to(device=x.device, dtype=torch.bool)
        sizes = {"batch_size": batch, "q_length": n, "kv_length": past + n, "q_offset": past, "kv_offset": 0,
                 "mask_function": causal_mask_function, "attention_mask": padding, "device": x.device}
        if self.attention == "eager":
            return eager_mask(**sizes, dtype=x.dtype)
        return sdpa_mask(**sizes, allow_is_causal_skip=True)

    def _visible(self, x: torch.Tensor, mask, past: int) -> rowattn.Visible | None:
        """The keys each row of a native pass sees: None (causal over the cache), from a 2-D padding mask directly,
        else from the 4-D mask."""
        batch, n = x.shape[:2]
        if mask is None:
            return None
        if mask.dim() == 2:
            return rowattn.Visible.padded(mask, n)
        return rowattn.Visible(mask, batch, n, past + n)

    def _rope(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the positions, sin's first half negated: (batch, n, head_dim).

        Read from a table the model's own rotary module computed for positions 0, 1, ... (its values
        depend on the position alone), except for RoPE kinds that rescale with the sequence's length.
        """
        rotary = self.rotary
        kind = str(getattr(rotary, "rope_type", "default"))
        low, high = (int(v) for v in position_ids.aminmax())
        if "dynamic" in kind or kind == "longrope" or low < 0:  # the module itself (a table has no row for -1)
            cos, sin = rotary(x, position_ids=position_ids)
            return cos, _negate_first_half(sin)
        need = high + 1
        table = self.rope_table
        if table is None or table[0].shape[0] < need or table[0].dtype != x.dtype:
            size = max(need, ROPE_TABLE_START, 2 * table[0].shape[0] if table is not None else 0)
            cos, sin = rotary(x, position_ids=torch.arange(size, device=x.device)[None])
            table = self.rope_table = (cos[0], _negate_first_half(sin[0]))
        return table[0][position_ids], table[1][position_ids]

    def _layers(self, x, cos, sin, mask, cache: CpuCache | None):
        """The decoder layers through torch ops around the model's own GEMMs and the attention."""
        half = cos.shape[-1] // 2
        cos, sin = cos.unsqueeze(2), _negate_first_half(sin).unsqueeze(2)
        store = None
        if cache is not None:
            first, kind = self.layers[0], cache.dtype or x.dtype  # a cache the native layers filled keeps its kind
            width = record_width(first.head_dim, kind)
            cache.open(x.new_empty(x.shape[0], first.kv_heads, 0, width, dtype=kind), x.shape[1])
            store = cache.write
        for layer in self.layers:
            x = x + self._attention(layer, _norm(x, layer.norm1, layer.eps1), cos, sin, half, mask, store)
            h = _norm(x, layer.norm2, layer.eps2)
            if layer.gate_up is not None:
                gate, up = layer.gate_up(h).split(layer.gate_up_sizes, dim=-1)
            else:
                gate, up = (gemm(h) for gemm in layer.gate_and_up)
            x = x + layer.down(F.silu(gate) * up)
        return x

    def _runs_natively(self, x: torch.Tensor) -> bool:
        """Whether this pass goes through the native layers: every pass the row-exact attention takes row by row.

        So rows that must agree bit for bit (a prompt's rows with and without masks after them, a wide
        pass's and a one-token pass's) are always computed by the same code.
        """
        if self.native is None or x.dtype != torch.float32 or x.device.type != "cpu":
            return False
        return x.shape[1] <= MAX_ROWS.get(self.attention, 0)

    def _native_pass(
        self, cache: CpuCache | None, x: torch.Tensor, cos, sin, mask: rowattn.Visible | None, final=None,
    ):
        batch, rows = x.shape[:2]
        # what the cache keeps: native_layers.cache_dtype, unless it already holds columns of another kind
        kind = (cache.dtype if cache is not None else None) or cache_dtype(x.dtype)
        like = x.new_empty(batch, self.native.kv_heads, 0, record_width(self.native.dim, kind), dtype=kind)
        if cache is not None:
            start, buffers, memo = cache.open(like, rows), cache.buffers, cache.native_memo
        else:  # no cache: this pass's keys and values only
            start, memo = 0, None
            buffers = [(like.new_empty(batch, like.shape[1], rows, like.shape[-1]),
                        like.new_empty(batch, like.shape[1], rows, like.shape[-1])) for _ in self.layers]
        return self.native.run(x, cos, sin, start, buffers, mask, memo, final)

    def _plainly_causal(self, x: torch.Tensor, mask, native: bool) -> bool:
        """Whether this pass's mask would say only "each row sees the cache and the rows up to it".

        One sequence, no mask, and a row-exact attention that takes all of these rows row by row: that
        attention reads a missing mask as exactly this rule, so building the 4-D mask (and the ranges
        the kernel would read from it) is skipped. Everything else gets transformers' mask.
        """
        if native:  # the native layers attend row by row however many rows there are
            return mask is None and x.shape[0] == 1
        return mask is None and x.shape[0] == 1 and x.shape[1] <= MAX_ROWS.get(self.attention, 0)

    def _attention(self, layer: _Layer, h, cos, sin, half, mask, store) -> torch.Tensor:
        batch, n = h.shape[:2]
        heads, kv_heads, d = layer.heads, layer.kv_heads, layer.head_dim
        if layer.qkv is not None:
            q_k, v = layer.qkv(h).split([heads * d + kv_heads * d, kv_heads * d], dim=-1)
        else:
            q, k, v = (gemm(h) for gemm in layer.q_k_v)
            q_k = torch.cat((q, k), dim=-1)
        q_k = q_k.unflatten(-1, (heads + kv_heads, d))  # (batch, n, heads + kv heads, d)
        turned = q_k.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # halves swapped; sin's first half negated
        q_k = q_k * cos + turned * sin
        q = q_k[:, :, :heads].transpose(1, 2)
        k = q_k[:, :, heads:].transpose(1, 2)
        v = v.unflatten(-1, (kv_heads, d)).transpose(1, 2)
        if store is not None:
            k, v = store(layer.index, k, v)
            k, v = k.to(q.dtype), v.to(q.dtype)  # no copy unless the cache keeps fp16 (int8 records come as fp32)
        out, _ = self.attend(layer.attention, q, k, v, mask, dropout=0.0, scaling=layer.attention.scaling)
        return layer.o(out.reshape(batch, n, -1))
