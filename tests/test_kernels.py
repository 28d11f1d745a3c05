"""CPU compute paths (paths.py): row-exact passes on bf16 and int8, the auto choice, the cached cost table."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from mars_demo.cli import main
from mars_demo.engine import progress
from mars_demo.engine.backends import backend_for
from mars_demo.engine.backends.cpu import calibration, paths
from mars_demo.engine.backends.cpu.backend import CpuBackend
from mars_demo.engine.backends.cpu.calibration import token_ids
from mars_demo.engine.backends.cpu.paths import cap_from_costs, choose_path, convert, select
from mars_demo.engine.backends.cpu.quant import FusedSlice, Int8Linear, RowInt8Linear, activation_ranges, fold_smoothing
from mars_demo.engine.checkpoints.loading import ModelLoadError, default_precision, resolve_meta
from mars_demo.engine.decoding.batch import collect_batch, generate_batch
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig, resolve_max_fed
from mars_demo.engine.decoding.exact import decode_rate
from mars_demo.engine.decoding.loop import collect, generate
from mars_demo.engine.model import LoadedModel

from conftest import PROMPTS, make_lm, make_tokenizer


def on_path(arch: str, path: str, smoothed: bool = False):
    lm = make_lm(arch)
    convert(lm.model, path, smoothing=token_ids(lm.tokenizer, PROMPTS) if smoothed else None)
    return lm


def first_row_logits(model, prompt: list[int], fed: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the last prompt token's position fed alone, and fed with ``fed`` after it, as ``model`` decodes."""
    backend = backend_for(model)
    with torch.inference_mode():
        cache = backend.new_cache()
        backend.forward(torch.tensor([prompt[:-1]]), cache)
        alone = backend.forward(torch.tensor([prompt[-1:]]), cache)[0, 0]
        cache.crop(1)
        wide = backend.forward(torch.tensor([prompt[-1:] + fed]), cache, keep=len(fed) + 1)[0, 0]
    return alone, wide


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("path", ["bf16", "int8", "int8dyn"])
def test_a_rows_logits_do_not_depend_on_the_rows_after_it(arch, path):
    lm = on_path(arch, path)
    prompt = lm.tokenizer(PROMPTS[0]).input_ids
    mask = lm.meta.mask_token_id
    for fed in ([mask], [mask] * 3, [5, 6, mask, mask, mask], [mask] * 7):
        alone, wide = first_row_logits(lm.model, prompt, fed)
        assert torch.equal(alone, wide), fed  # bit for bit, not only the argmax


@pytest.mark.parametrize("path", ["bf16", "int8", "int8dyn"])
@pytest.mark.parametrize("scheme, mode", [("token", "mars"), ("token", "exact"), ("block", "mars")])
def test_every_batch_row_equals_that_row_alone_on_every_path(path, scheme, mode):
    lm = on_path("llama", path)  # prompts of different lengths: the shorter rows are left-padded
    config = DecodeConfig(mode=mode, tau=0.5 if mode == "mars" else 1.0, max_new_tokens=12)
    batch = collect_batch(generate_batch(lm, PROMPTS, config, scheme=scheme))
    for prompt, row in zip(PROMPTS, batch.token_ids):
        assert row == collect(generate(lm, prompt, config)).token_ids, prompt


@pytest.mark.parametrize("path", ["fp32", "bf16", "int8", "int8dyn"])
def test_mars_at_tau_one_and_teacher_forced_wide_passes_equal_ar_on_every_path(tiny_lm, path):
    lm = on_path("llama" if tiny_lm.model.config.model_type == "llama" else "qwen2", path)
    for prompt in PROMPTS:
        ar = collect(generate(lm, prompt, DecodeConfig(mode="ar", max_new_tokens=24)))
        mars = collect(generate(lm, prompt, DecodeConfig(tau=1.0, max_new_tokens=24)))
        assert mars.token_ids == ar.token_ids
        # the AR tokens fed in one wide pass: every position's argmax is the next AR token
        ids = prompt_ids(lm.tokenizer, prompt)
        with torch.inference_mode():
            cache = lm.backend.new_cache()
            lm.backend.forward(torch.tensor([ids]), cache)
            fed = ar.token_ids[:8]
            wide = lm.backend.forward(torch.tensor([fed]), cache, keep=0)[0]
        assert wide[:-1].argmax(-1).tolist() == ar.token_ids[1:8]


