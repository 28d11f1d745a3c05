"""The cost surface and the width controller: injected surfaces on tiny models, no timing.

What must hold:
  * where width is free, every pass gets the full window; where every token fed costs a pass's
    worth, every decoding pass is width 1 and the output is batched AR's, token for token;
  * a pass whose rows have different widths leaves each row exactly as decoding it alone would;
  * exact and hybrid at tau 1.0 with the controller are greedy AR;
  * the priced adaptive policy lowers tau only where the surface says wider passes pay;
  * a surface with missing or non-finite entries is refused with one message.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import random
import time
from types import SimpleNamespace

import pytest
import torch

from mars_demo.engine.decoding import exact
from mars_demo.engine.decoding import surface as surface_module
from mars_demo.engine.decoding.batch import collect_batch, decode_batch, stream_batch
from mars_demo.engine.decoding.batch.token import TokenBatch
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.exact import DraftDepth
from mars_demo.engine.decoding.loop import LiveTau, eos_ids
from mars_demo.engine.decoding.surface import Surface, affordable_rate, cached_surface, measure
from mars_demo.engine.decoding.width import FIRST, GAIN, NEAR, Hits, Prices, Standing, WidthController
from mars_demo.engine.serving.loop import Request, ServeConfig, ServingLoop
from mars_demo.engine.serving.policies import Load, parse_policy

from conftest import PROMPTS, make_lm

ROWS, WIDTHS = (1, 2, 4, 8), (1, 2, 3, 4, 8, 16)
FREE = Surface.from_cost(lambda r, w: 5.0 + r, rows=ROWS, widths=WIDTHS, name="free")  # width costs nothing
LINEAR = Surface.from_cost(lambda r, w: 1.0 + 10.0 * r * w, rows=ROWS, widths=WIDTHS, name="linear")
MIXED = [PROMPTS[0], " ".join(PROMPTS), PROMPTS[2], PROMPTS[3][:5]]
NEW = 20


def _ids(lm, prompts=MIXED):
    return [prompt_ids(lm.tokenizer, p) for p in prompts]


def _batch(lm, ids, tau, *, surface=None, verifying=False, controller=None, max_new=NEW, block_size=4):
    controller = controller or WidthController(surface, block_size)
    config = DecodeConfig(mode="hybrid" if verifying else "mars", max_new_tokens=max_new)
    events = list(decode_batch(
        lm.backend, ids, config, scheme="token", block_size=block_size, mask_id=lm.meta.mask_token_id,
        pad_id=lm.tokenizer.pad_token_id, tau=LiveTau(tau), stop_ids=eos_ids(lm.backend, lm.tokenizer),
        controller=controller,
    ))
    return collect_batch(iter(events)).token_ids, events


# -- the surface -------------------------------------------------------------------------------------
def test_surface_interpolates_between_points_and_extends_past_the_grid():
    surface = Surface((1, 4), (1, 2, 4), [[10.0, 12.0, 20.0], [16.0, 24.0, 40.0]])
    assert surface.ms(1, 2) == 12.0 and surface.ms(4, 4) == 40.0  # grid points as measured
    assert surface.ms(1, 3) == pytest.approx(16.0)  # between widths
    assert surface.ms(2, 1) == pytest.approx(12.0)  # between row counts: 10 + (16 - 10) / 3
    assert surface.ms(1, 6) == pytest.approx(28.0)  # past the widest: the last slope
    assert surface.ms(8, 1) == pytest.approx(24.0)  # past the most rows: the last slope
    assert Surface.from_record(surface.record()).ms(2, 3) == pytest.approx(surface.ms(2, 3))


@pytest.mark.parametrize("grid, problem", [
    ([[10.0, math.nan]], "not a positive number"),
    ([[10.0, math.inf]], "not a positive number"),
    ([[10.0, -1.0]], "not a positive number"),
    ([[10.0]], "some are missing"),
    ([], "some are missing"),
])
def test_a_surface_with_missing_or_non_finite_entries_is_refused(grid, problem):
    with pytest.raises(ValueError, match=f"^the cost surface cannot be used: .*{problem}"):
        Surface((1,), (1, 2), grid)


def test_a_damaged_record_is_refused_with_one_message():
    with pytest.raises(ValueError, match="^the cost surface cannot be used: a field is missing"):
        Surface.from_record({"rows": [1], "widths": [1]})


def test_measured_surface_is_cached_by_key(tiny_llama, tmp_path, monkeypatch):
    surface = measure(tiny_llama.backend, rows=(1, 2), widths=(1, 2), context=8, rounds=1)
    assert surface.rows == (1, 2) and all(x > 0 for line in surface.grid for x in line) and not surface.simulated
    first = cached_surface(tiny_llama.backend, "k", tmp_path)
    checked = []
    monkeypatch.setattr(surface_module, "slowed", lambda kept, now: checked.append((kept, now)) or False)
    again = cached_surface(tiny_llama.backend, "k", tmp_path)  # read back, checked, not measured again
    assert again.record() == first.record() and len(checked) == 1 and checked[0][0] == again.ms(1, 1)


class Loaded:
    """A backend on a fake clock whose pass costs 1 + w/10 ms, three times that in the passes ``busy`` holds."""

    def __init__(self, busy=range(0)):
        self.now, self.passes, self.busy, self.device = 0.0, 0, busy, torch.device("cpu")
        self.config = SimpleNamespace(vocab_size=64)

    def new_cache(self):
        return SimpleNamespace(crop=lambda columns: None)

    def forward(self, ids, cache, *, positions=None, mask=None, keep=1):
        self.now += (1.0 + ids.shape[1] / 10) * (3.0 if self.passes in self.busy else 1.0) / 1000
        self.passes += 1
        return torch.zeros(ids.shape[0], keep, 8)


QUIET = [[1.1, 1.2, 1.4], [1.1, 1.2, 1.4]]  # Loaded's costs, ms by width 1, 2, 4 at rows 1 and 4


def flat(grid):
    return [x for line in grid for x in line]


def test_a_row_count_measured_under_load_is_measured_again(monkeypatch):
    # two prefills, then 7 rounds x 3 widths x 2 passes for 1 row (passes 2-43), then as many for 4 rows: loaded
    backend = Loaded(busy=range(44, 86))
    monkeypatch.setattr(time, "perf_counter", lambda: backend.now)
    surface = measure(backend, rows=(1, 4), widths=(1, 2, 4), context=8, rounds=5)
    assert flat(surface.grid) == pytest.approx(flat(QUIET))
    monkeypatch.setattr(surface_module, "RECHECKS", 0)  # without the check, the load stays in the surface
    backend = Loaded(busy=range(44, 86))
    surface = measure(backend, rows=(1, 4), widths=(1, 2, 4), context=8, rounds=5)
    assert surface.grid[1] == pytest.approx([3.3, 3.6, 4.2])


@pytest.mark.parametrize("kept_share, measured", [(3.0, True), (1.0, False), (0.5, False)])
def test_a_kept_surface_that_load_slowed_is_measured_again(monkeypatch, tmp_path, kept_share, measured):
    backend = Loaded()
    monkeypatch.setattr(time, "perf_counter", lambda: backend.now)
    monkeypatch.setattr(surface_module, "measure", functools.partial(measure, rows=(1, 4), widths=(1, 2, 4), rounds=5))
    kept = Surface((1, 4), (1, 2, 4), [[x * kept_share for x in line] for line in QUIET])
    (tmp_path / surface_module.SURFACE_FILE).write_text(json.dumps({f"k|surface={surface_module.SURFACE_VERSION}":
                                                                      kept.record()}))
    found = cached_surface(backend, "k", tmp_path)
    assert flat(found.grid) == pytest.approx(flat(QUIET if measured else kept.grid))
    stored = json.loads((tmp_path / surface_module.SURFACE_FILE).read_text())
    assert flat(Surface.from_record(next(iter(stored.values()))).grid) == pytest.approx(flat(found.grid))


class AfterWide:
    """A backend on a fake clock whose pass costs 1 + w/10 ms, half as much again in the ``lasting`` passes after a
    pass of 16+ (on this project's VMs a pass runs slower for several passes after a long one)."""

    def __init__(self, lasting=1):
        self.now, self.since, self.lasting, self.device = 0.0, lasting, lasting, torch.device("cpu")
        self.config = SimpleNamespace(vocab_size=64)

    def new_cache(self):
        return SimpleNamespace(crop=lambda columns: None)

    def forward(self, ids, cache, *, positions=None, mask=None, keep=1):
        width = ids.shape[1]
        self.now += (1.0 + width / 10) * (1.5 if self.since < self.lasting else 1.0) / 1000
        self.since = 0 if width >= 16 else self.since + 1
        return torch.zeros(ids.shape[0], keep, 8)


def test_the_passes_after_the_widest_do_not_set_the_narrow_widths_price(monkeypatch):
    backend = AfterWide()
    monkeypatch.setattr(time, "perf_counter", lambda: backend.now)
    surface = measure(backend, rows=(1, 4), widths=(1, 2, 4, 32), context=8, rounds=5)
    for rows in (1, 4):
        assert [surface.ms(rows, w) for w in (1, 2, 4, 32)] == pytest.approx([1.1, 1.2, 1.4, 4.2])


def test_a_slowness_that_lingers_after_the_widest_pass_does_not_price_the_one_token_pass(monkeypatch):
    # three passes slowed after each 32-token one: a round from narrow to wide timed the next round's one-token pass
    # second after it (1.65 ms), and a 2-token pass looked 0.73x of it
    backend = AfterWide(lasting=3)
    monkeypatch.setattr(time, "perf_counter", lambda: backend.now)
    surface = measure(backend, rows=(1, 4), widths=(1, 2, 4, 6, 8, 32), context=8, rounds=5)
    for rows in (1, 4):
        assert [surface.ms(rows, w) for w in (1, 2, 4, 6)] == pytest.approx([1.1, 1.2, 1.4, 1.6])


# -- the controller ----------------------------------------------------------------------------------
def test_controller_feeds_full_width_where_width_is_free_and_one_where_it_costs_linearly():
    rows = [Hits(3) for _ in range(4)]  # the prior: one candidate in two holds
    assert WidthController(FREE, 4).choose(rows, [9] * 4, 0.9) == 4
    assert WidthController(LINEAR, 4).choose(rows, [9] * 4, 0.9) == 1
    assert WidthController(None, 4).choose(rows, [9] * 4, 0.9) == 4  # no surface: width taken to be free
    assert WidthController(FREE, 4).choose(rows, [9] * 4, 1.0) == 1  # tau 1.0: only candidate 1 can pass


def test_the_rates_are_each_widths_expected_tokens_over_the_price_of_its_steady_columns():
    """The documented rate, written out: at width w each row commits the sum of its first min(w, cap) reach
    terms, and the pass feeds n_w - 1 + w columns, n_w what the row that accepts most is expected to accept."""
    rng = random.Random(0)
    surface = Surface.from_cost(lambda r, w: 3.0 + r * (1 + 0.4 * w), rows=ROWS, widths=WIDTHS, name="by columns")
    controller = WidthController(surface, 4)
    for rows in (1, 3, 8):
        hits = [Hits(3, start=([rng.random() for _ in range(3)], [1.0] * 3)) for _ in range(rows)]
        caps = [rng.choice([1, 2, 3, 9]) for _ in range(rows)]
        reach = [h.reach(4) for h in hits]
        for width, rate in controller.rates(hits, caps).items():
            widths = [min(width, cap) for cap in caps]
            tokens = sum(sum(r[:w]) for r, w in zip(reach, widths))
            most = sum(1 - math.prod(1 - r[k] for r, w in zip(reach, widths) if k < w) for k in range(width))
            assert rate == pytest.approx(tokens / surface.ms(rows, most - 1 + width))


def test_a_pass_that_offered_no_row_a_mask_leaves_each_row_as_observing_it_one_by_one_would():
    controller = WidthController(FREE, 4)
    apart, together = [controller.new_row(0.9) for _ in range(3)], [controller.new_row(0.9) for _ in range(3)]
    for offered in (3, 0, 0, 2, 0):
        accepted = [1 + min(offered, i) for i in range(3)]
        for row, tokens in zip(apart, accepted):
            controller.observe(row, 0.9, offered, tokens - 1)
        controller.observe_pass(together, 0.9, [1 + offered] * 3, accepted)
    assert [r.reach(4) for r in apart] == [r.reach(4) for r in together]


def test_controller_follows_each_rows_acceptance():
    curve = Surface.from_cost(lambda r, w: 10.0 + 1.0 * r * (w - 1), rows=ROWS, widths=WIDTHS, name="gentle")
    controller = WidthController(curve, 4)
    rows = [controller.new_row(0.9) for _ in range(2)]
    for _ in range(60):  # masks that never hold
        for row in rows:
            controller.observe(row, 0.9, 3, 0)
    assert controller.choose(rows, [9, 9], 0.9) == 1 and controller.gain(2, 0.9) == 1.0
    for _ in range(60):  # masks that always hold
        for row in rows:
            controller.observe(row, 0.9, 3, 3)
    assert controller.choose(rows, [9, 9], 0.9) == 4 and controller.gain(2, 0.9) > 1.0
    assert controller.new_row(0.9).share(0) > 0.5  # a new row starts from the pooled share at that tau


def test_where_width_costs_linearly_mars_feeds_width_1_and_equals_batched_ar(tiny_lm):
    ids = _ids(tiny_lm)
    narrow, events = _batch(tiny_lm, ids, 0.0, surface=LINEAR)
    assert all(step.width in (0, 1) for e in events[1:] for step in e.rows)  # every decoding pass: AR passes
    # Beside a prompt the masks cost next to nothing even here, so the prefill may accept several tokens; from
    # there on each row is greedy AR's continuation, token for token.
    first = [list(step.token_ids) for step in events[0].rows]
    for row, prompt, start in zip(narrow, ids, first):
        assert row[: len(start)] == start
        ar, _ = _batch(tiny_lm, [prompt + start], 1.0, max_new=NEW - len(start))
        assert row[len(start) :] == ar[0]


def test_where_width_is_free_mars_feeds_the_full_window(tiny_lm):
    ids = _ids(tiny_lm)
    wide, events = _batch(tiny_lm, ids, 0.0, surface=FREE)
    plain, _ = _batch(tiny_lm, ids, 0.0)  # no controller: the full window, as before
    assert wide == plain
    assert max(step.width for e in events[1:] for step in e.rows) == 4


class Schedule(WidthController):
    """A controller that hands out a fixed cycle of widths, pass after pass."""

    def __init__(self, widths):
        super().__init__(FREE, 4)
        self.widths, self.calls = widths, 0

    def choose(self, rows, caps, tau, fed=None, joins=0, static=False):
        self.calls += 1
        return self.widths[(self.calls - 1) % len(self.widths)]


def test_rows_of_different_widths_in_one_pass_each_equal_decoding_alone(tiny_lm):
    ids = _ids(tiny_lm)
    cycle = [4, 2, 1, 3]
    together, events = _batch(tiny_lm, ids, 0.2, controller=Schedule(cycle), max_new=9)  # rows accept unevenly
    mixed = [e for e in events if len({s.width for s in e.rows if s.width}) > 1]
    assert mixed, "the token limit should leave some rows narrower than others in some pass"
    for row, prompt in zip(together, ids):
        alone, _ = _batch(tiny_lm, [prompt], 0.2, controller=Schedule(cycle), max_new=9)
        assert row == alone[0]


GENTLE = Surface.from_cost(lambda r, w: 10.0 + 0.5 * r * w, rows=ROWS, widths=WIDTHS, name="gentle")


@pytest.mark.parametrize("surface", [FREE, LINEAR, GENTLE], ids=["free", "linear", "gentle"])
def test_verifying_passes_at_tau_1_with_the_controller_are_greedy_ar(tiny_lm, surface):
    """Exact mode, and hybrid mode at tau 1.0 (the same passes): greedy AR, whatever widths the controller picks."""
    surface = copy.copy(surface)  # its own pooled shares: what another model's drafts showed on it is not this one's
    ids = _ids(tiny_lm)
    ar, _ = _batch(tiny_lm, ids, 1.0)
    out, events = _batch(tiny_lm, ids, 1.0, surface=surface, verifying=True)
    assert out == ar
    widths = {s.width for e in events[1:] for s in e.rows if s.width}
    prefill = {s.width for s in events[0].rows}
    if surface.name == "free":
        assert max(widths) == 1 + 2 * 3  # full depth: the AR token, three drafts, three masks
        assert prefill == {1 + 3}  # the prompt's last token and a group of masks: the first drafts
    if surface.name == "linear":
        assert widths == {1} and prefill == {1}  # no draft pays: plain AR passes, and no masks to draft them


def test_exact_rows_under_the_controller_each_equal_decoding_alone(tiny_lm):
    ids = _ids(tiny_lm)
    together, _ = _batch(tiny_lm, ids, 1.0, surface=GENTLE, verifying=True)
    for row, prompt in zip(together, ids):
        alone, _ = _batch(tiny_lm, [prompt], 1.0, verifying=True)
        assert row == alone[0]


def test_stream_batch_prices_passes_only_with_auto_max_fed(tiny_llama):
    ids = _ids(tiny_llama)[:2]
    common = {"mask_id": tiny_llama.meta.mask_token_id, "block_size": 4, "surface": LINEAR}
    auto = list(stream_batch(tiny_llama.backend, tiny_llama.tokenizer, ids,
                             DecodeConfig(tau=0.0, max_new_tokens=8), **common))
    paper = list(stream_batch(tiny_llama.backend, tiny_llama.tokenizer, ids,
                              DecodeConfig(tau=0.0, max_new_tokens=8, max_fed=None), **common))
    assert max(s.width for e in auto[1:] for s in e.rows) == 1
    assert max(s.width for e in paper[1:] for s in e.rows) == 4


# -- policies and serving ----------------------------------------------------------------------------
def _load(queue, running, controller):
    return Load(queue, running, 8, None, 0.0, controller)


def test_adaptive_lowers_tau_only_where_wider_passes_pay():
    adaptive = parse_policy("adaptive")
    free, linear = WidthController(FREE, 4), WidthController(LINEAR, 4)
    assert adaptive(_load(0, 4, free)) == 1.0  # nobody waits: quality first, on any surface
    assert adaptive(_load(5, 8, free)) == 0.9  # a queue and free width: the ladder's tau
    assert adaptive(_load(5, 8, linear)) == 1.0  # a queue, but wider passes cost more than they return
    assert adaptive(_load(20, 8, None)) == 0.7  # no surface: width taken to be free
    assert parse_policy("fixed:0.9")(_load(5, 8, linear)) == 0.9  # fixed policies are not priced


@pytest.mark.parametrize("surface, widest", [(FREE, 4), (LINEAR, 1)])
def test_serving_with_the_controller_ends_every_request_once_with_its_widths(tiny_llama, surface, widest):
    ids = _ids(tiny_llama)
    loop = ServingLoop(
        tiny_llama.backend, mask_id=tiny_llama.meta.mask_token_id, pad_id=tiny_llama.tokenizer.pad_token_id,
        stop_ids=eos_ids(tiny_llama.backend, tiny_llama.tokenizer), policy=parse_policy("fixed:0.0"),
        config=ServeConfig(max_batch=3, max_new_tokens=10), surface=surface,
        pass_cost=lambda rows, width, kind, measured: surface.ms(rows, width) / 1000,
    )
    requests = [Request(i, tuple(p), 0.001 * i) for i, p in enumerate(ids * 2)]
    events = list(loop.run(requests))
    assert sorted(loop.served) == list(range(len(requests)))
    assert all(s.status == "done" and s.token_ids and s.trace for s in loop.served.values())
    decoding = [p.width for s in loop.served.values() for p in s.trace if p.kind == "decode"]
    assert max(decoding) == widest and min(decoding) >= 1
    assert all(e.why for e in events if e.width)


def test_affordable_rate_reads_batched_ar_off_the_surface():
    assert affordable_rate(LINEAR, 8, 50) == pytest.approx(8 / 81.0 * 1000 / 50)


def test_rows_that_join_a_priced_batch_decode_as_alone_at_their_widths(tiny_llama):
    from test_serving import alone_at

    ids = _ids(tiny_llama)
    mixed = Surface.from_cost(lambda r, w: 10.0 + 2.0 * r * w, rows=ROWS, widths=WIDTHS, name="mixed")
    loop = ServingLoop(
        tiny_llama.backend, mask_id=tiny_llama.meta.mask_token_id, pad_id=tiny_llama.tokenizer.pad_token_id,
        stop_ids=eos_ids(tiny_llama.backend, tiny_llama.tokenizer), policy=parse_policy("fixed:0.15"),
        config=ServeConfig(max_batch=3, max_new_tokens=12), surface=mixed,
        pass_cost=lambda rows, width, kind, measured: mixed.ms(rows, width) / 1000,
    )
    list(loop.run([Request(i, tuple(p), 0.002 * i) for i, p in enumerate(ids * 2)]))
    widths = {p.width for s in loop.served.values() for p in s.trace}
    assert len(widths) > 1  # the controller changed widths along the way
    for s in loop.served.values():
        assert s.token_ids == alone_at(tiny_llama, s.request.prompt, s.trace, max_new=12)


def test_newcomers_draft_in_their_prefill_only_where_the_batch_they_join_would_verify(tiny_llama):
    """A request prefilled alone feeds a group of masks (the first drafts) where drafting pays at one row; one
    that joins a running batch prices them at the rows it will be verified among, where here they do not pay."""
    alone_free = Surface.from_cost(lambda r, w: 10.0 + (0.0 if r == 1 else 5.0 * r * (w - 1)), rows=ROWS,
                                   widths=WIDTHS, name="free alone", simulated=False)
    loop = ServingLoop(
        tiny_llama.backend, mask_id=tiny_llama.meta.mask_token_id, pad_id=tiny_llama.tokenizer.pad_token_id,
        stop_ids=set(), policy=parse_policy("fixed:1.0"), surface=alone_free,
        config=ServeConfig(mode="exact", max_batch=4, max_new_tokens=24),
        pass_cost=lambda rows, width, kind, measured: alone_free.ms(rows, width) / 1000,
    )
    ids = _ids(tiny_llama)
    events = list(loop.run([Request(0, tuple(ids[0]), 0.0)] + [Request(i, tuple(p), 0.011 * i)
                                                                for i, p in enumerate(ids[1:], 1)]))
    joined = {i for e in events if e.running > len(e.admitted) for i in e.admitted}
    prefill = {i: s.trace[0] for i, s in loop.served.items()}
    assert all(p.kind == "prefill" for p in prefill.values())
    assert prefill[0].width > 1 and joined  # alone: masks after the prompt
    assert all(prefill[i].width == 1 for i in joined)


def test_single_sequence_mars_prices_its_width_on_the_measured_curve(tiny_llama, monkeypatch):
    from mars_demo.engine.backends.cpu.paths import ComputePath
    from mars_demo.engine.decoding.loop import collect, generate
    from mars_demo.ui.charts import width_text

    config = DecodeConfig(tau=0.0, block_size=4, max_new_tokens=NEW)
    linear = ComputePath(path="fp32", requested="fp32", costs_ms={w: 1.0 + 10.0 * w for w in range(1, 9)})
    monkeypatch.setattr(tiny_llama, "compute", linear)
    steps = collect(generate(tiny_llama, PROMPTS[0], config)).steps
    assert {s.width for s in steps[1:]} == {1} and width_text(steps) == "1"  # no mask pays: AR passes
    flat = ComputePath(path="fp32", requested="fp32", costs_ms={w: 10.0 for w in range(1, 9)})
    monkeypatch.setattr(tiny_llama, "compute", flat)
    steps = collect(generate(tiny_llama, PROMPTS[0], config)).steps
    assert max(s.width for s in steps[1:]) == 4 and width_text(steps).startswith(("1–4", "2–4", "3–4", "4"))


def test_a_measured_point_above_a_larger_pass_is_bounded_by_it():
    from mars_demo.engine.decoding.surface import monotone

    noisy = [[3.9, 3.9, 4.1], [10.0, 7.5, 9.3]]  # 2 rows x 1 token measured during a burst of other load
    assert monotone(noisy) == [[3.9, 3.9, 4.1], [7.5, 7.5, 9.3]]
    assert monotone([[5.0, 4.0], [3.0, 6.0]]) == [[3.0, 4.0], [3.0, 6.0]]  # bounded by the taller pass too


def test_the_controller_corrects_a_measured_surface_by_the_passes_it_sees():
    flat = Surface.from_cost(lambda r, w: 5.0 + 0.1 * r * w, rows=ROWS, widths=WIDTHS, name="m", simulated=False)
    controller = WidthController(flat, 4)
    rows = [Hits(3) for _ in range(4)]
    assert controller.choose(rows, [9] * 4, 0.9) > 1  # priced as nearly free
    for _ in range(60):  # but wide passes take three times their price here, one-token passes their price
        controller.passed(4, 3, 3 * flat.ms(4, 3) / 1000)
        controller.passed(4, 1, flat.ms(4, 1) / 1000)
    assert controller.prices.of(4)[True] == pytest.approx(3.0, rel=0.01) and controller.choose(rows, [9] * 4, 0.9) == 1
    simulated = WidthController(FREE, 4)  # a cost model's surface is the clock itself: never corrected
    simulated.passed(4, 3, 1.0)
    assert simulated.prices.of(4)[True] == 1.0


def _passes(controller: WidthController, rows: list[Hits], n: int, ms) -> list[int]:
    """``n`` passes at tau 0.9, each asking for its width first (as a batch's does) and taking ``ms(width)``."""
    widths = []
    for _ in range(n):
        widths.append(controller.choose(rows, [9] * len(rows), 0.9))
        controller.passed(len(rows), widths[-1], ms(widths[-1]) / 1000)
    return widths


def test_a_wide_ratio_raised_by_a_burst_drifts_back_once_wide_passes_stop():
    gentle = Surface.from_cost(lambda r, w: 5.0 + 0.2 * r * w, rows=ROWS, widths=WIDTHS, name="m", simulated=False)
    controller = WidthController(gentle, 4)
    rows = [Hits(3) for _ in range(2)]
    assert controller.choose(rows, [9] * 2, 0.9) > 1
    for _ in range(30):  # a burst of other load: wide passes read three times their price
        controller.passed(2, 3, 3 * gentle.ms(2, 3) / 1000)
    assert controller.choose(rows, [9] * 2, 0.9) == 1
    # one-token passes at their price: the wide ratio is not measured, and a short run says nothing
    assert set(_passes(controller, rows, Prices.STALE, lambda w: gentle.ms(2, w))) == {1}
    assert controller.prices.of(2)[True] == pytest.approx(3.0, rel=0.05)
    widths = _passes(controller, rows, 40, lambda w: gentle.ms(2, w))  # the burst is over
    assert widths[-1] > 1 and controller.prices.of(2)[True] < 1.1  # tried again, and its price is right again


def test_a_one_token_ratio_raised_by_a_burst_stops_keeping_wide_passes_on():
    steep = Surface.from_cost(lambda r, w: 5.0 + 2.0 * (w - 1) * r, rows=ROWS, widths=WIDTHS, name="m", simulated=False)
    controller = WidthController(steep, 4)
    rows = [Hits(3) for _ in range(2)]
    assert controller.choose(rows, [9] * 2, 0.9) == 1  # masks do not pay on this surface
    # a burst of other load: one-token passes read three times their price, and wide ones come to pay
    assert _passes(controller, rows, 30, lambda w: (3 if w == 1 else 1) * steep.ms(2, w))[-1] > 1
    widths = _passes(controller, rows, Prices.STALE + 40, lambda w: steep.ms(2, w))  # the burst is over
    assert controller.prices.of(2)[False] < 1.1 and widths[-1] == 1


def test_masks_beside_a_prompt_are_fed_where_their_tokens_are_worth_what_they_add():
    steep = Surface.from_cost(lambda r, w: 5.0 + 0.5 * r * w, rows=ROWS, widths=WIDTHS, name="m", simulated=False)

    def rows_holding(share):
        controller = WidthController(copy.copy(steep), 4)
        rows = [controller.new_row(0.9) for _ in range(8)]
        for _ in range(400):
            for row in rows:
                controller.observe(row, 0.9, 3, int(random.random() < share) * 3)
        return controller, rows

    random.seed(0)
    controller, rows = rows_holding(0.2)  # a fifth of masks hold: each costs 4 ms a column for ~1.6 tokens worth 1.1
    assert controller.choose(rows, [9] * 8, 0.9, fed=60) == 1
    # (priced as a pass's rate, a column beside 60 costs 1.6%: the prefill used to feed every mask here)
    controller, rows = rows_holding(0.9)  # nine in ten hold: the masks bring more than they add
    assert controller.choose(rows, [9] * 8, 0.9, fed=60) > 1 and controller.last[1] > 1.0


def test_a_newcomers_prefill_masks_are_valued_at_the_rows_it_joins():
    """A token is worth less time among 8 decoding rows than alone: masks that pay beside a lone row's prompt do
    not pay in the prefill of a row that joins 7 running ones."""
    steep = Surface.from_cost(lambda r, w: 5.0 + 1.0 * r * w, rows=ROWS, widths=WIDTHS, name="m", simulated=False)
    controller = WidthController(steep, 4)
    row = controller.new_row(0.9)
    random.seed(0)
    for _ in range(400):
        controller.observe(row, 0.9, 3, int(random.random() < 0.6) * 3)
    assert controller.choose([row], [9], 0.9, fed=60) > 1
    assert controller.choose([row], [9], 0.9, fed=60, joins=7) == 1


def test_a_width_1_choice_nothing_came_near_stands_for_recheck_passes_or_until_a_row_shows_something():
    dear = Surface.from_cost(lambda r, w: 5.0 + (w - 1) * r, rows=ROWS, widths=WIDTHS, name="m", simulated=False)
    controller = WidthController(dear, 4)  # one mask in two does not pay here; every mask held does
    read = []

    class Counted(Hits):
        def reach(self, most):
            read.append(self)
            return super().reach(most)

    rows = [Counted(3, 0.95) for _ in range(2)]
    assert controller.choose(rows, [9] * 2, 0.9) == 1 and len(read) == 2  # each row read once
    for _ in range(WidthController.RECHECK - 1):  # AR passes: the rows are not read again
        for row in rows:
            row.observe(0, 0)
        assert controller.choose(rows, [9] * 2, 0.9) == 1
    assert len(read) == 2
    assert controller.choose(rows, [9] * 2, 0.9) == 1 and len(read) == 4  # RECHECK passes on: read again
    assert controller.choose(rows, [9] * 2, 0.7) == 1 and len(read) == 6  # another tau: chosen again
    controller.choose(rows[:1], [9], 0.7)  # as many rows no more: chosen again
    assert len(read) == 7
    for _ in range(60):  # the rows' masks start to hold (a prefill's): the next choice reads them at once
        for row in rows:
            controller.observe(row, 0.7, 3, 3)
    assert controller.choose(rows, [9] * 2, 0.7) > 1


def test_verifying_and_window_passes_keep_their_own_price_corrections():
    measured = Surface.from_cost(lambda r, w: 5.0 + 0.1 * r * w, rows=ROWS, widths=WIDTHS, name="m", simulated=False)
    window, verifying = WidthController(measured, 4), WidthController(measured, 4, verifying=True)
    for _ in range(40):
        verifying.passed(2, 4, 2 * measured.ms(2, 4) / 1000)  # verifying passes' masks cost twice their price
    assert verifying.prices.of(2)[True] == pytest.approx(2.0, rel=0.05) and window.prices.of(2)[True] == 1.0
    assert WidthController(measured, 4, verifying=True).prices is verifying.prices  # shared on the surface


def test_a_verifying_batch_starts_from_the_drafts_earlier_batches_held():
    measured = Surface.from_cost(lambda r, w: 5.0 + 0.1 * r * w, rows=ROWS, widths=WIDTHS, name="m", simulated=False)
    first = WidthController(measured, 4, verifying=True)
    assert first.start_drafts(3) == ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])  # nothing seen yet: the prior
    for _ in range(200):
        first.observe_drafts(3, 3)  # every draft held
        first.observe_drafts(0, 0)  # a row without drafts shows nothing
    held, tried = WidthController(measured, 4, verifying=True).start_drafts(3)
    assert tried == [2.0] * 3 and all(h > 1.8 for h in held)
    costs = {1: 5.0, 4: 8.5, 7: 12.0, 10: 15.5}  # a draft pays only if more than 7 in 10 hold
    pooled, prior = DraftDepth(3, costs, (held, tried)), DraftDepth(3, costs)
    assert pooled.layout()[0] > 0
    for depths in (pooled, prior):
        for _ in range(6):  # a new batch's first drafts all miss: plain AR passes
            depths.observe(1, 0)
        assert depths.layout()[0] == 0
    # AR passes fade the counts back to where they started: the pooled share drafts again, the prior never would
    assert any(pooled.layout()[0] > 0 for _ in range(40))
    assert not any(prior.layout()[0] > 0 for _ in range(40))


