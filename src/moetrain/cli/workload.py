"""Flags and input checks shared by ``moetrain simulate`` and ``moetrain plan`` (torch-free): they turn
the command line into the planner's inputs (``Workload``, ``ParallelConfig``), so the planner never sees
argparse."""

from __future__ import annotations

import argparse

from moetrain.cli.common import add_cluster_arg, add_model_arg
from moetrain.cli.parsing import add_renamed_flag
from moetrain.config import ParallelConfig, limits, load_cluster_config, load_model_config
from moetrain.errors import UserError
from moetrain.planner.calibration import Calibration, load_calibration
from moetrain.planner.documents import DocumentPacking
from moetrain.planner.workload import Workload, runtime_workload

PRECISIONS = ("bf16", "fp16", "fp8", "fp32")


def add_workload_args(parser: argparse.ArgumentParser, batch_required: bool = True) -> None:
    """``batch_required=False``: --seq-len and --global-batch may be left out (``simulate --rl`` derives
    them from the RL step); the command checks them itself otherwise (``require_batch``)."""
    add_model_arg(parser)
    add_cluster_arg(parser)
    g = parser.add_argument_group("workload")
    g.add_argument("--devices", type=int, required=True, help="number of accelerators in the job")
    needed = "" if batch_required else " (required, except with --rl, which derives it from the RL step)"
    g.add_argument("--seq-len", type=int, required=batch_required, help="tokens per sequence" + needed)
    g.add_argument("--global-batch", type=int, required=batch_required, help="sequences per optimizer step" + needed)
    dtype = g.add_argument("--dtype", choices=PRECISIONS, default="bf16",
                           help="GEMM precision (fp8: linear layers only)")
    add_renamed_flag(g, "--precision", dtype)
    g.add_argument("--imbalance", type=float, default=1.0,
                   help="routed-token load of the hottest EP rank over the mean (1.0 = balanced)")
    g.add_argument("--calibration", help="efficiency file from `moetrain profile` or `moetrain validate --fit` "
                   "(default: the shipped fit on published runs)")
    g.add_argument("--comm-overlap", default="", metavar="TP,DP",
                   help="traffic the training stack states it overlaps with compute: TP (collectives fused with "
                   "the GEMMs: Transformer Engine userbuffers, AsyncTP, MindSpeed MC2), DP (gradient reduction "
                   "and weight gathers under the passes); priced with its whole window instead of the fitted "
                   "shares, as validate prices a row whose source states it (default: none stated)")
    g.add_argument("--document-tokens", type=float, default=None, metavar="L",
                   help="the sequences are packed from documents of L tokens on average that attention must not "
                   "cross (this project's data loader): the rows holding a boundary run their attention again "
                   "under the document mask, priced as --document-mask says (default: one stream, plain causal)")
    g.add_argument("--document-mask", choices=("block", "dense"), default=None,
                   help="with --document-tokens, how the mask reaches the kernel, as `moetrain train "
                   "--document-mask` says: block (FlexAttention tiles, compiled CUDA layers) or dense (a boolean "
                   "mask; the fused kernel computes the whole square) (default: block on accelerators, dense on a "
                   "CPU, as the runtime's auto)")
    g.add_argument("--split-wgrad", action="store_true",
                   help="the stack computes weight gradients apart from input gradients and runs them under the "
                   "expert all-to-all (Megatron-Core --delay-wgrad-compute, MindSpeed --moe-fb-overlap, DualPipe): "
                   "a warm-up or cool-down pass hides at least half of its own exchange, as validate prices a row "
                   "whose source names such a schedule")


def comm_overlap(text: str) -> tuple[str, ...]:
    """``--comm-overlap TP,DP`` as the sorted kinds ``Workload.comm_overlap_stated`` takes, refused in one
    line when a kind is not TP or DP."""
    kinds = sorted({part.strip().upper() for part in text.split(",") if part.strip()})
    unknown = [k for k in kinds if k not in ("TP", "DP")]
    if unknown:
        raise UserError(f"--comm-overlap {text}: {', '.join(unknown)} is not TP or DP; give e.g. --comm-overlap TP,DP")
    return tuple(kinds)


def require_batch(args: argparse.Namespace) -> None:
    """The one-line error argparse would give for a missing --seq-len or --global-batch."""
    missing = [f"--{name.replace('_', '-')}" for name in ("seq_len", "global_batch") if getattr(args, name) is None]
    if missing:
        raise UserError(f"the following arguments are required: {', '.join(missing)} (or --rl for an RL step)")


