"""CPU compute paths as conversions of an fp32 model: bf16, int8 (weight-only) and int8dyn (int8 x int8).

Every non-fp32 path is row-exact, a row's output bit for bit independent of the rows fed with
it: ``Int8Linear`` (per-output-channel int8 weights, bf16 activations, no activation scale
shared across rows), ``RowInt8Linear`` (int8 x int8 GEMM with one activation scale per row)
and ``row_exact_attention`` (each row attends as a one-token pass). So MARS at tau = 1.0 and
exact decoding equal one-token AR on these paths. Which path a model decodes on is measured
per machine in kernels.py.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import int8gemm, lean, rowattn

PATHS: tuple[str, ...] = ("fp32", "bf16", "int8", "int8dyn")
SMOOTHING_ALPHA = 0.5
# Passes up to this many rows attend row by row; longer ones (prefills) in one call.
ROW_EXACT_MAX_ROWS = lean.ROW_EXACT_ROWS  # lean.py skips the mask of plainly causal passes this short
ROW_EXACT = lean.ROW_EXACT[0]
# int8dyn and int8: prefills up to this many rows attend row by row too. A MARS or exact prefill
# feeds the prompt and masks, AR's the prompt alone, a batch's prefill pads its prompts, and SDPA
# over a block of rows rounds by block size (~1e-6 in fp32): int8dyn's per-row scales can turn that
# into a flipped token (BENCHMARKS.md, "Quality by compute path"), and so can int8's near ties (a live
# batch's row against the same prompt alone, tests/test_live.py). Longer prompts attend in one call.
ROW_EXACT_PREFILL_ROWS = lean.ROW_EXACT_PREFILL_ROWS
ROW_EXACT_PREFILL = lean.ROW_EXACT[1]


# -- row-exact building blocks -----------------------------------------------------------------
class Int8Linear(nn.Module):
    """Weight-only int8 linear: per-output-channel scales, bf16 activations, rows independent."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        weight = weight.detach().float()  # (out, in)
        scale = weight.abs().amax(dim=1).clamp_min(1e-8) / 127
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_int8", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.has_bias = bias is not None  # a plain attribute: reading a buffer goes through nn.Module.__getattr__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (rows, in)
        y = torch._weight_int8pack_mm(rows, self.weight_int8, self.scale).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.has_bias else y


def _visible_keys(attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int) -> list[list]:
    """For every (row of the batch, query), a prefix length or an index tensor of the keys it may see."""
    if attention_mask is None:  # causal over a cache of kv_len - q_len tokens
        return [[kv_len - q_len + i + 1 for i in range(q_len)] for _ in range(batch)]
    allowed = rowattn.allowed_keys(attention_mask, batch, q_len, kv_len)
    counts = allowed.sum(-1).tolist()
    prefix = allowed.int().cumprod(-1).sum(-1).tolist()  # one host sync for the whole pass
    return [
        [counts[b][i] if prefix[b][i] == counts[b][i] else allowed[b, i].nonzero().squeeze(1) for i in range(q_len)]
        for b in range(batch)
    ]


_last_mask: tuple = (None, None, None)  # (mask, reader, what it read): every layer of a pass gets the same mask


def _read_mask(read, attention_mask: torch.Tensor, *shape: int):
    """``read(attention_mask, *shape)``, once per mask object (the layers of a pass share one)."""
    global _last_mask
    mask, reader, found = _last_mask
    if mask is not attention_mask or reader is not read:
        found = read(attention_mask, *shape)
        _last_mask = (attention_mask, read, found)
    return found


def _attend_alone(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling) -> torch.Tensor:
    """One query row (1, heads, 1, d) over the keys it sees, (1, 1, heads, d): what every row of a short pass runs."""
    groups = getattr(module, "num_key_value_groups", 1)
    out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=groups > 1)
    return out.view(1, 1, query.shape[1], value.shape[-1])


def row_exact_prefill_attention(module, query, key, value, attention_mask, **kwargs):
    """row_exact_attention with prefills of up to ROW_EXACT_PREFILL_ROWS rows attending row by row too."""
    return row_exact_attention(module, query, key, value, attention_mask, max_rows=ROW_EXACT_PREFILL_ROWS, **kwargs)


