"""Which CPU compute path a model decodes on (fp32, bf16, int8, int8dyn), chosen by measuring this machine.

What a wider pass costs differs from CPU to CPU, so "auto" times the paths here (``pass_costs``),
checks each one's teacher-forced dNLL against fp32, and picks the fastest that passes (``choose_path``);
the MARS pass-width cap comes from the same curve (docs/METHOD.md, "CPU compute paths"). It measures
only what can win: the likely winner first (``SURVEY_ORDER``), then each other path at one token, and
only a path that this probe does not show slower at every width than one already measured gets its
whole curve (``survey``, ``dominated``). The table is cached (keyed by CPU model, threads, library
versions, model and the kernels built), and so is int8dyn's calibration (calibration.py); a cached curve
that other load slowed is measured again (``checked_curve``). How each path converts a model, and why
every non-fp32 path is row-exact, is quant.py.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .... import settings
from ... import progress
from ...machine import CHECK_CONTEXT, CHECK_ROUNDS, cpu_identity, cpu_model, save_table, slowed
from .. import backend_for, cpu_engine_runs
from . import int8gemm, native, native_layers, rowattn
from .calibration import calibration_texts, smoothing_ranges, token_ids
from .quant import PATHS, convert, flushing_subnormals

logger = logging.getLogger(__name__)

PRECISIONS: tuple[str, ...] = ("auto", *PATHS)
# auto's order: the path that wins where its native kernels build first, so that the others can be pruned.
SURVEY_ORDER: tuple[str, ...] = ("int8dyn", "int8", "bf16", "fp32")
PRUNE_MARGIN = 1.1  # a probed one-token pass must cost this much over the rival's widest pass to be pruned
PROBE_ROUNDS = 3  # a probe's timed rounds (after two warm-up rounds)
# Bumped when a path's kernels change, so cached cost tables are measured again.
KERNELS_VERSION = 17
PRECISION_ENV = settings.PRECISION.name
# The cap on tokens fed: the widest pass costing at most this share over a one-token pass.
MAX_COST_SHARE = 1.15
MEASURE_SECONDS = 0.5  # a path's curve is measured for at least this long (pass_costs) ...
MAX_ROUNDS = 60  # ... in at most this many rounds
# auto never picks a path whose teacher-forced NLL on the calibration texts exceeds fp32's by more.
DNLL_LIMIT = 0.03
TABLE_FILE = "compute-paths.json"


def check_precision(value: str | None) -> str:
    """``value`` if it names a precision (None -> "auto"); a ValueError with one line otherwise."""
    value = "auto" if value is None else value
    if value not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return value


def prebuild() -> None:
    """Start building the native kernels in the background (a first start on this machine), so that the
    compiler runs while the weights convert; the kernels' first callers wait for their own build."""
    native.prebuild(("decoder", "row_attention", "greedy"))  # int8_linear comes with decoder (native.INCLUDED_IN)


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
    backend = backend_for(model, on_path=True)  # what decodes it
    cache = backend.new_cache()
    times: dict[int, list[float]] = {width: [] for width in widths}
    with torch.inference_mode():
        backend.forward(ids[:, :context], cache)
        began, rounds = time.perf_counter(), 0
        while rounds < reps + 2 or (time.perf_counter() - began < seconds and rounds < MAX_ROUNDS + 2):
            rounds += 1  # the first two are warm-up rounds
            for width in widths:
                started = time.perf_counter()
                backend.forward(ids[:, context : context + width], cache, keep=width)
                times[width].append(time.perf_counter() - started)
                cache.crop(width)
    return monotone_curve({width: round(min(seen[2:]) * 1000, 2) for width, seen in times.items()})


def monotone_curve(costs: dict[int, float]) -> dict[int, float]:
    """No width above a wider one: a pass feeding more cannot cost less, so a width whose fastest round still
    costs more was slowed by other load (which only adds time) and the wider pass bounds it. Read curves too."""
    widths = sorted(costs)
    return {w: min(costs[v] for v in widths[i:]) for i, w in enumerate(widths)}


