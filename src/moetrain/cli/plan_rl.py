"""``moetrain plan --rl``: search the RL job (split, rollout replicas and their generation layout, trainer layout,
staleness k; ``moetrain.planner.rl_search``) and write the winner as an ``rl.yaml`` that ``moetrain rl --plan``
runs (docs/rl_plan.md)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from moetrain.cli.common import output_file
from moetrain.cli.simulate_rl import (
    PLACEMENTS,
    add_rl_workload_arguments,
    build_rl_workload,
    check_rl_workload,
    measured_rates,
    step_model_text,
)
from moetrain.config.run import spec_source_from_plan
from moetrain.errors import UserError
from moetrain.rl.spec import resolve_rl_spec

if TYPE_CHECKING:  # the planner's types load when a command runs
    from moetrain.planner.rl_rates import RLRates

DEFAULT_OUT = "rl.yaml"
NOT_RUNNABLE = "not runnable yet: "
"""How the plan file's header comment names what today's ``moetrain rl`` cannot run (``moetrain rl --plan``
refuses the file with the first)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("RL job (--rl; docs/rl_plan.md): search the rollout/training split, the rollout "
                                  "replicas' generation layout, the trainer layout and k; write an rl.yaml")
    g.add_argument("--rl", action="store_true", help="plan an RL job (moetrain rl --plan) instead of pre-training")
    g.add_argument("--placement", default="both", metavar="{" + ",".join(PLACEMENTS) + "}",
                   help="search colocated (RL Fusion), disaggregated (StaleSync) or both")
    g.add_argument("--max-staleness", type=int, default=2, help="search k = 0, 1, …, this")
    g.add_argument("--rollout-devices", type=int, help="fix the disaggregated split (default: searched)")
    g.add_argument("--gen-ep", type=int, help="fix the devices per generation replica (default: searched)")
    g.add_argument("--task", help="the task the rl.yaml names (default: moetrain rl's)")
    add_rl_workload_arguments(g)


def _options(args: argparse.Namespace, workload, rates: RLRates):
    from moetrain.planner.rl_search import RLSearchOptions  # lazy: the RL search loads when the command runs

    if args.offload and args.host_link_gbps is None and workload.cluster.device != "cpu":
        raise UserError("--offload on an accelerator needs --host-link-gbps (the host link, e.g. 25 for PCIe 4 x16)")
    placements = ("colocated", "disaggregated") if args.placement == "both" else (args.placement,)
    return RLSearchOptions(placements=placements, max_staleness=args.max_staleness,
                           rollout_devices=args.rollout_devices, gen_devices_per_replica=args.gen_ep,
                           offload=args.offload, host_link_gbps=args.host_link_gbps,
                           runnable_trainer_only=not args.any_layout, sync=rates.sync, probed_cpu=rates.role_cpu,
                           probed_ranks=rates.rank_cpu)


def plan_rl(args: argparse.Namespace):
    """(the search result, the workload) of the flags."""
    # lazy: the RL search and rich load when the command runs, not when the parser imports every command module
    from moetrain.planner.rl_search import check_options, search_rl
    from moetrain.status import say, status_console

    check_rl_workload(args, positive=("gen_ep", "rollout_devices"), non_negative=("max_staleness",))
    workload, calibration = build_rl_workload(args)
    rates = measured_rates(args)  # the rates simulate --rl prices with, read alike
    options = _options(args, workload, rates)
    check_options(args.devices, options)
    say(status_console(quiet=args.json), f"searching the RL jobs of {workload.model.name} on {args.devices:,} × "
        f"{workload.cluster.name}…")
    result = search_rl(workload, args.devices, calibration, rates.host, options)
    return result, workload


