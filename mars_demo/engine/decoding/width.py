"""How wide a pass should be: the measured cost surface and the width controller.

A forward pass over R rows that feeds w tokens to each row costs ``Surface.ms(R, w)``. On a
GPU that surface is nearly flat in w until large batches, which is the paper's regime: masks
are free and every row should get all of them. On a small CPU a pass is bound by compute as
soon as a few rows are fed, and a mask that returns 0.2 tokens can cost more than the pass it
rides on. So the width is chosen, per pass, from what the surface says it costs and what the
rows' running acceptance says it returns:

    W = argmax_w  sum_r E_r(min(w, cap_r)) / ms(R, n_w - 1 + w)

E_r(w) is the tokens row r is expected to commit from a pass of width w (one, plus each mask
reached by an unbroken run of accepted ones: ``Hits``). W = 1 is plain (batched) AR, and it
is chosen whenever no mask pays. n_w is what a pass feeds before its masks: the tokens accepted
the pass before by the row that accepted most (the pass is a rectangle), which in the steady
state of width w is E[max_r accepted_r] = sum_k (1 - prod_r (1 - P_r(at least k))): every token
committed is fed once more, so a wide pass also widens the next one, and the more rows, the
likelier one of them widens it. In the prefill n is the longest prompt, beside which masks
cost next to nothing. In a batch a wider pass must promise GAIN over width 1 (the surface is a
model); the controller corrects the surface's prices by the passes it sees (``passed``).
The width changes how many candidates a pass can accept, never which token a candidate is,
so exact mode stays greedy AR's text at any width.

A pass is a rectangle: every row is fed W columns, a row fed fewer gets holes (columns no one
attends to). A row's own width is therefore W, or less where its token limit leaves less room
(batch/token.py). The pass is priced by its rectangle, n_w - 1 + W columns a row, though the CPU
engine's native layers leave holes out of all but the attention (native_layers.py): pricing a pass
by the tokens its rows feed, with each row its own width, measured slower than the rectangle's
price on this project's CPUs (docs/bench/history.md, "Packed passes").
"""

from __future__ import annotations

import json
import math
import os
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..backends.base import Backend
from ..machine import cache_dir
from .acceptance import greedy_confidence

if TYPE_CHECKING:
    from ..model import LoadedModel

GRID_ROWS = (1, 2, 4, 8)
GRID_WIDTHS = (1, 2, 3, 4, 6, 8, 10, 16, 32)  # decoding widths, exact mode's widest (1 + 3 x 3), prefills
SURFACE_FILE = "cost-surfaces.json"
SURFACE_VERSION = 5  # 2: the acceptance's cost included; 3: made monotone; 4: rows with holes; 5: a pass before each
HOLES = 8  # left holes per row step when measuring (rows 0, 8, 16, 24 holes, repeating)
GAIN = 1.05  # a wider pass is taken only where it promises this much over one-token passes: the
# surface is a model of what a pass costs, and a pass it prices within a few percent may not pay
SURFACE_CONTEXT = 128  # cached tokens per row before a measured pass
SURFACE_ROUNDS = 7  # rounds kept per point (after two warm-up rounds): the fastest is the pass alone


