"""Where a batched pass's time goes, by method: the forward against the host work around it, pass by pass.

On a GPU the measured cost surface can be flat while batched MARS and exact passes take far longer than it says
(BENCHMARKS.md, "GPU"). This script answers where that time goes. It first decodes in a loop for ``--warmup``
seconds, recording each pass (a process's first passes can run slow), then times every method's passes with the
forward synchronised and timed apart (the rest of ``TokenBatch.step`` is host work: acceptance, pricing,
bookkeeping), compares the forward by rows and width with the surface's price, then runs each method once
under ``torch.profiler`` and prints the ops that took the most device and host time.

    PYTHONPATH=. python scripts/gpu_profile.py --batch 8 --methods ar,exact,mars:0.9 --out DIR
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from mars_demo.engine.checkpoints.loading import load_model
from mars_demo.engine.decoding.batch import stream_batch_ids
from mars_demo.engine.decoding.batch.rows import PaddedCache
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.surface import surface_for


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class ForwardClock:
    """Wraps PaddedCache's two forwards: each call synchronised and timed, inside a profiler label."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("forward_padded", "forward_block"):
            setattr(PaddedCache, name, self._wrap(getattr(PaddedCache, name), name))

    def _wrap(self, method, name: str):
        def timed(cache, *args, **kwargs):
            sync()
            started = time.perf_counter()
            with record_function(f"mars:{name}"):
                out = method(cache, *args, **kwargs)
                sync()
            self.seconds += time.perf_counter() - started
            return out

        return timed


COLLECTIONS = [0, 0, 0]  # Python's garbage collections so far, by generation


def _counted(phase: str, info: dict) -> None:
    if phase == "start":
        COLLECTIONS[info["generation"]] += 1


gc.callbacks.append(_counted)


def allocator() -> tuple[int, int]:
    """The CUDA caching allocator's (segments allocated, alloc retries) so far; zeros without a GPU."""
    if not torch.cuda.is_available():
        return 0, 0
    stats = torch.cuda.memory_stats()
    return stats.get("segment.all.allocated", 0), stats.get("num_alloc_retries", 0)


def run(lm, prompts, method: str, tokens: int, clock: ForwardClock) -> list[dict]:
    """Decode ``prompts`` as one batch with ``method`` (mode[:tau]); one record per pass, with what else happened in
    it: Python's full collections and the CUDA allocator's new segments."""
    mode, tau = (method.split(":") + ["1.0"])[:2]
    config = DecodeConfig(mode=mode, tau=float(tau), max_new_tokens=tokens)
    passes, before = [], (COLLECTIONS[2], *allocator())
    for event in stream_batch_ids(lm, prompts, config, scheme="token"):
        forward, clock.seconds = clock.seconds, 0.0
        now = (COLLECTIONS[2], *allocator())
        live = sum(1 for row in event.rows if row.token_ids)
        passes.append({"kind": event.kind, "rows": live, "width": event.fed, "tokens": event.tokens,
                       "ms": event.seconds * 1e3, "forward_ms": forward * 1e3, "full_gc": now[0] - before[0],
                       "segments": now[1] - before[1], "retries": now[2] - before[2]})
        before = now
    return passes


def decoding(timed: dict[str, list[dict]]) -> list[dict]:
    """Every method's decoding passes (no prefill) with live rows."""
    return [p for passes in timed.values() for p in passes if p["kind"] != "prefill" and p["rows"]]


def by_rows_and_width(passes: list[dict]) -> dict[tuple[int, int], list[dict]]:
    shapes: dict[tuple[int, int], list[dict]] = {}
    for p in passes:
        shapes.setdefault((p["rows"], p["width"]), []).append(p)
    return shapes


