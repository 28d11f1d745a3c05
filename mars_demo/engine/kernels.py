"""CPU compute paths for decoding: fp32, bf16 or two int8 paths, chosen by measuring this machine.

What a wider pass costs differs from CPU to CPU (BENCHMARKS.md has the curves), so ``select``
times each path here, checks its teacher-forced dNLL against fp32, caches the table (keyed by
CPU model, threads, library versions and model) and picks the fastest path that passes; the
MARS pass-width cap comes from the same curve (docs/METHOD.md, "CPU compute paths").

Every non-fp32 path is row-exact, a row's output bit for bit independent of the rows fed with
it: ``Int8Linear`` (per-output-channel int8 weights, bf16 activations, no activation scale
shared across rows), ``RowInt8Linear`` (int8 x int8 GEMM with one activation scale per row)
and ``row_exact_attention`` (each row attends as a one-token pass). So MARS at tau = 1.0 and
exact decoding equal one-token AR on these paths.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import AttentionInterface, PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import decoder, exact, int8gemm, lean, rowattn
from .machine import cpu_model

logger = logging.getLogger(__name__)

PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "int8", "int8dyn")
PATHS: tuple[str, ...] = ("fp32", "bf16", "int8", "int8dyn")
# Bumped when a path's kernels change, so cached cost tables are measured again.
KERNELS_VERSION = 12
PRECISION_ENV = "MARS_DEMO_PRECISION"
# The cap on tokens fed: the widest pass costing at most this share over a one-token pass.
MAX_COST_SHARE = 1.15
MEASURE_SECONDS = 0.5  # a path's curve is measured for at least this long (pass_costs) ...
MAX_ROUNDS = 60  # ... in at most this many rounds
# auto never picks a path whose teacher-forced NLL on the calibration texts exceeds fp32's by more.
DNLL_LIMIT = 0.03
# Calibration: CALIBRATION_TEXT and the first rows of held-out chat answers (none trained on).
CALIBRATION_FILE = Path(__file__).resolve().parents[2] / "assets" / "data" / "heldout_val64.jsonl"
CALIBRATION_ROWS = 4
# int8dyn's activation ranges (for smoothing) come from other held-out rows than the dNLL check's.
SMOOTHING_ROWS = range(8, 16)
SMOOTHING_ALPHA = 0.5
# Passes up to this many rows attend row by row; longer ones (prefills) in one call.
ROW_EXACT_MAX_ROWS = lean.ROW_EXACT_ROWS  # lean.py skips the mask of plainly causal passes this short
ROW_EXACT = lean.ROW_EXACT[0]
# int8dyn and int8: prefills up to this many rows attend row by row too. A MARS or exact prefill
# feeds the prompt and masks, AR's the prompt alone, a batch's prefill pads its prompts, and SDPA
# over a block of rows rounds by block size (~1e-6 in fp32): int8dyn's per-row scales can turn that
# into a flipped token (BENCHMARKS.md, issue #15), and so can int8's near ties (a live batch's row
# against the same prompt alone, tests/test_live.py). Longer prompts attend in one call.
ROW_EXACT_PREFILL_ROWS = lean.ROW_EXACT_PREFILL_ROWS
ROW_EXACT_PREFILL = lean.ROW_EXACT[1]
TABLE_FILE = "compute-paths.json"
CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
    "the members agreed to spend more on the library and the public parks, and less on new office "
    "furniture. To learn a new language, practise a little every day, read simple books, listen to "
    "native speakers and do not be afraid of mistakes. Water boils at one hundred degrees Celsius at sea "
    "level; at higher altitudes it boils at a lower temperature because the air pressure is lower. "
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
)


def check_precision(value: str | None) -> str:
    """``value`` if it names a precision (None -> "auto"); a ValueError with one line otherwise."""
    value = "auto" if value is None else value
    if value not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return value


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
# calls (BENCHMARKS.md, "Native int8 linear").
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
        # called without nn.Module's call machinery (no hooks on it), ~4 us less a call
        self.fused = (group, group.linear.forward)  # also how lean.py finds the one GEMM of the siblings
        self.start, self.stop, self.last = start, stop, last
        self.in_features, self.out_features = group.linear.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, gemm = self.fused
        seen = group.last  # one read of one tuple: another thread's call cannot tear it
        y = seen[1] if seen[0] is x else gemm(x)
        # object's own setattr: nn.Module's (a plain value checked against parameters, buffers and
        # submodules) cost ~8 us, 150 times a pass
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
    model: PreTrainedModel, path: str, *, row_exact: bool = True, smoothing: list[torch.Tensor] | None = None
) -> PreTrainedModel:
    """Put ``model`` (fp32, on a CPU) on ``path`` in place; ``row_exact`` adds the row-exact attention.

    ``smoothing``: token id tensors (1, n) whose activation ranges int8dyn smooths by (none: no smoothing).
    """
    if path not in PATHS:
        raise ValueError(f"unknown compute path {path!r}")
    lean.uninstall(model)  # convert transformers' modules: smoothing's ranges come from their hooks
    if path == "bf16":
        model.to(torch.bfloat16)
    elif path == "int8":
        _to_int8(model, Int8Linear)
    elif path == "int8dyn":
        if smoothing:
            fold_smoothing(model, activation_ranges(model, smoothing))
        _to_int8(model, RowInt8Linear)
    if path != "fp32" and row_exact:
        model.set_attn_implementation(ROW_EXACT_PREFILL if path in ("int8", "int8dyn") else ROW_EXACT)
    lean.install(model)  # after every swap: it reads the layers as they are now
    return model


# -- measuring ----------------------------------------------------------------------------------
@dataclass
class ComputePath:
    """The path a model decodes on, why, and the measured curve (ms per cached pass by tokens fed)."""

    path: str
    requested: str
    costs_ms: dict[int, float] = field(default_factory=dict)
    max_fed: int | None = None
    dnll: float | None = None  # teacher-forced NLL on the calibration texts minus fp32's
    cpu: str = ""
    threads: int = 0
    candidates: dict[str, dict] = field(default_factory=dict)  # auto: every path's curve and dnll
    cached: bool = False
    rows: int = 1  # auto chose for passes of this many tokens: 1 for one sequence, the batch size for batches

    def summary(self) -> str:
        """One line: path, cap and the curve, for status lines and logs."""
        # a tenth of a ms where passes are short: "1:5.4 4:6.2", not "1:5 4:6"
        curve = " ".join(f"{w}:{ms:.1f}" if ms < 20 else f"{w}:{ms:.0f}" for w, ms in sorted(self.costs_ms.items()))
        cap = f", up to {self.max_fed} tokens fed per pass" if self.max_fed else ""
        how = ""
        if self.requested == "auto":
            how = " (auto)" if self.rows == 1 else f" (auto, for batches of {self.rows})"
        threads = f" on {self.threads} thread{'s' if self.threads > 1 else ''}" if self.threads else ""
        return f"{self.path}{how}{cap}; ms per pass by tokens fed {curve}{threads}"

    def record(self) -> dict:
        return asdict(self)


def pass_costs(
    model: PreTrainedModel, widths: range, *, context: int = 128, reps: int = 7, seconds: float = MEASURE_SECONDS
) -> dict[int, float]:
    """Ms of a cached pass feeding each width of tokens after ``context`` tokens (the fastest of its rounds).

    The widths take turns, one pass each per round, so a burst of other load (a browser starting
    beside the app) slows one round of every width rather than every round of one width, and the
    fastest of each width's rounds is the pass alone. At least ``reps`` rounds, and more until
    ``seconds`` have passed (at most MAX_ROUNDS): a fast path's curve (a few ms a pass) gets tens of
    rounds, so the cap drawn from it no longer swings with one round's noise.
    """
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(vocab // 4, vocab // 2, (1, context + max(widths)), generator=gen)
    cache = lean.new_cache(model)  # the decoding loop's
    times: dict[int, list[float]] = {width: [] for width in widths}
    with torch.inference_mode():
        model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
        began, rounds = time.perf_counter(), 0
        while rounds < reps + 2 or (time.perf_counter() - began < seconds and rounds < MAX_ROUNDS + 2):
            rounds += 1  # the first two are warm-up rounds
            for width in widths:
                started = time.perf_counter()
                model(input_ids=ids[:, context : context + width], past_key_values=cache, use_cache=True,
                      logits_to_keep=width)
                times[width].append(time.perf_counter() - started)
                cache.crop(-width)
    return {width: round(min(seen[2:]) * 1000, 2) for width, seen in times.items()}  # load only ever adds time


def _held_out_texts(rows: range) -> list[str]:
    if not CALIBRATION_FILE.is_file():
        return []
    lines = CALIBRATION_FILE.read_text().splitlines()
    return [f"{row['prompt']}\n\n{row['response']}" for row in (json.loads(lines[i]) for i in rows if i < len(lines))]


def calibration_texts() -> list[str]:
    """The dNLL check's texts: CALIBRATION_TEXT and the first CALIBRATION_ROWS held-out answers."""
    return [CALIBRATION_TEXT] + _held_out_texts(range(CALIBRATION_ROWS))


