"""The app's handlers, driven directly with a tiny model: no server, no browser."""

from __future__ import annotations

import csv
import io
import json
import re
import threading
import time
from html import unescape
from pathlib import Path

import gradio as gr
import pytest
import torch

from mars_demo.engine.checkpoints.loading import BUNDLED, ModelLoadError
from mars_demo.engine.decoding.config import DecodeConfig, resolve_max_fed
from mars_demo.engine.decoding.loop import LiveTau, StepEvent, generate
from mars_demo.ui import charts
from mars_demo.ui.handlers import DemoHandlers
from mars_demo.ui.hosting import DecodeSlot
from mars_demo.ui.models import ModelCache, ModelPolicy, model_choices
from mars_demo.ui.outputs import MODEL_OUTPUTS, RACE_OUTPUTS, SWEEP_OUTPUTS, named
from mars_demo.ui.race import VIEW_EVERY, LaneCadence, RaceTrace, Session, interleave
from mars_demo.ui.render import ar_pane, mars_pane, model_message, model_status
from mars_demo.ui.sweep import SWEEP_COLUMNS

from conftest import make_lm, tiny_loader

PROMPT = "Explain why the sky is blue."
SETTINGS = {
    "spec": BUNDLED, "tau": 0.9, "block_size": 4, "max_new_tokens": 24, "metric": "probability", "temperature": 0.0,
    "full_window": False, "with_ar": True,
}


def is_skip(value) -> bool:
    return value == gr.skip()


@pytest.fixture
def handlers(tiny_qwen, tmp_path):
    loader = tiny_loader(tiny_qwen)
    # free text on, so "bad..." specs reach the loader; charts: first and last yield
    return DemoHandlers(loader, policy=ModelPolicy(tuple(model_choices(False)), free=True), chart_every=60.0,
                        trace_dir=tmp_path, stop_wait=1.0)


def start(handlers: DemoHandlers, session: Session, prompt: str = PROMPT, **changes):
    """The run handler's views, each as a dict by output name (its yields with nothing to draw left out: one
    per pass between two views, where a cancelled run ends)."""
    s = {**SETTINGS, **changes}
    run = handlers.run(prompt, s["spec"], s["tau"], s["block_size"], s["max_new_tokens"], s["metric"],
                       s["temperature"], s["full_window"], s["with_ar"], session)
    try:
        for values in run:
            if not all(is_skip(v) for v in values):
                yield named(RACE_OUTPUTS, values)
    finally:
        run.close()


def stop(handlers: DemoHandlers, session: Session) -> dict:
    return named(RACE_OUTPUTS, handlers.stop(session))


PLOTS = ("time_plot", "pass_plot", "hist_plot", "summary_plot")


def test_build_demo_loads_no_model():
    import app

    def loader(spec, precision=None):
        raise AssertionError("build_demo must not load a model")

    demo = app.build_demo(loader)
    assert isinstance(demo, gr.Blocks)
    assert demo.handlers.models.loaded() == []
    assert isinstance(app.demo, gr.Blocks) and app.demo.handlers.models.loaded() == []
    assert demo.handlers.view_every == VIEW_EVERY  # views by each side's clock (LaneCadence)


