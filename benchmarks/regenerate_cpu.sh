#!/usr/bin/env bash
# Rerun every benchmark whose result in benchmarks/results/ was measured or computed on a CPU, with the
# flags its record names. Each writes its file with the command, the commit and the machine.
#
#   benchmarks/regenerate_cpu.sh                 # all of them (about an hour on 2 cores)
#   benchmarks/regenerate_cpu.sh planner balance # only the entries whose script name contains a word
#
# From the repository root or anywhere; $PYTHON (default python) must import torch and the project's
# dependencies; shared/validation/calibration.csv must lie beside the checkout (or inside it).
# GPU results (*_cuda, *_gpu*, *_h100, *_h200, gpu_*: named by the GPU) come from benchmarks/gpu_suite.sh
# on a GPU machine.
# Not rerun here: planner_screen_vs_timeline_3a11047.json, the same benchmark at an older commit
# (the model before the paired-schedule fix), kept as the "before" its docs compare with.
# Nor compiled_grad_check_cpu_torch211_fixed.json, compiled_grad_check_cpu_torch211_unfixed.json and
# compiled_grad_check_cpu_torch213_unfixed.json: the compiled-gradient check under one torch version each
# (2.11 needs a venv of its own), before and after the fix 3c2bd06; rerun by hand with the command each
# records, from the commit it names.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python}
R=benchmarks/results
ONLY=("$@")

run() {
    local script=$1
    if ((${#ONLY[@]})); then
        local word hit=0
        for word in "${ONLY[@]}"; do [[ $script == *"$word"* ]] && hit=1; done
        ((hit)) || return 0
    fi
    echo "== $*"
    local start=$SECONDS
    nice "$PYTHON" "benchmarks/$@"
    echo "   ($((SECONDS - start)) s)"
}

# The planner (numpy only): validation against the published runs and its analyses.
run planner_validation.py
run planner_validation.py --cv
run planner_moe_probe.py
run planner_source_consistency.py
run planner_vtrain_heldout.py
run planner_vtrain_bubble.py
run planner_vtrain_residuals.py  # --cv-variants reruns its slow variants (kept from the last run otherwise)
run planner_dgxc_heldout.py --cv-variant --cv-with-dgxc
run planner_llama3_heldout.py
# planner_fit_basins*.json compare the fold without MPT with branch planfit5's fit of it, from an export of that
# branch in /tmp/pf5 (commands in benchmarks/planner_fit_basins.py's docstring); skipped without the export.
if [[ -d /tmp/pf5/src ]]; then
run planner_fit_basins.py --family MPT --at src/moetrain/planner/calibration_default.yaml \
    /tmp/pf5/src/moetrain/planner/calibration_default.yaml
PYTHONPATH=/tmp/pf5/src run planner_fit_basins.py --family MPT --at /tmp/pf5/src/moetrain/planner/calibration_default.yaml \
    src/moetrain/planner/calibration_default.yaml --out $R/planner_fit_basins_planfit5.json
fi
run planner_fit_variants.py
run planner_screen_vs_timeline.py
run planner_speed.py
run planner_step_check.py
# the H200's recorded step and profile priced again by this commit's simulator (no GPU needed)
run planner_step_check.py --device cuda --cluster h200-sxm-141gb --model benchmarks/data/pangu-shaped-small.yaml \
    --seq-len 4096 --global-batch 8 --measured $R/step_speed_h200.json --variant compiled:8:block --skip 3 \
    --calibration $R/planner_step_check_h200_pangu-shaped-small.json \
    --out $R/planner_step_check_h200_pangu-shaped-small_repriced.json
run plan_train_check.py --out $R/plan_train_check_cpu.json

# Expert, data and pipeline balance: recorded routing traces first, then what reads them.
run balance_data_pipeline.py
run balance_record_trace.py --steps 80 --out $R/balance_trace_tiny_pangu.jsonl
run balance_record_trace.py --steps 80 --no-balance-loss --out $R/balance_trace_tiny_pangu_no_balance_loss.jsonl
run balance_traces.py --trace $R/balance_trace_tiny_pangu.jsonl --trace $R/balance_trace_tiny_pangu_no_balance_loss.jsonl
run balance_traces.py --trace $R/balance_trace_tiny_pangu.jsonl --trace $R/balance_trace_tiny_pangu_no_balance_loss.jsonl \
    --fixed-interval --out $R/balance_traces_fixed_interval.json
run balance_families.py
run balance_defaults.py --jobs 2  # the defaults sweep: BALANCE_DEFAULTS must equal its winner
run balance_expert_gemm.py --model tiny-pangu --ep 4 --tokens-per-rank 4096 --zipf 1.0 --device cpu --repeats 7 \
    --threads 1
run balance_online.py --out $R/balance_online_cpu.json

# The runtime on CPU (gloo ranks): parity with one process, overlap, memory policies, the demo run.
run cp_parity.py --out $R/cp_parity_cpu.json
run distributed_data_parity.py --out $R/distributed_data_parity.json
run ep_overlap.py --global-batch 64 --out $R/ep_overlap_cpu.json
run ep_overlap.py --nproc 2 --global-batch 32 --out $R/ep_overlap_cpu_2ranks.json
run memory_policy.py --device cpu --seq-len 256 --budget-fraction 0.3
run step_speed.py --device cpu --steps 4 --out $R/step_speed_cpu.json
run row_split_compiles.py
run checkpoint_stall.py --step-seconds 4 --steps-between 8 --out $R/checkpoint_stall_cpu.json
run rl_switch.py --out $R/rl_switch_cpu.json
run rl_switch.py --ranks 2 --out $R/rl_switch_cpu_2ranks.json
run rl_generation.py --out $R/rl_generation_cpu.json
run rl_learning.py --out $R/rl_learning_cpu.json
run rl_learning.py --quick-try --out $R/rl_quick_try_cpu.json
run rl_stalesync.py --out $R/rl_stalesync_cpu.json
run rl_simulate_check.py --remeasure --out $R/rl_simulate_check_cpu.json
run rl_simulate_check.py --remeasure --out $R/rl_simulate_check_cpu_repeat.json
run rl_simulate_check.py --remeasure --rounds 3 --out $R/rl_simulate_check_cpu_rounds.json
run rl_scale.py --out $R/rl_scale_cpu.json
run rl_plan_check.py --out $R/rl_plan_check_cpu.json
run rl_progress_cost.py --out $R/rl_progress_cost_cpu.json
run rl_simulate_pangu.py --out $R/rl_simulate_pangu.json
run rl_plan_anchors.py --out $R/rl_plan_anchors.json
run train_demo.py --tag cpu-1thread --quiet --threads 1
