"""``moetrain simulate --rl``: the flags of an RL step and its rendering (the pricing is
``moetrain.planner.rl_step``)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from moetrain.cli.workload import build_workload, parallel_from_args
from moetrain.config import limits, load_model_config
from moetrain.errors import UserError

if TYPE_CHECKING:  # the planner's types load when a command runs (lazy imports below)
    from moetrain.planner.rl_rates import RLRates

PLACEMENTS = ("colocated", "disaggregated", "both")


def add_rl_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("RL step (--rl; docs/rl_simulate.md): generation, reward, training, weight "
                                  "transfer for the placements of `moetrain rl`; --tp/--pp/--ep/... are the "
                                  "training layout")
    g.add_argument("--rl", action="store_true", help="price one RL step instead of a pre-training step")
    g.add_argument("--placement", default="both", metavar="{" + ",".join(PLACEMENTS) + "}",
                   help="colocated (RL Fusion switch), disaggregated (StaleSync) or both")
    g.add_argument("--staleness", type=int, default=0,
                   help="StaleSync's K: 0 alternates generation and training, K ≥ 1 overlaps them (disaggregated: "
                        "on separate devices; colocated: the next batch beside each update)")
    add_rl_workload_arguments(g)
    g.add_argument("--rollout-devices", type=int,
                   help="disaggregated: devices that generate; the rest train (default: half)")
    g.add_argument("--gen-ep", type=int, default=1,
                   help="devices per generation replica, experts split over them (1: a whole model each)")


def add_rl_workload_arguments(g) -> None:
    """The RL step's workload (prompts, lengths, extra forwards, reward, generation engine, offload): the
    flags ``moetrain simulate --rl`` and ``moetrain plan --rl`` share."""
    g.add_argument("--prompts", type=int, default=32, help="prompts per step")
    g.add_argument("--group-size", type=int, default=8, help="samples per prompt, G")
    g.add_argument("--prompt-len", type=int, help="prompt tokens per sample")
    g.add_argument("--response-len", type=int, help="generated tokens per sample (the batch's longest answers)")
    g.add_argument("--completion-len", type=float,
                   help="mean generated tokens per sample, where samples stop early: the trainer's head runs on "
                        "them, and its micro-batches, grouped by length and cut to their longest (moetrain rl's "
                        "default), hold about prompt + this many positions per sample (default: --response-len)")
    g.add_argument("--offload", action="store_true",
                   help="colocated: optimizer state and grads to host while generating, and back")
    g.add_argument("--host-link-gbps", type=float,
                   help="host link per device, one way, GB/s (for --offload; default on a CPU: its memory)")
    g.add_argument("--logprob-forwards", type=int, default=0,
                   help="extra forwards over the samples per step: reference (KL), proximal policy")
    g.add_argument("--graphs", action="store_true",
                   help="generation runs captured graphs (an inference engine): no per-MoE-pass host cost")
    g.add_argument("--reward-s", type=float, default=0.0, help="seconds to score a step's samples")
    g.add_argument("--rl-rates", default=None, metavar="FILE",
                   help="host rates measured by `moetrain profile --rl-out` (generation's host costs, the weight "
                        "sync's copy and CRC-32 rates; with a role_cpu section from --rl-job, a disaggregated "
                        "step at k ≥ 1 is the probed CPU-seconds per process shared over the cores, with a "
                        "rank_cpu section a colocated step the probed CPU-seconds per rank; default: "
                        "none, the device work and the link alone)")


def _check(args: argparse.Namespace) -> None:
    if args.timeline:
        raise UserError("--timeline draws a training step's pipeline schedule; an RL step has none to draw, so "
                        "drop --timeline (or --rl)")
    check_rl_workload(args, positive=("gen_ep",), non_negative=("staleness",))


def check_rl_workload(args: argparse.Namespace, positive: tuple[str, ...] = (),
                      non_negative: tuple[str, ...] = ()) -> None:
    """The checks of ``add_rl_workload_arguments``' flags (and of ``positive`` and ``non_negative`` more)."""
    if args.placement not in PLACEMENTS:
        raise UserError(f"--placement {args.placement!r}: choose one of {', '.join(PLACEMENTS)}")
    given = [f"--{flag.replace('_', '-')}" for flag in ("seq_len", "global_batch") if getattr(args, flag) is not None]
    if given:  # they would be overwritten by the RL sizes below, silently
        raise UserError(f"{' and '.join(given)} size{'s' * (len(given) == 1)} a training step; with --rl the step is "
                        "sized by --prompt-len + --response-len and --prompts × --group-size, so drop "
                        f"{' and '.join(given)}")
    for flag in ("prompt_len", "response_len"):
        if getattr(args, flag) is None:
            raise UserError(f"--rl needs --{flag.replace('_', '-')} (tokens per sample)")
    for flag in ("prompts", "group_size", "prompt_len", "response_len", "devices", *positive):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise UserError(f"--{flag.replace('_', '-')} must be positive (got {getattr(args, flag)})")
    if args.completion_len is not None and not 0 < args.completion_len <= args.response_len:
        raise UserError(f"--completion-len {args.completion_len:g} must be in (0, --response-len {args.response_len}]: "
                        "the mean of the samples' generated tokens")
    for flag in ("logprob_forwards", "reward_s", *non_negative):
        if getattr(args, flag) < 0:
            raise UserError(f"--{flag.replace('_', '-')} cannot be negative (got {getattr(args, flag)})")
    if args.host_link_gbps is not None and args.host_link_gbps <= 0:
        raise UserError(f"--host-link-gbps must be positive (got {args.host_link_gbps})")


