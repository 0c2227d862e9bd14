"""The rates an RL step is priced with (``planner.rl_step.price_rl_step``), measured on this machine: what
``moetrain profile`` does not cover for RL on a CPU.

- ``profile_policy``: ``moetrain profile`` of the policy, a few times over, the least disturbed first;
- ``host_costs``: the eager generation loop's host work (``planner.generation.HostCosts``): one decoder
  layer's forward on one token, the sampler's time per logit, the rollout engine's own work per decode
  step (``engine_probe``);
- ``core_capacity``, ``threads_capacity``: the cores' worth of compute that co-running one-thread processes
  (or two threads of one process) get together (``Capacity``); ``mixed_capacity``: the same for the
  disaggregated job's own mix, decode processes beside training ones (``MixedCapacity``); and
  ``shared_cores`` / ``shared_sync`` / ``training_calibration``: the rates carried to each process's share;
- ``sync_probes`` / ``shared_sync``: the weight sync's copy and CRC-32 rates (``planner.rl_step.SyncRates``);
  ``link_fit`` / ``with_link``: the in-node link fitted to gloo collectives;
- ``role_cpu``: each process's CPU-seconds per step of a disaggregated StaleSync job, its roles apart
  (k = 0), which ``planner.rl_cores`` shares over the CPU's cores for k ≥ 1 (``RoleCPUProbe``);
- ``rank_cpu``: each rank's CPU-seconds per step of a colocated job (RL Fusion or colocated StaleSync) as it
  runs, which ``planner.rl_cores`` shares over the CPU's cores (``RankCPUProbe``);
- ``speed_reference``: the machine's speed now, to tell a moving machine from a wrong formula;
- ``measure_rl_rates``: generation's host costs and the sync's rates of one policy, as ``moetrain profile
  --rl-out`` writes them for ``moetrain simulate --rl --rl-rates``.

``benchmarks/rl_simulate_check.py`` prices the committed CPU RL runs with these (benchmarks/notes/
rl_simulate.md, "Check against the CPU runs"). Everything here runs on the CPU, one thread per process, as
those runs do."""

from __future__ import annotations

import multiprocessing as mp
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import torch
import yaml

from moetrain.config import ModelConfig, load_model_config
from moetrain.distributed.world import spawn
from moetrain.errors import UserError
from moetrain.models.transformer import build_model
from moetrain.planner.calibration import Calibration, load_calibration
from moetrain.planner.comm import LinkFit, fit_link, link_residuals
from moetrain.planner.generation import HostCosts
from moetrain.planner.rl_cores import RankCPU, RoleCPU
from moetrain.planner.rl_rates import RLRates
from moetrain.planner.rl_step import RLLayout, RLWorkload, SyncRates, training_prediction
from moetrain.rl.config import GRPOConfig, RLOptions
from moetrain.rl.fusion import sample_generators
from moetrain.rl.generate import RolloutEngine, SamplingParams, sample
from moetrain.rl.loop import policy_config, step_problems
from moetrain.rl.roles import Roles
from moetrain.rl.sft import prompt_ids
from moetrain.rl.stalesync import StaleSyncJob, run_stalesync
from moetrain.rl.tasks import get_task, new_tokens_for
from moetrain.rl.tokenizer import CharTokenizer
from moetrain.runtime_base.host_memory import keep_freed_host_memory
from moetrain.train.profiler import profile_sync_rates, profile_weight_sync

SAMPLER_ROWS = 128
"""Rows of logits the sampler probe draws from."""


