#!/usr/bin/env bash
# Every GPU check and benchmark on one CUDA device, each under its own time limit, one after another:
#
#     bash benchmarks/gpu_suite.sh [STEP ...]      # default: all steps, in the order below
#
# The peers benchmark needs torchtitan and megatron-core (see benchmarks/moe_layer_peers.py for the wheels).
# Results land in benchmarks/results/ (the *_gpu / *_h100 / *_cuda files) and logs in $LOG_DIR
# (default: /tmp/moetrain-gpu-logs). A step that fails is reported and the next one runs.
set -u
cd "$(dirname "$0")/.."
LOG_DIR=${LOG_DIR:-/tmp/moetrain-gpu-logs}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1

tests() { python -m pytest tests/gpu -q -p no:cacheprovider -rA; }
moe_layer() { python benchmarks/moe_layer.py --scale 1 --experts 32 --tokens 16384 --iters 10 \
    --out benchmarks/results/moe_layer_h100.json; }
memory() { python benchmarks/memory_policy.py --device cuda --budget-fraction 0.3 --repeats 10; }
memory_long() { python benchmarks/memory_policy.py --device cuda --budget-fraction 0.3 --repeats 10 --seq-len 8192 \
    --out benchmarks/results/memory_gpu_seq8192.json; }
step_tiny() { python benchmarks/planner_step_check.py --device cuda --steps 20 --skip 5; }
step_small() { python benchmarks/planner_step_check.py --device cuda --model benchmarks/data/pangu-shaped-small.yaml \
    --seq-len 4096 --global-batch 8 --micro-batch 1 --steps 8 --skip 3; }
balance() { python benchmarks/balance_expert_gemm.py --device cuda --model pangu-ultra-moe-718b --tokens-per-rank 8192; }
attention_probe() { python benchmarks/gpu_attention_probe.py --out benchmarks/results/gpu_attention_probe.json; }
profile_small() { python benchmarks/gpu_step_profile.py --model benchmarks/data/pangu-shaped-small.yaml --seq-len 4096 \
    --global-batch 8 --micro-batch 1 --out benchmarks/results/gpu_step_profile_small_compiled.json; }
profile_tiny() { python benchmarks/gpu_step_profile.py --out benchmarks/results/gpu_step_profile_tiny.json; }
step_speed() { for mb in 1 2; do python benchmarks/step_speed.py --device cuda \
    --model benchmarks/data/pangu-shaped-small.yaml --seq-len 4096 --global-batch 8 --micro-batch $mb --steps 6 \
    --out benchmarks/results/step_speed_h100_mb$mb.json; done; }
step_speed_synthetic() { python benchmarks/step_speed.py --device cuda --model benchmarks/data/pangu-shaped-small.yaml \
    --seq-len 4096 --global-batch 8 --micro-batch 2 --steps 6 --variants compiled --synthetic-data \
    --out benchmarks/results/step_speed_h100_mb2_synthetic.json; }
attention_layout() { python benchmarks/gpu_attention_layout.py --out benchmarks/results/gpu_attention_layout.json; }
moe_layer_peers() { python benchmarks/moe_layer_peers.py --compile --out benchmarks/results/moe_layer_peers_h100.json; }
demo() { python benchmarks/train_demo.py --tag h100 --cache "${MOETRAIN_CACHE:-$HOME/.cache/moetrain}" --quiet \
    --device cuda; }

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests moe_layer memory memory_long attention_probe profile_small profile_tiny
                                  step_tiny step_small balance demo step_speed step_speed_synthetic
                                  attention_layout moe_layer_peers)
for step in "${steps[@]}"; do
    start=$(date +%s)
    echo "=== $step"
    timeout "${STEP_TIMEOUT:-300}" bash -c "$(declare -f "$step"); $step" > "$LOG_DIR/$step.log" 2>&1
    rc=$?
    tail -n 25 "$LOG_DIR/$step.log"
    echo "=== $step: exit $rc after $(( $(date +%s) - start )) s"
done
