"""Batched decoders against batched AR in one process, in turns: the steadiest ratio this project's VMs give.

Each turn decodes every prompt in static batches of ``--batch`` rows once with every method, the order
reversed every other turn, and each method's ratio to the first (batched AR) is taken within the turn;
the median over turns is printed. Every method first runs once on the first batch, untimed. ``bench``
runs each batch size's methods group by group, so a ratio there can read 5-10% apart between runs of
the same code as the VM's phase moves (BENCHMARKS.md, "Many requests at once"); here the methods share
each phase.

    PYTHONPATH=. python scripts/batch_turns.py --batch 8 --methods ar,mars:0.9,exact --turns 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mars_demo.engine.checkpoints.loading import load_model
from mars_demo.engine.decoding.batch import stream_batch_ids
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig

AFTER = 6  # --after-wide: one-token passes this many or more after a wider one are counted together


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="assets/data/heldout_chunk20_16.json")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--methods", default="ar,mars:0.7,mars:0.9,mars:0.95,exact",
                        help="mode[:tau], the first the reference")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: the loader's choice)")
    parser.add_argument("--precision", default="int8dyn", help="int8dyn here; auto on a GPU")
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--by-width", action="store_true",
                        help="also each method's decoding passes by (rows, columns fed a row): count, median ms, "
                             "tokens a ms (where a method's wide passes pay or not)")
    parser.add_argument("--after-wide", action="store_true",
                        help="also each method's one-token passes over the whole batch by passes since its last wider "
                             "one, median ms: what a wide pass costs the passes after it")
    parser.add_argument("--torch-attention", action="store_true",
                        help="on a GPU, SDPA's kernels as torch picks them, cuDNN's included (backends/hf.py)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, precision=args.precision)
    if args.torch_attention and lm.backend.device.type == "cuda":  # the backend switched cuDNN's SDPA off: back on
        torch.backends.cuda.enable_cudnn_sdp(True)
    with open(args.prompts) as f:
        prompts = [prompt_ids(lm.tokenizer, text) for text in json.load(f)[: args.limit]]
    methods = args.methods.split(",")
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    passes: dict[str, dict[tuple[int, int], list[tuple[float, int]]]] = {m: {} for m in methods}
    after: dict[str, dict[int, list[float]]] = {m: {} for m in methods}  # one-token passes by passes since a wide one
    for turn in range(-1, args.turns):  # turn -1: every method once on the first batch, untimed (warm-up)
        for method in methods if turn % 2 == 0 else methods[::-1]:
            mode, tau = (method.split(":") + ["1.0"])[:2]
            config = DecodeConfig(mode=mode, tau=float(tau), max_new_tokens=args.max_new_tokens)
            started = time.perf_counter()
            for i in range(0, len(prompts) if turn >= 0 else 1, args.batch):
                since = AFTER  # passes since the batch's last wider one
                for event in stream_batch_ids(lm, prompts[i : i + args.batch], config, scheme="token"):
                    if turn >= 0 and event.kind != "prefill":
                        shape = (sum(1 for row in event.rows if row.width), event.fed)  # rows in the pass
                        passes[method].setdefault(shape, []).append((event.seconds, event.tokens))
                        if shape == (args.batch, 1):
                            after[method].setdefault(min(since, AFTER), []).append(event.seconds)
                        since = 0 if event.fed > 1 else since + 1
            if turn >= 0:
                seconds[method].append(time.perf_counter() - started)
    reference = seconds[methods[0]]
    for method in methods:
        ratios = [r / s for r, s in zip(reference, seconds[method])]
        print(f"{method:12s} {statistics.median(seconds[method]):7.3f} s a turn, {statistics.median(ratios):.3f}x "
              f"{methods[0]} (turns: {' '.join(f'{r:.3f}' for r in ratios)})")
        if args.by_width:
            for (rows, fed), seen in sorted(passes[method].items()):
                ms = statistics.median(s for s, _ in seen) * 1000
                per_ms = sum(t for _, t in seen) / sum(s for s, _ in seen) / 1000
                print(f"    {rows} rows x {fed} fed: {len(seen)} passes, {ms:.2f} ms, {per_ms:.2f} tokens a ms")
        if args.after_wide and after[method]:
            found = (f"{k}{'+' if k == AFTER else ''}: {statistics.median(v) * 1000:.2f} ms ({len(v)})"
                     for k, v in sorted(after[method].items()))
            print(f"    one-token passes of the whole batch by passes since a wider one: {', '.join(found)}")
        if args.by_width:
            for name, whole in (("the whole batch", True), ("fewer rows", False)):  # a static batch's tail apart
                seen = [x for (rows, _), xs in passes[method].items() if (rows == args.batch) == whole for x in xs]
                spent, tokens = sum(s for s, _ in seen), sum(t for _, t in seen)
                if seen:
                    print(f"    passes of {name}: {len(seen)}, {spent:.2f} s, {tokens / spent / 1000:.2f} tokens a ms")


if __name__ == "__main__":
    main()