def smoothing_texts() -> list[str]:
    """int8dyn's activation-range texts: other held-out answers than the dNLL check's, if there are any."""
    return _held_out_texts(SMOOTHING_ROWS) or [CALIBRATION_TEXT]


def token_ids(tokenizer: PreTrainedTokenizerBase, texts: list[str], limit: int = 256) -> list[torch.Tensor]:
    return [tokenizer(text, return_tensors="pt").input_ids[:, :limit] for text in texts]


def text_nll(model: PreTrainedModel, texts: list[torch.Tensor]) -> float:
    """Teacher-forced NLL (nats per token, pooled over tokens) of token id tensors (1, n)."""
    total, count = 0.0, 0
    with torch.inference_mode():
        for ids in texts:
            logits = model(input_ids=ids).logits[0, :-1].float()
            total += F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return total / count


def cap_from_costs(costs: dict[int, float], share: float = MAX_COST_SHARE) -> int:
    """The widest pass costing at most ``share`` x a one-token pass (at least 2: one token and one mask)."""
    limit = costs[1] * share
    return max([2] + [w for w, ms in costs.items() if w >= 2 and ms <= limit])


def decode_rate(costs: dict[int, float], block_size: int) -> float:
    """Tokens per ms of one sequence on a cost curve: AR's, or exact decoding's if that is more.

    Exact decoding's rate is its layout model's (exact.DraftDepth) at its prior acceptance, one draft in
    two held: a flat curve turns the masks' guesses into speed, a steep one leaves AR's one-token pass.
    """
    depth = exact.DraftDepth(max(block_size - 1, 1), costs)
    return max(1 / costs[1], depth.rate(*depth.layout()))


