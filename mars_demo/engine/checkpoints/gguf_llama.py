"""A llama-family GGUF's weights as transformers names them, read in one pass over the file.

transformers' GGUF loader parses the file's metadata three times (config, tokenizer, weights), the
tokenizer's ~100k strings each time, and maps names tensor by tensor. The bundled model's config and
tokenizer are shipped instead (``SHIPPED``: written once by that loader), so a first start reads the
file once, here: each tensor dequantised by gguf's own ``dequantize`` (as transformers does), renamed,
and the q and k rows put back in transformers' order (llama.cpp's converter interleaves each head's
two RoPE halves; ``unpermute`` undoes it as transformers' ``_reverse_permute_weights`` does).
``tests/test_bundled.py`` holds the result to transformers' loader, tensor for tensor.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from ..machine import ASSETS

SHIPPED = ASSETS / "smollm2-135m-instruct"
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(name: str) -> str:
    """transformers' name of a llama GGUF tensor ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight")."""
    found = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if found and found.group(2) in _LAYER:
        return f"model.layers.{found.group(1)}.{_LAYER[found.group(2)]}.{found.group(3)}"
    stem, _, kind = name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{kind}"
    raise ValueError(f"not a llama GGUF tensor: {name}")


def unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows (heads * head_dim, in) from llama.cpp's order (per head, the two RoPE halves interleaved)."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def read_weights(path: Path, heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF at ``path``, fp32, by transformers' name."""
    from gguf import GGUFReader, dequantize

    weights = {}
    for tensor in GGUFReader(str(path)).tensors:
        values = dequantize(tensor.data, tensor.tensor_type)
        if ".attn_q." in tensor.name:
            values = unpermute(values, heads)
        elif ".attn_k." in tensor.name:
            values = unpermute(values, kv_heads)
        values = np.ascontiguousarray(values, dtype=np.float32)
        if not values.flags.writeable:  # an f32 tensor is a view of the read-only file
            values = values.copy()
        weights[hf_name(tensor.name)] = torch.from_numpy(values)
    return weights


def write(path: Path, target: Path, shipped: Path = SHIPPED) -> None:
    """A transformers model directory at ``target`` from the GGUF at ``path``: its weights as fp32 safetensors
    (a tied head left out, as ``save_pretrained`` leaves it), the shipped config and tokenizer files beside."""
    from safetensors.torch import save_file

    config = json.loads((shipped / "config.json").read_text())
    weights = read_weights(path, config["num_attention_heads"], config["num_key_value_heads"])
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    target.mkdir(parents=True, exist_ok=True)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    for part in shipped.iterdir():
        shutil.copyfile(part, target / part.name)
