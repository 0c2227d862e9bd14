#!/usr/bin/env bash
# Every GPU figure in one slot: the checks and benchmarks on one CUDA device, in priority order, each under
# its own time limit and all of them under one budget (a step that no longer fits is skipped, and says so).
#
#     bash benchmarks/gpu_suite.sh                      # on the GPU: every step, within $SUITE_BUDGET_S (530 s)
#     bash benchmarks/gpu_suite.sh --dry-run            # rehearsal on a CPU: every step at tiny sizes
#     bash benchmarks/gpu_suite.sh step_speed memory    # chosen steps only
#
# Order (what matters most first): tests/gpu, the step's speed (compiled with FlexAttention tiles, eager
# with the dense mask; compiled with the dense mask only if a variant failed), the MoE layer beside
# torchtitan and Megatron-Core, the memory policies in compiled layers, the simulator against the measured
# step, RL generation with the KV cache, RL Fusion's switch by phase, compiled layers swapped whole. The GPU benchmarks left out of the
# slot (moe_layer.py, gpu_attention_probe.py, gpu_attention_layout.py, gpu_step_profile.py,
# balance_expert_gemm.py, train_demo.py) run on their own.
# Results are named by the device they ran on (step_speed_h200.json ...) and written to
# $RESULTS (benchmarks/results; a temporary folder in a dry run), the logs to $RESULTS/gpu_logs; after
# every step both are packed into $OUT/gpu_suite.tgz when $OUT is set (the device tool's return folder),
# so a suite cut short still returns what it finished.
#
# What the GPU machine lacks travels with the working tree (the device tool's `carry`): .whl/base (pydantic
# and what it needs, installed only where missing), .whl/peers (torchtitan 0.3.0, megatron-core 0.19.2 and
# their missing imports; without them the peers are recorded as not measured), and .gpucache (the embedded
# corpus's tokenizer and tokens, so that no step trains a tokenizer). $MOETRAIN_COMMIT names the commit the
# copied tree holds (it has no git history).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_FX_GRAPH_CACHE=1
DRY=0
steps=()
for arg in "$@"; do
    if [ "$arg" = "--dry-run" ]; then DRY=1; else steps+=("$arg"); fi
done
PY=${PYTHON:-python3}
BUDGET=${SUITE_BUDGET_S:-530}
SUITE_START=$(date +%s)
if [ $DRY = 1 ]; then
    RESULTS=${RESULTS:-$(mktemp -d /tmp/gpu-suite-dry.XXXX)}
    TAG=cpu
else
    RESULTS=${RESULTS:-benchmarks/results}
    TAG=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); from _record import device_tag; print(device_tag())")
fi
LOGS=$RESULTS/gpu_logs
mkdir -p "$LOGS"
[ -d .gpucache ] && export MOETRAIN_CACHE="$PWD/.gpucache"
SMALL=benchmarks/data/pangu-shaped-small.yaml
export PY DRY RESULTS TAG LOGS SMALL  # the steps run in shells of their own