class Surface:
    """Milliseconds of one pass by (rows, tokens fed per row), on a grid; interpolated between its points.

    ``simulated``: the grid is a cost model, not a measurement (serve-sim's clocks); every report
    that shows it says so. A grid with a missing or non-finite entry is refused with one message.
    """

    def __init__(self, rows: Sequence[int], widths: Sequence[int], ms: Sequence[Sequence[float]], *,
                 name: str = "measured", simulated: bool = False) -> None:
        self.rows, self.widths = tuple(int(r) for r in rows), tuple(int(w) for w in widths)
        self.grid = [[float(x) for x in line] for line in ms]
        self.name, self.simulated = name, simulated
        problem = _grid_problem(self.rows, self.widths, self.grid)
        if problem:
            raise ValueError(f"the cost surface cannot be used: {problem}")

    @classmethod
    def from_cost(cls, cost: Callable[[int, int], float], *, rows: Sequence[int] = GRID_ROWS,
                  widths: Sequence[int] = GRID_WIDTHS, name: str, simulated: bool = True) -> Surface:
        """A surface from a cost model ``cost(rows, width)`` in ms (a simulated clock)."""
        return cls(rows, widths, [[cost(r, w) for w in widths] for r in rows], name=name, simulated=simulated)

    @classmethod
    def from_curve(cls, costs_ms: dict, *, name: str = "measured curve") -> Surface:
        """One row's surface from a compute path's curve {tokens fed: ms} (cpu/paths.py's ComputePath.costs_ms)."""
        points = sorted((int(w), float(ms)) for w, ms in costs_ms.items())
        return cls((1,), [w for w, _ in points], [[ms for _, ms in points]], name=name)

    @classmethod
    def from_record(cls, record: dict) -> Surface:
        try:
            return cls(record["rows"], record["widths"], record["ms"], name=record.get("name", "measured"),
                       simulated=bool(record.get("simulated", False)))
        except (KeyError, TypeError) as err:
            raise ValueError(f"the cost surface cannot be used: a field is missing or malformed ({err})") from None

    def record(self) -> dict:
        return {"name": self.name, "simulated": self.simulated, "rows": list(self.rows), "widths": list(self.widths),
                "ms": [[round(x, 3) for x in line] for line in self.grid]}

    def ms(self, rows: int, width: int) -> float:
        """Interpolated linearly between grid points; past the grid's end, its last slope (never downwards)."""
        line = [_interpolate(self.widths, costs, width) for costs in self.grid]
        return _interpolate(self.rows, line, rows)

    def summary(self, widths: Sequence[int] = (1, 2, 4)) -> str:
        """One line: ms by width for a few row counts, e.g. "1 row 1:2.3 2:2.4 4:2.6; 8 rows 1:4.1 ..."."""
        shown = [r for r in (1, 4, max(self.rows)) if r in self.rows]
        parts = []
        for r in dict.fromkeys(shown):
            curve = " ".join(f"{w}:{self.ms(r, w):.1f}" for w in widths)
            parts.append(f"{r} row{'s' if r > 1 else ''} {curve}")
        kind = "simulated " if self.simulated else ""
        return f"{kind}ms per pass by tokens per row: " + "; ".join(parts)


def _grid_problem(rows: tuple[int, ...], widths: tuple[int, ...], grid: list[list[float]]) -> str | None:
    if not rows or not widths:
        return "it has no rows or no widths"
    if any(r < 1 for r in rows) or any(w < 1 for w in widths):
        return "rows and widths must be at least 1"
    if list(rows) != sorted(set(rows)) or list(widths) != sorted(set(widths)):
        return "rows and widths must be increasing"
    if len(grid) != len(rows) or any(len(line) != len(widths) for line in grid):
        return f"it needs {len(rows)} x {len(widths)} entries (rows x widths), some are missing"
    bad = [(r, w) for r, line in zip(rows, grid) for w, x in zip(widths, line) if not (math.isfinite(x) and x > 0)]
    if bad:
        r, w = bad[0]
        return f"the entry at {r} rows x {w} tokens is not a positive number ({len(bad)} such entries)"
    return None


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = (xs[-2], ys[-2]), (xs[-1], ys[-1])
    return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (x - x1)