def test_a_row_narrowed_to_ar_passes_is_offered_a_mask_again_later():
    controller = WidthController(copy.copy(GENTLE), 4)  # its own pooled shares: none seen yet, so the prior
    row = controller.new_row(0.9)
    for _ in range(30):  # a hard stretch: masks never hold
        controller.observe(row, 0.9, 3, 0)
    assert controller.choose([row], [99], 0.9) == 1
    for _ in range(100):  # width-1 passes show nothing: the estimate relaxes toward the prior
        controller.observe(row, 0.9, 0, 0)
        if controller.choose([row], [99], 0.9) > 1:
            break
    assert controller.last[0] > 1


def test_a_row_relaxes_back_to_the_share_its_batch_showed_not_to_the_prior():
    surface = Surface.from_cost(lambda r, w: 10.0 + (w - 1) * r, rows=ROWS, widths=WIDTHS, name="m", simulated=False)
    controller = WidthController(surface, 4)
    assert controller.choose([controller.new_row(0.9) for _ in range(2)], [99] * 2, 0.9) > 1  # one in two pays
    seen = controller.new_row(0.9)
    for i in range(300):  # the batch's rows so far: one mask in five holds, which does not pay here
        controller.observe(seen, 0.9, 1, int(i % 5 == 0))
    rows = [controller.new_row(0.9) for _ in range(2)]
    assert controller.choose(rows, [99] * 2, 0.9) == 1
    for _ in range(200):  # plain AR passes: each row relaxes toward the batch's share, so stays narrow
        for row in rows:
            controller.observe(row, 0.9, 0, 0)
        assert controller.choose(rows, [99] * 2, 0.9) == 1


