"""``spawn`` on a process that already ran a one-rank group: a forked child must not free the parent's groups."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.dist]

# A one-rank gloo world with a subgroup that, after the world is destroyed, only a reference cycle holds (as
# an in-process run can leave behind), then ``spawn`` of two ranks whose function runs a cycle collection.
# Freed in a forked child, the subgroup's destructor waits forever on threads that only the parent has.
SCRIPT = textwrap.dedent("""
    import gc
    import torch.distributed as dist
    from moetrain.distributed.world import spawn

    gc.disable()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    holder = type("Holder", (), {})()
    holder.group, holder.me = dist.new_group([0]), holder
    dist.destroy_process_group()
    del holder

    def collect(rank, world_size):
        gc.collect()
        return rank

    print(spawn(collect, 2), flush=True)
""")


def _run_script(script: str | Path, timeout_s: float, hung: str, env: dict[str, str] | None = None) -> str:
    """``script``'s standard output (a script's text, or its file); the test fails with ``hung`` if it runs
    past ``timeout_s`` (its forked ranks are killed with it) and with its standard error if it fails."""
    command = [sys.executable, str(script)] if isinstance(script, Path) else [sys.executable, "-c", script]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True, env=env)
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the forked ranks too
        process.communicate()
        pytest.fail(hung)
    assert process.returncode == 0, err
    return out


# The same through moetrain's own calls: a lone process's world (``join_world``) with a group from
# ``world.new_group``, as an in-process run builds its layout's, then ``spawn``: nothing of this module may keep
# the group once its world is gone, or a forked rank frees it (the test suite hung so in CI).
OWN_GROUPS = textwrap.dedent("""
    import torch
    from moetrain.distributed import world

    with world.join_world(torch.device("cpu")):
        world.new_group([0])

    def rank_of(rank, world_size):
        return rank

    print(world.spawn(rank_of, 2), flush=True)
