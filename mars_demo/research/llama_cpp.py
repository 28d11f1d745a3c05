"""llama.cpp in ``bench``: the same prompts through llama-cpp-python, greedy, timed as our decoders are.

Methods (the model's GGUF weights):
  llama_cpp          the Q8_0 weights made once from the shipped GGUF (the format closest to int8dyn)
  llama_cpp_q4       the shipped GGUF as it is (Q4_1)
  llama_cpp_lookup   the Q8_0 weights with llama-cpp-python's prompt-lookup decoding (LlamaPromptLookupDecoding),
                     batch 1 only
llama_cpp and llama_cpp_q4 run at every batch size on llama.cpp's own API (``Batched``): a chunk's prompts are the
sequences of one context, the prefill one ``llama_decode`` of every prompt, then one call a pass over the live
rows' newest tokens, as llama.cpp's server batches its slots; at batch 1 that is plain greedy decoding without
the high-level ``Llama.generate``'s per-token sampler work.
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

import numpy as np
import torch

from ..engine.checkpoints.loading import BUNDLED, BUNDLED_BASE, gguf_path, load_model
from ..engine.decoding.config import DecodeConfig
from ..engine.decoding.loop import eos_ids
from ..engine.decoding.metrics import agreement
from ..engine.machine import cache_dir
from ..engine.model import LoadedModel

logger = logging.getLogger(__name__)

METHODS = ("llama_cpp", "llama_cpp_q4", "llama_cpp_lookup")
BATCHED = ("llama_cpp", "llama_cpp_q4")  # also at batch sizes above 1 (batched AR's peers)
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
def lookup_runner(threads: int):
    """The llama_cpp.Llama with prompt-lookup decoding on the Q8_0 weights (loaded once per process)."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    return llama_cpp.Llama(
        model_path=str(q8_path()), n_ctx=CONTEXT, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0,
        draft_model=LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS),
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


class Batched:
    """Greedy batched decoding on llama.cpp's own API: one context whose sequences are a chunk's rows.

    Each ``decode`` clears the context's memory, feeds every prompt in one ``llama_decode`` (each its own
    sequence, logits for its last token only), then one call a pass over the live rows' newest tokens; a row
    leaves at a stop token (kept) or after ``max_new`` tokens. Each sequence has its own part of the cache
    (``kv_unified`` off), as rows of our batches have their own cache rows. The context is made again, larger,
    where a chunk needs more room than it has.
    """

    def __init__(self, model, rows: int, threads: int) -> None:
        import llama_cpp

        self.lib, self.model, self.rows, self.threads = llama_cpp, model, rows, threads
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.ctx = self.batch = None
        self.room = 0  # cache cells per sequence of the current context

    def _fit(self, room: int) -> None:
        """A context with at least ``room`` cells per sequence (rounded up to a power of two, 512 at least)."""
        if room <= self.room:
            return
        self.close()
        lib, self.room = self.lib, max(512, 1 << (room - 1).bit_length())
        params = lib.llama_context_default_params()
        params.n_seq_max, params.kv_unified, params.no_perf = self.rows, False, True
        params.n_ctx = params.n_batch = self.room * self.rows  # a chunk's whole prefill fits one call
        params.n_threads = params.n_threads_batch = self.threads
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context")
        self.batch = lib.llama_batch_init(params.n_batch, 0, 1)

    def decode(self, prompts: list[list[int]], max_new: int, stop: set[int]) -> tuple[list[list[int]], int]:
        """Greedy tokens after each prompt (the stop token kept) and the ``llama_decode`` calls they took."""
        if len(prompts) > self.rows:
            raise ValueError(f"{len(prompts)} prompts for a context of {self.rows} sequences")
        self._fit(max(map(len, prompts)) + max_new)
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        outs: list[list[int]] = [[] for _ in prompts]
        feed = [(token, pos, row) for row, ids in enumerate(prompts) for pos, token in enumerate(ids)]
        live, passes = list(range(len(prompts))), 0
        while live:
            read = self._feed(feed)
            passes += 1
            for row in live:
                logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, read[row]), shape=(self.vocab,))
                outs[row].append(int(logits.argmax()))
            live = [r for r in live if outs[r][-1] not in stop and len(outs[r]) < max_new]
            feed = [(outs[r][-1], len(prompts[r]) + len(outs[r]) - 1, r) for r in live]
        return outs, passes

    def _feed(self, feed: list[tuple[int, int, int]]) -> dict[int, int]:
        """One ``llama_decode`` of (token, position, row) entries, logits kept for each row's last; {row: its index}."""
        batch, read = self.batch, {}
        for i, (token, pos, row) in enumerate(feed):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = token, pos, 1, row
            batch.logits[i] = False
            read[row] = i
        for i in read.values():
            batch.logits[i] = True
        batch.n_tokens = len(feed)
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return read

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
        self.ctx = self.batch = None
        self.room = 0


@cache
def loaded(weights: Path):
    """GGUF ``weights`` loaded through llama.cpp's own API, once per process (a ``llama_model`` pointer)."""
    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's own log lines: errors only
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(weights).encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {weights}")
    return model


@cache
def batched(method: str, rows: int, threads: int) -> Batched:
    """The runner of ``method`` (llama_cpp or llama_cpp_q4) for chunks of up to ``rows`` prompts."""
    return Batched(loaded(gguf_path() if method == "llama_cpp_q4" else q8_path()), rows, threads)


def run(
    lm: LoadedModel, method: str, prompts: list[list[int]], max_new: int, tick=lambda n: None, batch_size: int = 1
):
    """``method`` over ``prompts`` (token ids) in chunks of ``batch_size``: an ``Outcome`` as bench's other runners
    return."""
    from .benchmark import Outcome  # bench imports this module lazily, in its runner

    stop = eos_ids(lm.backend, lm.tokenizer)
    if method in BATCHED:
        runner_, size = batched(method, batch_size, torch.get_num_threads()), batch_size

        def one(chunk):  # (outputs, passes, each row's passes): one token a pass while a row is live
            outs, passes = runner_.decode(chunk, max_new, stop)
            return outs, passes, [len(out) for out in outs]
    else:
        llm, size = lookup_runner(torch.get_num_threads()), 1

        def one(chunk):
            out, passes = decode(llm, chunk[0], max_new, stop)
            return [out], passes, [passes]
    result = Outcome()
    for start in range(0, len(prompts), size):
        chunk = prompts[start : start + size]
        started = time.perf_counter()
        outs, passes, row_passes = one(chunk)
        result.seconds += time.perf_counter() - started
        result.outputs += outs
        result.forward_passes += passes
        result.row_passes += row_passes
        tick(len(chunk))
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