def plan_file(args: argparse.Namespace, candidate) -> dict[str, Any]:
    """The winner as an RL run spec's sections (what ``moetrain rl --plan`` reads)."""
    lay = candidate.layout
    trainer = spec_source_from_plan({"parallel": lay.train.model_dump(), "cluster": args.cluster})
    trainer["parallel"].pop("sp", None)  # the run spec decides it from tp
    cluster = str(Path(args.cluster).resolve()) if Path(args.cluster).is_file() else args.cluster
    trainer["run"] = {"cluster": cluster, **trainer.get("run", {})}
    rl: dict[str, Any] = {"prompts_per_step": args.prompts, "max_new_tokens": args.response_len,
                          "grpo": {"group_size": args.group_size}}
    if args.task:
        rl = {"task": args.task, **rl}
    spec: dict[str, Any] = {"model": args.model, "rl": rl, "trainer": trainer,
                            "generation": {"gen_ep": lay.gen_devices_per_replica}}
    if lay.offload:
        spec["generation"]["offload"] = "always"
    spec["rollout"] = {"replicas": lay.replicas, "ranks_per_replica": lay.gen_devices_per_replica}
    if lay.placement == "disaggregated" or lay.staleness:
        spec["stalesync"] = {"placement": lay.placement, "staleness": lay.staleness}
    return spec


def _header(args: argparse.Namespace, candidate, result, out: str) -> str:
    p = candidate.prediction
    lines = [f"written by `moetrain plan --rl` ({_commit()}): {_command(args)}",
             f"searched {len(result.ranked):,} RL jobs ({result.trainer_searches} trainer searches, "
             f"{result.trainer_layouts_evaluated:,} trainer layouts) in {result.seconds:.1f} s",
             f"winner: {candidate.split()}, {candidate.generation()}, k = {candidate.staleness}, trainer "
             f"{candidate.trainer()}",
             f"predicted on {args.devices} × {args.cluster} ({args.dtype}, {args.prompt_len} prompt + "
             f"{args.response_len} generated tokens per sample): step {p.step_s:.4g} s, "
             f"{p.tokens_per_s:,.0f} tokens/s, {p.generated_tokens_per_s:,.0f} generated tokens/s",
             f"step model: {step_model_text(p.step_model, candidate.layout.shared_cores, candidate.layout.placement)}"]
    lines += [f"{NOT_RUNNABLE}{reason}" for reason in candidate.not_runnable]
    if not candidate.not_runnable:
        lines.append(f"run it: {run_command(args, candidate, out)} (flags other than the layout's override it)")
    return "".join(f"# {line}\n" for line in lines)


def run_command(args: argparse.Namespace, candidate, out: str) -> str:
    """How to run the plan: ``moetrain rl --plan out``, on each node with its flags when it spans nodes."""
    from moetrain.config import load_cluster_config  # lazy: the presets load when the command runs

    per_node = load_cluster_config(args.cluster).devices_per_node
    devices = candidate.layout.devices
    if devices <= per_node:
        return f"moetrain rl --plan {out}"
    return (f"on each of {devices // per_node} nodes, moetrain rl --plan {out} --nnodes {devices // per_node} "
            f"--nproc {per_node} --rdzv-endpoint HOST:PORT")


def _command(args: argparse.Namespace) -> str:
    return "moetrain " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["plan"] else "moetrain plan --rl (API)"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
        return f"commit {out.stdout.strip()}" if out.returncode == 0 and out.stdout.strip() else "no git commit"
    except (OSError, subprocess.SubprocessError):
        return "no git commit"


def _loads_as_spec(spec: dict[str, Any], name: str) -> str | None:
    """None when ``moetrain rl`` would accept the file; else the line it refuses it with."""
    try:
        resolve_rl_spec([spec], [name])
    except (UserError, ValueError) as exc:
        return str(exc).splitlines()[0]
    return None


def _unprobed_line(result, args: argparse.Namespace) -> str:
    """One line naming the jobs the probed CPU-seconds per process could not price (left out of the ranking)."""
    from moetrain.planner.rl_rates import PROBE_COMMAND  # lazy: as above

    jobs = "; ".join(result.unprobed)
    return (f"not priced by {args.rl_rates}'s role_cpu (its processes are another job's), left out at k ≥ 1: "
            f"{jobs}; probe such a job with `{PROBE_COMMAND}` to rank it")


