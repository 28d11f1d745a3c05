"""The AR path reference of ``validate``, simulated as a sliding window instead of block by block.

For each model: the AR head's probability of every row token of heldout_val64.jsonl, then a
decoding-like walk over each row where a pass at p accepts candidate j while
P(x_p) * ... * P(x_{p+j-1}) >= tau, and the next pass starts where this one stopped.
Run from the repository root: PYTHONPATH=. python docs/experiments/2026-11-23-recipe-trials/ar_path_sliding.py SPEC...
"""

import json
import sys
from pathlib import Path

import torch

from mars_demo.engine.checkpoints.loading import load_model

BLOCK = 4
rows = [json.loads(line) for line in Path("assets/data/heldout_val64.jsonl").read_text().splitlines()]
for spec in sys.argv[1:]:
    model = load_model(spec).model
    probs = []
    with torch.no_grad():
        for row in rows:
            n = len(row["prompt_ids"])
            logits = model(torch.tensor([row["prompt_ids"] + row["response_ids"]])).logits[0, n - 1 : -1].float()
            target = torch.tensor(row["response_ids"])
            probs.append(logits.softmax(-1)[torch.arange(len(target)), target].tolist())
    cells = []
    for tau in (0.95, 0.9, 0.7):
        accepted = passes = 0
        for ps in probs:
            p = 0
            while p < len(ps):
                k, path = 1, ps[p]
                while k < BLOCK and p + k < len(ps):
                    path *= ps[p + k]
                    if path < tau:
                        break
                    k += 1
                accepted, passes, p = accepted + k, passes + 1, p + k
        cells.append(f"tau {tau}: {accepted / passes:.3f}")
    print(spec, "sliding AR path tok/pass:", ", ".join(cells), flush=True)
