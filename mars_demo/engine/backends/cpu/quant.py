"""CPU compute paths as conversions of an fp32 model: bf16, int8 (weight-only) and int8dyn (int8 x int8).

Every non-fp32 path is row-exact, a row's output bit for bit independent of the rows fed with
it: ``RowBf16Linear`` (bf16's linears, a decode pass's rows fed to the GEMM one at a time),
``Int8Linear`` (per-output-channel int8 weights, bf16 activations, no activation scale
shared across rows), ``RowInt8Linear`` (int8 x int8 GEMM with one activation scale per row)
and the row-exact attention (attention.py: each row attends as a one-token pass). So MARS at tau = 1.0 and
exact decoding equal one-token AR on these paths. Which path a model decodes on is measured
per machine in paths.py.
"""

from __future__ import annotations

import contextvars
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from . import int8gemm

PATHS: tuple[str, ...] = ("fp32", "bf16", "int8", "int8dyn")
SMOOTHING_ALPHA = 0.5


# -- row-exact building blocks -----------------------------------------------------------------
# How many rows a pass may have and still feed bf16's linears one row at a time. The CPU engine sets it
# for each pass (backend.py): every row of a decode pass alone, a prefill in calls of BF16_CHUNK rows; elsewhere
# (transformers' forward on a bf16 model) passes of up to 16 rows, as attention.ROW_EXACT_ROWS. Per thread: a live
# batch decodes beside a race.
BF16_ROWS_ALONE: contextvars.ContextVar[int] = contextvars.ContextVar("bf16_rows_alone", default=16)
# A longer pass's rows go to the GEMM in calls of exactly this many, the last padded with zero rows: oneDNN picks
# its kernel by the rows of a call, and on a CPU with AMX a prompt's rows rounded otherwise in one call than in a
# call of a few rows more (the same prompt with a MARS prefill's masks after it). In calls of one size, row r is
# always row r % BF16_CHUNK of such a call, whatever follows it.
BF16_CHUNK = 32


