"""Rollout replicas on CPU: tokens/s of 1 against 2 rollout replicas beside a 2-rank trainer group at k = 1,
and ``moetrain simulate --rl``'s price of the same runs.

Disaggregated StaleSync (``moetrain.rl.stalesync``, docs/rl_stalesync.md) with R rollout replicas (ranks
0 … R − 1, one whole generation model each, generating half of every batch when R = 2) beside a trainer
group of 2 ranks in DP2 (``moetrain rl --staleness 1 --nproc R+2 --rollout-replicas R --dp 2``, here
through the Python API: ``spawn(run_stalesync, ...)``), one thread per process, on the 4-layer policy of
rl_stalesync.py (tiny-pangu without MTP) after a short SFT warm-up on the task (sort: answers of 3 to 6
digits, rows ending at their end-of-sequence token). Each R runs ``--repeats`` times, interleaved (a burst
of load on the shared machine touches both alike), and the median run of each R is reported.

Throughput is trained completion tokens per second of the trainer's steps, without the first (the pipeline
fills) and the last (the final evaluation): rl_stalesync.py's measure.

The prediction is ``moetrain.planner.rl_step.price_rl_step`` with each process's CPU-seconds per step
measured before the runs, never from the runs' times (``rl.rates.role_cpu``: two runs of the same job at
k = 0, of 4 and ``--steps`` steps, each rank's CPU time from getrusage, differenced per step; at k = 0 the
replicas generate and then the trainer ranks train, so no more processes run at once than cores), each
carried to the roles overlapped by what a call costs in CPU time overlapped over apart in the mixed probe
(``rl.rates.overlap_cpu``: R processes decoding a replica's rows, 2 training a micro-batch and meeting
after each, first each kind on its own, then all at once: processes time-sliced on a core evict each
other's caches). The R + 2 processes share the machine's cores (``os.cpu_count()``) by processor sharing
(``planner.rl_cores.shared_cpu_step``: all at min(1, cores / n) of a core, the smallest work done first,
its share then going to the others), one pipeline round per step. CPU time is what the load of other users
stretches least, so the probes hold on a busy machine where their wall times would not; the tokens/s check
still needs quiet cores, since other users take cores the prediction counts as the job's. The error is the
predicted tokens/s (the run's trained completion tokens over the predicted step) against the measured, per
R, median of the repeats; the target is 15 %.

Beside it, per R (``role_cpu``): the runs' own CPU-seconds per step and process (each run's CPU less the
probe's estimate of a run's start and end, over its steps) over the probe's with the roles apart
(``runs_over_apart``, to compare with the probe's ``overlap_factors``: the model's premise, checked in CPU
time), and the two bounds of a round (the largest process, the total over the cores). The decode steps of
each batch are counted from the samples the trainer trained on (the longest sample of the slowest
replica's share, and the share of its rows running per decode step): a property of the workload, not of
the machine; they feed the priced phases (``predicted_phases_s``), which the step on shared cores no longer
sums.

Beside it (``preset_prediction``, not the figure): ``moetrain simulate --rl`` itself, with the shipped CPU
calibration and the ``cpu`` preset's core split over the R + 2 ranks (``ClusterConfig.for_ranks``: the
cores and the shared-host slowdown), no measured rate at all.

The machine's speed is recorded too (rl_simulate_check's ``speed_reference``: a fixed one-thread forward,
right before every run and between the probes), and each R's prediction is also carried to the speed its
runs saw (``*_at_run_speed``): a secondary figure, the prediction itself stays the check's.

    python benchmarks/rl_scale.py --out benchmarks/results/rl_scale_cpu.json
    python benchmarks/rl_scale.py --repeats 1 --steps 7 --probe-repeats 1 --out /tmp/rl_scale.json   # a smoke run

Not yet timed on quiet cores since its probes changed: the run before took 6 minutes there, and the role
probe adds 4 short runs while the forward-only capacity probe is gone (an estimate: 6-7 minutes). The smoke
run took 17 minutes at a load average of 20-40.
Timing: run it with nothing else on the machine (``uptime``'s load under 2.5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import yaml
from _record import write_result
from rl_simulate_check import error_pct, trained_len, within_bound
from rl_stalesync import warm_up

from moetrain.config import ParallelConfig, TrainingConfig, load_cluster_config
from moetrain.config.run import RunSpec
from moetrain.distributed.world import spawn
from moetrain.planner.rl_cores import RoleCPU, cpu_bounds
from moetrain.planner.rl_step import RLLayout, RLWorkload, price_rl_step
from moetrain.rl.config import GRPOConfig, RLOptions, StaleSyncOptions
from moetrain.rl.rates import (
    MixedWork,
    OverlapCPU,
    RoleCPUProbe,
    host_costs,
    overlap_cpu,
    policy_model,
    profile_policy,
    role_cpu,
    shared_sync,
    speed_reference,
    stalesync_with_cpu,
)
from moetrain.rl.sft import sequence_len_for
from moetrain.rl.stalesync import StaleSyncJob
from moetrain.rl.tasks import get_task
from moetrain.rl.tokenizer import CharTokenizer
from moetrain.runtime_base.host_memory import keep_freed_host_memory
from moetrain.train.profiler import profile_sync_rates, profile_weight_sync

TRAINER_DP = 2
"""The trainer group: 2 ranks in DP2."""
LAYERS = 4
STALENESS = 1
BUCKET_MIB = StaleSyncOptions().bucket_mib


@dataclass
class Run:
    replicas: int
    repeat: int
    tokens_per_s: float
    """Trained completion tokens / trainer step seconds over the steady steps."""
    step_s: float
    """Mean trainer step over the steady steps."""
    steady_steps: int
    steady_tokens: float
    steady_seconds: float
    wall_s: float
    trained_tokens_per_step: float
    """Mean positions the trainer computed per steady step (its micro-batches cut to their longest sample)."""
    longest: list[int]
    """Per steady batch: tokens of the longest sample of the slowest replica's share."""
    running: list[float]
    """Per steady batch: that share's mean fraction of rows running per decode step."""
    parts_s: dict[str, float]
    """Medians over the steady steps of the trainer's rows: waiting for the batch, the step, after it (the
    push's packing), and the rollout side's generation of the batch (``gen_time_s``)."""
    staleness_max: int
    dropped_samples: int
    final_reward: float
    load_average_1min_before: float
    speed_reference_s: float
    """rl_simulate_check's speed reference right before the run (seconds per call; higher is slower)."""
    cpu_s: list[float]
    """CPU-seconds of each process over the whole run, by rank (replicas first): what the prediction's
    CPU-seconds, measured with the roles apart, are checked against (not an input of it)."""
    usage: list[dict]
    """Each process's ``RankUsage``: its CPU, its threads, its waits and time slices."""


