"""The hierarchical all-to-all in the planner's device memory, by hand: its layouts keep the two-hop
dispatcher's tensors (``moetrain.costs.activations``; the runtime's saved bytes:
tests/distributed/test_hierarchical_memory.py), over the nodes the EP group spans on the cluster."""

from __future__ import annotations

import numpy as np

from moetrain.config import load_cluster_config
from moetrain.config.model import GQAConfig, ModelConfig, MoEConfig, RouterConfig
from moetrain.planner.device_memory import _layer_activations
from moetrain.planner.strategy import Strategies
from moetrain.planner.workload import Workload

HIDDEN, SEQ = 256, 512


def _moe_model() -> ModelConfig:
    # 16 experts, top-2, no shared expert
    return ModelConfig(name="moe-test", vocab_size=1000, hidden_size=HIDDEN, num_layers=4, dense_ffn_hidden=1024,
                       ffn_act="swiglu", attention=GQAConfig(num_heads=8, num_kv_heads=2, head_dim=32),
                       moe=MoEConfig(num_experts=16, expert_ffn_hidden=1024, router=RouterConfig(top_k=2)))


def _strategy(a2a: int) -> Strategies:
    def one(value: float | bool) -> np.ndarray:
        return np.array([value])

    return Strategies(tp=one(1), sp=one(False), pp=one(1), vpp=one(1), ep=one(16), etp=one(1), cp=one(1),
                      dp=one(16), zero=one(1), micro_batch=one(1), recompute=one(0), a2a=one(a2a),
                      overlap=one(False))


def test_hierarchical_layouts_keep_the_two_hop_tensors() -> None:
    """EP 16 on 8-GPU nodes spans 2 nodes; 512 tokens a device, top-2 in bf16. A token's 2 experts
    reach 2·(1 − (1/2)²) = 1.5 nodes on average: S = 768 hop-1 rows sent and received; 1,024 rows
    expanded at the peer and received. Added: S·(8 index + 2 mask) = 7,680; expand order S·2·8 =
    12,288; per expanded row 8 + 4 + 256·2 (its source row, weight and the row the combine's first hop
    returns) = 524: 536,576. Gone: the flat sort order and inverse 2·1,024·8 = 16,384, the combine's
    weights 1,024·4 = 4,096 and its returned rows 1,024·256·2 = 524,288. Net: 11,776 bytes per MoE
    layer and micro-batch."""
    w = Workload(_moe_model(), load_cluster_config("h100-sxm-80gb"), SEQ, 16)
    assert w.cluster.fabric_devices == 8
    flat, hierarchical = (float(_layer_activations(w, _strategy(a2a), True, np.array([0]))[0]) for a2a in (0, 1))
    assert hierarchical - flat == 11_776
