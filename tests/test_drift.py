"""A static batch's wide passes, priced for its rows drifting apart (mars_demo/engine/decoding/drift.py)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from mars_demo.engine.decoding.drift import fixed_share, largest_normal, moments, spread
from mars_demo.engine.decoding.exact import CHAIN, IN_TURNS, WITH_FALLBACK, DraftDepth, Layout
from mars_demo.engine.decoding.surface import Surface
from mars_demo.engine.decoding.width import Hits, WidthController

ROWS, WIDTHS = (1, 2, 4, 8), (1, 2, 3, 4, 8, 16)


def test_the_largest_of_a_few_normals_is_what_tables_give():
    assert largest_normal(1) == pytest.approx(0.0, abs=1e-6)
    assert largest_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-4)
    assert largest_normal(4) == pytest.approx(1.0294, abs=1e-3)
    assert largest_normal(8) == pytest.approx(1.4236, abs=1e-3)


def test_a_pass_has_the_mean_and_variance_of_its_reach():
    mean, variance = moments([1.0, 0.6, 0.36])  # 1, 2 or 3 tokens with 0.4, 0.24 and 0.36
    assert mean == pytest.approx(1.96) and variance == pytest.approx(0.4 + 0.24 * 4 + 0.36 * 9 - 1.96**2)
    assert moments([1.0]) == (1.0, 0.0)


def test_a_static_batch_keeps_less_of_a_wide_rate_the_more_rows_and_the_less_room_left():
    assert spread(1, 1.5, 0.25, 50) == 1.0  # one row waits for no other
    assert spread(8, 1.0, 0.0, 50) == 1.0  # plain passes: the rows do not drift
    assert spread(2, 1.5, 0.25, 50) > spread(4, 1.5, 0.25, 50) > spread(8, 1.5, 0.25, 50)
    assert spread(8, 1.5, 0.25, 20) < spread(8, 1.5, 0.25, 200) < 1.0
    assert 1.05 * spread(8, 1.05, 0.05, 1) == pytest.approx(1.0)  # never under one token a pass: each row gets one


def _passes(rng: random.Random, left: int, held: float) -> int:
    """Passes a row takes to commit ``left`` tokens when each commits one, and one more with chance ``held``."""
    passes, done = 0, 0
    while done < left:
        passes, done = passes + 1, done + 1 + (rng.random() < held)
    return passes


@pytest.mark.parametrize("rows, left, held", [(8, 96, 0.5), (4, 96, 0.3), (8, 24, 0.6), (2, 48, 0.5)])
def test_the_model_predicts_how_many_passes_a_simulated_static_batch_takes(rows, left, held):
    rng = random.Random(0)
    batches = [max(_passes(rng, left, held) for _ in range(rows)) for _ in range(2000)]
    tokens = 1 + held
    predicted = left / (tokens * spread(rows, tokens, held * (1 - held), left))
    assert statistics.mean(batches) == pytest.approx(predicted, rel=0.03)
    assert statistics.mean(batches) > left / tokens  # what the steady rate alone would say


@pytest.mark.parametrize("rows, held", [(8, 0.5), (4, 0.4), (2, 0.6)])
def test_the_model_predicts_how_long_a_simulated_static_batch_takes_where_passes_cost_by_their_rows(rows, held):
    """A pass over r rows costs a + b r: rows that end early spare their share as late ones add theirs, and only a
    is paid again for each pass the last row adds."""
    own, per_row, left, rng = 4.0, 0.5, 96, random.Random(1)
    surface = Surface.from_cost(lambda r, w: own + per_row * r, rows=ROWS, widths=WIDTHS, name="a + b r")

    def seconds() -> float:
        ends = sorted(_passes(rng, left, held) for _ in range(rows))  # each row's passes; rows - i alive till ends[i]
        spans = zip([0] + ends, ends)
        return sum((end - before) * (own + per_row * (rows - i)) for i, (before, end) in enumerate(spans))

    tokens, variance = 1 + held, held * (1 - held)
    steady = left / tokens * (own + per_row * rows)
    fixed = fixed_share(surface, rows, 1)
    assert fixed == pytest.approx(own / (own + per_row * rows))
    simulated = statistics.mean(seconds() for _ in range(2000))
    assert simulated == pytest.approx(steady / spread(rows, tokens, variance, left, fixed), rel=0.01)
    assert simulated > steady * 1.003  # the steady rate alone would say less


def test_a_static_batch_goes_wide_only_where_the_gain_outlasts_its_rows_drifting_apart():
    """A second column costs 10% more, masks hold one time in two: a server's batch of eight rows gains ~1.25x a
    pass from it; a static one keeps ~1.18x with 96 tokens to go and ~1.04x (under GAIN) with eight."""
    surface = Surface.from_cost(lambda r, w: 10.0 * (1 + 0.1 * (w - 1)), rows=ROWS, widths=WIDTHS, name="tenth")

    def width(rows, left, static):
        return WidthController(surface, 2).choose([Hits(1) for _ in range(rows)], [left] * rows, 0.9, static=static)

    assert width(8, 8, static=False) == 2
    assert width(8, 8, static=True) == 1
    assert width(8, 96, static=True) == 2
    assert width(1, 8, static=True) == 2  # one row: nothing drifts


def test_a_layouts_variance_is_spread_over_the_passes_that_verify():
    depth = DraftDepth(3, {w: 10.0 for w in range(1, 11)})  # the prior: each draft holds one time in two
    verifying = moments([1.0, 0.5, 0.25, 0.125])
    assert depth.pass_moments(Layout(3, *WITH_FALLBACK)) == pytest.approx(verifying)  # every pass verifies
    tokens, variance = depth.pass_moments(Layout(3, *IN_TURNS))  # every other pass verifies
    assert tokens == pytest.approx((verifying[0] + 1) / 2) and variance == pytest.approx(verifying[1] / 2)
    tokens, variance = depth.pass_moments(Layout(3, *CHAIN))
    assert 1.0 < tokens < verifying[0] and 0.0 < variance < verifying[1]
    assert depth.pass_moments(Layout(0, True, True)) == (1.0, 0.0)  # a plain pass
