"""Helper for the several-node tests: start the same ``moetrain`` command as several "nodes" on this machine,
each its own process with its own torchrun agent, joined by c10d rendezvous on a free local port."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range, from which every port-0 bind is served."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port for the rendezvous, below the ephemeral range: the agents bind it a second or two later, and
    a port from that range could meanwhile be handed to any process that binds port 0 (the other test worker's
    stores and gloo sockets): EADDRINUSE. Drawn at random, so the other worker's draw rarely meets it."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low}")


def run_as_nodes(argv: list[str], nodes: int, log_root: Path, timeout_s: float = 240,
                 node_argv: dict[int, list[str]] | None = None, expect: int = 0) -> list[str]:
    """``python -m moetrain *argv --nnodes N --rdzv-endpoint 127.0.0.1:PORT --log-dir log_root/nodeI`` on each
    of ``nodes`` "nodes" at once (node I's command ends with ``node_argv[I]``); every one must exit ``expect``.
    Their stderr, in node order."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    node_argv = node_argv or {}
    procs = [subprocess.Popen([sys.executable, "-m", "moetrain", *argv, "--nnodes", str(nodes), "--rdzv-endpoint",
                               endpoint, "--log-dir", str(log_root / f"node{i}"), *node_argv.get(i, [])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(nodes)]
    errors = []
    for i, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        log = log_root / f"node{i}" / "torchrun.log"
        assert proc.returncode == expect, (i, err[-2000:], log.read_text()[-3000:] if log.exists() else "")
        errors.append(err)
    return errors