def test_run_streams_both_panes_pass_by_pass(handlers):
    session = Session()
    outputs = list(start(handlers, session))
    trace = session.trace
    assert trace.status == "done"
    assert trace.mars[-1].done and trace.ar[-1].done
    # one yield to reset, one per forward pass of either side, one to finish
    assert len(outputs) == 1 + len(trace.mars) + len(trace.ar) + 1
    streamed = outputs[1:-1]
    assert sum(not is_skip(o["mars_pane"]) for o in streamed) == len(trace.mars)
    assert sum(not is_skip(o["ar_pane"]) for o in streamed) == len(trace.ar)
    assert all(is_skip(o["mars_pane"]) != is_skip(o["ar_pane"]) for o in streamed)  # each yield is one side's pass
    final = outputs[-1]
    assert 'data-status="done"' in final["mars_pane"] and 'data-status="done"' in final["ar_pane"]
    assert final["mars_pane"].count('class="pass ') == len(trace.mars)
    assert all(final[name] is not None for name in PLOTS)
    json_path = final["json_file"]["value"]
    data = json.loads(Path(json_path).read_text(encoding="utf-8"))
    assert data["status"] == "done" and set(data["sides"]) == {"mars", "ar"}
    assert data["sides"]["mars"]["text"] == "".join(s.text for s in trace.mars)
    assert [p["pass"] for p in data["sides"]["ar"]["passes"]] == list(range(1, len(trace.ar) + 1))


def test_charts_refresh_while_the_run_streams(handlers):
    handlers.chart_every = 0.0
    session = Session()
    outputs = list(start(handlers, session, max_new_tokens=6))
    assert all(not is_skip(o["time_plot"]) for o in outputs)
    time_fig, pass_fig = outputs[2]["time_plot"], outputs[2]["pass_plot"]
    first = len(session.trace.mars[0].token_ids)
    assert [t.name for t in time_fig.data] == ["MARS", "AR"] and list(time_fig.data[0].y) == [0, first]
    assert list(pass_fig.data[1].y) == [0.9]


def test_passes_alternate_until_one_side_is_done(tiny_qwen):
    config = DecodeConfig(max_new_tokens=16, tau=0.0)
    ar = generate(tiny_qwen, PROMPT, config.with_(mode="ar"))
    order = [side for side, _ in interleave(generate(tiny_qwen, PROMPT, config), ar)]
    n_mars = order.count("mars")
    assert order[: 2 * n_mars] == ["mars", "ar"] * n_mars
    assert set(order[2 * n_mars :]) == {"ar"}  # MARS needs fewer passes; AR finishes alone


def test_ar_side_can_be_switched_off(handlers):
    session = Session()
    outputs = list(start(handlers, session, with_ar=False))
    assert session.trace.ar == [] and session.trace.steps("ar") is None
    assert "switched off" in outputs[-1]["ar_pane"]
    assert set(json.loads(Path(outputs[-1]["json_file"]["value"]).read_text())["sides"]) == {"mars"}


@pytest.mark.parametrize("full_window", [False, True])
def test_tau_set_mid_run_is_used_from_the_next_pass(handlers, full_window):
    session = Session()
    run = start(handlers, session, max_new_tokens=40, full_window=full_window)
    next(run)  # reset
    next(run)  # MARS pass 1
    next(run)  # AR pass 1
    handlers.set_tau(0.0, session)  # what the slider's change event does while the run streams
    list(run)
    mars = session.trace.mars
    assert mars[0].tau == 0.9
    assert all(s.tau == 0.0 for s in mars[1:])
    # at tau = 0 every candidate a pass offers is accepted: whole blocks. The tiny model has no
    # measured compute path, so "auto" (the checkbox off) sets no cap either.
    assert resolve_max_fed(DecodeConfig().max_fed, handlers_lm(handlers).compute) is None
    assert [len(s.token_ids) for s in mars[1:-1]] == [4] * (len(mars) - 2)
    assert session.trace.to_json()["sides"]["mars"]["passes"][1]["tau"] == 0.0


def handlers_lm(handlers):
    return handlers.models._loader(BUNDLED)


def test_two_sessions_keep_their_own_tau(handlers):
    handlers.slot = DecodeSlot(2)  # two runs decoding at once, as MARS_DEMO_CONCURRENCY=2 allows
    a, b = Session(), Session()
    run_a, run_b = start(handlers, a), start(handlers, b)
    next(run_a), next(run_b)
    next(run_a), next(run_b)
    handlers.set_tau(0.3, a)
    list(run_a), list(run_b)
    assert a.tau is not b.tau
    assert {s.tau for s in a.trace.mars[1:]} == {0.3}
    assert {s.tau for s in b.trace.mars} == {0.9}


