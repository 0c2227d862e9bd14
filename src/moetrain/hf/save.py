"""Write a moetrain model as a Hugging Face folder that transformers (and serving engines) load.

Layout: ``config.json`` plus ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards
with ``model.safetensors.index.json`` when the weights exceed ``max_shard_bytes``; for the moetrain_pangu
family also its modeling code (``configuration_moetrain_pangu.py``, ``modeling_moetrain_pangu.py``), which
transformers runs with ``trust_remote_code=True``. Experts are written
one module each (``experts.{e}.gate_proj.weight``), the layout of published checkpoints and of
transformers' own ``save_pretrained``. Shards are planned from shapes first, then each shard's
tensors are produced, written and freed, so only one shard is held besides the model.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from moetrain.config.model import ModelConfig
from moetrain.errors import UserError
from moetrain.hf import pangu
from moetrain.hf.configs import hf_config_from_model, hf_family_for
from moetrain.hf.weights import TensorSpec, tensor_specs

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain local tensor of the whole parameter (gathers a DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _plan_shards(specs: list[TensorSpec], state: dict[str, torch.Tensor], dtype: torch.dtype,
                 max_shard_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        param = state[spec.param]
        numel = param[0].numel() if spec.expert is not None else param.numel()
        nbytes = numel * (torch.float32.itemsize if spec.param.endswith("score_bias") else dtype.itemsize)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def save_pretrained(model: nn.Module, path: str | Path, dtype: torch.dtype | None = None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write ``model`` (a ``MoETransformer``) to ``path``; ``dtype`` defaults to the parameters' dtype.

    The family follows from the config: MLA → deepseek_v3 where it computes the same function, else
    moetrain_pangu (sandwich norm, other norm eps, softmax routing, dense); GQA with q/k norm → qwen3_moe,
    GQA without → mixtral; configs none of them can represent are refused with the field at fault.
    """
    cfg: ModelConfig = model.cfg
    family = hf_family_for(cfg)
    if cfg.num_mtp_layers and family != pangu.FAMILY:
        # Dropping MTP does not change the logits; say so instead of failing an export for serving.
        print(f"note: {cfg.num_mtp_layers} multi-token-prediction module(s) are not exported")
    state = {k: _full(v).detach() for k, v in model.state_dict().items()}
    dtype = dtype or state["embed.weight"].dtype
    if dtype not in _DTYPE_NAMES:
        raise UserError(f"cannot save weights as {dtype}; choose float32, bfloat16 or float16")
    specs = tensor_specs(cfg, family, rope_interleave=family == "deepseek_v3")
    for spec in specs:
        if spec.param not in state and spec.param.endswith("score_bias"):
            # A sigmoid router without a score bias is DeepSeek-V3's router with a zero bias (ours is
            # then a non-persistent buffer, absent from the state dict).
            state[spec.param] = torch.zeros(cfg.moe.num_experts)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(specs, state, dtype, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for shard_specs, file_name in zip(shards, names):
        tensors = {}
        for spec in shard_specs:
            keep_fp32 = spec.param.endswith("score_bias")  # as transformers keeps it
            tensor = spec.to_hf(state[spec.param]).to("cpu", torch.float32 if keep_fp32 else dtype)
            tensors[spec.hf_name] = tensor
            weight_map[spec.hf_name] = file_name
            total_bytes += tensor.numel() * tensor.element_size()
        save_file(tensors, str(path / file_name), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    hf_config = hf_config_from_model(cfg, _DTYPE_NAMES[dtype])
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if family == pangu.FAMILY:
        code = resources.files("moetrain.hf.remote_code")
        for name in pangu.REMOTE_CODE_FILES:
            (path / name).write_text(code.joinpath(name).read_text(encoding="utf-8"), encoding="utf-8")
    return path