def decode_shape(samples: torch.Tensor, replicas: int, pad_id: int) -> tuple[int, float]:
    """(tokens of the longest sample of the slowest replica's share, that share's mean fraction of rows
    running per decode step) of one trained batch (its generated ids [B, N], the engine's pad after each
    row's end; the replicas' shares are contiguous rows). A row of n tokens runs in the first n − 1 decode
    steps (``RolloutEngine.generate``: one prefill, then a decode step per further token)."""
    nonpad = samples != pad_id
    positions = torch.arange(1, samples.shape[1] + 1).expand_as(samples)
    lengths = (positions * nonpad).max(dim=1).values  # the last generated token's position
    shares = lengths.view(replicas, -1)
    slowest = int(shares.max(dim=1).values.argmax())
    share = shares[slowest]
    longest = int(share.max())
    steps = max(longest - 1, 1)
    running = float((share - 1).clamp(min=0).sum()) / (steps * len(share))
    return longest, running


def run_once(job: StaleSyncJob, repeat: int) -> Run:
    load = os.getloadavg()[0]
    speed = speed_reference()
    start = time.perf_counter()
    results = spawn(stalesync_with_cpu, job.roles.world_size, job)
    wall = time.perf_counter() - start
    reports = [report for report, _ in results]
    trainer = reports[job.replicas]  # the trainer group's first rank
    steps = [r for r in trainer.rows if "loss" in r]
    steady = steps[1:-1]
    tokens, seconds = sum(r["completion_tokens"] for r in steady), sum(r["step_time_s"] for r in steady)
    pad = CharTokenizer().pad_id
    shapes = [decode_shape(samples, job.replicas, pad) for samples in trainer.samples[1:-1]]
    parts = {"batch": "batch_time_s", "train_step": "train_step_time_s", "after_step": "after_step_time_s",
             "generate": "gen_time_s"}
    return Run(job.replicas, repeat, tokens / seconds, seconds / len(steady), len(steady), tokens, seconds, wall,
               statistics.mean(r["tokens"] for r in steady), [s[0] for s in shapes], [s[1] for s in shapes],
               {name: statistics.median(r[key] for r in steady) for name, key in parts.items()},
               max(r["staleness_max"] for r in steps), steps[-1]["dropped_samples"],
               steps[-1].get("heldout_accuracy", float("nan")), load, speed, [usage.cpu_s for _, usage in results],
               [asdict(usage) for _, usage in results])


