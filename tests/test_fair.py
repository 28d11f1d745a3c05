"""Fair to every visitor (#35): cancels end the work within one pass, the slot is held until the work ends,
a time budget per run, hosted defaults, bounded uploads, a message for every bad call, hub loads fail fast.

A tiny model stands in for the real one; its forward passes are counted by a hook, never timed.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import httpx
import pytest
from test_hosting import API, free_port

import app
from mars_demo.engine.backends.cpu.paths import ComputePath
from mars_demo.engine.checkpoints import hub
from mars_demo.engine.checkpoints.hub import HubUnreachable, check_hub
from mars_demo.engine.checkpoints.loading import BUNDLED
from mars_demo.engine.checkpoints.memory import GB, ModelTooLarge
from mars_demo.ui.examples import EXAMPLE_PROMPTS
from mars_demo.ui.handlers import DemoHandlers
from mars_demo.ui.hosting import SETTINGS, DecodeSlot, Limits
from mars_demo.ui.models import ModelCache, ModelPolicy, model_choices
from mars_demo.ui.outputs import RACE_OUTPUTS, SWEEP_OUTPUTS, named
from mars_demo.ui.race import Session
from mars_demo.ui.traces import TraceStore

from conftest import tiny_loader


@contextmanager
def served(lm, tmp_path, limits: Limits | None = None, **launch):
    """The app on ``lm``, served on a free loopback port for the block: (demo, port); closed afterwards."""
    built = {"limits": limits} if limits is not None else {}  # else the app's own, read from the environment
    demo = app.build_demo(tiny_loader(lm), policy=CLOSED, traces=TraceStore(tmp_path), **built)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **launch)
    try:
        yield demo, port
    finally:
        demo.close()

PROMPT = "Explain why the sky is blue."
CLOSED = ModelPolicy(tuple(model_choices(False)), free=False)
RACE = {"spec": BUNDLED, "tau": 0.9, "block_size": 4, "max_new_tokens": 48, "metric": "probability",
        "temperature": 0.0, "full_window": False, "with_ar": True}


class Passes:
    """Counts a model's forward passes (a hook on its forward), and the most that ran at once."""

    def __init__(self, model, delay: float = 0.0) -> None:
        self.count = self.active = self.most = 0
        self.delay, self._lock = delay, threading.Lock()
        self._hooks = [model.register_forward_pre_hook(self._start), model.register_forward_hook(self._end)]

    def _start(self, *_):
        with self._lock:
            self.count += 1
            self.active += 1
            self.most = max(self.most, self.active)
        if self.delay:
            time.sleep(self.delay)  # a longer pass, so that a served run is still decoding when it is cancelled

    def _end(self, *_):
        with self._lock:
            self.active -= 1

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


@pytest.fixture
def passes(tiny_qwen):
    counter = Passes(tiny_qwen.model)
    yield counter
    counter.remove()


def handlers_for(lm, tmp_path, **kwargs) -> DemoHandlers:
    return DemoHandlers(tiny_loader(lm), policy=CLOSED, trace_dir=tmp_path, **kwargs)


def sweep(handlers: DemoHandlers, tokens: int = 48, request=None):
    return handlers.sweep(list(EXAMPLE_PROMPTS[:2]), [0.5], tokens, BUNDLED, 4, "probability", 0.0, request=request)


def race(handlers: DemoHandlers, session: Session, request=None, **changes):
    s = {**RACE, **changes}
    return handlers.run(PROMPT, *s.values(), session, request=request)


def is_view(values: tuple) -> bool:
    return not all(v == gr.skip() for v in values)


# -- cancellation ------------------------------------------------------------------------------
def test_a_cancelled_sweep_stops_within_one_pass(tiny_qwen, tmp_path, passes):
    handlers = handlers_for(tiny_qwen, tmp_path)
    run = sweep(handlers)
    for _ in range(6):  # mid-run: the first run (AR) decodes 48 tokens, one pass each
        before = passes.count
        values = next(run)
        assert passes.count - before <= 1  # every yield comes within one pass of the last: Gradio closes there
    assert not is_view(values) and passes.count == 6
    assert handlers.slot.running() == 1 and handlers.models.in_use() == {BUNDLED: 1}
    run.close()  # what Gradio does to a cancelled generator, at its next yield
    assert passes.count == 6  # the run under way ended: no pass after the cancel
    assert handlers.slot.running() == 0 and handlers.models.in_use() == {}


