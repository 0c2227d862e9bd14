"""StaleSync's Ray engine (``moetrain rl --staleness K --engine ray``): the pipeline's ranks as Ray actors.

Ray is only the launcher and the placement layer. The driver (the ``moetrain rl`` process) reserves one
CPU per rank in a placement group, starts one actor per rank in it, has rank 0's actor host each
attempt's rendezvous store (on a port the OS assigns as it binds, so no other process can take it in
between), and has every actor run ``moetrain.distributed.world.run_in_world``: the function ``spawn``'s
processes run, which joins the torch.distributed (gloo) group through that store and then runs the
rank's code, the same code the local engine runs (``run_stalesync`` in tests; from the
CLI, the torchrun entry ``moetrain.rl.worker.run_rank`` on the run's spec). Any layout torchrun runs
runs here: R rollout replicas and a trainer group of several ranks are R + T actors. Batches and weights
travel over that group, never through Ray; the driver only waits on the actors' return values.

A failure ends the attempt: the first actor whose task raises, or whose process dies, is reported in one
line naming its worker (``rank 0 failed: StaleSync rollout worker (rank 0) failed: ...`` or ``... died:
...``). Without restarts left every actor is killed at once, so no rank is left waiting on a dead peer,
and the run ends. With ``--max-restarts N`` the actors are made with Ray's ``max_restarts``: Ray starts
a dead actor's process again in its bundle of the placement group (whose CPUs stay reserved), the driver
has Ray restart the survivors the same way (``ray.kill(..., no_restart=False)``: a fresh process, no
torch.distributed state left over), and runs the ranks again as attempt n. That is torchrun's
``--max-restarts``: the attempt number is torchrun's ``TORCHELASTIC_RESTART_COUNT`` in each actor, so
every rank resumes from the newest complete GRPO checkpoint, the reporting rank names the failure from
the report the driver wrote for the failed rank and what was lost (``moetrain.runtime_base.recovery``),
and the metrics file stays one curve.

A rank that hangs (no reply) is found by its peers: each of their collectives gives up after the run's
``timeout_s``, and the failure line names the rank they were waiting on.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from moetrain.distributed.world import DEFAULT_TIMEOUT_S, Rendezvous, run_in_world, store_server
from moetrain.errors import UserError
from moetrain.runtime_base.recovery import (
    RECOVERY_ENV,
    RESTART_ENV,
    failure_line,
    report_name,
    restarts_summary,
)
from moetrain.train.faults import ENV as FAULT_ENV

if TYPE_CHECKING:
    from moetrain.rl.spec import RLRunSpec

PLACE_TIMEOUT_S = 60.0
"""How long the driver waits for the cluster to reserve every actor's CPU before it gives up."""

START_TIMEOUT_S = 300.0
"""How long the driver waits for a placed actor's process to start and answer (a fresh Python importing
torch: seconds on an idle machine, over a minute on a loaded one) before it gives up."""


def import_ray() -> ModuleType:
    """Ray, or a one-line ``UserError`` saying how to install it (Ray is an optional dependency)."""
    try:
        import ray  # optional dependency: a missing Ray is the one line below
    except ImportError:
        raise UserError("--engine ray needs Ray, which is not installed: pip install ray "
                        "(or use --engine local)") from None
    return ray


class RayRankError(RuntimeError):
    """A rank of a Ray run failed (raised, died, or did not finish in time): ``str`` is its one line."""

    def __init__(self, line: str, rank: int | None, user_error: bool = False, died: bool = False) -> None:
        super().__init__(line)
        self.rank, self.user_error, self.died = rank, user_error, died


@dataclass(frozen=True)
class RankSetting:
    """What every actor of one attempt is told besides its rank: the group's collective timeout and the
    environment torchrun's ranks would have (the attempt, the fault injection, the recovery folders)."""

    timeout_s: float
    env: dict[str, str | None]
    """Variables to set (None: to unset) in the actor's process before the rank runs."""


@dataclass(frozen=True)
class Restarts:
    """Restarts of the whole group after a failure (``--max-restarts``); 0: a failure ends the run."""

    max_restarts: int = 0
    log_dir: Path | None = None
    """Where the ranks record their progress and the driver writes the failed rank's report (the
    ``MOETRAIN_RECOVERY_DIR`` and ``MOETRAIN_ERROR_DIR`` of torchrun's ranks); None: nowhere."""

    def env(self, attempt: int) -> dict[str, str | None]:
        env: dict[str, str | None] = {RESTART_ENV: str(attempt), FAULT_ENV: os.environ.get(FAULT_ENV)}
        if self.log_dir is not None:
            env.update({RECOVERY_ENV: str(self.log_dir), "MOETRAIN_ERROR_DIR": str(self.log_dir / "errors")})
        return env

    def record_failure(self, attempt: int, exc: RayRankError) -> None:
        """The failed rank's one line where the restarted reporting rank reads its cause."""
        if self.log_dir is not None and exc.rank is not None:
            folder = self.log_dir / "errors"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / report_name(exc.rank, attempt)).write_text(str(exc) + "\n")


