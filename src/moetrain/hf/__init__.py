"""Hugging Face interop: load and save deepseek_v3, qwen3_moe and mixtral checkpoints (safetensors).

``load_pretrained(path) -> (model, config)`` and ``save_pretrained(model, path)``; the config mapping
(torch-free) is in ``moetrain.hf.configs``, the tensor mapping in ``moetrain.hf.weights``. transformers
is not needed at run time; the tests use it as the reference implementation.
"""

from moetrain.hf.configs import FAMILIES, hf_config_from_model, hf_family_for, model_config_from_hf
from moetrain.hf.load import load_pretrained
from moetrain.hf.save import save_pretrained

__all__ = [
    "FAMILIES",
    "hf_config_from_model",
    "hf_family_for",
    "load_pretrained",
    "model_config_from_hf",
    "save_pretrained",
]