def row_exact_attention(module, query, key, value, attention_mask, max_rows: int = ROW_EXACT_MAX_ROWS, **kwargs):
    """SDPA in which each query row of a pass of up to ``max_rows`` attends alone, as in a one-token pass.

    On fp32 tensors it is the native kernel (rowattn.py) where that is built: all rows in one call per layer.
    """
    batch, _, q_len, _ = query.shape  # (batch, heads, q, head_dim)
    if q_len > max_rows:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    scaling = kwargs.get("scaling")
    native = rowattn.kernel()
    if native is not None and rowattn.supports(query, key, value):
        shape = batch, q_len, key.shape[2]
        visible = None if attention_mask is None else _read_mask(rowattn.Visible, attention_mask, *shape)
        return rowattn.attend(native, query, key, value, scaling, visible), None
    if batch == 1 and attention_mask is None:  # one sequence, causal over its cache: the commonest passes
        if q_len == 1:  # the one-token pass: the same call as every row's
            return _attend_alone(module, query, key, value, scaling), None
        first = key.shape[2] - q_len + 1  # keys the first row sees
        rows = [_attend_alone(module, query[:, :, i : i + 1], key[:, :, : first + i], value[:, :, : first + i], scaling)
                for i in range(q_len)]
        return torch.cat(rows, dim=1), None  # (1, q, heads, head_dim)
    shape = batch, q_len, key.shape[2]
    if attention_mask is None:
        visible = _visible_keys(None, *shape)
    else:
        visible = _read_mask(_visible_keys, attention_mask, *shape)
    rows = []
    for b in range(batch):
        for i, keys in enumerate(visible[b]):
            if isinstance(keys, int):
                k, v = key[b : b + 1, :, :keys], value[b : b + 1, :, :keys]
            else:
                k, v = key[b : b + 1, :, keys], value[b : b + 1, :, keys]
            rows.append(_attend_alone(module, query[b : b + 1, :, i : i + 1], k, v, scaling))
    out = torch.cat(rows, dim=1).reshape(batch, q_len, *rows[0].shape[2:])  # (batch, q, heads, head_dim)
    return out, None


AttentionInterface.register(ROW_EXACT, row_exact_attention)
# Without a mask function of its own, transformers gives a custom attention no mask at all, and the
# padded rows of a batch would attend to their padding: it builds the same masks as SDPA.
AttentionMaskInterface.register(ROW_EXACT, sdpa_mask)
AttentionInterface.register(ROW_EXACT_PREFILL, row_exact_prefill_attention)
AttentionMaskInterface.register(ROW_EXACT_PREFILL, sdpa_mask)


# -- int8dyn: int8 x int8 GEMMs with one activation scale per row --------------------------------
# Each row is divided by its own max |x|, so it lies in [-1, 1] exactly (IEEE division is monotonic and
# m / m = 1), and it is coded with one fixed range for [-1, 1]: a row's integers, hence its output, depend
# on nothing fed beside it. The native kernel (int8gemm.py) does it all in one call and keeps that promise;
# fbgemm's fixed-range linear (without a compiler) gives the same bits at one row but not always in wider
# calls (docs/bench/history.md, "Native int8 linear").
DYN_WEIGHT_QMAX = 63  # 7-bit weights: AVX2's u8 x s8 pair sums cannot saturate int16 (2 * 255 * 63 < 32767)
DYN_INPUT_SCALE, DYN_INPUT_ZERO = int8gemm.INPUT_STEP, 128  # uint8 codes of [-1, 1]
SMOOTHABLE = ("llama", "qwen2")  # RMSNorm as weight * x, attention and MLP as in these models
# The overload itself: calling the packet re-resolves it (and checks for fake script objects) on every call.
try:
    _LINEAR_FIXED_RANGE = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default
except (AttributeError, RuntimeError):  # a torch build without quantized CPU ops: int8dyn's prepack fails first
    _LINEAR_FIXED_RANGE = None