def test_html_escapes_model_output():
    evil = ("<script>alert(1)</script>", '" onmouseover="alert(2)', "<img src=x onerror=alert(3)>", "&amp;")
    step = StepEvent(0, (1, 2, 3, 4), evil, (0.9, 0.8, 0.7, 0.6), 0.5, 0.01, None)
    for html in (mars_pane([step], "running"), ar_pane([step], "running")):
        assert "<script" not in html and "<img" not in html
        assert '" onmouseover' not in html
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
        assert "&amp;amp;" in html
    assert "<" not in model_message("<b>x</b>").split(">", 1)[1].rsplit("<", 1)[0]
    assert "&lt;|mask|&gt;" in model_status("m", 4, "<|mask|>", 1.0)


def test_prompt_with_markup_runs_and_is_kept_as_text(handlers):
    session = Session()
    prompt = "<script>alert('x')</script> Say hi"
    outputs = list(start(handlers, session, prompt=prompt, with_ar=False))
    assert json.loads(Path(outputs[-1]["json_file"]["value"]).read_text())["prompt"] == prompt
    assert "<script" not in outputs[-1]["mars_pane"]


def test_bad_input_gets_a_clear_message(handlers):
    with pytest.raises(gr.Error, match="Type a prompt"):
        next(start(handlers, Session(), prompt="   "))
    with pytest.raises(gr.Error, match="tau must be a number from 0 to 1"):
        next(start(handlers, Session(), tau=1.5))
    with pytest.raises(gr.Error, match="Could not load that model"):
        next(start(handlers, Session(), spec="bad<b>model</b>"))
    long_prompt = "the sky is blue " * 400  # far past the tiny model's 512 positions
    with pytest.raises(gr.Error, match="context"):
        list(start(handlers, Session(), prompt=long_prompt))


def test_error_messages_are_escaped(handlers):
    with pytest.raises(gr.Error) as err:
        next(start(handlers, Session(), metric="<img src=x onerror=alert(1)>"))
    assert "img" not in err.value.message and "metric must be one of probability" in err.value.message  # not echoed
    assert err.value.title == "Bad setting"


def test_failed_load_keeps_the_previous_model(handlers):
    session = Session()
    loading, done = (named(MODEL_OUTPUTS, o) for o in handlers.show_model(BUNDLED, session))
    assert "Loading smollm2-135m-mars" in loading["model_line"]
    assert "Serving" in done["model_line"] and done["block_size"] == 4
    assert len(list(handlers.show_model(BUNDLED, session))) == 1  # cached: no "Loading" flash
    with pytest.warns(UserWarning, match="Still serving"):
        *_, last = handlers.show_model("bad/<b>model</b>", session)
    status, picker, block = (named(MODEL_OUTPUTS, last)[name] for name in ("model_line", "model", "block_size"))
    assert "Could not load that model" in status and "bad/" not in status and "<b>" not in status  # never echoed
    assert "Still serving smollm2-135m-mars." in status and ".." not in status
    assert picker == BUNDLED and is_skip(block)
    assert session.spec == BUNDLED
    assert handlers.models.loaded() == [BUNDLED]
    outputs = list(start(handlers, session, with_ar=False))  # still serving
    assert session.trace.status == "done" and outputs


def test_stop_shows_and_saves_the_partial_run(handlers):
    session = Session()
    run = start(handlers, session, max_new_tokens=40)
    for _ in range(5):
        next(run)
    run.close()  # what Gradio's cancel does to the generator
    outputs = stop(handlers, session)
    assert session.trace.status == "stopped"
    assert 'data-status="stopped"' in outputs["mars_pane"]
    data = json.loads(Path(outputs["json_file"]["value"]).read_text())
    assert data["status"] == "stopped"
    assert len(data["sides"]["mars"]["passes"]) == 2 and len(data["sides"]["ar"]["passes"]) == 2
    assert all(is_skip(o) for o in stop(handlers, session).values())  # a second Stop does nothing
    import app

    forget_session, _ = app.session_cleanup(handlers.traces)
    forget_session(session)  # gr.State's delete callback
    assert not any(handlers.traces.directory.glob(f"*{session.id}*"))


