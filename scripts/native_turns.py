"""Native decoder builds against each other in one process, batch by batch: the steadiest A/B of a kernel change.

Each source tree's ``csrc/decoder.cpp`` (with the files it includes) is built into a scratch folder and loaded;
``NativeLayers.function`` is swapped between them before every static batch, the order reversed every other
batch, so every build decodes in the same phases of the VM. Separate processes minutes apart read +-10-30% on
these VMs (NOTES.md, "Machine facts that bite"); here a 1-2% difference shows. Only the native layers change:
the Python around them is this checkout's.

    git worktree add /tmp/before HEAD~1
    PYTHONPATH=. python scripts/native_turns.py --batch 8 --rounds 4 /tmp/before .
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mars_demo.engine.backends.cpu import int8gemm, native
from mars_demo.engine.checkpoints.loading import load_model
from mars_demo.engine.decoding.batch import stream_batch_ids
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig


def build(tree: str, where: Path, like) -> ctypes._CFuncPtr:
    """The ``decoder`` function of ``tree``'s sources, typed as the loaded one (``like``), its linears tiled,
    prefetching and on AMX tiles as this process's own (where the build has those settings)."""
    native.SOURCES = Path(tree).resolve() / "mars_demo/engine/backends/cpu/csrc"
    library = ctypes.CDLL(str(native.build("decoder", native.compiler(), where)))
    if hasattr(library, "int8_tiling") and int8gemm.tiling() is not None:
        library.int8_tiling.argtypes = [ctypes.c_int64]
        library.int8_tiling(int8gemm.TILINGS.index(int8gemm.tiling()))
    if hasattr(library, "int8_prefetch") and int8gemm.prefetching() is not None:
        few, many = int8gemm.prefetching()
        if "few_rows" in (native.SOURCES / "int8_linear.cpp").read_text():
            int8gemm.set_prefetch(library, (few, many))
        else:  # a build from before tiles of a few rows had their own choice: one for every tile of several rows
            library.int8_prefetch.argtypes = [ctypes.c_int64, ctypes.c_int64]
            library.int8_prefetch(*map(int8gemm.PREFETCHES.index, (int8gemm.ONE_ROW_PREFETCH, many)))
    if hasattr(library, "int8_amx"):  # AMX tiles from as many rows as this process's timing chose (0: none)
        library.int8_amx.argtypes, library.int8_amx.restype = [ctypes.c_int64], ctypes.c_int64
        library.int8_amx(int8gemm.amx())
    function = library.decoder
    function.argtypes, function.restype = like.argtypes, like.restype
    return function


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", help="source trees (checkouts or worktrees), the first the reference")
    parser.add_argument("--prompts", default="assets/data/heldout_chunk20_16.json")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--mode", default="ar", help="mode[:tau]")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(None, precision="int8dyn")
    layers = lm.backend.lean.native
    if layers is None:
        raise SystemExit("the native layers did not build here: nothing to compare")
    sources, scratch = native.SOURCES, Path(tempfile.mkdtemp())
    try:
        functions = {tree: build(tree, scratch, layers.function) for tree in args.trees}
    finally:
        native.SOURCES = sources
    with open(args.prompts) as f:
        prompts = [prompt_ids(lm.tokenizer, text) for text in json.load(f)]
    mode, tau = (args.mode.split(":") + ["1.0"])[:2]
    config = DecodeConfig(mode=mode, tau=float(tau), max_new_tokens=args.max_new_tokens)
    rates: dict[str, list[float]] = {tree: [] for tree in args.trees}
    for round_ in range(args.rounds):
        for start in range(0, len(prompts), args.batch):
            turn = round_ + start // args.batch
            for tree in args.trees if turn % 2 == 0 else args.trees[::-1]:
                layers.function = functions[tree]
                began, tokens = time.perf_counter(), 0
                for event in stream_batch_ids(lm, prompts[start : start + args.batch], config, scheme="token"):
                    tokens += sum(len(row.token_ids) for row in event.rows)
                rates[tree].append(tokens / (time.perf_counter() - began))
    reference = rates[args.trees[0]]
    for tree in args.trees:
        ratios = [r / base for base, r in zip(reference, rates[tree])]
        print(f"{tree:24s} {statistics.median(rates[tree]):8.1f} tok/s, {statistics.median(ratios):.3f}x "
              f"{args.trees[0]} (median of {len(ratios)} batches; mean {statistics.mean(ratios):.3f})")


if __name__ == "__main__":
    main()
