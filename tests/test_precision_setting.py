"""The app's compute-path setting (issue #15): checked as --precision is, the model cache keyed by
(spec, path), every handler that loads a model passing it, the memory guard counting it; tiny models."""

from __future__ import annotations

import dataclasses

import gradio as gr
import pytest

from mars_demo.engine.backends.cpu.paths import PRECISION_ENV, PRECISIONS, ComputePath, check_precision, convert
from mars_demo.engine.checkpoints import memory
from mars_demo.engine.checkpoints.loading import BUNDLED
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import generate
from mars_demo.engine.serving.loop import ServeConfig
from mars_demo.engine.serving.shared import SharedBatches
from mars_demo.ui.handlers import DemoHandlers
from mars_demo.ui.live_tab import LIVE_OUTPUTS, LiveHandlers, LiveState
from mars_demo.ui.models import ModelCache, ModelPolicy, default_compute_path, model_choices
from mars_demo.ui.outputs import MODEL_OUTPUTS, SWEEP_OUTPUTS, named
from mars_demo.ui.race import Session
from mars_demo.ui.serving_tab import ServingHandlers, ServingState

from conftest import make_lm

PROMPT = "Explain why the sky is blue."
POLICY = ModelPolicy(tuple(model_choices(False)), free=False)
BAD = "int4"


def race(handlers, session, precision, spec=BUNDLED, tau=0.9, max_new_tokens=8):
    return list(handlers.run(PROMPT, spec, tau, 4, max_new_tokens, "probability", 0.0, False, True, session,
                             "mars", precision))


def sweep(handlers, precision):
    return list(handlers.sweep([PROMPT], [0.5], 6, BUNDLED, 4, "probability", 0.0, False, precision))


def serve(handlers, precision):
    serving = ServingHandlers(handlers, chart_every=60.0)
    return list(serving.run("poisson", 20.0, ["fixed:1.0"], "", 2, 60, 2, 8, BUNDLED, ServingState(), precision))


def live_send(handlers, precision):
    live = LiveHandlers(handlers, SharedBatches(ServeConfig(max_batch=2, max_new_tokens=8), idle=5.0), poll=0.05)
    return list(live.send("Hello there.", BUNDLED, LiveState(), None, precision))  # None: the gr.Request


@pytest.fixture
def spy(tiny_qwen):
    """A loader that records (spec, precision) and gives the tiny model a ComputePath naming that path."""
    calls, guarded = [], []

    def loader(spec, precision=None):
        calls.append((spec, precision))
        path = "fp32" if precision in (None, "auto") else precision
        compute = ComputePath(path=path, requested=precision or "auto", costs_ms={1: 1.0, 2: 1.0 + len(calls)})
        return dataclasses.replace(tiny_qwen, compute=compute)

    def guard(spec, precision=None):
        guarded.append((spec, precision))

    handlers = DemoHandlers(loader, policy=POLICY, chart_every=60.0, stop_wait=1.0, guard=guard, gpu=False)
    handlers.calls, handlers.guarded = calls, guarded
    return handlers


def test_the_setting_is_checked_like_precision(spy, monkeypatch):
    monkeypatch.delenv(PRECISION_ENV, raising=False)
    with pytest.raises(ValueError) as expected:
        check_precision(BAD)
    for good in PRECISIONS:
        assert spy.compute_path(good) == good
    assert spy.compute_path(None) == "auto"  # the default: MARS_DEMO_PRECISION, else auto
    monkeypatch.setenv(PRECISION_ENV, "int8")
    assert spy.compute_path(None) == "int8"
    session = Session()
    with pytest.warns(UserWarning, match="precision must be one of"):
        *_, last = spy.show_model(BUNDLED, session, BAD)
    view = named(MODEL_OUTPUTS, last)
    assert str(expected.value) in view["model_line"].replace("&#x27;", "'") and 'class="model-status error"' in \
        view["model_line"]
    assert view["precision"] == "int8" and spy.calls == []  # the setting goes back; nothing loaded
    for handler in (lambda p: race(spy, Session(), p), lambda p: sweep(spy, p), lambda p: serve(spy, p),
                    lambda p: live_send(spy, p)):
        with pytest.raises(gr.Error, match="precision must be one of") as err:
            handler(BAD)
        assert err.value.title == "Bad setting"
    assert spy.calls == []
    list(spy.show_model(BUNDLED, session, "bf16"))  # the app keeps running: a good value serves
    assert spy.calls == [(BUNDLED, "bf16")] and session.precision == "bf16"