def test_stop_during_a_pass_ends_the_run_without_another_yield(handlers):
    session = Session()
    run = start(handlers, session, max_new_tokens=40)
    for _ in range(3):
        next(run)
    # Stop's handler runs while Gradio is inside next(): the pass finishes, nothing more is yielded
    results = {}
    stopper = threading.Thread(target=lambda: results.setdefault("out", stop(handlers, session)))
    stopper.start()
    time.sleep(0.2)  # stop() is now waiting for the run to end
    assert list(run) == []
    stopper.join()
    assert session.trace.ended.is_set()
    assert 'data-status="stopped"' in results["out"]["mars_pane"]
    assert len(session.trace.mars) == 1 and len(session.trace.ar) == 1


def test_trace_csv_round_trips_token_texts(tmp_path):
    pieces = ('He said, "hi"', "\n", " a,b ")
    step = StepEvent(0, (5, 6, 7), pieces, (0.5, 0.25, 0.125), 0.7, 0.01, None)
    trace = RaceTrace(prompt="p", model="m", config=DecodeConfig(), mars=[step], ar=[step])
    json_path, csv_path = trace.write(tmp_path, "t")
    rows = list(csv.DictReader(io.StringIO(csv_path.read_text(encoding="utf-8"))))
    assert [r["side"] for r in rows] == ["mars", "ar"]
    assert tuple(json.loads(rows[0]["token_texts"])) == pieces
    assert json.loads(rows[0]["token_ids"]) == [5, 6, 7]
    assert float(rows[0]["tau"]) == 0.7 and rows[0]["pass"] == "1" and rows[0]["tokens"] == "3"
    data = json.loads(json_path.read_text(encoding="utf-8"))
    assert data["sides"]["mars"]["passes"][0]["token_texts"] == list(pieces)
    assert data["config"]["tau"] == 0.9


def test_sweep_handler_yields_the_frontier(handlers):
    every = [named(SWEEP_OUTPUTS, o)
             for o in handlers.sweep([PROMPT, "Count: one, two"], [0.5], 10, BUNDLED, 4, "probability", 0.0)]
    outputs = [o for o in every if not all(is_skip(v) for v in o.values())]  # the rest: one per pass, nothing drawn
    assert len(outputs) == 8 and len(every) > 8  # one update per run (AR, exact, tau 1.0, tau 0.5 for each prompt)
    assert [is_skip(o["sweep_plot"]) for o in outputs] == [True] * 3 + [False] + [True] * 3 + [False]  # per prompt
    status, fig, table = (outputs[-1][name] for name in SWEEP_OUTPUTS)
    assert "Sweep finished: 2 of 2 prompts, 8 of 8 runs" in status
    assert [row[0] for row in table] == ["exact", 1.0, 0.5]  # exact mode's row, whatever the sidebar's mode
    assert table[0][1] == 2 and table[0][5] == 1.0  # exact mode's output is AR's, measured on both prompts
    assert table[1][5] == 1.0  # tau = 1.0 agrees with itself
    assert [t.name for t in fig.data] == ["MARS", "exact"] * 2
    assert list(fig.data[1].text) == ["exact"] and list(fig.data[1].x) == [1.0]
    rendered = gr.Dataframe(headers=SWEEP_COLUMNS).postprocess(table)  # the table as the browser gets it
    assert rendered.data[0][0] == "exact" and rendered.headers == SWEEP_COLUMNS
    with pytest.raises(gr.Error, match="at least one prompt"):
        next(handlers.sweep([], [0.5], 10, BUNDLED, 4, "probability", 0.0))


