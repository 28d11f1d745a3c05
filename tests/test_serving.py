"""Serving loop (continuous batching): rows that join a running batch decode exactly as alone; policies;
deterministic replays; every request ends exactly once with its output and trace."""

from __future__ import annotations

import pytest
import torch

from mars_demo.engine.decoding.batch.token import TokenBatch
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import LiveTau, decode_passes, eos_ids
from mars_demo.engine.decoding.width import WidthController
from mars_demo.engine.serving.loop import Request, ServeConfig, ServingLoop
from mars_demo.engine.serving.policies import (
    DEFAULT_LADDER,
    ENDINGS,
    Fixed,
    Ladder,
    LatencyTarget,
    Load,
    parse_policy,
    split_policies,
)

from conftest import PROMPTS

LONG = " ".join(PROMPTS) * 2
TEXTS = [PROMPTS[0], LONG, PROMPTS[2], PROMPTS[3][:5], PROMPTS[1], PROMPTS[3]]
NEW = 20


class Schedule(LiveTau):
    """A live tau that follows a recorded schedule, one value per pass."""

    def __init__(self, taus: list[float]) -> None:
        super().__init__(taus[0])
        self.taus, self.i = list(taus), 0

    def get(self) -> float:
        tau = self.taus[min(self.i, len(self.taus) - 1)]
        self.i += 1
        return tau


def unit_cost(rows: int, width: int, kind: str, measured: float) -> float:
    """A deterministic clock: 10 ms per pass plus 1 ms per token fed."""
    return 0.010 + 0.001 * rows * width


def make_loop(
    lm, policy="fixed:1.0", *, mode="mars", max_batch=3, max_new=NEW, cost=unit_cost, **sampling
) -> ServingLoop:
    return ServingLoop(
        lm.backend, mask_id=lm.meta.mask_token_id, pad_id=lm.tokenizer.pad_token_id,
        stop_ids=eos_ids(lm.backend, lm.tokenizer),
        config=ServeConfig(mode=mode, max_batch=max_batch, max_new_tokens=max_new, **sampling),
        policy=parse_policy(policy), pass_cost=cost,
    )


def requests(lm, arrivals=(0.0, 0.0, 0.03, 0.05, 0.05, 0.2)) -> list[Request]:
    return [Request(i, tuple(prompt_ids(lm.tokenizer, t)), a) for i, (t, a) in enumerate(zip(TEXTS, arrivals))]


def alone(lm, prompt, taus, *, mode="mars", max_new=NEW) -> list[int]:
    """The request decoded alone by the single-sequence decoder, at the tau schedule it saw in the batch."""
    passes = decode_passes(
        lm.backend, list(prompt), DecodeConfig(mode=mode, max_new_tokens=max_new, max_fed=None), window=4,
        mask_id=lm.meta.mask_token_id, tau=Schedule(taus), stop_ids=eos_ids(lm.backend, lm.tokenizer),
    )
    return [t for p in passes for t in p.tokens]


class Replayed(WidthController):
    """Hands out the widths a request was given in a batch, pass after pass."""

    def __init__(self, widths, most=4):
        super().__init__(None, most)
        self.widths = iter(widths)

    def choose(self, rows, caps, tau, fed=None, joins=0, static=False):
        return next(self.widths)


def alone_at(lm, prompt, trace, *, max_new=NEW, mode="mars") -> list[int]:
    """The request decoded as the only row of a batch, at the tau and width of each pass it had in the batch."""
    batch = TokenBatch(
        lm.backend, [list(prompt)], DecodeConfig(mode=mode, max_new_tokens=max_new), block_size=4,
        mask_id=lm.meta.mask_token_id, pad_id=lm.tokenizer.pad_token_id, stop_ids=eos_ids(lm.backend, lm.tokenizer),
        controller=Replayed([p.width for p in trace]),
    )
    out = []
    for p in trace:
        steps, _ = batch.step(p.tau)
        out += steps[0].token_ids
    return out


def replay(loop, reqs):
    events = list(loop.run(reqs))
    return events, {i: s for i, s in loop.served.items()}


# Taus this low make the tiny random models accept several tokens per pass (they are not trained).
@pytest.mark.parametrize("policy", ["fixed:1.0", "fixed:0.15", "ladder:0=0.1,2=1.0"])
def test_rows_that_join_a_running_batch_decode_as_alone(tiny_lm, policy):
    events, served = replay(make_loop(tiny_lm, policy), requests(tiny_lm))
    assert any(e.admitted and e.running > len(e.admitted) for e in events)  # someone joined a running batch
    wide = sum(len(p.tokens) > 1 for s in served.values() for p in s.trace)
    assert (wide == 0) if policy == "fixed:1.0" else wide >= 5
    assert len({e.tau for e in events}) == (2 if policy.startswith("ladder") else 1)
    for s in served.values():
        assert s.status == "done"
        taus = [p.tau for p in s.trace]
        assert s.token_ids == alone(tiny_lm, s.request.prompt, taus)