class RowInt8Linear(nn.Module):
    """int8dyn's linear, row-exact: one activation scale per row, 7-bit per-channel weights.

    One native call where the kernel builds (engine/int8gemm.py), else fbgemm's: the same bits.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        weight = weight.detach().float()  # (out, in)
        self.out_features, self.in_features = weight.shape
        scale = weight.abs().amax(dim=1).clamp_min(1e-8) / DYN_WEIGHT_QMAX
        ints = torch.round(weight / scale[:, None]).clamp(-DYN_WEIGHT_QMAX, DYN_WEIGHT_QMAX).to(torch.int8)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.has_bias = bias is not None  # a plain attribute: reading a buffer goes through nn.Module.__getattr__
        self.native = int8gemm.kernel()
        self.packed = self.weights = None
        if self.native is not None:
            self.weights = int8gemm.Weights(ints, scale, self.bias)
            return
        zeros = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm's packing still takes one
            warnings.simplefilter("ignore")
            quantized = torch._make_per_channel_quantized_tensor(ints, scale.double(), zeros, 0)
        self.packed = torch.ops.quantized.linear_prepack(quantized, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.native is not None:
            if rows.dtype != torch.float32 or rows.stride(-1) != 1:
                rows = rows.float().contiguous()
            return self.weights.linear(self.native, rows).reshape(*x.shape[:-1], self.out_features)
        row_max = rows.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30)  # linalg's inf-norm is 2x dearer here
        y = _LINEAR_FIXED_RANGE(rows / row_max, DYN_INPUT_SCALE, DYN_INPUT_ZERO, self.packed).mul_(row_max)
        if self.has_bias:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


# -- sibling linears fused (both int8 paths) -----------------------------------------------------
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # siblings fed the same input


class FusedLinears(nn.Module):
    """Sibling linears fed the same input (q/k/v, gate/up) as one int8 linear (``kind``): one GEMM, not three.

    Both int8 linears scale per output channel (and int8dyn per input row), so the fused weights are
    the siblings' own, row for row: only the number of GEMM calls changes.
    """

    def __init__(self, linears: list[nn.Linear], kind: type[nn.Module]) -> None:
        super().__init__()
        biases = [lin.bias for lin in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([lin.weight.new_zeros(lin.out_features) if b is None else b.detach()
                              for lin, b in zip(linears, biases)])
        self.linear = kind(torch.cat([lin.weight.detach() for lin in linears]), bias)
        self.last: tuple = (None, None)  # (input, output) of the latest call, for the next sibling


class FusedSlice(nn.Module):
    """One sibling's columns of a FusedLinears output; the first sibling called computes them for all."""

    def __init__(self, group: FusedLinears, start: int, stop: int, last: bool) -> None:
        super().__init__()
        # a tuple keeps the group out of this module's children (one owner); the GEMM's forward is
        # called without nn.Module's call machinery (no hooks on it): a pass makes this call for every GEMM
        self.fused = (group, group.linear.forward)  # also how lean.py finds the one GEMM of the siblings
        self.start, self.stop, self.last = start, stop, last
        self.in_features, self.out_features = group.linear.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, gemm = self.fused
        seen = group.last  # one read of one tuple: another thread's call cannot tear it
        y = seen[1] if seen[0] is x else gemm(x)
        # object's own setattr: nn.Module's checks a plain value against its parameters, buffers and
        # submodules, on every sibling of every layer of every pass
        object.__setattr__(group, "last", (None, None) if self.last else (x, y))
        return y[..., self.start : self.stop]


def _to_int8(model: PreTrainedModel, kind: type[nn.Module]) -> None:
    """Swap every nn.Linear for an int8 linear of ``kind`` (Int8Linear, RowInt8Linear), sibling groups fused."""
    for module in list(model.modules()):
        for names in SIBLINGS:
            linears = [getattr(module, name, None) for name in names]
            if not all(type(lin) is nn.Linear for lin in linears) or len({lin.in_features for lin in linears}) > 1:
                continue
            group, start = FusedLinears(linears, kind), 0
            module.add_module("fused_" + "_".join(n.split("_")[0] for n in names), group)
            for i, (name, lin) in enumerate(zip(names, linears)):
                setattr(module, name, FusedSlice(group, start, start + lin.out_features, i == len(names) - 1))
                start += lin.out_features
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, kind(child.weight, child.bias))


