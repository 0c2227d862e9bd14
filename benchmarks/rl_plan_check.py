"""``moetrain plan --rl`` checked on this CPU: plan, probe, plan again, run the winner and the other placement.

For one small RL workload (tiny-pangu on 4 ranks of this machine, docs/rl_plan.md's CPU example) this runs the
loop a user runs, through the CLI only:

1. ``moetrain profile --device cpu --threads 1 --out cpu.yaml --rl-out rates.yaml`` (this CPU's kernels and RL
   host rates, no job) and ``moetrain plan --rl ... --calibration cpu.yaml --rl-rates rates.yaml``: every job
   priced by its phases (``plan1``);
2. the best disaggregated job at k ≥ 1 with one-rank replicas and the best colocated job at k ≥ 1 (gen-ep 1)
   are probed as ``moetrain profile --rl-job`` takes them, in one profile (``rates2.yaml``: each process's
   CPU-seconds per step, the disaggregated roles apart into ``role_cpu``, the colocated ranks as they run into
   ``rank_cpu``, both shared by processor sharing over the cores), and the search runs again with it
   (``plan2``): is the winner the same? A disaggregated job whose probe fails (the runtime refuses it) is
   recorded with its error and the next disaggregated split is probed in its stead;
3. ``moetrain rl --plan`` runs plan1's winner, plan2's winner where it differs, and the best job of the other
   placement, ``--runs`` times each, interleaved (a burst of load on the shared machine hits every job alike);
   each run's median trainer step after the first ``--skip`` steps and without the last (its closing
   evaluation) is its step, the median over the runs the job's;
4. each job's predicted step (plan1: the phases; plan2: processor sharing where the probe prices it) is set
   against its measured step, and the plans' ranking against the runs'.

Every job runs as its plan file says, with the settings the probe's job also takes: no SFT warm-up (so an
untrained policy generates every row to the token limit, the plan's response length), every group trained
(``--no-filter-groups``: an untrained policy's groups all score 0, which the filter would drop), no replay
diagnostics forward and no evaluation but the closing one (neither is priced), one thread per rank.

    python benchmarks/rl_plan_check.py --out benchmarks/results/rl_plan_check_cpu.json
    python benchmarks/rl_plan_check.py --steps 4 --skip 1 --runs 1 --out /tmp/rl_plan_check.json   # a smoke run

About 17 minutes on the 2-core machine (the probes take 4-8 of them). Timing: run it with nothing else on the
machine (``uptime``'s load under 2.5).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import write_result  # noqa: E402

WORKLOAD = ["--model", "tiny-pangu", "--cluster", "cpu", "--devices", "4", "--prompts", "16", "--group-size", "8",
            "--prompt-len", "13", "--response-len", "16", "--dtype", "fp32", "--task", "sort"]
"""docs/rl_plan.md's CPU example: sort's prompts are 13 tokens, 16 new tokens per sample."""
RUN_FLAGS = ["--sft-steps", "0", "--no-filter-groups", "--eval-every", "0", "--eval-size", "16",
             "--replay-stats-every", "0", "--threads", "1"]
"""What every run adds to its plan file (the module docstring says why)."""
PROBE_SETTINGS = {"sft": {"steps": 0}, "rl": {"eval_every": 0, "eval_size": 16, "filter_groups": False,
                                              "replay_stats_every": 0}}
"""RUN_FLAGS as rl.yaml sections, for the probed job (``--rl-job`` takes a file, not flags)."""
PROBE_STEPS = 10
"""The probe's longer run (``rl.rates.role_cpu`` and ``rank_cpu`` difference it with a run of 4 steps)."""
PROFILE = ["profile", "--device", "cpu", "--threads", "1"]
"""One thread per process, as each rank of the runs."""


