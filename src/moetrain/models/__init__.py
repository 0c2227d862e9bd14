"""The MoE transformer (runtime side: imports torch, reads configs and never the reverse)."""

from moetrain.models.dispatch import LocalDispatcher, permute, unpermute
from moetrain.models.moe import MoE
from moetrain.models.router import Router, Routing
from moetrain.models.transformer import (
    IGNORE_INDEX,
    DecoderLayer,
    ModelOutput,
    MoETransformer,
    build_model,
    param_counts_by_part,
)

__all__ = [
    "IGNORE_INDEX",
    "DecoderLayer",
    "LocalDispatcher",
    "MoE",
    "ModelOutput",
    "MoETransformer",
    "Router",
    "Routing",
    "build_model",
    "param_counts_by_part",
    "permute",
    "unpermute",
]
