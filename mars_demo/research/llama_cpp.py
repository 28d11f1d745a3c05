"""llama.cpp in ``bench``: the same prompts through llama-cpp-python, greedy, timed as our decoders are.

Methods (batch 1, the model's GGUF weights):
  llama_cpp          the Q8_0 weights made once from the shipped GGUF (the format closest to int8dyn)
  llama_cpp_q4       the shipped GGUF as it is (Q4_1)
  llama_cpp_lookup   the Q8_0 weights with llama-cpp-python's prompt-lookup decoding (LlamaPromptLookupDecoding)
Each prompt is fed as the token ids our chat template gives (``prompt_ids``), the cache is cleared before
it (no prefix reuse across prompts, as our decoders prefill every prompt), decoding is greedy, stops at
our stop ids (the stop token kept, as ``cut_at_stop`` keeps it) or after ``max_new`` tokens, on torch's
thread count. The clock covers the prefill and the decoding, as ``run_single``'s does.

llama-cpp-python is an optional install (requirements-llama.txt); without it the methods are skipped
with one line (``missing``).
"""

from __future__ import annotations

import ctypes
import logging
import time
from functools import cache
from pathlib import Path

import torch

from ..engine.checkpoints.loading import BUNDLED, BUNDLED_BASE, gguf_path, load_model
from ..engine.decoding.config import DecodeConfig
from ..engine.decoding.loop import eos_ids
from ..engine.decoding.metrics import agreement
from ..engine.machine import cache_dir
from ..engine.model import LoadedModel

logger = logging.getLogger(__name__)

METHODS = ("llama_cpp", "llama_cpp_q4", "llama_cpp_lookup")
LOOKUP_TOKENS = 10  # drafted tokens per lookup, as bench's prompt_lookup_tokens
CONTEXT = 4096
INSTALL = "pip install -r requirements-llama.txt"


def missing(lm: LoadedModel) -> str | None:
    """Why the llama.cpp methods cannot run for ``lm`` here (one line), or None.

    llama.cpp reads the bundled base model's GGUF, so they run beside the bundled models only: the base
    (the same weights) and the MARS model (the base with its adapter merged: the same architecture and
    cost, other weights, so agreement with it measures the adapter too).
    """
    if lm.name not in (BUNDLED, BUNDLED_BASE):
        return f"llama.cpp runs the bundled GGUF, not {lm.name!r}: the llama_cpp methods are skipped"
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama-cpp-python is not installed: the llama_cpp methods are skipped ({INSTALL})"
    try:
        gguf_path()
    except Exception as err:  # noqa: BLE001 - the GGUF's package is missing: one line, the methods skipped
        return f"no GGUF weights for llama.cpp ({err}): the llama_cpp methods are skipped"
    return None


def q8_path(source: Path | None = None, target: Path | None = None) -> Path:
    """The shipped GGUF requantised to Q8_0 with llama.cpp's own quantizer, made once (into the cache)."""
    import llama_cpp

    source = source or gguf_path()
    target = target or cache_dir() / "llama_cpp" / f"{source.stem.rsplit('.', 1)[0]}.Q8_0.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(target.name + ".tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True  # the source is already quantised (Q4_1)
    params.nthread = torch.get_num_threads()
    if llama_cpp.llama_model_quantize(str(source).encode(), str(staging).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {source}")
    staging.replace(target)
    return target


@cache
def runner(method: str, threads: int):
    """The llama_cpp.Llama for ``method`` (weights loaded once per process)."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    weights = gguf_path() if method == "llama_cpp_q4" else q8_path()
    draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS) if method == "llama_cpp_lookup" else None
    return llama_cpp.Llama(
        model_path=str(weights), n_ctx=CONTEXT, n_threads=threads, n_threads_batch=threads, draft_model=draft,
        verbose=False, seed=0,
    )


def decode(llm, ids: list[int], max_new: int, stop: set[int]) -> tuple[list[int], int]:
    """Greedy tokens after ``ids`` (the stop token kept) and the passes (``eval`` calls) they took."""
    passes = [0]
    evaluate = llm.eval

    def counted(tokens):
        passes[0] += 1
        return evaluate(tokens)

    llm.eval = counted
    out: list[int] = []
    try:
        llm.reset()  # no prefix kept from the last prompt
        for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            out.append(token)
            if token in stop or len(out) >= max_new:
                break
    finally:
        llm.eval = evaluate
    return out, passes[0]


def run(lm: LoadedModel, method: str, prompts: list[list[int]], max_new: int, tick=lambda n: None):
    """``method`` over ``prompts`` (token ids): an ``Outcome`` as bench's other runners return."""
    from .benchmark import Outcome  # bench imports this module lazily, in its runner

    llm = runner(method, torch.get_num_threads())
    stop = eos_ids(lm.backend, lm.tokenizer)
    result = Outcome()
    for ids in prompts:
        started = time.perf_counter()
        out, passes = decode(llm, ids, max_new, stop)
        result.seconds += time.perf_counter() - started
        result.outputs.append(out)
        result.forward_passes += passes
        result.row_passes.append(passes)
        tick(1)
    return result


def fp32_agreement(lm: LoadedModel, prompts: list[list[int]], max_new: int, runs: list[dict], outputs: dict) -> None:
    """Add ``agreement_fp32`` to every batch-1 run: its agreement with our AR on the fp32 path (the reference
    the compute paths are checked against), so llama.cpp's quantised weights and ours are read side by side.

    ``outputs``: each run's outputs, by (method, tau) as in ``runs``.
    """
    from .benchmark import run_single

    reference = load_model(lm.name, precision="fp32", block_size=lm.meta.block_size)
    config = DecodeConfig(mode="ar", max_new_tokens=max_new)
    fp32 = run_single(reference, prompts, config).outputs
    for run in runs:
        if run["batch_size"] == 1 and (run["method"], run["tau"]) in outputs:
            run["agreement_fp32"] = round(agreement(outputs[run["method"], run["tau"]], fp32), 4)