@dataclass(frozen=True)
class Work:
    """Where one check writes its files and which commands it ran."""

    folder: Path
    commands: list[str] = field(default_factory=list)

    def moetrain(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        self.commands.append(" ".join(["moetrain", *args]))
        done = subprocess.run([sys.executable, "-m", "moetrain", *args], capture_output=True, text=True,
                              cwd=self.folder)
        if check and done.returncode != 0:
            raise SystemExit(f"moetrain {' '.join(args)}: exit {done.returncode}\n{done.stderr[-3000:]}")
        return done


@dataclass(frozen=True)
class Job:
    """One planned job: what tells it apart in a plan's rows, its file, its prediction in each plan."""

    name: str
    plan_file: str
    placement: str
    rollout_devices: int
    gen_devices_per_replica: int
    staleness: int
    trainer: dict
    predicted: dict[str, dict] = field(default_factory=dict)
    """By plan (``plan1``, ``plan2``): ``step_s``, ``step_model``, ``phases_s``, ``rank``."""


def _key(row: dict) -> tuple:
    return (row["placement"], row["rollout_devices"], row["gen_devices_per_replica"], row["staleness"])


def _same(a: Job, b: Job) -> bool:
    return _key(asdict(a)) == _key(asdict(b)) and a.trainer == b.trainer


def _describe(row: dict) -> str:
    split = "colocated" if row["placement"] == "colocated" else \
        f"{row['rollout_devices']} generate / {row['train_devices']} train"
    return f"{split}, {row['replicas']} × gen-ep {row['gen_devices_per_replica']}, k = {row['staleness']}"


def _plan(work: Work, rates: str, out: str, *narrow: str) -> dict:
    """``moetrain plan --rl`` of the workload, every job ranked (``--json``), the winner written to ``out``."""
    done = work.moetrain("plan", "--rl", *WORKLOAD, "--calibration", "cpu.yaml", "--rl-rates", rates, "--top", "100",
                         "--json", "--out", out, *narrow)
    return json.loads(done.stdout)


def _job(work: Work, row: dict, rates: str, out: str) -> Job:
    """A plan file whose winner is ``row``: the search narrowed to its placement, split, replicas and k."""
    narrow = ["--placement", row["placement"], "--gen-ep", str(row["gen_devices_per_replica"]), "--max-staleness",
              str(row["staleness"])]
    if row["placement"] == "disaggregated":
        narrow += ["--rollout-devices", str(row["rollout_devices"])]
    winner = _plan(work, rates, out, *narrow)["top"][0]
    if _key(winner) != _key(row) or winner["trainer"] != row["trainer"]:
        raise SystemExit(f"narrowing the search to {_describe(row)} chose {_describe(winner)}")
    return _as_job(winner, out)


def _as_job(row: dict, plan_file: str) -> Job:
    return Job(_describe(row), plan_file, row["placement"], row["rollout_devices"], row["gen_devices_per_replica"],
               row["staleness"], row["trainer"])


def _probe_file(work: Work, plan_file: str) -> str:
    """The plan file with the runs' settings and the probe's steps, as ``--rl-job`` takes it."""
    import yaml

    spec = yaml.safe_load((work.folder / plan_file).read_text())
    spec["sft"] = PROBE_SETTINGS["sft"]
    spec["rl"] = {**spec["rl"], **PROBE_SETTINGS["rl"]}
    spec["trainer"]["training"] = {**spec["trainer"].get("training", {}), "steps": PROBE_STEPS}
    spec["trainer"]["run"] = {**spec["trainer"].get("run", {}), "threads": 1}
    path = Path(plan_file).with_suffix(".probe.yaml").name
    (work.folder / path).write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@dataclass
class Probe:
    """The disaggregated jobs tried in turn: the one probed (None: none could be) and the refused ones."""

    job: Job | None
    refused: dict[str, str]
    """By job: the last line of its probe's error."""
    role_cpu: dict | None
    probe_yaml: str | None
    rank_cpu: dict | None = None
    """The colocated job's probe (``--rl-job`` beside the disaggregated one); None: none was probed."""


def colocated_probe(work: Work, rows: list[dict]) -> tuple[Job | None, str | None]:
    """(the best colocated job at k ≥ 1 of gen-ep 1, its probe file): what ``--rl-job`` probes beside the
    disaggregated job; (None, None) when the plan has none."""
    row = next((r for r in rows if r["placement"] == "colocated" and r["staleness"] >= 1
                and r["gen_devices_per_replica"] == 1), None)
    if row is None:
        return None, None
    job = _job(work, row, "rates.yaml", "colocated.yaml")
    return job, _probe_file(work, job.plan_file)


def probe_best_disaggregated(work: Work, rows: list[dict], tries: int, colocated_yaml: str | None = None) -> Probe:
    """Probe the best runnable disaggregated k ≥ 1 job of one-rank replicas (the plan's ``not_runnable``
    reasons say which the runtime refuses), the next split if the probe is refused all the same;
    ``colocated_yaml``'s job in the same profile (its ranks into ``rank_cpu``)."""
    beside = ["--rl-job", colocated_yaml] if colocated_yaml else []
    refused: dict[str, str] = {}
    candidates = [r for r in rows if r["placement"] == "disaggregated" and r["staleness"] >= 1
                  and r["gen_devices_per_replica"] == 1 and not r["not_runnable"]]
    splits = list(dict.fromkeys(r["rollout_devices"] for r in candidates))[:tries]
    for split in splits:
        row = next(r for r in candidates if r["rollout_devices"] == split)
        job = _job(work, row, "rates.yaml", f"disaggregated{split}.yaml")
        probe_yaml = _probe_file(work, job.plan_file)
        done = work.moetrain(*PROFILE, "--out", "cpu2.yaml", "--rl-out", "rates2.yaml", "--rl-job", probe_yaml,
                             *beside, check=False)
        if done.returncode == 0:
            import yaml

            rates = yaml.safe_load((work.folder / "rates2.yaml").read_text())
            return Probe(job, refused, rates["role_cpu"], (work.folder / probe_yaml).read_text(),
                         rates.get("rank_cpu"))
        refused[job.name] = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        print(f"probe of {job.name} refused: {refused[job.name]}", flush=True)
    return Probe(None, refused, None, None)


def _predict(job: Job, plan: str, rows: list[dict]) -> None:
    """``job``'s row in ``plan`` (its rank in the plan's order, from 1), or its absence (left out)."""
    for rank, row in enumerate(rows, 1):
        if _key(row) == _key(asdict(job)) and row["trainer"] == job.trainer:
            job.predicted[plan] = {"step_s": row["step_s"], "step_model": row["step_model"],
                                   "shared_cores": row["shared_cores"], "phases_s": row["phases_s"], "rank": rank,
                                   "tokens_per_s": row["tokens_per_s"]}
            return
    job.predicted[plan] = {"step_s": None, "step_model": "left out", "rank": None}


@dataclass
class Run:
    job: str
    run: int
    median_step_s: float
    step_times_s: list[float]
    completion_tokens_per_step: float
    load_average_1min: list[float]
    """Before and after the run."""


def run_job(work: Work, job: Job, args: argparse.Namespace, run: int) -> Run:
    """One ``moetrain rl --plan`` run of ``job``: its median trainer step over the steady steps."""
    metrics = work.folder / f"metrics-{Path(job.plan_file).stem}-{run}.jsonl"
    load = os.getloadavg()[0]
    work.moetrain("rl", "--plan", job.plan_file, "--steps", str(args.steps), *RUN_FLAGS, "--metrics-out",
                  metrics.name, "--quiet")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r]
    steady = steps[args.skip:-1]  # the first steps fill the pipeline; the last holds the closing evaluation
    times = [r["step_time_s"] for r in steps]
    result = Run(job.name, run, statistics.median(r["step_time_s"] for r in steady), times,
                 statistics.mean(r["completion_tokens"] for r in steady), [load, os.getloadavg()[0]])
    print(f"{job.name} run {run}: median step {result.median_step_s:.3f} s", flush=True)
    return result