def test_model_cache_keeps_one_model_and_survives_failures():
    calls = []

    def loader(spec, precision=None):
        calls.append(spec)
        time.sleep(0.05)
        if spec == "bad":
            raise ModelLoadError("no such model")
        return object()

    cache = ModelCache(loader, capacity=1)
    threads = [threading.Thread(target=cache.get, args=("a",)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["a"]  # concurrent sessions share one load
    first = cache.get("a")
    with pytest.raises(ModelLoadError):
        cache.get("bad")
    assert cache.loaded() == ["a"] and cache.get("a") is first
    cache.get("b")
    assert cache.loaded() == ["b"]


def test_model_cache_serves_the_loaded_model_while_another_loads():
    release = threading.Event()

    def loader(spec, precision=None):
        if spec == "slow":
            release.wait(5)
        return spec

    cache = ModelCache(loader, capacity=1)
    cache.get("a")
    slow = threading.Thread(target=cache.get, args=("slow",))
    slow.start()
    time.sleep(0.1)
    started = time.monotonic()
    assert cache.get("a") == "a"  # not stuck behind the slow load
    assert time.monotonic() - started < 1.0
    release.set()
    slow.join()
    assert cache.loaded() == ["slow"]


def test_model_choices_list_bundled_first():
    online = [spec for _, spec in model_choices(online=True)]
    assert online[0] == BUNDLED and any("MARS-Qwen2.5-0.5B-blk4" in s for s in online)
    assert all("Xalphinions" not in spec for _, spec in model_choices(online=False))


def test_session_state_is_per_session():
    a, b = Session(), Session()
    assert isinstance(a.tau, LiveTau) and a.tau is not b.tau and a.id != b.id
    assert a.tau.get() == DecodeConfig().tau


def test_exact_mode_races_ar_with_the_same_text_and_marks_verified_drafts(handlers):
    session = Session()
    s = SETTINGS
    outputs = list(handlers.run(PROMPT, s["spec"], 1.0, s["block_size"], s["max_new_tokens"], s["metric"],
                                0.0, s["full_window"], True, session, "exact"))
    trace = session.trace
    assert trace.config.mode == "exact"
    assert [t for e in trace.mars for t in e.token_ids] == [t for e in trace.ar for t in e.token_ids]
    final = named(RACE_OUTPUTS, outputs[-1])
    assert "Exact (verified)" in final["mars_pane"]
    summary = final["summary_plot"].data[0].cells.values
    assert "(identical)" in summary[1][summary[0].index("same tokens as AR")]
    evil = ("<script>", "x", '"y')
    step = StepEvent(0, (1, 2, 3), evil, (0.9, 0.8, 0.7), 1.0, 0.01, None, ("draft", "draft", "ar"))
    html = mars_pane([step], "running", None, "exact")
    assert "<script" not in html and html.count('class="tok draft" data-tip') == 2
    assert "draft verified by the AR head" in html and "the AR head&#x27;s token" in html


def test_a_sampled_race_seeds_its_lanes_apart_and_reports_nll(handlers):
    """Sampled, the lanes draw from seeds one apart (in the trace), every token says where it came from, and
    the summary gives each side's NLL under the model where a greedy race says how many tokens agree."""
    session, s = Session(), SETTINGS
    outputs = list(handlers.run(PROMPT, s["spec"], 1.0, s["block_size"], 16, s["metric"], 0.8, False, True,
                                session, "exact", None, 0.9, 20))
    trace = session.trace
    assert trace.config.temperature == 0.8 and trace.config.top_p == 0.9 and trace.config.top_k == 20
    assert trace.config.seed is not None and trace.ar_seed == trace.config.seed + 1
    assert set(trace.nll) == {"mars", "ar"} and all(v > 0 for v in trace.nll.values())
    final = named(RACE_OUTPUTS, outputs[-1])
    summary = final["summary_plot"].data[0].cells.values
    assert "same tokens as AR" not in summary[0]
    row = summary[0].index("NLL / token under the model")
    assert summary[1][row] == f"{trace.nll['mars']:.3f}" and summary[2][row] == f"{trace.nll['ar']:.3f}"
    saved = json.loads(Path(final["json_file"]["value"]).read_text())
    assert saved["ar_seed"] == trace.ar_seed and saved["config"]["top_p"] == 0.9
    assert saved["sides"]["mars"]["nll_per_token"] == round(trace.nll["mars"], 5)
    origins = [o for p in saved["sides"]["mars"]["passes"] for o in p["origins"]]
    assert len(origins) == saved["sides"]["mars"]["tokens"] and set(origins) <= {"ar", "draft", "resampled", "bonus"}
    rows = list(csv.DictReader(io.StringIO(Path(final["csv_file"]["value"]).read_text())))
    assert all(len(json.loads(r["origins"])) == int(r["tokens"]) for r in rows)
    step = StepEvent(0, (1, 2), ("<img src=x>", "x"), (0.9, 0.8), 1.0, 0.01, None, ("resampled", "bonus"))
    html = mars_pane([step], "running", None, "exact")
    assert "<img" not in html and "drawn again after the AR head rejected a draft" in html and "bonus:" in html


@pytest.mark.parametrize("top_p, top_k, message", [
    (0.0, 0, "top-p"), (1.5, 0, "Top-p"), (float("nan"), 0, "Top-p"), ("abc", 0, "Top-p"), (0.9, -1, "Top-k"),
    (0.9, 2.5, "Top-k"), (0.9, float("nan"), "Top-k"), (0.9, "<script>", "Top-k"),
])
def test_bad_sampling_settings_get_a_clear_message(handlers, top_p, top_k, message):
    s = SETTINGS
    with pytest.raises(gr.Error, match=message) as caught:
        next(handlers.run(PROMPT, s["spec"], 0.9, 4, 8, s["metric"], 0.7, False, True, Session(), "mars", None,
                          top_p, top_k))
    assert "<script>" not in str(caught.value)


def test_views_land_on_each_side_in_proportion_to_its_decoding_time():
    cadence = LaneCadence(1 / 8)
    landed = {"mars": 0, "ar": 0}
    for _ in range(1000):  # MARS passes of 1/16 s and AR passes of 1/32 s, alternating
        landed["ar"] += cadence.after("mars", 1 / 16, "ar")
        landed["mars"] += cadence.after("ar", 1 / 32, "mars")
    # one view per 1/8 s of each side's own decoding: 62.5 s of MARS, 31.25 s of AR (the view owed
    # for AR's last four passes would land on a 1001st AR pass)
    assert landed == {"mars": 500, "ar": 249}
    assert all(LaneCadence(0.0).after("mars", 0.01, side) for side in ("ar", "mars", None))  # 0: every pass
    assert not LaneCadence(0.1).after("mars", 1.0, None)  # the last pass: the final view follows


def test_the_first_view_is_drawn_before_the_first_pass_off_both_clocks(handlers, monkeypatch):
    log = []

    def logged(mars, ar):
        for item in interleave(mars, ar):
            log.append(item[0])
            yield item

    monkeypatch.setattr("mars_demo.ui.handlers.interleave", logged)
    monkeypatch.setattr("mars_demo.ui.handlers.time.sleep", lambda seconds: log.append(f"settle {seconds}"))
    handlers.view_every, handlers.view_settle = 10.0, 0.25  # views: the first and the final one
    outputs = list(start(handlers, Session()))
    # without the wait the browser would draw the emptied panes and charts during MARS's prefill
    assert len(outputs) == 2 and log[:3] == ["settle 0.25", "mars", "ar"]
    assert log.count("settle 0.25") == 1


def test_a_view_carries_every_pane_that_changed_since_the_last(handlers):
    handlers.view_every = 1e-9  # a view before every pass of a side that has decoded since its last view
    session = Session()
    outputs = list(start(handlers, session))
    trace = session.trace
    first = outputs[1]  # after MARS's first pass AR had not decoded yet: the first view follows AR's first pass
    assert 'data-passes="1"' in first["mars_pane"] and 'data-passes="1"' in first["ar_pane"]
    assert len(outputs) == 1 + len(trace.mars) + len(trace.ar) - 1
    handlers.view_every = 10.0  # longer than the whole race: no view until the final one
    outputs = list(start(handlers, session))
    assert len(outputs) == 2 and f'data-passes="{len(session.trace.mars)}"' in outputs[-1]["mars_pane"]
    assert 'data-status="done"' in outputs[-1]["ar_pane"]


@pytest.fixture(scope="module")
def drafty_handlers(tmp_path_factory):
    """Handlers over a tiny qwen2 whose LM head leans towards four tokens, so that the masks' second and third
    candidates hold now and then (as in test_trees.py) and a tree run commits nodes off the main path."""
    lm = make_lm("qwen2")
    bias = torch.zeros(lm.model.config.vocab_size)
    bias[[50, 60, 70, 80]] = 7.0
    lm.model.lm_head.bias = torch.nn.Parameter(bias)
    return DemoHandlers(tiny_loader(lm), policy=ModelPolicy(tuple(model_choices(False)), free=True), chart_every=60.0,
                        trace_dir=tmp_path_factory.mktemp("traces"), stop_wait=1.0)


def tree_race(handlers: DemoHandlers, session: Session, tree, mode: str = "exact", temperature: float = 0.0) -> dict:
    """A whole race with the sidebar's candidate-tree setting; its final view by name."""
    s = SETTINGS
    views = handlers.run(PROMPT, s["spec"], 1.0, 4, s["max_new_tokens"], s["metric"], temperature, False, True,
                         session, mode, None, 1.0, 0, tree)
    return named(RACE_OUTPUTS, list(views)[-1])


def tips(pane: str) -> list[str]:
    """The hover text of every token with text in a pane, in order, unescaped."""
    return [unescape(t) for t in re.findall(r'class="tok[^"]*" data-tip="([^"]*)"', pane)]


def test_tree_hover_text_names_the_branch_and_stays_escaped():
    evil = ("<script>", '" onmouseover="x', "<i>", "&")
    side = StepEvent(3, (1, 2, 3, 4), evil, (0.9,) * 4, 1.0, 0.01, None, ("draft",) * 3 + ("ar",), 4, (1, 0, 2, -1),
                     (3, 3, 3))
    main = StepEvent(4, (5, 6), ("a", "b"), (0.9, 0.8), 1.0, 0.01, None, ("draft", "bonus"), 3, (0, -1), (2, 1))
    pane = mars_pane([side, main], "running", None, "exact")
    assert "<script" not in pane and "<i>" not in pane and '" onmouseover' not in pane and "&lt;i&gt;" in pane
    shown = tips(pane)
    assert shown[0].startswith("pass 4 (4 tokens) · confidence 0.900 · tau 1.00 · draft verified by the AR head · ")
    assert [tip.split(" · ")[-1] for tip in shown] == [
        "tree: candidate 2 of its position (depth 1, a side branch)",
        "tree: candidate 1 of its position (depth 2, under a side branch)",
        "tree: candidate 3 of its position (depth 3, a side branch)",
        "the AR head's token",
        "tree: main path (the top candidate at depth 1)",
        "bonus: drawn from the AR head, every draft kept",
    ]
    chain = StepEvent(0, (1,), ("a",), (0.9,), 1.0, 0.01, None, ("draft",), 2, (), (1,))  # a chain: no tree hover
    assert "tree:" not in mars_pane([chain], "running", None, "exact")


def test_a_tree_race_names_each_verified_tokens_branch_on_hover(drafty_handlers):
    """Issue #37: the setting reaches DecodeConfig.tree, the text is AR's, and hovering a token the tree verified
    names its branch: the main path, or which candidate of its position (and at which depth) it was."""
    session = Session()
    final = tree_race(drafty_handlers, session, "3,2,1")
    trace = session.trace
    assert trace.config.tree == "3,2,1" and trace.status == "done"
    assert [t for e in trace.mars for t in e.token_ids] == [t for e in trace.ar for t in e.token_ids]
    tokens = [(s, i) for s in trace.mars for i, piece in enumerate(s.pieces) if piece]
    shown = tips(final["mars_pane"])
    assert len(shown) == len(tokens)
    side = 0
    for (step, i), tip in zip(tokens, shown):
        rank = step.branches[i]
        if rank < 0:
            assert "tree:" not in tip
        elif all(b == 0 for b in step.branches[: i + 1]):
            assert f"tree: main path (the top candidate at depth {i + 1})" in tip
        else:
            side += rank > 0
            assert f"tree: candidate {rank + 1} of its position (depth {i + 1}, " in tip
            assert "draft verified by the AR head" in tip
    assert side, "no token of this run came from a side branch: the test would not see its hover text"
    plot = final["tree_plot"]
    assert plot["visible"] is True
    bars = plot["value"].data[0]
    assert list(bars.x) == [s.index + 1 for s in trace.mars]
    assert list(bars.customdata) == [charts.shape_text(s.shape) for s in trace.mars]
    assert "3,2,1" in bars.customdata
    summary = final["summary_plot"].data[0].cells.values
    cell = summary[1][summary[0].index(charts.tree_label("3,2,1"))].split("<br>")
    assert cell[0] == "{} {:.0f}%".format(*charts.tree_shares(trace.mars)[0]) and len(cell) >= 2
    saved = json.loads(Path(final["json_file"]["value"]).read_text())
    assert [p["shape"] for p in saved["sides"]["mars"]["passes"]] == [list(s.shape) for s in trace.mars]


@pytest.mark.parametrize("value, tree", [("auto", "auto"), (" 2, 1 ", "2,1"), ("chain", None), (None, None)])
def test_the_tree_setting_reaches_exact_runs_and_no_other(drafty_handlers, value, tree):
    session = Session()
    final = tree_race(drafty_handlers, session, value)
    assert session.trace.config.tree == tree
    assert final["tree_plot"]["visible"] is True  # exact mode: a chain's passes have shapes too
    labels = final["summary_plot"].data[0].cells.values[0]
    assert (tree is not None and charts.tree_label(tree) in labels) or (tree is None and len(labels) == 8)
    mars = Session()
    final = tree_race(drafty_handlers, mars, value, mode="mars")
    assert mars.trace.config.tree is None and final["tree_plot"]["visible"] is False


@pytest.mark.parametrize("value", ["4,1", "0", "2,,1", "1," * 20, "2,1,1" * 30, "<script>alert(1)</script>", 3,
                                   ["2", "1"]])
def test_a_bad_tree_setting_gets_one_clear_message(drafty_handlers, value):
    with pytest.raises(gr.Error, match="Candidate tree must be chain, auto or a shape such as 2,1,1") as caught:
        tree_race(drafty_handlers, Session(), value)
    assert caught.value.title == "Bad setting" and "script" not in caught.value.message
    session = Session()  # the app keeps serving
    tree_race(drafty_handlers, session, "2,1,1")
    assert session.trace.status == "done"


def test_hybrid_at_a_temperature_refuses_a_tree_with_a_message(drafty_handlers):
    with pytest.raises(gr.Error, match="exact mode only") as caught:
        tree_race(drafty_handlers, Session(), "2,1,1", mode="hybrid", temperature=0.7)
    assert caught.value.title == "Bad setting"
