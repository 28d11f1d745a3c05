"""A lean forward for llama-family decoders on the CPU: the same layers, the same bits, fewer ops.

On a small CPU a cached pass of the bundled 135M model is mostly not arithmetic. Each small op
pays a fixed dispatch cost whatever its size, and a transformers forward runs well over a thousand
of them plus its module plumbing (hooks, output capture, keyword arguments; BENCHMARKS.md and
docs/bench/history.md, "Lean forward", have the figures).
``LeanForward`` runs the decoder layers as one loop over the model's own modules and weights:

- RMSNorm as ``torch.rms_norm`` (one op, the same arithmetic) where the model is fp32;
- RoPE on q and k together, the half rotation as one ``flip`` against a sine whose first half is
  negated (``-a * s == a * -s`` in IEEE arithmetic): 4 ops a layer instead of 14;
- sibling GEMMs (kernels.FusedLinears) called once, without the module machinery;
- keys and values appended into a buffer with room to grow (``_append``), not concatenated into a
  new tensor every layer of every pass (that copy grows with the context).

The logits are bit for bit those of the transformers forward on the same weights
(tests/test_lean.py), so every property the compute paths have (row-exactness, exact mode equal to
AR) holds here too. On int8dyn with the native kernels the layers themselves are one native call a
pass (decoder.py): the same layers, rounded a little differently (RMSNorm, SiLU), rows still
independent bit for bit. Anything it does not cover (training, other outputs, other attention kinds,
sliding windows) goes to the model's own forward.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import rowattn
from .native_layers import NativeLayers

LEAN_ENV = "MARS_DEMO_LEAN"  # "0": decode with transformers' forward (for comparisons)
ARCHITECTURES = ("llama", "qwen2")  # RMSNorm, RoPE, q/k/v/o attention and a gated SiLU MLP
ATTENTION = ("sdpa", "eager", "mars_row_exact", "mars_row_exact_prefill")
# Keyword arguments the lean forward reads; any other one set to something else than None / False
# (labels, inputs_embeds, output_hidden_states, ...) goes to the model's own forward.
READ = ("attention_mask", "position_ids", "past_key_values", "use_cache", "logits_to_keep")
ARGUMENTS = {"input_ids", "return_dict", *READ}
# The row-exact attentions (kernels.py) and the rows they always take row by row (kernels.ROW_EXACT_MAX_ROWS)
ROW_EXACT = ("mars_row_exact", "mars_row_exact_prefill")
ROW_EXACT_ROWS = 16
# int8dyn's attention (the second name) takes prefills up to this many rows row by row too (kernels.py)
ROW_EXACT_PREFILL_ROWS = 2048
ROW_EXACT_MAX = dict(zip(ROW_EXACT, (ROW_EXACT_ROWS, ROW_EXACT_PREFILL_ROWS)))
BUFFER_SLACK = 256  # columns a key / value buffer is allocated beyond what it holds
ROPE_TABLE_START = 1024  # positions in the native layers' first RoPE table (it doubles as needed)


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

    Siblings fused by kernels.FusedLinears are FusedSlices carrying ``fused`` = (group, its GEMM).
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


def _append(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DynamicLayer.update without the copy: write into a buffer with room, hold views of it.

    ``layer.keys`` / ``layer.values`` stay what DynamicLayer holds (the cached columns, now views of
    the buffer), so cropping, ``get_seq_length`` and the batch code work on them unchanged. Columns
    cropped off are overwritten by the next append; a cache whose tensors were replaced (a batch
    reorder, transformers' own update) is copied into a new buffer first.
    """
    start, end, buffers = room(layer, keys, keys.shape[-2])
    buffers[0][:, :, start:end].copy_(keys)
    buffers[1][:, :, start:end].copy_(values)
    hold(layer, buffers, end)
    return layer.keys, layer.values


