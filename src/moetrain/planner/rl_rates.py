"""The RL step's measured host rates as a file: what ``moetrain profile --rl-out`` writes beside the
calibration and ``moetrain simulate --rl --rl-rates`` reads. The calibration holds the training step's
efficiencies; an RL step on a CPU also spends host time the calibration does not price (the eager
generation loop's layer passes, the sampler, the rollout engine: ``HostCosts``) and the weight sync's
copies and CRC-32s (``SyncRates``). A file may also hold one disaggregated job's CPU-seconds per step and
process, probed with its roles apart (``moetrain profile --rl-out FILE --rl-job rl.yaml``: ``ProbedRoleCPU``),
which ``moetrain simulate --rl`` then shares over the probed machine's cores (``planner.rl_cores``) for that
job at k ≥ 1, and one colocated job's CPU-seconds per step and rank (``ProbedRankCPU``), shared the same way
for colocated jobs of its ranks and kind of k; files without them load as before. Torch-free: measuring
them is ``moetrain.rl.rates``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import yaml

from moetrain.errors import UserError
from moetrain.planner.calibration import read_profile_file
from moetrain.planner.generation import HostCosts
from moetrain.planner.rl_cores import RankCPU, RoleCPU
from moetrain.planner.rl_step import RLLayout, SyncRates

PROBE_COMMAND = "moetrain profile --rl-out FILE --rl-job rl.yaml"
"""What writes a file's ``role_cpu`` section (named in the errors that refuse one)."""


@dataclass(frozen=True)
class ProbedRoleCPU:
    """One disaggregated job's CPU-seconds per step and process with its roles apart (``RoleCPU``), and the
    cores of the machine they were probed on, which its processes share at k ≥ 1."""

    work: RoleCPU
    cores: float
    """``os.cpu_count()`` where the probe ran: what ``rl_cores.shared_cpu_step`` shares the works over."""

    def to_dict(self) -> dict:
        return {"rollout_s": list(self.work.rollout_s), "trainer_s": list(self.work.trainer_s),
                "overlap": list(self.work.overlap), "cores": self.cores}

    def on(self, layout: RLLayout) -> RLLayout:
        """``layout`` as ``moetrain simulate --rl`` and ``moetrain plan --rl`` price it with this probe: a
        disaggregated layout at k ≥ 1 carries the probed CPU-seconds per process and the probed machine's
        cores, so its step is those works shared over the cores (``rl_step.price_rl_step``, ``rl_cores``);
        any other layout as it was (at k = 0 the roles take turns, and a colocated job shares no pipeline
        round). ``rl_step.role_cpu_mismatch`` says when the probe's processes are not the layout's."""
        if layout.placement != "disaggregated" or layout.staleness == 0:
            return layout
        return replace(layout, role_cpu=self.work, shared_cores=self.cores)


@dataclass(frozen=True)
class ProbedRankCPU:
    """One colocated job's CPU-seconds per step and rank (``RankCPU``), probed on the job at its k, and the
    cores of the machine they were probed on, which its ranks share."""

    work: RankCPU
    cores: float
    """``os.cpu_count()`` where the probe ran: what ``rl_cores.colocated_cpu_step`` shares the works over."""

    def to_dict(self) -> dict:
        return {"rank_s": list(self.work.rank_s), "staleness": self.work.staleness, "cores": self.cores}

    def on(self, layout: RLLayout) -> RLLayout:
        """``layout`` as ``simulate --rl`` and ``plan --rl`` price it with this probe: a colocated layout
        carries the probed CPU-seconds per rank and the probed machine's cores, so its step is those works
        shared over the cores (``rl_step.price_rl_step``); a disaggregated one as it was.
        ``rl_step.rank_cpu_mismatch`` says when the probe's ranks are not the layout's."""
        if layout.placement != "colocated":
            return layout
        return replace(layout, rank_cpu=self.work, shared_cores=self.cores)


@dataclass(frozen=True)
class RLRates:
    """Host costs of generation and the weight sync's rates, measured on one machine for one policy: what
    ``moetrain simulate --rl`` and ``moetrain plan --rl`` price with (``--rl-rates``)."""

    host: HostCosts
    sync: SyncRates | None = None
    """The weight sync's measured host rates; None: not measured (the link alone prices the sync)."""
    measured_on: str = ""
    """What measured them (the command, the model)."""
    role_cpu: ProbedRoleCPU | None = None
    """One job's probed CPU-seconds per process (``--rl-job``); None: not probed (the phases price the step)."""
    rank_cpu: ProbedRankCPU | None = None
    """One colocated job's probed CPU-seconds per rank (``--rl-job`` of a colocated job); None: not probed."""

    def on(self, layout: RLLayout) -> RLLayout:
        """``layout`` as the probes price it (``ProbedRoleCPU.on``, ``ProbedRankCPU.on``)."""
        layout = self.role_cpu.on(layout) if self.role_cpu else layout
        return self.rank_cpu.on(layout) if self.rank_cpu else layout

    def to_dict(self) -> dict:
        data = {"measured_on": self.measured_on, "host": asdict(self.host)}
        data |= {"sync": asdict(self.sync)} if self.sync is not None else {}
        data |= {"role_cpu": self.role_cpu.to_dict()} if self.role_cpu is not None else {}
        return data | ({"rank_cpu": self.rank_cpu.to_dict()} if self.rank_cpu is not None else {})

    def save(self, path: str | Path) -> None:
        path, data = Path(path), self.to_dict()
        path.write_text(json.dumps(data, indent=2) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False))