def test_cap_is_the_widest_pass_within_the_share():
    assert cap_from_costs({1: 30, 2: 33, 3: 34, 4: 40, 5: 34.4, 6: 60}) == 5
    assert cap_from_costs({1: 30, 2: 40, 3: 50}) == 2  # never below one token and one mask
    assert cap_from_costs({1: 10, 2: 11, 3: 11.6}, share=1.15) == 2


def curve(one: float, per_token: float, widest: int = 8) -> dict[int, float]:
    return {w: one + per_token * (w - 1) for w in range(1, widest + 1)}


def test_auto_picks_the_fastest_path_that_keeps_quality():
    table = {
        "fp32": {"costs_ms": curve(60, 20), "dnll": 0.0},
        "bf16": {"costs_ms": curve(30, 10), "dnll": 0.01},
        "int8": {"costs_ms": curve(20, 5), "dnll": 0.05},  # fastest, but too far from fp32
    }
    assert choose_path(table) == "bf16"
    table["int8"]["dnll"] = 0.02
    assert choose_path(table) == "int8"
    assert choose_path({"fp32": {"costs_ms": {"1": 9, "2": 9}, "dnll": 0.0}}) == "fp32"  # JSON keys are strings
    # one sequence: a flat curve's exact decoding beats a slightly cheaper one-token pass ...
    table["int8dyn"] = {"costs_ms": curve(22, 0.5), "dnll": 0.01}
    assert choose_path(table) == "int8"  # by AR's rate alone (the default)
    assert choose_path(table, rate=decode_rate) == "int8dyn"
    assert decode_rate(curve(22, 0.5), 4) > 1 / 20  # its exact decoding beats int8's AR
    # ... but not a much dearer one, and AR's rate is the floor of a steep curve
    table["int8dyn"]["costs_ms"] = curve(40, 0.5)
    assert choose_path(table, rate=decode_rate) == "int8"
    assert decode_rate(curve(20, 30), 4) == 1 / 20
    table["int8dyn"] = {"costs_ms": curve(22, 0.5), "dnll": 0.04}
    assert choose_path(table, rate=decode_rate) == "int8"


def test_auto_for_batches_picks_the_path_cheapest_at_the_batchs_rows(tmp_path, monkeypatch):
    table = {  # this CPU's shape: int8 cheapest at one token, int8dyn nearly flat in rows
        "fp32": {"costs_ms": {1: 60, 2: 100, 4: 130, 8: 130}, "dnll": 0.0},
        "bf16": {"costs_ms": {1: 38, 2: 53, 4: 95, 8: 160}, "dnll": 0.0002},
        "int8": {"costs_ms": {1: 25, 2: 29, 4: 37, 8: 60}, "dnll": 0.003},
        "int8dyn": {"costs_ms": {1: 27, 2: 29.5, 4: 33, 8: 40}, "dnll": 0.004},
    }
    assert choose_path(table, rows=2) == "int8dyn"  # within 5% at two rows: the flatter curve
    assert choose_path(table, rows=4) == choose_path(table, rows=8) == "int8dyn"
    table["int8dyn"]["costs_ms"] = {1: 27, 2: 33, 4: 33, 8: 40}
    assert choose_path(table, rows=2) == "int8"  # more than 5% dearer at the batch's rows
    assert choose_path(table, rows=64) == "int8dyn"  # past the widest measured pass: the widest decides

    monkeypatch.setattr(paths, "survey", lambda order, *args: {p: table[p] for p in order})
    lm = make_lm("llama")
    batch = select(lm.model, lm.tokenizer, "auto", block_size=4, table_dir=tmp_path, rows=8)
    assert batch.path == "int8dyn" and batch.rows == 8 and "for batches of 8" in batch.summary()
    assert isinstance(lm.model.model.layers[0].mlp.up_proj, FusedSlice)  # converted to the chosen path
    table["int8"]["costs_ms"] = {1: 20, 2: 40, 4: 80, 8: 160}  # one sequence: int8's AR beats int8dyn's exact rate
    one = make_lm("llama")
    assert select(one.model, one.tokenizer, "auto", block_size=4, table_dir=tmp_path / "one").path == "int8"


