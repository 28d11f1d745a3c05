"""Quality of each CPU compute path against fp32 (issue #15): greedy AR agreement and dNLL under fp32.

For every path, the bundled model (or ``--model``) decodes the held-out prompts greedily
(AR, the same settings on every path); each output is compared with fp32's for the same
prompt (``agreement``: common prefix over the longer output, as ``bench`` reports it;
``exact_match``: identical outputs) and scored teacher-forced by the fp32 model, so
``dnll_fp32`` is how much less likely fp32 finds the path's text than its own (0 for fp32;
positive: drift). ``calibration_dnll`` is the check ``auto`` ran before allowing the path
(at most 0.03).

Run it with nothing else on the CPU; BENCHMARKS.md, "Quality by compute path", has the figures::

    PYTHONPATH=. python scripts/path_quality.py --out runs/path-quality.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from mars_demo.engine.backends.cpu.paths import PATHS, cpu_model
from mars_demo.engine.checkpoints.loading import load_model
from mars_demo.engine.decoding.config import DecodeConfig
from mars_demo.engine.decoding.loop import prompt_ids
from mars_demo.engine.decoding.metrics import agreement, exact_match
from mars_demo.research.evaluation import decode, pooled_nll, teacher_forced


def compare(model: str | None, prompts: list[str], paths: list[str], max_new_tokens: int) -> dict:
    """The report: fp32's greedy outputs, then each other path's against them (module docstring)."""
    config = DecodeConfig(mode="ar", max_new_tokens=max_new_tokens)
    reference = load_model(model, precision="fp32")
    ids = [prompt_ids(reference.tokenizer, p) for p in prompts]

    def outputs_of(lm) -> tuple[list[list[int]], float]:
        started = time.perf_counter()
        out = [list(decode(lm, x, config).token_ids) for x in ids]
        return out, time.perf_counter() - started

    def nll_under_fp32(outputs: list[list[int]]) -> float:
        return pooled_nll([teacher_forced(reference.backend, x, o) for x, o in zip(ids, outputs, strict=True)])

    fp32_out, seconds = outputs_of(reference)
    fp32_nll = nll_under_fp32(fp32_out)
    rows = [{"path": "fp32", "agreement": 1.0, "exact_match": 1.0, "dnll_fp32": 0.0, "calibration_dnll": 0.0,
             "tokens": sum(map(len, fp32_out)), "seconds": round(seconds, 1)}]
    for path in (p for p in paths if p != "fp32"):
        lm = load_model(model, precision=path)
        out, seconds = outputs_of(lm)
        rows.append({
            "path": path,
            "agreement": round(agreement(out, fp32_out), 4),
            "exact_match": round(exact_match(out, fp32_out), 4),
            "dnll_fp32": round(nll_under_fp32(out) - fp32_nll, 4),
            "calibration_dnll": lm.compute.dnll if lm.compute is not None else None,
            "tokens": sum(map(len, out)),
            "seconds": round(seconds, 1),
        })
        print(json.dumps(rows[-1]), flush=True)
        del lm
        gc.collect()
    return {"model": model or "bundled", "count": len(prompts), "max_new_tokens": max_new_tokens,
            "cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "fp32_nll": round(fp32_nll, 4), "paths": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint spec (default: the bundled model)")
    parser.add_argument("--prompts", default="assets/data/heldout_varied32.json")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, from {', '.join(PATHS)}")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    prompts = json.loads(Path(args.prompts).read_text())[: args.limit]
    report = {**compare(args.model, prompts, paths, args.max_new_tokens), "prompts": args.prompts}
    print(f"{'path':8s} {'agreement':>9s} {'exact':>6s} {'dNLL fp32':>9s} {'calib':>7s}")
    for r in report["paths"]:
        calibration = r["calibration_dnll"] if r["calibration_dnll"] is not None else "-"
        print(f"{r['path']:8s} {r['agreement']:9.3f} {r['exact_match']:6.3f} {r['dnll_fp32']:+9.4f} {calibration:>7}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