""")


@pytest.mark.parametrize("script", [SCRIPT, OWN_GROUPS], ids=["cycle-held", "world.new_group"])
def test_spawn_after_an_in_process_group_does_not_hang(script: str):
    out = _run_script(script, 120, "spawn hung: a forked rank freed a process group inherited from its parent")
    assert out.strip() == "[0, 1]"


def _timeout_s(group: dist.ProcessGroup) -> float:
    """A gloo group's collective timeout, in seconds."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _group_timeouts(rank: int, world_size: int) -> tuple[list[float], list[float], list[float]]:
    """The collective timeouts (s) of every group this rank is in: after joining with 600 s, after
    ``end_startup_timeout(5)``, and after a later call asking for more (which must not raise them)."""
    from torch.distributed.device_mesh import init_device_mesh

    from moetrain.distributed import world

    pair = [world.new_group([0, 1]), world.new_group([2, 3])][rank // 2]  # every rank builds every group
    mine = [world.new_group([r]) for r in range(world_size)][rank]
    mesh = init_device_mesh("cpu", (2, 2)).get_group(1)  # a group torch builds, not world.new_group
    groups = [dist.group.WORLD, pair, mine, mesh]

    def timeouts() -> list[float]:
        return [_timeout_s(g) for g in groups]

    joined = timeouts()
    world.end_startup_timeout(5)
    lowered = timeouts()
    world.end_startup_timeout(60)
    return joined, lowered, timeouts()


def test_the_startup_timeout_ends_on_every_group_a_rank_is_in():
    from moetrain.distributed.world import spawn

    for joined, lowered, kept in spawn(_group_timeouts, 4, timeout_s=600):
        assert joined == [600.0, 600.0, 600.0, 1800.0]  # torch's own default for the mesh's group
        assert lowered == kept == [5.0] * 4


def _timeouts_around_a_run(rank: int, world_size: int) -> tuple[float, float]:
    """The world's collective timeout once the run's first step lowered it, and after the run."""
    from _parity import run_spec, train_rows

    import moetrain.train.trainer as trainer_module
    from moetrain.config import ParallelConfig, TrainingConfig

    during: list[float] = []
    lower = trainer_module.end_startup_timeout

    def lower_and_read(timeout_s: float) -> None:
        lower(timeout_s)
        during.append(_timeout_s(dist.group.WORLD))

    trainer_module.end_startup_timeout = lower_and_read  # in this forked rank only
    training = TrainingConfig(steps=2, global_batch=4, micro_batch=2, seq_len=16, warmup_steps=1)
    train_rows(run_spec(training, ParallelConfig(dp=2), None, timeout_s=5.0))
    return during[0], _timeout_s(dist.group.WORLD)


def test_a_run_gives_the_world_its_timeout_back_when_it_ends():
    # spawn's world waits 600 s; the run lowers it to its own 5 s after its first step and, ending, puts the
    # 600 s back: a rank whose layout ends first waits for the others that long (in CI a rank done with one
    # layout gave up at the world's last barrier after the run's 60 s, its peers still compiling another)
    from moetrain.distributed.world import spawn

    assert spawn(_timeouts_around_a_run, 2, timeout_s=600) == [(5.0, 600.0)] * 2


# Three spawns in one process, the middle one failing: it raises with a failed rank's message (every rank raises,
# as whichever failure torch.multiprocessing sees first is the one reported), and the spawn after it, whose
# parent hosts a new store on a new port, runs.
SEQUENCE = textwrap.dedent("""
    import torch.distributed as dist
    from moetrain.distributed.world import spawn

    def total(rank, world_size):
        return dist.get_world_size(), rank

    def refuse(rank, world_size):
        raise ValueError(f"rank {rank} refuses")

    print(spawn(total, 3), flush=True)
    try:
        spawn(refuse, 2, timeout_s=30)
    except Exception as error:
        print("raised:", " refuses" in str(error), flush=True)
    print(spawn(total, 2), flush=True)
""")


def test_spawn_fails_with_its_rank_and_the_next_spawn_runs(tmp_path):
    """... and leaves nothing in the temp folder: torch.multiprocessing writes the failed ranks' tracebacks
    to files there and does not remove them."""
    out = _run_script(SEQUENCE, 180, "spawn hung after a failed spawn", env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert out.split("\n")[:3] == ["[(3, 0), (3, 1), (3, 2)]", "raised: True", "[(2, 0), (2, 1)]"], out
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def test_each_torchrun_attempt_joins_the_agents_store_under_its_own_keys(monkeypatch) -> None:
    """Under torchrun every rank is a client of the agent's store (no rank binds a port), and a restarted
    attempt's keys are apart from the failed one's, so no rank reads a dead peer's address."""
    import datetime

    import torch.distributed as dist

    from moetrain.distributed.world import _agent_store_of_this_attempt

    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert _agent_store_of_this_attempt(10.0) is None  # spawn, Ray, or torchrun not sharing its store
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        _agent_store_of_this_attempt(10.0).set("rank0/address", f"from attempt {attempt}")
    assert agent.get("moetrain/attempt0/rank0/address") == b"from attempt 0"
    assert agent.get("moetrain/attempt1/rank0/address") == b"from attempt 1"


# A process that ran a (compiled) backward, then ``spawn`` of ranks that run one. A file, not ``-c``: ranks
# started afresh import the function from it.
AFTER_A_BACKWARD = textwrap.dedent("""
    import torch
    from moetrain.distributed.world import spawn, start_method

    def backward(rank, world_size):
        x = torch.full((2,), float(rank + 1), requires_grad=True)
        (x * x).sum().backward()
        return x.grad.tolist()

    if __name__ == "__main__":
        torch.compile(torch.nn.Linear(4, 4), backend="eager")(torch.randn(2, 4)).sum().backward()
        print(start_method("gloo"), spawn(backward, 2), flush=True)
""")


def test_ranks_spawned_after_a_compiled_backward_run_their_own_backward(tmp_path: Path) -> None:
    """On a torch built for CUDA (or ROCm), a compiled backward in the parent makes every forked child refuse
    autograd, GPU or not (torch 2.11+cu130 on this CPU); ``spawn`` then starts its ranks afresh. A CPU-only
    build keeps forking."""
    script = tmp_path / "after_a_backward.py"
    script.write_text(AFTER_A_BACKWARD)
    accelerator_build = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
    out = _run_script(script, 180, "spawn hung after a compiled backward")
    assert out.strip() == f"{'spawn' if accelerator_build else 'fork'} [[2.0, 2.0], [4.0, 4.0]]", out