def _layouts(args: argparse.Namespace, workload) -> list:
    """The ``RLLayout`` of each asked placement (the training layout from the strategy flags)."""
    from moetrain.planner.rl_step import RLLayout  # lazy: the RL pricing loads when the command runs

    training = workload.samples_workload
    placements = ("colocated", "disaggregated") if args.placement == "both" else (args.placement,)
    if args.offload and args.host_link_gbps is None and workload.cluster.device != "cpu":
        raise UserError("--offload on an accelerator needs --host-link-gbps (the host link, e.g. 25 for PCIe 4 x16)")
    layouts = []
    for placement in placements:
        rollout = 0
        if placement == "disaggregated":
            rollout = args.rollout_devices if args.rollout_devices is not None else args.devices // 2
            if not 0 < rollout < args.devices:
                raise UserError(f"--rollout-devices {rollout} must leave devices to train and to generate "
                                f"(1 to {args.devices - 1} of --devices {args.devices})")
        try:
            parallel = parallel_from_args(args, training, args.devices - rollout)
        except UserError as exc:  # the batch is the step's samples here, not a flag of its own
            raise UserError(f"{placement} training on {args.devices - rollout} devices: "
                            + str(exc).replace("--global-batch", "--prompts × --group-size =")) from None
        layouts.append(RLLayout(placement, args.devices, parallel, args.gen_ep, rollout,
                                args.staleness, args.offload,
                                args.host_link_gbps))
    return layouts


def _check_sample_sizes(args: argparse.Namespace) -> None:
    """What ``build_workload`` checks of --seq-len and --global-batch, named by the flags an RL step has:
    a sample is its prompt and response, a step's batch --prompts × --group-size samples."""
    model = load_model_config(args.model)
    sample = f"--prompt-len {args.prompt_len} + --response-len {args.response_len}"
    tokens = args.prompt_len + args.response_len
    if tokens > model.max_seq_len:
        raise UserError(f"{sample} = {tokens:,} tokens per sample, beyond {model.name}'s max_seq_len "
                        f"{model.max_seq_len} (its rotary range); lower --response-len or --prompt-len")
    limits.check_step_tokens(args.prompts * args.group_size * tokens, f"--prompts {args.prompts} × --group-size "
                             f"{args.group_size} samples × {tokens:,} tokens", "lower --prompts or --group-size")


def build_rl_workload(args: argparse.Namespace):
    """(the ``RLWorkload`` of the flags, the calibration to price it with)."""
    from moetrain.planner.rl_step import RLWorkload  # lazy: as above

    _check_sample_sizes(args)
    args.seq_len = args.prompt_len + args.response_len
    args.global_batch = args.prompts * args.group_size
    base, calibration = build_workload(args)
    trained = None if args.completion_len is None else args.prompt_len + math.ceil(args.completion_len)
    workload = RLWorkload(base.model, base.cluster, args.prompts, args.group_size, args.prompt_len,
                          args.response_len, base.precision, args.logprob_forwards, args.reward_s,
                          train_seq_len=trained, completion_len=args.completion_len)
    return workload, calibration