@dataclass(frozen=True)
class ActorAddress:
    """Where a rank's actor runs: its node's address, its process id and, for rank 0's, the port of the
    attempt's rendezvous store it hosts (0 for the others)."""

    host: str
    pid: int
    port: int = 0


class RankActor:
    """One rank (made a Ray actor by ``run_ranks``): it runs the rank's function inside the process group."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._store = None

    def __repr__(self) -> str:  # Ray prefixes the actor's printed lines with it
        return self.name

    def address(self) -> ActorAddress:
        import ray  # optional dependency; present in an actor, which Ray started

        return ActorAddress(ray.util.get_node_ip_address(), os.getpid())

    def host_store(self, timeout_s: float) -> ActorAddress:
        """Host a new rendezvous store (rank 0's actor, once per attempt; ``world.store_server``) and say
        where. A fresh store each attempt holds no key of a failed one (pytorch/pytorch#135712); it stays up,
        with this actor, until the next attempt replaces it."""
        import ray  # optional dependency; present in an actor, which Ray started

        host = ray.util.get_node_ip_address()
        self._store = store_server(host, timeout_s)
        return ActorAddress(host, os.getpid(), self._store.port)

    def run(self, fn: Callable[..., Any], rank: int, world_size: int, args: tuple, master: ActorAddress,
            setting: RankSetting) -> Any:
        # the driver's environment, not the raylet's: a worker process may have started before it was set
        for name, value in setting.env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        # LOCAL_RANK 0: Ray gives each actor its own devices (CUDA_VISIBLE_DEVICES), so its first is its own
        rendezvous = Rendezvous(master.port, master.host, timeout_s=setting.timeout_s, store_hosted=True)
        return run_in_world(fn, rank, world_size, args, rendezvous, local_rank=0)


@contextlib.contextmanager
def connected(ray: ModuleType) -> Iterator[None]:
    """The Ray cluster to run on: the one this process already joined, the one ``RAY_ADDRESS`` or
    ``ray start`` names, or else a local one started here (and shut down on exit)."""
    if ray.is_initialized():
        yield
        return
    address = os.environ.get("RAY_ADDRESS")
    try:
        ray.init(address=address or "auto")
    except ConnectionError as exc:
        if address:
            raise UserError(f"RAY_ADDRESS={address}: cannot join that Ray cluster "
                            f"({str(exc).splitlines()[0]})") from None
        ray.init(address="local", num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, names: Sequence[str],
              timeout_s: float | None = None, group_timeout_s: float = DEFAULT_TIMEOUT_S,
              restarts: Restarts | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Ray actors (one CPU each) joined in one gloo
    group, on the cluster this process is connected to; their return values (``spawn``'s contract).
    ``names[r]`` names rank r in a failure; ``timeout_s`` bounds each attempt (None: the group's
    ``group_timeout_s`` on every collective is the only bound). After a failure that is not a user error,
    the group runs again while ``restarts`` has some left (the module's doc); then ``RayRankError`` is
    raised, after killing every actor."""
    ray = import_ray()
    restarts = restarts or Restarts()
    # optional dependency, present once import_ray() has returned
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"CPU": 1}] * world_size, strategy="PACK")
    actors: list = []
    try:
        if not ray.wait([group.ready()], timeout=PLACE_TIMEOUT_S)[0]:
            cpus = ray.cluster_resources().get("CPU", 0)
            raise UserError(f"the Ray cluster cannot place {world_size} actors of 1 CPU each (it has {cpus:g} CPUs "
                            f"in all, {PLACE_TIMEOUT_S:.0f} s waited); give it more CPUs or free some")
        # with restarts, Ray restarts an actor whose process died as often as it dies; the driver counts the
        # group's attempts against --max-restarts
        actor_cls = ray.remote(num_cpus=1, max_restarts=-1 if restarts.max_restarts else 0)(RankActor)
        actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=rank)).remote(names[rank]) for rank in range(world_size)]
        addresses = _gather(ray, [actor.address.remote() for actor in actors], names, None, START_TIMEOUT_S,
                            "its Ray actor did not start")
        for attempt in range(restarts.max_restarts + 1):
            setting = RankSetting(group_timeout_s, restarts.env(attempt))
            master = _gather(ray, [actors[0].host_store.remote(group_timeout_s)], names[:1], addresses[:1],
                             START_TIMEOUT_S, "did not host the rendezvous store")[0]
            refs = [actor.run.remote(fn, rank, world_size, args, master, setting)
                    for rank, actor in enumerate(actors)]
            try:
                return _gather(ray, refs, names, addresses, timeout_s)
            except RayRankError as exc:
                if exc.user_error or attempt == restarts.max_restarts:
                    raise
                restarts.record_failure(attempt, exc)
                addresses = _restart(ray, actors, addresses, exc.rank if exc.died else None, names)
        raise AssertionError("unreachable: the last attempt returns or raises")
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)


