"""How long a checkpoint save stalls training, synchronous vs ``--async-save`` (issue 40, item 2).

One process, the trainer's own ``CheckpointSaver`` (DCP write, every file's SHA-256, the ``COMPLETE`` marker,
the rename, ``--keep-last 1``), on a state shaped as training keeps it: fp32 weights and two AdamW moments,
12 bytes per parameter, in tensors of about 16M elements. Between saves a stand-in for the optimizer step
updates every tensor in place (so the host copy of an asynchronous save must be taken before it returns).
A step also computes (matrix products) until it has taken ``--step-seconds``, as a large model's step
does. Each mode saves ``--saves`` times, every ``--steps-between`` steps; the figure is the stall per save, the
wall time the step loop spent inside ``save``: for sync the whole write, for async the wait for the previous
write (if still running) plus the host copy. Also recorded: the step time while a background write runs,
against the step time without one (the write competes for the cores and the disk).

The full 1.5B-parameter state (18 GB, 36 GB with the host copy) does not fit this 23 GB machine beside the
other work on it; ``--params`` sets the size (default 250M parameters: a 3 GB state).

    python benchmarks/checkpoint_stall.py --out benchmarks/results/checkpoint_stall_cpu.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _record import write_result  # noqa: E402

CHUNK = 16 * 2**20
"""Elements per tensor: about a large layer's weight."""


def make_state(params: int) -> dict:
    sizes = [CHUNK] * (params // CHUNK) + ([params % CHUNK] if params % CHUNK else [])
    state: dict = {"model": {}, "optim": {"state": {}}}
    generator = torch.Generator().manual_seed(0)
    for i, size in enumerate(sizes):
        name = f"layer{i}.weight"
        state["model"][name] = torch.randn(size, generator=generator)
        state["optim"]["state"][name] = {"exp_avg": torch.zeros(size), "exp_avg_sq": torch.zeros(size)}
    return state


def training_step(state: dict, seconds: float, work: torch.Tensor) -> None:
    """A stand-in for a step: matrix products until ``seconds`` have passed, then AdamW's in-place update
    of every weight and moment."""
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        work @ work
    for name, weight in state["model"].items():
        moments = state["optim"]["state"][name]
        moments["exp_avg"].mul_(0.9).add_(weight, alpha=0.1)
        moments["exp_avg_sq"].mul_(0.999)
        weight.mul_(0.9999)


def run_mode(state: dict, save_dir: Path, async_save: bool, saves: int, steps_between: int,
             step_seconds: float) -> dict:
    import torch.distributed as dist

    from moetrain.train.saver import CheckpointSaver

    group = dist.group.WORLD
    saver = CheckpointSaver(save_dir, group, [0], async_save=async_save, keep_last=1)
    stalls, waits, step_times, busy_steps = [], [], [], []
    step = 0
    work = torch.randn(256, 256)
    try:
        for _ in range(saves):
            for _ in range(steps_between):
                writing = saver._pending is not None and not saver._pending.done.done()
                start = time.perf_counter()
                training_step(state, step_seconds, work)
                (busy_steps if writing else step_times).append(time.perf_counter() - start)
                step += 1
            _, cost = saver.save(step, state, "benchmark")
            stalls.append(cost.stall_s)
            waits.append(cost.wait_s)
            print(f"{'async' if async_save else 'sync '} save after step {step}: stall {cost.stall_s:.2f} s"
                  + (f" (waited {cost.wait_s:.2f} s for the previous write)" if async_save else ""), flush=True)
        final_wait = saver.finish()
    finally:
        saver.close()
    return {"stall_s": stalls, "median_stall_s": statistics.median(stalls), "wait_s": waits,
            "final_wait_s": final_wait, "median_step_s": statistics.median(step_times) if step_times else None,
            "median_step_while_writing_s": statistics.median(busy_steps) if busy_steps else None,
            "steps_while_writing": len(busy_steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=250e6, help="parameters (the state is 12 bytes each)")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--steps-between", type=int, default=5)
    parser.add_argument("--step-seconds", type=float, default=2.0, help="compute per step before its update")
    parser.add_argument("--dir", help="where to write the checkpoints (default: a temporary folder)")
    parser.add_argument("--out", default="benchmarks/results/checkpoint_stall_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from moetrain.distributed.world import join_world

    params = int(args.params)
    state = make_state(params)
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    print(f"state: {params / 1e6:,.0f}M parameters, {state_bytes / 2**30:.2f} GiB (weights + 2 moments, fp32)")
    root = Path(args.dir or tempfile.mkdtemp(prefix="moetrain-stall-"))
    modes = {}
    with join_world(torch.device("cpu")):
        for name, async_save in (("sync", False), ("async", True)):
            folder = root / name
            shutil.rmtree(folder, ignore_errors=True)
            modes[name] = run_mode(state, folder, async_save, args.saves, args.steps_between, args.step_seconds)
            shutil.rmtree(folder, ignore_errors=True)
    sync, asynchronous = modes["sync"]["median_stall_s"], modes["async"]["median_stall_s"]
    print(f"median stall per save: sync {sync:.2f} s, async {asynchronous:.2f} s ({sync / asynchronous:.1f}× less)")
    write_result(args.out, {
        "params": params, "state_bytes": state_bytes, "saves": args.saves, "steps_between": args.steps_between,
        "step_seconds": args.step_seconds,
        "threads": torch.get_num_threads(), "note": "a shared 2-core machine: medians; rerun on a quiet one",
        "modes": modes, "stall_ratio_sync_over_async": sync / asynchronous,
    })


def _tensors(state):
    if isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, torch.Tensor):
        yield state


if __name__ == "__main__":
    main()
