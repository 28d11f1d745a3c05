"""Checkpoint specs: released-style a2d-qwen2 checkpoints, mars.json metadata, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from mars_demo.engine.checkpoints.loading import ModelLoadError, block_size_from_name, choose_mask_token, load_model
from mars_demo.engine.decoding import acceptance
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import collect, generate
from mars_demo.engine.model import MarsMeta

from conftest import PROMPTS, make_lm


def save_as_released(lm, directory):
    """Save a tiny Qwen2 the way the released MARS checkpoints are published."""
    lm.model.save_pretrained(directory)
    lm.tokenizer.save_pretrained(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["model_type"] = "a2d-qwen2"
    config["architectures"] = ["A2DQwen2LMHeadModel"]
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_a2d_qwen2.A2DQwen2LMHeadModel"}
    config_path.write_text(json.dumps(config))


def test_a2d_qwen2_checkpoint_loads_as_stock_qwen2_and_decodes(tmp_path):
    tiny = make_lm("qwen2")
    directory = tmp_path / "MARS-Qwen2.5-tiny-blk8"
    save_as_released(tiny, directory)
    acceptance.greedy_kernel.cache_clear()
    lm = load_model(str(directory))
    assert acceptance.greedy_kernel.cache_info().currsize == 1  # the greedy kernel is ready before the first pass
    assert type(lm.model).__name__ == "Qwen2ForCausalLM"
    assert lm.meta.block_size == 8  # from the name
    assert lm.meta.mask_token == "<|mask|>"
    assert lm.meta.mask_token_id == tiny.tokenizer.convert_tokens_to_ids("<|mask|>")
    ids = lm.tokenizer("hello fox", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.allclose(lm.model(ids).logits, tiny.model(ids).logits, atol=1e-5)
    result = collect(generate(lm, PROMPTS[0], DecodeConfig(tau=0.5, max_new_tokens=12)))
    assert result.stats.tokens == len(result.token_ids) > 0


def test_mars_json_beside_a_checkpoint_wins_over_the_rules(tmp_path):
    tiny = make_lm("llama")
    directory = tmp_path / "plain-blk16"
    tiny.model.save_pretrained(directory)
    tiny.tokenizer.save_pretrained(directory)
    assert load_model(str(directory)).meta.block_size == 16
    MarsMeta(block_size=2, mask_token_id=3, mask_token="<unused0>").save(directory)
    lm = load_model(str(directory))
    assert (lm.meta.block_size, lm.meta.mask_token) == (2, "<unused0>")
    assert load_model(str(directory), block_size=6).meta.block_size == 6  # the caller wins


def test_mask_token_rules():
    qwen, llama = make_lm("qwen2").tokenizer, make_lm("llama").tokenizer
    assert choose_mask_token(qwen) == "<|mask|>"
    assert choose_mask_token(llama) == "<unused0>"  # an unused special token: no new parameters
    with pytest.raises(ModelLoadError, match="vocabulary"):
        choose_mask_token(llama, "<|not-a-token|>")
    assert block_size_from_name("Xalphinions/MARS-Qwen2.5-0.5B-blk16") == 16
    assert block_size_from_name("some/model") is None


def test_unknown_models_get_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown model"):
        load_model(str(tmp_path / "missing" / "dir"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_model(str(tmp_path / "empty"))