def test_idle_passes_pull_a_row_toward_the_prior_as_one_at_a_time_would():
    row, held, tried = Hits(3, 0.9), 1.0, 2.0  # the prior's pseudo-counts
    for _ in range(20):
        row.observe(3, 0)  # masks that never hold
    h, t = row.held[0], row.tried[0]
    for _ in range(15):  # width-1 passes: each pulls a tenth of the way back to the prior
        row.observe(0, 0)
        h, t = 0.9 * h + 0.1 * held, 0.9 * t + 0.1 * tried
    assert row.share(0) == pytest.approx(h / t, rel=1e-12)
    row.observe(1, 1)  # the next real pass counts after the pull
    assert row.tried[0] == pytest.approx(0.9 * t + 1, rel=1e-12)
    assert row.held[0] == pytest.approx(0.9 * h + 1, rel=1e-12)


def test_prices_are_corrected_apart_for_each_row_count():
    measured = Surface.from_cost(lambda r, w: 5.0 + 0.1 * r * w, rows=ROWS, widths=WIDTHS, name="m", simulated=False)
    controller = WidthController(measured, 4)
    for _ in range(40):
        controller.passed(4, 3, 2 * measured.ms(4, 3) / 1000)  # wide passes over 4 rows at twice their price
        controller.passed(2, 3, measured.ms(2, 3) / 1000)  # over 2 rows at their price
    assert controller.prices.of(4)[True] == pytest.approx(2.0, rel=0.05)
    assert controller.prices.of(2)[True] == pytest.approx(1.0, rel=0.01)
    assert controller.prices.of(7) == {False: 1.0, True: 1.0}  # a count not seen yet: the surface as measured


