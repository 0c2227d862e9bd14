"""One rank of a multi-rank run: join the process group, train, leave.

torchrun starts ``python -m moetrain.cli.worker`` on every rank; ``moetrain train --nproc N`` validates the
run spec, writes it to a file and names that file in ``MOETRAIN_RUN_SPEC``; a user starting torchrun on
several nodes gives the same flags as ``moetrain train`` (``--config run.yaml`` and overrides) and the spec
is built and checked the same way (``moetrain.cli.train.worker_main``); on several nodes the ranks check
that every node built the same spec (``moetrain.distributed.nodes``). Each rank then runs ``Trainer``,
the loop of every layout. A rank that raises writes one line, naming itself and the cause, to
``$MOETRAIN_ERROR_DIR/rank<R>.txt`` (``rank<R>.restart<A>.txt`` in a restarted attempt) and exits non-zero
(2 for a user error); torchrun then stops every other rank and, with restarts left (``--max-restarts``),
starts the group again: an attempt after the first resumes every rank from the newest complete
checkpoint. Otherwise the launcher prints that line.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from moetrain.config.run import RunSpec
from moetrain.distributed.nodes import check_same_spec, spans_nodes
from moetrain.distributed.world import init_world
from moetrain.errors import UserError
from moetrain.runtime_base.recovery import USER_ERROR_EXIT, attempt, report_failure
from moetrain.status import say, status_console
from moetrain.train.trainer import Trainer, resolve_device


def run_rank(spec: RunSpec) -> int:
    """Join the process group, train, leave; a failure is one line and a non-zero exit."""
    torch.set_num_threads(spec.run.threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank = int(os.environ.get("RANK", "0"))
    if attempt() > 0:  # torchrun restarted the group after a failure: every rank resumes
        spec = spec.model_copy(update={"run": spec.run.model_copy(update={"resume": True})})
    try:
        device = resolve_device(spec.run.device)
        rank, _, _ = init_world("nccl" if device.type == "cuda" else "gloo", spec.run.first_step_timeout_s)
        if spans_nodes():  # each node built its spec from its own flags: they must agree (log folders aside)
            check_same_spec(spec.model_copy(update={"run": spec.run.model_copy(update={"log_dir": None})}).to_json(),
                            "moetrain train")
        say(status_console(spec.run.quiet or rank != 0), f"all {dist.get_world_size()} ranks joined; "
            "preparing the data and each rank's part of the model…")
        trainer = Trainer(spec)
        trainer.console.print(trainer.describe())
        trainer.train()
        trainer.print_summary()
    except BaseException as exc:  # report every cause, then let torchrun stop the others
        report_failure(rank, exc)
        os._exit(USER_ERROR_EXIT if isinstance(exc, UserError) else 1)  # no teardown: peers may be gone
    dist.destroy_process_group()
    return 0