def text_nll(model: PreTrainedModel, texts: list[torch.Tensor]) -> float:
    """Teacher-forced NLL (nats per token, pooled over tokens) of token id tensors (1, n), as ``model`` decodes."""
    backend = backend_for(model, on_path=True)
    total, count = 0.0, 0
    with torch.inference_mode(), flushing_subnormals():
        for ids in texts:
            logits = backend.forward(ids, None, keep=0)[0, :-1].float()
            total += F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return total / count


def cap_from_costs(costs: dict[int, float], share: float = MAX_COST_SHARE) -> int:
    """The widest pass costing at most ``share`` x a one-token pass (at least 2: one token and one mask)."""
    limit = costs[1] * share
    return max([2] + [w for w, ms in costs.items() if w >= 2 and ms <= limit])


def ar_rate(costs: dict[int, float], block_size: int) -> float:
    """Tokens per ms of one sequence decoding one token a pass on a cost curve."""
    return 1 / costs[1]


def choose_path(
    candidates: dict[str, dict], limit: float = DNLL_LIMIT, rows: int = 1, block_size: int = 4,
    rate: Callable[[dict[int, float], int], float] = ar_rate,
) -> str:
    """The fastest path whose dnll <= ``limit``, for one sequence (rows = 1) or batches of ``rows`` sequences.

    One sequence: the best ``rate`` (tokens per ms on a path's curve; the loader passes exact decoding's,
    decoding/exact.py's ``decode_rate``). A batch of ``rows`` sequences feeds at least that many tokens a
    pass: the cheapest pass at ``rows`` (capped at the widest measured) decides; within 5% of it, the
    cheaper widest pass.
    """
    passing = [p for p in PATHS if p in candidates and passes(p, candidates[p], limit)]

    def curve(p: str) -> dict[int, float]:
        return {int(w): ms for w, ms in sorted(candidates[p]["costs_ms"].items(), key=lambda item: int(item[0]))}

    if rows <= 1:
        return max(passing, key=lambda p: rate(curve(p), block_size))

    def speed(p: str) -> tuple[float, float]:
        costs = curve(p)
        return costs[min(rows, max(costs))], costs[max(costs)]

    best = min(passing, key=lambda p: speed(p)[0])
    close = [p for p in passing if speed(p)[0] <= speed(best)[0] * 1.05]
    return min(close, key=lambda p: speed(p)[1])


def model_key(model: PreTrainedModel) -> str:
    """The fp32 model on this CPU, thread count and libraries: what its calibration depends on."""
    name = getattr(model.config, "_name_or_path", "") or model.config.model_type
    params = sum(p.numel() for p in model.parameters())
    return "|".join([
        cpu_identity(), f"threads={torch.get_num_threads()}", f"torch={torch.__version__}",
        f"kernels={KERNELS_VERSION}", f"transformers={transformers.__version__}", f"model={name}", f"params={params}",
    ])


def table_key(model: PreTrainedModel, widths: range) -> str:
    """What a cost table holds for: ``model_key``, the widths, and the kernels built (it waits for their build)."""
    return "|".join([
        model_key(model), f"widths={widths.stop - 1}", f"lean={cpu_engine_runs(model)}",
        f"rowattn={rowattn.kernel() is not None}", f"int8gemm={int8gemm.kernel() is not None}",
        f"decoder={native_layers.kernel() is not None}", f"half_cache={native_layers.half_cache()}",
    ] + (["int8_cache=True"] if native_layers.int8_cache() else []))


