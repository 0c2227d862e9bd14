"""Expert tensor parallelism in the planner's device memory, by hand: the experts' stored inputs are the
rows the ETP group gathered (etp times the device's own), at 1/etp of the FFN width; the gather's send and
receive buffers hold etp copies of the routed rows (``moetrain.distributed.etp``; the runtime's saved
bytes: tests/distributed/test_etp_memory.py)."""

from __future__ import annotations

import numpy as np
import pytest

from moetrain.config import load_cluster_config
from moetrain.config.model import GQAConfig, ModelConfig, MoEConfig, RouterConfig
from moetrain.planner.device_memory import STATIC_WORKSPACE_BYTES, LocalParams, _buffers, fp8_stored_elements
from moetrain.planner.strategy import Strategies
from moetrain.planner.workload import Workload

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERT_FFN, SEQ = 256, 8, 2, 32, 1024, 512


def _moe_model() -> ModelConfig:
    # 8 experts of width 1024, top-2, no shared expert, GQA attention
    return ModelConfig(name="moe-test", vocab_size=1000, hidden_size=HIDDEN, num_layers=4, dense_ffn_hidden=1024,
                       ffn_act="swiglu", attention=GQAConfig(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM),
                       moe=MoEConfig(num_experts=8, expert_ffn_hidden=EXPERT_FFN, router=RouterConfig(top_k=2)))


def _strategy(etp: int) -> Strategies:
    def one(value: float | bool) -> np.ndarray:
        return np.array([value])

    return Strategies(tp=one(1), sp=one(False), pp=one(1), vpp=one(1), ep=one(2), etp=one(etp), cp=one(1),
                      dp=one(4), zero=one(1), micro_batch=one(1), recompute=one(0), a2a=one(0),
                      overlap=one(False))


def _workload() -> Workload:
    return Workload(_moe_model(), load_cluster_config("h100-sxm-80gb"), SEQ, 8, precision="fp8")


@pytest.mark.parametrize("etp", [1, 2])
def test_fp8_stored_expert_inputs_are_the_gathered_rows(etp: int) -> None:
    # 512 tokens: the two pre-norm outputs (2·512·256), the o_proj input (512·8·32); 512·2 = 1,024 routed
    # rows, gathered to 1,024·etp: the experts' input (1,024·etp·256) and the down GEMM's input (1,024·etp
    # rows of 1,024/etp columns = 1,024·1,024 whatever etp)
    attention = 2 * 512 * 256 + 512 * 8 * 32
    experts = 1024 * etp * 256 + 1024 * etp * (1024 / etp)
    got = fp8_stored_elements(_workload(), _strategy(etp), True, np.array([0]))
    assert float(got[0]) == attention + experts  # etp 1: 1,703,936; etp 2: 1,966,080


def test_etp_gather_buffers_hold_etp_copies_of_the_routed_rows() -> None:
    w = _workload()
    buffers = {etp: float(_buffers(w, _strategy(etp), LocalParams.of(w, _strategy(etp)))[0]) for etp in (1, 2)}
    tp_gathers = 2 * 512 * 256 * 2  # send and receive of one micro-batch's hidden states, bf16
    # send and receive of 512·2 = 1,024 routed rows (bf16): the all-to-all's at etp 1, the gather's etp
    # copies at etp 2
    assert buffers[1] == STATIC_WORKSPACE_BYTES + tp_gathers + 2 * 1024 * 256 * 2
    assert buffers[2] == STATIC_WORKSPACE_BYTES + tp_gathers + 2 * 2 * 1024 * 256 * 2