def simulate_rl(args: argparse.Namespace) -> dict:
    """The predictions as a plain mapping (what --json prints)."""
    # lazy: the RL pricing loads when the command runs, not when the parser imports every command module
    from moetrain.planner.rl_step import price_rl_step

    _check(args)
    workload, calibration = build_rl_workload(args)
    rates = measured_rates(args)
    layouts = [rates.on(layout) for layout in _layouts(args, workload)]
    predictions = [price_rl_step(workload, layout, calibration, rates.host, rates.sync) for layout in layouts]
    rows = [{**{k: v for k, v in asdict(p).items() if k != "phases"}, "phases_s": asdict(p.phases),
             "shared_cores": layout.shared_cores}
            for p, layout in zip(predictions, layouts, strict=True)]
    return {
        "model": workload.model.name, "cluster": workload.cluster.name, "devices": args.devices,
        "prompts": args.prompts, "group_size": args.group_size, "prompt_len": args.prompt_len,
        "response_len": args.response_len, "completion_len": args.completion_len, "precision": workload.precision,
        "graphs": args.graphs,
        "training_layout": _layouts_text(args),
        "predictions": rows,
        "faster": min(rows, key=lambda r: r["step_s"])["placement"],
    }


def measured_rates(args: argparse.Namespace) -> RLRates:
    """The rates of ``--rl-rates`` and ``--graphs``, read alike for ``simulate --rl`` and ``plan --rl`` (no file:
    none measured, the device work and the link alone, every step by its phases)."""
    # lazy: the RL pricing loads when the command runs, not when the parser imports every command module
    from moetrain.planner.generation import HostCosts
    from moetrain.planner.rl_rates import RLRates, load_rl_rates

    if args.rl_rates is None:
        return RLRates(HostCosts(moe_pass_us=0.0 if args.graphs else None))
    rates = load_rl_rates(args.rl_rates)
    return replace(rates, host=replace(rates.host, moe_pass_us=0.0)) if args.graphs else rates


def step_model_text(step_model: str, shared_cores: float | None, placement: str = "disaggregated") -> str:
    """What priced a step, in words (``RLStepPrediction.step_model``): what ``simulate --rl`` and ``plan --rl``
    print."""
    from moetrain.planner.rl_step import SHARED_CPU_MODEL  # lazy: as above

    if step_model == SHARED_CPU_MODEL and placement == "colocated":
        return (f"processor sharing of the probed CPU-seconds per rank over {shared_cores:g} cores "
                "(planner.rl_cores; --rl-rates' rank_cpu)")
    if step_model == SHARED_CPU_MODEL:
        return (f"processor sharing of the probed CPU-seconds per process over {shared_cores:g} cores "
                "(planner.rl_cores; --rl-rates' role_cpu)")
    return "the priced phases"


def _layouts_text(args: argparse.Namespace) -> str:
    return f"tp{args.tp} pp{args.pp} ep{args.ep} etp{args.etp} cp{args.cp} zero{args.zero} mb{args.micro_batch}"


PHASE_NAMES = {"generate_s": "generate (prefill + decode)", "reward_s": "reward", "logprob_s": "log-prob forwards",
               "train_s": "train", "offload_s": "offload", "reshard_s": "reshard", "restore_s": "restore",
               "push_s": "weight push", "gather_s": "rows gathered"}


def run_rl(args: argparse.Namespace) -> int:
    from moetrain.planner.rl_step import PHASES_MODEL  # lazy: as above

    result = simulate_rl(args)
    if args.json:
        print(json.dumps(result, indent=2, default=float))
        return 0
    print(f"RL step of {result['model']} on {result['devices']} × {result['cluster']}: {result['prompts']} prompts × "
          f"{result['group_size']} samples, {result['prompt_len']} + {result['response_len']} tokens; training "
          f"{result['training_layout']}")
    for row in result["predictions"]:
        shown = row["placement"] == "disaggregated" or row["staleness"] > 0
        name = row["placement"] + (f", k = {row['staleness']}" if shown else "")
        split = (f"{row['generating_devices']} generate ({row['replicas']} replicas), {row['train_devices']} train"
                 if row["placement"] == "disaggregated" else f"all {row['devices']} devices, {row['replicas']} "
                 "generation replicas")
        print(f"\n{name}: {split}")
        print(f"  step {row['step_s']:.4g} s   {row['generated_tokens_per_s']:.4g} generated tokens/s   "
              f"{row['tokens_per_s']:.4g} tokens/s   decode {'memory' if row['decode_memory_bound'] else 'compute'}"
              f"-bound{'' if row['train_fits_memory'] else '   TRAINING DOES NOT FIT'}")
        below = " below" if row["step_model"] == PHASES_MODEL else ""  # the phases follow
        print(f"  step model: {step_model_text(row['step_model'], row['shared_cores'], row['placement'])}{below}")
        for key, label in PHASE_NAMES.items():
            if row["phases_s"][key] > 0:
                print(f"  {label:32s} {row['phases_s'][key]:10.4g} s")
    if len(result["predictions"]) > 1:
        print(f"\nfaster: {result['faster']}")
    return 0