def test_every_tab_yields_within_one_pass(tiny_qwen, tmp_path, passes):
    handlers = handlers_for(tiny_qwen, tmp_path, view_every=10.0)  # views far apart: the yields between carry nothing
    run = race(handlers, Session())
    counts = []
    for _ in run:
        counts.append(passes.count)
    assert max(b - a for a, b in itertools.pairwise(counts)) <= 1 and passes.count > 10


def test_a_closed_tab_cancels_its_runs_before_their_next_pass(tiny_qwen, tmp_path, passes):
    handlers = handlers_for(tiny_qwen, tmp_path)
    tab = SimpleNamespace(headers={"sec-fetch-mode": "cors"}, session_hash="tab1")
    session = Session()
    run = race(handlers, session, request=tab)
    next(run), next(run)
    count = passes.count
    cancel_tab_runs = app.slot_cleanup(handlers.slot)
    cancel_tab_runs(SimpleNamespace(session_hash="someone-else"))
    next(run)
    assert passes.count == count + 1  # another tab's unload changes nothing
    cancel_tab_runs(tab)  # the unload event of this tab
    assert list(run) == [] and passes.count == count + 1 and session.trace.status == "stopped"
    assert handlers.slot.running() == 0


# -- the decoding slot ---------------------------------------------------------------------------
def test_the_slot_is_released_only_when_the_work_has_ended(tiny_qwen, tmp_path, passes):
    handlers = handlers_for(tiny_qwen, tmp_path, slot=DecodeSlot(1, wait=0.05))
    first = sweep(handlers)
    next(first)  # decoding
    second = race(handlers, Session())
    with pytest.raises(gr.Error) as err:
        next(second)  # Gradio may already have freed its own slot: this one is the work's
    assert "still busy" in err.value.message and err.value.title == "Busy"
    assert passes.most == 1
    first.close()
    views = [named(RACE_OUTPUTS, v) for v in race(handlers, Session()) if is_view(v)]
    assert "data-status=\"done\"" in views[-1]["mars_pane"] and handlers.slot.running() == 0
    with pytest.raises(gr.Error):
        next(race(handlers, Session(), tau=7))  # a refused run never takes the slot
    assert handlers.slot.running() == 0


def test_a_served_cancel_frees_the_slot_only_after_the_last_pass(tiny_qwen, tmp_path, monkeypatch):
    """Four sweeps started and cancelled, then a race: never two passes at once, and no pass of a sweep after
    its cancel has returned beyond the one under way."""
    from gradio_client import Client

    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    counter = Passes(tiny_qwen.model, delay=0.01)
    try:
        with served(tiny_qwen, tmp_path, limits=Limits()) as (demo, port):
            for _ in range(4):
                client = Client(f"http://127.0.0.1:{port}/", verbose=False)
                job = client.submit(list(EXAMPLE_PROMPTS[:4]), [0.9, 0.5], 512, BUNDLED, 4, "probability", 0.0, False,
                                    "auto", api_name="/sweep")
                deadline = time.monotonic() + 30
                while counter.count < 3 and time.monotonic() < deadline:
                    time.sleep(0.01)
                job.cancel()
                until = time.monotonic() + 10
                while demo.handlers.slot.running() and time.monotonic() < until:
                    time.sleep(0.01)
                assert demo.handlers.slot.running() == 0  # the sweep's work ended
                ended = counter.count
                time.sleep(0.1)
                assert counter.count == ended  # and stays ended: nothing decodes in the background
                counter.count = 0
            result = Client(f"http://127.0.0.1:{port}/", verbose=False).predict(
                PROMPT, *{**RACE, "max_new_tokens": 8}.values(), "mars", "auto", api_name="/run")
            assert 'data-status="done"' in named(RACE_OUTPUTS, result)["mars_pane"]["value"] and counter.most == 1
    finally:
        counter.remove()