class LeanLayer(DynamicLayer):
    """A DynamicLayer that holds the first ``end`` columns of a key and a value buffer: its ``keys`` and
    ``values`` are views made when read, so ``hold`` and ``crop`` move a number instead of slicing 2
    tensors a layer (60 slices a pass of the bundled model).

    A tensor assigned from outside (DynamicLayer's own update, a batch reorder) is held as it is, as
    DynamicLayer holds it; ``room`` copies it into new buffers at the next native pass.
    """

    def __init__(self) -> None:
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._end = 0
        self._held: list = [None, None]  # what was assigned from outside, while there are no buffers
        super().__init__()

    def _get(self, which: int):
        if self._buffers is None:
            return self._held[which]
        return self._buffers[which][:, :, : self._end]

    def _set(self, which: int, tensor) -> None:
        if self._buffers is not None:  # keep the other one as it was, off the buffers
            self._held = [self._get(0), self._get(1)]
            self._buffers = None
        self._held[which] = tensor

    keys = property(lambda self: self._get(0), lambda self, tensor: self._set(0, tensor))
    values = property(lambda self: self._get(1), lambda self, tensor: self._set(1, tensor))

    def hold(self, buffers: tuple[torch.Tensor, torch.Tensor], end: int) -> None:
        self._buffers, self._end, self._held = buffers, end, [None, None]

    def get_seq_length(self) -> int:
        return self._end if self._buffers is not None else super().get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        if self._buffers is None or tokens_to_remove > 0:  # the legacy form raises there
            return super().crop(tokens_to_remove)
        self._end = max(self._end - abs(tokens_to_remove), 0)


class LeanCache(DynamicCache):
    """A DynamicCache of LeanLayers (``new_cache``): the cache of single-sequence decoding on the native layers."""

    def __init__(self, config) -> None:
        super().__init__(config=config)
        self.layers = [LeanLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]
        self.native_memo: dict = {}  # the native layers' arrays of buffer addresses (decoder.NativeLayers.pointers)


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """A LeanCache where ``model`` runs the lean forward's native layers, else a DynamicCache."""
    forward = model.__dict__.get("forward")
    if isinstance(forward, LeanForward) and forward.native is not None:
        return LeanCache(model.config)
    return DynamicCache(config=model.config)


