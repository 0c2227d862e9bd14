"""Read a Hugging Face model folder (config.json + safetensors, sharded or not) into moetrain.

Memory: the model is built on the meta device, materialised once with ``to_empty`` (the only full
copy), and the checkpoint is streamed one tensor at a time through ``safetensors.safe_open`` (memory
mapped), each tensor copied (and cast) into its place, experts stacked as they arrive. Peak memory is
the model plus the largest single checkpoint tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from moetrain.config.model import ModelConfig
from moetrain.errors import UserError
from moetrain.hf.configs import family_of, model_config_from_hf
from moetrain.hf.weights import TensorSpec, canonical_name, fused_expert_specs, tensor_specs
from moetrain.models.attention import AttentionBackend
from moetrain.models.transformer import MoETransformer

_MAX_NAMES = 5  # tensors named in an error before "... and N more"


def _json_object(file: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``file``: anything else (bad JSON, a list, undecodable bytes) is one line."""
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise UserError(f"{file}: cannot be read ({exc.strerror}); {what}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError is one too
        raise UserError(f"{file}: not valid JSON ({exc}); {what}") from None
    if not isinstance(data, dict):
        raise UserError(f"{file}: holds a JSON {type(data).__name__}, not an object ({{...}}); {what}")
    return data


def read_hf_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"{path}: no config.json; give a Hugging Face model folder")
    return _json_object(config_file, "give the model's own config.json")


def _shard_names(index: Path) -> list[str]:
    """The shard files ``model.safetensors.index.json`` maps its tensors to."""
    weight_map = _json_object(index, "give the model's own index file").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"{index}: no weight_map of tensor names to shard files; give the model's own index file")
    return sorted(set(weight_map.values()))


def safetensors_files(path: Path) -> list[Path]:
    """The shards named by ``model.safetensors.index.json``, else every ``*.safetensors`` file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [path / name for name in _shard_names(index)]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{path}: shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path}: no *.safetensors files (PyTorch .bin checkpoints are not read; convert them)")
    return files


def _unreadable(file: Path, exc: Exception) -> UserError:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return UserError(f"{file}: not a readable safetensors file ({reason}); replace it with the model's own "
                     "(download or export it again)")


def readable_safetensors(path: Path) -> list[Path]:
    """``safetensors_files``, each one's header read: a damaged file is refused before any model is built
    (opening reads the header only; the tensors stay on disk)."""
    files = safetensors_files(path)
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu"):
                pass
        except (SafetensorError, OSError) as exc:
            raise _unreadable(file, exc) from None
    return files


def _named_list(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES])
    return shown + (f" ... and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else "")


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """Checkpoint tensors that carry no weight of our model: rotary caches, tied heads, MTP layers."""
    if name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight"):
        return True
    parts = name.split(".")
    # DeepSeek-V3 stores its multi-token-prediction modules as layers num_hidden_layers.. ; not loaded.
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
        and int(parts[2]) >= cfg.num_layers


class _Filler:
    """Copies streamed tensors into the model's state and remembers which pieces arrived."""

    def __init__(self, model: MoETransformer, cfg: ModelConfig, family: str, rope_interleave: bool) -> None:
        self.state = model.state_dict(keep_vars=True)
        self.specs: dict[str, TensorSpec] = {s.hf_name: s for s in tensor_specs(cfg, family, rope_interleave)}
        self.fused = fused_expert_specs(cfg, family)
        self.piece_names = {(s.param, s.expert): s.hf_name for s in self.specs.values()}
        self.filled: set[tuple[str, int | None]] = set()
        self.unexpected: list[str] = []
        self.cfg, self.family = cfg, family

    @staticmethod
    def _check_shape(source: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
        if tuple(shape) != tuple(expected):
            raise UserError(f"checkpoint tensor {source} has shape {list(shape)}, expected {list(expected)} "
                            "from config.json; the folder's config and weights disagree")

    def _copy(self, param: str, value: torch.Tensor, expert: int | None, source: str) -> None:
        target = self.state[param].data
        if expert is not None:
            target = target[expert]
        self._check_shape(source, value.shape, target.shape)
        target.copy_(value)

    def add(self, raw_name: str, read: Callable[[], torch.Tensor]) -> None:
        name = canonical_name(raw_name, self.family)
        if name in self.specs:
            spec = self.specs[name]
            raw = read()
            self._check_shape(raw_name, raw.shape, spec.hf_shape(self.state[spec.param].shape))
            self._copy(spec.param, spec.to_ours(raw), spec.expert, raw_name)
            self.filled.add((spec.param, spec.expert))
        elif name in self.fused:
            split, pieces = self.fused[name]
            for param, value in split(read()):
                self._copy(param, value, None, raw_name)
            self.filled.update(pieces)
        elif not _ignorable(name, self.cfg):
            self.unexpected.append(raw_name)

    def check_complete(self, path: Path) -> None:
        if self.unexpected:
            raise UserError(f"{path}: tensors the {self.family} mapping does not know (unsupported feature?): "
                            f"{_named_list(sorted(self.unexpected))}")
        missing = [name for piece, name in self.piece_names.items() if piece not in self.filled]
        if missing:
            raise UserError(f"{path}: checkpoint is missing tensors: {_named_list(missing)}")


def load_pretrained(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    backend: AttentionBackend = "sdpa", name: str | None = None,
) -> tuple[MoETransformer, ModelConfig]:
    """(model, config) from a Hugging Face folder of family deepseek_v3, qwen3_moe, mixtral or moetrain_pangu.

    ``dtype`` is the parameter dtype (fp32 master weights by default; checkpoint tensors are cast as
    they stream). The router's score bias stays fp32.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path} is not a folder; give a Hugging Face model folder (config.json + safetensors)")
    hf = read_hf_config(path)
    family = family_of(hf, str(path / "config.json"))
    cfg = model_config_from_hf(hf, name=name or path.name, source=str(path / "config.json"))
    files = readable_safetensors(path)

    model = MoETransformer(cfg, backend=backend, device="meta").to(dtype)  # no storage yet
    model = model.to_empty(device=device)  # the one full copy, uninitialised until filled below
    for module in model.modules():  # buffers are not in every checkpoint: start them from zero
        if hasattr(module, "score_bias"):
            module.score_bias = torch.zeros(module.score_bias.shape, dtype=torch.float32, device=device)
    # DeepSeek-V3 checkpoints keep rotary pairs interleaved unless they say otherwise; moetrain_pangu rotates halves
    interleaved = family == "deepseek_v3" and bool(hf.get("rope_interleave", True))
    filler = _Filler(model, cfg, family, rope_interleave=interleaved)
    with torch.no_grad():
        for file in files:
            _stream(file, filler)
    filler.check_complete(path)
    return model, cfg


def _stream(file: Path, filler: _Filler) -> None:
    """Every tensor of one shard into the model; a tensor the header promises but the file cannot give
    (a dtype torch lacks, a file changed since its header was read) is one line naming the file."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for key in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                filler.add(key, lambda key=key, shard=shard: shard.get_tensor(key))
    except (SafetensorError, OSError) as exc:
        raise _unreadable(file, exc) from None
