"""One rank of a distributed run: what ``torchrun`` starts (``python -m moetrain.distributed.worker``).

The layout comes from the flags (or a plan file) and was validated by the launcher before any
process started. The data are the single-process trainer's (default corpus or ``--data``, same
tokenizer and packing; ``--synthetic-data``: counting sequences), the loop and its metrics, routing
trace and checkpoints are ``moetrain.distributed.training``'s. Rank 0 prints one line per step.
A rank that raises writes one line, naming itself and the cause, to ``$MOETRAIN_ERROR_DIR/rank<R>.txt``
and exits non-zero; torchrun (``--max-restarts 0``) then stops every other rank, and the launcher
prints that line.

``MOETRAIN_FAULT=rank:step:raise|kill`` injects a failure (tests of the failure path).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moetrain.distributed.worker")
    parser.add_argument("--model", default="tiny-pangu")
    for axis in ("tp", "pp", "vpp", "ep", "etp", "cp", "dp"):
        parser.add_argument(f"--{axis}", type=int, default=1)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--a2a", choices=["flat", "hierarchical"], default="flat")
    parser.add_argument("--ranks-per-node", type=int)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--lr", type=float, help="peak learning rate (default: TrainingConfig's)")
    parser.add_argument("--warmup", type=int,
                        help="warm-up steps (default: TrainingConfig's; with --synthetic-data min(20, steps/5))")
    parser.add_argument("--data", help="the user's .txt/.jsonl file or folder; default: the embedded corpus")
    parser.add_argument("--synthetic-data", action="store_true", help="counting sequences instead of a corpus")
    parser.add_argument("--metrics-out")
    parser.add_argument("--trace-routing", help="rank 0 writes the global tokens per expert, per step and MoE layer")
    parser.add_argument("--save-dir")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--cluster", help="cluster preset for MFU (default: cpu on CPU, h100-sxm-80gb on GPU)")
    parser.add_argument("--trace-dir")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--online-balance", action="store_true", help="migrate and replicate experts while training")
    parser.add_argument("--balance-interval", type=int)
    parser.add_argument("--balance-horizon", type=int)
    parser.add_argument("--slots-per-rank", type=int)
    return parser.parse_args(argv)


def _maybe_fault(rank: int, step: int) -> None:
    spec = os.environ.get("MOETRAIN_FAULT")
    if not spec:
        return
    fault_rank, fault_step, kind = spec.split(":")
    if int(fault_rank) == rank and int(fault_step) == step:
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault at step {step}")


def training_config(args: argparse.Namespace):
    """The TrainingConfig of ``moetrain train`` with the same flags (unset flags keep the config's
    defaults), so the config hash and the learning-rate schedule are those of the single-process run."""
    from moetrain.config import TrainingConfig

    overrides = {"steps": args.steps, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
                 "seq_len": args.seq_len, "seed": args.seed}
    if args.lr is not None:
        overrides["lr"] = args.lr
    if args.warmup is not None:
        overrides["warmup_steps"] = args.warmup
    elif args.synthetic_data:
        overrides["warmup_steps"] = min(20, args.steps // 5)  # the synthetic runs' historical schedule
    return TrainingConfig(**overrides)


def _prepare_data(args: argparse.Namespace, rank: int, vocab_size: int, seq_len: int, seed: int):
    """Rank 0 builds (or reads) the cached tokenizer and token stream first; the others then read the
    cache, so no two ranks write the same cache file."""
    import torch.distributed as dist

    from moetrain.data import prepare_data

    data = prepare_data(args.data, vocab_size, seq_len, seed) if rank == 0 else None
    dist.barrier()
    return data if data is not None else prepare_data(args.data, vocab_size, seq_len, seed)


def _train(args: argparse.Namespace, rank: int, device: torch.device) -> None:
    from moetrain.config import ParallelConfig, load_cluster_config, load_model_config
    from moetrain.costs.flops import training_flops_per_token
    from moetrain.distributed import training
    from moetrain.distributed.checkpoint import load_checkpoint, read_expert_placement, save_checkpoint
    from moetrain.distributed.layout import ParallelDims
    from moetrain.distributed.step import build_layout
    from moetrain.distributed.trace import Tracer
    from moetrain.errors import UserError
    from moetrain.train.checkpoint import latest_checkpoint
    from moetrain.train.metrics import MetricsLogger, RoutingTraceWriter

    cfg = training_config(args)
    parallel = ParallelConfig(tp=args.tp, sp=args.sp or args.tp > 1, pp=args.pp, vpp=args.vpp, ep=args.ep,
                              etp=args.etp, cp=args.cp, dp=args.dp, a2a=args.a2a, overlap=args.overlap,
                              micro_batch=cfg.micro_batch)
    model_cfg = load_model_config(args.model)
    save_dir = training.resolve_path(args.save_dir)
    if (args.resume or args.stop_at is not None) and save_dir is None:
        raise UserError("--resume and --stop-at need --save-dir (the folder holding the checkpoints)")
    dims = ParallelDims.build(parallel, rank, args.ranks_per_node)
    dp_rank, dp_size = dims.local_rank("dp"), parallel.dp
    if args.synthetic_data:
        data = None
        config_hash = "synthetic"
        next_batch = lambda step: training.synthetic_step_batch(step, cfg, model_cfg.vocab_size, dp_rank, dp_size)
    else:
        data = _prepare_data(args, rank, model_cfg.vocab_size, cfg.seq_len, cfg.seed)
        config_hash = training.trainer_config_hash(model_cfg, cfg, data)
        next_batch = lambda step: data.dataset.step_batch(step, cfg.global_batch, cfg.micro_batch, dp_rank, dp_size)
    cluster = load_cluster_config(args.cluster or ("h100-sxm-80gb" if device.type == "cuda" else "cpu"))
    balancer = None
    if args.online_balance:  # spare slots, replica-summing optimizer, trigger after every step
        from moetrain.distributed.balancing import build_balanced_run

        tuning = {name: value for name, value in (("interval", args.balance_interval),
                                                  ("horizon", args.balance_horizon)) if value is not None}
        run, balancer = build_balanced_run(dims, model_cfg, cfg, device, cluster, slots_per_rank=args.slots_per_rank,
                                           **tuning)
    else:
        run = build_layout(dims, model_cfg, cfg, device)
    step = 0
    if args.resume:
        path = latest_checkpoint(save_dir)
        if path is not None:
            if balancer is not None:  # adopt the saved placement first: slots then load their experts
                saved = read_expert_placement(path)
                restored = saved is not None and balancer.load_state_dict(saved)
                if rank == 0:
                    print("restored the saved expert placement" if restored else
                          "no expert placement of this EP size in the checkpoint; starting from the contiguous one",
                          flush=True)
            step = load_checkpoint(path, run, model_cfg, config_hash=config_hash)
            if rank == 0:
                print(f"resumed from {path} (step {step})", flush=True)
        elif rank == 0:
            print(f"no checkpoint in {save_dir}; starting from step 0", flush=True)
    layers = training.moe_layer_indices(model_cfg)
    if args.trace_routing and not layers:
        raise UserError(f"--trace-routing needs an MoE model; {model_cfg.name} has no MoE layers")
    peak_flops_total = cluster.peak_flops("bf16") * parallel.world_size
    flops_per_token = float(training_flops_per_token(model_cfg, cfg.seq_len))
    metrics = MetricsLogger(training.resolve_path(args.metrics_out) if rank == 0 else None, resume=args.resume)
    routing = (RoutingTraceWriter(Path(args.trace_routing), layers, resume=args.resume)
               if args.trace_routing and rank == 0 else None)
    last_step = min(cfg.steps, args.stop_at or cfg.steps)
    tracer = Tracer(rank)
    try:
        while step < last_step:
            _maybe_fault(rank, step)
            start = time.perf_counter()
            batch = next_batch(step)
            with tracer.active():
                result = training.data_train_step(run, step, batch, cfg, device, layers)
            step += 1
            decisions = balancer.after_step(step - 1) if balancer is not None else []
            row = training.metrics_row(step, result, batch.global_tokens, time.perf_counter() - start,
                                       flops_per_token, peak_flops_total, parallel, cfg.global_batch)
            if balancer is not None:
                row.update(balancer.step_metrics(decisions))
                if rank == 0:
                    for line in balancer.describe(decisions):
                        print(line, flush=True)
            metrics.log(row)
            if routing is not None:
                routing.write(step, result.tokens_per_expert)
            if rank == 0:
                print(f"step {step - 1} loss {row['loss']:.6f}", flush=True)
            training.check_finite(row["loss"], step)
            if save_dir is not None and training.should_save(step, last_step, args.save_every):
                save_checkpoint(save_dir, step, run, model_cfg, cfg, config_hash=config_hash,
                                expert_placement=balancer.state_dict() if balancer is not None else None)
        if balancer is not None:
            balancer.finish_migration()  # the last step's move, if any, lands before the ranks part
    finally:
        metrics.close()
        if routing is not None:
            routing.close()
    if args.trace_dir:
        tracer.save(Path(args.trace_dir) / f"rank{rank}.json")
        if rank == 0:
            print(f"a2a_hidden_fraction {tracer.a2a_hidden_fraction():.3f} (rank 0, all steps)", flush=True)


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from moetrain.distributed.world import init_world

    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, _, device = init_world(timeout_s=args.timeout_s)
    try:
        _train(args, rank, device)
    except BaseException as exc:  # report every cause, then let torchrun stop the others
        error_dir = os.environ.get("MOETRAIN_ERROR_DIR")
        message = f"rank {rank} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if error_dir:
            Path(error_dir, f"rank{rank}.txt").write_text(message + "\n")
        print(message, file=sys.stderr, flush=True)
        os._exit(1)  # no process-group teardown: peers may already be gone
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
