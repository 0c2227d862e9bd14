"""``moetrain simulate --rl`` against the measured CPU RL steps, for both placements.

The probes (``profile_policy``, ``host_costs``, ``core_capacity``, ``sync_probes``, ``speed_reference``, ...)
live in ``moetrain.rl.rates``; this script runs them, prices the committed runs' workloads with them and
records the comparison.

The prediction comes from this CPU's measured rates and the planner's formulas, never from the RL step
times: ``moetrain profile`` of the runs' policy (GEMM rate and per-call cost, attention, memory bandwidth,
MoE pass cost, and the time of the policy's forward + backward and optimizer step at a 16-token batch,
whose excess over the device work priced for it adds to every layer pass of training on a CPU) plus
three probes of the eager generation loop that the profile does not cover (``HostCosts``): the time of one
decoder layer's forward of the runtime's model on one token (the host floor of a layer pass: Python,
dispatcher, small kernels), the sampler's time per logit, and the rollout engine's own work per decode
step beyond those (``engine_probe``: its decode step at 1 and 16 rows less the model's forward and the draw
of the same rows). Those go into
``moetrain.planner.rl_step.price_rl_step`` with the shapes of the measured workloads:

- colocated (RL Fusion): ``benchmarks/rl_switch.py``'s three variants (tiny-pangu, 4 gloo ranks, training
  TP2×EP2 or PP2×EP2, generation in 4 replicas; offload auto and always), measured in
  ``benchmarks/results/rl_switch_cpu.json`` (median step time), and its two variants on 2 ranks, one per
  core (training EP2 or TP2, generation in 2 replicas), in ``rl_switch_cpu_2ranks.json``;
- colocated StaleSync (k = 1: the next batch generated beside each update, one process, two threads) and
  disaggregated StaleSync: ``benchmarks/rl_stalesync.py``'s runs (k = 0, 1, 4: 4-layer tiny-pangu, one
  rollout and one training process), measured in ``benchmarks/results/rl_stalesync_cpu.json`` (trainer
  step time = steady seconds / steady steps).

The colocated runs' transfers and collectives are priced from two more probes (``moetrain.train.profiler``):
gloo collectives at rl_switch's 4 ranks (and 2), one thread each (all-reduce, all-gather, all-to-all on the world
and on both pairs at once, one-way sends; ``profile_collectives``), to which the planner's link formulas
are fitted (``planner.comm.fit_link``: a latency and a bandwidth, fed in as the ``cpu`` cluster's in-node
link), and the weight sync's rate on one core (``profile_sync_rates``: one buffer's copy and CRC-32;
``profile_weight_sync``: the whole sync of the run's model in one process, per-box work included), at one
process's share of the cores (the sync's buckets run one after the other: one rank works while the others
wait). The replay diagnostics forward is priced where the
runtime runs it: on each rank's generation model, over every sample (``logprob_on_generation``).

A batch decodes until its longest sample ends, and the warmed-up policy of the StaleSync runs stops at
its own end-of-sequence token: the decode steps of those batches are a property of the workload, not of
the machine, so they are counted here (the SFT warm-up of rl_stalesync.py, then the steady steps' batches
generated with the warmed-up weights; no time is read) and given to the planner as the response length.
The untrained policy of rl_switch.py never stops early (one end-of-sequence token among 2,048): its
batches run to the token limit.

The runs put one thread per rank on the machine's cores. How much compute concurrent processes get
together is measured too (``core_capacity``: the same one-thread loop of the runtime's forward of the
run's model alone and in 2 or 4 processes at once, so that what the processes share besides the cores,
the last-level cache, is seen; two SMT siblings of one physical core give about one core, not two), three
ways (``Capacity``): by the processes' mean time, by the slowest of them, and paced (all meeting after
every forward, as a layout's ranks meet in their collectives: the slowest sets every call's pace; on a
virtual machine whose cores run at different speeds these two are below the mean). The ranks of
rl_switch generate and run the routing forward each on its own until they meet to gather: each gets the
slowest-process capacity / ranks of a core (every rate divided by ranks/capacity) of the same probe with
each process generating its replica's rows (``replica_generation``: the engine's host work shares the
cores otherwise than a forward); their training meets in every layer, at the forward's paced capacity.
StaleSync's overlapped phases (k ≥ 1), two processes that do not wait for each other, share the 2-process
capacity by the mean (``rl_step.overlapped_time``, processor sharing). Other users of the
machine are not modelled beyond what the capacity probe sees: the load averages are recorded beside, and for
rl_switch (which recorded its load) a sensitivity row prices the same step with each rank's share taken
from that load average instead (not the prediction: it shows how much of the gap the machine's load can
explain).

    python benchmarks/rl_simulate_check.py --remeasure --out benchmarks/results/rl_simulate_check_cpu.json

The colocated rows compare phase by phase too (``phases``): the switch's phases and the step's other parts
that rl_switch.py records (scoring, the replay diagnostics forward, the training step proper) against the
predicted phases that price them.

``--remeasure`` also runs rl_switch.py and rl_stalesync.py (one repeat) again right after the rates are
measured (into a temporary folder; the committed results stay) and compares the same predictions with
those runs, made under the same load as the rates.

The machine's speed is a measurement too (``speed_reference``: a fixed one-thread forward, seconds per
call), taken between the probes and right before and after each run made again: on a virtual machine
whose speed moves by a fifth within minutes, a prediction from probes that caught it fast and a run that
caught it slow differ by that much whatever the formulas. Each run made again is also compared with the
prediction carried to the speed it saw (predicted × the run's reference / the probes' median reference;
``*_at_run_speed``), beside the prediction itself, which stays the check's figure.

``--rounds N`` repeats the whole pass (the probes, and with ``--remeasure`` the runs made again) N times,
so that probes and runs meet the machine at several moments, and compares each row's median prediction
over the rounds with the committed run and with the median of its runs made again (``over_rounds``; every
round is kept under ``rounds``).

    python benchmarks/rl_simulate_check.py --remeasure --rounds 3 \
        --out benchmarks/results/rl_simulate_check_cpu_rounds.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from _record import write_result

from moetrain.config import ParallelConfig, load_cluster_config, load_model_config
from moetrain.models.transformer import build_model
from moetrain.planner.calibration import Calibration
from moetrain.planner.comm import LinkFit
from moetrain.planner.generation import HostCosts
from moetrain.planner.rl_step import RLLayout, RLWorkload, price_rl_step, training_prediction
from moetrain.rl.generate import SamplingParams
from moetrain.rl.loop import policy_config
from moetrain.rl.rates import (
    PROFILES,
    Capacity,
    best_time,
    core_capacity,
    host_costs,
    link_fit,
    policy_model,
    profile_policy,
    replica_generation,
    shared_cores,
    shared_sync,
    speed_reference,
    sync_probes,
    threads_capacity,
    training_calibration,
    with_link,
)
from moetrain.rl.sft import sequence_len_for
from moetrain.rl.tasks import get_task
from moetrain.runtime_base.host_memory import keep_freed_host_memory
from moetrain.train.profiler import profile_collectives

RESULTS = Path(__file__).resolve().parent / "results"
COLOCATED_RANKS = 4
"""rl_switch.py's ranks: the collective probe runs at that world size."""
STALESYNC_BUCKET_MIB = 32.0
"""rl_stalesync.py's weight-sync bucket (``StaleSyncOptions``' default) when its result does not say."""
CAPACITY_WORK = {2: (4, 128), 4: (8, 32)}
"""The forward the capacity of n processes is measured with: (layers, rows) of the run with n processes
(StaleSync's 4-layer model and its 128-row batch; rl_switch's 8-layer model and 32 rows per replica). The
GEMM loop's capacity (a working set that fits each core's cache) is recorded beside."""
SWITCH_2_RANKS_WORK = (8, 64)
"""rl_switch's 2-rank run: the 8-layer model, 64 rows per replica."""


