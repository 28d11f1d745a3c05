"""What a pass costs: the measured cost surface, by rows and tokens fed per row (width.py chooses on it).

A forward pass over R rows that feeds w tokens to each row costs ``Surface.ms(R, w)``, measured once per
machine, compute path and kernel version (``measure``, ``cached_surface``: kept beside the compute path's
cost table), or on a GPU once per GPU, library versions and model (``surface_for``). serve-sim's cost-model
clocks build surfaces of their own, marked simulated, and ``read_surface`` reads one measured elsewhere.
"""

from __future__ import annotations

import json
import math
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..backends.base import Backend
from ..machine import CHECK_CONTEXT, CHECK_ROUNDS, cache_dir, save_table, slowed
from .acceptance import greedy_confidence

if TYPE_CHECKING:
    from ..model import LoadedModel

GRID_ROWS = (1, 2, 4, 8)
GRID_WIDTHS = (1, 2, 3, 4, 6, 8, 10, 16, 32)  # decoding widths, exact mode's widest (1 + 3 x 3), prefills
SURFACE_FILE = "cost-surfaces.json"
SURFACE_VERSION = 6  # 2: the acceptance's cost included; 3: made monotone; 4: rows with holes; 5: a pass before each;
# 6: widest first
HOLES = 8  # left holes per row step when measuring (rows 0, 8, 16, 24 holes, repeating)
SURFACE_CONTEXT = 128  # cached tokens per row before a measured pass
SURFACE_ROUNDS = 7  # rounds kept per point (after two warm-up rounds): the fastest is the pass alone
RECHECKS = 2  # times a measurement's slowed row counts are measured again (measure)


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
        self._at: dict[tuple[int, int], float] = {}  # ms at whole (rows, width): priced again every pass
        self._lines: dict[float, list[float]] = {}  # ms at each grid width, by row count

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

    def ms(self, rows: int, width: float) -> float:
        """Interpolated linearly between grid points; past the grid's end, its last slope (never downwards)."""
        known = self._at.get((rows, width))
        if known is not None:
            return known
        line = self._lines.get(rows)
        if line is None:  # the row count's line of the grid, or between two lines: made once
            line = self._lines[rows] = (
                self.grid[self.rows.index(rows)] if rows in self.rows
                else [_interpolate(self.rows, costs, rows) for costs in zip(*self.grid)]
            )
        found = _interpolate(self.widths, line, width)
        if float(width).is_integer() and float(rows).is_integer():  # the controllers' recurring questions
            self._at[(rows, width)] = found
        return found

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
    pass follows another, and a round goes from the widest pass to the narrowest: for a few passes after a
    prefill-sized one (16 or 32 tokens a row) a pass runs slower, so a round that went from narrow to wide
    priced the next round's one-token pass above what decoding pays, and wide passes too cheap beside
    it (docs/METHOD.md, "Width").

    Load that lasts through a whole row count's rounds slows all of them. So once every row count is
    measured, each one's one-token pass is timed again; a row count whose pass now takes less than
    machine.LOADED of what it was measured at is measured again, at most RECHECKS times, each point keeping its
    fastest measurement.
    """
    gen = torch.Generator().manual_seed(0)
    setups = {r: _Setup(backend, r, context, max(widths), gen) for r in rows}
    lines = {r: setups[r].line(widths, rounds) for r in rows}
    for _ in range(RECHECKS):
        loaded = [r for r in rows if slowed(lines[r][0], setups[r].line((1,), rounds)[0])]
        for r in loaded:
            lines[r] = [min(a, b) for a, b in zip(lines[r], setups[r].line(widths, rounds))]
        if not loaded:
            break
    return Surface(rows, widths, monotone([lines[r] for r in rows]))


class _Setup:
    """``rows`` rows holding ``context`` cached tokens (rows of different lengths, holes on the left, as in a real
    batch), from which passes of up to ``widest`` tokens a row are timed (measure)."""

    def __init__(self, backend: Backend, rows: int, context: int, widest: int, gen: torch.Generator) -> None:
        vocab, device = backend.config.vocab_size, backend.device
        self.backend = backend
        self.ids = torch.randint(vocab // 4, vocab // 2, (rows, context + widest), generator=gen).to(device)
        self.cache = backend.new_cache()
        self.held = torch.ones(rows, context, dtype=torch.long, device=device)
        for row in range(1, rows):
            self.held[row, : HOLES * (row % 4)] = 0
        backend.forward(self.ids[:, :context], self.cache, mask=self.held)

    def line(self, widths: Sequence[int], rounds: int) -> list[float]:
        """Ms of a pass by width: the fastest of ``rounds`` rounds (after two warm-up rounds), widths in turns, the
        widest first (measure)."""
        seen: dict[int, list[float]] = {w: [] for w in widths}
        widest_first = sorted(widths, reverse=True)
        for _ in range(rounds + 2):
            for w in widest_first:
                _timed_pass(self.backend, self.ids, self.cache, self.held, 1)  # the pass before: a decoding pass's
                seen[w].append(_timed_pass(self.backend, self.ids, self.cache, self.held, w))
        return [min(seen[w][2:]) * 1000 for w in widths]


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
    """The surface of ``backend`` measured once per ``key`` (the compute path's cost-table key) and kept on disk.

    A kept surface is checked first: one row's one-token pass is timed, and where it now takes less than
    machine.LOADED of the kept cost, other load slowed that measurement (a test suite or a second process on the
    same cores), and every later batch would be priced on it, so the surface is measured again.
    """
    path = table_dir / SURFACE_FILE
    full_key = f"{key}|surface={SURFACE_VERSION}"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if full_key in table:
        try:
            kept = Surface.from_record(table[full_key])
        except ValueError:
            kept = None  # a damaged entry is measured again
        if kept is not None and not slowed_by_load(backend, kept):
            return kept
    surface = measure(backend)
    table[full_key] = surface.record()
    save_table(path, table)
    return surface


@torch.inference_mode()
def slowed_by_load(backend: Backend, surface: Surface, *, context: int = CHECK_CONTEXT,
                   rounds: int = CHECK_ROUNDS) -> bool:
    """Whether one row's one-token pass now takes less than machine.LOADED of what ``surface`` says it costs."""
    if surface.simulated or 1 not in surface.rows or 1 not in surface.widths:
        return False
    one_row = _Setup(backend, 1, context, 1, torch.Generator().manual_seed(0))
    return slowed(surface.ms(1, 1), one_row.line((1,), rounds)[0])


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
