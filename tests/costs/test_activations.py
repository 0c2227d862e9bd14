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


def _moe_parts(model: ModelConfig, sharding: Sharding, dtype_bytes: float = 2.0, **load: float) -> dict:
    shape = ActivationShape(model, seq_len=32, micro_batch=2, dtype_bytes=dtype_bytes, sharding=sharding, **load)
    return activation_bytes_per_layer(shape, moe_layer=True)


def test_imbalance_scales_the_received_rows_not_the_own_assignments() -> None:
    """EP2, tiny-pangu in bf16 (hidden 128, width 64, top-4), 64 tokens a device: 256 own assignments;
    at imbalance 1.5 the device receives 384 rows (tests/distributed/test_hierarchical_memory.py
    measures it)."""
    model = load_model_config("tiny-pangu")
    parts = _moe_parts(model, Sharding(ep=2), imbalance=1.5)
    sort_order_and_inverse = 2 * 256 * 8  # int64, the device's own 256 assignments
    ep_reorder_and_inverse = 2 * 384 * 8  # int64, the 384 rows the all-to-all delivered
    received_rows = 384 * 128 * 2  # the experts' input
    assert float(parts["dispatch"]) == sort_order_and_inverse + ep_reorder_and_inverse + received_rows  # 108,544
    intermediates = 4 * 384 * 64 * 2  # gate, up, silu(gate), product
    offsets = 8 * 4  # int32 block ends of the 8 local experts
    returned_rows = 256 * 128 * 2  # the combine's rows: one per own assignment, back from the all-to-all
    assert float(parts["experts"]) == intermediates + offsets + returned_rows  # 262,176


def test_hierarchical_dispatch_keeps_its_own_tensors() -> None:
    """EP4 on 2 nodes, tiny-pangu in bf16, 64 tokens a device, each to 2 nodes: 128 hop-1 rows sent and
    received, 256 rows expanded at the peer and received (tests/distributed/test_hierarchical_memory.py
    measures it)."""
    model = load_model_config("tiny-pangu")
    parts = _moe_parts(model, Sharding(ep=4, hierarchical=True, ep_nodes=2), nodes_per_token=2)
    source_index = 128 * 8  # int64, the token of each hop-1 row
    mask = 128 * 4 * 1  # bool, which of the token's 4 assignments each hop-1 row carries
    expand_order = 128 * 4 * 8  # int64 argsort over the received hop-1 rows' assignments
    expanded = 256 * (8 + 4)  # int64 source row and fp32 gating weight of each expanded row
    first_hop_back = 256 * 128 * 2  # the rows the combine's first hop returns, once, in bf16
    ep_reorder_and_inverse = 2 * 256 * 8
    received_rows = 256 * 128 * 2
    # the combine's sums keep no second-hop rows and no fp32 or weighted copy (their backward is a gather)
    assert float(parts["dispatch"]) == (source_index + mask + expand_order + expanded + first_hop_back
                                        + ep_reorder_and_inverse + received_rows)  # 143,872
    # no flat combine: neither its returned rows nor its gating weights
    assert float(parts["experts"]) == 4 * 256 * 64 * 2 + 4 * 4
    flat = _moe_parts(model, Sharding(ep=4))
    assert float(flat["router"] - parts["router"]) == 256 * 4


def test_uniform_routing_reaches_the_expected_number_of_nodes() -> None:
    """Without a measured count, a token's 4 experts on 2 nodes miss a given node with probability
    (1/2)^4, so they reach 2·(1 − 1/16) = 1.875 nodes on average: 120 hop-1 rows for 64 tokens. On
    one node every token's row goes to that node: 64 rows."""
    model = load_model_config("tiny-pangu")

    def hop1_rows(nodes: int) -> float:
        given = _moe_parts(model, Sharding(ep=4, hierarchical=True, ep_nodes=nodes), nodes_per_token=1)
        uniform = _moe_parts(model, Sharding(ep=4, hierarchical=True, ep_nodes=nodes))
        # bytes per hop-1 row: sent, 8 (index) + 4 (mask); received, 4·8 (expand order)
        return float(uniform["dispatch"] - given["dispatch"]) / 44 + 64

    assert hop1_rows(2) == 120
    assert hop1_rows(1) == 64