@pytest.mark.parametrize("kept_share, measured", [(20.0, True), (1 / 20, False)])
def test_a_kept_curve_that_load_slowed_is_measured_again(tmp_path, kept_share, measured):
    lm = make_lm("llama")
    select(lm.model, lm.tokenizer, "int8dyn", block_size=4, table_dir=tmp_path)
    table_file = tmp_path / paths.TABLE_FILE
    table = json.loads(table_file.read_text())
    entry = next(iter(table.values()))["int8dyn"]
    entry["costs_ms"] = kept = {int(w): ms * kept_share for w, ms in entry["costs_ms"].items()}
    table_file.write_text(json.dumps(table))
    again, stages = make_lm("llama"), []
    with progress.listening(stages.append):
        found = select(again.model, again.tokenizer, "int8dyn", block_size=4, table_dir=tmp_path)
    kept_now = next(iter(json.loads(table_file.read_text()).values()))["int8dyn"]["costs_ms"]
    assert found.cached and found.costs_ms == pytest.approx({int(w): ms for w, ms in kept_now.items()})
    assert found.max_fed == cap_from_costs(found.costs_ms)
    if measured:  # measured again, kept in the table, and said so
        assert found.costs_ms[1] < kept[1] / 5 and any("pass costs again" in s for s in stages)
    else:
        assert found.costs_ms == pytest.approx(kept) and not any("again" in s for s in stages)


def test_a_curve_takes_at_least_its_rounds_and_more_while_time_is_left(monkeypatch):
    lm = make_lm("llama")
    passes = []
    real = CpuBackend.forward  # the backend a path decodes on: its passes are what is timed
    monkeypatch.setattr(CpuBackend, "forward", lambda self, *args, **kw: passes.append(1) or real(self, *args, **kw))
    costs = paths.pass_costs(lm.model, range(1, 3), context=8, reps=1, seconds=0)
    assert len(passes) == 1 + 2 * 3 and set(costs) == {1, 2}  # the prompt, then 2 widths x (1 + 2 warm-up) rounds
    passes.clear()
    monkeypatch.setattr(paths, "MAX_ROUNDS", 5)
    paths.pass_costs(lm.model, range(1, 3), context=8, reps=1, seconds=60)
    assert len(passes) == 1 + 2 * (5 + 2)  # time was left: rounds up to the most


def test_a_curve_slowed_by_other_load_is_bounded_by_its_wider_passes(tmp_path):
    """A curve measured beside other work (the fastest round of width 2 still slowed) is read as the wider
    passes bound it, when measured and when read from a table written before: it cannot turn exact mode off."""
    slowed = {1: 3.21, 2: 7.11, 3: 7.25, 4: 7.39, 5: 3.49, 6: 7.68, 7: 7.9, 8: 7.99}
    assert paths.monotone_curve(slowed) == {1: 3.21, 2: 3.49, 3: 3.49, 4: 3.49, 5: 3.49, 6: 7.68, 7: 7.9, 8: 7.99}
    quiet = {1: 2.22, 2: 2.24, 3: 2.4, 4: 2.51}
    assert paths.monotone_curve(quiet) == quiet
    entry = {"int8dyn": {"costs_ms": {str(w): ms for w, ms in slowed.items()}, "dnll": 0.0}}
    read = paths._chosen(entry, "int8dyn", ("int8dyn",), rows=1, block_size=4, rate=paths.ar_rate, cached=True)
    assert read.costs_ms[2] == 3.49 and list(read.costs_ms.values()) == sorted(read.costs_ms.values())


def test_cpus_of_one_model_name_are_told_apart_by_family_model_and_features(monkeypatch):
    from mars_demo.engine import machine

    zen4 = {"model name": "AMD EPYC", "cpu family": "25", "model": "17", "stepping": "1"}
    zen5 = {"model name": "AMD EPYC", "cpu family": "26", "model": "2", "stepping": "1"}
    monkeypatch.setattr(machine, "cpu_model", lambda: "AMD EPYC")
    monkeypatch.setattr(machine, "cpu_features", lambda: "fpu avx2 avx512f avx512_vnni")
    identities = []
    for fields in (zen4, zen5, zen5):
        monkeypatch.setattr(machine, "_cpuinfo_fields", lambda fields=fields: fields)
        identities.append(machine.cpu_identity())
    assert identities[0] != identities[1] == identities[2] and identities[1].startswith("AMD EPYC")
    assert "cpu family=26" in identities[1] and "model=2" in identities[1]
    monkeypatch.setattr(machine, "cpu_features", lambda: "fpu avx2")  # a VM that hides AVX-512
    assert machine.cpu_identity() != identities[2]