def choose(candidates: dict[str, dict], limit: float = DNLL_LIMIT, rows: int = 1, block_size: int = 4) -> str:
    """The fastest path whose dnll <= ``limit``, for one sequence (rows = 1) or batches of ``rows`` sequences.

    One sequence: the best ``decode_rate``. A batch of ``rows`` sequences feeds at least that many tokens a
    pass: the cheapest pass at ``rows`` (capped at the widest measured) decides; within 5% of it, the
    cheaper widest pass.
    """
    passing = [p for p in PATHS if p in candidates and (p == "fp32" or candidates[p]["dnll"] <= limit)]

    def curve(p: str) -> dict[int, float]:
        return {int(w): ms for w, ms in sorted(candidates[p]["costs_ms"].items(), key=lambda item: int(item[0]))}

    if rows <= 1:
        return max(passing, key=lambda p: decode_rate(curve(p), block_size))

    def speed(p: str) -> tuple[float, float]:
        costs = curve(p)
        return costs[min(rows, max(costs))], costs[max(costs)]

    best = min(passing, key=lambda p: speed(p)[0])
    close = [p for p in passing if speed(p)[0] <= speed(best)[0] * 1.05]
    return min(close, key=lambda p: speed(p)[1])


def table_key(model: PreTrainedModel, widths: range) -> str:
    name = getattr(model.config, "_name_or_path", "") or model.config.model_type
    params = sum(p.numel() for p in model.parameters())
    return "|".join([
        cpu_model(), f"threads={torch.get_num_threads()}", f"torch={torch.__version__}", f"kernels={KERNELS_VERSION}",
        f"transformers={transformers.__version__}", f"model={name}", f"params={params}", f"widths={widths.stop - 1}",
        f"lean={lean.enabled(model)}", f"rowattn={rowattn.kernel() is not None}",
        f"int8gemm={int8gemm.kernel() is not None}", f"decoder={decoder.kernel() is not None}",
    ])


