#!/usr/bin/env bash
# The GPU recipe's last call (CONTRIBUTING.md, "On a GPU"): train from the base, then measure.
#
#   scripts/gpu_session.sh SECONDS
#
# Runs from the repository root on the device machine after the base GGUF was put together under
# /tmp/site (CONTRIBUTING.md). Every step has a deadline inside SECONDS, so what finished comes back
# even when a step runs long: a cut training run leaves its last checkpoint's adapter. Results go to
# $OUT (at most 8 files come back): the adapter in 15 MB pieces and one tarball of the small files.
# QUICK=1 runs every step at toy size on any device (to check the script before spending GPU time).
set -u
budget=${1:-480}
begin=$SECONDS
OUT=${OUT:-/tmp/gpu-out}
runs=/tmp/runs
mkdir -p "$OUT/small" "$runs"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} MARS_DEMO_CACHE=${MARS_DEMO_CACHE:-/tmp/mc} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
log=$OUT/small/log.txt
left() { echo $((budget - (SECONDS - begin) - 25)); }  # 25 s kept for packing
step() {  # step NAME SHARE_OF_WHAT_IS_LEFT(%) COMMAND...: run with a deadline, log it
    local name=$1 share=$2; shift 2
    local limit=$(( $(left) * share / 100 ))
    if [ "$limit" -lt 20 ]; then echo "== $name: skipped, $(left) s left" >>"$log"; return; fi
    echo "== $name ($limit s at most, $(left) s left): $*" >>"$log"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    echo "== $name: rc $? after $((SECONDS - t0)) s" >>"$log"
}

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1; lscpu | grep "Model name"
  $py -c "import torch, transformers, peft, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"; } >>"$log" 2>&1

if [ "${QUICK:-0}" = 1 ]; then
    train_size=(--max-rows 8 --max-steps 2 --batch-size 2 --val-rows 2 --save-every 1)
    bench_size=(--limit 1 --max-new-tokens 8 --batch-sizes 1,2)
    sim_size=(--requests 3 --max-new-tokens 8)
    turns_size=(--turns 2 --max-new-tokens 8 --precision fp32); turns_limit=2
    profile_size=(--batch 2 --max-new-tokens 8 --warmup 2 --precision fp32)
    device=(--device cpu)
else
    train_size=(--epochs "${EPOCHS:-3}" --batch-size "${BATCH:-16}" --lr "${LR:-6e-4}" --save-every 100 --val-every 400)
    bench_size=(--limit 4 --max-new-tokens 64 --batch-sizes 1,2,4,8)  # an eager pass takes ~20 ms on an H200
    sim_size=(--requests 60 --max-new-tokens 64)
    turns_size=(--turns 3 --max-new-tokens 64 --precision auto); turns_limit=4  # sized to fit (CONTRIBUTING.md)
    profile_size=(--batch 8 --max-new-tokens 64 --warmup 10 --methods ar,exact)
    device=()
fi
model=$runs/gpu
# 1. MARS fine-tuning from the base on every row (LoRA r64: the bundled adapter's form and size)
[ "${SKIP_TRAIN:-0}" = 1 ] || step train 60 $py -m mars_demo train --base smollm2-135m --data assets/data/distill.jsonl --out "$model" \
    --val-data assets/data/heldout_val64.jsonl --ar-weight 2.0 "${train_size[@]}" "${device[@]}"
[ -f "$model/adapter_model.safetensors" ] || model=smollm2-135m-mars  # no adapter: measure the bundled one
# 2. the compiled path (CUDA graphs), first: compiling takes minutes (BENCHMARKS.md, "GPU"), so 2 prompts
[ "${QUICK:-0}" = 1 ] || step compiled 45 $py -m mars_demo bench --model "$model" \
    --prompts assets/data/heldout_varied32.json --taus 0.9 --methods ar,mars,mars_exact --limit 2 --max-new-tokens 64 \
    --batch-sizes 1 --compile --out "$OUT/small/bench-compiled.json"
# 3. the methods in turns in one process, the rows that matter most first
for rows in 8 4; do  # at least turns_limit prompts, and a full batch of them
    step "turns at $rows rows" 40 env PYTHONPATH=".:$PYTHONPATH" $py scripts/batch_turns.py --model "$model" --prompts assets/data/heldout_varied32.json \
        --batch $rows --limit $(( rows > turns_limit ? rows : turns_limit )) --methods ar,exact,mars:0.9,mars:0.7 "${turns_size[@]}"
done
# 4. serving on the measured clock (the GPU's own cost surface prices each pass's width); exact mode in the same run,
# taking turns with the others pass by pass (a run of its own reads another phase of the machine)
step "serve-sim measured" 60 $py -m mars_demo serve-sim --model "$model" --rate 30 --seed 0 --max-batch 8 \
    --policies fixed:1.0,fixed:0.9,adaptive,fixed:1.0@exact --arrivals poisson --mode mars --no-quality --clock measured \
    "${sim_size[@]}" --out "$OUT/small/serve-measured"
# 5. where a batched pass's time goes: the forward timed apart from the host work, then a profile per method
# (BENCHMARKS.md, "GPU": how cuDNN's per-shape graph builds showed)
step profile 35 env PYTHONPATH=".:$PYTHONPATH" $py scripts/gpu_profile.py --model "$model" "${profile_size[@]}" \
    --out "$OUT/small/profile"
# 6. single-sequence and batch speed
step bench 50 $py -m mars_demo bench --model "$model" --prompts assets/data/heldout_varied32.json --taus 0.9 \
    --methods hf_generate,ar,mars,mars_exact,ar_batch_ours,mars_batch_token,exact_batch "${bench_size[@]}" \
    "${device[@]}" --out "$OUT/small/bench-eager.json"

# pack: the run's small files in one tarball, the adapter in pieces under 16 MB
for f in training.json loss.jsonl val.jsonl mars.json adapter_config.json; do
    [ -f "$runs/gpu/$f" ] && cp "$runs/gpu/$f" "$OUT/small/"
done
cp "$MARS_DEMO_CACHE"/cost-surfaces.json "$OUT/small/" 2>/dev/null
rm -f "$OUT"/small/*/*.html "$OUT"/small/*.html  # pages are large; the JSON holds every figure
tar -czf "$OUT/small.tgz" -C "$OUT" small && rm -rf "$OUT/small"
[ -f "$runs/gpu/adapter_model.safetensors" ] && split -b 15M "$runs/gpu/adapter_model.safetensors" "$OUT/adapter.part-"
ls -la "$OUT"
