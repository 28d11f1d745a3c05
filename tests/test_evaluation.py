"""The eval metrics on hand-made inputs, and the eval command end to end on a tiny saved model."""

from __future__ import annotations

import json

import pytest
import torch

from mars_demo.cli import main
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.metrics import common_prefix, prefix_agreement
from mars_demo.research.evaluation import (
    Decoded,
    EvalConfig,
    Scored,
    ar_match,
    argmax_agreement,
    decode,
    evaluate,
    extra_ar_match,
    mean_nll,
    merge_counts,
    pass_positions,
    pooled_nll,
    repeated_ngrams,
    repetition,
    tau_row,
    teacher_forced,
)

from conftest import PROMPTS, make_lm

# --- pure functions on hand-made inputs ---


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ([], [], 1.0),  # nothing to disagree on
        ([1, 2, 3], [], 0.0),
        ([1, 2, 3], [1, 2, 3], 1.0),
        ([1, 2, 3], [4, 2, 3], 0.0),  # same tail, different first token: nothing shared
        ([1, 2, 3, 4], [1, 2, 9, 4], 0.5),
        ([1, 2], [1, 2, 3, 4], 0.5),  # a prefix of the other: divided by the longer
    ],
)
def test_prefix_agreement(a, b, expected):
    assert prefix_agreement(a, b) == expected
    assert prefix_agreement(b, a) == expected  # symmetric


def test_repeated_ngrams():
    assert repeated_ngrams([1, 2, 3, 4, 1, 2, 3, 4, 1], n=4) == (2, 6)  # 1234 and 2341 come back
    assert repeated_ngrams([7] * 6, n=4) == (2, 3)
    assert repeated_ngrams([1, 2, 3], n=4) == (0, 0)
    assert repetition([[1, 2, 3, 4, 5], [9, 9, 9, 9, 9, 9]]) == pytest.approx(2 / 5)
    assert repetition([[], [1]]) == 0.0


def test_argmax_agreement():
    scored = [Scored((0.1, 0.2, 0.3), (5, 6, 7)), Scored((0.1,), (9,))]
    assert argmax_agreement(scored, [[5, 0, 7], [9]]) == 3 / 4
    assert argmax_agreement([], []) == 1.0


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1], [1, 2]) == 1
    assert common_prefix((), [5]) == 0


def test_pass_positions():
    assert pass_positions([3, 1, 2]) == [1, 2, 3, 1, 1, 2]
    assert pass_positions([1, 1, 1]) == [1, 1, 1]
    assert pass_positions([]) == []


def test_ar_match_counts_per_pass_position():
    # passes of 3 and 1 tokens; the 3rd token of the first pass is not what AR would pick
    counts = ar_match([5, 6, 7, 8], [5, 6, 9, 8], [3, 1])
    assert counts == {1: (2, 2), 2: (1, 1), 3: (0, 1)}
    assert extra_ar_match(counts) == (0.5, 2)


def test_extra_ar_match_without_extras_is_one():
    # tau = 1.0: one token per pass, so there is nothing extra; a wrong AR token does not count
    counts = ar_match([5, 6, 7], [5, 0, 7], [1, 1, 1])
    assert counts == {1: (2, 3)}
    assert extra_ar_match(counts) == (1.0, 0)
    assert extra_ar_match({}) == (1.0, 0)


def test_ar_match_refuses_lengths_that_disagree():
    with pytest.raises(ValueError, match="disagree"):
        ar_match([1, 2, 3], [1, 2, 3], [2])


def test_merge_counts_and_pooled_nll():
    assert merge_counts([{1: (1, 2), 2: (1, 1)}, {1: (2, 2), 3: (0, 1)}]) == {1: (3, 4), 2: (1, 1), 3: (0, 1)}
    scores = [Scored((1.0, 3.0), (0, 0)), Scored((2.0,), (0,))]
    assert pooled_nll(scores) == pytest.approx(2.0)  # (1 + 3 + 2) / 3 tokens, not the mean of 2.0 and 2.0
    assert pooled_nll([Scored((4.0,), (0,)), Scored((1.0, 1.0, 1.0), (0, 0, 0))]) == pytest.approx(7 / 4)
    assert pooled_nll([]) == 0.0