@dataclass(frozen=True)
class Rates:
    """What the prediction is made of: this machine's rates, measured before the runs."""

    calibration: object
    host: object
    sync: object
    overlap: dict[int, OverlapCPU]
    """By R: the mixed probe's CPU-seconds per call with the roles apart and overlapped (``rates.overlap_cpu``)."""
    role_cpu: dict[int, RoleCPUProbe]
    """By R: each process's CPU-seconds per step with the roles apart (``rates.role_cpu``)."""
    speed_reference_s: list[float]


def measure_rates(jobs: dict[int, StaleSyncJob], repeats: int, work: dict[int, MixedWork]) -> tuple[Rates, dict]:
    replicas = list(jobs)
    speeds = [speed_reference()]
    calibration = profile_policy(policy_model(LAYERS), repeats)[0]  # the least disturbed profile
    speeds.append(speed_reference())
    host = host_costs(policy_model(LAYERS), repeats)
    sync_rates = {**profile_sync_rates(repeats),
                  f"whole_sync_{LAYERS}_layers": profile_weight_sync(policy_model(LAYERS), repeats)}
    speeds.append(speed_reference())
    overlap, roles = {}, {}
    for count in replicas:
        overlap[count] = overlap_cpu(count, TRAINER_DP, work[count], repeats)
        roles[count] = role_cpu(jobs[count])
        speeds.append(speed_reference())
    rates = Rates(calibration, host, shared_sync(sync_rates, 1.0, LAYERS), overlap, roles, speeds)
    return rates, sync_rates


def workload_of(config: dict, run_group: list[Run], model_cfg, cluster) -> RLWorkload:
    """The runs' workload (one R: the same samples every repeat) as the RL simulator takes it."""
    task = get_task(config["task"])
    batch = config["prompts"] * config["group_size"]
    longest = [n for run in run_group for n in run.longest]
    running = [r for run in run_group for r in run.running]
    trained = statistics.median(run.trained_tokens_per_step for run in run_group)
    completion = statistics.median(run.steady_tokens / run.steady_steps for run in run_group) / batch
    return RLWorkload(model_cfg, cluster, config["prompts"], config["group_size"], task.max_prompt_chars + 1,
                      round(statistics.mean(longest)), "fp32",
                      train_seq_len=trained_len(trained, batch, sequence_len_for(task, config["max_new_tokens"])),
                      completion_len=completion, decode_running_share=statistics.mean(running))