def _error_pct(predicted: float | None, measured: float) -> float | None:
    return None if predicted is None else (predicted - measured) / measured * 100


def compare(jobs: list[Job], runs: list[Run]) -> dict:
    """Each job's measured step (the median of its runs) against its predictions; the rankings."""
    measured = {job.name: statistics.median(r.median_step_s for r in runs if r.job == job.name) for job in jobs}
    rows = []
    for job in jobs:
        errors = {plan: _error_pct(p["step_s"], measured[job.name]) for plan, p in job.predicted.items()}
        rows.append(asdict(job) | {"measured_step_s": measured[job.name], "error_pct": errors,
                                   "run_median_step_s": [r.median_step_s for r in runs if r.job == job.name]})
    ranking = {"measured": sorted(measured, key=measured.get)}
    for plan in ("plan1", "plan2"):
        priced = [j for j in jobs if j.predicted[plan]["step_s"] is not None]
        ranking[plan] = [j.name for j in sorted(priced, key=lambda j: j.predicted[plan]["step_s"])]
    # ``…_on_priced``: the plan's order of the jobs it prices against the runs' order of those jobs (a job the
    # plan leaves out, such as a colocated job at k = 0 beside a probe at k ≥ 1, is not counted against it)
    priced_holds = {f"{plan}_ranking_holds_on_priced": ranking[plan] == [n for n in ranking["measured"]
                                                                        if n in ranking[plan]]
                    for plan in ("plan1", "plan2")}
    return {"jobs": rows, "ranking": ranking,
            "plan2_ranking_holds": ranking["plan2"] == ranking["measured"],
            "plan1_ranking_holds": ranking["plan1"] == ranking["measured"],
            **priced_holds}


