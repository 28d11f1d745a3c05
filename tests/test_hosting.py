"""Safe to host: page loads copy no model, the model policy, models in use stay, traces are bounded, messages.

A tiny model stands in for the real one; the last test serves the app on a free
localhost port and drives it through gradio_client, as an API visitor would.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import socket
import time
import types
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest
import torch

import app
from mars_demo.engine.checkpoints.loading import BUNDLED, BUNDLED_BASE, RELEASED, ModelLoadError
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.ui.examples import EXAMPLE_PROMPTS
from mars_demo.ui.handlers import BUSY, DemoHandlers
from mars_demo.ui.messages import error, for_client, is_api, sentence
from mars_demo.ui.models import ModelBusy, ModelCache, ModelPolicy, ModelRefused, decoding_threads, model_choices
from mars_demo.ui.outputs import MODEL_OUTPUTS, RACE_OUTPUTS, named
from mars_demo.ui.race import RaceTrace, Session
from mars_demo.ui.traces import TraceStore, stem

PROMPT = "Explain why the sky is blue."
CLOSED = ModelPolicy(tuple(model_choices(False)), free=False)
FREE = ModelPolicy(tuple(model_choices(False)), free=True)
# What a visitor might type: files, a directory, a missing path, /proc, a hub id, markup.
PROBES = ["/etc/passwd", "/etc", "/no/such/path", "/proc/self/environ", "../../etc/shadow", "someone/some-model",
          "<img src=x onerror=alert(1)>", " " + "x" * 600]
BROWSER = SimpleNamespace(headers={"sec-fetch-mode": "cors", "user-agent": "Chromium"}, session_hash="tab1")
API = SimpleNamespace(headers={"x-gradio-user": "api"}, session_hash="api1")


def settings(**changes) -> list:
    s = {"spec": BUNDLED, "tau": 0.9, "block_size": 4, "max_new_tokens": 8, "metric": "probability", "temperature": 0.0,
             "full_window": False, "with_ar": True} | changes
    return list(s.values())


@pytest.fixture
def spy_loader(tiny_qwen):
    calls = []

    def loader(spec, precision=None):
        calls.append(spec)
        if spec != BUNDLED and spec != BUNDLED_BASE:
            raise ModelLoadError(f"{spec} is not a valid JSON file: Expecting value: line 1 column 1 (char 0)")
        return tiny_qwen

    loader.calls = calls
    return loader


# -- page loads ------------------------------------------------------------------------------
ATOMIC = (types.FunctionType, types.BuiltinFunctionType, type, types.ModuleType, str, bytes, int, float)


def copied_by_deepcopy(root) -> set[int]:
    """Ids of the objects copy.deepcopy(root) would copy: functions, classes and modules are atomic
    to it, a bound method copies its object, anything else its contents."""
    seen, stack = set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, ATOMIC):
            continue
        seen.add(id(obj))
        stack.extend([obj.__self__] if isinstance(obj, types.MethodType) else gc.get_referents(obj))
    return seen


def test_page_config_does_not_reach_a_loaded_model(tiny_qwen, tmp_path):
    """Gradio deep-copies this config per GET / and GET /config: the copy must not take the model with it."""
    demo = app.build_demo(lambda spec, precision=None: tiny_qwen, traces=TraceStore(tmp_path))
    demo.handlers.models.get(BUNDLED)
    tensors = {id(t) for t in [*tiny_qwen.model.parameters(), *tiny_qwen.model.buffers()]}
    for config in (demo.get_config_file(), demo.config):
        reached = copied_by_deepcopy(config)
        assert id(tiny_qwen.model) not in reached and id(demo.handlers) not in reached
        assert not tensors & reached
        memo: dict = {}
        copy.deepcopy(config, memo)  # plain deepcopy works (Gradio's safe_deepcopy needs no fallback)
        assert not any(isinstance(v, torch.Tensor) for v in memo.values())


# -- the model policy ------------------------------------------------------------------------
def test_a_refused_spec_opens_nothing_and_gets_one_message(spy_loader, tmp_path):
    handlers = DemoHandlers(spy_loader, policy=CLOSED, trace_dir=tmp_path)
    messages = set()
    for spec in PROBES:
        session = Session()
        with pytest.warns(UserWarning, match="Still serving"):
            *_, last = handlers.show_model(spec, session)
        status, picker = named(MODEL_OUTPUTS, last)["model_line"], named(MODEL_OUTPUTS, last)["model"]
        messages.add(status)
        assert picker == BUNDLED and session.spec == BUNDLED
        with pytest.raises(gr.Error) as err:
            next(handlers.run(PROMPT, *settings(spec=spec), session))
        messages.add(err.value.message)
        assert err.value.title == "Model not loaded"
        with pytest.raises(gr.Error) as err:
            next(handlers.sweep([PROMPT], [0.5], 8, spec, 4, "probability", 0.0))
        messages.add(err.value.message)
    assert spy_loader.calls == []  # nothing was opened to decide
    assert len({m for m in messages if "model-status" in m}) == 1 and len(messages) == 2  # status line + toast
    assert all("passwd" not in m and "JSON" not in m and "exist" not in m for m in messages)
    # the known models are served
    last = named(MODEL_OUTPUTS, list(handlers.show_model(BUNDLED_BASE, Session()))[-1])
    assert last["model_line"].startswith('<div class="model-status ok">')


def test_load_failures_read_the_same_whatever_the_spec(spy_loader, tmp_path):
    """With free text on, the loader runs; its error (a file's type, a JSON error) stays in the server log."""
    handlers = DemoHandlers(spy_loader, policy=FREE, trace_dir=tmp_path)
    messages = set()
    for spec in PROBES:
        with pytest.raises(gr.Error) as err:
            next(handlers.run(PROMPT, *settings(spec=spec), Session(), request=API))
        messages.add(err.value.message)
    assert messages == {FREE.refusal} and "JSON" not in FREE.refusal
    # a 600-character spec is refused unopened; a hub id with the hub out of reach (HF_HUB_OFFLINE) fails at once
    assert spy_loader.calls == [p for p in PROBES[:-1] if p != "someone/some-model"]


def test_policy_from_the_environment():
    local = ModelPolicy.from_env({"HF_HUB_OFFLINE": "1"})
    assert local.free and local.specs == (BUNDLED, BUNDLED_BASE)
    assert not ModelPolicy.from_env({"SPACE_ID": "me/mars"}).free
    assert not ModelPolicy.from_env({"GRADIO_SERVER_NAME": "0.0.0.0"}).free
    assert ModelPolicy.from_env({"GRADIO_SERVER_NAME": "127.0.0.1"}).free
    assert ModelPolicy.from_env({"SPACE_ID": "me/mars", "MARS_DEMO_ANY_MODEL": "1"}).free
    assert not ModelPolicy.from_env({"MARS_DEMO_ANY_MODEL": "0"}).free
    hosted = ModelPolicy.from_env({"SPACE_ID": "me/mars", "MARS_DEMO_EXTRA_MODELS": " me/ckpt-a, ,me/ckpt-b "})
    assert hosted.specs == (BUNDLED, BUNDLED_BASE, *RELEASED, "me/ckpt-a", "me/ckpt-b")
    assert hosted.check(" me/ckpt-b ") == "me/ckpt-b" and hosted.check("") == BUNDLED
    with pytest.raises(ModelRefused) as err:
        hosted.check("me/ckpt-c")
    assert str(err.value) == hosted.refusal


def test_decoding_threads_leave_a_local_browser_a_core():
    local = {"GRADIO_SERVER_NAME": "127.0.0.1"}
    assert decoding_threads(local, threads=2, gpu=False) == (1, "")
    assert decoding_threads({}, threads=8, gpu=False) == (7, "")
    assert decoding_threads(local, threads=1, gpu=False) == (None, "")  # one core: nothing to leave
    for hosted in ({"SPACE_ID": "me/mars"}, {"GRADIO_SERVER_NAME": "0.0.0.0"}):
        assert decoding_threads(hosted, threads=8, gpu=False) == (None, "")  # the browser is elsewhere
    assert decoding_threads(local, threads=8, gpu=True) == (None, "")
    assert decoding_threads({**local, "OMP_NUM_THREADS": "8"}, threads=8, gpu=False) == (None, "")
    assert decoding_threads({"SPACE_ID": "me/mars", "MARS_DEMO_THREADS": "3"}, threads=8, gpu=False) == (3, "")
    assert decoding_threads({"MARS_DEMO_THREADS": " Auto "}, threads=4, gpu=False) == (3, "")
    for bad in ("0", "-2", "two", "1.5"):
        threads, note = decoding_threads({"MARS_DEMO_THREADS": bad}, threads=4, gpu=False)
        assert threads == 3 and note.startswith("MARS_DEMO_THREADS must be auto or a number") and repr(bad) in note


# -- models in use stay ----------------------------------------------------------------------
def test_a_model_in_use_is_never_dropped():
    loads = []
    cache = ModelCache(lambda spec, precision=None: loads.append(spec) or object(), capacity=1)
    with cache.hold("a") as a:
        with pytest.raises(ModelBusy):
            cache.get("b")  # refused before loading: no second model in memory
        assert loads == ["a"] and cache.loaded() == ["a"] and cache.in_use() == {"a": 1}
        with cache.hold("a") as again:  # another run on the same model shares it
            assert again is a and cache.in_use() == {"a": 2}
    assert cache.in_use() == {}
    cache.get("b")  # nobody uses a now: it is dropped for b
    assert cache.loaded() == ["b"] and loads == ["a", "b"]


def test_a_run_keeps_its_model_while_another_session_asks_for_another(spy_loader, tmp_path):
    handlers = DemoHandlers(spy_loader, policy=CLOSED, trace_dir=tmp_path)
    a = Session()
    run = handlers.run(PROMPT, *settings(max_new_tokens=16), a)
    next(run), next(run)  # a's run is decoding with the bundled model
    with pytest.warns(UserWarning, match="in use by other visitors"):
        *_, last = handlers.show_model(BUNDLED_BASE, Session())
    status, picker = named(MODEL_OUTPUTS, last)["model_line"], named(MODEL_OUTPUTS, last)["model"]
    assert "in use by other visitors" in BUSY and "in use by other visitors" in status and picker == BUNDLED
    assert handlers.models.loaded() == [BUNDLED]
    list(run)
    assert a.trace.status == "done" and handlers.models.in_use() == {}
    list(handlers.show_model(BUNDLED_BASE, Session()))  # free now
    assert handlers.models.loaded() == [BUNDLED_BASE]


def test_a_cancelled_run_lets_go_of_its_model(spy_loader, tmp_path):
    handlers = DemoHandlers(spy_loader, policy=CLOSED, trace_dir=tmp_path)
    run = handlers.run(PROMPT, *settings(max_new_tokens=16), Session())
    next(run)
    assert handlers.models.in_use() == {BUNDLED: 1}
    run.close()  # what Gradio's cancel does
    assert handlers.models.in_use() == {}


# -- traces ----------------------------------------------------------------------------------
def small_trace() -> RaceTrace:
    return RaceTrace(prompt="p", model="m", config=DecodeConfig())


def test_trace_folder_is_bounded_by_count_and_age(tmp_path):
    store = TraceStore(tmp_path, max_files=6, max_age=60)
    for i in range(10):
        store.write(small_trace(), stem(f"s{i}"))
        assert len(store.files()) <= 6
    assert {p.stem for p in store.files()} == {stem("s7"), stem("s8"), stem("s9")}  # the newest pairs
    old = time.time() - 120
    for path in store.files()[:4]:
        os.utime(path, (old, old))
    store.prune()
    assert len(store.files()) == 2


def test_closing_the_tab_removes_its_traces(spy_loader, tmp_path):
    handlers = DemoHandlers(spy_loader, policy=CLOSED, traces=TraceStore(tmp_path))
    forget_session, forget_tab = app.session_cleanup(handlers.traces)
    tab, other = Session(), Session()
    final = named(RACE_OUTPUTS, list(handlers.run(PROMPT, *settings(), tab, request=BROWSER))[-1])
    list(handlers.run(PROMPT, *settings(), other, request=API))
    assert json.loads(Path(final["json_file"]["value"]).read_text())["status"] == "done"
    assert len(handlers.traces.files()) == 4
    forget_tab(BROWSER)  # the unload event
    assert {p.stem for p in handlers.traces.files()} == {stem(other.id)}
    forget_session(other)  # gr.State's delete callback
    assert handlers.traces.files() == []


# -- messages --------------------------------------------------------------------------------
def test_messages_plain_for_api_escaped_for_the_browser():
    text = sentence("Cannot decode this prompt: it is past this model's context of 512 tokens.")
    assert text == "Cannot decode this prompt: it is past this model's context of 512 tokens."
    assert sentence("Could not load.", "Still serving x") == "Could not load. Still serving x."
    assert for_client(text, API) == text
    assert for_client("<b>", BROWSER) == "&lt;b&gt;" and for_client("it's", BROWSER) == "it&#x27;s"
    assert for_client("<b>", None) == "&lt;b&gt;"  # no request: the safe side
    assert is_api(SimpleNamespace(headers={})) and not is_api(BROWSER)
    err = error("a <b>", "My title", API)
    assert err.message == "a <b>" and err.title == "My title"


# -- served, through the API ---------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_served_app_through_the_api(spy_loader, tmp_path, monkeypatch):
    import httpx
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    demo = app.build_demo(spy_loader, policy=CLOSED, traces=TraceStore(tmp_path / "traces"))
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        client = Client(url, verbose=False, download_files=str(tmp_path / "downloads"))
        assert spy_loader.calls == []
        result = client.predict(PROMPT, *settings(tau=0.7), api_name="/run")
        trace = json.loads(Path(named(RACE_OUTPUTS, result)["json_file"]["value"]).read_text())
        assert trace["status"] == "done" and {p["tau"] for p in trace["sides"]["mars"]["passes"]} == {0.7}
        # a page load with the model in memory copies no model: it is quick
        started = time.perf_counter()
        assert httpx.get(url + "config", timeout=10).status_code == 200
        assert time.perf_counter() - started < 1.0
        for spec, prompt, title, message in [
            ("/etc/passwd", PROMPT, "Model not loaded", CLOSED.refusal),
            (BUNDLED, "the sky is blue " * 400, "Prompt not accepted", "model's context"),  # plain, no &#x27;
        ]:
            with pytest.raises(AppError) as err:
                client.predict(prompt, *settings(spec=spec), api_name="/run")
            assert message in str(err.value) and err.value.title == title and "&#" not in str(err.value)
        assert spy_loader.calls == [BUNDLED]
        assert [p.name for p in (tmp_path / "traces").iterdir()]  # the downloaded trace is still there
    finally:
        demo.close()


def test_sessions_kept_are_bounded(spy_loader, tmp_path, monkeypatch):
    """Gradio keeps every session's state until it evicts the least recently used past the capacity."""
    from gradio_client import Client

    assert app.launch_options({})["state_session_capacity"] == 1000
    options = app.launch_options({"MARS_DEMO_SESSIONS": "2"})
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    demo = app.build_demo(spy_loader, policy=CLOSED, traces=TraceStore(tmp_path / "traces"))
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                state_session_capacity=options["state_session_capacity"])
    try:
        for tau in (0.5, 0.6, 0.7):  # three API sessions, each with its own state
            Client(f"http://127.0.0.1:{port}/", verbose=False).predict(tau, api_name="/set_tau")
        assert len(demo.state_holder.session_data) == 2
        kept = [next(iter(s.state_data.values())) for s in demo.state_holder.session_data.values()]
        assert sorted(session.tau.get() for session in kept) == [0.6, 0.7]  # the oldest went
    finally:
        demo.close()


