"""The bench command: a tiny end-to-end run writes the report and the HTML page; bad input is one line, exit 2."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mars_demo import cli
from mars_demo.commands import bench as bench_command
from mars_demo.engine.backends.cpu import int8gemm
from mars_demo.engine.decoding.metrics import agreement
from mars_demo.research import benchmark
from mars_demo.research import report as report_page
from mars_demo.research.benchmark import METHODS, BenchConfig, Outcome, add_speedups, cut_at_stop, plan

from conftest import PROMPTS, make_lm

RUN_KEYS = {
    "method", "tau", "batch_size", "tokens_per_second", "tokens_per_forward", "speedup", "delta_nll_self",
    "agreement", "forward_passes", "tokens", "seconds",
}


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(PROMPTS[:2]))
    return path


def test_bench_writes_report_and_html(tmp_path, prompts_file, monkeypatch, capsys):
    lm = make_lm("qwen2")
    monkeypatch.setattr(bench_command, "load_model", lambda *a, **k: lm)
    loaded = int8gemm.kernel() is not None  # built and timed now if it can be: the report then says how it runs
    out = tmp_path / "out" / "report.json"
    code = cli.main([
        "bench", "--model", "tiny", "--prompts", str(prompts_file), "--taus", "1.0,0.1",
        "--batch-sizes", "1,2", "--max-new-tokens", "6", "--out", str(out),
    ])
    assert code == 0
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert {r["method"] for r in runs} == set(METHODS)
    for run in runs:
        assert RUN_KEYS <= set(run), run["method"]
        assert run["tokens"] > 0 and run["forward_passes"] > 0 and run["seconds"] > 0
    by = {(r["method"], r["tau"], r["batch_size"]): r for r in runs}
    # tau = 1.0 is greedy AR: same text as transformers generate, hence no quality change
    greedy = [
        ("ar", 1.0, 1), ("mars", 1.0, 1), ("mars_batch", 1.0, 2), ("mars_batch_token", 1.0, 2),
        ("ar_batch_ours", 1.0, 2), ("mars_exact", 1.0, 1),
    ]
    for key in greedy:
        assert by[key]["agreement"] == 1.0 and by[key]["delta_nll_self"] == pytest.approx(0.0, abs=1e-4)
    assert by[("mars", 0.1, 1)]["tokens_per_forward"] > 1.0
    # our batch decoders' decoding passes by columns fed a row (prefills apart); one-sequence runs have none
    ar_passes, wide = by[("ar_batch_ours", 1.0, 2)]["passes_by_fed"], by[("mars_batch_token", 0.1, 2)]["passes_by_fed"]
    assert set(ar_passes) == {"1"} and 0 < ar_passes["1"]["passes"] < by[("ar_batch_ours", 1.0, 2)]["forward_passes"]
    assert any(int(fed) > 1 for fed in wide) and "passes_by_fed" not in by[("ar", 1.0, 1)]
    assert all(0 <= by[(m, 1.0, 2)]["tail_share"] <= 1 for m in ("ar_batch_ours", "mars_batch_token", "exact_batch"))
    assert "tail_share" not in by[("ar", 1.0, 1)] and "tail_share" not in by[("ar_batch", 1.0, 2)]
    assert report["drifted"] == []  # (the tiny model runs on fp32 here: nothing is held to AR's text bit for bit)
    assert {"cpu", "cpu_cores", "torch_threads", "torch", "transformers", "device", "dtype"} <= set(report["machine"])
    gemm = report["machine"]["int8_gemm"]  # how the native int8 linear tiled and prefetched in this process
    if loaded:
        assert gemm["tiling"] in int8gemm.TILINGS and gemm["prefetch"]["few_rows"] in int8gemm.PREFETCHES
        assert gemm["amx_from_rows"] in (0, *int8gemm.AMX_ROWS)  # 0 on a CPU without AMX tiles
    else:
        assert gemm is None
    assert report["command"].startswith("python -m mars_demo bench ") and "--taus 1,0.1" in report["command"]
    assert set(report["profile"]["mars"]["ms_per_pass"]) >= {"forward_body", "lm_head", "acceptance_and_host"}
    page = out.with_suffix(".html").read_text()
    assert "plotly" in page.lower() and '<script src="http' not in page  # plotly.js inlined: opens offline
    printed = capsys.readouterr().out
    assert "mars_batch_token" in printed and "tok/s" in printed


@pytest.mark.parametrize("flags, message", [
    (["--prompts", "/nonexistent/prompts.json"], "prompts file not found"),
    (["--taus", "1.0,abc"], "--taus"),
    (["--taus", "1.5"], "tau must be between 0 and 1"),
    (["--batch-sizes", "0"], "batch sizes"),
    (["--batch-sizes", "2,x"], "--batch-sizes"),
    (["--methods", "ar,warp"], "unknown method"),
    (["--limit", "0"], "--limit"),
    (["--temperature", "0.7", "--top-p", "0"], "top-p"),
    (["--temperature", "0.7", "--top-p", "nan"], "top-p"),
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "0.7", "--top-k", "-1"], "top-k"),
    (["--temperature", "0.7", "--seeds", "1,x"], "--seeds"),
    (["--temperature", "0.7", "--methods", "hf_generate,mars_batch"], "at a temperature bench runs"),
    (["--repeats", "0"], "repeats must be"),
    (["--temperature", "0.7", "--methods", "mars", "--repeats", "2"], "--repeats is for greedy runs"),
])
def test_bad_input_is_one_line_exit_2(prompts_file, flags, message, monkeypatch, capsys):
    monkeypatch.setattr(bench_command, "load_model", lambda *a, **k: pytest.fail("loaded a model on bad input"))
    args = ["bench", "--prompts", str(prompts_file), *flags]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_sampled_bench_reports_speed_and_nll_over_seeds(tmp_path, prompts_file, monkeypatch, capsys):
    lm = make_lm("qwen2")
    monkeypatch.setattr(bench_command, "load_model", lambda *a, **k: lm)
    out = tmp_path / "sampled.json"
    code = cli.main([
        "bench", "--model", "tiny", "--prompts", str(prompts_file), "--taus", "0.5", "--batch-sizes", "1",
        "--methods", "ar,mars,mars_exact,mars_batch", "--max-new-tokens", "6", "--temperature", "0.7",
        "--top-p", "0.9", "--seeds", "0,1", "--out", str(out),
    ])
    assert code == 0
    report = json.loads(out.read_text())
    assert {(r["method"], r["seed"]) for r in report["runs"]} == {
        (m, s) for m in ("ar", "mars", "mars_exact") for s in (0, 1)
    }
    summary = {r["method"]: r for r in report["summary"]}
    assert summary["ar"]["speedup"] == 1.0 and summary["ar"]["seeds"] == 2
    for row in summary.values():
        assert row["tokens"] > 0 and row["nll_self_min"] <= row["nll_self"] <= row["nll_self_max"]
    assert summary["mars_exact"]["tokens_per_forward"] >= 1.0 and "nll_within_ar_spread" in summary["mars_exact"]
    assert report["settings"]["temperature"] == 0.7 and report["settings"]["top_p"] == 0.9
    assert "--temperature 0.7 --top-p 0.9 --top-k 0 --seeds 0,1" in report["command"]
    printed = capsys.readouterr().out
    assert "mars_exact" in printed and "NLL (mean)" in printed


def test_runs_that_must_give_ars_text_and_do_not_are_named_on_a_row_exact_path():
    runs = [
        {"method": "ar", "batch_size": 1, "tau": 1.0, "agreement": 1.0},
        {"method": "ar_batch_ours", "batch_size": 2, "tau": 1.0, "agreement": 0.88},
        {"method": "exact_batch", "batch_size": 4, "tau": 1.0, "agreement": 1.0},
        {"method": "mars_exact", "batch_size": 1, "tau": 1.0, "agreement": 0.813},
        {"method": "mars_batch_token", "batch_size": 2, "tau": 1.0, "agreement": 0.99},
        {"method": "mars_batch_token", "batch_size": 2, "tau": 0.9, "agreement": 0.6},  # MARS below 1: its own text
        {"method": "ar_batch", "batch_size": 2, "tau": 1.0, "agreement": 0.9},  # transformers' forward: not ours
    ]
    off = benchmark.drifted(runs, True)
    assert [(r["method"], r["batch_size"]) for r in off] == [
        ("ar_batch_ours", 2), ("mars_exact", 1), ("mars_batch_token", 2)
    ] and off[2]["tau"] == 1.0
    assert benchmark.drifted(runs, False) == []  # fp32 or transformers' forward: rounding may part them
    message = benchmark.drift_message(off, "int8dyn")
    assert "int8dyn" in message and "mars_exact at 1 row(s) (agreement 0.813)" in message


def test_plan_always_has_the_reference_and_batch_methods_above_one():
    jobs = plan(BenchConfig(taus=(1.0, 0.9), batch_sizes=(4,), methods=("mars", "mars_batch")))
    assert (jobs[0].method, jobs[0].batch_size) == ("ar", 1)  # our AR on the same path: the reference
    assert [(j.method, j.tau, j.batch_size) for j in jobs[1:]] == [("mars_batch", 1.0, 4), ("mars_batch", 0.9, 4)]


def test_agreement_and_helpers():
    assert agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5
    assert agreement([[1, 2]], [[1, 2, 3, 4]]) == 0.5
    assert agreement([[]], [[]]) == 1.0
    assert cut_at_stop([5, 2, 2, 2], {2}) == [5, 2]
    runs = [
        {"method": "hf_generate", "batch_size": 1, "tokens_per_second": 10.0},
        {"method": "ar", "batch_size": 1, "tokens_per_second": 12.0},
        {"method": "mars", "batch_size": 1, "tokens_per_second": 24.0},
        {"method": "mars_batch", "batch_size": 4, "tokens_per_second": 30.0},
    ]
    add_speedups(runs)
    assert runs[2]["speedup"] == 2.0 and runs[2]["speedup_over"] == "ar" and runs[3]["speedup"] is None


def test_the_runs_of_a_batch_size_take_turns_and_keep_prompt_order(monkeypatch):
    """Each chunk runs every job, the first one rotating; a job's outputs and seconds add up in prompt order."""
    calls = []

    def fake_run_job(lm, job, prompts, config, max_new, tick=None):
        calls.append((job.method, [p[0] for p in prompts], max_new))
        return Outcome(outputs=[[p[0], len(calls)] for p in prompts], row_passes=[1] * len(prompts),
                       forward_passes=1, seconds=0.5)

    monkeypatch.setattr(benchmark, "run_job", fake_run_job)
    config = BenchConfig(taus=(1.0,), batch_sizes=(1, 2), methods=("hf_generate", "mars", "mars_batch"),
                         warmup_tokens=3)
    groups = benchmark.interleaved(plan(config))
    assert [[j.method for j in g] for g in groups] == [["ar", "hf_generate", "mars"], ["mars_batch"]]
    prompts = [[10], [11], [12]]
    outcomes = benchmark.run_group(None, groups[0], prompts, config)
    timed = [(method, ids) for method, ids, max_new in calls if max_new == config.max_new_tokens]
    assert [method for method, _, _ in calls[:3]] == ["ar", "hf_generate", "mars"]  # warm-ups first
    assert all(max_new == config.warmup_tokens for _, _, max_new in calls[:3])
    turns = [["ar", "hf_generate", "mars"], ["hf_generate", "mars", "ar"], ["mars", "ar", "hf_generate"]]
    assert [m for m, _ in timed] == [m for turn in turns for m in turn]
    assert all(ids == [p[0]] for (_, ids), p in zip(timed, [q for q in prompts for _ in range(3)]))
    for job in groups[0]:
        assert [row[0] for row in outcomes[job].outputs] == [10, 11, 12]  # prompt order
        assert outcomes[job].seconds == 1.5 and outcomes[job].forward_passes == 3
    batched = benchmark.run_group(None, groups[1], prompts, config)[groups[1][0]]
    assert [ids for _, ids, _ in calls[-2:]] == [[10, 11], [12]]  # batches of 2
    assert [row[0] for row in batched.outputs] == [10, 11, 12]