def _call_times(fn, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after a warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def best_time(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn``, after a warm-up call."""
    return min(_call_times(fn, repeats))


SPEED_REFERENCE_WORK = (8, 32)
"""The speed reference's forward: (layers, rows) of rl_switch's policy and one replica's rows."""
SPEED_REFERENCE_CALLS = 15


@cache
def _speed_reference_step():
    return _forward_step(SPEED_REFERENCE_WORK)


def speed_reference() -> float:
    """The machine's speed now: the median seconds of ``SPEED_REFERENCE_CALLS`` calls of a fixed one-thread
    forward (``SPEED_REFERENCE_WORK``) in this process, after a warm-up call. Higher is slower."""
    with torch.no_grad():
        return statistics.median(_call_times(_speed_reference_step(), SPEED_REFERENCE_CALLS))


def policy_model(num_layers: int, model: str = "tiny-pangu") -> ModelConfig:
    """The RL runs' policy: ``model`` without MTP (tiny-pangu by default), with ``num_layers`` layers
    (benchmarks/rl_stalesync.py runs 4, rl_switch.py 8)."""
    return policy_config(load_model_config(model)).model_copy(update={"num_layers": num_layers})


PROFILES = 3
"""The machine is shared: the rates are those of the least disturbed of this many profiles (the one with
the fastest GEMMs; its fitted per-call costs come with it), as rl_stalesync.py reports the fastest of its
repeats."""


def profile_policy(model_cfg: ModelConfig, repeats: int, profiles: int = PROFILES) -> list[Calibration]:
    """``moetrain profile`` on this CPU, one thread (the runs' threads per rank), of ``model_cfg`` (its host
    time per layer pass and per optimizer step are that model's), ``profiles`` times, each in a process of
    its own, the least disturbed first."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        out, model = Path(tmp) / "cpu.yaml", Path(tmp) / "policy.yaml"
        model.write_text(yaml.safe_dump(model_cfg.model_dump(mode="json")))
        for _ in range(profiles):
            subprocess.run([sys.executable, "-m", "moetrain", "profile", "--cluster", "cpu", "--device", "cpu",
                            "--model", str(model), "--threads", "1", "--repeats", str(repeats), "--out", str(out)],
                           check=True, capture_output=True)
            runs.append(load_calibration(out))
    return sorted(runs, key=lambda run: -run.per_arch["cpu"]["gemm_max"])


ENGINE_PROBE_ROWS = 16
"""The engine's decode step is probed at 1 row and at this many (its own work grows with the rows)."""
ENGINE_PROBE_STEPS = 8
"""Decode steps the engine probe times beyond a generation of one token (after a prompt of as many)."""


def host_costs(model_cfg: ModelConfig, repeats: int) -> HostCosts:
    """Per-layer forward of the runtime's model on one token, the sampler's time per logit, and the
    generation engine's own work per decode step (``engine_probe``), each the fastest of its repeats."""
    num_layers = model_cfg.num_layers
    model = build_model(model_cfg, torch.device("cpu"), seed=0).eval().requires_grad_(False)
    ids = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        forward = best_time(lambda: model(ids), repeats * 20)
    logits = torch.randn(SAMPLER_ROWS, model_cfg.vocab_size)
    generators = [torch.Generator().manual_seed(row) for row in range(SAMPLER_ROWS)]
    params = SamplingParams(max_new_tokens=1, temperature=1.0)
    sampling = best_time(lambda: sample(logits, params, generators), repeats * 5)
    step_us, row_us = engine_probe(model, repeats)
    return HostCosts(layer_forward_us=forward / num_layers * 1e6, probe_tokens=1,
                     sample_ns_per_logit=sampling / logits.numel() * 1e9, host_is_device=True,
                     engine_step_us=step_us, engine_row_us=row_us)


def engine_probe(model, repeats: int) -> tuple[float, float]:
    """The rollout engine's own work per decode step beyond the model's forward and the draw, as (µs per
    step, µs per row), from its decode step at 1 row and at ``ENGINE_PROBE_ROWS``: at each size, a
    generation of 1 + ``ENGINE_PROBE_STEPS`` tokens less one of 1 token, over the steps, less the model's
    forward of those rows on one token and the sampler's draw for them. Each the fastest of ``repeats``
    rounds, the timings of a round taken one after the other (a passing load then touches all of them)."""
    cpu, vocab = torch.device("cpu"), model.cfg.vocab_size
    engine = RolloutEngine(model, pad_id=0)
    prompt = list(range(1, ENGINE_PROBE_STEPS + 1))

    def timers(rows: int) -> dict:
        prompts = [prompt] * rows
        short, long = (SamplingParams(max_new_tokens=n, temperature=1.0)  # no stop id: every step runs
                       for n in (1, 1 + ENGINE_PROBE_STEPS))
        ids, logits = torch.zeros(rows, 1, dtype=torch.long), torch.randn(rows, vocab)
        generators = [torch.Generator().manual_seed(row) for row in range(rows)]
        return {"short": lambda: engine.generate(prompts, short, sample_generators(0, 0, rows, cpu)),
                "long": lambda: engine.generate(prompts, long, sample_generators(0, 0, rows, cpu)),
                "forward": lambda: model(ids), "draw": lambda: sample(logits, short, generators)}

    def own_work(rows: int) -> float:
        calls = timers(rows)
        best = dict.fromkeys(calls, float("inf"))
        with torch.no_grad():
            for _ in range(repeats + 1):  # the first round warms up
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    best[name] = min(best[name], time.perf_counter() - start)
        step = (best["long"] - best["short"]) / ENGINE_PROBE_STEPS
        return max(step - best["forward"] - best["draw"], 0.0)

    one, several = own_work(1), own_work(ENGINE_PROBE_ROWS)
    per_row = max(several - one, 0.0) / (ENGINE_PROBE_ROWS - 1)
    return max(one - per_row, 0.0) * 1e6, per_row * 1e6


def _forward_step(work: tuple[int, int], seed: int = 0):
    """The runtime's eager forward of the run's model (``work`` = (layers, rows)) on CAPACITY_TOKENS tokens
    per row, as a call."""
    layers, rows = work
    model_cfg = policy_model(layers)
    model = build_model(model_cfg, torch.device("cpu"), seed=seed).eval().requires_grad_(False)
    ids = torch.zeros(rows, CAPACITY_TOKENS, dtype=torch.long)
    return lambda: model(ids)


def _timed_loop(step, count: int, barrier, paced: bool = False) -> float:
    """Seconds of ``count`` calls of ``step`` after a warm-up, started when every worker is at ``barrier``;
    ``paced``: every worker waits at the barrier after each call, as ranks that meet in a collective do."""
    with torch.no_grad():
        step()
        barrier.wait()  # every worker imported and warmed up: the loops run at once
        start = time.perf_counter()
        for _ in range(count):
            step()
            if paced:
                barrier.wait()
    return time.perf_counter() - start


def _capacity_worker(queue, barrier, work: tuple[int, int] | dict | None = None, paced: bool = False) -> None:
    torch.set_num_threads(1)
    keep_freed_host_memory()  # as the runs' processes
    if work is None:
        a, b = torch.randn(384, 384), torch.randn(384, 384)
        step, count = (lambda: a @ b), CAPACITY_MATMULS
    elif isinstance(work, dict):  # an rl_switch run's config: one replica's generation
        step, count = replica_generation(work), CAPACITY_GENERATIONS
    else:
        step, count = _forward_step(work), CAPACITY_FORWARDS
    queue.put(_timed_loop(step, count, barrier, paced))


CAPACITY_MATMULS = 600
"""Calls per timing of the capacity probe's loop: of a 384² GEMM (a working set that fits each core's cache),"""
CAPACITY_FORWARDS = 40
"""of the runtime's forward of the policy,"""
CAPACITY_GENERATIONS = 6
"""and of one rl_switch replica's generation (``replica_generation``)."""
CAPACITY_TOKENS = 4
"""Tokens per row of the capacity probe's forward."""


def _concurrent_times(processes: int, work: tuple[int, int] | dict | None = None, paced: bool = False) -> list[float]:
    """Seconds of the same one-thread loop (a GEMM; with ``work`` = (layers, rows) the runtime's forward; with
    an rl_switch run's config one replica's generation) in each of ``processes`` processes started together
    (``paced``: meeting after every call)."""
    context = mp.get_context("spawn")
    queue, barrier = context.Queue(), context.Barrier(processes)
    return _run_together(context, queue, _capacity_worker, [(queue, barrier, work, paced)] * processes)


def _run_together(context, queue, target, args_per_process: list[tuple]) -> list:
    """Start one ``target`` process per argument tuple, then collect one result each from ``queue``."""
    workers = [context.Process(target=target, args=args) for args in args_per_process]
    for worker in workers:
        worker.start()
    results = [queue.get() for _ in workers]
    for worker in workers:
        worker.join()
    return results


@dataclass(frozen=True)
class Capacity:
    """Cores' worth of compute that concurrent one-thread processes get together."""

    shared: float
    """Each process on its own: processes × (the loop's time alone) / (its mean time when they run at once)."""
    slowest: float
    """The same run, by its slowest process: what independent processes that meet once at the end (the
    generation replicas before their rows' gather) get, the last of them setting the end."""
    paced: float
    """Processes that wait for each other after every call, as the ranks of one training layout meet in
    their collectives: the slowest of them sets every call's pace. On a virtual machine whose cores run
    at different speeds (another tenant on a core's sibling thread) this is well below ``shared``."""


def core_capacity(processes: int, tries: int = 2, work: tuple[int, int] | dict | None = None) -> Capacity:
    """Cores' worth of compute that ``processes`` one-thread processes get together, on their own and paced
    (``Capacity``): processes × (time of the loop alone) / (its time when they run at once); each the best of
    ``tries``. The loop is the runtime's eager forward of the run's model (``work`` = (layers, rows); a GEMM
    loop without): each process then brings its model's weights and activations, as the runs' processes
    do, so the probe sees what they share besides the cores (the last-level cache: 4 ranks' models do not
    fit in it together where one does). Two SMT siblings of one physical core give about 1, not 2; other
    users of the machine take their share too."""
    alone = min(_concurrent_times(1, work)[0] for _ in range(tries))
    free = [_concurrent_times(processes, work) for _ in range(tries)]
    paced = max(processes * alone / statistics.mean(_concurrent_times(processes, work, True)) for _ in range(tries))
    return Capacity(max(processes * alone / statistics.mean(times) for times in free),
                    max(processes * alone / max(times) for times in free), paced)


DECODE, TRAIN = "decode", "train"
"""The two kinds of process of a disaggregated job on one CPU: a rollout replica decoding, a trainer rank."""


@dataclass(frozen=True)
class MixedWork:
    """What the mixed probe's processes run, per call: a decode step (the eager forward of ``decode_rows``
    rows of one token each, under no grad) and a training micro-batch (the forward and backward of
    ``train_rows`` rows of ``train_tokens`` tokens), on the ``layers``-layer policy."""

    layers: int
    decode_rows: int
    train_rows: int
    train_tokens: int


def _mixed_step(kind: str, work: MixedWork):
    model = build_model(policy_model(work.layers), torch.device("cpu"), seed=0)
    if kind == DECODE:
        model.eval().requires_grad_(False)
        ids = torch.zeros(work.decode_rows, 1, dtype=torch.long)
        return lambda: model(ids)
    ids = torch.randint(0, model.cfg.vocab_size, (work.train_rows, work.train_tokens),
                        generator=torch.Generator().manual_seed(0))

    def train() -> None:
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    return train


MIXED_TRAIN_CALLS = 8
"""Training micro-batches each trainer process of the mixed probe times (the decoders run meanwhile),"""
MIXED_DECODE_CALLS = 20
"""and the fewest decode steps a decoder times (alone: exactly these)."""


def _mixed_worker(queue, start, pace, done, kind: str, work: MixedWork) -> None:
    """One process of the mixed probe: its step's seconds per call while every process runs. A trainer
    process runs MIXED_TRAIN_CALLS calls, meeting the other trainers after each (``pace``: their collectives);
    a decoder calls its step until the trainers are ``done`` (at least MIXED_DECODE_CALLS times), so its calls
    overlap theirs."""
    torch.set_num_threads(1)
    keep_freed_host_memory()  # as the runs' processes
    step = _mixed_step(kind, work)
    step()  # warm-up
    start.wait()
    began, began_cpu, calls = time.perf_counter(), time.process_time(), 0
    while (calls < MIXED_TRAIN_CALLS) if kind == TRAIN else (calls < MIXED_DECODE_CALLS or not done.is_set()):
        step()
        calls += 1
        if kind == TRAIN and pace is not None:
            pace.wait()
    if kind == TRAIN:
        done.set()
    queue.put((kind, (time.perf_counter() - began) / calls, (time.process_time() - began_cpu) / calls))


def _mixed_times(decoders: int, trainers: int, work: MixedWork) -> list[tuple[str, float, float]]:
    """(kind, seconds per call, CPU-seconds per call) of each of ``decoders`` decode processes and
    ``trainers`` trainer processes started together."""
    context = mp.get_context("spawn")
    queue, done = context.Queue(), context.Event()
    start = context.Barrier(decoders + trainers)
    pace = context.Barrier(trainers) if trainers > 1 else None
    kinds = [DECODE] * decoders + [TRAIN] * trainers
    if not trainers:  # a decoder alone: its MIXED_DECODE_CALLS calls
        done.set()
    return _run_together(context, queue, _mixed_worker, [(queue, start, pace, done, kind, work) for kind in kinds])


@dataclass(frozen=True)
class MixedCapacity:
    """Cores' worth of compute that the disaggregated job's processes get side by side on one CPU: R
    rollout replicas decoding beside T trainer ranks training (forward and backward, meeting after every
    micro-batch), measured as they run (``mixed_capacity``)."""

    decode_alone_s: float
    """A decode step's seconds in one process alone."""
    train_alone_s: float
    """A training micro-batch's seconds in one process alone."""
    together_s: tuple[tuple[str, float], ...]
    """(kind, seconds per call) of every process when all run at once."""

    @property
    def shared(self) -> float:
        """Σ over the processes of (its call's time alone) / (its call's time among the others): each
        process's share of a core while all run, summed (``mixed_cores``)."""
        return mixed_cores({DECODE: self.decode_alone_s, TRAIN: self.train_alone_s}, self.together_s)


def mixed_cores(alone_s: dict[str, float], together_s: tuple[tuple[str, float], ...]) -> float:
    """Cores' worth that processes of several kinds get side by side: Σ alone_s[kind] / seconds, over every
    (kind, seconds per call) in ``together_s``. The price's ``shared_cores`` (``RLLayout``) on one CPU."""
    return sum(alone_s[kind] / seconds for kind, seconds in together_s)


def mixed_capacity(decoders: int, trainers: int, work: MixedWork, tries: int = 2) -> MixedCapacity:
    """The disaggregated job's processes side by side (``MixedCapacity``): ``decoders`` decode processes
    beside ``trainers`` trainer processes, each call's time alone the best of ``tries``, the run together
    the one of ``tries`` that gets the most."""
    decode_alone = min(_mixed_times(1, 0, work)[0][1] for _ in range(tries))
    train_alone = min(_mixed_times(0, 1, work)[0][1] for _ in range(tries))
    runs = [tuple((kind, wall) for kind, wall, _ in _mixed_times(decoders, trainers, work)) for _ in range(tries)]
    alone = {DECODE: decode_alone, TRAIN: train_alone}
    return MixedCapacity(decode_alone, train_alone, max(runs, key=lambda run: mixed_cores(alone, run)))


@dataclass(frozen=True)
class OverlapCPU:
    """CPU-seconds per call of the disaggregated job's two kinds of process with their roles apart (R
    decoders on their own, then T trainers on their own, as StaleSync runs at k = 0) and overlapped (all
    R + T at once, as at k ≥ 1), each the median over the processes of a kind (``overlap_cpu``)."""

    apart_s: dict[str, float]
    together_s: dict[str, float]

    @property
    def factors(self) -> tuple[float, float]:
        """(rollout, trainer): what a call costs in CPU time overlapped over what it costs apart: the
        caches that time-sliced processes evict from each other, a busy sibling of the core."""
        return (self.together_s[DECODE] / self.apart_s[DECODE], self.together_s[TRAIN] / self.apart_s[TRAIN])


def _median_cpu(run: list[tuple[str, float, float]], kind: str) -> float:
    return statistics.median(cpu for k, _, cpu in run if k == kind)


def overlap_cpu(decoders: int, trainers: int, work: MixedWork, tries: int = 2) -> OverlapCPU:
    """The mixed probe's processes (``MixedWork``: a decode step, a training micro-batch) timed in CPU:
    ``decoders`` on their own, ``trainers`` on their own (meeting after every micro-batch), then all at
    once; each figure the lowest of ``tries`` (a burst of other load only adds)."""
    apart = {DECODE: min(_median_cpu(_mixed_times(decoders, 0, work), DECODE) for _ in range(tries)),
             TRAIN: min(_median_cpu(_mixed_times(0, trainers, work), TRAIN) for _ in range(tries))}
    runs = [_mixed_times(decoders, trainers, work) for _ in range(tries)]
    return OverlapCPU(apart, {kind: min(_median_cpu(run, kind) for run in runs) for kind in (DECODE, TRAIN)})


def threads_capacity(work: tuple[int, int], tries: int = 2) -> float:
    """Cores' worth of compute two threads of one process get together, each running the forward loop of a
    model of its own (``work`` = (layers, rows)), as the colocated run's generating and training threads
    do: 2 × (the loop's time alone) / (its mean time when both run at once); the best of ``tries``. The
    interpreter's lock is what the two threads share besides the cores."""
    steps = [_forward_step(work, seed=i) for i in range(2)]

    def loop(step, times: list[float], barrier: threading.Barrier) -> None:
        times.append(_timed_loop(step, CAPACITY_FORWARDS, barrier))

    def together(count: int) -> float:
        times: list[float] = []
        barrier = threading.Barrier(count)
        threads = [threading.Thread(target=loop, args=(steps[i], times, barrier)) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return statistics.mean(times)

    alone = min(together(1) for _ in range(tries))
    return max(2 * alone / together(2) for _ in range(tries))


def replica_generation(config: dict):
    """One rl_switch replica's generation as a call: its share of step 2's rows (``config``: the run's, with
    its ranks), the 8-layer policy, the engine as RL Fusion runs it."""
    task, tokenizer, cpu = get_task(config["task"]), CharTokenizer(), torch.device("cpu")
    model = build_model(policy_config(load_model_config(config["model"])), cpu, seed=0)
    engine = RolloutEngine(model.eval().requires_grad_(False), tokenizer.pad_id, tokenizer.decode)
    engine.retain_cache = True
    options = RLOptions(task=config["task"], prompts_per_step=config["prompts"],
                        grpo=GRPOConfig(group_size=config["group_size"]))
    problems = step_problems(task, options, 0, 2)
    rows = len(problems) // config["ranks"]
    prompts = [prompt_ids(tokenizer, p) for p in problems[:rows]]
    params = SamplingParams(max_new_tokens=new_tokens_for(task, None), temperature=1.0,
                            stop_token_ids=(tokenizer.eos_id,))

    def run() -> None:
        engine.generate(prompts, params, sample_generators(0, 2, rows, cpu))
        engine.free_cache()

    return run


def shared_cores(calibration: Calibration, host: HostCosts, slow: float) -> tuple[Calibration, HostCosts]:
    """Rates when each process gets 1/``slow`` of a core."""
    if slow <= 1.0:
        return calibration, host
    eff = calibration.for_device("cpu")
    # every other value (the measured link's bus efficiency of 1 among them) stays the device's
    cpu = {**eff.as_dict(), "gemm_max": eff.gemm_max / slow, "attention": eff.attention / slow,
           "memory": eff.memory / slow, "gemm_overhead_us": eff.gemm_overhead_us * slow,
           "moe_overhead_us": eff.moe_overhead_us * slow, "host_layer_us": eff.host_layer_us * slow,
           "host_optimizer_ms": eff.host_optimizer_ms * slow}
    scaled = replace(calibration, per_arch={**calibration.per_arch, "cpu": cpu}, held_out_fits={})
    return scaled, replace(host, layer_forward_us=host.layer_forward_us * slow,
                           sample_ns_per_logit=host.sample_ns_per_logit * slow,
                           engine_step_us=host.engine_step_us * slow, engine_row_us=host.engine_row_us * slow)


def shared_sync(rates: dict, slow: float, layers: int) -> SyncRates:
    """The weight sync's rates when each process gets 1/``slow`` of a core: the copy and CRC rates of one
    buffer (``profile_sync_rates``) and, where measured, the whole sync's own rate on the ``layers``-layer
    model (``profile_weight_sync``)."""
    slow = max(slow, 1.0)
    whole = rates.get(f"whole_sync_{layers}_layers")
    return SyncRates(rates["copy_bytes_per_s"] / slow, rates["crc_bytes_per_s"] / slow,
                     whole["host_bytes_per_s"] / slow if whole else None)


def link_fit(collectives: list[dict]) -> LinkFit:
    """The in-node link of the ranks' gloo collectives: latency and bandwidth fitted to the measured
    all-reduces, all-gathers and all-to-alls (``profile_collectives``). The one-way sends are measured
    beside but not fitted: back to back they stream (no round trip), which no per-message latency of a
    collective describes; the fit's error on them is recorded."""
    fit = fit_link([m for m in collectives if m["kind"] != "send_recv"])
    sends = [m for m in collectives if m["kind"] == "send_recv"]
    return replace(fit, residual_pct={**fit.residual_pct, **link_residuals(sends, fit.latency_us, fit.gbps)})


def with_link(calibration: Calibration) -> Calibration:
    """The calibration for a measured link: the fit's bandwidth is what the collectives reached (bus
    efficiency 1)."""
    cpu = {**calibration.per_arch.get("cpu", {}), "bus_intra": 1.0}
    return replace(calibration, per_arch={**calibration.per_arch, "cpu": cpu})


def training_calibration(workload: RLWorkload, layout: RLLayout, calibration: Calibration, host: HostCosts,
                         paced_capacity: float, bubble_calibration: Calibration | None = None
                         ) -> tuple[Calibration, float]:
    """The calibration a colocated layout's training runs at on a CPU host, and its busy ranks: a rank
    blocked in a collective or a pipeline's idle stage takes no CPU (gloo waits without spinning), so the
    ranks that compute share the cores' worth the layout's ranks get paced (``Capacity.paced``): on average
    ranks × (1 − the pipeline's bubble fraction) of them (all of them without a pipeline). ``calibration``
    and ``host``: one core's rates; ``bubble_calibration``: the rates the bubble fraction is priced at
    (default ``calibration``)."""
    bubble = training_prediction(workload, layout, bubble_calibration or calibration).bubble_fraction
    busy = layout.devices * (1.0 - float(bubble))
    return shared_cores(calibration, host, busy / paced_capacity)[0], busy


def sync_probes(repeats: int, num_layers: tuple[int, ...] = (8, 4)) -> dict:
    """The weight sync's rates on one core: one buffer's copy and CRC-32 (``profile_sync_rates``) and the
    whole sync of the policy (``policy_model``) at each of ``num_layers`` (rl_switch's 8, rl_stalesync's 4)
    in one process (``profile_weight_sync``: per-box work included)."""
    return {**profile_sync_rates(repeats),
            **{f"whole_sync_{layers}_layers": profile_weight_sync(policy_model(layers), repeats)
               for layers in num_layers}}


def measure_rl_rates(model_cfg: ModelConfig, repeats: int) -> RLRates:
    """The RL step's host rates of ``model_cfg``'s policy (``rl.loop.policy_config``: no MTP) on this CPU:
    generation's host costs (``host_costs``) and the weight sync's (one buffer's copy and CRC-32, and the
    whole sync of the policy, per-box work included: ``SyncRates.host_bytes_per_s``)."""
    policy = policy_config(model_cfg)
    buffer, whole = profile_sync_rates(repeats), profile_weight_sync(policy, repeats)
    sync = SyncRates(buffer["copy_bytes_per_s"], buffer["crc_bytes_per_s"], whole["host_bytes_per_s"])
    return RLRates(host_costs(policy, repeats), sync, f"moetrain profile --rl-out, the policy of {model_cfg.name}")


def process_cpu_seconds() -> float:
    """CPU-seconds this process has run so far, every thread of it (gloo's and the push's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class RankUsage:
    """What a rank's process used over its run: CPU time and the threads it ran."""

    cpu_s: float
    """CPU-seconds of every thread of the process, from its fork on."""
    intra_op_threads: int
    """torch's intra-op threads (the runs set one per process)."""
    inter_op_threads: int
    os_threads: int
    """Threads of the process at its end (gloo's among them: they wait, blocked, for messages)."""
    voluntary_switches: int
    """Times the process gave up its core to wait (a receive, a collective, a lock)."""
    involuntary_switches: int
    """Times the kernel took its core away for another process (time-slicing)."""


def rank_usage() -> RankUsage:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return RankUsage(process_cpu_seconds(), torch.get_num_threads(), torch.get_num_interop_threads(),
                     len(list(Path("/proc/self/task").iterdir())), usage.ru_nvcsw, usage.ru_nivcsw)


def stalesync_with_cpu(rank: int, world_size: int, job: StaleSyncJob) -> tuple[object, RankUsage]:
    """``run_stalesync`` as ``spawn``'s entry, with what its rank's process used (a forked rank's counts
    start at its fork)."""
    report = run_stalesync(rank, world_size, job)
    return report, rank_usage()


def run_cpu_seconds(job: StaleSyncJob) -> list[float]:
    """CPU-seconds of each rank's process over a whole StaleSync run of ``job`` (by rank)."""
    return [usage.cpu_s for _, usage in spawn(stalesync_with_cpu, job.roles.world_size, job)]


ROLE_CPU_SHORT_STEPS = 4
"""The shorter of the role probe's two runs: its steps."""


@dataclass(frozen=True)
class RoleCPUProbe:
    """Each process's CPU-seconds over two runs of the job, its roles apart (k = 0), and what a step costs
    each (``role_cpu``)."""

    steps: tuple[int, int]
    """The two runs' steps."""
    cpu_s: tuple[tuple[float, ...], tuple[float, ...]]
    """Each run's CPU-seconds per process, by rank."""
    role_cpu: RoleCPU
    """Per step: (the long run's − the short run's) / (their difference in steps), by process."""


def check_probe_steps(probe: str, steps: int, short_steps: int = ROLE_CPU_SHORT_STEPS) -> None:
    """Refuse a job too short for a CPU probe's two runs (``per_step_cpu``), before any probe runs."""
    if not 0 < short_steps < steps:
        raise UserError(f"the {probe} CPU probe needs a job of more than {short_steps} steps (got {steps}); "
                        "give the job more steps")


RunCPU = tuple[float, ...]
"""One run's CPU-seconds, by rank."""


def per_step_cpu(cpu_of_run: Callable[[int], RunCPU], steps: tuple[int, int]) -> tuple[tuple[RunCPU, RunCPU], RunCPU]:
    """(each run's CPU-seconds by rank, what a step costs each rank): ``cpu_of_run(n)`` runs the job for n
    steps. A run's start (fork, model, process groups) and its end (the final evaluation) cost the same
    whatever its steps, so the difference of the two runs, over the steps between, is what a step costs."""
    short, long = (cpu_of_run(count) for count in steps)
    per_step = tuple((b - a) / (steps[1] - steps[0]) for a, b in zip(short, long, strict=True))
    return (short, long), per_step


def check_role_cpu_job(roles: Roles, steps: int, short_steps: int = ROLE_CPU_SHORT_STEPS) -> None:
    """Refuse a job ``role_cpu`` cannot split into its processes' work per step (before any probe runs)."""
    if roles.ranks_per_replica != 1 or roles.world_size != roles.rollout_ranks + len(roles.trainer_group):
        raise UserError("the role CPU probe measures one-rank replicas beside the trainer group, with no reward "
                        "or reference worker; probe such a job")
    check_probe_steps("role", steps, short_steps)


def role_cpu(job: StaleSyncJob, short_steps: int = ROLE_CPU_SHORT_STEPS) -> RoleCPUProbe:
    """Each process's CPU-seconds per step of a disaggregated job (one-rank replicas) while its roles do not
    overlap: the job at k = 0, where the replicas generate and then the trainer ranks train, never more
    processes running than the replicas or the trainer group; a run of ``short_steps`` and one of the job's
    steps, differenced (``per_step_cpu``)."""
    roles = job.roles
    steps = (short_steps, job.spec.training.steps)
    check_role_cpu_job(roles, steps[1], short_steps)
    apart = replace(job, stale=job.stale.model_copy(update={"staleness": 0}))

    def cpu_of_run(count: int) -> RunCPU:
        training = job.spec.training.model_copy(update={"steps": count})
        return tuple(run_cpu_seconds(replace(apart, spec=job.spec.model_copy(update={"training": training}))))

    runs, per_step = per_step_cpu(cpu_of_run, steps)
    replicas = roles.rollout_ranks
    return RoleCPUProbe(steps, runs, RoleCPU(per_step[:replicas], per_step[replicas:]))


@dataclass(frozen=True)
class RankCPUProbe:
    """Each rank's CPU-seconds over two runs of a colocated job, and what a step costs each (``rank_cpu``)."""

    steps: tuple[int, int]
    """The two runs' steps."""
    cpu_s: tuple[tuple[float, ...], tuple[float, ...]]
    """Each run's CPU-seconds per rank, by rank."""
    rank_cpu: RankCPU
    """Per step: (the long run's − the short run's) / (their difference in steps), by rank."""


def colocated_with_cpu(rank: int, world_size: int, spec) -> RankUsage:
    """One rank of the colocated job ``spec`` (an ``RLRunSpec``) as ``moetrain rl``'s worker runs it, as
    ``spawn``'s entry; what its process used (a forked rank's counts start at its fork)."""
    from moetrain.rl.worker import run_rank  # the RL runtime's rank: only a colocated probe runs it

    run_rank(spec, rank)
    return rank_usage()


def rank_cpu(spec, short_steps: int = ROLE_CPU_SHORT_STEPS) -> RankCPUProbe:
    """Each rank's CPU-seconds per step of the colocated job ``spec`` (an ``RLRunSpec``), run as it is, at its
    own k. Its ranks share the CPU's cores in every phase (at k = 0 all generate, then all train; at k ≥ 1
    each generates beside its update), so there are no roles to keep apart: time-slicing stretches their wall
    time, not their CPU time. A run of ``short_steps`` and one of the job's steps, differenced
    (``per_step_cpu``)."""
    from moetrain.rl.run import build_rl_run  # the RL runtime's spec: only a colocated probe needs it

    steps = (short_steps, spec.trainer.training.steps)
    check_probe_steps("rank", steps[1], short_steps)
    world_size = build_rl_run(spec).grpo.world_size

    def cpu_of_run(count: int) -> RunCPU:
        training = spec.trainer.training.model_copy(update={"steps": count})
        counted = spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"training": training})})
        return tuple(usage.cpu_s for usage in spawn(colocated_with_cpu, world_size, counted))

    runs, per_step = per_step_cpu(cpu_of_run, steps)
    staleness = spec.stalesync.staleness if spec.stalesync is not None else 0
    return RankCPUProbe(steps, runs, RankCPU(per_step, staleness))
