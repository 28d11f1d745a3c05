"""serve-sim: seeded arrivals, the report (JSON + self-contained HTML, one curve per policy), bad parameters."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mars_demo.cli import main
from mars_demo.commands import serve_sim
from mars_demo.engine.backends.cpu import paths
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.surface import Surface
from mars_demo.engine.serving.replay import (
    BURST,
    SimConfig,
    arrival_times,
    in_turn,
    make_requests,
    percentile,
    replay,
    request_records,
    summarise,
)
from mars_demo.research.simulation import clock_surface, model_cost, simulate
from mars_demo.research.simulation_report import format_totals, to_html
from mars_demo.ui.charts import rolling_throughput, serving_figures

from conftest import PROMPTS


def test_arrivals_are_seeded_and_keep_the_mean_rate():
    a = arrival_times("poisson", 2.0, 400, seed=3)
    assert a == arrival_times("poisson", 2.0, 400, seed=3) and a != arrival_times("poisson", 2.0, 400, seed=4)
    assert a == sorted(a) and a[0] == 0.0 and 400 / 2.0 * 0.8 < a[-1] < 400 / 2.0 * 1.2
    burst = arrival_times("burst", 4.0, 20, seed=0)
    assert burst[:BURST] == [0.0] * BURST and burst[BURST] == BURST / 4.0 and len(set(burst)) == 3


def test_requests_draw_prompts_from_the_pool_reproducibly():
    config = SimConfig(rate=1.0, requests=12)
    pool = [[1, 2], [3], [4, 5, 6]]
    assert make_requests(config, pool) == make_requests(config, pool)
    assert {r.prompt for r in make_requests(config, pool)} <= {tuple(p) for p in pool}


def test_percentile():
    assert percentile([], 95) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile(list(range(101)), 95) == 95


def test_simulation_on_a_tiny_model(tiny_qwen):
    config = SimConfig(
        rate=50.0, requests=8, policies=("fixed:1.0", "fixed:0.15", "adaptive"), max_batch=3, max_new_tokens=12
    )
    pool = [prompt_ids(tiny_qwen.tokenizer, p) for p in PROMPTS]
    result = simulate(tiny_qwen, config, pool, base=tiny_qwen.backend)
    names = [p["summary"]["policy"] for p in result["policies"]]
    assert names == ["fixed:1", "fixed:0.15", "adaptive"]
    for policy in result["policies"]:
        s = policy["summary"]
        assert s["done"] == 8 and s["stopped"] == s["error"] == 0
        assert s["latency_p50"] <= s["latency_p95"] <= s["latency_p99"]
        assert len(policy["requests"]) == 8 and all(r["passes"] for r in policy["requests"])
        assert len(policy["series"]["clock"]) == s["iterations"]
    ref = result["policies"][0]["summary"]
    assert ref["delta_nll_base"] == 0.0 and ref["agreement"] == 1.0 and ref["tau_mean"] == 1.0
    assert result["policies"][1]["summary"]["tokens_per_forward"] > 1.0
    all_series = {p["summary"]["policy"]: p["series"] for p in result["policies"]}
    assert all(len(fig.data) == 3 for fig in serving_figures(all_series))  # one curve per policy
    assert "fixed:0.15" in format_totals([p["summary"] for p in result["policies"]])


def test_policies_take_turns_pass_by_pass(tiny_qwen):
    """The replays alternate, so a drifting machine slows each policy alike; each still serves every request
    exactly once, as it does replayed alone."""
    config = SimConfig(rate=50.0, requests=5, policies=("fixed:1.0", "fixed:0.15"), max_batch=2, max_new_tokens=8)
    pool = [prompt_ids(tiny_qwen.tokenizer, p) for p in PROMPTS]
    seen = []
    result = simulate(tiny_qwen, config, pool, on_event=lambda name, event: seen.append(name))
    assert seen[:6] == ["fixed:1", "fixed:0.15", "fixed:0.15", "fixed:1", "fixed:1", "fixed:0.15"]  # first rotates
    alone = replay(tiny_qwen, config, "fixed:0.15", make_requests(config, pool))
    together = result["policies"][1]
    assert together["summary"]["done"] == 5 and together["summary"]["tokens"] == summarise(alone)["tokens"]
    assert [r["token_ids"] for r in together["requests"]] == [r["token_ids"] for r in request_records(alone)]


def test_each_round_of_turns_starts_one_replay_further():
    assert [in_turn([0, 1, 2], turn) for turn in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert in_turn([0, 2], 3) == [2, 0] and in_turn([], 5) == []  # replays that ended are left out


def test_a_policy_may_decode_in_its_own_mode_beside_the_others(tiny_qwen):
    """"fixed:1.0@exact" serves in exact mode in the same run as MARS policies, taking turns with them: greedy AR's
    text (agreement 1.0 with fixed:1.0) from verifying passes, as exact mode replayed alone gives."""
    config = SimConfig(rate=50.0, requests=5, policies=("fixed:1.0", "fixed:1.0@exact"), max_batch=2,
                       max_new_tokens=10)
    pool = [prompt_ids(tiny_qwen.tokenizer, p) for p in PROMPTS]
    result = simulate(tiny_qwen, config, pool)
    ar, exact = (p["summary"] for p in result["policies"])
    assert (ar["policy"], exact["policy"]) == ("fixed:1", "fixed:1@exact")
    assert exact["done"] == 5 and exact["agreement"] == 1.0
    assert ar["width_mean"] == 1.0 and exact["width_mean"] > 1.0  # exact passes verify drafts and read masks
    alone = replay(tiny_qwen, replace(config, mode="exact"), "fixed:1.0", make_requests(config, pool))
    texts = [r["token_ids"] for r in result["policies"][1]["requests"]]
    assert texts == [r["token_ids"] for r in request_records(alone)]
    assert serve_sim.lossless_drift([ar, {**exact, "agreement": 0.9}], "mars", True) == ["fixed:1@exact"]


def test_rolling_throughput():
    clock, rate = rolling_throughput({"clock": [0.5, 1.0, 1.5, 2.5], "tokens": [2, 2, 2, 2]}, window=1.0)
    assert clock == [0.5, 1.0, 1.5, 2.5] and rate == [2.0, 4.0, 4.0, 2.0]


def test_cli_writes_json_and_self_contained_html(model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "sim"
    code = main(["serve-sim", "--model", model_dir, "--rate", "40", "--requests", "6",
                 "--policies", "fixed:1.0,latency:0.5", "--prompts", str(prompts),
                 "--max-new-tokens", "8", "--max-batch", "2", "--out", str(out),
                 "--precision", "fp32", "--base", model_dir, "--pass-costs"])
    assert code == 0
    report = json.loads((out / "serve-sim.json").read_text())
    assert [p["summary"]["policy"] for p in report["policies"]] == ["fixed:1", "latency:0.5"]
    assert report["pass_costs"] and "measured seconds" in report["clock"]
    page = (out / "serve-sim.html").read_text()
    assert page.count("<script") >= 4 and '<script src="http' not in page and "latency:0.5" in page
    assert "fixed:1" in capsys.readouterr().out


def test_cli_without_plotly_writes_the_json_alone(model_dir, tmp_path, monkeypatch, capsys):
    """A machine without plotly (the lent GPU's image) still gets the report; the page is skipped, said once."""
    from mars_demo.research import simulation_report

    monkeypatch.setattr(simulation_report, "pio", None)
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "sim"
    code = main(["serve-sim", "--model", model_dir, "--rate", "40", "--requests", "3", "--policies", "fixed:1.0",
                 "--prompts", str(prompts), "--max-new-tokens", "4", "--out", str(out), "--precision", "fp32",
                 "--no-quality"])
    assert code == 0 and (out / "serve-sim.json").is_file() and not (out / "serve-sim.html").exists()
    assert "no HTML page: plotly is not installed" in capsys.readouterr().out


def test_auto_chooses_the_path_for_the_batch_it_serves(model_dir, tmp_path, monkeypatch):
    table = {  # int8 cheapest at one token, int8dyn at two rows and more (this CPU's shape)
        "fp32": {"costs_ms": {1: 60, 2: 100}, "dnll": 0.0}, "bf16": {"costs_ms": {1: 38, 2: 53}, "dnll": 0.0},
        "int8": {"costs_ms": {1: 25, 2: 33}, "dnll": 0.0}, "int8dyn": {"costs_ms": {1: 27, 2: 29}, "dnll": 0.0},
    }
    monkeypatch.setattr(paths, "survey", lambda order, *args: {p: table[p] for p in order})
    monkeypatch.setenv("MARS_DEMO_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "sim"
    assert main(["serve-sim", "--model", model_dir, "--rate", "40", "--requests", "2", "--policies", "fixed:1.0",
                 "--prompts", str(prompts), "--max-new-tokens", "4", "--max-batch", "2", "--out", str(out),
                 "--precision", "auto", "--no-quality"]) == 0
    compute = json.loads((out / "serve-sim.json").read_text())["machine"]["compute_path"]
    assert compute["path"] == "int8dyn" and compute["rows"] == 2 and compute["requested"] == "auto"


@pytest.mark.parametrize("clock", ["width-free", "tokens-fed"])
def test_cli_cost_model_clocks(model_dir, tmp_path, clock):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "sim"
    assert main(["serve-sim", "--model", model_dir, "--rate", "40", "--requests", "5",
                 "--policies", "fixed:1.0,fixed:0.2", "--prompts", str(prompts),
                 "--max-new-tokens", "8", "--max-batch", "2", "--out", str(out),
                 "--precision", "fp32", "--no-quality", "--clock", clock]) == 0
    report = json.loads((out / "serve-sim.json").read_text())
    assert report["clock"].startswith("cost model") and report["curve_ms"]
    assert report["surface"]["simulated"] and report["surface"]["name"] == clock
    assert report["settings"]["clock"] == clock and "delta_nll_base" not in report["policies"][0]["summary"]


def _surface_table(tmp_path, name, per_width):
    """A cost-surfaces.json with one entry: ms = 10 x rows + per_width x width."""
    rows, widths = [1, 2, 4, 8], [1, 2, 4, 8, 16, 32]
    ms = [[10.0 * r + per_width * w for w in widths] for r in rows]
    path = tmp_path / name
    path.write_text(json.dumps({"GPU X|model=m": {"name": "measured", "rows": rows, "widths": widths, "ms": ms}}))
    return path


@pytest.mark.parametrize("per_width, wide", [(0.0, True), (1000.0, False)])
def test_cli_prices_passes_on_a_surface_measured_elsewhere(model_dir, tmp_path, per_width, wide):
    """--surface: the same controller feeds masks where that surface makes width free, AR passes where it is dear."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "sim"
    assert main(["serve-sim", "--model", model_dir, "--rate", "40", "--requests", "4", "--policies", "fixed:0.0",
                 "--prompts", str(prompts), "--max-new-tokens", "8", "--max-batch", "2", "--out", str(out),
                 "--precision", "fp32", "--no-quality", "--clock", "tokens-fed",
                 "--surface", str(_surface_table(tmp_path, "s.json", per_width))]) == 0
    report = json.loads((out / "serve-sim.json").read_text())
    assert "measured on another machine: GPU X|model=m" in report["clock"] and "--surface" in report["command"]
    width = report["policies"][0]["summary"]["width_mean"]
    assert (width > 1.5) if wide else (width == 1.0)


def test_a_surface_file_that_cannot_price_passes_is_one_line(tmp_path, capsys):
    two = _surface_table(tmp_path, "two.json", 1.0)
    table = json.loads(two.read_text())
    two.write_text(json.dumps(table | {"another": next(iter(table.values()))}))
    holed = _surface_table(tmp_path, "holed.json", 1.0)
    table = json.loads(holed.read_text())
    next(iter(table.values()))["ms"][1][2] = float("nan")
    holed.write_text(json.dumps(table))
    for path, message in [(tmp_path / "none.json", "cannot read the cost surface"),
                          (two, "holds 2 cost surfaces"), (holed, "cost surface")]:
        assert main(["serve-sim", "--rate", "1", "--clock", "width-free", "--surface", str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert main(["serve-sim", "--rate", "1", "--surface", str(two)]) == 2
    assert "add --clock tokens-fed" in capsys.readouterr().err


def test_cost_models_follow_the_surface():
    surface = Surface((1, 2), (1, 2, 4), [[10.0, 12.0, 20.0], [14.0, 18.0, 30.0]])
    cpu, gpu = model_cost(surface, "tokens-fed"), model_cost(surface, "width-free")
    assert cpu(2, 2, "decode", 9.9) == pytest.approx(0.018) and gpu(2, 2, "decode", 9.9) == pytest.approx(0.014)
    assert gpu(2, 2, "prefill", 9.9) == cpu(2, 2, "prefill", 9.9) == pytest.approx(0.018)
    flat = clock_surface(gpu, "width-free")  # what the width controller prices passes on under that clock
    assert flat.simulated and flat.ms(2, 4) == flat.ms(2, 1) == pytest.approx(14.0)


def test_exact_serving_that_parts_from_fixed_ones_text_is_named_on_a_row_exact_path():
    summaries = [{"policy": "fixed:1.0", "agreement": 1.0}, {"policy": "adaptive", "agreement": 0.973},
                 {"policy": "fixed:0.9", "agreement": 1.0}, {"policy": "latency:10", "agreement": None}]
    assert serve_sim.lossless_drift(summaries, "exact", True) == ["adaptive"]
    assert serve_sim.lossless_drift(summaries, "exact", False) == []  # fp32 or transformers' forward: rounding
    assert serve_sim.lossless_drift(summaries, "mars", True) == []  # MARS below tau 1.0 has its own text


def test_html_escapes_what_it_shows():
    report = {"model": "<b>m</b>", "command": "<script>x</script>", "policies": [], "settings": {}}
    page = to_html(report, [])
    assert "<b>m</b>" not in page and "&lt;script&gt;x" in page


@pytest.mark.parametrize("args, message", [
    (["--rate", "0"], "rate must be above 0"),
    (["--rate", "-2"], "rate must be above 0"),
    (["--rate", "nan"], "rate must be above 0"),
    (["--rate", "1", "--requests", "0"], "requests must be an integer from 1"),
    (["--rate", "1", "--requests", "1000000"], "requests must be an integer from 1"),
    (["--rate", "1", "--max-batch", "500"], "max batch must be an integer from 1"),
    (["--rate", "1", "--policies", "fixed:1.0,turbo"], "unknown policy 'turbo'"),
    (["--rate", "1", "--policies", "fixed:2"], "tau must be between 0 and 1"),
    (["--rate", "1", "--policies", ""], "give 1 to 8 different policies"),
    (["--rate", "1", "--time-limit", "0"], "--time-limit must be above 0"),
    (["--rate", "1", "--arrivals", "steady"], "invalid choice"),
])
def test_bad_parameters_are_one_line_and_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) if "invalid choice" in message else _no_raise() as caught:
        code = main(["serve-sim", *args])
    code = caught.value.code if caught else code
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


class _no_raise:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