def test_what_the_passes_after_a_wide_one_cost_over_their_price_is_charged_to_it():
    """As on a 2-core Xeon: the one-token passes right after a wide pass run ~25% over their price, less each pass
    (scripts/batch_turns.py --after-wide). The wide pass is priced with that, the one-token pass is not."""
    slowed, level = Prices(), Prices()
    for prices in (slowed, level):
        for _ in range(40):
            prices.seen(8, False, 1.0)
        prices.seen(8, True, 1.1, columns=2, dearer=1.4)  # a look after a long run: counted for half
    after = [1.25, 1.2, 1.15, 1.1, 1.05, 1.02, 1.3]  # the last one past AFTER: load, not the wide pass
    for ratio in after:
        slowed.seen(8, False, ratio)
        level.seen(8, False, 1.0)
    charged = 0.5 * sum(r - 1.0 for r in after[: Prices.AFTER]) / 1.4  # in the wide pass's own price
    assert slowed.factor(8, 2) == pytest.approx(level.factor(8, 2) + charged)
    assert slowed.factor(8, 1) == pytest.approx(0.9 * 1.0 + 0.1 * 1.3)  # only the pass past AFTER moved it


def test_a_wide_pass_is_priced_by_the_ratio_of_its_own_width_and_between_the_widths_seen():
    prices = Prices()
    for _ in range(60):  # one-token passes at their price, 3-column ones at 1.3x theirs
        prices.seen(4, False, 1.0)
        prices.seen(4, True, 1.3, columns=3)
    assert prices.factor(4, 1) == pytest.approx(1.0, rel=0.01) and prices.factor(4, 3) == pytest.approx(1.3, rel=0.01)
    assert prices.factor(4, 2) == pytest.approx(1.15, rel=0.01)  # not seen: between the two
    assert prices.factor(4, 2.5) == pytest.approx(1.225, rel=0.01)
    assert prices.factor(4, 9) == pytest.approx(1.3, rel=0.01)  # past the widest seen: its ratio
    assert prices.factor(2, 2) == 1.0  # a row count not seen: the surface as measured
    for _ in range(60):  # 2-column passes at 1.05x their price
        prices.seen(4, True, 1.05, columns=2)
    assert prices.factor(4, 2) == pytest.approx(1.05, rel=0.01) and prices.factor(4, 3) == pytest.approx(1.3, rel=0.01)