def slow_passes(timed: dict[str, list[dict]]) -> str:
    """Decoding passes over twice their shape's median against the rest: what the slow ones share (a full
    collection, a new allocator segment, the forward or the host)."""
    decode = decoding(timed)
    medians = {shape: statistics.median(p["ms"] for p in passes) for shape, passes in by_rows_and_width(decode).items()}
    lines = []
    for name, slow in (("slow", True), ("other", False)):
        group = [p for p in decode if (p["ms"] > 2 * medians[p["rows"], p["width"]]) == slow]
        if group:
            mean = {key: sum(p[key] for p in group) / len(group) for key in ("ms", "forward_ms", "full_gc",
                                                                              "segments", "retries")}
            lines.append(f"{name:5s} passes {len(group):5d}: forward {mean['forward_ms']:6.2f} ms, host "
                         f"{mean['ms'] - mean['forward_ms']:6.2f} ms, full collections {mean['full_gc']:.3f}, new "
                         f"segments {mean['segments']:.3f}, alloc retries {mean['retries']:.3f} a pass")
    return "\n".join(lines)


def summary(method: str, passes: list[dict], surface) -> str:
    decode = [p for p in passes if p["kind"] != "prefill"]
    ms = statistics.median(p["ms"] for p in decode)
    forward = statistics.median(p["forward_ms"] for p in decode)
    priced = [surface.ms(p["rows"], p["width"]) for p in decode if p["rows"]] if surface else []
    rate = sum(p["tokens"] for p in passes) / sum(p["ms"] for p in passes) * 1e3
    width = statistics.mean(p["width"] for p in decode)
    return (f"{method:10s} {len(decode):4d} passes, {rate:7.1f} tok/s, pass median {ms:6.2f} ms (forward"
            f" {forward:6.2f}, host {ms - forward:5.2f}), width mean {width:4.2f}"
            + (f", surface's price median {statistics.median(priced):6.2f} ms" if priced else ""))


def by_shape(timed: dict[str, list[dict]], surface) -> str:
    """The synchronised forward's median ms by (rows, width) over every method's decoding passes, against the
    surface's price: whether a wide pass on this path costs what the surface says."""
    lines = ["rows width passes forward-ms (p10 p90) surface-ms"]
    for (rows, width), passes in sorted(by_rows_and_width(decoding(timed)).items()):
        price = f"{surface.ms(rows, width):10.2f}" if surface else "         -"
        ms = sorted(p["forward_ms"] for p in passes)  # p10 and p90: a shape's passes may come in two speeds
        spread = f"({ms[len(ms) // 10]:6.2f} {ms[9 * len(ms) // 10]:6.2f})"
        lines.append(f"{rows:4d} {width:5d} {len(ms):6d} {statistics.median(ms):10.2f} {spread} {price}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="assets/data/heldout_varied32.json")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--methods", default="ar,exact,mars:0.9,mars:0.7", help="mode[:tau]")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=40.0, help="seconds of untimed decoding first")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--out", default=None, help="a folder for every pass's record (passes.json)")
    args = parser.parse_args()
    lm = load_model(args.model, precision=args.precision)
    with open(args.prompts) as f:
        prompts = [prompt_ids(lm.tokenizer, text) for text in json.load(f)[: args.batch]]
    methods, clock = args.methods.split(","), ForwardClock()
    surface = surface_for(lm)
    print(f"device {lm.backend.device}, backend {type(lm.backend).__name__}, surface: {surface and surface.summary()}")
    record: dict = {"warmup": [], "timed": {}}
    started = time.perf_counter()
    while time.perf_counter() - started < args.warmup:  # every method in turn, each pass kept (the warm-up curve)
        for method in methods:
            at = time.perf_counter() - started
            passes = run(lm, prompts, method, args.max_new_tokens, clock)
            record["warmup"].append({"method": method, "at_s": round(at, 2), "passes": passes})
            print(f"warm-up at {at:6.1f} s: " + summary(method, passes, surface))
    for method in methods:
        record["timed"][method] = passes = run(lm, prompts, method, args.max_new_tokens, clock)
        print("timed: " + summary(method, passes, surface))
    print(by_shape(record["timed"], surface))
    print(slow_passes(record["timed"]))
    if args.out:  # before the profiles: parsing a profile's events can outrun the step's deadline
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "passes.json").write_text(json.dumps(record))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    for method in methods:
        with profile(activities=activities) as prof:
            run(lm, prompts, method, args.max_new_tokens, clock)
        print(f"\n== profile: {method}\n" + prof.key_averages().table(sort_by=sort, row_limit=18))
        if torch.cuda.is_available():  # the host's side too
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