def _restart(ray: ModuleType, actors: list, before: list[ActorAddress], dead: int | None,
             names: Sequence[str]) -> list[ActorAddress]:
    """Every actor in a fresh process (Ray restarts them in their bundles): the survivors are killed with
    a restart (the dead one Ray restarts by itself); their new addresses, once each answers from a new
    process."""
    for rank, actor in enumerate(actors):
        if rank != dead:
            ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + START_TIMEOUT_S
    addresses = []
    for rank, actor in enumerate(actors):
        late = RayRankError(f"rank {rank} failed: {names[rank]} was not restarted by Ray within "
                            f"{START_TIMEOUT_S:.0f} s", rank)
        while True:
            try:
                address = ray.get(actor.address.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            except ray.exceptions.RayActorError:  # a call that reached the process being killed
                address = None
            except ray.exceptions.GetTimeoutError:
                raise late from None
            if address is not None and address.pid != before[rank].pid:
                addresses.append(address)
                break
            if time.monotonic() > deadline:
                raise late
            time.sleep(0.2)
    return addresses


def _gather(ray: ModuleType, refs: list, names: Sequence[str], addresses: list[ActorAddress] | None,
            timeout_s: float | None, late: str = "did not finish") -> list[Any]:
    """Every ref's value, in rank order; the first failure (in the order they happen) is raised at once.
    ``late`` says what a rank did not do when ``timeout_s`` runs out (the failure line's words)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    pending, values = list(refs), {}
    while pending:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            waited_on = ", ".join(names[rank_of[ref]] for ref in pending)
            raise RayRankError(f"{waited_on}: {late} within {timeout_s:.0f} s", None)
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            rank = rank_of[ref]
            try:
                values[rank] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                where = f" (pid {addresses[rank].pid} on {addresses[rank].host})" if addresses else ""
                cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise RayRankError(f"rank {rank} failed: {names[rank]} died: its Ray actor{where} exited: "
                                   f"{cause}", rank, died=True) from exc
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                raise RayRankError(failure_line(rank, cause), rank, isinstance(cause, UserError)) from exc
    return [values[rank] for rank in range(len(refs))]


def cli_rank(rank: int, world_size: int, spec: RLRunSpec) -> None:
    """A rank of ``moetrain rl --staleness K --engine ray``: torchrun's ranks' ``run_rank``, unchanged."""
    from moetrain.rl.worker import run_rank  # the actor's code: the driver never imports the ranks' runtime

    run_rank(spec, rank)


def launch(spec: RLRunSpec, log_dir: Path | None = None, command: str = "rl") -> int:
    """The CLI's StaleSync run on Ray actors (the spec torchrun's ranks read from a file, given whole); the
    exit code, with a failure printed as one line (the local launcher's format). ``log_dir``: the run's
    folder, where restarts are recorded (needed for ``--max-restarts``)."""
    roles, run = spec.roles, spec.trainer.run
    ray = import_ray()
    restarts = Restarts(run.max_restarts, log_dir)
    if log_dir is not None and run.max_restarts:
        for name in ("progress.json", "restarts.jsonl"):  # a log folder reused from an earlier run
            (log_dir / name).unlink(missing_ok=True)
    start = time.monotonic()
    with connected(ray):
        try:
            run_ranks(cli_rank, roles.world_size, spec, names=[roles.worker_name(r) for r in range(roles.world_size)],
                      group_timeout_s=run.timeout_s, restarts=restarts)
        except RayRankError as exc:
            after = f"after {run.max_restarts} restart{'s' * (run.max_restarts > 1)}, " \
                if run.max_restarts and not exc.user_error else ""
            print(f"moetrain {command}: {exc} ({after}all Ray actors stopped after {time.monotonic() - start:.1f} s)",
                  file=sys.stderr)
            return 2 if exc.user_error else 1
    recovered = restarts_summary(log_dir) if log_dir is not None and run.max_restarts else None
    if recovered:  # what the failures cost: said even in a quiet run
        print(f"moetrain {command}: {recovered}", flush=True)
    return 0
