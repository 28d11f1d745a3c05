"""``auto``'s survey (likely winner first, dominated paths pruned) against measuring every path at every width.

Loads the bundled model in fp32 and, in turns, runs the survey and the full measurement on the same
conversions (``paths._Candidates``), so both read this machine at the same moments. Prints each
round's choice and cap, and the wall seconds of each. ``--rounds N`` repeats the pair.

    PYTHONPATH=. python scripts/auto_vs_full.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mars_demo.engine.backends.cpu import calibration, paths
from mars_demo.engine.checkpoints.loading import load_model
from mars_demo.engine.decoding.exact import decode_rate
from mars_demo.engine.machine import cache_dir


def one(candidates, widths, prune: bool) -> tuple[dict, float]:
    started = time.perf_counter()
    real = paths.dominated
    if not prune:
        paths.dominated = lambda first, curve: False
    try:
        found = paths.survey(paths.SURVEY_ORDER, widths, candidates.curve, candidates.dnll)
    finally:
        paths.dominated = real
    return found, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    lm = load_model(None)  # fp32, no compute path
    widths = range(1, 2 * lm.meta.block_size + 1)
    ranges = calibration.smoothing_ranges(lm.model, lm.tokenizer, paths.model_key(lm.model), cache_dir())
    texts = calibration.token_ids(lm.tokenizer, calibration.calibration_texts())
    candidates = paths._Candidates(lm.model, texts, ranges)
    rows = []
    for _ in range(args.rounds):
        for prune in (True, False):
            found, seconds = one(candidates, widths, prune)
            path = paths.choose_path(found, rate=decode_rate, block_size=lm.meta.block_size)
            costs = {int(w): ms for w, ms in found[path]["costs_ms"].items()}
            rows.append({"survey" if prune else "full": path, "cap": paths.cap_from_costs(costs),
                         "seconds": round(seconds, 2), "measured": [p for p in found if "dnll" in found[p]],
                         "curves": {p: found[p]["costs_ms"] for p in found}})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "curves"}), flush=True)
    print(json.dumps({"cpu": paths.cpu_model(), "threads": torch.get_num_threads(), "rounds": rows}))


if __name__ == "__main__":
    main()
