"""One warm start's load, timed in a fresh process: ``load_model(None, precision="auto")`` on MARS_DEMO_CACHE, then
the first pass over a chat prompt. Run it once on a new cache folder to fill it, then again for warm loads;
for a before/after comparison alternate two worktrees, each on its own cache folder:

    MARS_DEMO_CACHE=/tmp/fm-after PYTHONPATH=. python scripts/warm_load.py
"""

from __future__ import annotations

import time

started = time.perf_counter()
import torch  # the imports are timed too

from mars_demo.engine.checkpoints import warm
from mars_demo.engine.checkpoints.loading import load_model
from mars_demo.engine.decoding.chat import prompt_ids


def main() -> None:
    imported = time.perf_counter()
    lm = load_model(None, precision="auto")
    loaded = time.perf_counter()
    warm.wait_stored()  # a filling run's stored conversion, written before the pass is timed
    waited = time.perf_counter()
    ids = torch.tensor([prompt_ids(lm.tokenizer, "Write a short story about a robot who learns to count.")])
    with torch.inference_mode():
        lm.backend.forward(ids, lm.backend.new_cache())
    passed = time.perf_counter()
    print(f"imports {imported - started:.2f} s, load_model {loaded - imported:.3f} s, "
          f"first pass {passed - waited:.3f} s; {lm.compute.path}, table cached {lm.compute.cached}")


if __name__ == "__main__":
    main()
