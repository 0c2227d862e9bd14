"""The activation accounting of moetrain.costs.activations for MLP structures the runtime does not
build (GELU, squared ReLU: the published runs the planner validates)."""

import pytest

from moetrain.config import load_model_config
from moetrain.config.model import ModelConfig
from moetrain.costs.activations import ActivationShape, Sharding, activation_bytes_per_layer

TOKENS = 64 * 2
DENSE_WIDTH = 96


def _model(ffn_act: str) -> ModelConfig:
    # tiny-qwen3 as a dense model of FFN width 96
    return load_model_config("tiny-qwen3").model_copy(
        update={"ffn_act": ffn_act, "moe": None, "dense_ffn_hidden": DENSE_WIDTH})


def _ffn_bytes(ffn_act: str, recompute: str | frozenset = "none") -> float:
    parts = activation_bytes_per_layer(ActivationShape(_model(ffn_act), seq_len=64, micro_batch=2, dtype_bytes=2.0),
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
        shape = ActivationShape(model, 64, 2, dtype_bytes=2.0)
        return float(activation_bytes_per_layer(shape, moe_layer=True)["experts"])

    offsets = moe_model.moe.num_experts * 4  # the grouped GEMMs' int32 block offsets, one per expert
    output = routed * moe_model.hidden_size * 2  # the expert output, kept by the weighted combine
    assert experts("swiglu") == routed * width * 4 * 2 + offsets + output
    assert experts("gelu") == routed * width * 2 * 2 + offsets + output


def test_expert_tensor_parallelism_keeps_the_gathered_rows() -> None:
    """EP2 × ETP2, tiny-pangu in bf16 (hidden 128, 16 experts of width 64, top-4), seq 32 × micro-batch 2:
    64 tokens a device, P = 64·4 = 256 routed rows received; the ETP gather makes them 2·256 = 512 rows
    that the experts run on 64/2 = 32 columns each (tests/distributed/test_etp_memory.py measures it)."""
    model = load_model_config("tiny-pangu")
    assert (model.hidden_size, model.moe.expert_ffn_hidden, model.moe.router.top_k) == (128, 64, 4)

    def parts(etp: int) -> dict:
        shape = ActivationShape(model, seq_len=32, micro_batch=2, dtype_bytes=2.0, sharding=Sharding(ep=2, etp=etp))
        return activation_bytes_per_layer(shape, moe_layer=True)

    sort_order_and_inverse = 2 * 256 * 8  # int64, the device's own 256 assignments
    ep_reorder_and_inverse = 2 * 256 * 8  # int64, the 256 rows the all-to-all delivered
    etp_reorder_and_inverse = 2 * 512 * 8  # int64, over the 512 gathered rows
    gathered_rows = 512 * 128 * 2  # the experts' input, kept by the gate and up GEMMs
    assert float(parts(2)["dispatch"]) == (sort_order_and_inverse + ep_reorder_and_inverse
                                           + etp_reorder_and_inverse + gathered_rows)  # 147,456
    intermediates = 4 * 512 * 32 * 2  # gate, up, silu(gate), product: 512 rows of 32 columns
    offsets = 8 * 4  # int32 block ends of the 16/2 = 8 local experts
    combined_rows = 256 * 128 * 2  # the device's own expert output rows, kept by the combine
    assert float(parts(2)["experts"]) == intermediates + offsets + combined_rows  # 196,640
    # etp 1: 256 rows of the whole width 64, no ETP index: the same intermediates, half the input rows
    assert float(parts(1)["experts"]) == 4 * 256 * 64 * 2 + offsets + combined_rows
    assert float(parts(1)["dispatch"]) == sort_order_and_inverse + ep_reorder_and_inverse + 256 * 128 * 2
