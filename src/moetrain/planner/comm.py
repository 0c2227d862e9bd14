"""Collective-communication times, each on the link it really crosses.

Every function is numpy-broadcastable over its size and group arguments, so the planner prices many
layouts in one call. Time = latency + bytes / (link bandwidth × bus efficiency), where the bus
efficiency comes from the calibration (``Efficiency.bus_intra`` / ``bus_inter``).

Placement convention (Megatron order, innermost first): tp, cp, then the data-parallel ranks (on
which the expert grid etp × ep × edp is folded), then pp. A group of ``group`` ranks laid out with
``stride`` between consecutive members has ``ranks_per_node`` of its members in each node.

Rings (all-gather, reduce-scatter, all-reduce) run at the slowest link they cross; the all-to-all
splits its bytes over both link kinds.
The expert-balancing code also imports ``alltoall_time`` and ``expert_compute_time`` from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from moetrain.config.cluster import COLLECTIVE_KINDS, ClusterConfig, CollectiveLink
from moetrain.planner.calibration import Efficiency, load_calibration

# Re-exported (see __all__): one import site for communication and expert compute times.
from moetrain.planner.compute import ExpertShard, expert_compute_time, gemm_time

__all__ = [
    "ExpertShard",
    "RankGroup",
    "allgather_time",
    "allreduce_time",
    "alltoall_time",
    "LinkFit",
    "alltoall_volume",
    "collective_terms",
    "efficiency_for",
    "expert_compute_time",
    "fit_link",
    "gemm_time",
    "link_residuals",
    "mesh_share",
    "p2p_time",
    "ranks_per_node",
    "reduce_scatter_time",
]


@lru_cache(maxsize=64)
def _default_efficiency(device: str) -> Efficiency:
    return load_calibration().for_device(device)


def efficiency_for(cluster: ClusterConfig, efficiency: Efficiency | None = None) -> Efficiency:
    """The given efficiencies, or the shipped calibration's values for this cluster's device."""
    return efficiency if efficiency is not None else _default_efficiency(cluster.device)


def ranks_per_node(group, stride, devices_per_node):
    """Members of a group (``group`` ranks, ``stride`` apart) that share one node."""
    group = np.asarray(group)
    per_node = np.maximum(devices_per_node // np.maximum(np.asarray(stride), 1), 1)
    return np.minimum(group, per_node)


@dataclass(frozen=True)
class RankGroup:
    """A group of ``size`` ranks laid out ``stride`` apart (the placement convention above) on nodes of
    ``devices_per_node`` devices. Fields broadcast like the functions' arguments."""

    size: object
    devices_per_node: object
    stride: object = 1

    @property
    def in_node(self):
        """Members that share one node (``ranks_per_node``)."""
        return ranks_per_node(self.size, self.stride, self.devices_per_node)


def _links(cluster: ClusterConfig, eff: Efficiency, kind: str | None = None) -> tuple[float, float, float, float]:
    """(in-node bandwidth, network bandwidth, in-node latency, network latency) for a collective of ``kind``:
    its measured in-node link where the cluster has one (``ClusterConfig.collective_links``)."""
    inter = cluster.inter_node_gbps * 1e9 * eff.bus_inter
    measured = cluster.collective_links.get(kind) if kind else None
    if measured is not None:
        return measured.gbps * 1e9, inter, measured.latency_us * 1e-6, cluster.inter_node_latency_us * 1e-6
    intra = cluster.intra_node_gbps * 1e9 * eff.bus_intra
    return intra, inter, cluster.intra_node_latency_us * 1e-6, cluster.inter_node_latency_us * 1e-6


def mesh_share(cluster: ClusterConfig, peers_in_node):
    """Share of the in-node bandwidth that a collective with ``peers_in_node`` members in the node (itself
    included) reaches: 1 on a switched fabric; on a full mesh of L links per device (``ClusterConfig.
    intra_node_mesh_links``) only the links to its peers carry it, min(q − 1, L)/L (a send: q = 2, one link;
    q = 1: 1, as nothing crosses the node's links)."""
    links = cluster.intra_node_mesh_links
    if not links:
        return 1.0
    q = np.asarray(peers_in_node, dtype=float)
    # alone in its node (q = 1) the collective has no in-node hop for the mesh to limit
    return np.where(q < 2.0, 1.0, np.minimum(q - 1.0, float(links)) / float(links))