def _run(tokens, passes, seconds):
    return Decoded(tuple(tokens), tuple(passes), seconds, "", "length")


def test_tau_row_pools_over_prompts():
    ar = [_run([1, 2, 3, 4], [1, 1, 1, 1], 4.0), _run([5, 6], [1, 1], 2.0)]
    reference = [_run([1, 2, 3, 4], [1, 1, 1, 1], 5.0), _run([5, 6], [1, 1], 2.5)]
    mine = [_run([1, 2, 9, 9], [3, 1], 2.0), _run([5, 6], [2], 1.0)]
    own = [Scored((0.0,) * 4, (1, 2, 3, 9)), Scored((0.0, 0.0), (5, 6))]
    base = [Scored((1.0, 1.0, 2.0, 2.0), (0,) * 4), Scored((1.0, 1.0), (0, 0))]
    row = tau_row(0.5, mine, ar, reference, own, base, reference_nll={"base": 1.0, "self": 0.5})
    assert row["tokens_per_forward"] == pytest.approx(6 / 3)
    assert row["speedup"] == pytest.approx((6 / 3.0) / (6 / 6.0))  # tokens/s over AR's tokens/s
    assert row["time_ratio"] == pytest.approx(6.0 / 3.0)
    assert row["extra_tokens"] == 3  # positions 2 and 3 of the first prompt, 2 of the second
    assert row["extra_ar_match"] == pytest.approx(2 / 3)  # the 9 at position 3 is not AR's 3
    assert [p["position"] for p in row["by_position"]] == [1, 2, 3]
    assert row["agreement"] == pytest.approx((0.5 + 1.0) / 2)
    assert row["exact_match"] == 0.5
    assert row["nll_base"] == pytest.approx(8 / 6) and row["nll_self"] == 0.0
    assert row["delta_nll_base"] == pytest.approx(8 / 6 - 1.0) and row["delta_nll_self"] == pytest.approx(-0.5)


def test_eval_config_levels_and_validation():
    assert EvalConfig(taus=(0.7, 0.9, 0.9)).levels == (1.0, 0.9, 0.7)
    with pytest.raises(ValueError):
        EvalConfig(taus=(1.5,))
    with pytest.raises(ValueError):
        EvalConfig(taus=())
    with pytest.raises(ValueError):
        EvalConfig(max_new_tokens=0)


# --- metrics on a tiny random model ---


def _greedy(lm, prompt: str, n: int = 12) -> tuple[list[int], list[int]]:
    ids = prompt_ids(lm.tokenizer, prompt)
    return ids, list(decode(lm, ids, DecodeConfig(mode="ar", max_new_tokens=n)).token_ids)


def test_mean_nll_equals_the_language_modelling_loss(tiny_llama):
    ids, out = _greedy(tiny_llama, PROMPTS[0])
    labels = torch.tensor([[-100] * len(ids) + out])
    with torch.no_grad():
        loss = tiny_llama.model(input_ids=torch.tensor([ids + out]), labels=labels).loss
    assert mean_nll(tiny_llama.backend, ids, out) == pytest.approx(float(loss), rel=1e-4)
    with pytest.raises(ValueError):
        mean_nll(tiny_llama.backend, ids, [])


def test_own_greedy_output_scores_better_than_random_tokens(tiny_llama):
    ids, out = _greedy(tiny_llama, PROMPTS[1])
    generator = torch.Generator().manual_seed(0)
    random = torch.randint(0, len(tiny_llama.tokenizer), (len(out),), generator=generator).tolist()
    assert mean_nll(tiny_llama.backend, ids, out) < mean_nll(tiny_llama.backend, ids, random)
    # Teacher forcing reads back the greedy choices: a MARS output equal to the greedy output
    # agrees with AR on every extra token, however it was split into passes.
    scored = teacher_forced(tiny_llama.backend, ids, out)
    assert list(scored.argmax) == out
    passes, left = [], len(out)
    for size in [3, 1, 4] * len(out):
        if left == 0:
            break
        passes.append(min(size, left))
        left -= passes[-1]
    assert extra_ar_match(ar_match(out, scored.argmax, passes)) == (1.0, len(out) - len(passes))