def test_a_price_gone_unmeasured_is_looked_at_once_where_its_kind_comes_near():
    # a mask in two holds: priced here, a width-2 pass promises ~0.92x the rate of one-token passes
    dear = Surface.from_cost(lambda r, w: 5.0 + 0.9 * (w - 1) * r, rows=ROWS, widths=WIDTHS, name="m", simulated=False)
    controller = WidthController(dear, 4)
    rows = [Hits(3) for _ in range(2)]
    assert controller.choose(rows, [9] * 2, 0.9) == 1 and controller.prices.due(2) is None
    # one-token passes at their price: the wide price is not measured meanwhile
    assert set(_passes(controller, rows, Prices.STALE, lambda w: dear.ms(2, w))) == {1}
    assert controller.prices.due(2) is True
    for _ in range(WidthController.RECHECK):  # the width-1 choice that stands runs out
        if (width := controller.choose(rows, [9] * 2, 0.9)) > 1:
            break
        controller.passed(2, 1, dear.ms(2, 1) / 1000)
    assert width > 1  # a look: near enough to what it would cost if the surface were off
    gain = controller.last[1]
    assert controller.settle(2, gain) and controller.settle(2, gain, first=0.1)
    assert not controller.settle(2, gain, first=0.4)  # a verifying look whose draft-only first pass is dear: none
    assert controller.settle(2, 1.2, first=0.4)  # but a wide pass that pays is taken whatever its first pass costs
    controller.passed(2, width, 0.5 * dear.ms(2, width) / 1000)  # and wide passes cost half their price today
    assert controller.prices.due(2) is None and controller.prices.of(2)[True] == pytest.approx(0.75)
    assert controller.choose(rows, [9] * 2, 0.9) > 1  # they pay: taken from now on
    # far from paying, no look: a linear surface's widths promise under half the one-token rate
    steep = Surface.from_cost(lambda r, w: 1.0 + 10.0 * r * w, rows=ROWS, widths=WIDTHS, name="m", simulated=False)
    linear = WidthController(steep, 4)
    for _ in range(Prices.STALE + 1):
        linear.passed(2, 1, steep.ms(2, 1) / 1000)
    assert linear.prices.due(2) is True and linear.choose(rows, [9] * 2, 0.9) == 1