def allgather_time(total_bytes, group, in_node, cluster: ClusterConfig, efficiency: Efficiency | None = None,
                   kind: str = "all_gather"):
    """Ring all-gather whose gathered output is ``total_bytes`` on every rank (same cost: reduce-scatter
    of an input of that size). ``in_node`` = members per node (see ``ranks_per_node``).

    Each rank sends (group−1)/group of the buffer (Thakur et al. 2005, ring cost). A ring that leaves
    the node runs one channel per member of the node, each over its own NIC, so the node boundary
    carries the ``in_node`` members' network bandwidth together, capped by the in-node link: a group of
    8 per node crossing nodes over 8 × 25 GB/s NICs sees ~200 GB/s bus bandwidth (what NCCL tests
    report on DGX A100), a group with one member per node sees one NIC."""
    eff = efficiency_for(cluster, efficiency)
    intra, inter, lat_intra, lat_inter = _links(cluster, eff, kind)
    group = np.maximum(np.asarray(group, dtype=float), 1.0)
    q = np.minimum(np.asarray(in_node, dtype=float), group)
    crosses = q < group
    if kind not in cluster.collective_links:
        intra = intra * mesh_share(cluster, q)
    bandwidth = np.where(crosses, np.minimum(intra, inter * q), intra)
    latency = np.where(crosses, lat_inter, lat_intra)
    t = (group - 1) / group * np.asarray(total_bytes, dtype=float) / bandwidth + (group - 1) * latency
    return np.where(group > 1, t, 0.0)


reduce_scatter_time = allgather_time


def allreduce_time(total_bytes, group, in_node, cluster: ClusterConfig, efficiency: Efficiency | None = None):
    """Ring all-reduce = reduce-scatter + all-gather of the same buffer (on the all-reduce's own link where
    the cluster has one measured)."""
    return 2.0 * allgather_time(total_bytes, group, in_node, cluster, efficiency, kind="all_reduce")


def alltoall_volume(tokens, hidden: int, top_k: int, dtype_bytes: float = 2.0):
    """Bytes one rank sends in one MoE dispatch (and again in the combine): every token goes to each of
    its ``top_k`` experts, so tokens·top_k·hidden·dtype_bytes, whatever the expert placement (the part
    that stays on the rank is subtracted by ``alltoall_time``)."""
    return np.asarray(tokens, dtype=float) * top_k * hidden * dtype_bytes


def alltoall_time(bytes_per_rank, group: RankGroup, cluster: ClusterConfig, hierarchical: bool | np.ndarray = False,
                  top_k: int = 1, efficiency: Efficiency | None = None):
    """Time of one expert-parallel all-to-all (dispatch or combine) in seconds.

    Args:
        bytes_per_rank: bytes one rank sends, all destinations together (``alltoall_volume``), with
            destinations spread evenly over the EP ranks (imbalance is priced by the caller).
        group: the expert-parallel group: its size, placed with the expert tensor-parallel size as stride.
        hierarchical: False: flat all-to-all, every (token, expert) copy bound for another node crosses
            the network. True: the SPEC §2 hierarchical scheme: each token crosses the network once per
            destination node (not once per expert), then an all-to-all inside the node over the fast
            links delivers it to the experts there.
        top_k: experts per token, used to turn the routed bytes into token bytes for the hierarchical
            all-gather.
    """
    eff = efficiency_for(cluster, efficiency)
    intra, inter, lat_intra, lat_inter = _links(cluster, eff, "all_to_all")
    ep = np.maximum(np.asarray(group.size, dtype=float), 1.0)
    q = np.asarray(ranks_per_node(ep, group.stride, group.devices_per_node), dtype=float)
    nodes = ep / q
    send = np.asarray(bytes_per_rank, dtype=float)
    if "all_to_all" not in cluster.collective_links:
        intra = intra * mesh_share(cluster, q)
    # Flat: 1/ep of the copies stay, (q-1)/ep go over in-node links, (ep-q)/ep over the network; the two
    # link kinds run concurrently, the slower one decides.
    flat = np.maximum((q - 1) / ep * send / intra, (ep - q) / ep * send / inter)
    flat = flat + np.where(nodes > 1, lat_inter, 0.0) + (q > 1) * lat_intra
    # Hierarchical: each token crosses the network once per remote node that hosts one of its experts
    # (with uniform routing a given node is hit with probability 1 − (1 − 1/nodes)^top_k), then an
    # in-node all-to-all delivers the copies to this node's experts.
    token_bytes = send / max(top_k, 1)
    nodes_hit = (nodes - 1) * (1.0 - (1.0 - 1.0 / nodes) ** top_k)
    gather = nodes_hit * token_bytes / inter + lat_inter
    local = (q - 1) / q * send / intra + (q > 1) * lat_intra
    hier = gather + local
    return np.where(ep > 1, np.where(hierarchical, np.where(nodes > 1, hier, flat), flat), 0.0)


def p2p_time(num_bytes, cross_node, cluster: ClusterConfig, efficiency: Efficiency | None = None):
    """Pipeline send/recv of ``num_bytes`` between neighbouring stages (in-node or across nodes)."""
    eff = efficiency_for(cluster, efficiency)
    intra, inter, lat_intra, lat_inter = _links(cluster, eff)
    num_bytes = np.asarray(num_bytes, dtype=float)
    intra = intra * mesh_share(cluster, 2)
    return np.where(cross_node, num_bytes / inter + lat_inter, num_bytes / intra + lat_intra)


