"""Process-group start-up and a small in-process launcher for tests and benchmarks.

``init_world`` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...) and picks
gloo on CPU, NCCL on GPU. ``spawn`` starts ``world_size`` processes running ``fn(rank, world_size,
*args)`` on one machine around a store it hosts itself, sets one thread per rank (several ranks share
few cores), and returns each rank's return value; a rank that raises makes ``spawn`` raise with that rank's
message (torch.multiprocessing ends the others).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetrain.runtime_base.host_memory import keep_freed_host_memory
from moetrain.runtime_base.recovery import RESTART_ENV

DEFAULT_TIMEOUT_S = 60.0
"""Collective timeout: a rank stuck waiting for a dead peer gives up after this long."""


_TIMEOUT: datetime.timedelta | None = None
"""The collective timeout of the default group this process joined here (None: not joined here)."""


def _init_process_group(backend: str, timeout_s: float, **kwargs: Any) -> None:
    global _TIMEOUT
    _TIMEOUT = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, timeout=_TIMEOUT, **kwargs)


def new_group(ranks: list[int]) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` with the collective timeout of the default group joined here: ``dist.new_group``
    does not inherit it (it takes torch's 30-minute default), and a rank waiting on a hung peer must give up as
    soon on the layout's groups as on the world's; ``end_startup_timeout`` lowers them together. Every rank of
    the default group calls it for every group, in the same order, member or not (``new_group``'s contract)."""
    return dist.new_group(ranks, timeout=_TIMEOUT)


def end_startup_timeout(timeout_s: float) -> None:
    """Lower the collective timeout of every group this rank belongs to (the default group, ``new_group``'s,
    a device mesh's) to ``timeout_s``, once start-up is over. A run joins with a longer one
    (``run.startup_timeout_s``): loading a checkpoint, building and compiling the model can leave a rank far
    behind its peers before the first step, where a hung peer must still be found quickly later. Nothing to do
    when the run joined with no longer a timeout. Never raises a timeout; no collective (each rank's own
    waits)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if _TIMEOUT is None or timeout >= _TIMEOUT or not dist.is_initialized():
        return
    _set_every_group_timeout(timeout)


def collective_timeout_s() -> float | None:
    """The collective timeout of the groups joined here, in seconds (None: no group joined here)."""
    return None if _TIMEOUT is None else _TIMEOUT.total_seconds()


def restore_collective_timeout(timeout_s: float | None) -> None:
    """Set every group of this rank back to ``timeout_s`` (``collective_timeout_s()`` read earlier): a run
    that lowered them in a world it does not own (``spawn``'s, a Ray actor's, several runs side by side)
    leaves it as it found it, so a rank done early waits at the world's last barrier as long as the world's
    owner asked. Nothing to do for None or once the world is gone."""
    if timeout_s is None or _TIMEOUT is None or not dist.is_initialized():
        return
    _set_every_group_timeout(datetime.timedelta(seconds=timeout_s))


def _set_every_group_timeout(timeout: datetime.timedelta) -> None:
    global _TIMEOUT
    # private but kept for this use (torchtitan lowers its start-up timeout after the first step the same way).
    # torch's own registry of this rank's groups, not a list kept here: a group such a list still held after
    # destroy_process_group would be freed in a child ``spawn`` forks, whose destructor waits forever on
    # threads only the parent has.
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    for group in list(_world.pg_map):
        _set_pg_timeout(timeout, group)
    _TIMEOUT = timeout


def _store_client(addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the store another process hosts at ``addr:port``."""
    return dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def store_server(addr: str, timeout_s: float) -> dist.TCPStore:
    """A store hosted here for ranks to join as clients (``Rendezvous.store_hosted``), on a port the kernel
    picks as it binds (its ``port``): a free port looked up first and bound later could be taken in between
    by any other process that binds port 0, whose store the ranks would then join, or EADDRINUSE."""
    return dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))


def _agent_store_of_this_attempt(timeout_s: float) -> dist.Store | None:
    """Under torchrun, the store its agent hosts for the whole job (every rank a client: no rank binds a port
    of its own, which another process could take between torchrun picking it and rank 0 binding it), with
    this attempt's keys apart from those of a failed one, which a restarted rank could otherwise read for a
    peer's address (pytorch/pytorch#135712). None outside torchrun or where it shares no store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    client = _store_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout_s)
    return dist.PrefixStore(f"moetrain/attempt{os.environ.get(RESTART_ENV, '0')}", client)


def init_world(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
               store: dist.Store | None = None) -> tuple[int, int, torch.device]:
    """Join the process group torchrun (or ``spawn``, or a Ray actor) described in the environment, through
    ``store`` when given (else torchrun's agent store, keyed by attempt, or the one ``MASTER_ADDR:MASTER_PORT``
    names); a CPU rank keeps the host memory it frees (``moetrain.runtime_base.host_memory``)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        keep_freed_host_memory()  # a CPU rank: its activations live in host memory, reused step after step
    if not dist.is_initialized():
        store = store if store is not None else _agent_store_of_this_attempt(timeout_s)
        _init_process_group(backend, timeout_s, rank=rank, world_size=world_size,
                            device_id=device if backend == "nccl" else None,
                            **({"store": store} if store is not None else {}))
    return rank, world_size, device