def _near_exact_batch(lm) -> tuple[WidthController, TokenBatch]:
    """Two rows in exact mode past their prefill (priced apart), on a surface where, at the prior's one draft in two,
    a draft's layout promises ~0.98x plain passes' rate, near enough for a look, and the look's first pass (drafting
    only, as after plain passes no row has drafts) costs 0.28 more than a plain one."""
    near = Surface.from_cost(lambda r, w: 5.0 + 0.7 * r * (w - 1), rows=ROWS, widths=WIDTHS, name="m", simulated=False)
    controller = WidthController(near, 4, verifying=True)
    batch = TokenBatch(
        lm.backend, _ids(lm)[:2], DecodeConfig(mode="exact", max_new_tokens=NEW), block_size=4,
        mask_id=lm.meta.mask_token_id, pad_id=lm.tokenizer.pad_token_id, controller=controller,
    )
    batch.passes = 1
    return controller, batch


def test_a_plain_verifying_pass_stands_where_a_due_look_would_only_draft_at_a_dear_first_pass(tiny_llama, monkeypatch):
    controller, batch = _near_exact_batch(tiny_llama)
    controller.prices.runs[2] = (False, Prices.STALE)  # one-token passes only for STALE passes: the wide price is due
    weighed, layout = [], batch.depths.layout
    monkeypatch.setattr(batch.depths, "layout", lambda kinds: weighed.append(kinds) or layout(kinds))
    chosen = [batch._layout(1.0).depth for _ in range(WidthController.RECHECK + 2)]
    best, rate, plain = batch.depths.weighed
    assert NEAR <= rate / plain < GAIN and controller.prices.due(2) is True
    assert chosen == [0] * len(chosen)  # no look: its first pass would only draft, at 1.28x a plain pass
    assert len(weighed) == 2  # so the plain choice stood for RECHECK passes instead of being weighed every pass
    batch.plain, batch.drafts[0] = Standing(), [5]  # with a draft in hand the look's first pass verifies: it is taken
    assert batch._layout(1.0) == best