def _unprobed_colocated_line(result, args: argparse.Namespace) -> str:
    """One line naming the colocated jobs the probed CPU-seconds per rank could not price (left out)."""
    from moetrain.planner.rl_rates import PROBE_COMMAND  # lazy: as above

    jobs = "; ".join(result.unprobed_colocated)
    return (f"not priced by {args.rl_rates}'s rank_cpu (its ranks are another colocated job's), left out: "
            f"colocated {jobs}; probe such a job with `{PROBE_COMMAND}` to rank it")


def row(c) -> dict[str, Any]:
    lay, p = c.layout, c.prediction
    return {"placement": lay.placement, "devices": lay.devices, "rollout_devices": lay.rollout_devices,
            "train_devices": lay.train_devices, "replicas": lay.replicas,
            "gen_devices_per_replica": lay.gen_devices_per_replica, "staleness": lay.staleness,
            "trainer": lay.train.model_dump(), "step_s": p.step_s, "tokens_per_s": p.tokens_per_s,
            "generated_tokens_per_s": p.generated_tokens_per_s, "step_model": p.step_model,
            "shared_cores": lay.shared_cores, "phases_s": vars(p.phases),
            "train_fits_memory": p.train_fits_memory, "device_gib": c.device_gib,
            "not_runnable": list(c.not_runnable)}


def run(args: argparse.Namespace) -> int:
    out = args.out or DEFAULT_OUT
    output_file(out, "--out", DEFAULT_OUT)
    result, workload = plan_rl(args)
    winner = result.winner
    spec = plan_file(args, winner)
    refused = _loads_as_spec(spec, Path(out).name)
    if refused and not winner.not_runnable:
        raise UserError(f"the planned RL run is refused by moetrain rl: {refused}")
    Path(out).write_text(_header(args, winner, result, out) + yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    top = result.ranked[:max(args.top, 1)]
    if args.json:
        print(json.dumps({"model": workload.model.name, "cluster": workload.cluster.name, "devices": args.devices,
                          "seconds": result.seconds, "candidates": len(result.ranked),
                          "trainer_searches": result.trainer_searches,
                          "trainer_layouts_evaluated": result.trainer_layouts_evaluated,
                          "left_out": result.left_out, "unprobed": result.unprobed,
                          "unprobed_colocated": result.unprobed_colocated, "top": [row(c) for c in top],
                          "why": result.why,
                          "plan_file": out, "runnable": not winner.not_runnable}, indent=2, default=float))
        return 0
    print(f"searched {len(result.ranked):,} RL jobs of {workload.model.name} on {args.devices:,} × "
          f"{workload.cluster.name} in {result.seconds:.1f} s ({result.trainer_searches} trainer searches, "
          f"{result.trainer_layouts_evaluated:,} trainer layouts)")
    print(f"{'#':>2} {'split':<38} {'generation':<18} {'k':>2} {'step s':>9} {'step model':<17} {'tokens/s':>10} "
          f"{'runs':>4}  trainer")
    for i, c in enumerate(top, 1):
        print(f"{i:>2} {c.split():<38} {c.generation():<18} {c.staleness:>2} {c.step_s:>9.4g} "
              f"{c.prediction.step_model:<17} {c.tokens_per_s:>10,.0f} {'no' if c.not_runnable else 'yes':>4}  "
              f"{c.trainer()}")
    if result.left_out:
        print("left out: " + "; ".join(f"{reason} ({n})" for reason, n in result.left_out.items()))
    if result.unprobed:
        print(_unprobed_line(result, args))
    if result.unprobed_colocated:
        print(_unprobed_colocated_line(result, args))
    print("\nwhy the winner wins:")
    for line in result.why:
        print(f"  {line}")
    print(f"\nRL plan written to {out}")
    if winner.not_runnable:
        print("  not runnable by today's moetrain rl (planned all the same):")
        for reason in winner.not_runnable:
            print(f"    {reason}")
    else:
        print(f"  runs as is: {run_command(args, winner, out)}")
    return 0
