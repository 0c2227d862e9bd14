"""Typed configs (pydantic, torch-free): model, cluster, parallel plan, training."""

from moetrain.config.cluster import ClusterConfig
from moetrain.config.model import GQAConfig, MLAConfig, ModelConfig, MoEConfig, RouterConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.config.presets import (
    cluster_for_device,
    cluster_presets,
    load_cluster_config,
    load_model_config,
    load_plan_file,
    model_presets,
)
from moetrain.config.training import TrainingConfig

__all__ = [
    "ClusterConfig",
    "GQAConfig",
    "MLAConfig",
    "ModelConfig",
    "MoEConfig",
    "ParallelConfig",
    "RouterConfig",
    "TrainingConfig",
    "cluster_for_device",
    "cluster_presets",
    "load_cluster_config",
    "load_model_config",
    "load_plan_file",
    "model_presets",
]
