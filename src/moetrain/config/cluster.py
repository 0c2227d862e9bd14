"""Cluster (hardware) config: per-device peaks, memory and the two link tiers.

Figures for the presets come from ``shared/validation/README.md`` (hardware table). Bandwidths are
one direction, per device, in GB/s (10^9 bytes/s); HBM in GB (10^9 bytes) as vendors quote it.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

CollectiveKind = Literal["all_reduce", "all_gather", "all_to_all"]
COLLECTIVE_KINDS: tuple[str, ...] = get_args(CollectiveKind)


class CollectiveLink(BaseModel):
    """The in-node link as one kind of collective sees it, fitted to that kind's measured times
    (``moetrain profile --comm-ranks``): gloo's all-reduce, for one, runs an algorithm of its own whose
    per-message cost is several times an all-gather's."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    latency_us: float = Field(ge=0)
    gbps: float = Field(gt=0)
    """Bandwidth the collective reached (bus efficiency included)."""


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    name: str
    device: str
    """Accelerator id, as in the validation schema's ``hardware`` column."""
    peak_tflops_bf16: float = Field(gt=0)
    peak_tflops_fp8: float | None = Field(default=None, gt=0)
    peak_tflops_fp4: float | None = Field(default=None, gt=0)
    """Dense FP4 (NVFP4/MXFP4) peak where the part has one (Blackwell). No precision the cost model prices
    runs in it yet; ``peak_flops("fp4")`` reports it."""
    hbm_gb: float = Field(gt=0)
    hbm_bandwidth_tbps: float = Field(gt=0)
    devices_per_node: int = Field(gt=0)
    intra_node_gbps: float = Field(gt=0)
    """Per-device, one-way bandwidth over the in-node fabric (NVLink, HCCS)."""
    inter_node_gbps: float = Field(gt=0)
    """Per-device, one-way network bandwidth between nodes (InfiniBand, RoCE)."""
    scale_up_domain: int | None = Field(default=None, gt=0)
    """Devices that share the in-node fabric when it spans several hosts: a GB200 NVL72 rack's NVLink joins
    18 trays of 4 GPUs, 72 devices at ``intra_node_gbps``; beyond the domain, traffic takes the network
    (``inter_node_gbps``). None: the fabric ends at the node (``devices_per_node``)."""
    intra_node_mesh_links: int | None = Field(default=None, gt=0)
    """The in-node fabric is a full mesh: every device has this many direct links, one to each other device
    of the node (Ascend HCCS: 7 in an 8-NPU node), over which ``intra_node_gbps`` is split evenly. A
    collective among q ranks of the node then reaches only the q − 1 links to its peers, (q − 1)/links of
    the bandwidth, and a send one link. None: a switch (NVSwitch) gives every device its whole bandwidth
    towards any set of peers."""
    intra_node_latency_us: float = Field(default=3.0, ge=0)
    inter_node_latency_us: float = Field(default=10.0, ge=0)
    host_cores: int | None = Field(default=None, gt=0)
    """Where the devices are ranks computing on one host's cores (``cpu``): the cores of a node. Ranks beyond
    them share the cores, and every rank shares the node's memory (``for_ranks``). None: each device has
    compute and memory of its own."""
    core_share: float = Field(default=1.0, gt=0, le=1)
    """Of a core's time, the share each rank gets where ranks outnumber ``host_cores``, over the shared
    host's slowdown (set by ``for_ranks``; the peaks above are already scaled by it)."""
    shared_host_slowdown: float = Field(default=1.0, ge=1.0)
    """With ``host_cores``: a rank's compute time when ranks keep every core busy over its time alone (the
    cores share the host's memory bandwidth, caches and clock). Measured by ``moetrain profile
    --comm-ranks N``; 1: ranks do not slow each other."""
    collective_links: dict[CollectiveKind, CollectiveLink] = Field(default_factory=dict)
    """Measured in-node links by collective kind; a kind given here is priced on its own link instead of
    ``intra_node_*`` (and the calibration's ``bus_intra``). Empty for the presets."""
    notes: str = ""

    def __hash__(self) -> int:
        # frozen, and used as a key (workloads group by it): the links' mapping hashes as its sorted items
        return hash(tuple((name, tuple(sorted(value.items())) if isinstance(value, dict) else value)
                          for name, value in self.__dict__.items()))

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gb * 1e9

    @property
    def fabric_devices(self) -> int:
        """Devices reachable over the in-node fabric (NVLink, HCCS): the scale-up domain where one spans
        several hosts, else the node. The cost model prices a group's links by it."""
        return self.scale_up_domain or self.devices_per_node

    @property
    def host_is_device(self) -> bool:
        """The CPU computes: the host's time to issue the work (Python, dispatcher) is spent on the same
        cores as the work, so it adds to it instead of hiding behind it."""
        return self.device == "cpu"

    def for_ranks(self, ranks_on_node: int) -> ClusterConfig:
        """The devices as ``ranks_on_node`` ranks of one host see them: with ``host_cores``, the node's
        memory split among them, and compute and memory bandwidth split too where they outnumber the
        cores (each then has ``host_cores / ranks_on_node`` of a core's time), and slowed by
        ``shared_host_slowdown`` as they share the host. Unchanged without it."""
        if self.host_cores is None or ranks_on_node <= 1 or self.core_share < 1.0:
            return self  # a host cluster for one rank, or already split
        # the slowdown was measured with every core busy: ranks that leave cores idle pay its share
        busy = 1.0 if self.host_cores <= 1 else min(1.0, (ranks_on_node - 1) / (self.host_cores - 1))
        share = min(1.0, self.host_cores / ranks_on_node) / (1.0 + (self.shared_host_slowdown - 1.0) * busy)
        return self.model_copy(update={
            "peak_tflops_bf16": self.peak_tflops_bf16 * share,
            "peak_tflops_fp8": None if self.peak_tflops_fp8 is None else self.peak_tflops_fp8 * share,
            "peak_tflops_fp4": None if self.peak_tflops_fp4 is None else self.peak_tflops_fp4 * share,
            "hbm_bandwidth_tbps": self.hbm_bandwidth_tbps * share,
            "hbm_gb": self.hbm_gb / ranks_on_node,
            "core_share": share,
        })

    def unshared(self) -> ClusterConfig:
        """The host as one rank with the cores to itself (the inverse of ``for_ranks``' compute split)."""
        if self.core_share == 1.0:
            return self
        share = self.core_share
        return self.model_copy(update={
            "peak_tflops_bf16": self.peak_tflops_bf16 / share,
            "peak_tflops_fp8": None if self.peak_tflops_fp8 is None else self.peak_tflops_fp8 / share,
            "peak_tflops_fp4": None if self.peak_tflops_fp4 is None else self.peak_tflops_fp4 / share,
            "hbm_bandwidth_tbps": self.hbm_bandwidth_tbps / share,
            "core_share": 1.0,
        })

    def peak_flops(self, precision: str = "bf16") -> float:
        """Peak dense FLOP/s per device for ``precision`` (fp4 falls back to fp8, fp8 to bf16 where absent)."""
        if precision == "fp4" and self.peak_tflops_fp4:
            return self.peak_tflops_fp4 * 1e12
        if precision in ("fp8", "fp4") and self.peak_tflops_fp8:
            return self.peak_tflops_fp8 * 1e12
        return self.peak_tflops_bf16 * 1e12
