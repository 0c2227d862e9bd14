"""YAML presets shipped in the package, and loading a user's own YAML file in their place."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from moetrain.config.cluster import ClusterConfig
from moetrain.config.model import ModelConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.errors import UserError, describe_validation_error
from moetrain.textfile import read_text, require_file

ConfigT = TypeVar("ConfigT", bound=BaseModel)

_PRESETS = resources.files("moetrain.config") / "presets"


def _preset_names(kind: str) -> list[str]:
    return sorted(p.name.removesuffix(".yaml") for p in (_PRESETS / kind).iterdir() if p.name.endswith(".yaml"))


def model_presets() -> list[str]:
    return _preset_names("models")


def cluster_presets() -> list[str]:
    return _preset_names("clusters")


def _read_yaml(text: str, source: str) -> dict:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UserError(f"{source}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a YAML mapping of config fields at the top level")
    return data


def _load(kind: str, name_or_path: str, schema: type[ConfigT]) -> ConfigT:
    path = Path(name_or_path)
    if name_or_path.endswith((".yaml", ".yml")) or path.is_file():
        require_file(path, f"{kind} file {name_or_path!r}", "give a preset name or an existing YAML path")
        text, source = read_text(path, f"{kind} file {path}", "save it as UTF-8"), str(path)
    else:
        preset = _PRESETS / f"{kind}s" / f"{name_or_path}.yaml"
        if not preset.is_file():
            known = ", ".join(_preset_names(f"{kind}s"))
            raise UserError(f"unknown {kind} preset {name_or_path!r}; choose one of: {known} (or pass a YAML file)")
        text, source = preset.read_text(), f"{kind} preset {name_or_path!r}"
    data = _read_yaml(text, source)
    data.setdefault("name", path.stem if source == str(path) else name_or_path)
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise UserError(describe_validation_error(source, exc, schema)) from None


def load_model_config(name_or_path: str) -> ModelConfig:
    """A model preset name (``tiny-pangu``) or a path to a YAML file with the same fields."""
    return _load("model", name_or_path, ModelConfig)


def load_cluster_config(name_or_path: str) -> ClusterConfig:
    return _load("cluster", name_or_path, ClusterConfig)


# Words of a GPU's name (``torch.cuda.get_device_name``) → the cluster preset of that device, most
# specific first. A GPU none names is priced as an H100.
_CLUSTER_OF_GPU_NAME: tuple[tuple[str, str], ...] = (
    ("GB200", "gb200"), ("B200", "b200"), ("H200", "h200-sxm-141gb"), ("H800", "h800-sxm-80gb"),
    ("H100", "h100-sxm-80gb"), ("A100", "a100-sxm-80gb"),
)


def cluster_for_device(device_name: str) -> str:
    """The cluster preset whose peaks describe a device: ``cpu`` for a CPU, else by the GPU's name
    (``NVIDIA H200`` → ``h200-sxm-141gb``), an H100 for a name not listed."""
    if device_name == "cpu":
        return "cpu"
    upper = device_name.upper()
    return next((preset for word, preset in _CLUSTER_OF_GPU_NAME if word in upper), "h100-sxm-80gb")


def load_plan_file(path: str) -> dict:
    """Read a plan written by ``moetrain plan``; returns its mapping with ``parallel`` validated."""
    p = Path(path)
    require_file(p, f"plan file {path!r}", f"write one with `moetrain plan --out {path}`")
    text = read_text(p, f"plan file {path}", "save it as UTF-8 or write it again with `moetrain plan`")
    data = _read_yaml(text, path)
    if "parallel" not in data:
        rl = sorted(set(data) & {"trainer", "generation", "rollout", "stalesync", "sft", "rl"})
        if rl:
            raise UserError(f"{path} is an RL plan or spec (its {', '.join(rl)}: moetrain plan --rl), not a training "
                            f"plan; run it with moetrain rl --plan {path}")
        raise UserError(f"{path}: no 'parallel' section; is this a plan written by `moetrain plan`?")
    try:
        data["parallel"] = ParallelConfig.model_validate(data["parallel"])
    except ValidationError as exc:
        raise UserError(describe_validation_error(path, exc, ParallelConfig, section="parallel")) from None
    return data