@pytest.mark.parametrize("mode", ["exact", "hybrid"])
def test_verifying_modes_join_as_alone(tiny_qwen, mode):
    _, served = replay(make_loop(tiny_qwen, "fixed:0.15", mode=mode), requests(tiny_qwen))
    for s in served.values():
        assert s.token_ids == alone(tiny_qwen, s.request.prompt, [p.tau for p in s.trace], mode=mode)
        if mode == "exact":
            assert {p.tau for p in s.trace} == {1.0}


@pytest.mark.parametrize("mode", ["mars", "exact"])
def test_a_batch_that_never_empties_forgets_its_finished_rows(tiny_qwen, monkeypatch, mode):
    """Arrivals that keep the batch running: its book is forgotten down to the live rows now and then, and every
    request still decodes as it would alone."""
    import mars_demo.engine.serving.loop as serving

    monkeypatch.setattr(serving, "FORGET_AFTER", 3)
    loop = make_loop(tiny_qwen, "fixed:0.15", mode=mode, max_new=8)
    texts = TEXTS * 3
    reqs = [Request(i, tuple(prompt_ids(tiny_qwen.tokenizer, t)), 0.02 * i) for i, t in enumerate(texts)]
    books, batches = [], set()
    for event in loop.run(reqs):
        if loop.batch is not None:
            books.append(len(loop.batch.book.produced))
            batches.add(id(loop.batch))
    assert len(batches) == 1  # one batch ran all the way
    assert max(books) < 3 + loop.config.max_batch + 1 < len(texts)
    for s in loop.served.values():
        assert s.status == "done"
        assert s.token_ids == alone(tiny_qwen, s.request.prompt, [p.tau for p in s.trace], mode=mode, max_new=8)


def test_tau_one_is_greedy_ar(tiny_llama):
    _, served = replay(make_loop(tiny_llama, "fixed:1.0", max_batch=2), requests(tiny_llama))
    for s in served.values():
        x = torch.tensor([s.request.prompt])
        out = tiny_llama.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                                        pad_token_id=tiny_llama.tokenizer.pad_token_id)
        assert s.token_ids == out[0, x.shape[1]:].tolist()[: len(s.token_ids)]
        assert all(len(p.tokens) <= 1 for p in s.trace)


def test_max_batch_bounds_the_running_rows(tiny_llama):
    events, _ = replay(make_loop(tiny_llama, "fixed:0.8", max_batch=2), requests(tiny_llama, [0.0] * 6))
    assert max(e.running for e in events) == 2
    assert events[0].queue == 4


@pytest.mark.parametrize("policy", ["ladder:0=1.0,1=0.2,2=0.1", "latency:0.05", "fixed:0.15"])
def test_seeded_replays_are_deterministic(tiny_qwen, policy):
    first = replay(make_loop(tiny_qwen, policy), requests(tiny_qwen))
    second = replay(make_loop(tiny_qwen, policy), requests(tiny_qwen))
    assert {i: s.token_ids for i, s in first[1].items()} == {i: s.token_ids for i, s in second[1].items()}
    assert [(e.tau, e.queue, e.clock) for e in first[0]] == [(e.tau, e.queue, e.clock) for e in second[0]]


@pytest.mark.parametrize("mode", ["mars", "exact", "hybrid"])
def test_sampled_serving_is_seeded(tiny_qwen, mode):
    """At a temperature every mode samples (exact by the speculative-sampling rule); one seed, one replay."""
    sampled = {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 4}
    first = replay(make_loop(tiny_qwen, "fixed:0.5", mode=mode, **sampled), requests(tiny_qwen))[1]
    again = replay(make_loop(tiny_qwen, "fixed:0.5", mode=mode, **sampled), requests(tiny_qwen))[1]
    other = replay(make_loop(tiny_qwen, "fixed:0.5", mode=mode, **sampled | {"seed": 5}), requests(tiny_qwen))[1]
    tokens = {i: s.token_ids for i, s in first.items()}
    assert tokens == {i: s.token_ids for i, s in again.items()} != {i: s.token_ids for i, s in other.items()}
    assert all(s.status == "done" for s in first.values())


