"""Chart builders and the sweep's arithmetic: pure functions, tested on hand-made events (no browser)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import plotly.graph_objects as go
import pytest

from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import RunStats, StepEvent
from mars_demo.engine.decoding.metrics import REFERENCE_TAU, Rates, speedup
from mars_demo.ui import charts
from mars_demo.ui.sweep import FrontierPoint, SweepRun, frontier, plan, sweep_runs, sweep_table


def steps(counts: list[int], taus: list[float] | None = None, seconds: float = 0.1) -> list[StepEvent]:
    """Events accepting ``counts[i]`` tokens at pass i; the last one carries the totals."""
    taus = taus or [0.9] * len(counts)
    out, next_id = [], 10
    for i, (n, tau) in enumerate(zip(counts, taus)):
        ids = tuple(range(next_id, next_id + n))
        next_id += n
        last = i == len(counts) - 1
        stats = RunStats(sum(counts), len(counts), seconds * len(counts), "length") if last else None
        out.append(StepEvent(i, ids, tuple(f"t{t} " for t in ids), (0.95,) * n, tau, seconds, stats))
    return out


def test_rates_of_steps_and_speedup():
    mars, ar = Rates.of_steps(steps([1, 3, 2])), Rates.of_steps(steps([1] * 6))
    assert (mars.tokens, mars.forward_passes) == (6, 3)
    assert mars.seconds == pytest.approx(0.3)
    assert mars.tokens_per_forward == 2.0
    assert mars.tokens_per_second == pytest.approx(20.0)
    assert speedup(mars, ar) == pytest.approx(2.0)
    assert speedup(mars, None) is None
    assert Rates.of_steps([]).tokens_per_second == 0.0


def test_tokens_vs_time_has_both_sides_on_their_own_clocks():
    fig = charts.tokens_vs_time(steps([1, 3, 2], seconds=0.2), steps([1] * 4, seconds=0.1))
    assert isinstance(fig, go.Figure)
    mars, ar = fig.data
    assert (mars.name, ar.name) == ("MARS", "AR")
    assert list(mars.y) == [0, 1, 4, 6]
    assert list(mars.x) == pytest.approx([0.0, 0.2, 0.4, 0.6])
    assert list(ar.y) == [0, 1, 2, 3, 4]
    assert list(ar.x) == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


def test_tokens_vs_time_without_ar():
    fig = charts.tokens_vs_time(steps([2, 2]), None)
    assert [t.name for t in fig.data] == ["MARS"]


def test_tokens_per_pass_overlays_tau_per_pass():
    fig = charts.tokens_per_pass(steps([1, 4, 2, 3], taus=[0.9, 0.9, 0.5, 0.5]), block_size=4)
    bars, tau = fig.data
    assert isinstance(bars, go.Bar) and isinstance(tau, go.Scatter)
    assert list(bars.x) == [1, 2, 3, 4]
    assert list(bars.y) == [1, 4, 2, 3]
    assert list(tau.y) == [0.9, 0.9, 0.5, 0.5]
    assert tau.yaxis == "y2"
    # neighbouring passes get different colours, the same ones the text pane uses
    colours = list(bars.marker.color)
    assert all(a != b for a, b in itertools.pairwise(colours))
    assert set(colours) <= set(charts.PASS_COLORS)


def test_histogram_counts_passes_per_size():
    fig = charts.passes_histogram(steps([1, 1, 3, 4, 1, 3]), block_size=4)
    (bars,) = fig.data
    assert list(bars.x) == [1, 2, 3, 4]
    assert list(bars.y) == [3, 0, 2, 1]
    assert "mean 2.17" in fig.layout.title.text


def test_empty_figures_build():
    for fig in (charts.tokens_vs_time([], []), charts.tokens_per_pass([]), charts.passes_histogram([]),
                charts.summary_table([], []), charts.tree_shapes([])):
        assert isinstance(fig, go.Figure)


def shaped(shapes: list[tuple[int, ...]]) -> list[StepEvent]:
    """Verifying passes that fed these tree shapes (StepEvent.shape), one token each."""
    return [replace(step, shape=shape) for step, shape in zip(steps([1] * len(shapes), [1.0] * len(shapes)), shapes)]


def test_tree_shapes_has_one_point_per_pass_with_its_shape():
    run = shaped([(), (1, 1, 1), (2, 1, 1), (2, 1, 1), (3, 2), (1,)])
    fig = charts.tree_shapes(run, "auto")
    bars, depth = fig.data
    assert list(bars.x) == list(depth.x) == [1, 2, 3, 4, 5, 6]
    assert list(bars.customdata) == ["no drafts", "chain of 3", "2,1,1", "2,1,1", "3,2", "chain of 1"]
    assert list(bars.y) == [0, 3, 6, 6, 9, 1]  # drafts verified: a tree's nodes, a chain's depth
    assert list(depth.y) == [0, 3, 3, 3, 2, 1]
    assert list(bars.marker.color) == [charts.MARS_COLOR] * 2 + [charts.EXACT_COLOR] * 3 + [charts.MARS_COLOR]
    assert "tree auto: chains on 40% of passes, 2,1,1 on 40%, 3,2 on 20%" in fig.layout.title.text  # ties: first seen
    assert fig.layout.height <= charts.HEIGHT  # a small chart


def test_tree_text_gives_the_shares_of_shapes_after_the_prefill():
    run = shaped([()] + [(1, 1)] * 8 + [(2, 1, 1)] * 2)
    assert charts.tree_text(run, "auto") == "auto: chains on 80% of passes, 2,1,1 on 20%"
    assert charts.tree_text(run, None) == "—" and charts.tree_text(run[:1], "auto") == "—"
    many = shaped([(), (2,), (3,), (2, 1), (3, 1), (1,)])
    assert charts.tree_text(many, "2") == "2: 2 on 20% of passes, 3 on 20%, 2,1 on 20%, other shapes on 40%"
    table = charts.summary_table(run, None, None, "auto").data[0].cells.values
    assert table[1][table[0].index("candidate tree (auto): passes by shape")] == "chains 80%<br>2,1,1 20%"
    assert table[0][:-1] == charts.summary_table(run, None).data[0].cells.values[0]  # the row only with a tree


def test_summary_table_values():
    fig = charts.summary_table(steps([2, 2], seconds=0.1), steps([1] * 4, seconds=0.1))
    (table,) = fig.data
    labels, mars_col, ar_col = table.cells.values
    row = dict(zip(labels, zip(mars_col, ar_col)))
    assert row["tokens"] == ("4", "4")
    assert row["forward passes"] == ("2", "4")
    assert row["tokens / forward"] == ("2.00", "1.00")
    assert row["speedup over AR"] == ("2.00×", "1.00×")
    off = charts.summary_table(steps([2]), None).data[0].cells.values
    assert off[2][0] == "—" and off[1][-1] == "—"
    assert row["same tokens as AR"] == ("4/4 (identical)", "—")  # steps() numbers tokens alike on both sides
    assert charts.agreement_text(steps([2, 2]), steps([1, 1, 1])) == "3/4"
    assert charts.agreement_text(steps([2]), None) == "—"


def test_plan_always_includes_the_reference_ar_and_exact_mode():
    runs = plan(["a", "b"], [0.5, 0.9, 0.9])
    assert runs[:5] == [("a", "ar", None), ("a", "exact", None), ("a", "mars", 1.0), ("a", "mars", 0.9),
                        ("a", "mars", 0.5)]
    assert len(runs) == 10
    for bad in (([], [0.5]), (["a"], []), (["a"], [1.5]), (["  "], [0.5])):
        with pytest.raises(ValueError):
            plan(*bad)


def run(prompt, mode, tau, ids, passes, seconds) -> SweepRun:
    return SweepRun(prompt, mode, tau, tuple(ids), "", passes, seconds)


def test_frontier_pools_rates_and_measures_agreement():
    runs = [
        run("a", "ar", None, [1, 2, 3, 4], 4, 0.4),
        run("a", "mars", 1.0, [1, 2, 3, 4], 4, 0.4),
        run("a", "mars", 0.5, [1, 2, 9, 4], 2, 0.2),
        run("b", "ar", None, [5, 6], 2, 0.2),
        run("b", "mars", 1.0, [5, 6], 2, 0.2),
        run("b", "mars", 0.5, [5, 6], 1, 0.1),
    ]
    ref, low = frontier(runs)
    assert (ref.tau, low.tau) == (REFERENCE_TAU, 0.5) and (ref.mode, low.mode) == ("mars", "mars")
    assert ref.agreement == 1.0 and ref.exact == 1.0
    assert ref.tokens_per_forward == 1.0 and ref.speedup == pytest.approx(1.0)
    assert low.prompts == 2
    assert low.tokens_per_forward == pytest.approx(6 / 3)
    assert low.speedup == pytest.approx((6 / 0.3) / (6 / 0.6))
    assert low.agreement == pytest.approx((0.5 + 1.0) / 2)  # common prefix 2 of 4, then identical
    assert low.exact == 0.5
    # a prefix of the runs (a sweep in progress) gives points for what has a reference
    assert [p.tau for p in frontier(runs[:3])] == [1.0, 0.5]
    assert frontier(runs[:1]) == []


def test_exact_modes_point_measures_its_agreement_with_the_ar_output():
    runs = [
        run("a", "ar", None, [1, 2, 3, 4], 4, 0.4),
        run("a", "exact", None, [1, 2, 3, 4], 2, 0.25),
        run("a", "mars", 1.0, [1, 2, 3, 4], 4, 0.4),
        run("b", "ar", None, [5, 6, 7, 8], 4, 0.4),
        run("b", "exact", None, [5, 6, 9], 2, 0.15),  # not AR's output: the point says so, nothing is assumed
        run("b", "mars", 1.0, [5, 6, 7, 8], 4, 0.4),
    ]
    exact, ref = frontier(runs)
    assert (exact.mode, exact.tau, exact.label, ref.label) == ("exact", None, "exact", "1")
    assert exact.prompts == 2 and exact.tokens_per_forward == pytest.approx(7 / 4)
    assert exact.speedup == pytest.approx((7 / 0.4) / (8 / 0.8))
    assert exact.agreement == pytest.approx((1.0 + 0.5) / 2) and exact.exact == 0.5
    assert frontier(runs[1:3])[0].mode == "mars"  # exact mode's point waits for its AR run
    assert sweep_table(frontier(runs))[0][0] == "exact" and sweep_table(frontier(runs))[1][0] == 1.0


def test_frontier_figure():
    points = [FrontierPoint(1.0, 2, 1.0, 10.0, 1.0, 1.0, 1.0), FrontierPoint(0.5, 2, 2.0, 18.0, 1.8, 0.8, 0.5)]
    fig = charts.frontier(points)
    left, right = fig.data
    assert list(left.x) == [1.0, 0.8] and list(left.y) == [1.0, 2.0]
    assert list(right.y) == [1.0, 1.8]
    assert list(left.text) == ["τ=1", "τ=0.5"]
    exact = FrontierPoint(None, 2, 1.6, 13.0, 1.3, 1.0, 1.0, mode="exact")
    fig = charts.frontier([exact, *points])
    assert [t.name for t in fig.data] == ["MARS", "exact"] * 2  # exact mode: a point of its own on each chart
    left, left_exact, right, right_exact = fig.data
    assert list(left.text) == ["τ=1", "τ=0.5"] and list(left_exact.text) == ["exact"]
    assert list(left_exact.x) == [1.0] and list(left_exact.y) == [1.6] and list(right_exact.y) == [1.3]


def test_sweep_runs_on_a_tiny_model(tiny_qwen):
    config = DecodeConfig(max_new_tokens=12)
    runs = list(sweep_runs(tiny_qwen, ["Explain why the sky is blue."], [0.0], config))
    assert [(r.mode, r.tau) for r in runs] == [("ar", None), ("exact", None), ("mars", 1.0), ("mars", 0.0)]
    ar, exact, ref, fast = runs
    assert ar.token_ids == ref.token_ids == exact.token_ids  # tau = 1.0 and exact mode are greedy AR's output
    assert ref.forward_passes == ref.tokens
    assert exact.forward_passes <= exact.tokens
    assert fast.forward_passes < fast.tokens  # tau = 0 accepts the whole block
    points = frontier(runs)
    assert [p.label for p in points] == ["exact", "1", "0"]
    assert points[0].agreement == 1.0 and points[0].exact == 1.0 and points[0].speedup is not None
    assert points[1].agreement == 1.0 and points[1].tokens_per_forward == 1.0
    assert points[2].tokens_per_forward > 1.0