def test_a_dear_look_waits_as_much_longer_and_then_verifies_what_it_drafted(tiny_llama, monkeypatch):
    controller, batch = _near_exact_batch(tiny_llama)  # a look's first pass costs 0.28 more, 1.4x FIRST
    controller.prices.runs[2] = (False, Prices.STALE)
    assert batch._layout(1.0).depth == 0  # weighed: a draft's layout comes near, its first pass is dear
    best, rate, plain = batch.depths.weighed
    first = batch.depths.cost(1 + best.depth) / batch.depths.cost(1) - 1
    assert first > FIRST and NEAR <= rate / plain < GAIN
    wait = math.ceil(Prices.STALE * first / FIRST)  # one-token passes before such a look: its cost spread as thin
    for run, looks in ((wait - 1, False), (wait, True)):
        batch.plain = Standing()
        controller.prices.runs[2] = (False, run)
        assert (batch._layout(1.0).depth > 0) == looks, run
    weighed = []
    monkeypatch.setattr(batch.depths, "layout", lambda kinds: weighed.append(kinds))
    assert batch._layout(1.0) == best and not weighed  # the pass after the look verifies its drafts, unweighed
    controller.prices.runs[2] = (True, 1)  # (as the look's pass leaves the runs)
    assert not controller.spaced(2, 0.0)  # and no look is due from a run of wide passes


