"""What a static batch's wide passes return once its rows drift apart (width.py, batch/token.py).

A static batch (``stream_batch_ids``, ``bench``: no row joins it) runs until its last row ends. A pass that feeds
masks or drafts commits a random number of tokens a row, so rows that began together drift apart, and the batch
runs as many passes as its unluckiest row needs: what the luckier rows gained does not shorten it (they end sooner,
and the passes after them run on fewer rows, which on a CPU cost most of what full ones do).

A row ``left`` tokens from its end, committing ``tokens`` a pass with ``variance`` a pass, needs about
left / tokens passes, give or take sqrt(left * variance / tokens^3) (the normal limit of a renewal count); the last
of R such rows about c_R of those more, c_R the expected largest of R standard normals, and never more than
``left`` (every pass commits at least one token a row). A pass over r rows costs about a + b r (``surface.ms`` along
its rows): the rows' own share b r is paid for every row's passes, whose sum drifting does not change (rows that end
early spare it as those that end late add it), and only the pass's own share a (reading the weights, the head,
the host's work) is paid once more for each pass the last row adds. So a static batch keeps
1 / (1 + k c_R sqrt(variance / (left * tokens))) of a width's steady rate, k = a / ms(R) (``fixed_share``), and at
least one token a pass: all of it for one row or for plain passes (no variance), less the more rows and the fewer
tokens left. A batch whose finished rows are replaced (a server's) keeps its steady rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .surface import Surface


def spread(rows: int, tokens: float, variance: float, left: float, fixed: float = 1.0) -> float:
    """The share of its steady rate a static batch of ``rows`` rows keeps at a width whose passes commit ``tokens``
    a row with ``variance``, ``left`` tokens before its last row's end, ``fixed`` of a pass's cost its own (not its
    rows': ``fixed_share``; module docstring)."""
    if rows < 2 or variance <= 0 or left <= 0 or tokens <= 1:
        return 1.0
    late = fixed * largest_normal(rows) * math.sqrt(variance / (left * tokens))
    return max(1.0 / tokens, 1.0 / (1.0 + late))


def fixed_share(surface: Surface, rows: int, width: float) -> float:
    """The share of a pass over ``rows`` rows feeding ``width`` tokens each that does not grow with its rows, on
    ``surface``: a / ms(rows, width) for ms(r, width) = a + b r through one row and ``rows`` rows, within [0, 1]."""
    if rows < 2:
        return 1.0
    one, all_rows = surface.ms(1, width), surface.ms(rows, width)
    own = one - (all_rows - one) / (rows - 1)
    return min(max(own / all_rows, 0.0), 1.0)


def kept(
    rates: dict[int, float], reach: Sequence[list[float]], caps: Sequence[int], surface: Surface
) -> dict[int, float]:
    """MARS windows' steady ``rates`` by width (width.py) as a static batch on ``surface`` keeps them: ``reach``, each
    row's P(at least k tokens) (``Hits.reach``), ``caps``, its room left (its width's cap)."""
    rows = len(reach)
    if rows < 2:
        return rates
    out, left = {}, max(caps)
    for width, rate in rates.items():
        each = [moments(r[: max(min(width, cap), 1)]) for r, cap in zip(reach, caps)]
        mean, variance = (sum(m[i] for m in each) / rows for i in (0, 1))
        out[width] = rate * spread(rows, mean, variance, left, fixed_share(surface, rows, width))
    return out


def moments(reach: list[float]) -> tuple[float, float]:
    """(mean, variance) of a pass's tokens from P(at least k tokens), k = 1, 2, ... (``Hits.reach``)."""
    mean = sum(reach)
    return mean, sum((2 * k + 1) * p for k, p in enumerate(reach)) - mean * mean


@lru_cache(maxsize=64)
def largest_normal(rows: int) -> float:
    """The expected largest of ``rows`` standard normals: 0 for one, 0.564 for two, 1.029 for four, 1.424 for
    eight. The integral of x R phi(x) Phi(x)^(R - 1), by the trapezoid rule on [-10, 10]."""
    step, total = 0.01, 0.0
    for i in range(-1000, 1001):
        x = i * step
        density = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        total += x * rows * density * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (rows - 1)
    return total * step