def test_evaluate_with_a_separate_base_and_a_foreign_tokenizer(tiny_llama):
    base = make_lm("llama", seed=1)  # same tokenizer, other weights
    config = EvalConfig(taus=(1.0, 0.3), max_new_tokens=5, warmup=False)
    report = evaluate(tiny_llama, base, PROMPTS[:2], config, progress=False)
    assert report["base"] == "tiny-llama" and report["tau1_equals_ar"] == 1.0
    greedy = [r["base_greedy"]["token_ids"] for r in report["per_prompt"]]
    assert greedy == [_greedy(base, p, 5)[1] for p in PROMPTS[:2]]  # decoded by the base, not the model
    assert report["tau1_vs_base_nll"] > 0  # the base likes its own greedy output best
    own_argmax = [teacher_forced(tiny_llama.backend, prompt_ids(tiny_llama.tokenizer, p), g).argmax
                  for p, g in zip(PROMPTS[:2], greedy)]
    agreeing = sum(a == t for argmax, g in zip(own_argmax, greedy) for a, t in zip(argmax, g))
    assert report["base_argmax_agreement"] == agreeing / sum(map(len, greedy)) < 1.0
    with pytest.raises(ValueError, match="tokenizer"):
        evaluate(tiny_llama, make_lm("qwen2"), PROMPTS[:1], config, progress=False)


# --- the command end to end ---


def test_eval_command_writes_a_sane_report(model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS[:3]))
    out = tmp_path / "eval.json"
    code = main([
        "eval", "--model", model_dir, "--base", model_dir, "--prompts", str(prompts), "--limit", "2",
        "--taus", "0.9,0.3", "--max-new-tokens", "6", "--out", str(out),
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "tok/fwd" in printed and "tau1_vs_base_nll" in printed
    report = json.loads(out.read_text())
    keys = (
        "model", "base", "block_size", "prompts", "ar", "tau1_nll", "base_greedy_nll", "tau1_vs_base_nll", "taus",
        "per_prompt", "definitions",
    )
    for key in keys:
        assert key in report
    assert report["prompts"] == 2 and len(report["per_prompt"]) == 2
    assert [row["tau"] for row in report["taus"]] == [1.0, 0.9, 0.3]
    ref, *others = report["taus"]
    assert ref["tokens_per_forward"] == 1.0
    assert ref["delta_nll_base"] == 0.0 and ref["delta_nll_self"] == 0.0
    assert ref["agreement"] == 1.0 and ref["exact_match"] == 1.0
    assert ref["extra_tokens"] == 0 and ref["extra_ar_match"] == 1.0
    assert report["tau1_equals_ar"] == 1.0
    # base == model: its greedy is the tau = 1.0 output
    assert report["tau1_vs_base_nll"] == pytest.approx(0.0, abs=1e-9)
    assert report["base_argmax_agreement"] == 1.0 and "reproduces 100.0%" in printed
    for row in report["taus"]:
        assert set(row) >= {"tokens_per_forward", "speedup", "extra_ar_match", "agreement", "exact_match",
                            "delta_nll_base", "delta_nll_self"}
        assert 1.0 <= row["tokens_per_forward"] <= report["block_size"]
        assert 0.0 <= row["extra_ar_match"] <= 1.0 and 0.0 <= row["agreement"] <= 1.0
        assert row["speedup"] > 0 and 0.0 <= row["repeated_ngrams"] < 1.0
        assert row["by_position"][0]["position"] == 1 and row["by_position"][0]["ar_match"] == 1.0
    assert others[-1]["tokens_per_forward"] > 1.0  # the peaked tiny model accepts extras at tau = 0.3
    for record in report["per_prompt"]:
        for run in record["mars"].values():
            assert sum(run["pass_lengths"]) == len(run["token_ids"]) <= 6


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--taus", "1.5"], "tau"),
        (["--taus", "0.9,x"], "--taus"),
        (["--limit", "0"], "--limit"),
        (["--max-new-tokens", "0"], "max new tokens"),
    ],
)
def test_eval_bad_input_is_one_line(model_dir, tmp_path, capsys, flags, message):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    assert main(["eval", "--model", model_dir, "--prompts", str(prompts), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_eval_missing_prompts_file(model_dir, tmp_path, capsys):
    assert main(["eval", "--model", model_dir, "--prompts", str(tmp_path / "nope.txt")]) == 2
    assert "not found" in capsys.readouterr().err