# ----- a link measured on this machine (``moetrain profile --comm``) -----
def collective_terms(kind: str, group: int) -> tuple[float, float]:
    """(latencies, share of the bytes on the link) of one collective as the formulas above price it, so
    that time = latencies · latency + share · bytes / bandwidth (in-node, ``bytes`` as each function takes
    them): a ring all-gather or reduce-scatter crosses group − 1 steps carrying (g−1)/g of its output, an
    all-reduce twice that, an all-to-all one latency and the (g−1)/g of its bytes that leave the rank, a
    send one latency and all of its bytes."""
    g = float(group)
    if kind in ("all_gather", "reduce_scatter"):
        return g - 1.0, (g - 1.0) / g
    if kind == "all_reduce":
        return 2.0 * (g - 1.0), 2.0 * (g - 1.0) / g
    if kind == "all_to_all":
        return 1.0, (g - 1.0) / g
    if kind == "send_recv":
        return 1.0, 1.0
    raise ValueError(f"unknown collective {kind!r}")


@dataclass(frozen=True)
class LinkFit:
    """A link's latency and bandwidth fitted to measured collectives: over all of them, and for each kind
    of collective on its own measurements (``kinds``), which is what the formulas price that kind with."""

    latency_us: float
    gbps: float
    """Bandwidth the formulas see (bus efficiency included: use with ``bus_intra`` = 1)."""
    residual_pct: dict[str, float]
    """Per measurement (``kind/group/bytes``): (formula − measured) / measured, in %, with its kind's link."""
    kinds: dict[str, LinkFit] = field(default_factory=dict)
    """The fit of each collective kind with measurements of two sizes or more (``COLLECTIVE_KINDS``)."""

    def cluster(self, cluster: ClusterConfig) -> ClusterConfig:
        """``cluster`` with this link as its in-node link, and each fitted kind's as that kind's."""
        links = {kind: CollectiveLink(latency_us=fit.latency_us, gbps=fit.gbps) for kind, fit in self.kinds.items()}
        return cluster.model_copy(update={"intra_node_gbps": self.gbps, "intra_node_latency_us": self.latency_us,
                                          "collective_links": links})


def link_residuals(measurements: list[dict], latency_us: float, gbps: float) -> dict[str, float]:
    """Per measurement (``kind/group/bytes``): (formula − measured) / measured, in %, on a link of
    ``latency_us`` and ``gbps``."""
    out = {}
    for m in measurements:
        latencies, share = collective_terms(m["kind"], m["group"])
        formula = latencies * latency_us * 1e-6 + share * m["bytes"] / (gbps * 1e9)
        out[f"{m['kind']}/{m['group']}/{m['bytes']}"] = float((formula - m["seconds"]) / m["seconds"] * 100)
    return out


def _fit_one(measurements: list[dict]) -> tuple[float, float]:
    """(latency µs, bandwidth GB/s) for which ``collective_terms`` best reproduce ``measurements``: least
    squares on the relative error, both terms kept non-negative (an infinite bandwidth: no byte term)."""
    terms = [collective_terms(m["kind"], m["group"]) for m in measurements]
    seconds = np.array([m["seconds"] for m in measurements], dtype=float)
    design = np.array([[lat, share * m["bytes"]] for (lat, share), m in zip(terms, measurements)], dtype=float)
    weighted = design / seconds[:, None]
    (latency, per_byte), *_ = np.linalg.lstsq(weighted, np.ones_like(seconds), rcond=None)
    if per_byte <= 0 or latency < 0:  # refit the one term alone
        column = 0 if per_byte <= 0 else 1
        only = weighted[:, column]
        value = float(only @ np.ones_like(seconds) / (only @ only))
        latency, per_byte = (value, 0.0) if column == 0 else (0.0, value)
    return float(latency) * 1e6, float(1e-9 / per_byte) if per_byte > 0 else float("inf")


def fit_link(measurements: list[dict]) -> LinkFit:
    """Latency and bandwidth for which ``collective_terms`` best reproduce ``measurements`` (each
    {kind, group, bytes, seconds}; least squares on the relative error, so that small messages weigh as much
    as large ones; both kept non-negative), over all of them and for each kind alone. A kind whose own fit
    finds no bandwidth term (every size latency-bound) takes the overall bandwidth."""
    if not measurements:
        raise ValueError("no collective measurements to fit")
    latency, gbps = _fit_one(measurements)
    residual = link_residuals(measurements, latency, gbps)
    kinds = {}
    for kind in COLLECTIVE_KINDS:
        own = [m for m in measurements if m["kind"] == kind]
        if len({m["bytes"] for m in own}) < 2:
            continue
        kind_latency, kind_gbps = _fit_one(own)
        kind_gbps = kind_gbps if np.isfinite(kind_gbps) else gbps
        kinds[kind] = LinkFit(kind_latency, kind_gbps, link_residuals(own, kind_latency, kind_gbps))
        residual.update(kinds[kind].residual_pct)
    return LinkFit(latency, gbps, residual, kinds)