def test_the_report_draws_each_decoder_across_batch_sizes_and_tau_only_where_a_tau_method_ran():
    def run(method, tau, batch, speed):
        return {"method": method, "tau": tau, "batch_size": batch, "tokens_per_second": speed}

    runs = [run("ar", 1.0, 1, 100.0), run("mars", 0.9, 1, 130.0), run("llama_cpp", None, 1, 80.0),
            run("ar_batch_ours", 1.0, 2, 180.0), run("mars_batch_token", 0.9, 2, 200.0),
            run("mars_batch_token", 0.7, 2, 210.0), run("llama_cpp", None, 2, 90.0)]
    lines = {trace.name: (list(trace.x), list(trace.y)) for trace in report_page.speed_by_batch(runs).data}
    assert lines == {"our AR": ([1, 2], [100.0, 180.0]), "MARS tau=0.9": ([1, 2], [130.0, 200.0]),
                     "MARS tau=0.7": ([2], [210.0]), "llama.cpp Q8_0": ([1, 2], [80.0, 90.0])}
    full = {**run("ar", 1.0, 1, 1.0), "tokens_per_forward": 1.0, "speedup": 1.0, "delta_nll_self": 0.0,
            "agreement": 1.0}
    plain = [full, {**full, "method": "llama_cpp", "tau": None}]  # one batch size, no tau method
    page = report_page.to_html({"runs": plain, "machine": {}})
    assert "Throughput against tau" not in page and "Throughput by batch size" not in page
    page = report_page.to_html({"runs": plain + [{**full, "method": "mars", "tau": 0.9, "batch_size": 2}],
                                "machine": {}})
    assert "Throughput against tau" in page and "Throughput by batch size" in page


