"""One home per concept: the metric definitions, the commit cut, the pad id and the text table."""

from __future__ import annotations

import pytest

from mars_demo.engine.decoding.batch.events import BatchStats
from mars_demo.engine.decoding.chat import pad_id
from mars_demo.engine.decoding.commit import commit_tokens, cut_at_stop_string
from mars_demo.engine.decoding.loop import RunStats
from mars_demo.engine.decoding.metrics import (
    Rates,
    agreement,
    delta_nll_key,
    exact_match,
    per_forward,
    per_second,
    pooled_nll,
    prefix_agreement,
    speedup,
)
from mars_demo.research.tables import text_table


def test_rates_pool_token_weighted_not_averaged():
    short, long = Rates(2, 1, 1.0), Rates(10, 10, 1.0)  # 2.0 and 1.0 tokens per forward
    pooled = Rates.pool([short, long])
    assert (pooled.tokens, pooled.forward_passes, pooled.seconds) == (12, 11, 2.0)
    assert pooled.tokens_per_forward == pytest.approx(12 / 11)  # not (2.0 + 1.0) / 2
    assert pooled.tokens_per_second == pytest.approx(6.0)
    assert Rates().tokens_per_forward == 0.0 and Rates().tokens_per_second == 0.0
    assert per_forward(3, 0) == 0.0 and per_second(3, 0.0) == 0.0
    assert Rates(3, 2, 0.5).record() == {
        "tokens": 3, "forward_passes": 2, "seconds": 0.5, "tokens_per_forward": 1.5, "tokens_per_second": 6.0,
    }


def test_run_stats_are_rates_with_a_finish_reason():
    stats = RunStats(6, 3, 0.5, "eos")
    assert isinstance(stats, Rates) and stats.finish_reason == "eos"
    assert stats.tokens_per_forward == 2.0 and stats.tokens_per_second == 12.0


def test_batch_tokens_per_forward_is_token_weighted_over_rows():
    rows = (RunStats(8, 2, 1.0, "length"), RunStats(1, 1, 0.5, "eos"))  # 4.0 and 1.0 per pass
    stats = BatchStats(rows, forward_passes=2, seconds=1.0)
    assert stats.tokens == 9
    assert stats.tokens_per_forward == pytest.approx(9 / 3)  # not the mean of 4.0 and 1.0
    assert stats.tokens_per_second == pytest.approx(9.0)  # on the batch's wall clock


def test_speedup_is_a_tokens_per_second_ratio():
    assert speedup(Rates(20, 10, 1.0), Rates(10, 10, 1.0)) == pytest.approx(2.0)
    assert speedup(30.0, 10.0) == pytest.approx(3.0)
    assert speedup(Rates(20, 10, 1.0), None) is None
    assert speedup(Rates(20, 10, 1.0), Rates()) is None  # no baseline rate yet


def test_agreement_and_exact_match():
    assert prefix_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert agreement([[1, 2, 3, 4], [5]], [[1, 2, 9, 4], [5]]) == pytest.approx(0.75)
    assert exact_match([[1, 2], [3]], [[1, 2], [4]]) == 0.5
    assert agreement([], []) == 1.0 and exact_match([], []) == 1.0


def test_pooled_nll_and_the_named_dnll():
    assert pooled_nll([(3.0, 1), (1.0, 3)]) == pytest.approx(1.0)
    assert pooled_nll([]) == 0.0
    assert delta_nll_key("base") == "delta_nll_base" and delta_nll_key("self") == "delta_nll_self"
    with pytest.raises(ValueError, match="scorer"):
        delta_nll_key("judge")


@pytest.mark.parametrize("tokens, room, expected", [
    ([5, 6, 7], 10, ([5, 6, 7], None)),
    ([5, 2, 7], 10, ([5, 2], "eos")),  # the stop id stays in the output
    ([5, 6, 7], 2, ([5, 6], "length")),
    ([5, 6, 2], 3, ([5, 6, 2], "eos")),  # a stop id on the last allowed token is a stop
    ([5, 6], 2, ([5, 6], "length")),
])
def test_commit_tokens(tokens, room, expected):
    assert commit_tokens(tokens, room, {2}) == expected


def test_cut_at_stop_string_spans_passes_and_keeps_the_stop():
    pieces = ["lo", " wor", "ld"]
    assert cut_at_stop_string(pieces, "hel", ("o w",)) == 2 and pieces[:2] == ["lo", " w"]
    assert cut_at_stop_string(["abc"], "", ()) is None
    assert cut_at_stop_string(["abc"], "", ("z",)) is None


class _Tok:
    def __init__(self, pad, eos):
        self.pad_token_id, self.eos_token_id = pad, eos


def test_pad_id_falls_back_to_eos_then_zero():
    assert pad_id(_Tok(3, 7)) == 3
    assert pad_id(_Tok(None, 7)) == 7
    assert pad_id(_Tok(None, None)) == 0


def test_text_table_aligns_and_marks_missing_values():
    columns = [("name", "method", "{}"), ("x", "x", "{:.2f}")]
    table = text_table([{"name": "ar", "x": 1.0}, {"name": "mars", "x": None}], columns, left=1)
    assert table.splitlines() == ["method     x", "------  ----", "ar      1.00", "mars       -"]