@torch.inference_mode()
def measure(backend: Backend, *, rows: Sequence[int] = GRID_ROWS, widths: Sequence[int] = GRID_WIDTHS,
            context: int = SURFACE_CONTEXT, rounds: int = SURFACE_ROUNDS) -> Surface:
    """Measure the surface: a cached pass feeding ``width`` tokens to each of ``rows`` rows after ``context`` tokens.

    The attention mask and position ids are passed as the batch decoders pass them, rows of different
    lengths (holes on the left) as in a real batch, so the compute path's masking and attention run as
    in a real pass, and every pass's logits go through the greedy choice and
    its host sync as the decoders' do (a wider pass also costs its candidates' acceptance). The widths
    of one row count take turns, one pass each per round, and the fastest round of each is kept:
    other load only ever adds time. Each timed pass follows an untimed one-token pass, as a decoding
    pass follows another: right after a wide pass (a 32-token one at 8 rows on a CPU) the next pass runs
    slower, which in a fixed order priced the narrow passes that came next as dear as wider ones
    (BENCHMARKS.md, "Many requests at once").
    """
    gen = torch.Generator().manual_seed(0)
    vocab, device = backend.config.vocab_size, backend.device
    grid = []
    for r in rows:
        ids = torch.randint(vocab // 4, vocab // 2, (r, context + max(widths)), generator=gen).to(device)
        cache = backend.new_cache()
        held = torch.ones(r, context, dtype=torch.long, device=device)
        for row in range(1, r):  # rows of different lengths, as in a real batch: holes on the left
            held[row, : HOLES * (row % 4)] = 0
        backend.forward(ids[:, :context], cache, mask=held)
        seen: dict[int, list[float]] = {w: [] for w in widths}
        for _ in range(rounds + 2):  # two warm-up rounds
            for w in widths:
                _timed_pass(backend, ids, cache, held, 1)  # the pass before: a decoding pass's
                seen[w].append(_timed_pass(backend, ids, cache, held, w))
        grid.append([min(seen[w][2:]) * 1000 for w in widths])
    return Surface(rows, widths, monotone(grid))


def _timed_pass(backend: Backend, ids: torch.Tensor, cache, held: torch.Tensor, width: int) -> float:
    """Seconds of one pass feeding ``width`` of ``ids``'s columns after the ``held`` ones (measure), then cropped."""
    rows, context = held.shape
    mask = torch.cat([held, held.new_ones(rows, width)], dim=1)
    positions = torch.arange(context, context + width, device=held.device)[None].expand(rows, -1)
    started = time.perf_counter()
    logits = backend.forward(ids[:, context : context + width], cache, positions=positions, mask=mask, keep=width)
    tokens, conf = greedy_confidence(logits, "probability")
    torch.stack([tokens.double(), conf.double()]).tolist()  # the host sync, as accept_rows has it
    seconds = time.perf_counter() - started
    cache.crop(width)
    return seconds


def monotone(grid: list[list[float]]) -> list[list[float]]:
    """No point above a wider or a taller one: a pass that feeds more cannot cost less, so where a
    measured point costs more than one that feeds more, a burst of other load slowed it (load only
    ever adds time), and the larger pass's cost bounds it."""
    out = [list(line) for line in grid]
    for r in range(len(out) - 1, -1, -1):
        for w in range(len(out[r]) - 1, -1, -1):
            wider = out[r][w + 1] if w + 1 < len(out[r]) else math.inf
            taller = out[r + 1][w] if r + 1 < len(out) else math.inf
            out[r][w] = min(out[r][w], wider, taller)
    return out


def cached_surface(backend: Backend, key: str, table_dir: Path) -> Surface:
    """The surface of ``backend`` measured once per ``key`` (the compute path's cost-table key) and kept on disk."""
    path = table_dir / SURFACE_FILE
    full_key = f"{key}|surface={SURFACE_VERSION}"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if full_key in table:
        try:
            return Surface.from_record(table[full_key])
        except ValueError:
            pass  # a damaged entry is measured again
    surface = measure(backend)
    table[full_key] = surface.record()
    table_dir.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + f".tmp{os.getpid()}")
    staging.write_text(json.dumps(table, indent=1) + "\n")
    staging.replace(path)
    return surface


class Hits:
    """Running share of candidates accepted at each depth (depth 1: the first mask or draft after the AR token).

    Depth j counts as tried when every depth before it held. ``decay`` (< 1) forgets old passes, so a
    row whose text turns from prose to code, or a tau that changes, moves the estimate within tens of
    passes. A pass that offered nothing (width 1) shows nothing, so it relaxes the estimate toward
    the prior instead: a row narrowed to AR passes by a hard stretch is offered a mask again some tens
    of passes later, and keeps it if its text has turned easy. PRIOR: pseudo-counts (held, tried), a
    first guess of one in two.
    """

    PRIOR = (1.0, 2.0)

    def __init__(self, depth: int, decay: float = 1.0) -> None:
        self.decay = decay
        self.held = [self.PRIOR[0]] * depth
        self.tried = [self.PRIOR[1]] * depth
        self.idle = 0  # passes that offered nothing, not yet applied (a pass of plain AR costs no host work here)

    def observe(self, offered: int, extra: int) -> None:
        """A pass offered ``offered`` candidates past the AR token and the first ``extra`` of them held."""
        if offered < 1:
            self.idle += 1
            return
        self._relax()
        if self.decay < 1:
            self.held = [h * self.decay for h in self.held]
            self.tried = [t * self.decay for t in self.tried]
        for j in range(min(extra + 1, offered, len(self.tried))):
            self.tried[j] += 1
            self.held[j] += j < extra

    def _relax(self) -> None:
        """The idle passes' pull toward the prior, all at once: d^k of the way left after k of them."""
        if self.idle:
            left, (held, tried) = self.decay**self.idle, self.PRIOR
            self.held = [held + left * (h - held) for h in self.held]
            self.tried = [tried + left * (t - tried) for t in self.tried]
            self.idle = 0

    def share(self, j: int) -> float:
        if self.idle:
            self._relax()
        return self.held[j] / self.tried[j]

    def expected(self, width: int) -> float:
        """Tokens a pass of ``width`` (the AR token and width - 1 candidates) is expected to commit."""
        reach, total = 1.0, 1.0
        for j in range(min(width - 1, len(self.held))):
            reach *= self.share(j)
            total += reach
        return total


_POOLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # surface -> {most: {tau: pooled Hits}}


def widest_accepted(rows: Sequence[Hits], widths: Sequence[int]) -> float:
    """Expected tokens accepted by the row that accepts most, each row offered its width's candidates."""
    total, most = 0.0, max(widths, default=1)
    reach = [1.0] * len(rows)  # P(row accepts at least k)
    for k in range(1, most + 1):
        if k > 1:
            reach = [r * h.share(k - 2) if k <= w else 0.0 for r, h, w in zip(reach, rows, widths)]
        none = 1.0
        for r in reach:
            none *= 1.0 - r
        total += 1.0 - none
    return total


class WidthController:
    """Chooses each pass's width (module docstring) and keeps what it chose and why.

    ``surface`` None: width is taken to be free (an unmeasured device): every pass gets ``most``.
    Each row's acceptance is its own ``Hits``, started from the pooled share at the same tau, which every
    controller on the same surface shares (within this process): a new batch starts from what the
    model's rows have shown on this machine, not from the prior.

    On a measured surface the controller also checks it against the passes it sees (``passed``): the
    running ratio of a pass's measured time to the surface's price, kept apart for one-token and wider
    passes (the host work a real batch adds per column is not all in the surface), scales the price
    of every later pass. A simulated surface is the clock itself and is taken as it is.
    """

    ROW_DECAY = 0.95  # a row's own share follows its last tens of passes
    POOLED_DECAY = 0.99  # the batch's, its last hundreds of row passes
    COST_DECAY = 0.9  # the measured / priced ratio follows the last tens of passes

    def __init__(self, surface: Surface | None, most: int) -> None:
        self.surface, self.most = surface, max(int(most), 1)
        shared = _POOLED.setdefault(surface, {}) if surface is not None else {}
        self.pooled: dict[float, Hits] = shared.setdefault(self.most, {})  # tau -> the pooled share
        self.scale: dict[bool, float] = shared.setdefault("scale", {False: 1.0, True: 1.0})  # wide? -> ratio
        self.last: tuple[int, float] = (self.most, 1.0)  # (width, expected gain over width 1)

    def new_row(self, tau: float) -> Hits:
        hits = Hits(self.most - 1, self.ROW_DECAY)
        pooled = self.pooled.get(round(tau, 4))
        if pooled is not None:  # start from what the batch's rows have shown at this tau
            hits.held = [Hits.PRIOR[1] * pooled.share(j) for j in range(self.most - 1)]
        return hits

    def observe(self, row: Hits, tau: float, offered: int, extra: int) -> None:
        row.observe(offered, extra)
        self.pooled.setdefault(round(tau, 4), Hits(self.most - 1, self.POOLED_DECAY)).observe(offered, extra)

    def rate(self, rows: Sequence[Hits], caps: Sequence[int], width: int, fed: int | None = None) -> float:
        """Expected committed tokens per ms of passes of ``width`` over these rows (module docstring).

        ``fed``: the columns this pass feeds before its masks (a prefill); None: the steady state's.
        """
        widths = [min(width, cap) for cap in caps]
        expected = sum(h.expected(w) for h, w in zip(rows, widths))
        before = widest_accepted(rows, widths) if fed is None else fed
        columns = before - 1 + width
        return expected / (self.surface.ms(len(rows), columns) * self.scale[columns > 1])

    def passed(self, rows: int, columns: int, seconds: float) -> None:
        """A pass over ``rows`` rows fed ``columns`` columns and took ``seconds``: correct the prices."""
        if self.surface is None or self.surface.simulated or rows < 1 or columns < 1 or seconds <= 0:
            return
        ratio = seconds * 1000 / self.surface.ms(rows, columns)
        wide = columns > 1
        self.scale[wide] = self.COST_DECAY * self.scale[wide] + (1 - self.COST_DECAY) * min(max(ratio, 0.25), 4.0)

    def choose(self, rows: Sequence[Hits], caps: Sequence[int], tau: float, fed: int | None = None) -> int:
        """The width of the next pass (``fed`` as in ``rate``): 1 at tau = 1.0, else the best rate."""
        if tau >= 1.0 or not rows:
            self.last = (1, 1.0)
        elif self.surface is None:
            self.last = (self.most, math.inf)
        else:
            rates = {w: self.rate(rows, caps, w, fed) for w in range(1, self.most + 1)}
            best = max(rates, key=lambda w: (rates[w], -w))
            best = best if rates[best] >= (GAIN if len(rows) > 1 else 1.0) * rates[1] else 1
            self.last = (best, rates[best] / rates[1])
        return self.last[0]

    def gain(self, rows: int, tau: float) -> float:
        """How much faster than width 1 the best width is expected to be at ``rows`` rows and ``tau``.

        From the pooled acceptance at that tau (the prior where none was seen). inf without a surface.
        """
        if self.surface is None:
            return math.inf
        if tau >= 1.0 or rows < 1:
            return 1.0
        hits = self.pooled.get(round(tau, 4)) or Hits(self.most - 1)
        every = [hits] * rows
        caps = [self.most] * rows
        gain = max(self.rate(every, caps, w) for w in range(1, self.most + 1)) / self.rate(every, caps, 1)
        return gain if gain >= GAIN else 1.0

    def why(self) -> str:
        """One line: the width chosen last and the reason."""
        width, gain = self.last
        if self.surface is None:
            return f"width {width}: no measured cost surface, so every mask is fed"
        if width == 1:
            return "width 1 (plain AR passes): on this machine's cost surface no mask pays for itself here"
        return f"width {width}: expected {gain:.2f}x the tokens per ms of one-token passes on the cost surface"