BOUND_PCT = 15.0
"""Issue #26's bound on the prediction's error."""


def error_pct(predicted_s: float, measured_s: float) -> float:
    """The prediction's error, in percent of the measured time (negative: priced short)."""
    return (predicted_s - measured_s) / measured_s * 100


def within_bound(error: float) -> bool:
    return abs(error) <= BOUND_PCT


def _row(name: str, predicted, measured_s: float, **extra) -> dict:
    error = error_pct(predicted.step_s, measured_s)
    return {"run": name, "predicted_step_s": predicted.step_s, "measured_step_s": measured_s, "error_pct": error,
            "within_15pct": within_bound(error), "predicted_phases_s": asdict(predicted.phases), **extra}


# The RL Fusion step's phases as rl_switch.py records them (the switch's, then the step's other parts), each
# with the predicted phases that price it: the runtime's generate phase gathers the rows too.
COLOCATED_PHASES = {"offload": ("offload_s",), "reshard": ("reshard_s",), "generate": ("generate_s", "gather_s"),
                    "restore": ("restore_s",), "score": ("reward_s",), "replay_forward": ("logprob_s",),
                    "train_step": ("train_s",)}


def phase_comparison(phases, measured: dict[str, float]) -> dict[str, dict]:
    """Predicted against measured seconds of each phase the run measured (``phases``: ``RLPhases``)."""
    out = {}
    for name, parts in COLOCATED_PHASES.items():
        if name not in measured:
            continue
        predicted = sum(getattr(phases, part) for part in parts)
        seen = measured[name]
        out[name] = {"predicted_s": predicted, "measured_s": seen,
                     "predicted_over_measured": predicted / seen if seen > 0 else None}
    return out