def test_the_cost_table_is_cached_and_a_changed_key_measures_again(tmp_path, monkeypatch):
    calls = []
    real = paths.pass_costs

    def counting(model, widths, **kwargs):
        calls.append(widths)
        return real(model, widths, reps=1, seconds=0)

    monkeypatch.setattr(paths, "pass_costs", counting)
    lm = make_lm("llama")
    first = select(lm.model, lm.tokenizer, "auto", block_size=4, table_dir=tmp_path)
    full = [w for w in calls if len(w) > 1]
    assert full[0] == range(1, 9) and len(calls) >= len(paths.PATHS)  # each path measured or probed
    assert not first.cached and first.path in paths.PATHS and set(first.candidates) == set(paths.PATHS)
    assert first.max_fed == cap_from_costs(first.costs_ms) and "dnll" in first.candidates[first.path]
    table = json.loads((tmp_path / paths.TABLE_FILE).read_text())
    assert len(table) == 1 and "threads=" in next(iter(table))

    measured = len(calls)
    again = make_lm("llama")
    monkeypatch.setattr(paths, "slowed", lambda kept, now: False)  # the kept curve's check: its own test
    second = select(again.model, again.tokenizer, "auto", block_size=4, table_dir=tmp_path)
    assert calls[measured:] == [range(1, 2)] and second.cached and second.path == first.path  # only the check
    # the model the survey converted (adopted) decodes as the cached path's conversion of a fresh copy
    prompt = [lm.tokenizer(PROMPTS[0]).input_ids]
    with torch.inference_mode():
        assert torch.equal(lm.model(input_ids=torch.tensor(prompt)).logits,
                           again.model(input_ids=torch.tensor(prompt)).logits)

    monkeypatch.setattr(paths, "cpu_identity", lambda: "another CPU")
    third = make_lm("llama")
    select(third.model, third.tokenizer, "auto", block_size=4, table_dir=tmp_path)
    assert len(calls) > measured and len(json.loads((tmp_path / paths.TABLE_FILE).read_text())) == 2


def fake_curves(rng: random.Random) -> dict[str, dict]:
    """Every path's whole curve (growing with width, as passes do) and dnll, drawn at random."""
    found = {}
    for path in paths.PATHS:
        one, costs = rng.uniform(2, 100), {}
        for width in range(1, 9):
            one += rng.choice([0, 0, rng.uniform(0, 8)])
            costs[width] = round(one, 2)
        found[path] = {"costs_ms": costs, "dnll": 0.0 if path == "fp32" else rng.choice([0.001, 0.01, 0.05])}
    return found


@pytest.mark.parametrize("seed", range(40))
def test_the_survey_chooses_as_measuring_every_path_would(seed):
    rng = random.Random(seed)
    truth = fake_curves(rng)
    probed, measured = [], []

    def curve_of(path, widths):
        (probed if len(widths) == 1 else measured).append(path)
        return {w: truth[path]["costs_ms"][w] for w in widths}

    found = paths.survey(paths.SURVEY_ORDER, range(1, 9), curve_of, lambda path: truth[path]["dnll"])
    assert set(found) == set(paths.PATHS) and measured[0] == paths.SURVEY_ORDER[0]
    for rows in (1, 2, 4, 8, 16):
        assert choose_path(found, rows=rows) == choose_path(truth, rows=rows), rows
    for path in found:
        assert found[path].get("pruned", False) == (path not in measured)