class OneRow:
    """The controller of one sequence (loop.decode_passes): its running acceptance and each pass's width."""

    def __init__(self, controller: WidthController) -> None:
        self.controller, self.hits = controller, None

    def choose(self, tau: float, room: int, pending: int, produced: int) -> int | None:
        """The next MARS pass's width (None at tau 1.0: an AR pass); ``pending`` is the prompt's length in the
        prefill (nothing ``produced`` yet), where masks are priced beside it."""
        if tau >= 1.0:
            return None
        self.hits = self.hits or self.controller.new_row(tau)
        return self.controller.choose([self.hits], [room], tau, None if produced else pending)

    def observe(self, tau: float, width: int, accepted: int) -> None:
        self.controller.observe(self.hits, tau, width - 1, accepted - 1)


_SURFACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its surface, within this process


def surface_for(lm: LoadedModel) -> Surface | None:
    """The measured surface of a model on its measured CPU compute path or on a GPU, cached on disk.

    None where nothing is measured (a CPU model loaded as it is): width is then taken to be free.
    """
    if lm.compute is None and lm.device.type != "cuda":
        return None
    if lm.model not in _SURFACES:
        _SURFACES[lm.model] = cached_surface(lm.backend, _surface_key(lm), cache_dir())
    return _SURFACES[lm.model]


def _surface_key(lm: LoadedModel) -> str:
    """What a surface holds for: the CPU compute path's own cost-table key, or the GPU, libraries and model."""
    if lm.compute is not None:
        from ..backends.cpu.paths import table_key  # the same machine, kernels, model and path

        return f"{table_key(lm.model, range(1, 2))}|path={lm.compute.path}"
    import transformers

    name = getattr(lm.model.config, "_name_or_path", "") or lm.model.config.model_type
    params = sum(p.numel() for p in lm.model.parameters())
    return "|".join([
        torch.cuda.get_device_name(lm.device), f"torch={torch.__version__}", f"cuda={torch.version.cuda}",
        f"transformers={transformers.__version__}", f"model={name}", f"params={params}", f"dtype={lm.model.dtype}",
        f"backend={type(lm.backend).__name__}",
    ])


def known_surface(lm: LoadedModel) -> Surface | None:
    """The surface ``surface_for`` measured or read for ``lm`` in this process, if any (reports, no measuring)."""
    return _SURFACES.get(lm.model)


def read_surface(path: Path) -> tuple[Surface, str]:
    """A surface saved elsewhere (serve-sim --surface): a Surface record, or a cost-surfaces.json holding
    one entry. Returns it and where it came from (the entry's key); any other content is one ValueError."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read the cost surface {path}: {err}") from None
    if isinstance(data, dict) and "ms" not in data:  # a cost-surfaces.json table: key -> record
        if len(data) != 1:
            raise ValueError(f"{path} holds {len(data)} cost surfaces: keep the one to price passes on")
        (source, data), = data.items()
    else:
        source = str(path)
    return Surface.from_record(data), source  # anything but a record: one ValueError


def affordable_rate(surface: Surface, rows: int, tokens_per_request: float) -> float:
    """Requests per second that batched AR passes of ``rows`` rows sustain on ``surface`` (one token a row a pass)."""
    return rows / surface.ms(rows, 1) * 1000 / max(tokens_per_request, 1.0)
