"""StaleSync's Ray engine (``moetrain rl --staleness K --engine ray``): the pipeline's ranks as Ray actors.

Ray is only the launcher and the placement layer. The driver (the ``moetrain rl`` process) reserves one
CPU per rank in a placement group, starts one actor per rank in it, asks rank 0's actor for its node's
address and a free port, and has every actor run ``moetrain.distributed.world.run_in_world``: the
function ``spawn``'s processes run, which joins the torch.distributed (gloo) group at that address and
then runs the rank's code, the same code the local engine runs (``run_stalesync`` in tests; from the
CLI, the torchrun entry ``moetrain.rl.worker.run_rank`` on the run's spec). Batches and weights travel
over that group, never through Ray; the driver only waits on the actors' return values.

A failure ends the run: the first actor whose task raises, or whose process dies, is reported in one
line naming its worker (``rank 0 failed: StaleSync rollout worker (rank 0) failed: ...`` or ``... died:
...``), and every other actor is killed at once, so no rank is left waiting on a dead peer.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from moetrain.distributed.world import DEFAULT_TIMEOUT_S, run_in_world
from moetrain.errors import UserError
from moetrain.runtime_base.recovery import failure_line

if TYPE_CHECKING:
    from moetrain.rl.spec import RLRunSpec

PLACE_TIMEOUT_S = 60.0
"""How long the driver waits for the cluster to place every actor before it gives up."""


def import_ray() -> ModuleType:
    """Ray, or a one-line ``UserError`` saying how to install it (Ray is an optional dependency)."""
    try:
        import ray
    except ImportError:
        raise UserError("--engine ray needs Ray, which is not installed: pip install ray "
                        "(or use --engine local)") from None
    return ray


class RayRankError(RuntimeError):
    """A rank of a Ray run failed (raised, died, or did not finish in time): ``str`` is its one line."""

    def __init__(self, line: str, rank: int | None, user_error: bool = False) -> None:
        super().__init__(line)
        self.rank, self.user_error = rank, user_error


@dataclass(frozen=True)
class ActorAddress:
    """Where a rank's actor runs: its node's address, a free port there, its process id."""

    host: str
    port: int
    pid: int


class RankActor:
    """One rank (made a Ray actor by ``run_ranks``): it runs the rank's function inside the process group."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:  # Ray prefixes the actor's printed lines with it
        return self.name

    def address(self) -> ActorAddress:
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ActorAddress(host, port, os.getpid())

    def run(self, fn: Callable[..., Any], rank: int, world_size: int, args: tuple, master: ActorAddress,
            timeout_s: float) -> Any:
        # LOCAL_RANK 0: Ray gives each actor its own devices (CUDA_VISIBLE_DEVICES), so its first is its own
        return run_in_world(fn, rank, world_size, args, master_addr=master.host, master_port=master.port,
                            local_rank=0, timeout_s=timeout_s)


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
              timeout_s: float | None = None, group_timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Ray actors (one CPU each) joined in one gloo
    group, on the cluster this process is connected to; their return values (``spawn``'s contract).
    ``names[r]`` names rank r in a failure; ``timeout_s`` bounds the whole run (None: the group's
    ``group_timeout_s`` on every collective is the only bound). Raises ``RayRankError`` on the first
    failure, after killing every actor."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"CPU": 1}] * world_size, strategy="PACK")
    actors = []
    try:
        if not ray.wait([group.ready()], timeout=PLACE_TIMEOUT_S)[0]:
            cpus = ray.cluster_resources().get("CPU", 0)
            raise UserError(f"the Ray cluster cannot place {world_size} actors of 1 CPU each (it has {cpus:g} CPUs "
                            f"in all, {PLACE_TIMEOUT_S:.0f} s waited); give it more CPUs or free some")
        actor_cls = ray.remote(num_cpus=1, max_restarts=0)(RankActor)
        actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=rank)).remote(names[rank]) for rank in range(world_size)]
        addresses = _gather(ray, [actor.address.remote() for actor in actors], names, None, PLACE_TIMEOUT_S)
        refs = [actor.run.remote(fn, rank, world_size, args, addresses[0], group_timeout_s)
                for rank, actor in enumerate(actors)]
        return _gather(ray, refs, names, addresses, timeout_s)
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)


def _gather(ray: ModuleType, refs: list, names: Sequence[str], addresses: list[ActorAddress] | None,
            timeout_s: float | None) -> list[Any]:
    """Every ref's value, in rank order; the first failure (in the order they happen) is raised at once."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    pending, values = list(refs), {}
    while pending:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            late = ", ".join(names[rank_of[ref]] for ref in pending)
            raise RayRankError(f"{late}: no result after {timeout_s:.0f} s", None)
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            rank = rank_of[ref]
            try:
                values[rank] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                where = f" (pid {addresses[rank].pid} on {addresses[rank].host})" if addresses else ""
                cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise RayRankError(f"rank {rank} failed: {names[rank]} died: its Ray actor{where} exited: "
                                   f"{cause}", rank) from exc
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                raise RayRankError(failure_line(rank, cause), rank, isinstance(cause, UserError)) from exc
    return [values[rank] for rank in range(len(refs))]


def cli_rank(rank: int, world_size: int, spec: RLRunSpec) -> None:
    """A rank of ``moetrain rl --staleness K --engine ray``: torchrun's ranks' ``run_rank``, unchanged."""
    from moetrain.rl.worker import run_rank

    run_rank(spec, rank)


def launch(spec: RLRunSpec, group_timeout_s: float, command: str = "rl") -> int:
    """The CLI's StaleSync run on Ray actors (the spec torchrun's ranks read from a file, given whole); the
    exit code, with a failure printed as one line (the local launcher's format)."""
    roles = spec.roles
    ray = import_ray()
    start = time.monotonic()
    with connected(ray):
        try:
            run_ranks(cli_rank, roles.world_size, spec, names=[roles.worker_name(r) for r in range(roles.world_size)],
                      group_timeout_s=group_timeout_s)
        except RayRankError as exc:
            print(f"moetrain {command}: {exc} (all Ray actors stopped after {time.monotonic() - start:.1f} s)",
                  file=sys.stderr)
            return 2 if exc.user_error else 1
    return 0
