import json

import numpy as np
import pytest

from moetrain.balance.traces import TraceShape, drifting_trace, parse_trace_rows, read_trace, write_trace, zipf_trace
from moetrain.errors import UserError


def test_round_trip(tmp_path):
    trace = zipf_trace(TraceShape(5, 3, 16, 1, 256, 4), seed=1)
    path = tmp_path / "trace.jsonl"
    write_trace(trace, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 15
    assert set(rows[0]) == {"step", "layer", "tokens_per_expert"}
    again = read_trace(path)
    assert np.array_equal(again.tokens_per_expert, trace.tokens_per_expert)
    assert again.steps.tolist() == list(range(5))


def test_rows_in_any_order_and_sparse_steps():
    rows = [
        {"step": 20, "layer": 5, "tokens_per_expert": [1, 2]},
        {"step": 10, "layer": 5, "tokens_per_expert": [3, 4]},
    ]
    trace = parse_trace_rows(rows)
    assert trace.steps.tolist() == [10, 20]
    assert trace.layers.tolist() == [5]
    assert trace.tokens_per_expert[:, 0].tolist() == [[3, 4], [1, 2]]


def test_errors(tmp_path):
    with pytest.raises(UserError, match="step 1 has no row for layer 2; every step needs every layer"):
        parse_trace_rows([
            {"step": 0, "layer": 1, "tokens_per_expert": [1]},
            {"step": 0, "layer": 2, "tokens_per_expert": [1]},
            {"step": 1, "layer": 1, "tokens_per_expert": [1]},
        ])
    with pytest.raises(UserError, match="appears twice"):
        parse_trace_rows([{"step": 0, "layer": 0, "tokens_per_expert": [1]}] * 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0, "layer": 0, "tokens_per_expert": [1]}\n{"step": 1}\n')
    with pytest.raises(UserError) as err:
        read_trace(bad)
    assert str(err.value) == f"{bad}:2: expected a JSON row with step, layer and tokens_per_expert"
    with pytest.raises(UserError, match="does not exist"):
        read_trace(tmp_path / "missing.jsonl")


def test_zipf_is_skewed_and_counts_every_assignment():
    trace = zipf_trace(TraceShape(4, 2, 64, 1, 1000, 8), exponent=1.0, seed=0)
    assert (trace.tokens_per_expert.sum(axis=-1) == 8000).all()
    mean = trace.tokens_per_expert.mean(axis=0)
    # hottest expert about H_64 ≈ 4.7 times the mean share
    assert mean.max(axis=-1).min() > 3.5 * mean.mean()
    # layers are shuffled differently
    assert trace.tokens_per_expert[0, 0].argmax() != trace.tokens_per_expert[0, 1].argmax()


def test_drifting_hot_set_moves():
    trace = drifting_trace(TraceShape(120, 1, 32, 1, 20000, 2), num_hot=4, hot_weight=8.0, period=30, seed=0)
    def hot(step):
        return set(np.argsort(trace.tokens_per_expert[step, 0])[-4:].tolist())
    assert hot(0) != hot(119)
    assert len(hot(25) & hot(35)) >= 2  # drift, not a jump: most of the hot set stays


def test_a_provenance_line_heads_a_recorded_trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = ['{"step": 1, "layer": 0, "tokens_per_expert": [3, 1]}',
            '{"step": 2, "layer": 0, "tokens_per_expert": [2, 2]}']
    path.write_text('{"provenance": {"command": "python x.py", "commit": "abc1234", "machine": {}}}\n'
                    + "\n".join(rows) + "\n")
    assert read_trace(path).tokens_per_expert.tolist() == [[[3, 1]], [[2, 2]]]
    # anywhere else it is a malformed row
    path.write_text(rows[0] + '\n{"provenance": {}}\n')
    with pytest.raises(UserError, match=":2: expected a JSON row"):
        read_trace(path)