class RowBf16Linear(nn.Linear):
    """bf16's linear, row-exact: in a pass of up to BF16_ROWS_ALONE rows each row is its own GEMM call.

    oneDNN's bf16 GEMM (where the CPU has AVX-512) picks its kernel by the rows fed, and with 2048 or
    more inputs (Qwen2.5-0.5B's down_proj: 4864) a row's sums round otherwise at 3 rows than at 1. A row
    fed alone is the very call of a one-token pass, so a decode pass's rows are a one-token pass's bit for
    bit; a longer pass (a prefill) goes in calls of BF16_CHUNK rows, so a prompt's rows are the same with
    or without masks after them. Shares the linear's parameters (a tied head stays tied).
    """

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (rows, in)
        n = rows.shape[0]
        if n > BF16_ROWS_ALONE.get():
            padded = torch.cat([rows, rows.new_zeros(-n % BF16_CHUNK, self.in_features)]) if n % BF16_CHUNK else rows
            y = torch.cat([F.linear(chunk, self.weight, self.bias) for chunk in padded.split(BF16_CHUNK)])[:n]
            return y.view(*x.shape[:-1], self.out_features)
        if n == 1:  # a one-token pass: the call every row of a short pass makes
            y = F.linear(rows, self.weight, self.bias)
        else:
            y = torch.cat([F.linear(rows[i : i + 1], self.weight, self.bias) for i in range(n)])
        return y.view(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """Weight-only int8 linear: per-output-channel scales, bf16 activations, rows independent."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        weight = weight.detach().float()  # (out, in)
        scale = weight.abs().amax(dim=1).clamp_min(1e-8) / 127  # on the meta device (a skeleton): shapes only
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

    One native call where the kernel builds (int8gemm.py), else fbgemm's: the same bits.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        weight = weight.detach().float()  # (out, in)
        self.out_features, self.in_features = weight.shape
        if weight.is_meta:  # a skeleton that stored.py fills: the shapes, no arithmetic
            scale, ints = weight.new_empty(self.out_features), weight.new_empty(weight.shape, dtype=torch.int8)
        else:
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
        # [(input, output)] of the latest call, for the next sibling: a list's item is set without
        # nn.Module's __setattr__, which checks a value against parameters, buffers and submodules
        self.last: list[tuple] = [(None, None)]


class FusedSlice(nn.Module):
    """One sibling's columns of a FusedLinears output; the first sibling called computes them for all."""

    def __init__(self, group: FusedLinears, start: int, stop: int, last: bool) -> None:
        super().__init__()
        # a tuple keeps the group out of this module's children (one owner); the GEMM's forward is
        # called without nn.Module's call machinery (no hooks on it): a pass makes this call for every GEMM
        self.fused = (group, group.linear.forward)  # how lean.py finds the one GEMM of the siblings
        self.start, self.stop, self.last = start, stop, last
        self.in_features, self.out_features = group.linear.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, gemm = self.fused
        seen = group.last[0]  # one read of one tuple: another thread's call cannot tear it
        y = seen[1] if seen[0] is x else gemm(x)
        group.last[0] = (None, None) if self.last else (x, y)
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


@contextmanager
def flushing_subnormals() -> Iterator[None]:
    """Subnormal floats read and written as zero inside the block (the CPU's FTZ/DAZ), off again after it.

    A whole text through the fp32 layers makes subnormal activations, and x86 cores take a slow path on
    every operation that meets one: calibration's fp32 passes run many times slower with them. Their
    values (below 1.2e-38) change no activation range and no NLL that calibration reads. Decoding never
    runs inside this block.
    """
    # The mode is per thread and a new thread inherits its creator's: OpenMP's team is started first (a
    # parallel sum), so that no worker keeps the mode after the block.
    torch.ones(1 << 17).sum()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)  # the process default: nothing else in the package sets it


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
    head = model.lm_head
    untied = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
    if head.weight.is_meta:  # a skeleton that stored.py fills: only the structure (the untied head)
        untied.weight = nn.Parameter(torch.empty_like(head.weight), requires_grad=False)
    else:
        groups = config.num_attention_heads // config.num_key_value_heads
        for i, layer in enumerate(model.model.layers):
            _smooth_layer(layer, ranges, f"model.layers.{i}", alpha, groups)
        s = _divisor(ranges["lm_head"], head.weight.abs().amax(0), alpha)
        model.model.norm.weight.div_(s)
        untied.weight = nn.Parameter(head.weight.detach() * s, requires_grad=False)
    if head.bias is not None:
        untied.bias = nn.Parameter(head.bias.detach().clone(), requires_grad=False)
    model.lm_head = untied
    return True


def convert(
    model: PreTrainedModel, path: str, *, smoothing: list[torch.Tensor] | None = None,
    ranges: dict[str, torch.Tensor] | None = None,
) -> PreTrainedModel:
    """Put ``model`` (fp32, on a CPU) on ``path`` in place (the CPU backend adds the row-exact attention).

    int8dyn smooths by ``ranges`` (``activation_ranges``' result), else by the activation ranges of
    ``smoothing``, token id tensors (1, n); with neither, it does not smooth.
    """
    if path not in PATHS:
        raise ValueError(f"unknown compute path {path!r}")
    if path == "bf16":
        model.to(torch.bfloat16)
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    setattr(module, name, RowBf16Linear(child))
    elif path == "int8":
        _to_int8(model, Int8Linear)
    elif path == "int8dyn":
        if ranges or smoothing:
            fold_smoothing(model, ranges or activation_ranges(model, smoothing))
        _to_int8(model, RowInt8Linear)
    return model


def path_of(model: PreTrainedModel) -> str:
    """The compute path ``convert`` put ``model`` on: read from its linears and its dtype."""
    kinds = {type(m) for m in model.modules()}
    if RowInt8Linear in kinds:
        return "int8dyn"
    if Int8Linear in kinds:
        return "int8"
    return "bf16" if model.dtype == torch.bfloat16 else "fp32"
