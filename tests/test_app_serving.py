"""The app's Serving tab, driven directly with a tiny model: validation, live charts, totals, Stop, the time limit."""

from __future__ import annotations

from html import unescape

import gradio as gr
import pytest

from mars_demo.engine.checkpoints.loading import BUNDLED
from mars_demo.engine.decoding.surface import Surface
from mars_demo.ui.handlers import DemoHandlers
from mars_demo.ui.models import ModelPolicy, model_choices
from mars_demo.ui.serving_tab import BOUNDS, ServingHandlers, ServingState, parse_settings

from conftest import tiny_loader

GOOD = {
    "arrivals": "poisson", "rate": 20.0, "policies": ["fixed:1.0", "fixed:0.9", "adaptive"], "extra": "", "requests": 6,
    "time_limit": 60, "max_batch": 3, "max_new_tokens": 8,
}


@pytest.fixture
def serving(tiny_qwen, tmp_path):
    loader = tiny_loader(tiny_qwen)
    demo = DemoHandlers(loader, policy=ModelPolicy(tuple(model_choices(False)), free=True), trace_dir=tmp_path)
    return ServingHandlers(demo, chart_every=0.0)


def start(serving: ServingHandlers, state: ServingState, spec: str = BUNDLED, from_machine=False, **changes):
    s = {**GOOD, **changes}
    return serving.run(s["arrivals"], s["rate"], s["policies"], s["extra"], s["requests"], s["time_limit"],
                       s["max_batch"], s["max_new_tokens"], spec, state, None, from_machine)


def test_run_draws_live_charts_and_ends_with_totals(serving):
    outputs = list(start(serving, ServingState()))
    assert len(outputs) > 3  # warm-up, live redraws, final view
    status, tau, queue, throughput, latency, width, surface, totals = outputs[-1]
    assert "Finished: 3 of 3 policies" in status
    assert [row[0] for row in totals] == ["fixed:1", "fixed:0.9", "adaptive"]
    assert all(row[1] == 6 for row in totals)  # every request done under every policy
    assert totals[0][-1] == 1.0  # fixed:1.0 agrees with itself
    for fig in (tau, queue, throughput, latency, width):
        assert [trace.name for trace in fig.data] == ["fixed:1", "fixed:0.9", "adaptive"]
    assert all(w == 1 for w in width.data[0].y if w)  # fixed:1.0 feeds one token a row: batched AR
    assert surface is gr.skip() or surface == gr.skip()  # a model without a measured path has no surface to show
    live = [o for o in outputs[1:-1] if o[-1]]
    assert live and len(live[0][-1]) == 3  # every policy's partial totals: they take turns pass by pass
    assert "taking turns" in live[0][0] and all(name in live[0][0] for name in ("fixed:1", "fixed:0.9", "adaptive"))


def test_rate_from_the_machine_loads_it_past_batched_ar_and_shows_the_surface(serving, monkeypatch):
    import mars_demo.ui.serving_tab as tab

    surface = Surface.from_cost(lambda r, w: 2.0 + r * w, rows=(1, 2, 4), widths=(1, 2, 4, 8), name="t",
                                simulated=False)
    monkeypatch.setattr(tab, "surface_for", lambda lm: surface)
    outputs = list(start(serving, ServingState(), from_machine=True, policies=["fixed:1.0"], max_batch=2))
    status, *_, heatmap, totals = outputs[-1]
    sustained = 2 / surface.ms(2, 1) * 1000 / GOOD["max_new_tokens"]  # requests/s of batched AR at 2 rows
    assert f"Rate {round(1.5 * sustained, 2):g} requests/s" in unescape(status)
    assert totals[0][1] == BOUNDS["requests"][1]  # enough requests to keep it busy, within the tab's bound
    assert "measured surface" in heatmap.layout.title.text and heatmap.data[0].z[0][0] == pytest.approx(3.0)


def test_stop_ends_the_run_between_passes_and_keeps_the_totals(serving):
    state = ServingState()
    run = start(serving, state, requests=30, rate=2.0)
    next(run)  # reading the cost surface
    next(run)  # warming up
    next(run)  # first live view
    serving.stop(state)
    outputs = list(run)
    status, *_, totals = outputs[-1]
    assert "Stopped" in status and "so far" in status and not state.running
    assert [row[0] for row in totals] == ["fixed:1", "fixed:0.9", "adaptive"]  # they took turns: each one's totals


def test_the_time_limit_bounds_the_run(serving, monkeypatch):
    import mars_demo.ui.serving_tab as tab

    clock = iter(range(0, 10_000, 3))  # every monotonic() call: 3 s later
    monkeypatch.setattr(tab.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr("mars_demo.engine.serving.loop.time.monotonic", lambda: next(clock))
    outputs = list(start(serving, ServingState(), time_limit=5, requests=30, rate=1.0))
    assert "Time limit reached" in outputs[-1][0]


@pytest.mark.parametrize("change, message", [
    ({"rate": 0}, "Rate must be a number from 0.05 to 20"),
    ({"rate": -1}, "Rate must be a number from 0.05 to 20"),
    ({"rate": "fast"}, "Rate must be a number"),
    ({"requests": 1000}, "Requests must be a whole number from 1 to 60"),
    ({"requests": 2.5}, "Requests must be a whole number"),
    ({"time_limit": 9999}, "Time limit must be a whole number from 5 to 180"),
    ({"max_batch": 0}, "Max batch must be a whole number from 1 to 8"),
    ({"policies": [], "extra": ""}, "pick at least one policy"),
    ({"extra": "turbo"}, "unknown policy 'turbo'"),
    ({"extra": "fixed:1.0"}, "a policy is listed twice"),
    ({"extra": "fixed:3"}, "tau must be between 0 and 1"),
    ({"arrivals": "steady"}, "arrivals must be one of poisson, burst"),
])
def test_bad_values_get_a_clear_message(serving, change, message):
    with pytest.raises(gr.Error) as err:
        next(start(serving, ServingState(), **change))
    assert message.lower() in unescape(str(err.value)).lower()  # escaped for the browser


def test_bad_model_and_markup_are_refused_escaped(serving):
    with pytest.raises(gr.Error):
        next(start(serving, ServingState(), spec="bad<b>model</b>"))
    with pytest.raises(gr.Error) as err:
        next(start(serving, ServingState(), extra="<img src=x onerror=alert(1)>"))
    assert "<img" not in str(err.value) and "&lt;img" in str(err.value)


def test_exact_mode_serves_beside_the_tau_policies_and_gives_fixed_ones_text(serving):
    """The tab's "fixed:1.0@exact" choice: exact mode in the same run, taking turns with the others, lossless."""
    outputs = list(start(serving, ServingState(), policies=["fixed:1.0", "fixed:1.0@exact"]))
    status, *_, width, _, totals = outputs[-1]
    assert "Finished: 2 of 2 policies" in status
    assert [row[0] for row in totals] == ["fixed:1", "fixed:1@exact"]
    assert all(row[1] == 6 for row in totals) and totals[1][-1] == 1.0  # greedy AR's text in exact mode
    assert any(w and w > 1 for w in width.data[1].y)  # its passes verify drafts: wider than AR's


def test_settings_parse_within_bounds():
    config, limit = parse_settings(**{**GOOD, "extra": "ladder:0=1,2=0.8"})
    assert config.policies[-1] == "ladder:0=1,2=0.8" and limit == 60
    assert all(low < high for low, high, _ in BOUNDS.values())
