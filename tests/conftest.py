"""Tiny random models and a small byte-level tokenizer, built inside the tests (no network)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from mars_demo.engine.backends.cpu import native_layers
from mars_demo.engine.checkpoints.loading import ModelLoadError, resolve_meta
from mars_demo.engine.model import LoadedModel

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Explain why the sky is blue.",
    "def add(a, b):\n    return a + b\n# Write a Python function that adds two numbers.",
    "Once upon a time there was a small robot who loved to count: one, two, three, four.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber \u4f60\u597d \u3053\u3093\u306b\u3061\u306f \U0001f600",
]
PROMPTS = ["Explain why the sky is blue.", "Write a story about a fox.", "def add(a, b):", "Count: one, two"]


def make_tokenizer(mask_token: str | None) -> PreTrainedTokenizerFast:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unused0>"] + ([mask_token] if mask_token else [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>", mask_token=mask_token, chat_template=CHAT_TEMPLATE,
    )
    fast.add_special_tokens({"additional_special_tokens": ["<unused0>"]})
    return fast


def make_model(arch: str, tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    common = {
        "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        # A large init makes the random model's distributions peaked, so several
        # candidates per pass clear tau and the MARS paths are really exercised.
        "initializer_range": 0.3, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id, "tie_word_embeddings": False,
    }
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def make_lm(arch: str, block_size: int = 4, seed: int = 0) -> LoadedModel:
    tokenizer = make_tokenizer("<|mask|>" if arch == "qwen2" else None)
    model = make_model(arch, tokenizer, seed)
    meta = resolve_meta(tokenizer, {}, f"tiny-{arch}", block_size)
    return LoadedModel(model=model, tokenizer=tokenizer, meta=meta, name=f"tiny-{arch}")


@pytest.fixture
def torch_layers(monkeypatch):
    """int8dyn models built in the test run the lean forward's torch layers: the native decoder is switched off."""
    monkeypatch.setenv(native_layers.DECODER_ENV, "0")
    native_layers.kernel.cache_clear()
    yield
    native_layers.kernel.cache_clear()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_lm(request) -> LoadedModel:
    return make_lm(request.param)


@pytest.fixture(scope="session")
def tiny_llama() -> LoadedModel:
    return make_lm("llama")


@pytest.fixture(scope="session")
def tiny_qwen() -> LoadedModel:
    return make_lm("qwen2")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A tiny Llama saved as a checkpoint directory, for commands that take --model."""
    directory = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    lm = make_lm("llama")
    lm.model.save_pretrained(directory)
    lm.tokenizer.save_pretrained(directory)
    return str(directory)


def tiny_loader(lm: LoadedModel):
    """An app model loader that serves ``lm`` for every spec except those starting with "bad" (a load error)."""

    def loader(spec: str, precision=None) -> LoadedModel:
        if spec.startswith("bad"):
            raise ModelLoadError(f"unknown model {spec!r}")
        return lm

    return loader