def test_streamed_runs_do_not_grow_the_session(spy_loader, tmp_path, monkeypatch):
    """Gradio keeps each session's latest component values; a run's passes must replace them, not pile up.

    (Gradio 6.31 stores a value that follows a gr.skip() for the same output under a new id, so a run
    that streams plain values between skips added a copy of a pane or a figure to its session per pass.)
    """
    from gradio_client import Client

    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    demo = app.build_demo(spy_loader, policy=CLOSED, traces=TraceStore(tmp_path / "traces"))
    demo.handlers.chart_every = 0.0  # charts on every pass as well
    demo.handlers.view_every = 0.0  # a view after every pass (the app's default shows one per 0.25 s of each side)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False, download_files=str(tmp_path / "downloads"))
        for tau in (0.9, 0.5, 0.7):
            client.predict(PROMPT, *settings(tau=tau, max_new_tokens=24), api_name="/run")
        client.predict(list(EXAMPLE_PROMPTS[:2]), [0.7], 8, BUNDLED, 4, "probability", 0.0, False, api_name="/sweep")
        client.predict(api_name="/stop")
        (session,) = demo.state_holder.session_data.values()
        assert set(session.blocks_config.blocks) <= set(demo.blocks)  # one stored component per block, no more
        assert set(session.config_values) <= set(demo.blocks)
        assert [type(v) for v in session.state_data.values()] == [Session]
    finally:
        demo.close()