def test_a_batch_prices_a_draftless_row_at_the_width_its_drafting_rows_feed():
    costs = {1: 10.0, 2: 10.5, 3: 11.0, 4: 13.0, 5: 16.0, 7: 20.0, 10: 25.0}
    depths = DraftDepth(3, costs)  # at the prior: one draft in two held
    alone = depths.rate(1, False)  # one row: after a miss the next pass feeds 2 tokens
    depths.rows = 4
    assert depths.rate(1, False) == pytest.approx((1.5 + 0.5) / (1.5 * costs[3]))  # in a batch it rides at 3
    assert depths.rate(1, False) < alone and depths.rate(1, True) == pytest.approx(1.5 / costs[4])
    assert depths.layout() == (1, False, True)  # one draft without fallback masks pays best on this curve


def test_where_three_tokens_a_row_cost_much_more_than_two_a_batch_verifies_and_drafts_in_turns():
    jump = {1: 10.0, 2: 10.5, 3: 16.0, 4: 20.0, 5: 24.0, 7: 32.0, 10: 44.0}
    depths = DraftDepth(3, jump)  # at the prior: one draft in two held
    depths.rows = 4
    everything = (exact.WITH_FALLBACK, exact.CHAIN, exact.IN_TURNS)
    assert depths.rate(1, False, False) == pytest.approx((1.5 + 1) / (2 * jump[2]))  # a verifying and a drafting pass
    assert depths.layout() == (0, True, True)  # the chain's passes (3 tokens a row and up) do not pay: AR passes
    assert depths.layout(everything) == (1, False, False)  # passes in turns, 2 tokens a row each, do
    flat = DraftDepth(3, {w: 10.0 for w in range(1, 11)})
    flat.rows = 4
    assert flat.layout(everything) == (3, True, True)  # where width is free the fallback group still pays most


def test_exact_batches_in_turns_are_greedy_ar(tiny_lm, monkeypatch):
    from mars_demo.engine.decoding.batch import token

    costs = {1: 10.0, 2: 10.5, 3: 16.0, 4: 20.0, 5: 24.0, 7: 32.0, 10: 44.0, 16: 68.0}
    jump = Surface.from_cost(lambda r, w: costs[w], rows=ROWS, widths=tuple(costs), name="jump")
    seen, verify_block = [], token.verify_block
    monkeypatch.setattr(token, "verify_block", lambda *a: seen.append(a[-1]) or verify_block(*a))
    ids = _ids(tiny_lm)
    ar, _ = _batch(tiny_lm, ids, 1.0)
    out, events = _batch(tiny_lm, ids, 1.0, surface=jump, verifying=True)
    assert False in seen and out == ar  # passes in turns (no masks beside the drafts), greedy AR's text
    widths = {step.width for event in events[1:] for step in event.rows if step.token_ids}
    assert widths <= {1, 2}  # every row fed its pending token and one draft or one mask


def test_verifying_batches_share_what_their_layouts_yielded_and_stay_greedy_ar():
    lm = make_lm("llama")  # whose masks guess right often enough for drafts to pay: a bias towards four tokens
    bias = torch.zeros(lm.model.config.vocab_size)
    bias[[50, 60, 70, 80]] = 7.0
    lm.model.lm_head.bias = torch.nn.Parameter(bias)
    flat = Surface.from_cost(lambda r, w: 10.0, rows=ROWS, widths=WIDTHS, name="yields")
    ids = _ids(lm)
    ar, _ = _batch(lm, ids, 1.0)
    first = WidthController(flat, 4, verifying=True)
    out, _ = _batch(lm, ids, 1.0, verifying=True, controller=first)
    yields = first.draft_yields()
    assert out == ar and yields.sums  # passes of a weighed drafting layout were counted, the text is AR's
    assert all(0 < realized and 0 < expected for realized, expected in yields.sums.values())
    before = copy.deepcopy(yields.sums)
    again = WidthController(flat, 4, verifying=True)
    assert again.draft_yields() is yields  # a later batch on this surface starts from them
    # one row: drafts that hold this rarely do not pay in a static batch of four once its rows drift apart (drift.py)
    out, _ = _batch(lm, ids[:1], 1.0, verifying=True, controller=again)
    assert out == ar[:1] and yields.sums != before


def test_exact_batches_without_fallback_masks_are_greedy_ar(tiny_lm, monkeypatch):
    from mars_demo.engine.decoding.batch import token

    costs = {1: 10.0, 2: 10.5, 3: 11.0, 4: 13.0, 5: 16.0, 7: 20.0, 10: 25.0, 16: 40.0}
    widths = tuple(costs)
    no_fallback = Surface.from_cost(lambda r, w: costs[w], rows=ROWS, widths=widths, name="no fallback")
    seen, verify_block = [], token.verify_block

    def recorded(*args):
        seen.append(args[-2])  # whether the pass fed the fallback group
        return verify_block(*args)

    monkeypatch.setattr(token, "verify_block", recorded)
    ids = _ids(tiny_lm)
    ar, _ = _batch(tiny_lm, ids, 1.0)
    out, _ = _batch(tiny_lm, ids, 1.0, surface=no_fallback, verifying=True)
    assert False in seen and out == ar


def test_a_policys_gain_stands_for_recheck_questions_or_until_a_row_shows_something():
    gentle = Surface.from_cost(lambda r, w: 5.0 + 0.2 * r * w, rows=ROWS, widths=WIDTHS, name="m", simulated=False)
    controller = WidthController(gentle, 4)
    first = controller.gain(2, 0.9)
    assert first > 1.0  # the prior's one in two pays on this gentle surface
    for _ in range(40):  # wide passes turn out to cost four times their price: a gain read now would be none
        controller.passed(2, 3, 4 * gentle.ms(2, 3) / 1000)
    answers = [controller.gain(2, 0.9) for _ in range(WidthController.RECHECK)]
    assert answers[:-1] == [first] * (WidthController.RECHECK - 1) and answers[-1] == 1.0  # then read again
    for _ in range(20):  # every mask holds (shown through observe): the next question reads it at once
        controller.observe(controller.new_row(0.9), 0.9, 3, 3)
        controller.passed(2, 3, gentle.ms(2, 3) / 1000)  # and wide passes cost their price again
    assert controller.gain(2, 0.9) > 1.0