def document_packing(args: argparse.Namespace, host_is_device: bool) -> DocumentPacking | None:
    """--document-tokens and --document-mask as the workload's ``documents``, refused in one line when
    the length is not positive or the mask comes without it."""
    tokens, mask = getattr(args, "document_tokens", None), getattr(args, "document_mask", None)
    if tokens is None:
        if mask is not None:
            raise UserError(f"--document-mask {mask} prices packed documents: add --document-tokens L, their mean "
                            "length in tokens")
        return None
    if not tokens > 0:
        raise UserError(f"--document-tokens is a mean document length in tokens and must be positive (got {tokens})")
    return DocumentPacking(tokens, mask or ("dense" if host_is_device else "block"))


def build_workload(args: argparse.Namespace) -> tuple[Workload, Calibration]:
    """The workload the flags describe and the calibration to price it with (``for_device`` of its
    cluster gives the efficiencies; its ``accuracy`` is what simulate and plan print)."""
    for name in ("devices", "seq_len", "global_batch"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive (got {getattr(args, name)})")
    if args.imbalance < 1.0:
        raise UserError(f"--imbalance is max/mean load and cannot be below 1.0 (got {args.imbalance})")
    limits.check_devices(args.devices)
    model = load_model_config(args.model)
    limits.check_seq_len(args.seq_len, model.max_seq_len, model.name)
    limits.check_batch_tokens(args.global_batch, args.seq_len)
    # ranks on one host share its cores and memory (the ``cpu`` cluster); other devices are their own
    cluster = load_cluster_config(args.cluster)
    cluster = cluster.for_ranks(min(args.devices, cluster.devices_per_node))
    calibration = load_calibration(args.calibration)
    stated = comm_overlap(getattr(args, "comm_overlap", ""))
    documents = document_packing(args, cluster.host_is_device)
    split_wgrad = bool(getattr(args, "split_wgrad", False))
    if cluster.host_is_device:
        if stated:
            raise UserError("--comm-overlap prices a published stack on accelerators; this project's runtime on "
                            "a CPU overlaps no TP or DP traffic, drop the flag")
        if split_wgrad:
            raise UserError("--split-wgrad prices a published stack on accelerators; this project's runtime "
                            "computes weight and input gradients together, drop the flag")
        # CPU ranks run on gloo, which only this project's runtime drives: price it as it trains
        asked = Workload(model, cluster, args.seq_len, args.global_batch, args.dtype, args.imbalance,
                         documents=documents)
        workload = runtime_workload(asked)
    else:
        # accelerators: the published stacks' semantics the shipped fit was made on (Megatron-Core-like
        # overlap and collectives)
        workload = Workload(model, cluster, args.seq_len, args.global_batch, args.dtype, args.imbalance,
                            grad_bytes=2.0 if args.dtype == "fp16" else 4.0, comm_overlap_stated=stated,
                            split_weight_grad=split_wgrad, documents=documents)
    return workload, calibration


def parallel_from_args(args: argparse.Namespace, workload: Workload, devices: int) -> ParallelConfig:
    """The strategy flags as a validated ``ParallelConfig``; dp is what remains of the devices."""
    tp, pp, cp = args.tp, args.pp, args.cp
    if min(tp, pp, cp, args.vpp, args.ep, args.etp, args.micro_batch) <= 0:
        raise UserError("parallel sizes and --micro-batch must be positive")
    if devices % (tp * pp * cp):
        raise UserError(f"--devices {devices} is not divisible by tp·pp·cp = {tp * pp * cp}; "
                        "pick sizes whose product divides the device count")
    dp = devices // (tp * pp * cp)
    if workload.global_batch % (dp * args.micro_batch):
        raise UserError(f"--global-batch {workload.global_batch} is not a multiple of dp·micro-batch = "
                        f"{dp}·{args.micro_batch}; change the batch or the layout")
    if args.recompute not in ("none", "selective", "full"):
        raise UserError(f"--recompute {args.recompute!r}: the simulator knows none, selective and full")
    moe = workload.model.moe
    if moe is not None and moe.num_experts % args.ep:
        raise UserError(f"--ep {args.ep} does not divide the {moe.num_experts} experts")
    if workload.model.num_layers < pp * args.vpp:
        raise UserError(f"pp·vpp = {pp * args.vpp} exceeds the model's {workload.model.num_layers} layers")
    if workload.seq_len % cp:
        raise UserError(f"--seq-len {workload.seq_len} is not divisible by --cp {cp}")
    sp = args.sp if args.sp is not None else tp > 1
    try:
        return ParallelConfig(tp=tp, sp=sp, pp=pp, vpp=args.vpp, ep=args.ep, etp=args.etp, cp=cp, dp=dp,
                              zero=args.zero, micro_batch=args.micro_batch, recompute=args.recompute,
                              a2a=args.a2a, overlap=args.overlap)
    except ValueError as exc:
        # the validator's own line (newer pydantic ends the message with a link line)
        lines = [line for line in str(exc).splitlines() if line.strip().startswith("Value error, ")]
        line = (lines[0] if lines else str(exc).splitlines()[-1]).strip().removeprefix("Value error, ")
        raise UserError(line.split(" [type=")[0]) from None