def test_a_batchs_tail_is_the_time_in_passes_with_fewer_rows_than_it_began_with():
    """tail_share: decoding passes (prefills apart) in which a row of the batch had finished, against all of them."""
    from mars_demo.engine.decoding.batch.events import BatchEvent, RowStep

    live, gone = RowStep(token_ids=(5,), width=1), RowStep()
    passes = [("prefill", (live, live, live), 0.5), ("window", (live, live, live), 0.3),
              ("window", (live, gone, live), 0.2), ("window", (gone, live, gone), 0.1)]
    events = [BatchEvent(index=i, rows=rows, tau=1.0, seconds=s, kind=kind, fed=1)
              for i, (kind, rows, s) in enumerate(passes)]
    part = Outcome()
    assert list(benchmark._noting(iter(events), part, rows=3)) == events
    assert part.decoding_seconds == pytest.approx(0.6) and part.tail_seconds == pytest.approx(0.3)
    assert part.passes == {1: [3, pytest.approx(0.6), 6]}  # each live row one token a pass
    whole = Outcome()
    whole.add(part)
    whole.add(part)
    assert whole.tail_seconds / whole.decoding_seconds == pytest.approx(0.5)


def test_repeats_go_over_the_prompts_again_in_turns_and_each_times_speedup_is_reported(monkeypatch):
    """--repeats: the turns rotate on through every time over the prompts; tok/s counts every time's tokens and
    seconds, the outputs are the first time's, and each time's speedup over the same AR run is reported."""
    from types import SimpleNamespace

    calls = []

    def fake_run_job(lm, job, prompts, config, max_new, tick=None):
        calls.append(job.method)
        fast = job.method == "mars" and len(calls) > 6  # mars runs faster in the second time over the prompts
        return Outcome(outputs=[[p[0]] * 4 for p in prompts], row_passes=[4] * len(prompts), forward_passes=4,
                       seconds=0.5 if fast else 1.0)

    monkeypatch.setattr(benchmark, "run_job", fake_run_job)
    config = BenchConfig(taus=(1.0,), batch_sizes=(1,), methods=("mars",), warmup_tokens=3, repeats=2)
    group = benchmark.interleaved(plan(config))[0]
    outcomes = benchmark.run_group(None, group, [[10], [11]], config)
    # after the warm-ups: each chunk's turn rotates, one place further the second time (ar is not always first on
    # the first chunk)
    assert calls[2:] == ["ar", "mars", "mars", "ar", "mars", "ar", "ar", "mars"]
    scorer = lambda i, out: SimpleNamespace(total=0.0, tokens=len(out))
    runs = []
    for job in group:
        outcome = outcomes[job]
        assert [row[0] for row in outcome.outputs] == [10, 11] and outcome.forward_passes == 8  # the first time's
        assert [sec for sec, _ in outcome.repeats] == ([2.0, 2.0] if job.method == "ar" else [2.0, 1.0])
        runs.append(benchmark.summarise(job, outcome, outcomes[group[0]].outputs, scorer, 0.0))
    add_speedups(runs)
    ar, mars = runs
    assert ar["tokens"] == 8 and ar["tokens_per_second"] == 4.0 and ar["repeat_tokens_per_second"] == [4.0, 4.0]
    assert mars["tokens_per_second"] == pytest.approx(16 / 3, abs=1e-3) and mars["agreement"] == 1.0
    assert mars["speedup_by_repeat"] == [1.0, 2.0] and mars["speedup_range"] == [1.0, 2.0]
    once = benchmark.run_group(None, group, [[10], [11]], replace(config, repeats=1))
    assert "repeat_tokens_per_second" not in benchmark.summarise(group[1], once[group[1]], [], scorer, 0.0)