def test_the_survey_measures_one_curve_where_the_likely_winner_dominates():
    truth = {  # this machine's shape: int8dyn at the memory floor and flat, the others far above it
        "int8dyn": {"costs_ms": curve(3.0, 0.1), "dnll": 0.001},
        "int8": {"costs_ms": curve(12, 1.5), "dnll": 0.004},
        "bf16": {"costs_ms": curve(30, 4), "dnll": 0.0},
        "fp32": {"costs_ms": curve(50, 8), "dnll": 0.0},
    }
    widths = []
    found = paths.survey(paths.SURVEY_ORDER, range(1, 9), lambda p, w: widths.append((p, len(w))) or
                           {x: truth[p]["costs_ms"][x] for x in w}, lambda p: truth[p]["dnll"])
    assert widths == [("int8dyn", 8), ("int8", 1), ("bf16", 1), ("fp32", 1)]
    assert choose_path(found) == "int8dyn" and all(found[p]["pruned"] for p in ("int8", "bf16", "fp32"))
    truth["int8dyn"]["dnll"] = 0.2  # the winner fails the quality check: nothing is pruned against it
    widths.clear()
    found = paths.survey(paths.SURVEY_ORDER, range(1, 9), lambda p, w: widths.append((p, len(w))) or
                           {x: truth[p]["costs_ms"][x] for x in w}, lambda p: truth[p]["dnll"])
    assert widths[:2] == [("int8dyn", 8), ("int8", 8)] and choose_path(found) == "int8"


def test_the_survey_reports_its_stages_and_the_calibration_is_cached(tmp_path, monkeypatch):
    stages, ranges = [], []
    real = calibration.activation_ranges
    monkeypatch.setattr(calibration, "activation_ranges", lambda *args: ranges.append(1) or real(*args))
    lm = make_lm("qwen2")
    with progress.listening(stages.append):
        select(lm.model, lm.tokenizer, "auto", block_size=2, table_dir=tmp_path)
    assert any(s.startswith("measuring int8dyn (compute path 1 of 4)") for s in stages) and len(ranges) == 1
    assert stages[-1].startswith("putting the model on")
    (tmp_path / paths.TABLE_FILE).unlink()  # measured again, calibrated from the cache
    again = make_lm("qwen2")
    select(again.model, again.tokenizer, "auto", block_size=2, table_dir=tmp_path)
    assert len(ranges) == 1


def test_a_named_path_is_applied_and_measured_alone(tmp_path):
    lm = make_lm("qwen2")
    compute = select(lm.model, lm.tokenizer, "int8", block_size=4, table_dir=tmp_path)
    assert compute.path == "int8" and compute.candidates == {}
    assert any(isinstance(m, Int8Linear) for m in lm.model.modules())
    lm.compute = compute
    assert resolve_max_fed("auto", lm.compute) == compute.max_fed
    assert resolve_max_fed(5, lm.compute) == 5
    assert resolve_max_fed("auto", make_lm("qwen2").compute) is None  # nothing measured: the paper's window


