"""What ``moetrain profile`` computes: the device probes (``train.profiler``) turned into a calibration file
for the simulator, and, with collectives on local ranks, the fitted in-node link and its cluster file. The
CLI parses the flags and prints; this module measures, fits and writes."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from moetrain.config import cluster_for_device, load_cluster_config, load_model_config
from moetrain.config.cluster import ClusterConfig
from moetrain.config.model import ModelConfig
from moetrain.errors import UserError
from moetrain.planner.calibration import Calibration, arch_of, load_calibration
from moetrain.planner.comm import LinkFit, fit_link
from moetrain.train.profiler import probe_device, profile_collectives, profile_shared_host, profile_sync_rates


@dataclass(frozen=True)
class ProfileRun:
    """One ``moetrain profile``: the measurements, the efficiencies and the calibration that carries them."""

    cluster: ClusterConfig
    model: ModelConfig
    device: str
    measured: dict
    """The raw measurements (``DeviceProfile.measured``; with collectives: ``collectives``, ``link``,
    ``weight_sync`` and, on a CPU host, ``shared_host``)."""
    efficiencies: dict[str, float]
    """This device's architecture's values in ``calibration``."""
    calibration: Calibration
    """The shipped calibration with this architecture's values replaced by ``efficiencies``."""
    comm_ranks: int | None = None
    link: LinkFit | None = None
    """The in-node link fitted to the collectives on ``comm_ranks`` local ranks."""
    link_cluster: ClusterConfig | None = None
    """``cluster`` with the fitted link (and, on a CPU host, the ranks' measured slowdown)."""

    @property
    def arch(self) -> str:
        return arch_of(self.cluster.device)

    def write_link_cluster(self, path: str | Path) -> None:
        """The cluster with the fitted link as a YAML file (use it as ``--cluster``)."""
        assert self.link_cluster is not None, "no collectives were measured"
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"# {self.cluster.name} with its in-node link fitted to gloo collectives on {self.comm_ranks} "
                    "local ranks (moetrain profile --comm-ranks)\n")
            yaml.safe_dump(self.link_cluster.model_dump(mode="json"), f, sort_keys=False)


def resolve_device(device: str) -> str:
    """"auto": cuda where torch sees a GPU, else cpu; a cuda device asked for without one is refused."""
    resolved = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if resolved.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no GPU; use --device cpu")
    return resolved


def profile_calibration(cluster_name: str | None, model_name: str, device: str, repeats: int,
                        comm_ranks: int | None = None) -> ProfileRun:
    """Probe ``device`` (``auto``, ``cpu``, ``cuda``) against ``cluster_name``'s peaks (None: ``cpu``, or the
    preset closest to the local GPU) with ``model_name``'s shapes; with ``comm_ranks``, also gloo collectives
    on that many local ranks, the weight sync's rates and the link fitted to them (whose bandwidth is what
    the collectives reached: the calibration then counts the link at bus efficiency 1)."""
    device = resolve_device(device)
    cluster_name = cluster_name or cluster_for_device(
        "cpu" if device == "cpu" else torch.cuda.get_device_name(torch.device(device)))
    cluster = load_cluster_config(cluster_name)
    model = load_model_config(model_name)
    profile = probe_device(cluster, model, device, repeats)
    measured, efficiencies = profile.measured(), profile.efficiencies()
    link = link_cluster = None
    if comm_ranks is not None:
        link, link_cluster = _profile_link(cluster, model, comm_ranks, repeats, measured)
        efficiencies["bus_intra"] = 1.0  # the fitted bandwidth is what the collectives reached
    base = load_calibration()
    per_arch = dict(base.per_arch)
    per_arch[arch_of(cluster.device)] = efficiencies
    calibration = Calibration(base.global_params, per_arch,
                              f"moetrain profile --cluster {cluster_name} --device {device} on this machine")
    return ProfileRun(cluster, model, device, measured, efficiencies, calibration, comm_ranks, link, link_cluster)


def _profile_link(cluster: ClusterConfig, model, comm_ranks: int, repeats: int,
                  measured: dict) -> tuple[LinkFit, ClusterConfig]:
    """Collectives, the sync's rates and (ranks on a CPU host) how the ranks slow each other into
    ``measured``; the fitted link and the cluster that carries it."""
    collectives = profile_collectives(comm_ranks, repeats=repeats)
    link = fit_link([m for m in collectives if m["kind"] != "send_recv"])  # sends stream: no round trip
    measured.update(collectives=collectives, link=asdict(link), weight_sync=profile_sync_rates(repeats))
    update = {"name": f"{cluster.name}-{comm_ranks}-ranks"}
    if cluster.host_cores is not None:  # ranks computing on one host's cores
        measured["shared_host"] = profile_shared_host(model, min(comm_ranks, cluster.host_cores), repeats)
        update["shared_host_slowdown"] = measured["shared_host"]["slowdown"]
    return link, link.cluster(cluster).model_copy(update=update)