def test_markup_in_a_bad_value_is_shown_as_text(spy):
    with pytest.warns(UserWarning):
        *_, last = spy.show_model(BUNDLED, Session(), "<img src=x onerror=alert(1)>")
    line = named(MODEL_OUTPUTS, last)["model_line"]
    assert "<img" not in line and "&lt;img" in line


def test_the_first_value_comes_from_the_environment():
    assert default_compute_path({}) == ("auto", "")
    assert default_compute_path({PRECISION_ENV: "int8"}) == ("int8", "")
    value, problem = default_compute_path({PRECISION_ENV: "fp16"})
    assert value == "auto" and problem.startswith(PRECISION_ENV) and "fp16" in problem and "using auto" in problem


def test_the_cache_keeps_one_entry_per_spec_and_path():
    loads = []
    cache = ModelCache(lambda spec, precision=None: loads.append((spec, precision)) or object(), capacity=2)
    int8 = cache.get("a", "int8")
    fp32 = cache.get("a", "fp32")
    assert fp32 is not int8 and loads == [("a", "int8"), ("a", "fp32")]
    assert cache.get("a", "int8") is int8 and cache.get(" a ", "fp32") is fp32 and len(loads) == 2  # reused
    assert cache.entries() == [("a", "int8"), ("a", "fp32")] and cache.loaded() == ["a"]
    assert cache.has("a", "fp32") and not cache.has("a", "bf16")
    with cache.hold("a", "int8"), cache.hold("a", "fp32"):
        assert cache.in_use() == {"a": 2}
    cache.get("a", "bf16")  # a third path: the least recently used idle entry goes
    assert cache.entries() == [("a", "fp32"), ("a", "bf16")] and len(loads) == 3


def test_switching_the_path_loads_on_it_and_the_status_line_follows(spy):
    session = Session()
    first = [named(MODEL_OUTPUTS, o) for o in spy.show_model(BUNDLED, session, "int8")]
    assert "Loading" in first[0]["model_line"] and "compute path int8;" in first[-1]["model_line"]
    assert len(list(spy.show_model(BUNDLED, session, "int8"))) == 1  # same path: reused, no "Loading"
    *_, last = spy.show_model(BUNDLED, session, "fp32")
    line = named(MODEL_OUTPUTS, last)["model_line"]
    assert "compute path fp32;" in line and "int8" not in line
    *_, last = spy.show_model(BUNDLED, session, "auto")
    assert "compute path fp32 (auto);" in named(MODEL_OUTPUTS, last)["model_line"]
    assert spy.calls == [(BUNDLED, "int8"), (BUNDLED, "fp32"), (BUNDLED, "auto")]
    assert spy.guarded == spy.calls  # the memory guard is asked about each path before its load


def test_every_handler_that_loads_passes_the_path(spy):
    session = Session()
    race(spy, session, "bf16")
    assert spy.calls[-1] == (BUNDLED, "bf16") and session.trace.compute.startswith("bf16;")
    assert session.trace.to_json()["compute_path"] == session.trace.compute
    race(spy, Session(), "bf16")
    assert len(spy.calls) == 1  # the same path: the same model
    *_, last = sweep(spy, "int8")
    assert spy.calls[-1] == (BUNDLED, "int8") and named(SWEEP_OUTPUTS, last)["sweep_table"]
    outputs = serve(spy, "fp32")
    assert spy.calls[-1] == (BUNDLED, "fp32") and "Finished" in outputs[-1][0]
    *_, last = live_send(spy, "bf16")
    assert spy.calls[-1] == (BUNDLED, "bf16") and 'data-status="done"' in named(LIVE_OUTPUTS, last)["live_pane"]
    assert len(spy.calls) == 4  # one model in memory: bf16 went for int8, and came back for the live batch
    assert spy.guarded == spy.calls