def _read_table(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# -- auto: measure only what can win ---------------------------------------------------------------
def dominated(first_ms: float, curve: dict[int, float]) -> bool:
    """Whether a path whose one-token pass costs ``first_ms`` loses to ``curve`` at every width.

    A pass feeding more tokens does at least the work of a narrower one, so a path's curve never falls
    below its one-token pass; one that costs more than ``curve``'s widest pass is slower at every width,
    for one sequence (``decode_rate``) and for batches (``choose_path``) alike, and need not be measured further.
    The margin keeps a short probe's noise from pruning a path that is merely close.
    """
    return first_ms > max(curve.values()) * PRUNE_MARGIN


def passes(path: str, found: dict, limit: float = DNLL_LIMIT) -> bool:
    """A fully measured path whose dnll is within ``limit`` (fp32 is the reference)."""
    return "dnll" in found and (path == "fp32" or found["dnll"] <= limit)


def survey(
    order: tuple[str, ...], widths: range, curve_of: Callable[[str, range], dict[int, float]],
    dnll_of: Callable[[str], float], limit: float = DNLL_LIMIT,
) -> dict[str, dict]:
    """Every path of ``order`` measured in turn, or pruned once a path measured before it dominates it.

    A path is first probed at one token (``curve_of(path, range(1, 2))``); if a passing path's curve
    dominates it (``dominated``), it is recorded as {"costs_ms": {1: ms}, "pruned": True}, else measured
    at every width with its dnll. ``choose_path`` over the result picks what it would pick over every curve.
    """
    found: dict[str, dict] = {}
    for i, path in enumerate(order, 1):
        bounds = [entry["costs_ms"] for p, entry in found.items() if passes(p, entry, limit)]
        if bounds:
            progress.report(f"checking {path} (compute path {i} of {len(order)})")
            first = curve_of(path, range(1, 2))[1]
            tightest = min(bounds, key=lambda curve: max(curve.values()))
            if dominated(first, tightest):
                found[path] = {"costs_ms": {1: first}, "pruned": True}
                logger.info("compute path %s: pruned (one-token pass %.2f ms)", path, first)
                continue
        progress.report(f"measuring {path} (compute path {i} of {len(order)})")
        costs = curve_of(path, widths)
        found[path] = {"costs_ms": costs, "dnll": round(dnll_of(path), 4)}
        logger.info("compute path %s: dnll %+.4f, ms by tokens fed %s", path, found[path]["dnll"], costs)
    return found


class _Candidates:
    """The fp32 ``model``'s conversions for a survey: one deep copy per path measured, converted once."""

    def __init__(self, model: PreTrainedModel, calibration: list[torch.Tensor], ranges: dict) -> None:
        self.model, self.calibration, self.ranges = model, calibration, ranges
        self.reference = text_nll(model, calibration)  # fp32's NLL, before any conversion
        self.converted: dict[str, PreTrainedModel] = {}

    def get(self, path: str) -> PreTrainedModel:
        if path not in self.converted:
            source = self.model if path == "fp32" else copy.deepcopy(self.model)
            self.converted[path] = convert(source, path, ranges=self.ranges)
        return self.converted[path]

    def curve(self, path: str, widths: range) -> dict[int, float]:
        if len(widths) == 1:  # a probe: the fastest of a few rounds is enough to see domination
            return pass_costs(self.get(path), widths, reps=PROBE_ROUNDS, seconds=0)
        return pass_costs(self.get(path), widths)

    def dnll(self, path: str) -> float:
        return 0.0 if path == "fp32" else text_nll(self.get(path), self.calibration) - self.reference

    def keep_only(self, path: str) -> PreTrainedModel | None:
        """The conversion of ``path`` if one was made (the others dropped)."""
        kept = self.converted.get(path)
        self.converted.clear()
        return kept


def adopt(model: PreTrainedModel, converted: PreTrainedModel) -> None:
    """Give ``model`` the modules and config of ``converted``, a converted deep copy of it: the same object
    then decodes on that path, as ``select`` promises its caller, without converting a second time."""
    if converted is model:
        return
    for name, child in converted.named_children():
        setattr(model, name, child)
    model.config = converted.config


def curve_widths(block_size: int) -> range:
    """The widths a path's curve is measured at: up to two blocks."""
    return range(1, 2 * max(block_size, 2) + 1)


def from_table(
    model: PreTrainedModel, precision: str, *, block_size: int, table_dir: Path, rows: int = 1,
    rate: Callable[[dict[int, float], int], float] = ar_rate,
) -> ComputePath | None:
    """The path ``select`` would choose for ``model`` (fp32, or its skeleton on the meta device) from the cached
    table alone, or None where the table does not hold every path it needs."""
    precision = check_precision(precision)
    widths, paths = curve_widths(block_size), SURVEY_ORDER if precision == "auto" else (precision,)
    entry = _read_table(table_dir / TABLE_FILE).get(table_key(model, widths), {})
    if not all(p in entry for p in paths) or (precision != "auto" and "dnll" not in entry[precision]):
        return None
    return _chosen(entry, precision, paths, rows=rows, block_size=block_size, rate=rate, cached=True)


def _chosen(
    entry: dict, precision: str, paths: tuple, *, rows: int, block_size: int, rate, cached: bool,
) -> ComputePath:
    """The ComputePath that a table entry holding every path of ``paths`` chooses (``choose_path`` for auto)."""
    chosen = precision
    if precision == "auto":
        chosen = choose_path({p: entry[p] for p in paths}, rows=rows, block_size=block_size, rate=rate)
    costs = monotone_curve({int(w): ms for w, ms in entry[chosen]["costs_ms"].items()})
    return ComputePath(
        path=chosen, requested=precision, costs_ms=costs, max_fed=cap_from_costs(costs), dnll=entry[chosen]["dnll"],
        cpu=cpu_model(), threads=torch.get_num_threads(),
        candidates={p: entry[p] for p in paths} if precision == "auto" else {}, cached=cached, rows=rows,
    )


def select(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, precision: str, *, block_size: int, table_dir: Path,
    rows: int = 1, rate: Callable[[dict[int, float], int], float] = ar_rate,
) -> ComputePath:
    """Measure (or read the cached table), put ``model`` on the chosen path in place, and say which.

    ``model`` must be fp32 on a CPU. "auto" surveys the paths, the likely winner first (``SURVEY_ORDER``,
    ``survey``), and chooses for passes of ``rows`` tokens (``choose_path``); a named path is measured alone,
    for its curve and cap. The table is cached in ``table_dir``/TABLE_FILE, int8dyn's calibration beside it.
    """
    precision = check_precision(precision)
    widths = curve_widths(block_size)
    paths = SURVEY_ORDER if precision == "auto" else (precision,)
    # int8dyn's calibration is fp32 work: on a first start it runs while the kernels still build
    ranges = smoothing_ranges(model, tokenizer, model_key(model), table_dir) if "int8dyn" in paths else {}
    progress.report("building the native kernels (first start only)")
    found = from_table(model, precision, block_size=block_size, table_dir=table_dir, rows=rows, rate=rate)
    converted = None
    if found is None:
        candidates = _Candidates(model, token_ids(tokenizer, calibration_texts()), ranges)
        entry = survey(paths, widths, candidates.curve, candidates.dnll)
        key, table = table_key(model, widths), _read_table(table_dir / TABLE_FILE)
        table[key] = {**table.get(key, {}), **entry}  # another process may have measured other paths meanwhile
        save_table(table_dir / TABLE_FILE, table)
        found = _chosen(table[key], precision, paths, rows=rows, block_size=block_size,
                        rate=rate, cached=False)
        converted = candidates.keep_only(found.path)
    progress.report(f"putting the model on {found.path}")
    if converted is not None:
        adopt(model, converted)
        return found
    key = table_key(model, widths)  # the fp32 model's, as the table has it
    convert(model, found.path, ranges=ranges)
    return checked_curve(model, found, key, widths, table_dir)


def checked_curve(model: PreTrainedModel, found: ComputePath, key: str, widths: range,
                  table_dir: Path) -> ComputePath:
    """``found`` (read from the table, ``model`` on its path) with its curve checked: the one-token pass is timed,
    and where it now takes less than machine.LOADED of the kept cost, other load slowed the curve's measurement
    (a test suite or a second process on the same cores). Every later pass would be priced on it, so the path's
    curve is measured again and kept; the choice of path stands."""
    now = pass_costs(model, range(1, 2), context=CHECK_CONTEXT, reps=CHECK_ROUNDS, seconds=0.0)[1]
    if not slowed(found.costs_ms[1], now):
        return found
    progress.report(f"measuring {found.path}'s pass costs again (the kept ones were slowed by other load)")
    costs = pass_costs(model, widths)
    table = _read_table(table_dir / TABLE_FILE)
    if found.path in table.get(key, {}):
        table[key][found.path]["costs_ms"] = costs
        save_table(table_dir / TABLE_FILE, table)
    return replace(found, costs_ms=costs, max_fed=cap_from_costs(costs))