def _ranked(rows: list[dict]) -> list[list]:
    """A plan's ranking in short: each job, its predicted step and the model that priced it."""
    return [[_describe(r), r["step_s"], r["step_model"]] for r in rows]


def check(args: argparse.Namespace, work: Work) -> dict:
    load_start = os.getloadavg()
    work.moetrain(*PROFILE, "--out", "cpu.yaml", "--rl-out", "rates.yaml")
    plan1 = _plan(work, "rates.yaml", "plan1.yaml")
    winner1 = _as_job(plan1["top"][0], "plan1.yaml")
    colocated, colocated_yaml = colocated_probe(work, plan1["top"])
    probe = probe_best_disaggregated(work, plan1["top"], args.probe_tries, colocated_yaml)
    plan2 = _plan(work, "rates2.yaml" if probe.job else "rates.yaml", "plan2.yaml")
    winner2 = _as_job(plan2["top"][0], "plan2.yaml")
    jobs = [winner1] + ([] if _same(winner2, winner1) else [winner2])
    other = next((r for r in plan2["top"] if r["placement"] != winner2.placement), None)
    if other is not None and not any(_same(_as_job(other, ""), job) for job in jobs):
        known = probe.job is not None and _same(_as_job(other, ""), probe.job)
        jobs.append(probe.job if known else _job(work, other, "rates2.yaml" if probe.job else "rates.yaml",
                                                 "other.yaml"))
    for job in jobs:
        _predict(job, "plan1", plan1["top"])
        _predict(job, "plan2", plan2["top"])
    runs = [run_job(work, job, args, run) for run in range(args.runs) for job in jobs]
    return {"plan1_winner": winner1.name, "plan2_winner": winner2.name,
            "same_winner": _same(winner1, winner2),
            "probed": probe.job.name if probe.job else None, "probe_refused": probe.refused,
            "role_cpu": probe.role_cpu, "probe_job_yaml": probe.probe_yaml,
            "probed_colocated": colocated.name if colocated and probe.rank_cpu else None,
            "rank_cpu": probe.rank_cpu,
            "colocated_probe_job_yaml": (work.folder / colocated_yaml).read_text() if colocated_yaml else None,
            "plan2_unprobed": plan2["unprobed"], "plan2_unprobed_colocated": plan2["unprobed_colocated"],
            **compare(jobs, runs),
            "plan1_rows": _ranked(plan1["top"]), "plan2_rows": _ranked(plan2["top"]),
            "runs": [asdict(r) for r in runs], "commands": work.commands,
            "load_average_1min_5min_15min": {"start": list(load_start), "end": list(os.getloadavg())},
            "cpu_count": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="GRPO steps per run")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out (the pipeline fills)")
    parser.add_argument("--runs", type=int, default=3, help="runs per job (their median)")
    parser.add_argument("--probe-tries", type=int, default=2, help="disaggregated splits tried for the probe")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = check(args, Work(Path(tmp)))
    write_result(Path(args.out), {"workload": WORKLOAD, "run_flags": RUN_FLAGS, "steps": args.steps,
                                  "skip": args.skip, "runs_per_job": args.runs, **result})


if __name__ == "__main__":
    main()