@contextlib.contextmanager
def join_world(device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[int]:
    """This process's rank in the default process group: the one torchrun (or ``spawn``) started, or,
    in a lone process, a one-rank group made here (gloo on CPU, NCCL on a GPU) and destroyed on exit,
    so that one process runs the same collectives-based step as every other layout."""
    if dist.is_initialized():
        yield dist.get_rank()
        return
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        rank, _, _ = init_world("nccl" if device.type == "cuda" else "gloo", timeout_s)
    else:
        backend = "nccl" if device.type == "cuda" else "gloo"
        _init_process_group(backend, timeout_s, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if backend == "nccl" else None)
        rank = 0
    try:
        yield rank
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class Rendezvous:
    """How a rank joins its group: the store at ``master_addr:master_port``, the backend, and how long its
    collectives wait for a peer."""

    master_port: int
    master_addr: str = "127.0.0.1"
    backend: str = "gloo"
    timeout_s: float = DEFAULT_TIMEOUT_S
    store_hosted: bool = False
    """True: the process that started the ranks hosts the store (``spawn``) and every rank joins it as a
    client; False: rank 0 hosts it."""


def run_in_world(fn: Callable[..., Any], rank: int, world_size: int, args: tuple, rendezvous: Rendezvous,
                 local_rank: int | None = None) -> Any:
    """One rank's life in a ``world_size``-rank group met at ``rendezvous``: join it, return
    ``fn(rank, world_size, *args)``, leave once every rank is done. ``spawn``'s processes and the Ray
    engine's actors (``moetrain.rl.ray_engine``) both run this."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank if local_rank is None else local_rank),
                      MASTER_ADDR=rendezvous.master_addr, MASTER_PORT=str(rendezvous.master_port))
    torch.set_num_threads(1)
    store = (_store_client(rendezvous.master_addr, rendezvous.master_port, rendezvous.timeout_s)
             if rendezvous.store_hosted else None)
    init_world(rendezvous.backend, rendezvous.timeout_s, store)
    try:
        result = fn(rank, world_size, *args)
        # Rank 0 may host the store every group was built from: no rank leaves before the slowest is done.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return result


def _entry(rank: int, world_size: int, rendezvous: Rendezvous, ports: Any, result_dir: str,
           fn: Callable[..., Any], args: tuple) -> None:
    # what a forked child inherits is never the child's to collect (see ``spawn``)
    gc.freeze()
    rendezvous = replace(rendezvous, master_port=ports.get())  # the store's port, once the parent has bound it
    result = run_in_world(fn, rank, world_size, args, rendezvous)
    torch.save(result, Path(result_dir) / f"rank{rank}.pt")


_AUTOGRAD_FORK_UNSAFE = False
"""Set once a forked child of this process could not run a backward (``_forked_backward_runs``)."""


def _forked_backward_runs() -> bool:
    """Whether a child forked from this process can now run a backward. Once a torch built for CUDA or ROCm has
    started autograd's device threads in this process, every forked child refuses autograd ("Unable to
    handle autograd's threading in combination with fork-based multiprocessing"): a compiled backward
    starts them even on a machine without a GPU (torch 2.11+cu130). A CPU-only build never does. No API
    says whether they started, so a child is forked once to try; a refusal is remembered."""
    global _AUTOGRAD_FORK_UNSAFE
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return True
    if not _AUTOGRAD_FORK_UNSAFE:
        pid = os.fork()
        if pid == 0:  # the child: one tiny backward, then out without running the parent's exit handlers
            code = 1
            try:
                x = torch.ones(1, requires_grad=True)
                (x * 2).sum().backward()
                code = 0
            finally:
                os._exit(code)
        _AUTOGRAD_FORK_UNSAFE = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0
    return not _AUTOGRAD_FORK_UNSAFE


def start_method(backend: str) -> str:
    """How ``spawn`` starts its ranks: fork where it can, as the children then inherit the imported torch
    and runtime (seconds saved per rank on a slow disk; they run single-threaded, so no OpenMP pool of the
    parent is touched after the fork). A fresh interpreter (``spawn``) for NCCL, since CUDA cannot be used
    in a forked child, off Linux, and where this process's autograd threads would fail a forked child's
    backward (``_forked_backward_runs``); ``fn`` and its arguments must then pickle."""
    fork = sys.platform == "linux" and backend == "gloo" and _forked_backward_runs()
    return "fork" if fork else "spawn"


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
          timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes (gloo, or NCCL with one GPU per
    rank), their collectives giving up after ``timeout_s``; their return values."""
    with tempfile.TemporaryDirectory() as result_dir:
        method = start_method(backend)
        if method == "fork":
            # A process group that only a reference cycle still holds (an earlier in-process run's) must be
            # freed here, where its threads run: freed in a forked child, its destructor waits forever on
            # threads the child does not have (a test hung that way in CI).
            gc.collect()
        # The parent hosts the group's store (``store_server``) and keeps it until the ranks are done. It
        # starts after the fork, as its server runs a thread: a child forked while that thread held a lock
        # would wait on it forever. The ranks read its port from a pipe.
        ports = mp.get_context(method).SimpleQueue()
        rendezvous = Rendezvous(0, backend=backend, timeout_s=timeout_s, store_hosted=True)
        ranks = mp.start_processes(_entry, args=(world_size, rendezvous, ports, result_dir, fn, args),
                                   nprocs=world_size, join=False, start_method=method)
        store = None
        try:
            store = store_server("127.0.0.1", timeout_s)
            for _ in range(world_size):
                ports.put(store.port)
            while not ranks.join():
                pass
        except BaseException:
            for process in ranks.processes:
                if process.is_alive():
                    process.terminate()
            raise
        finally:
            # stop the server's thread now, not when a traceback lets go of it: a later spawn forks again
            del store
            # torch gives each rank a file in the temp folder for its traceback and leaves the ones it read
            for error_file in ranks.error_files:
                Path(error_file).unlink(missing_ok=True)
        return [torch.load(Path(result_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
