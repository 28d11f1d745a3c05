"""The live shared batch (engine/serving/shared.py) under 1, 2 and 4 users sending at once: wall time, tokens/s, tau.

Each user's prompt is one of the app's examples; all are submitted together (the batch paused) and
decoded to the end, first under the live policy, then under fixed:1.0 (batched greedy AR) for
comparison. Prints one line per run and writes JSON with --out.

    PYTHONPATH=. python scripts/live_load.py --users 1,2,4 --max-new-tokens 64 --out docs/live-load.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

from mars_demo.engine.checkpoints.loading import BUNDLED, load_for_decoding
from mars_demo.engine.decoding.chat import prompt_ids
from mars_demo.engine.serving.loop import ServeConfig
from mars_demo.engine.serving.policies import parse_policy
from mars_demo.engine.serving.shared import LIVE_POLICY, SharedBatch
from mars_demo.ui.examples import EXAMPLE_PROMPTS


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                platform.processor())


def run(lm, users: int, policy: str, max_new: int) -> dict:
    batch = SharedBatch.of(lm, ServeConfig(max_batch=4, max_new_tokens=max_new, block_size=lm.meta.block_size),
                           policy=parse_policy(policy), max_queue=4, idle=1.0)
    prompts = [prompt_ids(lm.tokenizer, EXAMPLE_PROMPTS[k]) for k in range(users)]
    with batch.paused():
        lives = [batch.submit(p) for p in prompts]
        started = time.perf_counter()
    results = [list(live.updates(timeout=600)) for live in lives]
    wall = time.perf_counter() - started
    steps = [[s for u in r for s in u.steps] for r in results]
    tokens = sum(len(s.tokens) for row in steps for s in row)
    row_passes = sum(len(row) for row in steps)
    return {
        "users": users, "policy": policy, "wall_s": round(wall, 3), "tokens": tokens, "batch_passes": len(batch.passes),
        "tokens_per_second": round(tokens / wall, 2), "tokens_per_row_pass": round(tokens / row_passes, 3),
        "taus": sorted({s.tau for row in steps for s in row}), "endings": [r[-1].status for r in results],
        "ms_per_pass": round(1000 * sum(p.seconds for p in batch.passes) / len(batch.passes), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", default="1,2,4")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out")
    args = parser.parse_args()
    lm = load_for_decoding(BUNDLED)
    run(lm, 1, "fixed:1.0", 8)  # warm-up
    rows = []
    for users in (int(u) for u in args.users.split(",")):
        for policy in dict.fromkeys([LIVE_POLICY, "fixed:1.0"]):
            rows.append(run(lm, users, policy, args.max_new_tokens))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        report = {"cpu": cpu_model(), "model": lm.name, "compute": lm.compute.summary() if lm.compute else None,
                  "runs": rows}
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