def _section(data: dict, name: str, cls, source: str):
    section = data.get(name)
    known = {f.name for f in fields(cls)}
    if not isinstance(section, dict) or set(section) - known:
        raise UserError(f"{source}: '{name}' must be a mapping of {sorted(known)}, as `moetrain profile --rl-out` "
                        "writes it")
    for field in fields(cls):
        if field.name in section:
            _check_value(section[field.name], field, f"{name}.{field.name}", source)
    return cls(**section)


def _check_value(value: object, field, where: str, source: str) -> None:
    """A rate is a number ≥ 0 (None where its field allows it), a flag a boolean: a value YAML read as a string
    (``2.0e9`` without the exponent's sign) would otherwise fail deep in the pricing."""
    if isinstance(field.default, bool):
        if not isinstance(value, bool):
            raise UserError(f"{source}: {where} must be true or false (got {value!r})")
        return
    if value is None and "None" in str(field.type):
        return
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise UserError(f"{source}: {where} must be a number ≥ 0 (got {value!r}); write exponents with a sign "
                        "(2.0e+9) or measure again with `moetrain profile --rl-out`")


def load_rl_rates(path: str | Path) -> RLRates:
    """A file ``moetrain profile --rl-out`` wrote (YAML, or JSON by its suffix)."""
    data = read_profile_file(path, "RL rates", "--rl-out FILE", "'host' and 'sync' sections")
    return RLRates(_section(data, "host", HostCosts, str(path)), _section(data, "sync", SyncRates, str(path)),
                   str(data.get("measured_on", "")), _role_cpu_section(data.get("role_cpu"), str(path)),
                   _rank_cpu_section(data.get("rank_cpu"), str(path)))


ROLE_CPU_KEYS = ("rollout_s", "trainer_s", "overlap", "cores")


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _seconds(section: dict, key: str, what: str, source: str, name: str = "role_cpu") -> tuple[float, ...]:
    values = section.get(key)
    if not isinstance(values, list) or not values or not all(_positive(v) for v in values):
        raise UserError(f"{source}: {name}.{key} must be a list of positive CPU-seconds per step, one per "
                        f"{what} (got {values!r}); probe the job again with `{PROBE_COMMAND}`")
    return tuple(float(v) for v in values)


def _role_cpu_section(section: object, source: str) -> ProbedRoleCPU | None:
    """The file's ``role_cpu`` section (absent: None), every value checked: the CPU-seconds positive, one
    list per role, the two overlap factors and the cores positive."""
    if section is None:
        return None
    if not isinstance(section, dict) or set(section) - set(ROLE_CPU_KEYS):
        raise UserError(f"{source}: 'role_cpu' must be a mapping of {list(ROLE_CPU_KEYS)}, as `{PROBE_COMMAND}` "
                        "writes it")
    rollout = _seconds(section, "rollout_s", "rollout replica", source)
    trainer = _seconds(section, "trainer_s", "trainer rank", source)
    overlap = section.get("overlap", [1.0, 1.0])
    if not isinstance(overlap, list) or len(overlap) != 2 or not all(_positive(v) for v in overlap):
        raise UserError(f"{source}: role_cpu.overlap must be two positive factors, [rollout, trainer] (got "
                        f"{overlap!r}); probe the job again with `{PROBE_COMMAND}`")
    cores = _cores(section, "role_cpu", source)
    return ProbedRoleCPU(RoleCPU(rollout, trainer, (float(overlap[0]), float(overlap[1]))), cores)


def _cores(section: dict, name: str, source: str) -> float:
    """A probe section's ``cores``: the probed machine's core count, positive."""
    cores = section.get("cores")
    if not _positive(cores):
        raise UserError(f"{source}: {name}.cores must be the probed machine's positive core count (got "
                        f"{cores!r}); probe the job again with `{PROBE_COMMAND}`")
    return float(cores)


RANK_CPU_KEYS = ("rank_s", "staleness", "cores")


def _rank_cpu_section(section: object, source: str) -> ProbedRankCPU | None:
    """The file's ``rank_cpu`` section (absent: None): positive CPU-seconds per rank, the probed k (an
    integer ≥ 0) and the cores."""
    if section is None:
        return None
    if not isinstance(section, dict) or set(section) != set(RANK_CPU_KEYS):
        raise UserError(f"{source}: 'rank_cpu' must be a mapping of {list(RANK_CPU_KEYS)}, as `{PROBE_COMMAND}` "
                        "writes it for a colocated job")
    ranks = _seconds(section, "rank_s", "colocated rank", source, "rank_cpu")
    staleness = section["staleness"]
    if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
        raise UserError(f"{source}: rank_cpu.staleness must be the probed job's k, an integer ≥ 0 (got "
                        f"{staleness!r}); probe the job again with `{PROBE_COMMAND}`")
    return ProbedRankCPU(RankCPU(ranks, staleness), _cores(section, "rank_cpu", source))
