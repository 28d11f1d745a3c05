"""The Serving tab's live section, driven directly with a tiny model: visitors share one batch, each streams only
their own tokens (with the tau of each pass), Stop and a closed page take a request out, bad input is refused."""

from __future__ import annotations

import re
import threading
from html import unescape

import gradio as gr
import pytest
from test_live import LOW, WAIT
from test_serving import alone

from mars_demo.engine.checkpoints.loading import BUNDLED
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.loop import Detokenizer
from mars_demo.engine.serving.loop import PassStep, ServeConfig
from mars_demo.engine.serving.shared import LiveUpdate, SharedBatches
from mars_demo.ui.handlers import DemoHandlers
from mars_demo.ui.live_tab import BUSY_LIVE, LIVE_OUTPUTS, LiveHandlers, LiveState, LiveView, batches_from_env
from mars_demo.ui.models import ModelPolicy, model_choices
from mars_demo.ui.outputs import named

from conftest import tiny_loader

NEW = 16


@pytest.fixture
def live(tiny_qwen, tmp_path):
    loader = tiny_loader(tiny_qwen)
    demo = DemoHandlers(loader, policy=ModelPolicy(tuple(model_choices(False)), free=False), trace_dir=tmp_path)
    batches = SharedBatches(ServeConfig(max_batch=2, max_new_tokens=NEW), policy=LOW, max_queue=1, idle=5.0)
    return LiveHandlers(demo, batches, chart_every=0.0, poll=0.05)


def views(run) -> list[dict]:
    return [named(LIVE_OUTPUTS, out) for out in run]


def pane_text(pane: str) -> str:
    """The pane's text as the visitor reads it (newline markers and tags dropped, entities decoded)."""
    body = pane.split('<div class="text">', 1)[1].split('<div class="legend">', 1)[0]
    return unescape(re.sub(r"<[^>]+>", "", body.replace('<span class="nl">↵</span>', "")))


def decoded(lm, tokens: list[int]) -> str:
    detok = Detokenizer(lm.tokenizer)
    return "".join(detok.push(t) for t in tokens) + detok.flush()


def test_send_streams_the_visitors_own_passes_with_their_tau(live, tiny_qwen):
    state = LiveState()
    out = views(live.send("Explain why the sky is blue.", BUNDLED, state))
    assert len(out) >= 2  # the empty view, then one view per batch of passes that arrived together, the last final
    final = out[-1]
    assert "Done (" in final["live_status"] and 'data-status="done"' in final["live_pane"]
    assert "tau 1.00" in final["live_pane"]  # alone in the batch: every pass at tau 1.0, shown per token
    assert [t.name for t in final["live_plot"].data] == ["tokens accepted", "tau"]
    prompt = prompt_ids(tiny_qwen.tokenizer, "Explain why the sky is blue.")
    assert pane_text(final["live_pane"]) == decoded(tiny_qwen, alone(tiny_qwen, prompt, [1.0] * NEW, max_new=NEW))
    assert state.request.ended and live.batches.batches()[0].in_flight() == 0


class Scripted:
    """A live request whose updates come one per call, with a silent poll between them."""

    arrival, ended = 0.0, False

    def __init__(self, updates: list) -> None:
        self.script = [x for u in updates for x in (None, u)]

    def next_update(self, timeout=None):
        if not self.script or (timeout == 0 and self.script[0] is None):  # a look without waiting finds nothing
            return None
        return self.script.pop(0)


def test_the_stream_redraws_on_every_update_and_skips_while_silent(live, tiny_qwen):
    ids = tuple(tiny_qwen.tokenizer.encode("one two three", add_special_tokens=False))
    script = [LiveUpdate((PassStep(0, "prefill", 1.0, ids[:1], 0.1, (0.9,)),), "running"),
              LiveUpdate((PassStep(1, "decode", 0.8, ids[1:], 0.2, (0.95,) * (len(ids) - 1)),), "running"),
              LiveUpdate((), "done", "length")]
    out = list(live._stream(Scripted(script), LiveView(tiny_qwen.tokenizer, 4), None))
    assert len(out) == 1 + 2 * len(script)  # the first view, then per update a skipped poll and a redraw
    assert all(v == gr.skip() for v in out[1]) and named(LIVE_OUTPUTS, out[2])["live_pane"].count('data-pass=') == 1
    last = named(LIVE_OUTPUTS, out[-1])
    assert last["live_pane"].count("data-pass=") == 2 and "tau 0.80" in last["live_pane"]
    assert pane_text(last["live_pane"]) == "one two three" and "Done (length)" in last["live_status"]


