"""A run on several nodes: the same ``moetrain train`` (or ``moetrain rl``) command on each node, with
``--nnodes M --rdzv-endpoint HOST:PORT`` and ``--nproc N`` ranks per node, each starting torchrun's agent
with torchrun's own multi-node flags (``--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT``).

torchrun's c10d rendezvous numbers the nodes as they join (it ignores ``--node-rank``): node ``g`` holds the
global ranks ``g·N .. g·N + N − 1`` (where groups may sit on them: ``moetrain.config.nodes``). Every node
builds the run spec from its own flags and files (the same ``--config``, the same flags, paths every node
reads); the ranks compare the specs once joined (``check_same_spec``) and a node whose spec differs is one
error naming it.

Torch-free at import: the CLI sizes the launch with it; ``check_same_spec`` imports torch when a rank calls it.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

from moetrain.config.nodes import node_of
from moetrain.errors import UserError

RDZV_ID = "moetrain"
"""The rendezvous id every node's agent gives (one job per endpoint)."""


@dataclass(frozen=True)
class Nodes:
    """Where this node's torchrun agent joins the others."""

    count: int = 1
    """Nodes of the run (``--nnodes``)."""
    endpoint: str | None = None
    """``HOST:PORT`` of the c10d rendezvous (``--rdzv-endpoint``); None on one node."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise UserError(f"--nnodes {self.count} must be ≥ 1")
        if self.count > 1 and self.endpoint is None:
            raise UserError(f"--nnodes {self.count} needs --rdzv-endpoint HOST:PORT: a host every node reaches "
                            "(e.g. the first node's) and a free port")
        if self.count == 1 and self.endpoint is not None:
            raise UserError(f"--rdzv-endpoint {self.endpoint} joins several nodes: give --nnodes M too")
        if self.endpoint is not None and not re.fullmatch(r"[^\s:]+:\d{1,5}", self.endpoint):
            raise UserError(f"--rdzv-endpoint {self.endpoint}: give HOST:PORT, e.g. node0:29400")

    def torchrun_args(self, ranks_per_node: int) -> list[str]:
        """torchrun's flags for this node's agent: ``--standalone`` on one node."""
        if self.count == 1:
            return ["--standalone", f"--nproc-per-node={ranks_per_node}"]
        return [f"--nnodes={self.count}", f"--nproc-per-node={ranks_per_node}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={RDZV_ID}"]


def spans_nodes() -> bool:
    """Whether this rank's world spans several nodes (torchrun's environment)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) not in (0, int(os.environ.get("WORLD_SIZE", "1")))


def spec_fingerprint(spec_json: str) -> str:
    return hashlib.sha256(spec_json.encode("utf-8")).hexdigest()[:16]


def check_same_spec(spec_json: str, command: str) -> None:
    """Every rank's spec (``spec_json``, its node-local fields blanked) equals rank 0's; else a ``UserError``
    naming the first rank whose spec differs and its node. Collective: every rank calls it once joined."""
    import torch.distributed as dist  # lazy, heavy: only a rank of a joined group calls this

    prints: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(prints, spec_fingerprint(spec_json))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    for rank, value in enumerate(prints):
        if value != prints[0]:
            raise UserError(f"rank {rank} (node {node_of(rank, per_node)}) built another run spec than rank 0 "
                            f"(node 0): start every node with the same {command} flags, the same --config and "
                            "paths that every node reads")
