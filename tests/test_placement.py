"""Models spread over devices by accelerate decode exactly like the same model on one device.

The tiny model is dispatched with a device_map that splits its layers between the CPU
and disk offload, the way ``device_map="auto"`` spreads the 7B checkpoints over GPUs:
offloaded weights sit on the ``meta`` device (so ``model.device`` is ``meta``) and
accelerate's hooks bring each layer's weights in for its forward pass.
"""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import dispatch_model

from mars_demo.engine.backends.cpu import lean
from mars_demo.engine.backends.placement import SeededGenerator, input_device
from mars_demo.engine.decoding.batch import collect_batch, generate_batch
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import collect, generate
from mars_demo.engine.model import LoadedModel

from conftest import PROMPTS, make_lm

SPLIT = {  # the first layer on disk, so nothing can read the input device off the first parameter
    "model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk",
    "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk",
}
CONFIGS = {
    "mars": DecodeConfig(tau=0.7, max_new_tokens=20),
    "mars-capped": DecodeConfig(tau=0.7, max_new_tokens=20, max_fed=3),
    "mars-sampled": DecodeConfig(tau=0.7, max_new_tokens=20, temperature=0.8, seed=3),
    "ar": DecodeConfig(mode="ar", max_new_tokens=20),
    "exact": DecodeConfig(mode="exact", max_new_tokens=20),
    "hybrid": DecodeConfig(mode="hybrid", tau=0.7, max_new_tokens=20),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[LoadedModel, LoadedModel]:
    plain = make_lm("qwen2")
    model = dispatch_model(copy.deepcopy(plain.model), SPLIT, main_device="cpu",
                           offload_dir=str(tmp_path_factory.mktemp("offload")))
    spread = LoadedModel(model=model, tokenizer=plain.tokenizer, meta=plain.meta, name="tiny-qwen2-dispatched")
    return plain, spread


def test_the_split_really_offloads(pair):
    _, spread = pair
    assert spread.model.model.embed_tokens.weight.device.type == "meta"
    assert spread.model.lm_head.weight.device.type == "meta"
    assert spread.model.device.type == "meta"  # what the decoder used to put its inputs on
    assert input_device(spread.model) == torch.device("cpu")
    assert "dispatched" in lean.unsupported(spread.model)  # the lean forward would skip accelerate's hooks


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dispatched_decodes_like_undispatched(pair, name):
    plain, spread = pair
    config = CONFIGS[name]
    for prompt in PROMPTS:
        want = collect(generate(plain, prompt, config))
        got = collect(generate(spread, prompt, config))
        assert got.token_ids == want.token_ids
        assert [s.confidences for s in got.steps] == [s.confidences for s in want.steps]
        assert got.stats.forward_passes == want.stats.forward_passes


@pytest.mark.parametrize("scheme", ["token", "block"])
def test_dispatched_batches_like_undispatched(pair, scheme):
    plain, spread = pair
    config = DecodeConfig(tau=0.7, max_new_tokens=16)
    want = collect_batch(generate_batch(plain, PROMPTS, config, scheme=scheme))
    got = collect_batch(generate_batch(spread, PROMPTS, config, scheme=scheme))
    assert got.token_ids == want.token_ids


def test_input_device_of_a_plain_model_is_its_device(tiny_llama):
    assert input_device(tiny_llama.model) == tiny_llama.model.device


def test_seeded_generator_is_made_once_where_first_asked():
    generator = SeededGenerator(5)
    first = generator.on(torch.device("cpu"))
    assert generator.on(torch.device("cpu")) is first
    assert torch.equal(torch.rand(3, generator=first), torch.rand(3, generator=torch.Generator().manual_seed(5)))
    assert SeededGenerator(None).on(torch.device("cpu")) is None


@pytest.fixture
def host_threads(monkeypatch):
    """torch's thread count and the module's record of a user's choice, restored afterwards."""
    from mars_demo.engine.backends import placement

    before = torch.get_num_threads()
    monkeypatch.setattr(placement, "_threads_chosen", False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield placement
    torch.set_num_threads(before)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs a machine where torch runs several threads")
def test_a_gpu_decoding_host_runs_one_thread_unless_chosen(host_threads, monkeypatch):
    threads = torch.get_num_threads()
    host_threads.settle_gpu_host(torch.device("cpu"))
    assert torch.get_num_threads() == threads  # a CPU model keeps its team
    host_threads.settle_gpu_host(torch.device("cuda"))
    assert torch.get_num_threads() == 1

    torch.set_num_threads(threads)
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
    host_threads.settle_gpu_host(torch.device("cuda"))
    assert torch.get_num_threads() == threads  # the platform's count stands

    monkeypatch.delenv("OMP_NUM_THREADS")
    host_threads.choose_host_threads(2)
    host_threads.settle_gpu_host(torch.device("cuda"))
    assert torch.get_num_threads() == 2  # so does a user's