def colocated_rows(measured: dict, calibration: Calibration, host: HostCosts, capacities: tuple[Capacity, Capacity],
                   link: LinkFit, sync_rates: dict) -> list[dict]:
    """``measured``: an rl_switch.py result; ``capacities``: cores' worth its ranks get together running the
    model's forward and generating (``core_capacity``); ``link``: the ranks' gloo collectives (``link_fit``);
    ``sync_rates``: the weight sync's copy and CRC rates on one core (``profile_sync_rates``)."""
    capacity, generating = capacities
    config = measured["config"]
    task = get_task(config["task"])
    # the runtime runs tp > 1 with sequence parallelism only
    layouts = {"tp2_ep2": ParallelConfig(tp=2, sp=True, dp=2, ep=2), "pp2_ep2": ParallelConfig(pp=2, dp=2, ep=2),
               "ep2": ParallelConfig(dp=2, ep=2), "tp2": ParallelConfig(tp=2, sp=True)}
    model = policy_config(load_model_config(config["model"]))
    batch = config["prompts"] * config["group_size"]
    # Sensitivity, not the prediction: the same with every rank's share of a core taken from the load
    # average the run recorded (runnable processes, ours and other users') instead of ranks / cores.
    load = config.get("load_average_1min_after")
    calibration = with_link(calibration)
    load_slow = max(load, config["ranks"]) / (os.cpu_count() or 1) if load else None
    at_load = shared_cores(calibration, host, load_slow) if load_slow else None
    # Generation and the routing forward run on every rank's generation model on its own and end where the
    # ranks meet (the rows' gather): the slowest rank sets the end, at what the ranks get generating (more
    # host work than a forward: with more processes than cores it shares them worse). Training meets in
    # every layer's collectives (the forward's paced capacity, below).
    slow = config["ranks"] / generating.slowest
    one_core, one_core_host = calibration, host
    calibration, host = shared_cores(calibration, host, slow)
    # The sync's buckets run one after the other (``rl_step._colocated_transfers``): one rank packs or writes
    # while the others wait in gloo, taking no CPU, so the sync runs at one process's rates.
    sync = shared_sync(sync_rates, 1.0 / min(1.0, capacity.shared), 8)
    cluster = link.cluster(load_cluster_config("cpu"))
    rows = []
    for variant in measured["variants"]:
        parallel = layouts[variant["train_layout"]]
        max_new = task.max_answer_chars + 2  # RLOptions' default; the untrained policy never stops early
        seq_len = trained_len(variant.get("trained_tokens_per_step"), batch, sequence_len_for(task, max_new),
                              parallel.tp)
        # replay_stats_every = 1 (the default): one more forward over the samples per step
        # the replay diagnostics forward runs on the generation model, whole on every rank
        workload = RLWorkload(model, cluster, config["prompts"], config["group_size"], task.max_prompt_chars + 1,
                              max_new, "fp32", logprob_forwards=1, train_seq_len=seq_len, logprob_on_generation=True)
        train = parallel.model_copy(update={"micro_batch": batch // parallel.dp})
        layout = RLLayout("colocated", config["ranks"], train,
                          offload=variant["offload"] == "always", sync_bucket_bytes=config["bucket_mib"] * 2**20)
        # training: the ranks that compute (not blocked in a collective or a pipeline's bubble) share the
        # forward's paced capacity (the bubble as the generation's rates price it, as before the move)
        train_calibration, busy = training_calibration(workload, layout, one_core, one_core_host, capacity.paced,
                                                       bubble_calibration=calibration)
        training = training_prediction(workload, layout, train_calibration)
        predicted = price_rl_step(workload, layout, calibration, host, sync, training)
        alone = price_rl_step(workload, layout, one_core, one_core_host).phases.generate_s
        loaded = (price_rl_step(workload, layout, *at_load, shared_sync(sync_rates, load_slow, 8)).step_s
                  if at_load else None)
        # the switch's phases and, where the run recorded them, the step's other parts
        measured_phases = {**variant["phase_s"], **variant.get("step_phase_s", {})}
        rows.append(_row(f"colocated {variant['train_layout']} offload {variant['offload']} ({config['ranks']} ranks)",
                         predicted,
                         variant["step_s"], measured_phases_s=measured_phases,
                         phases=phase_comparison(predicted.phases, measured_phases), training_busy_ranks=busy,
                         generation_priced_one_core_s=alone,
                         sensitivity_step_s_at_recorded_load=loaded, recorded_load_average=load))
    return rows


def generation_alone(config: dict, repeats: int) -> float:
    """A diagnostic, not used by the prediction: seconds of one rl_switch replica's generation
    (``replica_generation``) in one process alone, the fastest of ``repeats``. Beside the planner's generation
    at one core (``generation_priced_one_core_s`` of the colocated rows) it shows the engine's own work that
    the price does not see."""
    return best_time(replica_generation(config), repeats)


def stalesync_decode_steps(config: dict) -> tuple[list[int], list[float]]:
    """Tokens of the longest sample of each steady batch of rl_stalesync.py's workload, generated with the
    SFT warm-up's weights (the RL steps move them little: the held-out accuracy stays within 0.6), and the
    mean share of each batch's rows still running in its decode steps (the engine's ``rows_computed`` over
    decode steps × rows: a row that stopped leaves the batch)."""
    from rl_stalesync import warm_up

    from moetrain.rl.config import GRPOConfig, RLOptions
    from moetrain.rl.fusion import sample_generators
    from moetrain.rl.generate import RolloutEngine
    from moetrain.rl.loop import step_problems
    from moetrain.rl.sft import prompt_ids
    from moetrain.rl.tokenizer import CharTokenizer

    task, tokenizer = get_task(config["task"]), CharTokenizer()
    model_cfg = policy_model(4)
    initial = warm_up(config["task"], model_cfg, sequence_len_for(task, config["max_new_tokens"]),
                      config["sft_steps"], config["seed"])
    model = build_model(model_cfg, torch.device("cpu"), seed=0)
    model.load_state_dict(initial)
    engine = RolloutEngine(model.eval().requires_grad_(False), tokenizer.pad_id)
    options = RLOptions(task=config["task"], prompts_per_step=config["prompts"],
                        grpo=GRPOConfig(group_size=config["group_size"]), max_new_tokens=config["max_new_tokens"])
    params = SamplingParams(max_new_tokens=config["max_new_tokens"], temperature=1.0,
                            stop_token_ids=(tokenizer.eos_id,))
    longest, running = [], []
    for step in range(1, config["steps"] - 1):
        problems = step_problems(task, options, config["seed"], step)
        generation = engine.generate([prompt_ids(tokenizer, p) for p in problems], params,
                                     sample_generators(config["seed"], step, len(problems), torch.device("cpu")))
        longest.append(int(generation.lengths_B.max()))
        running.append(generation.rows_computed / max(generation.decode_steps, 1) / len(problems))
    return longest, running


def trained_len(tokens_per_step: float | None, samples: int, padded: int, granule: int = 1) -> int:
    """Positions per trained sequence, as the trainer computed them: its micro-batches are cut to their
    longest sample (``rl.batch.length_chunks``), so a step computes ``tokens_per_step`` of them (what the run
    recorded: its rows' ``tokens``) over its samples, rounded up to the layout's split; ``padded`` where
    the run did not record it (a run before the cut)."""
    full = -(-padded // granule) * granule
    if not tokens_per_step:
        return full
    return min(-(-round(tokens_per_step / samples) // granule) * granule, full)


def stalesync_rows(measured: dict, calibration: Calibration, host: HostCosts, longest: list[int],
                   capacity: float, thread_capacity: float, sync_rates: dict,
                   running: list[float] | None = None) -> list[dict]:
    """``measured``: an rl_stalesync.py result; ``longest``, ``running``: tokens of the longest sample of each
    steady batch and the share of its rows running per decode step (``stalesync_decode_steps``);
    ``capacity``: cores' worth the two processes get together when both compute (k ≥ 1);
    ``thread_capacity``: the same for the two threads of the colocated run's one process; ``sync_rates``:
    the weight sync's copy and CRC rates on one core (the push runs between two batches, each side on its
    own core). The link stays the preset's (two processes: not probed)."""
    config = measured["workload"]
    task = get_task(config["task"])
    model = policy_model(4)
    batch = config["prompts"] * config["group_size"]
    decode_steps = round(statistics.mean(longest))
    share = statistics.mean(running) if running else 1.0
    rows = []
    bucket = config.get("bucket_mib", STALESYNC_BUCKET_MIB) * 2**20
    steps = config["steps"] - 2  # the steady steps: neither the first (fill) nor the last (evaluation)
    for run in measured["runs"]:
        # the trainer's head runs on the completion tokens: their mean count, as the run counted them
        completion = run["steady_tokens"] / (steps * batch)
        workload = RLWorkload(model, load_cluster_config("cpu"), config["prompts"], config["group_size"],
                              task.max_prompt_chars + 1, decode_steps, "fp32",
                              train_seq_len=trained_len(run.get("trained_tokens_per_step"), batch,
                                                        sequence_len_for(task, config["max_new_tokens"])),
                              completion_len=completion, decode_running_share=share)
        micro = ParallelConfig(micro_batch=config.get("micro_batch", batch))
        if run.get("placement", "disaggregated") == "colocated":
            # one process: its generating thread and its training thread share the thread capacity; the
            # reshard is a local copy (and check) of the weights into the generation model
            layout = RLLayout("colocated", 1, micro, staleness=run["staleness"],
                              shared_cores=thread_capacity, sync_bucket_bytes=bucket)
            name = f"colocated k={run['staleness']} (one process, two threads)"
        else:
            layout = RLLayout("disaggregated", 2, micro, rollout_devices=1,
                              staleness=run["staleness"], shared_cores=capacity, sync_bucket_bytes=bucket)
            name = f"disaggregated k={run['staleness']}"
        predicted = price_rl_step(workload, layout, calibration, host, shared_sync(sync_rates, 1.0, 4))
        rows.append(_row(name, predicted, run["steady_seconds"] / steps,
                         steady_steps=steps, decode_steps=decode_steps, longest_sample_per_batch=longest,
                         decode_running_share=share, mean_completion_tokens=completion,
                         measured_phases_s=run.get("trainer_step_parts_s")))
    return rows


@dataclass(frozen=True)
class Rates:
    """Everything measured on this machine that the predictions use."""

    calibrations: dict[int, list[Calibration]]
    """The profiles of the policy by its number of layers (StaleSync runs 4, rl_switch 8), the least
    disturbed first."""
    hosts: dict[int, HostCosts]
    """By the model's number of layers (StaleSync runs 4, rl_switch 8)."""
    capacity: dict[int, Capacity]
    """Cores' worth of 2 and 4 concurrent processes."""
    thread_capacity: float
    """Cores' worth of 2 concurrent threads of one process (the colocated StaleSync run)."""
    longest: list[int]
    """Tokens of the longest sample of each steady StaleSync batch."""
    collectives: list[dict]
    """Gloo collectives on rl_switch's 4 ranks (``profile_collectives``)."""
    sync: dict
    """The weight sync's copy and CRC rates on one core (``profile_sync_rates``)."""
    switch_2_ranks_capacity: Capacity
    """Cores' worth of rl_switch's 2 ranks (the 8-layer forward at 64 rows)."""
    collectives_2_ranks: list[dict]
    """Gloo collectives on 2 ranks."""
    running: tuple[float, ...] = ()
    """Share of each steady StaleSync batch's rows running per decode step (empty: all of them)."""
    generation_capacity: dict[int, Capacity] = field(default_factory=dict)
    """Cores' worth of rl_switch's 4 and 2 ranks each generating its replica's rows (``replica_generation``)."""

    @property
    def link(self) -> LinkFit:
        return link_fit(self.collectives)

    @property
    def link_2_ranks(self) -> LinkFit:
        return link_fit(self.collectives_2_ranks)


def run_speed_ratio(run: dict, probe_speed: float | None) -> float | None:
    """How much slower the machine ran during ``run`` (a result made again here, with its speed reference
    before and after) than during the probes: the mean of its two references over the probes' median."""
    references = run.get("config", {}).get("speed_reference_s")
    if probe_speed is None or not references:
        return None
    return statistics.mean(references) / probe_speed


def carry_to_run_speed(row: dict, ratio: float) -> None:
    """The row's prediction carried to the speed its run saw (every rate scaled alike), beside the prediction."""
    carried = row["predicted_step_s"] * ratio
    error = error_pct(carried, row["measured_step_s"])
    row.update(speed_ratio=ratio, predicted_at_run_speed_s=carried, error_at_run_speed_pct=error,
               within_15pct_at_run_speed=within_bound(error))


def compare(switch: dict, switch_2_ranks: dict, stalesync: dict, rates: Rates,
            probe_speed: float | None = None) -> dict:
    """Predicted against measured for rl_switch.py's results (4 and 2 ranks) and an rl_stalesync.py result,
    under every profile; for runs that carry a speed reference, also at the speed each run saw."""
    def predict(index: int) -> list[dict]:
        eight, four = rates.calibrations[8][index], rates.calibrations[4][index]
        return (colocated_rows(switch, eight, rates.hosts[8], (rates.capacity[4], rates.generation_capacity[4]),
                               rates.link, rates.sync)
                + colocated_rows(switch_2_ranks, eight, rates.hosts[8],
                                 (rates.switch_2_ranks_capacity, rates.generation_capacity[2]),
                                 rates.link_2_ranks, rates.sync)
                + stalesync_rows(stalesync, four, rates.hosts[4], rates.longest, rates.capacity[2].shared,
                                 rates.thread_capacity, rates.sync, list(rates.running)))

    per_profile = [predict(i) for i in range(PROFILES)]
    rows = per_profile[0]
    # one row per rl_switch variant (4 ranks, then 2) and per rl_stalesync run, in that order
    measured_by_row = ([switch] * len(switch["variants"]) + [switch_2_ranks] * len(switch_2_ranks["variants"])
                       + [stalesync] * len(stalesync["runs"]))
    assert len(measured_by_row) == len(rows)
    for i, row in enumerate(rows):
        # how far the prediction moves with the machine's load: the same row under every profile
        row["predicted_step_s_per_profile"] = [p[i]["predicted_step_s"] for p in per_profile]
        ratio = run_speed_ratio(measured_by_row[i], probe_speed)
        carried = ""
        if ratio is not None:
            carry_to_run_speed(row, ratio)
            carried = f"; at the run's speed (×{ratio:.2f}) {row['error_at_run_speed_pct']:+.1f} %"
        print(f"{row['run']:44s} predicted {row['predicted_step_s']:7.3f} s  measured {row['measured_step_s']:7.3f} s"
              f"  ({row['error_pct']:+.1f} %; under the {PROFILES} profiles "
              + ", ".join(f"{v:.3f}" for v in row["predicted_step_s_per_profile"]) + f" s{carried})")
    for row in rows:
        if row.get("phases"):
            print(f"    {row['run']}: " + ", ".join(
                f"{name} {p['predicted_s'] * 1e3:.0f}/{p['measured_s'] * 1e3:.0f} ms"
                for name, p in row["phases"].items() if p["measured_s"] > 0) + " (predicted/measured)")
    errors = [abs(r["error_pct"]) for r in rows]
    print(f"median |error| {statistics.median(errors):.1f} %, max {max(errors):.1f} %; "
          f"{sum(r['within_15pct'] for r in rows)} of {len(rows)} within 15 %")
    at_speed = {}
    if all("error_at_run_speed_pct" in r for r in rows):
        carried = [abs(r["error_at_run_speed_pct"]) for r in rows]
        at_speed = {"median_abs_error_at_run_speed_pct": statistics.median(carried),
                    "max_abs_error_at_run_speed_pct": max(carried),
                    "within_15pct_at_run_speed": sum(r["within_15pct_at_run_speed"] for r in rows)}
        print(f"at each run's speed: median |error| {statistics.median(carried):.1f} %, max {max(carried):.1f} %; "
              f"{at_speed['within_15pct_at_run_speed']} of {len(rows)} within 15 %")
    return {"rows": rows, "median_abs_error_pct": statistics.median(errors), "max_abs_error_pct": max(errors),
            "within_15pct": sum(r["within_15pct"] for r in rows), "rows_total": len(rows), **at_speed,
            "measured_load_average_1min": {name: run["config"].get("load_average_1min_after") for name, run in
                                           (("rl_switch", switch), ("rl_switch_2_ranks", switch_2_ranks))}}


def remeasure(folder: Path) -> tuple[dict, dict, dict]:
    """rl_switch.py (4 and 2 ranks) and rl_stalesync.py (one repeat) run again now, beside the rates, into
    ``folder``; each with the machine's speed reference right before and right after it."""
    results = []
    for script, extra in (("rl_switch.py", []), ("rl_switch.py", ["--ranks", "2"]),
                          ("rl_stalesync.py", ["--repeats", "1"])):
        out = folder / f"{script.replace('.py', '')}{'_'.join(extra)}.json"
        load = os.getloadavg()[0]
        before = speed_reference()
        subprocess.run([sys.executable, str(Path(__file__).parent / script), *extra, "--out", str(out)], check=True,
                       capture_output=True)
        after = speed_reference()
        result = json.loads(out.read_text())
        result.setdefault("config", {})["load_average_1min_before"] = load
        result["config"]["speed_reference_s"] = [before, after]
        results.append(result)
    return results[0], results[1], results[2]


@dataclass(frozen=True)
class CommittedRuns:
    """The committed RL results the check prices, and the StaleSync batches' decode shape."""

    switch: dict
    switch_2_ranks: dict
    stalesync: dict
    longest: list[int]
    running: list[float]


def measure_rates(committed: CommittedRuns, repeats: int) -> tuple[Rates, list[float]]:
    """Every probe the prediction uses, with the machine's speed reference between them (see the module
    docstring)."""
    probe_speeds = [speed_reference()]
    generating = {config["ranks"]: core_capacity(config["ranks"], work=config)
                  for config in (committed.switch["config"], committed.switch_2_ranks["config"])}
    probe_speeds.append(speed_reference())
    calibrations = {layers: profile_policy(policy_model(layers), repeats) for layers in (4, 8)}
    probe_speeds.append(speed_reference())
    hosts = {layers: host_costs(policy_model(layers), repeats) for layers in (4, 8)}
    capacity = {n: core_capacity(n, work=CAPACITY_WORK[n]) for n in (2, 4)}
    probe_speeds.append(speed_reference())
    thread_capacity, collectives = threads_capacity(CAPACITY_WORK[2]), profile_collectives(COLOCATED_RANKS)
    sync = sync_probes(repeats)
    probe_speeds.append(speed_reference())
    switch_2_ranks_capacity, collectives_2_ranks = core_capacity(2, work=SWITCH_2_RANKS_WORK), profile_collectives(2)
    probe_speeds.append(speed_reference())
    rates = Rates(calibrations, hosts, capacity, thread_capacity, committed.longest, collectives, sync,
                  switch_2_ranks_capacity, collectives_2_ranks, tuple(committed.running), generating)
    return rates, probe_speeds


def check_round(committed: CommittedRuns, repeats: int, remeasure_runs: bool) -> dict:
    """One pass: the rates, the prediction against the committed runs and (``remeasure_runs``) against the
    same benchmarks run again right after."""
    rates, probe_speeds = measure_rates(committed, repeats)
    probe_speed = statistics.median(probe_speeds)
    gemm_capacity = {n: core_capacity(n) for n in (2, 4)}
    shown = lambda c: f"{c.shared:.2f} / {c.slowest:.2f} / {c.paced:.2f}"  # noqa: E731
    print(f"cores' worth of 2 and 4 concurrent processes (the runs' forwards; on their own / by the slowest / "
          f"paced): {shown(rates.capacity[2])}, {shown(rates.capacity[4])}; rl_switch's 2 ranks "
          f"{shown(rates.switch_2_ranks_capacity)}; rl_switch's 4 and 2 ranks generating "
          f"{shown(rates.generation_capacity[4])}, {shown(rates.generation_capacity[2])}; "
          f"of 2 threads of one process: {rates.thread_capacity:.2f}; "
          f"of a GEMM loop (recorded, not used): {gemm_capacity[2].shared:.2f}, {gemm_capacity[4].shared:.2f}")
    link = rates.link
    print(f"gloo link of {COLOCATED_RANKS} ranks: {link.latency_us:.0f} µs per message step, {link.gbps:.2f} GB/s; "
          f"weight sync per core: copy {rates.sync['copy_bytes_per_s'] / 1e9:.2f} GB/s, "
          f"CRC-32 {rates.sync['crc_bytes_per_s'] / 1e9:.2f} GB/s; the whole sync of the 8-layer model "
          f"{rates.sync['whole_sync_8_layers']['host_bytes_per_s'] / 1e9:.2f} GB/s packed or written")
    alone = generation_alone(committed.switch["config"], repeats)
    print(f"one rl_switch replica's generation alone: {alone:.3f} s (a diagnostic)")
    result = {"measured_from": [f"benchmarks/results/{name}.json"
                                for name in ("rl_switch_cpu", "rl_switch_cpu_2ranks", "rl_stalesync_cpu")],
              **compare(committed.switch, committed.switch_2_ranks, committed.stalesync, rates)}
    if remeasure_runs:
        with tempfile.TemporaryDirectory() as tmp:
            again = remeasure(Path(tmp))
        print("against the runs made again now:")
        result["remeasured"] = {"load_average_1min_before": [r["config"]["load_average_1min_before"] for r in again],
                                "measured": {"rl_switch": again[0], "rl_switch_2_ranks": again[1],
                                             "rl_stalesync": again[2]},
                                **compare(*again, rates, probe_speed)}
    result["rates"] = {
        "cpu_efficiency": {f"policy_{layers}_layers": runs[0].for_device("cpu").as_dict()
                           for layers, runs in rates.calibrations.items()},
        "profiles": {f"policy_{layers}_layers": [c.per_arch["cpu"] for c in runs]
                     for layers, runs in rates.calibrations.items()},
        "host_4_layers": asdict(rates.hosts[4]), "host_8_layers": asdict(rates.hosts[8]),
        "cpu_count": os.cpu_count(), "core_capacity_2_processes": asdict(rates.capacity[2]),
        "core_capacity_4_processes": asdict(rates.capacity[4]),
        "core_capacity_2_threads": rates.thread_capacity,
        "capacity_work_layers_rows": CAPACITY_WORK,
        "core_capacity_gemm_2_processes": asdict(gemm_capacity[2]),
        "core_capacity_gemm_4_processes": asdict(gemm_capacity[4]),
        "collectives_4_ranks": rates.collectives, "link_4_ranks": asdict(link),
        "core_capacity_rl_switch_2_ranks": asdict(rates.switch_2_ranks_capacity),
        "core_capacity_generating": {ranks: asdict(c) for ranks, c in rates.generation_capacity.items()},
        "collectives_2_ranks": rates.collectives_2_ranks, "link_2_ranks": asdict(rates.link_2_ranks),
        "weight_sync_per_core": rates.sync, "generation_alone_one_replica_s": alone,
        "speed_reference_s_during_probes": probe_speeds, "speed_reference_s_probes_median": probe_speed}
    return result


def over_rounds(rounds: list[dict]) -> dict:
    """Each row's median prediction over the rounds against the committed run and against the median of its
    runs made again: rounds of probes and runs interleaved, so that a machine whose speed moves between
    minutes meets both in each."""
    rows = []
    for i, row in enumerate(rounds[0]["rows"]):
        predicted = statistics.median(r["rows"][i]["predicted_step_s"] for r in rounds)
        entry = {"run": row["run"], "predicted_step_s": predicted, "measured_step_s": row["measured_step_s"],
                 "error_pct": error_pct(predicted, row["measured_step_s"])}
        if all("remeasured" in r for r in rounds):
            again = statistics.median(r["remeasured"]["rows"][i]["measured_step_s"] for r in rounds)
            entry.update(measured_again_step_s=again, error_again_pct=error_pct(predicted, again))
        rows.append(entry)
    summary = {"rows": rows, "within_15pct": sum(within_bound(r["error_pct"]) for r in rows), "rows_total": len(rows)}
    if all("error_again_pct" in r for r in rows):
        summary["within_15pct_again"] = sum(within_bound(r["error_again_pct"]) for r in rows)
    print(f"over {len(rounds)} rounds (median prediction; against the committed runs, then the median of the runs "
          "made again):")
    for r in rows:
        again = (f"; {r['measured_again_step_s']:.3f} s ({r['error_again_pct']:+.1f} %)"
                 if "error_again_pct" in r else "")
        print(f"{r['run']:44s} predicted {r['predicted_step_s']:7.3f} s  measured {r['measured_step_s']:7.3f} s "
              f"({r['error_pct']:+.1f} %){again}")
    print(f"{summary['within_15pct']} of {len(rows)} within 15 %"
          + (f", {summary['within_15pct_again']} of {len(rows)} against the runs made again"
             if "within_15pct_again" in summary else ""))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--remeasure", action="store_true",
                        help="also run rl_switch.py and rl_stalesync.py again now and compare with those")
    parser.add_argument("--rounds", type=int, default=1,
                        help="probes (and, with --remeasure, runs) this many times over, compared by their medians")
    parser.add_argument("--out", default="benchmarks/results/rl_simulate_check_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_host_memory()  # the probes below run in this process: under the runs' allocator
    load_before = os.getloadavg()[0]
    switch = json.loads((RESULTS / "rl_switch_cpu.json").read_text())
    switch_2_ranks = json.loads((RESULTS / "rl_switch_cpu_2ranks.json").read_text())
    stalesync = json.loads((RESULTS / "rl_stalesync_cpu.json").read_text())
    longest, running = stalesync_decode_steps(stalesync["workload"])
    print(f"StaleSync batches' longest samples: {longest} tokens (mean {statistics.mean(longest):.1f}); rows "
          f"running per decode step: {statistics.mean(running):.2f} of each batch")
    committed = CommittedRuns(switch, switch_2_ranks, stalesync, longest, running)
    rounds = []
    for index in range(args.rounds):
        if args.rounds > 1:
            print(f"round {index + 1} of {args.rounds}")
        rounds.append(check_round(committed, args.repeats, args.remeasure))
    result = rounds[0] if args.rounds == 1 else {"rounds": rounds, "over_rounds": over_rounds(rounds)}
    write_result(args.out, {**result, "load_average_1min_before": load_before,
                            "load_average_1min_after": os.getloadavg()[0]})

if __name__ == "__main__":
    main()