def test_bad_precision_is_one_line_and_exit_2(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", "--precision", "int4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "precision" in err
    monkeypatch.setenv(paths.PRECISION_ENV, "fp16")
    with pytest.raises(ModelLoadError, match="MARS_DEMO_PRECISION"):
        default_precision()
    monkeypatch.setenv(paths.PRECISION_ENV, "int8")
    assert default_precision() == "int8"
    with pytest.raises(ValueError, match="precision must be one of"):
        paths.check_precision("fast")


def test_row_int8_linear_keeps_each_rows_output_whatever_rows_come_with_it():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 80)
    quantized = RowInt8Linear(linear.weight, linear.bias)
    x = torch.randn(6, 96)
    x[1] *= 1e4  # a loud row and a quiet one: a shared activation range would squash row 0
    x[2] *= 1e-5
    x[3, 7] = 300.0  # an outlier channel in one row
    x[4] = 0.0
    together = quantized(x)
    for i in range(6):
        assert torch.equal(quantized(x[i : i + 1])[0], together[i])
    assert torch.equal(quantized(x[None, :3])[0], together[:3])  # (batch, rows, in) as a model feeds it
    exact = linear(x)
    for i in (0, 1, 2, 5):
        assert (together[i] - exact[i]).norm() <= 0.03 * exact[i].norm()
    assert torch.equal(together[4], linear.bias.detach())
    with torch.inference_mode():
        inside = quantized(x[:2])
    with torch.no_grad():  # buffers made under inference mode stay writable outside it (transformers' generate)
        assert torch.equal(quantized(x[:2]), inside)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_smoothing_folds_into_the_weights_without_changing_the_fp32_model(arch):
    lm = make_lm(arch)
    ids = token_ids(lm.tokenizer, PROMPTS)
    embedding = lm.model.get_input_embeddings().weight.detach().clone()
    with torch.inference_mode():
        before = [lm.model(input_ids=t).logits for t in ids]
    ranges = activation_ranges(lm.model, ids)
    assert fold_smoothing(lm.model, ranges, alpha=0.5)
    changed = lm.model.model.layers[0].input_layernorm.weight
    assert not torch.allclose(changed, torch.ones_like(changed))  # the factors really moved somewhere
    with torch.inference_mode():
        for t, logits in zip(ids, before):
            assert torch.allclose(lm.model(input_ids=t).logits, logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(lm.model.get_input_embeddings().weight, embedding)  # the head was untied, not scaled


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_smoothed_int8dyn_is_row_exact_and_exact_mode_equals_ar(arch):
    lm = on_path(arch, "int8dyn", smoothed=True)
    assert any(isinstance(m, FusedSlice) for m in lm.model.modules())
    prompt = lm.tokenizer(PROMPTS[1]).input_ids
    mask = lm.meta.mask_token_id
    for fed in ([mask] * 3, [5, 6, mask, mask, mask]):
        alone, wide = first_row_logits(lm.model, prompt, fed)
        assert torch.equal(alone, wide)
    for prompt in PROMPTS:
        ar = collect(generate(lm, prompt, DecodeConfig(mode="ar", max_new_tokens=24)))
        for config in (DecodeConfig(mode="exact", max_new_tokens=24), DecodeConfig(tau=1.0, max_new_tokens=24)):
            assert collect(generate(lm, prompt, config)).token_ids == ar.token_ids


def test_a_fused_sibling_fed_another_input_computes_its_own_columns():
    lm = on_path("qwen2", "int8dyn")  # q/k/v with biases
    attention = lm.model.model.layers[0].self_attn
    x, y = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    with torch.inference_mode():
        k_alone = attention.k_proj(y)
        q = attention.q_proj(x)  # computes q, k and v of x
        k_of_y = attention.k_proj(y)  # not x: must not reuse x's columns
        assert torch.equal(k_of_y, k_alone)
        assert torch.equal(attention.k_proj(x), attention.fused_q_k_v.linear(x)[..., 64:96])
        assert torch.equal(q, attention.fused_q_k_v.linear(x)[..., :64])



@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("path, kind", [("int8", Int8Linear), ("int8dyn", RowInt8Linear)])
def test_fusing_siblings_changes_no_bit_of_the_logits(arch, path, kind, torch_layers):
    # the torch layers on both sides: the native decoder layers run fused siblings only
    fused, alone = make_lm(arch), make_lm(arch)
    convert(fused.model, path)
    for module in list(alone.model.modules()):  # the same path with every linear on its own
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, kind(child.weight, child.bias))
    assert isinstance(fused.model.model.layers[0].mlp.up_proj, FusedSlice)
    assert fused.backend.lean.attention == alone.backend.lean.attention  # the row-exact attention on both
    ids = torch.tensor([prompt_ids(fused.tokenizer, PROMPTS[0])])
    with torch.inference_mode():
        for n in (1, 3, ids.shape[1]):  # a one-token pass, a short pass, the whole prompt
            ours = fused.backend.forward(ids[:, :n], None, keep=0)
            assert torch.equal(ours, alone.backend.forward(ids[:, :n], None, keep=0))
            # transformers' own forward runs the fused siblings too (each sibling's columns of one GEMM)
            assert torch.equal(fused.model(input_ids=ids[:, :n]).logits, alone.model(input_ids=ids[:, :n]).logits)


