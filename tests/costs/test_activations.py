"""The activation accounting of moetrain.costs.activations for MLP structures the runtime does not
build (GELU, squared ReLU: the published runs the planner validates)."""

import pytest

from moetrain.config import load_model_config
from moetrain.config.model import ModelConfig
from moetrain.costs.activations import activation_bytes_per_layer

TOKENS = 64 * 2
DENSE_WIDTH = 96


def _model(ffn_act: str) -> ModelConfig:
    # tiny-qwen3 as a dense model of FFN width 96
    return load_model_config("tiny-qwen3").model_copy(
        update={"ffn_act": ffn_act, "moe": None, "dense_ffn_hidden": DENSE_WIDTH})


def _ffn_bytes(ffn_act: str, recompute: str | frozenset = "none") -> float:
    parts = activation_bytes_per_layer(_model(ffn_act), seq_len=64, micro_batch=2, dtype_bytes=2.0,
                                       moe_layer=False, recompute=recompute)
    return float(parts["ffn"])


@pytest.mark.parametrize("ffn_act", ["gelu", "relu2"])
def test_two_matrix_mlp_keeps_the_activation_input_and_output(ffn_act: str) -> None:
    # fc1 output (read by the activation) and activation output (read by fc2), bf16
    assert _ffn_bytes(ffn_act) == TOKENS * DENSE_WIDTH * 2 * 2
    # recomputing the activation keeps only the fc1 output
    assert _ffn_bytes(ffn_act, frozenset({"activation"})) == TOKENS * DENSE_WIDTH * 1 * 2


def test_swiglu_keeps_gate_up_silu_and_product() -> None:
    assert _ffn_bytes("swiglu") == TOKENS * DENSE_WIDTH * 4 * 2
    assert _ffn_bytes("swiglu", frozenset({"activation"})) == TOKENS * DENSE_WIDTH * 2 * 2


def test_experts_follow_the_mlp_structure() -> None:
    moe_model = load_model_config("tiny-qwen3")
    routed = TOKENS * moe_model.moe.router.top_k
    width = moe_model.moe.expert_ffn_hidden

    def experts(ffn_act: str) -> float:
        model = moe_model.model_copy(update={"ffn_act": ffn_act})
        return float(activation_bytes_per_layer(model, 64, 2, dtype_bytes=2.0, moe_layer=True)["experts"])

    offsets = moe_model.moe.num_experts * 4  # the grouped GEMMs' int32 block offsets, one per expert
    output = routed * moe_model.hidden_size * 2  # the expert output, kept by the weighted combine
    assert experts("swiglu") == routed * width * 4 * 2 + offsets + output
    assert experts("gelu") == routed * width * 2 * 2 + offsets + output