def _read_table(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _measure(
    model: PreTrainedModel, paths: tuple[str, ...], widths: range, calibration: list[torch.Tensor],
    smoothing: list[torch.Tensor],
) -> dict:
    """Each path's cost curve and dnll, converting copies of the fp32 ``model``."""
    reference = text_nll(model, calibration)
    found = {}
    for path in paths:
        started = time.perf_counter()
        candidate = convert(model if path == "fp32" else copy.deepcopy(model), path, smoothing=smoothing)
        costs = pass_costs(candidate, widths)
        dnll = 0.0 if path == "fp32" else text_nll(candidate, calibration) - reference
        found[path] = {"costs_ms": costs, "dnll": round(dnll, 4)}
        logger.info("compute path %s: dnll %+.4f, ms by tokens fed %s (%.1f s)", path, dnll, costs,
                    time.perf_counter() - started)
        del candidate
    return found


def select(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    precision: str,
    *,
    block_size: int,
    table_dir: Path,
    rows: int = 1,
) -> ComputePath:
    """Measure (or read the cached table), put ``model`` on the chosen path in place, and say which.

    ``model`` must be fp32 on a CPU. "auto" measures every path and chooses for passes of ``rows``
    tokens (``choose``); a named path is measured alone, for its curve and cap. The table is
    cached in ``table_dir``/TABLE_FILE.
    """
    precision = check_precision(precision)
    widths = range(1, 2 * max(block_size, 2) + 1)
    paths = PATHS if precision == "auto" else (precision,)
    key = table_key(model, widths)
    table_path = table_dir / TABLE_FILE
    entry = _read_table(table_path).get(key, {})
    cached = all(p in entry for p in paths)
    smoothing = token_ids(tokenizer, smoothing_texts())
    if not cached:
        calibration = token_ids(tokenizer, calibration_texts())
        entry.update(_measure(model, tuple(p for p in paths if p not in entry), widths, calibration, smoothing))
        table = _read_table(table_path)
        table[key] = entry
        table_dir.mkdir(parents=True, exist_ok=True)
        staging = table_path.with_name(table_path.name + f".tmp{os.getpid()}")
        staging.write_text(json.dumps(table, indent=1) + "\n")
        staging.replace(table_path)
    chosen = precision
    if precision == "auto":
        chosen = choose({p: entry[p] for p in paths}, rows=rows, block_size=block_size)
    convert(model, chosen, smoothing=smoothing)
    costs = {int(w): ms for w, ms in entry[chosen]["costs_ms"].items()}
    return ComputePath(
        path=chosen, requested=precision, costs_ms=costs, max_fed=cap_from_costs(costs), dnll=entry[chosen]["dnll"],
        cpu=cpu_model(), threads=torch.get_num_threads(),
        candidates={p: entry[p] for p in paths} if precision == "auto" else {}, cached=cached, rows=rows,
    )