# -- the time budget -----------------------------------------------------------------------------
class Clock:
    """time.monotonic for the handlers: each reading one second later; sleep does nothing."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now

    def sleep(self, seconds: float) -> None:
        pass


def test_the_budget_ends_a_run_and_keeps_its_trace(tiny_qwen, tmp_path, monkeypatch, passes):
    monkeypatch.setattr("mars_demo.ui.handlers.time", Clock())
    handlers = handlers_for(tiny_qwen, tmp_path, limits=Limits(run_seconds=12))
    session = Session()
    with pytest.warns(UserWarning, match="time limit of 12 s per run"):
        views = [named(RACE_OUTPUTS, v) for v in race(handlers, session, max_new_tokens=200) if is_view(v)]
    trace = json.loads(Path(views[-1]["json_file"]["value"]).read_text())
    mars = trace["sides"]["mars"]["passes"]
    assert trace["status"] == "limit" and 0 < len(mars) == len(session.trace.mars) < 200  # what it decoded, kept
    assert 'data-status="limit"' in views[-1]["mars_pane"] and "time limit" in views[-1]["mars_pane"]
    assert handlers.slot.running() == 0


def test_the_budget_ends_a_sweep_with_the_runs_done(tiny_qwen, tmp_path, monkeypatch):
    monkeypatch.setattr("mars_demo.ui.handlers.time", Clock())
    handlers = handlers_for(tiny_qwen, tmp_path, limits=Limits(run_seconds=20))
    with pytest.warns(UserWarning, match="This sweep reached"):
        views = [named(SWEEP_OUTPUTS, v) for v in sweep(handlers, tokens=8) if is_view(v)]
    status = views[-1]["sweep_status"]
    assert "Time limit reached" in status and "of 8 runs" in status and "8 of 8" not in status
    assert handlers.slot.running() == 0


# -- hosted defaults -----------------------------------------------------------------------------
def test_hosted_defaults_switch_on_under_space_id():
    local, hosted = Limits.from_env({}), Limits.from_env({"SPACE_ID": "me/mars"})
    assert not local.hosted and hosted.hosted
    for key, (_, near, far) in SETTINGS.items():
        assert getattr(local, key) == near and getattr(hosted, key) == far
    assert hosted.run_seconds < local.run_seconds and hosted.max_new_tokens < local.max_new_tokens
    assert hosted.sweep_runs < local.sweep_runs and hosted.paths == "shared" and hosted.session_jobs == 1
    assert Limits.from_env({"GRADIO_SERVER_NAME": "0.0.0.0"}).hosted
    host = Limits.from_env({"SPACE_ID": "me/mars", "MARS_DEMO_RUN_SECONDS": "90", "MARS_DEMO_PATHS": "any",
                            "MARS_DEMO_SESSION_JOBS": "0"})
    assert (host.run_seconds, host.paths, host.session_jobs) == (90.0, "any", 0)  # every limit is the host's
    for name, bad in (("MARS_DEMO_RUN_SECONDS", "nan"), ("MARS_DEMO_RUN_SECONDS", "soon"),
                      ("MARS_DEMO_MAX_NEW_TOKENS", "99999"), ("MARS_DEMO_PATHS", "all"), ("MARS_DEMO_SWEEP_RUNS", "0")):
        with pytest.raises(ValueError, match="MARS_DEMO_|run budget|out of range"):
            Limits.from_env({name: bad})


def test_the_hosted_app(tiny_qwen, tmp_path, monkeypatch):
    monkeypatch.setenv("SPACE_ID", "me/mars")
    demo = app.build_demo(tiny_loader(tiny_qwen), traces=TraceStore(tmp_path))
    c = demo.components
    assert c["max_new_tokens"].maximum == 512 and c["sweep_tokens"].maximum == 128
    assert not c["precision"].interactive
    validated = {fn.api_name for fn in demo.fns.values() if fn.validator is not None}
    assert validated == {"run", "sweep", "run_1"}  # every event on the decoding slot: one job per session
    handlers = demo.handlers
    with pytest.raises(gr.Error, match="Max new tokens must be a whole number from 1 to 512"):
        next(race(handlers, Session(), max_new_tokens=2048))
    with pytest.raises(gr.Error, match="at most 32 per sweep"):
        next(handlers.sweep(list(EXAMPLE_PROMPTS[:4]), [0.9, 0.8, 0.7, 0.6, 0.5, 0.3], 8, BUNDLED, 4,
                            "probability", 0.0))


def test_the_shared_path_never_reloads_the_model(tiny_qwen, tmp_path):
    lm = dataclasses.replace(tiny_qwen, compute=ComputePath(path="int8dyn", requested="auto"))
    loads = []

    def loader(spec, precision=None):
        loads.append(precision)
        return lm

    handlers = DemoHandlers(loader, policy=CLOSED, trace_dir=tmp_path, limits=Limits(paths="shared"))
    list(handlers.show_model(BUNDLED, Session(), "auto"))
    assert handlers.compute_path("int8dyn") == "int8dyn"  # what auto chose: served by the model loaded
    with handlers.models.hold(BUNDLED, "int8dyn") as held:
        assert held is lm
    for other in ("fp32", "bf16"):
        with pytest.raises(ValueError, match="keep auto"):
            handlers.compute_path(other)
    with pytest.warns(UserWarning, match="keep auto"):
        list(handlers.show_model(BUNDLED, Session(), "fp32"))
    assert loads == ["auto"] and handlers.models.entries() == [(BUNDLED, "auto")]


# -- uploads -------------------------------------------------------------------------------------
def test_an_upload_above_the_limit_is_refused(tiny_qwen, tmp_path, monkeypatch):
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    options = app.launch_options({"MARS_DEMO_UPLOAD_MB": "0.01"})
    assert app.launch_options({})["max_file_size"] == 2**20
    with served(tiny_qwen, tmp_path, max_file_size=options["max_file_size"]) as (_, port):
        url = f"http://127.0.0.1:{port}/gradio_api/upload"
        small = httpx.post(url, files={"files": ("a.txt", b"x" * 1000)}, timeout=10)
        big = httpx.post(url, files={"files": ("b.bin", b"x" * 20_000)}, timeout=10)
        assert small.status_code == 200 and big.status_code == 413


# -- every call gets a message -------------------------------------------------------------------
HUGE = "x" * 200_000


def call(port: int, api_name: str, data) -> tuple[str, dict | list | None]:
    """(event, payload) of one raw API call: "complete" with the outputs, "error" with the error, "refused"."""
    base = f"http://127.0.0.1:{port}/gradio_api/call/{api_name}"
    joined = httpx.post(base, content=json.dumps({"data": data}), headers={"content-type": "application/json"},
                        timeout=30)
    if joined.status_code != 200:
        return "refused", joined.json()
    stream = httpx.get(f"{base}/{joined.json()['event_id']}", timeout=60).text
    event, payload = None, None
    for line in stream.splitlines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: ") and event in ("complete", "error"):
            payload = json.loads(line[6:])
    return event, payload


def bad_calls(inputs: int) -> list[list]:
    wrong = [{"a": 1}, [1, 2], None, "NaN", float("nan"), HUGE, -1e308]
    calls = [[], [None]]
    calls += [[w] * inputs for w in wrong]
    calls += [[w] + ["x"] * (inputs - 1) for w in wrong[:2]]
    return calls


def test_every_endpoint_answers_bad_calls_with_a_message(tiny_qwen, tmp_path, monkeypatch):
    """Hosted (SPACE_ID): the validators that keep one job per session run first, and must not fail either."""
    from gradio_client import Client
    from gradio_client.exceptions import ValidationError

    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    monkeypatch.setenv("SPACE_ID", "me/mars")
    with served(tiny_qwen, tmp_path) as (_, port):
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        endpoints = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
        assert {"/run", "/sweep", "/run_1", "/set_tau", "/send"} <= set(endpoints)
        answered = empty = 0
        for name, info in endpoints.items():
            for data in bad_calls(len(info["parameters"])):
                event, payload = call(port, name.lstrip("/"), data)
                answered += 1
                if event == "error":
                    message = (payload or {}).get("error")
                    if not message:
                        empty += 1
                        continue
                    assert HUGE[:1000] not in message and len(message) < 2000, (name, message[:200])
                else:
                    assert event in ("complete", "refused"), (name, event)
        assert answered > 100 and empty == 0
        assert client.predict(0.5, api_name="/set_tau") in (None, ())  # and the app still serves
        event, payload = call(port, "run", [PROMPT])
        assert event == "error" and payload["error"].startswith("/run takes 15 values (prompt, spec, tau, ")
        assert "session (null)" in payload["error"] and payload["error"].endswith("this call sent 1.")
        event, payload = call(port, "set_tau", [float("nan"), None])  # NaN: JSON's extension, as Python writes it
        assert event == "error" and payload["error"] == "tau must be a number from 0 to 1."
        # one job per session: a second call while the first waits or decodes is refused when it joins
        first = client.submit(list(EXAMPLE_PROMPTS[:2]), [0.5], 128, BUNDLED, 4, "probability", 0.0, False,
                              "auto", api_name="/sweep")
        time.sleep(0.5)
        with pytest.raises(ValidationError, match="already have a run waiting or decoding"):
            client.predict(PROMPT, *RACE.values(), "mars", "auto", api_name="/run")
        first.cancel()


def test_the_serving_tab_through_gradio_client(tiny_qwen, tmp_path, monkeypatch):
    from gradio_client import Client

    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    with served(tiny_qwen, tmp_path) as (demo, port):
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        status, *_, totals = client.predict("poisson", 20.0, ["fixed:1.0", "fixed:0.9"], "", 3, 30, 2, 8, BUNDLED,
                                            "auto", False, api_name="/run_1")
        assert "Finished: 2 of 2 policies" in status and [row[0] for row in totals["data"]] == ["fixed:1", "fixed:0.9"]
        assert demo.handlers.slot.running() == 0


# -- hub loads and messages ----------------------------------------------------------------------
@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.setattr(hub._Reach, "checked", float("-inf"))


def test_a_hub_load_fails_at_once_without_blocking_other_loads(tiny_qwen, fresh_probe):
    loading, release = threading.Event(), threading.Event()

    def slow_loader(spec, precision=None):
        loading.set()
        release.wait(10)
        return tiny_qwen

    cache = ModelCache(slow_loader, capacity=2, precheck=check_hub)
    other = threading.Thread(target=cache.get, args=(BUNDLED,))
    other.start()
    assert loading.wait(10)  # a load is under way and holds the one-load-at-a-time lock
    started = time.monotonic()
    with pytest.raises(HubUnreachable, match="cannot be reached"):
        cache.get("someone/some-model")  # HF_HUB_OFFLINE (conftest): refused without waiting for that load
    assert time.monotonic() - started < 5
    release.set()
    other.join(10)
    probes = []
    online = {"HF_HUB_OFFLINE": "0"}
    for _ in range(3):
        with pytest.raises(HubUnreachable):
            check_hub("someone/some-model", probe=lambda seconds: probes.append(seconds) or False, env=online)
    assert probes == [3.0]  # one short probe, remembered
    check_hub(BUNDLED, probe=lambda seconds: pytest.fail("the bundled model needs no hub"), env=online)


def test_messages_name_no_host_facts(tiny_qwen, tmp_path):
    message = str(ModelTooLarge(needed=3 * GB, available=5 * GB + 123))
    assert "3.0 GB" in message and "5.0" not in message and "free" not in message
    handlers = handlers_for(tiny_qwen, tmp_path)
    session = Session()
    for bad in (float("nan"), None, "abc", [1], float("inf")):
        with pytest.raises(gr.Error, match="tau must be a number from 0 to 1"):
            handlers.set_tau(bad, session, request=API)
    assert session.tau.get() == 0.9


def test_a_live_request_leaves_the_batch_at_the_budget(tiny_qwen, tmp_path, monkeypatch):
    from mars_demo.engine.serving.loop import ServeConfig
    from mars_demo.engine.serving.shared import SharedBatches
    from mars_demo.ui.live_tab import LIVE_OUTPUTS, LiveHandlers, LiveState

    monkeypatch.setattr("mars_demo.ui.live_tab.time", Clock())  # every reading a second later: over 3 s at once
    demo = handlers_for(tiny_qwen, tmp_path, limits=Limits(run_seconds=3))
    batches = SharedBatches(ServeConfig(max_batch=2, max_new_tokens=400), max_queue=1, idle=5.0, pace=0.02)
    live = LiveHandlers(demo, batches, chart_every=0.0, poll=0.05)
    state = LiveState()
    with pytest.warns(UserWarning, match="This request reached this server.*time limit of 3 s"):
        views = [named(LIVE_OUTPUTS, v) for v in live.send(PROMPT, BUNDLED, state) if is_view(v)]
    assert "Stopped" in views[-1]["live_status"] and state.request.ended
    assert batches.batches()[0].in_flight() == 0


def test_a_cancelled_serving_run_ends_within_one_pass_and_frees_the_slot(tiny_qwen, tmp_path, passes):
    from mars_demo.ui.serving_tab import ServingHandlers, ServingState

    serving = ServingHandlers(handlers_for(tiny_qwen, tmp_path), chart_every=60.0)
    run = serving.run("poisson", 20.0, ["fixed:1.0", "fixed:0.9"], "", 12, 60, 2, 64, BUNDLED, ServingState())
    while is_view(next(run)):  # the surface read and the warm-up (short, untimed) come first, then the replay
        pass
    for _ in range(5):
        before = passes.count
        next(run)
        assert passes.count - before <= 2  # one loop iteration: a newcomer's prefill and the batch's pass
    count = passes.count
    assert serving.demo.slot.running() == 1
    run.close()
    assert passes.count == count and serving.demo.slot.running() == 0 and serving.demo.models.in_use() == {}
