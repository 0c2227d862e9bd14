"""What progress counting costs a rank of a multi-rank rollout replica (``moetrain.rl.replica_progress``).

Every rank of a replica of several ranks writes its count to the run's store once per forward of its
generation model (the prefill and each decode step), once per batch it starts and once per weight version
it receives, so that a rank that gives up can name the one that stopped. This measures that as counts and
a time, on this machine:

- **writes per batch**: the 4-layer policy of rl_stalesync.py / rl_scale.py (tiny-pangu without MTP)
  generates one replica's rows of a sort batch with the rollout engine, its forwards counted by a
  ``ReplicaProgress`` on an in-process store, as a replica rank counts them; plus the batch's start and one
  weight version (a k = 1 run receives one per batch);
- **seconds per store write**: ``--writes`` ``set`` calls from a ``TCPStore`` client to a ``TCPStore`` server
  in this process, as a rank writes to rank 0's store thread over loopback, the median of ``--repeats``
  timings. A ``set`` returns once sent, without the server's answer (what the counting rank waits for);
  ``set_delivered`` adds one ``get`` after the calls, which returns once the server has taken them all, and
  ``add`` waits for its answer every call: the two bound the server's side;
- **a decode step**: the same generation's wall time per forward, in one process of one thread. A rank of a
  TP or EP replica adds its collectives to each step, so this is the shortest step a counting rank takes and
  the share below the largest.

The share is writes per batch × seconds per write over the batch's generation time. The machine is shared and
was loaded when this ran (``load_average_1min`` is recorded): every time here is a loaded-machine figure.

    python benchmarks/rl_progress_cost.py --out benchmarks/results/rl_progress_cost_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from _record import write_result

from moetrain.models.transformer import build_model
from moetrain.rl.config import GRPOConfig, RLOptions
from moetrain.rl.fusion import sample_generators
from moetrain.rl.generate import RolloutEngine, SamplingParams
from moetrain.rl.loop import step_problems
from moetrain.rl.rates import policy_model
from moetrain.rl.replica_progress import KEY, ReplicaProgress
from moetrain.rl.roles import Roles
from moetrain.rl.sft import prompt_ids
from moetrain.rl.tasks import get_task
from moetrain.rl.tokenizer import CharTokenizer

LAYERS = 4
ROLES = Roles(replicas=2, trainer_ranks=2, ranks_per_replica=2, replica_tp=2)
"""Two replicas of two ranks each beside a trainer group of two: rank 0 counts (a replica rank)."""


def store_write_s(writes: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of ``writes`` ``set`` and ``add`` calls from a TCPStore client to a server in this
    process, each timing repeated ``repeats`` times."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    key = KEY.format(rank=0)
    times: dict[str, list[float]] = {"set": [], "set_delivered": [], "add": []}
    for _ in range(repeats):
        start = time.perf_counter()
        for count in range(writes):
            client.set(key, str(count))
        times["set"].append((time.perf_counter() - start) / writes)
        # a set is sent without waiting for the server's answer; one get after the sets waits until the server
        # has taken them all (one connection, in order): the writes' cost with the server's side
        start = time.perf_counter()
        for count in range(writes):
            client.set(key, str(count))
        assert client.get(key) == str(writes - 1).encode()
        times["set_delivered"].append((time.perf_counter() - start) / writes)
        start = time.perf_counter()
        for _ in range(writes):
            client.add("moetrain/bench/add", 1)
        times["add"].append((time.perf_counter() - start) / writes)
    del client, server
    return times


def generation(rows: int, max_new_tokens: int, repeats: int) -> dict:
    """One replica rank's generation of ``rows`` rows of a sort batch, its forwards counted as a replica rank
    counts them, and its wall time per forward (the fastest of ``repeats``)."""
    task, tokenizer, cpu = get_task("sort"), CharTokenizer(), torch.device("cpu")
    model = build_model(policy_model(LAYERS), cpu, seed=0).eval().requires_grad_(False)
    progress = ReplicaProgress(dist.HashStore(), 0, ROLES)
    progress.watch(model)
    engine = RolloutEngine(model, tokenizer.pad_id, tokenizer.decode)
    options = RLOptions(task="sort", prompts_per_step=max(rows // 8, 1), grpo=GRPOConfig(group_size=8))
    prompts = [prompt_ids(tokenizer, p) for p in step_problems(task, options, 0, 0)[:rows]]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, stop_token_ids=(tokenizer.eos_id,))
    engine.generate(prompts, params, sample_generators(0, 0, rows, cpu))  # warm-up
    walls, forwards = [], []
    for _ in range(repeats):
        before = progress.count
        start = time.perf_counter()
        engine.generate(prompts, params, sample_generators(0, 0, rows, cpu))
        walls.append(time.perf_counter() - start)
        forwards.append(progress.count - before)
    best = min(range(repeats), key=walls.__getitem__)
    return {"rows": rows, "max_new_tokens": max_new_tokens, "forwards_per_batch": forwards[best],
            "generation_s": walls[best], "generation_s_repeats": walls,
            "decode_step_s": walls[best] / forwards[best]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=2000, help="store calls per timing")
    parser.add_argument("--repeats", type=int, default=7, help="timings of each; the median is reported")
    parser.add_argument("--rows", type=int, default=64, help="rows one replica generates (rl_scale: 128 / 2)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", default="benchmarks/results/rl_progress_cost_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    times = store_write_s(args.writes, args.repeats)
    write_s = {kind: statistics.median(values) for kind, values in times.items()}
    gen = generation(args.rows, args.max_new_tokens, args.repeats)
    # a batch: its forwards, its start, one weight version (k = 1 receives one per batch)
    writes = gen["forwards_per_batch"] + 2
    share = writes * write_s["set"] / gen["generation_s"]
    delivered = writes * write_s["set_delivered"] / gen["generation_s"]
    print(f"store set {write_s['set'] * 1e6:.1f} µs, delivered {write_s['set_delivered'] * 1e6:.1f} µs, add "
          f"{write_s['add'] * 1e6:.1f} µs (median of {args.repeats} × "
          f"{args.writes}); {writes} writes per batch ({gen['forwards_per_batch']} forwards + start + sync); "
          f"a decode step {gen['decode_step_s'] * 1e3:.2f} ms; writes {share * 100:.3f} % of the batch's generation "
          f"({delivered * 100:.3f} % delivered) "
          f"(load average {load:.1f})")
    write_result(args.out, {
        "store_write_s": write_s, "store_write_s_repeats": times, "writes_per_timing": args.writes,
        "writes_per_batch": writes, "generation": gen, "write_share_of_generation": share,
        "delivered_write_share_of_generation": delivered,
        "model": f"tiny-pangu, {LAYERS} layers, no MTP", "threads": 1,
        "load_average_1min_before": load, "load_average_1min_after": os.getloadavg()[0], "cpu_count": os.cpu_count(),
    })


if __name__ == "__main__":
    main()