def layout_of(replicas: int, config: dict, shared_cores: float | None, work: RoleCPU | None = None) -> RLLayout:
    batch = config["prompts"] * config["group_size"]
    train = ParallelConfig(dp=TRAINER_DP, micro_batch=min(config["micro_batch"], batch // TRAINER_DP))
    return RLLayout("disaggregated", replicas + TRAINER_DP, train, rollout_devices=replicas, staleness=STALENESS,
                    shared_cores=shared_cores, sync_bucket_bytes=BUCKET_MIB * 2**20, role_cpu=work)


def preset_prediction(workload: RLWorkload, replicas: int, config: dict) -> dict:
    """``moetrain simulate --rl --json`` for the same runs: the shipped CPU calibration, the ``cpu`` preset
    split over the R + 2 ranks, no measured rate."""
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "policy.yaml"
        model.write_text(yaml.safe_dump(workload.model.model_dump(mode="json")))
        devices = replicas + TRAINER_DP
        command = ["simulate", "--rl", "--model", str(model), "--cluster", "cpu", "--devices", str(devices),
                   "--rollout-devices", str(replicas), "--placement", "disaggregated", "--staleness", str(STALENESS),
                   "--prompts", str(config["prompts"]), "--group-size", str(config["group_size"]),
                   "--prompt-len", str(workload.prompt_len), "--response-len", str(workload.response_len),
                   "--completion-len", f"{workload.completion_len:.3f}", "--dtype", "fp32",
                   "--micro-batch", str(layout_of(replicas, config, None).train.micro_batch), "--json"]
        done = subprocess.run([sys.executable, "-m", "moetrain", *command], capture_output=True, text=True,
                              check=True)
    (row,) = json.loads(done.stdout)["predictions"]
    return {"command": "moetrain " + " ".join(command[:3] + ["<policy.yaml>"] + command[4:]),
            "step_s": row["step_s"], "phases_s": row["phases_s"]}


def priced_work(rates: Rates, replicas: int) -> RoleCPU:
    """What prices R's runs: each process's CPU-seconds per step with the roles apart, carried to the roles
    overlapped by the mixed probe's factors."""
    return replace(rates.role_cpu[replicas].role_cpu, overlap=rates.overlap[replicas].factors)


def role_cpu_check(group: list[Run], probe: RoleCPUProbe, work: RoleCPU, cores: float) -> dict:
    """What prices beside the runs' own CPU-seconds (not an input of the price): each run's CPU per process
    less the probe's estimate of its start and end (the short run's CPU less its steps' worth), over the
    run's steps, against the probe's per step with the roles apart. CPU time, which the machine's load
    stretches far less than wall time, so this holds where the tokens/s do not."""
    apart, (short_steps, steps) = probe.role_cpu.processes, probe.steps
    fixed = [short - short_steps * step for short, step in zip(probe.cpu_s[0], apart, strict=True)]
    runs = [[(run.cpu_s[rank] - fixed[rank]) / steps for rank in range(len(apart))] for run in group]
    per_step = [statistics.median(run[rank] for run in runs) for rank in range(len(apart))]
    largest, over_cores = cpu_bounds(work, cores)
    return {"cores": cores, "apart_per_step_s": list(apart), "overlap_factors": list(work.overlap),
            "priced_per_step_s": list(work.processes), "total_per_step_s": work.total_s,
            "bound_largest_process_s": largest, "bound_total_over_cores_s": over_cores,
            "probe_steps": list(probe.steps), "probe_run_cpu_s": [list(run) for run in probe.cpu_s],
            "runs_per_step_s": per_step, "runs_per_step_s_repeats": runs,
            "runs_over_apart": [run / step for run, step in zip(per_step, apart, strict=True)]}


def predict(config: dict, runs: list[Run], rates: Rates, replicas: int) -> dict:
    """The simulator's price of R's runs against their median, and each repeat's error."""
    group = [run for run in runs if run.replicas == replicas]
    model_cfg = policy_model(LAYERS)
    workload = workload_of(config, group, model_cfg, load_cluster_config("cpu"))
    work, cores = priced_work(rates, replicas), float(os.cpu_count() or 1)
    predicted = price_rl_step(workload, layout_of(replicas, config, cores, work), rates.calibration, rates.host,
                              rates.sync)
    tokens_per_step = statistics.median(run.steady_tokens / run.steady_steps for run in group)
    measured = statistics.median(run.tokens_per_s for run in group)
    predicted_tps = tokens_per_step / predicted.step_s
    error = error_pct(predicted_tps, measured)
    probe_speed = statistics.median(rates.speed_reference_s)
    run_speed = statistics.median(run.speed_reference_s for run in group) / probe_speed
    at_speed = error_pct(predicted_tps / run_speed, measured)
    preset = preset_prediction(workload, replicas, config)
    preset_tps = tokens_per_step / preset["step_s"]
    return {
        "replicas": replicas, "ranks": replicas + TRAINER_DP,
        "measured_tokens_per_s": measured, "measured_tokens_per_s_repeats": [run.tokens_per_s for run in group],
        "measured_step_s": statistics.median(run.step_s for run in group),
        "predicted_tokens_per_s": predicted_tps, "predicted_step_s": predicted.step_s, "error_pct": error,
        "within_15pct": within_bound(error),
        "error_pct_per_repeat": [error_pct(tokens_per_step / predicted.step_s, run.tokens_per_s) for run in group],
        "predicted_phases_s": asdict(predicted.phases), "measured_parts_s": {
            name: statistics.median(run.parts_s[name] for run in group) for name in group[0].parts_s},
        "role_cpu": role_cpu_check(group, rates.role_cpu[replicas], work, cores),
        "overlap_cpu": asdict(rates.overlap[replicas]),
        "decode_steps": workload.response_len - 1,
        "response_len": workload.response_len, "decode_running_share": workload.decode_running_share,
        "train_seq_len": workload.seq_len, "completion_len": workload.completion_len,
        "speed_ratio": run_speed, "predicted_tokens_per_s_at_run_speed": predicted_tps / run_speed,
        "error_at_run_speed_pct": at_speed,
        "preset_prediction": {**preset, "tokens_per_s": preset_tps, "error_pct": error_pct(preset_tps, measured)},
    }


def job_of(args: argparse.Namespace, replicas: int, initial: dict) -> StaleSyncJob:
    """The measured job: R replicas beside the DP2 trainer group, k = 1."""
    task = get_task(args.task)
    batch = args.prompts * args.group_size
    options = RLOptions(task=args.task, prompts_per_step=args.prompts, grpo=GRPOConfig(group_size=args.group_size),
                        max_new_tokens=args.max_new_tokens, eval_every=0, eval_size=args.eval_size,
                        replay_stats_every=0)
    cfg = TrainingConfig(steps=args.steps, global_batch=batch, micro_batch=min(args.micro_batch, batch // TRAINER_DP),
                         seq_len=sequence_len_for(task, args.max_new_tokens), lr=3e-4, warmup_steps=0, seed=args.seed)
    spec = RunSpec(training=cfg, parallel={"dp": TRAINER_DP}, run={"device": "cpu", "cluster": "cpu", "quiet": True})
    return StaleSyncJob(spec, options, StaleSyncOptions(staleness=STALENESS), policy_model(LAYERS), initial,
                        replicas=replicas)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="sort")
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps per run (the first and last not timed)")
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--eval-size", type=int, default=16, help="held-out problems of the final evaluation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replicas", default="1,2", help="rollout replicas to compare")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each R; the median is reported")
    parser.add_argument("--probe-repeats", type=int, default=3, help="repeats of each rate probe")
    parser.add_argument("--out", default="benchmarks/results/rl_scale_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_host_memory()  # the probes run in this process: under the runs' allocator
    replicas = [int(r) for r in args.replicas.split(",")]
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    task = get_task(args.task)
    model_cfg = policy_model(LAYERS)
    seq_len = sequence_len_for(task, args.max_new_tokens)
    initial = warm_up(args.task, model_cfg, seq_len, args.sft_steps, args.seed)
    print(f"SFT warm-up: {time.perf_counter() - started:.0f} s", flush=True)
    jobs = {count: job_of(args, count, initial) for count in replicas}
    micro = jobs[replicas[0]].spec.training.micro_batch
    work = {count: MixedWork(LAYERS, args.prompts * args.group_size // count, micro, seq_len) for count in replicas}
    rates, sync_rates = measure_rates(jobs, args.probe_repeats, work)
    print(f"rates: {time.perf_counter() - started:.0f} s; CPU-s per step, roles apart: "
          + "; ".join(f"R = {n}: " + ", ".join(f"{w:.3f}" for w in probe.role_cpu.processes)
                      + " (overlapped ×{:.2f}, ×{:.2f})".format(*rates.overlap[n].factors)
                      for n, probe in rates.role_cpu.items()), flush=True)
    runs: list[Run] = []
    for repeat in range(args.repeats):  # interleaved: a burst of load touches every R alike
        for count in replicas:
            runs.append(run_once(jobs[count], repeat))
            last = runs[-1]
            print(f"R = {count}, repeat {repeat + 1}: {last.tokens_per_s:.0f} tokens/s ({last.step_s:.3f} s/step, "
                  f"wall {last.wall_s:.0f} s, load {last.load_average_1min_before:.1f})", flush=True)
    config = {"task": args.task, "prompts": args.prompts, "group_size": args.group_size,
              "max_new_tokens": args.max_new_tokens, "micro_batch": args.micro_batch}
    rows = [predict(config, runs, rates, count) for count in replicas]
    for row in rows:
        print(f"R = {row['replicas']} ({row['ranks']} ranks): measured {row['measured_tokens_per_s']:.0f} tokens/s, "
              f"predicted {row['predicted_tokens_per_s']:.0f} ({row['error_pct']:+.1f} %; at the runs' speed "
              f"{row['error_at_run_speed_pct']:+.1f} %; simulate --rl on the presets "
              f"{row['preset_prediction']['tokens_per_s']:.0f}, {row['preset_prediction']['error_pct']:+.1f} %); "
              "its runs' CPU-s per step over the roles apart: "
              + ", ".join(f"×{r:.2f}" for r in row["role_cpu"]["runs_over_apart"]))
    by = {row["replicas"]: row for row in rows}
    speedup = {}
    if 1 in by and 2 in by:
        speedup = {"measured_speedup_2_over_1": by[2]["measured_tokens_per_s"] / by[1]["measured_tokens_per_s"],
                   "predicted_speedup_2_over_1": by[2]["predicted_tokens_per_s"] / by[1]["predicted_tokens_per_s"]}
        print(f"2 replicas over 1: measured ×{speedup['measured_speedup_2_over_1']:.2f}, "
              f"predicted ×{speedup['predicted_speedup_2_over_1']:.2f}")
    errors = [abs(row["error_pct"]) for row in rows]
    write_result(args.out, {
        "rows": rows, **speedup,
        "median_abs_error_pct": statistics.median(errors), "max_abs_error_pct": max(errors),
        "within_15pct": sum(row["within_15pct"] for row in rows), "rows_total": len(rows),
        "workload": {"model": f"tiny-pangu, {LAYERS} layers, no MTP", "task": args.task, "steps": args.steps,
                     "sft_steps": args.sft_steps, "threads_per_process": 1, "prompts": args.prompts,
                     "group_size": args.group_size, "micro_batch": micro,
                     "max_new_tokens": args.max_new_tokens, "eval_size": args.eval_size, "seed": args.seed,
                     "staleness": STALENESS, "trainer_layout": f"dp{TRAINER_DP}", "bucket_mib": BUCKET_MIB},
        "tokens_per_s_means": "trained completion tokens / trainer step time, steps 2..N-1 (no fill, no final eval)",
        "repeats": args.repeats, "runs": [asdict(run) for run in runs],
        "rates": {"cpu_efficiency": rates.calibration.for_device("cpu").as_dict(), "host": asdict(rates.host),
                  "weight_sync_per_core": sync_rates,
                  "speed_reference_s_during_probes": rates.speed_reference_s},
        "cpu_count": os.cpu_count(), "load_average_1min_before": load_before,
        "load_average_1min_after": os.getloadavg()[0], "wall_s": time.perf_counter() - started,
    })


if __name__ == "__main__":
    main()
