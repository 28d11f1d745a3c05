"""scripts/host_work.py: a batch pass's time split into the forward and the rest, the clocks put back after."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mars_demo.engine.decoding.batch.token import TokenBatch
from mars_demo.engine.decoding.chat import prompt_ids

from conftest import PROMPTS, make_lm

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "host_work.py"
spec = importlib.util.spec_from_file_location("host_work", SCRIPT)
host_work = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_work)


def test_each_method_gets_its_passes_forward_and_host_work_and_the_clocks_are_put_back(tmp_path, monkeypatch):
    monkeypatch.setenv("MARS_DEMO_CACHE", str(tmp_path / "cache"))
    lm = make_lm("llama")
    prompts = [prompt_ids(lm.tokenizer, p) for p in PROMPTS]
    step = TokenBatch.step
    found = host_work.measure(lm, prompts, 2, ["ar", "mars:0.9"], turns=1, max_new_tokens=6)
    assert TokenBatch.step is step and "forward" not in vars(lm.backend) and "fill_prefix" not in vars(lm.backend)
    assert set(found) == {"ar", "mars:0.9"}
    assert 0 < found["ar"]["passes"] <= 2 * 5  # two batches, a token from each prefill, five passes each at most
    for x in found.values():
        assert x["passes"] > 0 and x["forward_ms"] > 0 and x["host_us"] > 0 and x["prefill_seconds"] > 0
        assert x["seconds"] > x["prefill_seconds"] + x["passes"] * x["forward_ms"] / 1000  # the rest is in the total
