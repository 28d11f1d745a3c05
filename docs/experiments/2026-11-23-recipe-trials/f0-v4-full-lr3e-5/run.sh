#!/bin/bash
# Session 8: full fine-tuning continuing v4 (merged) on rows 5308-6257, same rows/steps/validation as c0.
cd /work/main
common="--data assets/data/distill.jsonl --skip-rows 5308 --max-rows 950 --base /root/.cache/mars_demo/smollm2-135m-mars-a0c28f81a43fb4cd --full --block-size 4 --ar-weight 2 --val-data assets/data/heldout_val64.jsonl --save-every 50 --val-every 119"
.venv/bin/python -m mars_demo train $common --out runs/trials/f0-v4-full-lr3e-5 --lr 3e-5 > runs/trials/f0.log 2>&1
touch runs/trials/full.done