# --- the steps: each a function; $DRY picks the CPU rehearsal's sizes --------------------------------------
preflight() {
    if ! $PY -c "import pydantic" 2>/dev/null && [ -d .whl/base ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-base .whl/base/*.whl || return 1
        export PYTHONPATH="$PYTHONPATH:/tmp/site-base"
        echo "export PYTHONPATH=\"\$PYTHONPATH:/tmp/site-base\"" > "$LOGS/env.sh"
    fi
    $PY - <<'EOF'
import torch, moetrain.train  # noqa: F401  (the runtime imports)
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
EOF
    [ $DRY = 1 ] || nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
}
tests() { $PY -m pytest tests/gpu -q -p no:cacheprovider -rfE --durations=10; }
step_speed() {
    if [ $DRY = 1 ]; then
        # the corpus's rows at seq 64 seldom hold a document boundary, so the compiled split of the masked rows
        # (which torch 2.11 once failed to compile) is rehearsed on its own, at three counts of them
        $PY benchmarks/step_speed.py --device cpu --seq-len 64 --global-batch 8 --steps 3 \
            --variants compiled:8:dense,eager:8:dense --fallback compiled:8:auto --out "$RESULTS/step_speed_$TAG.json" \
            && $PY benchmarks/row_split_compiles.py --device cpu --counts 0,1,2 --out "$RESULTS/row_split_compiles_$TAG.json"
    else
        $PY benchmarks/step_speed.py --device cuda --model $SMALL --seq-len 4096 --global-batch 8 --steps 10 \
            --variants compiled:8:block,eager:8:dense --fallback compiled:8:dense --out "$RESULTS/step_speed_$TAG.json"
    fi
}
peers() {
    local site=/tmp/site-peers
    if [ -d .whl/peers ] && [ ! -d $site ]; then
        # a wheel built for another Python is left out (the CPU rehearsal's 3.11 cannot take megatron-core's cp312)
        for wheel in .whl/peers/*.whl; do
            $PY -m pip install -q --no-index --no-deps --no-compile --target $site "$wheel" 2>/dev/null \
                || echo "not installed here: $(basename "$wheel")"
        done
    fi
    if [ $DRY = 1 ]; then
        PYTHONPATH="$site:$PYTHONPATH" $PY benchmarks/moe_layer_peers.py --smoke --out "$RESULTS/moe_layer_peers_$TAG.json"
    else
        PYTHONPATH="$site:$PYTHONPATH" $PY benchmarks/moe_layer_peers.py --compile --out "$RESULTS/moe_layer_peers_$TAG.json"
    fi
}
memory() {
    if [ $DRY = 1 ]; then
        $PY benchmarks/memory_policy.py --device cpu --compile --seq-len 64 --repeats 2 --policies selective,auto \
            --out "$RESULTS/memory_${TAG}_compiled.json"
    else
        $PY benchmarks/memory_policy.py --device cuda --compile --budget-fraction 0.3 --repeats 8 \
            --policies selective,auto --out "$RESULTS/memory_${TAG}_compiled.json"
    fi
}
memory_swap() {
    # compiled layers swapped whole (swap_layer) beside none: what swap saves and costs in compiled layers
    if [ $DRY = 1 ]; then
        $PY benchmarks/memory_policy.py --device cpu --compile --seq-len 64 --repeats 2 --policies swap \
            --out "$RESULTS/memory_${TAG}_compiled_swap.json"
    else
        $PY benchmarks/memory_policy.py --device cuda --compile --repeats 8 --policies swap \
            --out "$RESULTS/memory_${TAG}_compiled_swap.json"
    fi
}
simulator() {
    if [ $DRY = 1 ]; then
        $PY benchmarks/planner_step_check.py --device cpu --seq-len 64 --global-batch 8 --profiles 1 \
            --measured "$RESULTS/step_speed_$TAG.json" --variant compiled:8:dense --out "$RESULTS/planner_step_check_$TAG.json"
    else
        $PY benchmarks/planner_step_check.py --device cuda --model $SMALL --seq-len 4096 --global-batch 8 \
            --measured "$RESULTS/step_speed_$TAG.json" --variant compiled:8:block,compiled:8:dense \
            --out "$RESULTS/planner_step_check_${TAG}_pangu-shaped-small.json"
    fi
}
rl_generation() {
    if [ $DRY = 1 ]; then
        $PY benchmarks/rl_generation.py --lengths 8,16 --repeats 1 --out "$RESULTS/rl_generation_$TAG.json"
    else
        $PY benchmarks/rl_generation.py --device cuda --model $SMALL --batch 64 --prompt-len 64 --lengths 128,256 \
            --repeats 1 --out "$RESULTS/rl_generation_$TAG.json"
    fi
}
rl_switch() {
    if [ $DRY = 1 ]; then
        $PY benchmarks/rl_switch.py --ranks 1 --steps 3 --prompts 4 --group-size 4 --out "$RESULTS/rl_switch_$TAG.json"
    else
        $PY benchmarks/rl_switch.py --device cuda --model $SMALL --steps 4 --out "$RESULTS/rl_switch_$TAG.json"
    fi
}

# name, limit in seconds, least time worth starting it with
# (measured on an H200 at 7b5f6aa: tests 112 s, step_speed 113 s, peers 49 s, memory 102 s, simulator 35 s,
# rl_generation at 128 and 256 new tokens 20 s; since then the profile in the simulator step also compiles and
# times FlexAttention under a document mask, not yet timed on a GPU: 40 s more allowed. step_speed: only the
# boundary rows are masked now, and their count changes the compiled layers' shapes: the first 11 steps' micro-
# batches hold 0,1,1,1,0,2,1,0,0,0,0 such rows, so a compiled variant compiles at steps 0, 1 and 5 (the third
# makes the count dynamic; none after it, counted on the CPU); the H200 took 28 s for each of the first
# two. The dense-mask compiled variant, 15 s then, runs only as a fallback. memory_swap, not yet timed on a GPU,
# compiles the model twice as memory does three times: 70 s allowed)
PLAN=("preflight 30 10" "tests 140 60" "step_speed 150 90" "peers 70 40" "memory 120 60" "simulator 90 30"
      "rl_generation 40 20" "rl_switch 60 25" "memory_swap 70 45")
[ ${#steps[@]} -eq 0 ] && for entry in "${PLAN[@]}"; do steps+=("${entry%% *}"); done

pack() {
    [ -n "${OUT:-}" ] && [ $DRY = 0 ] || return 0
    tar czf "$OUT/gpu_suite.tgz.part" "$RESULTS"/*_"$TAG"*.json "$LOGS" 2>/dev/null
    mv "$OUT/gpu_suite.tgz.part" "$OUT/gpu_suite.tgz"
}

summary=()
for step in "${steps[@]}"; do
    entry=$(printf '%s\n' "${PLAN[@]}" | grep "^$step ")
    [ -n "$entry" ] || { echo "unknown step $step; steps: ${PLAN[*]%% *}"; exit 2; }
    read -r _ limit least <<< "$entry"
    left=$(( BUDGET - ($(date +%s) - SUITE_START) ))
    if [ $left -lt "$least" ]; then
        summary+=("$step: skipped (${left} s of the budget left, needs ${least})")
        echo "=== $step: skipped, ${left} s left"
        continue
    fi
    [ $limit -gt $left ] && limit=$left
    echo "=== $step (limit ${limit} s)"
    start=$(date +%s)
    [ -f "$LOGS/env.sh" ] && . "$LOGS/env.sh"
    timeout --kill-after=5 "$limit" bash -c "$(declare -f "$step"); $step" > "$LOGS/$step.log" 2>&1
    rc=$?
    tail -n 20 "$LOGS/$step.log"
    took=$(( $(date +%s) - start ))
    status="exit $rc"; [ $rc -eq 124 ] && status="timed out"
    summary+=("$step: $status after ${took} s")
    echo "=== $step: $status after ${took} s"
    if [ "$step" = preflight ] && [ $rc -ne 0 ]; then
        echo "preflight failed: stopping here, so the rest of the slot is not spent"
        pack
        exit 1
    fi
    pack
done
echo "=== summary ($(( $(date +%s) - SUITE_START )) s of ${BUDGET}, results in $RESULTS)"
printf '%s\n' "${summary[@]}"