def test_both_lanes_decode_on_the_chosen_path():
    """A real int8 conversion: at tau = 1.0 MARS equals AR on it, and both equal AR decoded on that model alone."""
    models = {}

    def loader(spec, precision=None):
        lm = make_lm("qwen2")
        convert(lm.model, precision)
        models[precision] = dataclasses.replace(lm, compute=ComputePath(path=precision, requested=precision))
        return models[precision]

    handlers = DemoHandlers(loader, policy=POLICY, chart_every=60.0, guard=None, gpu=False)
    session = Session()
    race(handlers, session, "int8", tau=1.0, max_new_tokens=12)
    assert list(models) == ["int8"]
    trace = session.trace
    mars = [t for s in trace.mars for t in s.token_ids]
    ar = [t for s in trace.ar for t in s.token_ids]
    ar_alone = generate(models["int8"], PROMPT, DecodeConfig(mode="ar", max_new_tokens=12))
    alone = [t for e in ar_alone for t in e.token_ids]
    assert mars == ar == alone and "int8" in trace.compute


def test_on_a_gpu_the_setting_is_not_used(spy):
    spy.on_gpu = True
    assert spy.compute_path("int8") is None and spy.compute_path(None) is None
    with pytest.raises(ValueError):
        spy.compute_path(BAD)  # still checked
    session = Session()
    list(spy.show_model(BUNDLED, session, "int8"))
    race(spy, session, "fp32")
    assert spy.calls == [(BUNDLED, None)]  # one model: the loader's own GPU dtype


def test_the_memory_guard_counts_the_path(tiny_llama, tmp_path, monkeypatch):
    folder = tmp_path / "tiny"
    tiny_llama.model.save_pretrained(folder)
    params = memory.parameter_count(str(folder))
    needed = {p: memory.needed_bytes(params, p) for p in PRECISIONS}
    assert needed["auto"] == max(needed.values()) and needed["fp32"] < needed["int8"]
    monkeypatch.setenv(memory.MARGIN_ENV, "0")
    room = (needed["fp32"] + needed["int8"]) // 2
    memory.check_fits(str(folder), available=room, precision="fp32")
    with pytest.raises(memory.ModelTooLarge):
        memory.check_fits(str(folder), available=room, precision="int8")
    monkeypatch.setenv(PRECISION_ENV, "fp32")  # no path given: the loader's default
    memory.check_fits(str(folder), available=room)
    assert memory.needed_bytes(params, "nonsense") == max(needed.values())


def test_the_app_wires_the_setting_into_every_loading_event(monkeypatch):
    import app

    monkeypatch.setenv(PRECISION_ENV, "bf16")
    demo = app.build_demo(lambda spec, precision=None: pytest.fail("no model is loaded while building"))
    setting = demo.components["precision"]
    assert setting.value == "bf16" and setting.interactive is not False and setting.allow_custom_value
    takes = {}
    for fn in demo.fns.values():
        name = getattr(fn.fn, "__name__", "")
        if name in ("show_model", "run", "sweep"):
            takes.setdefault(name, []).append(setting in fn.inputs)
    assert takes["show_model"] == [True, True, True] and all(takes["run"]) and takes["sweep"] == [True]
    # page load, picker, path, race, sweep, serving, live (send, enter)
    assert sum(setting in fn.inputs for fn in demo.fns.values()) == 6 + 2 * (demo.live is not None)
    monkeypatch.setattr(app.DemoHandlers, "__init__", _gpu_init(app.DemoHandlers.__init__))
    gpu_demo = app.build_demo(lambda spec, precision=None: pytest.fail("no load"))
    assert gpu_demo.components["precision"].interactive is False
    assert "GPU" in gpu_demo.components["precision"].info


def _gpu_init(init):
    def wrapped(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "gpu": True})

    return wrapped