# -- smoothing (SmoothQuant, Xiao et al. 2023): activation outliers moved into the weights ----------
def activation_ranges(model: PreTrainedModel, texts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each nn.Linear's largest |input| per input channel over ``texts`` (token ids (1, n)), by module name."""
    ranges: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(module, inputs, output):
            seen = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().amax(0).float()
            ranges[name] = torch.maximum(ranges[name], seen) if name in ranges else seen
        return hook

    hooks = [m.register_forward_hook(record(n)) for n, m in model.named_modules() if type(m) is nn.Linear]
    try:
        with torch.inference_mode():
            for ids in texts:
                model(input_ids=ids)
    finally:
        for handle in hooks:
            handle.remove()
    return ranges


def _divisor(act: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-channel divisor of the activations (and multiplier of the weights' columns)."""
    return (act.clamp_min(1e-5) ** alpha / weight_max.clamp_min(1e-5) ** (1 - alpha)).clamp(1e-3, 1e3)


def _smooth_layer(layer: nn.Module, ranges: dict, prefix: str, alpha: float, groups: int) -> None:
    """Fold divisors into one decoder layer: norms' weights for q/k/v and gate/up, v rows for o, up rows for down."""
    att, mlp = layer.self_attn, layer.mlp
    for norm, first, linears in ((layer.input_layernorm, "self_attn.q_proj", [att.q_proj, att.k_proj, att.v_proj]),
                                 (layer.post_attention_layernorm, "mlp.gate_proj", [mlp.gate_proj, mlp.up_proj])):
        weight_max = torch.cat([lin.weight for lin in linears]).abs().amax(0)
        s = _divisor(ranges[f"{prefix}.{first}"], weight_max, alpha)
        norm.weight.div_(s)
        for lin in linears:
            lin.weight.mul_(s)
    s = _divisor(ranges[f"{prefix}.mlp.down_proj"], mlp.down_proj.weight.abs().amax(0), alpha)
    mlp.up_proj.weight.div_(s[:, None])
    mlp.down_proj.weight.mul_(s)
    # o_proj's input channel h * head_dim + d comes from v channel (h // groups) * head_dim + d
    head_dim = att.head_dim
    by_kv = (-1, groups, head_dim)
    act = ranges[f"{prefix}.self_attn.o_proj"].view(by_kv).amax(1).reshape(-1)
    s = _divisor(act, att.o_proj.weight.abs().amax(0).view(by_kv).amax(1).reshape(-1), alpha)
    att.v_proj.weight.div_(s[:, None])
    if att.v_proj.bias is not None:
        att.v_proj.bias.div_(s)
    att.o_proj.weight.mul_(s.view(-1, 1, head_dim).expand(by_kv).reshape(-1))


@torch.no_grad()
def fold_smoothing(model: PreTrainedModel, ranges: dict[str, torch.Tensor], alpha: float = SMOOTHING_ALPHA) -> bool:
    """Divide activations by per-channel factors and multiply the weights by them, exact in real arithmetic.

    Per-row int8 activations lose the small channels of a row that holds one outlier channel;
    smoothing trades that range between activations and weights. The factors go where they cost no
    work in a pass: RMSNorm weights, v_proj and up_proj rows, an untied copy of the head. False (and
    nothing changed) on a model type whose layout is not known to fit.
    """
    config = model.config
    if config.model_type not in SMOOTHABLE or not ranges:
        return False
    groups = config.num_attention_heads // config.num_key_value_heads
    for i, layer in enumerate(model.model.layers):
        _smooth_layer(layer, ranges, f"model.layers.{i}", alpha, groups)
    head = model.lm_head
    s = _divisor(ranges["lm_head"], head.weight.abs().amax(0), alpha)
    model.model.norm.weight.div_(s)
    untied = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None)
    untied.weight = nn.Parameter(head.weight.detach() * s, requires_grad=False)
    if head.bias is not None:
        untied.bias = nn.Parameter(head.bias.detach().clone(), requires_grad=False)
    model.lm_head = untied
    return True


def convert(
    model: PreTrainedModel, path: str, *, row_exact: bool = True, smoothing: list[torch.Tensor] | None = None,
    ranges: dict[str, torch.Tensor] | None = None,
) -> PreTrainedModel:
    """Put ``model`` (fp32, on a CPU) on ``path`` in place; ``row_exact`` adds the row-exact attention.

    int8dyn smooths by ``ranges`` (``activation_ranges``' result), else by the activation ranges of
    ``smoothing``, token id tensors (1, n); with neither, it does not smooth.
    """
    if path not in PATHS:
        raise ValueError(f"unknown compute path {path!r}")
    lean.uninstall(model)  # convert transformers' modules: smoothing's ranges come from their hooks
    if path == "bf16":
        model.to(torch.bfloat16)
    elif path == "int8":
        _to_int8(model, Int8Linear)
    elif path == "int8dyn":
        if ranges or smoothing:
            fold_smoothing(model, ranges or activation_ranges(model, smoothing))
        _to_int8(model, RowInt8Linear)
    if path != "fp32" and row_exact:
        model.set_attn_implementation(ROW_EXACT_PREFILL if path in ("int8", "int8dyn") else ROW_EXACT)
    lean.install(model)  # after every swap: it reads the layers as they are now
    return model