def test_int8dyn_prefill_rows_do_not_depend_on_the_masks_fed_after_them():
    # MARS and exact prefills feed the prompt and masks, AR's the prompt alone. At SmolLM2's
    # widths SDPA over a block of rows rounds differently with 3 more rows (~1e-6), which
    # int8dyn's per-row quantisation can turn into another token, so its prefills attend row by row.
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=500, hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=512, tie_word_embeddings=True,
    )
    backend = backend_for(convert(LlamaForCausalLM(config).eval(), "int8dyn"))
    for length in (45, 70):
        ids = torch.randint(10, 500, (1, length + 3))
        with torch.inference_mode():
            alone = backend.forward(ids[:, :length], None, keep=0)
            with_masks = backend.forward(ids, None, keep=0)
        assert torch.equal(alone[0], with_masks[0, :length])


def test_the_summary_shows_short_passes_to_a_tenth_of_a_ms():
    line = paths.ComputePath("int8dyn", "auto", costs_ms={1: 5.38, 4: 6.19, 8: 43.55}, max_fed=3).summary()
    assert line == "int8dyn (auto), up to 3 tokens fed per pass; ms per pass by tokens fed 1:5.4 4:6.2 8:44"
    one = paths.ComputePath("int8dyn", "auto", costs_ms={1: 5.38}, max_fed=3, threads=1).summary()
    assert one.endswith("1:5.4 on 1 thread")


def test_bf16_rows_are_exact_at_the_released_checkpoints_widths():
    # Qwen2.5-0.5B's widths, as the released a2d-qwen2 checkpoints have them (GQA 14 / 2, an MLP of 4864):
    # oneDNN's bf16 GEMM (AVX-512) rounds the down projection's sums otherwise at 3 rows than at 1, and
    # random weights make the near ties that turn it into another token (issue #37). Fewer layers and a
    # small vocabulary show it as well.
    tokenizer = make_tokenizer("<|mask|>")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=896, intermediate_size=4864, num_hidden_layers=2,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )).eval()
    lm = LoadedModel(convert(model, "bf16"), tokenizer, resolve_meta(tokenizer, {}, "tiny-a2d-qwen2", 4), "tiny")
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight  # still tied
    mask, backend = lm.meta.mask_token_id, lm.backend
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        fed = torch.tensor([ids[-1:] + [5, 6] + [mask] * 18])  # wider than 16 rows: exact mode at block 8
        with torch.inference_mode():
            cache = backend.new_cache()
            backend.forward(torch.tensor([ids[:-1]]), cache)
            wide = backend.forward(fed, cache, keep=0)[0]
            cache.crop(fed.shape[1])
            alone = torch.cat([backend.forward(fed[:, i : i + 1], cache)[0] for i in range(fed.shape[1])])
        assert torch.equal(wide, alone), prompt  # every row of a wide pass is a one-token pass's, bit for bit
        ar = collect(generate(lm, prompt, DecodeConfig(mode="ar", max_new_tokens=16)))
        for config in (DecodeConfig(mode="exact", max_new_tokens=16), DecodeConfig(tau=1.0, max_new_tokens=16)):
            assert collect(generate(lm, prompt, config)).token_ids == ar.token_ids, (prompt, config.mode)
    for n in (12, 30):  # a prefill's prompt rows, fed alone (AR) and with masks after them (MARS, exact)
        ids = torch.randint(10, len(tokenizer) - 10, (1, n + 3))
        ids[0, n:] = mask
        with torch.inference_mode():
            assert torch.equal(backend.forward(ids[:, :n], None, keep=0)[0], backend.forward(ids, None, keep=0)[0, :n])


def test_a_saved_table_drops_what_was_measured_for_a_model_folder_that_is_gone(tmp_path):
    """A test's temporary model, or a checkpoint moved away, leaves entries no key can reach again: not kept."""
    from mars_demo.engine import machine

    here, gone = tmp_path / "here", tmp_path / "gone"
    here.mkdir()
    table = {f"AMD EPYC|model={here}|params=1": {"ms": 1}, f"AMD EPYC|model={gone}|params=1": {"ms": 2},
             "AMD EPYC|model=HuggingFaceTB/SmolLM2-135M-Instruct": {"ms": 3}, "AMD EPYC|model=llama": {"ms": 4}}
    path = tmp_path / "tables" / "costs.json"
    machine.save_table(path, table)
    assert json.loads(path.read_text()) == {key: record for key, record in table.items() if str(gone) not in key}
    assert list(path.parent.iterdir()) == [path]  # written through a staging file, replaced whole