def room(layer: DynamicLayer, like: torch.Tensor, columns: int) -> tuple[int, int, tuple[torch.Tensor, torch.Tensor]]:
    """(start, end, (key buffer, value buffer)): the layer's cached columns in buffers with room for ``columns`` more.

    ``like``: (batch, kv heads, any, head dim), the dtype and device of the keys to come. The new
    columns go at start:end; ``hold`` then makes the layer hold them.
    """
    buffers = getattr(layer, "_buffers", None)  # a LeanLayer's, while it holds them
    if buffers is not None:
        start, end = layer._end, layer._end + columns
        if end <= buffers[0].shape[-2] and buffers[0].shape[:2] == like.shape[:2]:
            return start, end, buffers
    if not layer.is_initialized:
        layer.lazy_initialization(like, like)
    held_k, held_v = layer.keys, layer.values
    buffers = getattr(layer, "_lean_buffers", None)  # a DynamicLayer's, beside the views it holds
    start = held_k.shape[-2] if held_k.dim() == 4 else 0  # lazy_initialization holds empty 1-D tensors
    end = start + columns
    if (
        buffers is None or held_k.dim() != 4 or held_k.data_ptr() != buffers[0].data_ptr()
        or held_v.data_ptr() != buffers[1].data_ptr() or held_k.shape[:2] != like.shape[:2]
        or held_k.stride() != buffers[0].stride() or end > buffers[0].shape[-2]
    ):
        size = end + max(BUFFER_SLACK, end // 2)
        buffers = tuple(like.new_empty((*like.shape[:2], size, like.shape[-1])) for _ in range(2))
        if start:
            buffers[0][:, :, :start].copy_(held_k)
            buffers[1][:, :, :start].copy_(held_v)
        layer._lean_buffers = buffers
    return start, end, buffers


def hold(layer: DynamicLayer, buffers: tuple[torch.Tensor, ...], end: int) -> None:
    """The layer now holds the buffers' first ``end`` columns (a LeanLayer: by number; else: views)."""
    if isinstance(layer, LeanLayer):
        layer.hold(buffers, end)
    else:
        layer.keys, layer.values = buffers[0][:, :, :end], buffers[1][:, :, :end]


def _plain_layers(cache, layers: int) -> list | None:
    """The layers of a plain DynamicCache (one DynamicLayer per decoder layer, not offloaded), else None."""
    if (
        type(cache) in (DynamicCache, LeanCache) and not getattr(cache, "offloading", False)
        and len(cache.layers) == layers and all(type(layer) in (DynamicLayer, LeanLayer) for layer in cache.layers)
    ):
        return cache.layers
    return None


def _store(cache, layers: int):
    """How a pass puts its keys and values in ``cache``: ``_append`` on a plain DynamicCache, else its update."""
    if cache is None:
        return None
    held = _plain_layers(cache, layers)
    if held is not None:
        return lambda i, keys, values: _append(held[i], keys, values)
    return lambda i, keys, values: cache.update(keys, values, i)


class LeanForward:
    """The model's forward for decoding, lean (module docstring); ``fallback`` is the model's own forward."""

    def __init__(self, model: PreTrainedModel, fallback) -> None:
        self.model = model
        self.fallback = fallback
        # transformers reads the forward's parameters (generate makes left-padded rows' position ids only
        # when it sees ``position_ids``): show the model's own
        self.__signature__ = inspect.signature(fallback)
        # a profiler's clock(part, starting), called around the body and the head (research/bench.py's
        # PassClock): the module hooks it would use are not called here
        self.clock = None
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.layers = [_layer(layer, i) for i, layer in enumerate(inner.layers)]
        # all layers in one native call where they are int8dyn's on the native kernels (decoder.py)
        self.native = NativeLayers.build(self.layers)
        self.norm, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.rope_table = None  # (cos, sin with its first half negated) by position, for the native layers
        self.head = _gemm(model.lm_head)

    def __call__(self, input_ids=None, *args, **kwargs):
        model = self.model
        odd = any(v is not None and v is not False for k, v in kwargs.items() if k not in ARGUMENTS)
        if (
            args or odd or input_ids is None or kwargs.get("return_dict") is False or model.training
            or model.config._attn_implementation not in ATTENTION
        ):
            return self.fallback(input_ids, *args, **kwargs)
        return self._forward(input_ids, *(kwargs.get(name) for name in READ))

    def _forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep):
        config = self.model.config
        clock = self.clock
        if clock is not None:
            clock("forward_body", True)
        use_cache = config.use_cache if use_cache is None else use_cache
        x = self.embed(input_ids)  # (batch, n, hidden)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=config)
        if position_ids is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(x.shape[1], device=x.device) + past).unsqueeze(0)
        native = self._native_layers(x, past_key_values)
        if self._plainly_causal(x, attention_mask, past_key_values, native is not None):
            mask = None  # the row-exact attention's own causal rule: no mask to build and read every pass
        else:
            mask = create_causal_mask(
                config=config, inputs_embeds=x, attention_mask=attention_mask, past_key_values=past_key_values,
                position_ids=position_ids,
            )
        if native is not None:
            memo = getattr(past_key_values, "native_memo", None)
            x = self._native_pass(native, x, *self._rope(x, position_ids), mask, memo)
        else:
            cos, sin = self.rotary(x, position_ids=position_ids)  # (batch, n, head_dim)
            x = self._layers(x, cos, sin, mask, past_key_values)
        x = _norm(x, self.norm, self.norm_eps)
        if clock is not None:
            clock("forward_body", False)
            clock("lm_head", True)
        keep = logits_to_keep or 0
        logits = self.head(x[:, slice(-keep, None) if isinstance(keep, int) else keep, :])
        if clock is not None:
            clock("lm_head", False)
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)

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

    def _layers(self, x, cos, sin, mask, past_key_values):
        """The decoder layers through torch ops around the model's own GEMMs and attention."""
        config = self.model.config
        half = cos.shape[-1] // 2
        cos, sin = cos.unsqueeze(2), _negate_first_half(sin).unsqueeze(2)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)
        if attend is None:  # eager: transformers' own function, which the interface does not list
            from transformers.models.llama.modeling_llama import eager_attention_forward as attend
        store = _store(past_key_values, len(self.layers))
        for layer in self.layers:
            x = x + self._attention(layer, _norm(x, layer.norm1, layer.eps1), cos, sin, half, mask, attend, store)
            h = _norm(x, layer.norm2, layer.eps2)
            if layer.gate_up is not None:
                gate, up = layer.gate_up(h).split(layer.gate_up_sizes, dim=-1)
            else:
                gate, up = (gemm(h) for gemm in layer.gate_and_up)
            x = x + layer.down(F.silu(gate) * up)
        return x

    def _native_layers(self, x: torch.Tensor, past_key_values) -> list | None:
        """The cache's layers ([] without a cache) when this pass goes through the native layers, else None.

        Every pass the row-exact attention takes row by row does, so rows that must agree bit for bit
        (a prompt's rows with and without masks after them, a wide pass's and a one-token pass's) are
        always computed by the same code.
        """
        if self.native is None or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        if x.shape[1] > ROW_EXACT_MAX.get(self.model.config._attn_implementation, 0):
            return None
        if past_key_values is None:
            return []
        return _plain_layers(past_key_values, len(self.layers))

    def _native_pass(self, cache_layers: list, x: torch.Tensor, cos, sin, mask, memo: dict | None) -> torch.Tensor:
        batch, rows = x.shape[:2]
        like = x.new_empty(batch, self.native.kv_heads, 0, self.native.dim)
        if cache_layers:
            placed = [room(layer, like, rows) for layer in cache_layers]
            start, buffers = placed[0][0], [b for _, _, b in placed]
            if any(p[0] != start for p in placed):
                raise ValueError("the cache's layers hold different numbers of tokens")
        else:  # no cache: this pass's keys and values only
            start = 0
            buffers = [(like.new_empty(batch, like.shape[1], rows, like.shape[-1]),
                        like.new_empty(batch, like.shape[1], rows, like.shape[-1])) for _ in self.layers]
        visible = None if mask is None else rowattn.Visible(mask, batch, rows, start + rows)
        x = self.native.run(x, cos, sin, start, buffers, visible, memo)
        for layer, pair in zip(cache_layers, buffers):
            hold(layer, pair, start + rows)
        return x

    def _plainly_causal(self, x: torch.Tensor, attention_mask, past_key_values, native: bool = False) -> bool:
        """Whether this pass's mask would say only "each row sees the cache and the rows up to it".

        One sequence, no padding mask, a cache that holds exactly the tokens before this pass, and a
        row-exact attention that takes all of these rows row by row: that attention reads a missing mask
        as exactly this rule, so building the 4-D mask (and the ranges the kernel would read from it)
        is skipped. Everything else gets transformers' mask.
        """
        if native:  # the native layers attend row by row however many rows there are
            return attention_mask is None and x.shape[0] == 1
        return (
            attention_mask is None and x.shape[0] == 1 and x.shape[1] <= ROW_EXACT_ROWS
            and self.model.config._attn_implementation in ROW_EXACT
            and (past_key_values is None or type(past_key_values) in (DynamicCache, LeanCache))
        )

    @staticmethod
    def _attention(layer: _Layer, h, cos, sin, half, mask, attend, store) -> torch.Tensor:
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
        out, _ = attend(layer.attention, q, k, v, mask, dropout=0.0, scaling=layer.attention.scaling)
        return layer.o(out.reshape(batch, n, -1))


def enabled(model: PreTrainedModel) -> bool:
    """Whether ``install`` puts the lean forward on ``model``: it runs it and LEAN_ENV does not say "0"."""
    return os.environ.get(LEAN_ENV, "1") != "0" and unsupported(model) is None


def install(model: PreTrainedModel) -> bool:
    """Make ``model(...)`` run the lean forward (False, nothing changed: unsupported or switched off)."""
    if not enabled(model):
        return False
    uninstall(model)
    model.forward = LeanForward(model, model.forward)
    return True


def uninstall(model: PreTrainedModel) -> None:
    """Back to the model's own forward."""
    if isinstance(model.__dict__.get("forward"), LeanForward):
        del model.forward


def installed(model: PreTrainedModel) -> bool:
    return isinstance(model.__dict__.get("forward"), LeanForward)
