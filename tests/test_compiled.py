"""The optional compiled decoding path (static KV cache + torch.compile) decodes like the default one.

On the CPU the compile uses dynamo's ``eager`` backend: the graph capture, the static
cache and its rewinding are what is tested; inductor / CUDA graphs only change kernels.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, StaticCache

from mars_demo.engine.backends.hf import STATIC_CACHE_STEP, HFCache, TransformersBackend, compile_passes
from mars_demo.engine.decoding.config import DecodeConfig, resolve_max_fed
from mars_demo.engine.decoding.loop import collect, generate, steady_shapes
from mars_demo.engine.model import LoadedModel

from conftest import PROMPTS, make_lm

CONFIGS = {
    "mars": DecodeConfig(tau=0.7, max_new_tokens=16),
    "mars-tau1": DecodeConfig(tau=1.0, max_new_tokens=12),
    "mars-sampled": DecodeConfig(tau=0.7, max_new_tokens=16, temperature=0.8, seed=1),
    "ar": DecodeConfig(mode="ar", max_new_tokens=12),
    "exact": DecodeConfig(mode="exact", max_new_tokens=12),  # stays on the dynamic path
}


@pytest.fixture(scope="module")
def pair() -> tuple[LoadedModel, LoadedModel]:
    plain = make_lm("llama")
    model = copy.deepcopy(plain.model)
    compiled = LoadedModel(model=model, tokenizer=plain.tokenizer, meta=plain.meta, name="tiny-llama-compiled")
    compiled.chosen = compile_passes(model, backend="eager")
    return plain, compiled


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_decodes_like_eager(pair, name):
    plain, compiled = pair
    for prompt in PROMPTS[:2]:
        want = collect(generate(plain, prompt, CONFIGS[name]))
        got = collect(generate(compiled, prompt, CONFIGS[name]))
        assert got.token_ids == want.token_ids
        assert got.stats.forward_passes == want.stats.forward_passes
        for a, b in zip(got.steps, want.steps):
            assert a.confidences == pytest.approx(b.confidences, rel=1e-5, abs=1e-6)


def test_prompts_of_different_lengths_share_the_compiled_graphs(pair):
    from torch._dynamo.utils import counters

    _, compiled = pair
    config = CONFIGS["ar"]
    lengths = [len(compiled.tokenizer(p)["input_ids"]) for p in PROMPTS[:3]]
    assert len(set(lengths)) > 1  # the point: static caches asked for with different lengths
    collect(generate(compiled, PROMPTS[0], config))
    graphs = counters["stats"]["unique_graphs"]
    for prompt in PROMPTS[1:3]:
        collect(generate(compiled, prompt, config))
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_warmed_backend_compiles_nothing_while_it_decodes(pair):
    """bench --compile compiles every steady pass shape before timing: a width met only now and then (every mask
    accepted) compiled in the middle of a timed run on a GPU."""
    from torch._dynamo.utils import counters

    plain, _ = pair

    def fresh() -> LoadedModel:  # with nothing compiled yet (dynamo shares graphs between copies of a model)
        torch._dynamo.reset()
        model = copy.deepcopy(plain.model)
        lm = LoadedModel(model=model, tokenizer=plain.tokenizer, meta=plain.meta, name="tiny-llama-compiled")
        lm.chosen = compile_passes(model, backend="eager")
        return lm

    def graphs_while_decoding(lm: LoadedModel) -> int:
        before = counters["stats"]["unique_graphs"]
        for prompt in PROMPTS[:3]:
            for config in (CONFIGS["mars"], CONFIGS["ar"]):
                collect(generate(lm, prompt, config))
        return counters["stats"]["unique_graphs"] - before

    assert graphs_while_decoding(fresh()) > 0  # unwarmed, the shapes compile as they come
    warmed = fresh()
    shapes = steady_shapes(plain.meta.block_size, resolve_max_fed(CONFIGS["mars"].max_fed, None))
    assert (1, 1) in shapes and len(shapes) == plain.meta.block_size + 1
    assert warmed.backend.warm(shapes) == len(shapes) and plain.backend.warm(shapes) == 0
    assert graphs_while_decoding(warmed) == 0


def test_steady_shapes_follow_the_cap_on_tokens_fed():
    assert steady_shapes(4, None) == {(1, 1), (4, 4), (5, 4), (6, 4), (7, 4)}
    # 4 fed, but never under 2 candidates (so 5 fed after 4 accepted)
    assert steady_shapes(4, 4) == {(1, 1), (4, 4), (4, 3), (4, 2), (5, 2)}


def test_static_cache_only_when_compiled(pair):
    plain, compiled = pair
    assert isinstance(plain.backend, TransformersBackend) and plain.backend.compiled is None
    assert isinstance(plain.backend.new_cache(32).inner, DynamicCache)
    static = compiled.backend.new_cache(32).inner
    assert isinstance(static, StaticCache) and static.get_max_length() % STATIC_CACHE_STEP == 0
    assert isinstance(compiled.backend.new_cache().inner, DynamicCache)  # no size: verifying passes


def test_rewind_moves_the_static_write_position_back(pair):
    plain, _ = pair
    cache = HFCache(StaticCache(config=plain.model.config, max_cache_len=16))
    with torch.no_grad():
        plain.model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), past_key_values=cache.inner, use_cache=True)
    assert int(cache.get_seq_length()) == 5
    cache.crop(2)
    assert int(cache.get_seq_length()) == 3
    dynamic = HFCache(DynamicCache(config=plain.model.config))
    with torch.no_grad():
        plain.model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), past_key_values=dynamic.inner, use_cache=True)
    dynamic.crop(2)
    assert dynamic.get_seq_length() == 3


def test_bench_compile_is_for_cuda(model_dir, tmp_path, capsys):
    from mars_demo import cli

    prompts = tmp_path / "prompts.json"
    prompts.write_text('["Count: one, two"]')
    argv = ["bench", "--model", model_dir, "--prompts", str(prompts), "--device", "cpu", "--precision", "fp32",
            "--compile", "--out", str(tmp_path / "report.json")]
    assert cli.main(argv) == 2
    assert "--compile is for CUDA" in capsys.readouterr().err
