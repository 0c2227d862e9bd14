"""Start a one-node multi-rank run under torchrun, and turn a failure into one line.

``moetrain train`` has validated the run spec (``moetrain.train.checks``) before this is called:
nothing starts for a layout that does not divide the model or the world. ``launch`` writes the spec
to ``run_spec.json`` in the run's log folder (``moetrain rl``: its RL spec, ``rl_spec.json``, named in
``MOETRAIN_RL_SPEC``), names it in ``MOETRAIN_RUN_SPEC`` and runs
``torchrun --standalone --nproc-per-node N --max-restarts R -m moetrain.cli.worker``. torchrun's
agent stops every rank as soon as one exits non-zero or dies from a signal; collectives also time out
(60 s by default) so no rank waits for ever on a dead peer. With ``--max-restarts R`` (the run spec's
``run.max_restarts``, default 0) the agent then starts the group again, up to R times, and each attempt
resumes from the newest complete checkpoint (``moetrain.runtime_base.recovery``); a run of one rank runs under
torchrun too when R > 0, so it recovers the same way. Once no restart is left the launcher prints the
failing rank's own line (``rank R failed: cause``) of the last attempt, or, for a rank killed by a
signal or gone with an exit code and no report, the rank and the signal or code from torchrun's report;
the full torchrun log is kept on disk. A user error in a rank (exit 2) ends the launch with exit 2 as well.

Several nodes (``moetrain.distributed.nodes``): the same command on every node with ``--nnodes M
--rdzv-endpoint HOST:PORT``; each node's launcher writes its own spec file and starts its agent with
torchrun's c10d rendezvous in place of ``--standalone``. The failure line is then this node's ranks'.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from moetrain.config.run import RunSpec
from moetrain.distributed.nodes import Nodes
from moetrain.runtime_base.recovery import RECOVERY_ENV, peer_lost, report_name, restarts_summary
from moetrain.status import say, status_console
from moetrain.threads import ThreadChoice, choose_threads


def _failure_line(error_dir: Path, torchrun_log: str, attempt: int = 0) -> str:
    """The root cause in the last attempt (``attempt``): a rank killed by a signal (torchrun's SIGTERM of
    the survivors aside), else the first rank's own report that is not merely the loss of a peer, else a
    rank that exited non-zero without a report, else a peer's report."""
    codes = [(rank, int(code)) for rank, code in re.findall(
        r"^\s*rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", torchrun_log, re.M)]
    for rank, code in codes:
        if code < 0 and code != -signal.SIGTERM:
            return f"rank {rank} failed: killed by signal {signal.Signals(-code).name}"
    reports = sorted(error_dir.glob(report_name("*", attempt)), key=lambda p: p.stat().st_mtime)
    if attempt == 0:
        reports = [p for p in reports if ".restart" not in p.name]
    lines = [p.read_text().strip() for p in reports]
    causes = [line for line in lines if not peer_lost(line)]
    if causes:
        return causes[0]
    reported = {re.match(r"rank(\d+)", p.name).group(1) for p in reports}  # type: ignore[union-attr]
    for rank, code in codes:
        if code > 0 and rank not in reported:
            return f"rank {rank} failed: exited with code {code} without a report"
    if lines:
        return lines[0]
    return "a rank failed before reporting (see the torchrun log)"


@dataclass(frozen=True)
class SpecFile:
    """The one file every rank reads its run from, and the variable that names it."""

    path: Path
    env: str


@dataclass(frozen=True)
class Entry:
    """What each rank runs: ``module`` (``moetrain rl`` starts ``moetrain.rl.worker``) on ``spec_file``
    (None: the run spec itself, written to ``run_spec.json``, named in ``MOETRAIN_RUN_SPEC``; ``spec`` then
    gives only the threads, the device and the progress); ``command``: the CLI command a failure line names;
    ``nproc``: ranks of the whole run when they are not the layout's (a StaleSync run: the rollout replicas'
    ranks beside the trainer group)."""

    module: str = "moetrain.cli.worker"
    spec_file: SpecFile | None = None
    command: str = "train"
    nproc: int | None = None


def launch(spec: RunSpec, log_dir: Path | None = None, entry: Entry | None = None, nodes: Nodes | None = None) -> int:
    """Run ``spec`` on ``spec.world_size`` ranks (``entry.nproc`` when given), all on this node or, with
    ``nodes``, this node's share of them (the same command runs on every node); the exit code of the run."""
    entry = entry or Entry()
    nodes = nodes or Nodes()
    spec_file, command = entry.spec_file, entry.command
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="moetrain-run-"))
    error_dir = log_dir / "errors"
    error_dir.mkdir(parents=True, exist_ok=True)
    if spec_file is None:
        spec_file = SpecFile(log_dir / "run_spec.json", "MOETRAIN_RUN_SPEC")
        spec_file.path.write_text(spec.to_json(), encoding="utf-8")
    ranks = (entry.nproc or spec.world_size) // nodes.count
    # the free cores shared among the ranks (one thread each where they share cores); a GPU rank needs one
    on_cpu = not spec.run.device.startswith("cuda")
    threads = choose_threads(spec.run.threads, ranks) if on_cpu else ThreadChoice(1, "GPU ranks")
    env = dict(os.environ, MOETRAIN_ERROR_DIR=str(error_dir), OMP_NUM_THREADS=str(threads.threads),
               **{spec_file.env: str(spec_file.path)})
    restarts = spec.run.max_restarts
    if restarts > 0:
        env[RECOVERY_ENV] = str(log_dir)
        for name in ("progress.json", "restarts.jsonl"):  # a log folder reused from an earlier run
            (log_dir / name).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", *nodes.torchrun_args(ranks), f"--max-restarts={restarts}",
           "--monitor-interval=0.5", "-m", entry.module]
    log_path = log_dir / "torchrun.log"
    per_rank = f"{threads.threads} thread{'s' * (threads.threads > 1)} each ({threads.reason}), " \
        if on_cpu else ""
    where = f" on this node, joining {nodes.count - 1} other node(s) at {nodes.endpoint}" if nodes.count > 1 else ""
    say(status_console(spec.run.quiet), f"starting {ranks} ranks{where} under torchrun ({per_rank}each imports "
        f"torch, joins the others and builds its part; log: {log_path})…")
    start = time.monotonic()
    with open(log_path, "w") as log:
        code = subprocess.call(cmd, env=env, stderr=log)
    recovered = restarts_summary(log_dir) if restarts > 0 else None
    if code == 0:
        if recovered:  # what the failures cost: said even in a quiet run
            print(f"moetrain {command}: {recovered} (log: {log_path})", flush=True)
        return 0
    # the agent gives up only once every restart is spent: the cause is the last attempt's
    line = _failure_line(error_dir, log_path.read_text(), restarts)
    after = f"after {restarts} restart{'s' * (restarts > 1)}, " if restarts else ""
    print(f"moetrain {command}: {line} ({after}all ranks stopped after {time.monotonic() - start:.1f} s; "
          f"log: {log_path})", file=sys.stderr)
    return 2 if _user_error(log_path.read_text()) else 1


def _user_error(torchrun_log: str) -> bool:
    """Whether a rank ended with the worker's user-error exit code (2)."""
    return re.search(r"^\s*exitcode\s*:\s*2\b", torchrun_log, re.M) is not None