def test_two_visitors_share_the_batch_and_see_only_their_own_stream(live, tiny_qwen):
    prompts = ["Write a story about a fox.", "def add(a, b):"]
    states = [LiveState(), LiveState()]
    runs = [live.send(p, BUNDLED, s, session(k)) for k, (p, s) in enumerate(zip(prompts, states))]
    with live.batches.batch_for(tiny_qwen).paused():  # both sent before the next pass: they join together
        for run in runs:
            next(run)  # submits, then the empty view
    results: list[list] = [[], []]

    def consume(k: int) -> None:  # two threads, as Gradio runs two browser sessions' events
        results[k] = views(runs[k])

    threads = [threading.Thread(target=consume, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT)
    for k, prompt in enumerate(prompts):
        final = results[k][-1]
        assert "Done (" in final["live_status"]
        taus = [s.tau for s in states[k].view.steps]
        assert taus[0] == 0.15  # two in the batch: the policy's second step, on both streams
        ids = prompt_ids(tiny_qwen.tokenizer, prompt)
        assert pane_text(final["live_pane"]) == decoded(tiny_qwen, alone(tiny_qwen, ids, taus, max_new=NEW))
        assert states[k].request.owner == f"session-{k}"
    assert pane_text(results[0][-1]["live_pane"]) != pane_text(results[1][-1]["live_pane"])


class FakeRequest:
    """What the handler reads of a gr.Request: the session and the headers (a browser's)."""

    def __init__(self, k: int) -> None:
        self.session_hash, self.headers = f"session-{k}", {"sec-fetch-mode": "cors"}


def session(k: int) -> FakeRequest:
    return FakeRequest(k)


def test_bad_input_gets_a_clear_message(live):
    for prompt, message in [("", "Type a prompt first"), ("   ", "Type a prompt first"),
                            ("x" * 5000, "at most 4000")]:
        with pytest.raises(gr.Error, match=message):
            next(live.send(prompt, BUNDLED, LiveState()))
    with pytest.raises(gr.Error, match="only the models in the list"):
        next(live.send("Hello", "bad/model", LiveState()))


def test_an_over_long_prompt_ends_with_an_error_message(live):
    out = views(live.send("word " * 700, BUNDLED, LiveState()))  # more tokens than the tiny model's 512 positions
    assert "Ended with an error" in out[-1]["live_status"] and "too long" in out[-1]["live_status"]
    assert 'class="live-status error"' in out[-1]["live_status"]


def test_busy_and_one_request_per_visitor(live, tiny_qwen):
    batch_states = [LiveState() for _ in range(3)]
    runs = [live.send("Count: one, two", BUNDLED, s) for s in batch_states]
    with live.batches.batch_for(tiny_qwen).paused():  # nothing decodes, nothing ends, until the checks are done
        for run in runs:
            next(run)  # two rows and one queue place: all three in
        with pytest.raises(gr.Error, match=re.escape(BUSY_LIVE[:40])):
            next(live.send("One more", BUNDLED, LiveState()))
        with pytest.raises(gr.Error, match="still in the shared batch"):
            next(live.send("Again", BUNDLED, batch_states[0]))
    assert all("Done (" in views(run)[-1]["live_status"] for run in runs)


def test_stop_and_a_closed_page_take_the_request_out(live, tiny_qwen):
    state, gone, other = LiveState(), LiveState(), LiveState()
    runs = [live.send("Write a story about a fox.", BUNDLED, s) for s in (state, gone, other)]
    with live.batches.batch_for(tiny_qwen).paused():  # all three in before any pass
        for run in runs:
            next(run)
        live.stop(state)
        runs[1].close()  # Gradio closes the generator when the page goes or the event is cancelled
    assert "Stopped" in views(runs[0])[-1]["live_status"]
    assert [u.status for u in gone.request.updates(timeout=WAIT)] == ["stopped"]
    assert "Done (" in views(runs[2])[-1]["live_status"]  # the third visitor is not disturbed


def test_generated_text_is_escaped(tiny_qwen):
    view = LiveView(tiny_qwen.tokenizer, 4)
    tokens = tuple(tiny_qwen.tokenizer.encode("<script>alert(1)</script>", add_special_tokens=False))
    view.add(LiveUpdate((PassStep(0, "prefill", 0.9, tokens, 0.1, (0.5,) * len(tokens)),), "done", "length"), 0.0)
    pane = named(LIVE_OUTPUTS, view.outputs("fixed:0.9", True))["live_pane"]
    assert "<script" not in pane and "&lt;" in pane and "tau 0.90" in pane
    assert pane_text(pane) == "<script>alert(1)</script>"  # shown as text


@pytest.mark.parametrize("env, message", [
    ({"MARS_DEMO_LIVE_ROWS": "0"}, "MARS_DEMO_LIVE_ROWS must be a whole number from 1 to 16"),
    ({"MARS_DEMO_LIVE_QUEUE": "many"}, "MARS_DEMO_LIVE_QUEUE must be a whole number from 0 to 64"),
    ({"MARS_DEMO_LIVE_POLICY": "turbo"}, "unknown policy 'turbo'"),
    ({"MARS_DEMO_LIVE_PACE": "slow"}, "MARS_DEMO_LIVE_PACE must be a number of seconds from 0 to 1"),
    ({"MARS_DEMO_LIVE_PACE": "5"}, "MARS_DEMO_LIVE_PACE must be a number of seconds from 0 to 1"),
])
def test_bad_live_settings_fail_at_start_with_one_line(env, message):
    with pytest.raises(ValueError, match=message):
        batches_from_env(env)
    batches = batches_from_env({"MARS_DEMO_LIVE_ROWS": "2", "MARS_DEMO_LIVE_POLICY": "fixed:0.9"})
    assert (batches.config.max_batch, batches.max_queue, batches.policy, batches.pace) == (2, 4, "fixed:0.9", 0.0)
    assert batches_from_env({"MARS_DEMO_LIVE_PACE": "0.05"}).pace == 0.05
