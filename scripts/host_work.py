"""A batch decoder's host work a pass, apart from its forward: what a method adds to batched AR's passes.

Static batches of ``--batch`` rows over the prompts, every method on each batch in turn (the first rotating), as
``batch_turns.py`` does. Each decoding pass's time in ``TokenBatch.step`` is split into the forward (the
backend's ``forward`` and ``fill_prefix``: the native layers and the head) and the rest (choosing widths,
accepting, committing, the controller's bookkeeping); the first pass of a batch, its prefill, is counted apart.
Totals move 5-10% with the VM's phase, so a method's host work a pass is the steadier reading: MARS that makes
batched AR's own passes should cost what batched AR costs.

    PYTHONPATH=. python scripts/host_work.py --batch 8 --methods ar,mars:0.7,mars:0.95,exact --turns 3
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from mars_demo.engine.checkpoints.loading import load_model
from mars_demo.engine.decoding.batch import stream_batch_ids
from mars_demo.engine.decoding.batch.token import TokenBatch
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.model import LoadedModel


@contextmanager
def clocked(lm: LoadedModel, seconds: defaultdict, current: list[str]) -> Iterator[None]:
    """While inside: the backend's forwards and every ``TokenBatch.step`` add their seconds to ``seconds`` under
    (``current[0]``, part); put back as they were on the way out."""
    backend, step = lm.backend, TokenBatch.step
    forward, fill = backend.forward, backend.fill_prefix

    def timed(function):
        def call(*args, **kwargs):
            started = time.perf_counter()
            out = function(*args, **kwargs)
            seconds[current[0], "forward"] += time.perf_counter() - started
            return out
        return call

    def timed_step(self, tau):
        prefill, before, started = self.passes == 0, seconds[current[0], "forward"], time.perf_counter()
        out = step(self, tau)
        part = "prefill" if prefill else "pass"
        seconds[current[0], part] += time.perf_counter() - started
        seconds[current[0], part + " forward"] += seconds[current[0], "forward"] - before
        seconds[current[0], part + " n"] += 1
        return out

    own = {name: vars(backend)[name] for name in ("forward", "fill_prefix") if name in vars(backend)}
    backend.forward, backend.fill_prefix, TokenBatch.step = timed(forward), timed(fill), timed_step
    try:
        yield
    finally:
        TokenBatch.step = step
        for name in ("forward", "fill_prefix"):  # the instance as it was: its own attribute, or the class's method
            if name in own:
                setattr(backend, name, own[name])
            else:
                delattr(backend, name)


def measure(lm: LoadedModel, prompts: list[list[int]], batch: int, methods: list[str], turns: int,
            max_new_tokens: int) -> dict[str, dict[str, float]]:
    """Per method ("mode[:tau]"): total seconds, decoding passes, the forward's ms and the rest's us a pass, and the
    prefills' seconds, over ``turns`` turns of every batch."""
    seconds: defaultdict[tuple[str, str], float] = defaultdict(float)
    current = ["warm-up"]
    batches = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]

    def run(method: str, rows: list[list[int]], tokens: int) -> None:
        mode, tau = (method.split(":") + ["1.0"])[:2]
        started = time.perf_counter()
        for _ in stream_batch_ids(lm, rows, DecodeConfig(mode=mode, tau=float(tau), max_new_tokens=tokens)):
            pass
        seconds[current[0], "total"] += time.perf_counter() - started

    with clocked(lm, seconds, current):
        for method in methods:  # untimed: builds, tables, the first batch's caches
            run(method, batches[0], min(16, max_new_tokens))
        for turn in range(turns):
            for i, rows in enumerate(batches):
                first = (turn + i) % len(methods)
                for method in methods[first:] + methods[:first]:
                    current[0] = method
                    run(method, rows, max_new_tokens)
    out = {}
    for m in methods:
        n = max(seconds[m, "pass n"], 1)
        out[m] = {"seconds": seconds[m, "total"], "passes": seconds[m, "pass n"],
                  "forward_ms": seconds[m, "pass forward"] / n * 1000,
                  "host_us": (seconds[m, "pass"] - seconds[m, "pass forward"]) / n * 1e6,
                  "prefill_seconds": seconds[m, "prefill"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="assets/data/heldout_chunk20_16.json")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--methods", default="ar,mars:0.7,mars:0.95,exact", help="mode[:tau], the first the reference")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", default="int8dyn")
    parser.add_argument("--model", default=None, help="default: the bundled model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, precision=args.precision)
    with open(args.prompts) as f:
        prompts = [prompt_ids(lm.tokenizer, text) for text in json.load(f)]
    methods = args.methods.split(",")
    found = measure(lm, prompts, args.batch, methods, args.turns, args.max_new_tokens)
    base = found[methods[0]]["seconds"]
    for m, x in found.items():
        print(f"{m:12s} {base / x['seconds']:.3f}x {methods[0]} in total; {int(x['passes'])} passes: forward "
              f"{x['forward_ms']:.3f} ms, the rest of the pass {x['host_us']:.0f} us; prefills "
              f"{x['prefill_seconds']:.3f} s")


if __name__ == "__main__":
    main()
