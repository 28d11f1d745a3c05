"""A stored conversion (backends/cpu/stored.py) rebuilds the converted model bit for bit, and a warm load
(checkpoints/warm.py) reads it instead of converting; an unusable entry is converted again with one logged line."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mars_demo.engine.backends import backend_for
from mars_demo.engine.backends.cpu import int8gemm, native_layers, rowattn, stored
from mars_demo.engine.backends.cpu.calibration import token_ids
from mars_demo.engine.backends.cpu.paths import convert
from mars_demo.engine.backends.cpu.quant import activation_ranges
from mars_demo.engine.checkpoints import loading, warm

from conftest import CORPUS, PROMPTS


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The native kernels loaded from the usual cache (nothing built here), then MARS_DEMO_CACHE a fresh folder."""
    for kernel in (int8gemm.kernel, native_layers.kernel, rowattn.kernel):
        kernel()
    monkeypatch.setenv("MARS_DEMO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _logits(model, tokenizer) -> torch.Tensor:
    ids = torch.tensor([tokenizer(PROMPTS[0] + " " + PROMPTS[2]).input_ids])
    with torch.inference_mode():
        return backend_for(model, on_path=True).forward(ids, None, keep=0)


def _skeleton(model):
    with torch.device("meta"):
        return type(model)(copy.deepcopy(model.config)).eval()


@pytest.mark.parametrize("path", ["int8dyn", "int8", "bf16"])
def test_a_stored_conversion_rebuilds_the_converted_model_bit_for_bit(tiny_lm, path, tmp_path):
    fp32 = copy.deepcopy(tiny_lm.model)
    ranges = activation_ranges(fp32, token_ids(tiny_lm.tokenizer, CORPUS)) if path == "int8dyn" else None
    converted = convert(fp32, path, ranges=ranges)
    if not stored.storable(converted):
        pytest.skip("no native int8 kernel here: fbgemm's packed weights are not stored")
    file = tmp_path / "entry.safetensors"
    assert stored.save(converted, file)
    rebuilt = stored.rebuild(_skeleton(tiny_lm.model), path, ranges, file)
    ours, theirs = dict(stored.tensors_of(converted)), dict(stored.tensors_of(rebuilt))
    assert ours.keys() == theirs.keys() and all(t.device.type == "cpu" for t in theirs.values())
    assert all(torch.equal(ours[name], theirs[name]) and ours[name].dtype == theirs[name].dtype for name in ours)
    assert [type(m) for m in converted.modules()] == [type(m) for m in rebuilt.modules()]
    # where the kernels may expect their tensors (int8's weight-only GEMM crashed on 8-byte aligned weights)
    assert all(t.data_ptr() % stored.ALIGNMENT == 0 for t in theirs.values() if t.numel())
    assert torch.equal(_logits(converted, tiny_lm.tokenizer), _logits(rebuilt, tiny_lm.tokenizer))


def test_a_file_that_does_not_fit_the_model_is_refused(tiny_llama, tiny_qwen, tmp_path):
    file = tmp_path / "entry.safetensors"
    converted = convert(copy.deepcopy(tiny_llama.model), "bf16")
    assert stored.save(converted, file)
    with pytest.raises(stored.StoredError, match="missing"):  # qwen2's q/k/v biases are not in llama's file
        stored.rebuild(_skeleton(tiny_qwen.model), "bf16", None, file)
    with pytest.raises(stored.StoredError, match="bfloat16, the model needs"):  # int8 keeps the embedding fp32
        stored.rebuild(_skeleton(tiny_llama.model), "int8", None, file)
    with safe_open(file, "pt") as kept:
        names = kept.keys()  # a safe_open handle has no iteration of its own
        tensors, meta = {name: kept.get_tensor(name) for name in names}, kept.metadata()
    save_file({**tensors, "model.extra": torch.zeros(1)}, file, metadata=meta)
    with pytest.raises(stored.StoredError, match="does not hold: model.extra"):
        stored.rebuild(_skeleton(tiny_llama.model), "bf16", None, file)


def test_a_warm_load_reads_the_stored_conversion_and_a_broken_one_is_made_again(model_dir, cache, monkeypatch, caplog):
    first = loading.load_model(model_dir, precision="int8dyn")
    warm.wait_stored()
    entries = list((cache / stored.FOLDER).glob("*.safetensors"))
    if not entries:
        pytest.skip("no native int8 kernel here: nothing stored")
    real_select = loading.select
    monkeypatch.setattr(loading, "select", lambda *args, **kwargs: pytest.fail("converted again"))
    rebuilt = loading.load_model(model_dir, precision="int8dyn")
    assert rebuilt.compute.path == "int8dyn" and rebuilt.compute.cached
    assert torch.equal(_logits(first.model, first.tokenizer), _logits(rebuilt.model, rebuilt.tokenizer))
    assert rebuilt.model.config.to_dict() == first.model.config.to_dict()
    assert rebuilt.model.generation_config.to_dict() == first.model.generation_config.to_dict()

    monkeypatch.setattr(loading, "select", real_select)
    entries[0].write_bytes(b"half a file")
    with caplog.at_level(logging.WARNING):
        again = loading.load_model(model_dir, precision="int8dyn")
        warm.wait_stored()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "stored conversion" in warned[0] and warned[0].endswith("converting again")
    assert torch.equal(_logits(first.model, first.tokenizer), _logits(again.model, again.tokenizer))
    monkeypatch.setattr(loading, "select", lambda *args, **kwargs: pytest.fail("converted again"))
    assert loading.load_model(model_dir, precision="int8dyn").compute.cached  # stored anew, whole


def test_an_entry_is_named_by_what_its_bits_depend_on(tiny_llama, cache):
    ranges = {"a": torch.ones(3)}
    name = stored.entry(cache, "weights v1", "tiny", "int8dyn", ranges)
    assert name.parent == cache / stored.FOLDER and name.name.startswith("tiny-int8dyn-")
    others = [stored.entry(cache, "weights v2", "tiny", "int8dyn", ranges),
              stored.entry(cache, "weights v1", "tiny", "int8", None),
              stored.entry(cache, "weights v1", "tiny", "int8dyn", {"a": torch.full((3,), 2.0)})]
    assert name not in others and len(set(others)) == 3


def test_a_merged_adapter_is_not_stored_as_its_base(model_dir, cache, tmp_path):
    """An adapter merged at load changes the weights its base's files name: its conversion must not be stored."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=2, target_modules=["q_proj"]))
    for name, parameter in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter)  # a merge that changes the weights
    lora.save_pretrained(tmp_path / "adapter")
    config = tmp_path / "adapter" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": model_dir}))
    merged = loading.load_model(str(tmp_path / "adapter"), precision="int8dyn")
    warm.wait_stored()
    assert not list((cache / stored.FOLDER).glob("*.safetensors"))
    # nor measured as its base: its own cost table entry and int8dyn calibration (keyed by the adapter's bits)
    from mars_demo.engine.backends.cpu import paths

    plain = loading.load_model(model_dir, precision="int8dyn")
    assert paths.model_key(merged.model) != paths.model_key(plain.model)
    assert "+adapter-" in merged.model.config._name_or_path
