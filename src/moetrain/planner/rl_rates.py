"""The RL step's measured host rates as a file: what ``moetrain profile --rl-out`` writes beside the
calibration and ``moetrain simulate --rl --rl-rates`` reads. The calibration holds the training step's
efficiencies; an RL step on a CPU also spends host time the calibration does not price (the eager
generation loop's layer passes, the sampler, the rollout engine: ``HostCosts``) and the weight sync's
copies and CRC-32s (``SyncRates``). Torch-free: measuring them is ``moetrain.rl.rates``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import yaml

from moetrain.errors import UserError
from moetrain.planner.calibration import read_profile_file
from moetrain.planner.generation import HostCosts
from moetrain.planner.rl_step import SyncRates


@dataclass(frozen=True)
class RLRates:
    """Host costs of generation and the weight sync's rates, measured on one machine for one policy."""

    host: HostCosts
    sync: SyncRates
    measured_on: str = ""
    """What measured them (the command, the model)."""

    def to_dict(self) -> dict:
        return {"measured_on": self.measured_on, "host": asdict(self.host), "sync": asdict(self.sync)}

    def save(self, path: str | Path) -> None:
        path, data = Path(path), self.to_dict()
        path.write_text(json.dumps(data, indent=2) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False))


def _section(data: dict, name: str, cls, source: str):
    section = data.get(name)
    known = {f.name for f in fields(cls)}
    if not isinstance(section, dict) or set(section) - known:
        raise UserError(f"{source}: '{name}' must be a mapping of {sorted(known)}, as `moetrain profile --rl-out` "
                        "writes it")
    return cls(**section)


def load_rl_rates(path: str | Path) -> RLRates:
    """A file ``moetrain profile --rl-out`` wrote (YAML, or JSON by its suffix)."""
    data = read_profile_file(path, "RL rates", "--rl-out FILE", "'host' and 'sync' sections")
    return RLRates(_section(data, "host", HostCosts, str(path)), _section(data, "sync", SyncRates, str(path)),
                   str(data.get("measured_on", "")))