def test_every_request_ends_exactly_once_with_output_and_trace(tiny_llama):
    loop = make_loop(tiny_llama, "adaptive", max_batch=2)
    reqs = requests(tiny_llama) + [Request(90, ()), Request(91, tuple(range(4)) * 300, 0.01)]  # empty, too long
    events = []
    for event in loop.run(reqs):
        events.append(event)
        if len(events) == 3:
            loop.stop(reqs[5].id)  # still waiting
            running = next(iter(loop.rows.values()))
            loop.stop(running)  # running
    served = loop.served
    assert sorted(served) == sorted(r.id for r in reqs)
    assert all(s.status in ENDINGS and s.finished is not None for s in served.values())
    assert served[90].status == served[91].status == "error" and "empty" in served[90].reason
    assert served[5].status == "stopped" and served[5].trace == [] and served[running].status == "stopped"
    ended = [i for e in events for i in e.ended]
    assert len(ended) == len(set(ended))  # none ends twice
    for s in served.values():
        assert [t for p in s.trace for t in p.tokens] == s.token_ids
        if s.status == "done":
            assert s.token_ids and s.trace[0].kind == "prefill" and s.ttft <= s.latency
    with pytest.raises(RuntimeError, match="ended twice"):
        loop._end(served[0], "done", "eos")


def test_a_failing_pass_ends_its_requests_with_an_error(tiny_llama, monkeypatch):
    loop = make_loop(tiny_llama, "fixed:0.8", max_batch=2)
    calls = {"n": 0}
    real = tiny_llama.backend.forward

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("device lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(tiny_llama.backend, "forward", flaky)
    list(loop.run(requests(tiny_llama)))
    statuses = [s.status for s in loop.served.values()]
    assert "error" in statuses and set(statuses) <= {"done", "error"}
    assert all("device lost" in s.reason for s in loop.served.values() if s.status == "error")


def test_a_deadline_stops_what_is_left(tiny_llama):
    loop = make_loop(tiny_llama, "fixed:1.0", max_batch=1)
    list(loop.run(requests(tiny_llama), deadline=0.0))
    assert {s.status for s in loop.served.values()} == {"stopped"}


def test_policies_map_load_to_tau():
    def load(queue=0, running=1, recent=None, oldest=0.0):
        return Load(queue, running, 8, recent, oldest)

    assert Fixed(0.9)(load(queue=50)) == 0.9
    ladder = parse_policy("adaptive")
    assert [ladder(load(queue=q)) for q in (0, 1, 3, 4, 8, 15, 16, 100)] == [1.0, 0.95, 0.95, 0.9, 0.8, 0.8, 0.7, 0.7]
    assert ladder.steps == DEFAULT_LADDER
    assert parse_policy("ladder:2=0.8,5=0.5")(load(queue=1)) == 1.0  # below the first step: tau 1.0
    assert parse_policy("ladder:2=0.8,5=0.5")(load(queue=6)) == 0.5
    target = LatencyTarget(2.0)
    taus = [target(load(oldest=s)) for s in (3.0, 3.0, 2.5, 1.5, 0.5, 0.5, 0.5)]
    assert taus == [0.95, 0.9, 0.8, 0.8, 0.9, 0.95, 1.0]
    assert target(load(recent=9.0)) == 0.95  # recent latency counts too
    assert isinstance(parse_policy("latency:3"), LatencyTarget) and isinstance(parse_policy("ladder"), Ladder)


BAD_POLICIES = ["fixed", "fixed:1.5", "fixed:x", "latency:0", "latency:-1", "ladder:a=b", "turbo", "", "fixed:1@ar",
                "adaptive@"]


@pytest.mark.parametrize("spec", BAD_POLICIES)
def test_bad_policies_are_refused_in_one_line(spec):
    with pytest.raises(ValueError) as err:
        parse_policy(spec)
    assert "\n" not in str(err.value) and ("policy" in str(err.value) or "tau" in str(err.value))


def test_policy_lists_keep_ladder_steps_together():
    assert split_policies("fixed:1.0, ladder:0=1,4=0.9 ,adaptive,") == ["fixed:1.0", "ladder:0=1,4=0.9", "adaptive"]
    assert split_policies("") == []


def test_bad_serve_config_is_refused():
    for bad in ({"mode": "ar"}, {"max_batch": 0}, {"max_new_tokens": 1.5}, {"temperature": float("nan")},
                {"top_p": 0.0}, {"top_p": 1.2}, {"top_k": -1}):
        with pytest.raises(ValueError):
            ServeConfig(**bad)
