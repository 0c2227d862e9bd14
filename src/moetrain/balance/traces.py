"""Routing traces: per step and MoE layer, how many tokens each expert received.

File format (written by ``moetrain train --trace-routing F``), JSONL, one row per step and MoE layer::

    {"step": 12, "layer": 3, "tokens_per_expert": [40, 0, 17, ...]}

``tokens_per_expert`` counts token-expert assignments (a token routed to k experts counts k times).
A first line ``{"provenance": {...}}`` (what a benchmark that recorded the trace adds: its command,
commit and machine) is skipped.
In memory a trace is a dense array ``[num_steps, num_layers, num_experts]``.

Synthetic traces stand in for real runs where none is recorded: a Zipf popularity (a few experts take
most of the tokens, as seen early in training or without a balance loss) and a drifting hot set (the
popular experts change over time, which is what a predictor must follow).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetrain.errors import UserError
from moetrain.textfile import read_text, require_file


@dataclass(frozen=True)
class RoutingTrace:
    steps: np.ndarray
    """[T] training step of each row block."""
    layers: np.ndarray
    """[L] MoE layer index of each layer block."""
    tokens_per_expert: np.ndarray
    """[T, L, E] int64 token-expert assignments."""
    name: str = "trace"

    @property
    def num_steps(self) -> int:
        return int(self.tokens_per_expert.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.tokens_per_expert.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.tokens_per_expert.shape[2])

    def rows(self) -> list[dict]:
        return [
            {"step": int(step), "layer": int(layer), "tokens_per_expert": self.tokens_per_expert[t, i].tolist()}
            for t, step in enumerate(self.steps)
            for i, layer in enumerate(self.layers)
        ]


def write_trace(trace: RoutingTrace, path: str | Path) -> None:
    with open(path, "w") as f:
        for row in trace.rows():
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def parse_trace_rows(rows: list[dict], source: str = "trace") -> RoutingTrace:
    """Dense trace from rows; every (step, layer) pair must appear exactly once."""
    if not rows:
        raise UserError(f"{source}: no rows; record one with `moetrain train --trace-routing FILE`")
    num_experts = len(rows[0]["tokens_per_expert"])
    steps = sorted({r["step"] for r in rows})
    layers = sorted({r["layer"] for r in rows})
    step_index = {s: i for i, s in enumerate(steps)}
    layer_index = {x: i for i, x in enumerate(layers)}
    loads = np.zeros((len(steps), len(layers), num_experts), dtype=np.int64)
    seen = np.zeros((len(steps), len(layers)), dtype=bool)
    for r in rows:
        counts = r["tokens_per_expert"]
        if len(counts) != num_experts:
            raise UserError(
                f"{source}: step {r['step']} layer {r['layer']} has {len(counts)} experts, the first row "
                f"{num_experts}; one trace must come from one model"
            )
        t, i = step_index[r["step"]], layer_index[r["layer"]]
        if seen[t, i]:
            raise UserError(f"{source}: step {r['step']} layer {r['layer']} appears twice")
        seen[t, i] = True
        loads[t, i] = counts
    if not seen.all():
        t, i = np.argwhere(~seen)[0]
        raise UserError(f"{source}: step {steps[t]} has no row for layer {layers[i]}; every step needs every layer")
    if (loads < 0).any():
        raise UserError(f"{source}: negative token counts")
    return RoutingTrace(np.array(steps, dtype=np.int64), np.array(layers, dtype=np.int64), loads, name=source)


_RECORD = "record it again with `moetrain train --trace-routing FILE`"
# The largest count (or step, or layer) read: every whole number up to it is exact as a float, which the cost
# model prices loads in, and it fits the int64 trace; no real step routes this many tokens.
_MAX_WHOLE = 2**53


def _whole(value: object) -> int | None:
    """``value`` as a whole number from 0 to ``_MAX_WHOLE`` (JSON's 3 or 3.0), or None: a fraction, a
    negative, NaN, Infinity, a string or a bool is no count of tokens."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not (isinstance(value, int) or math.isfinite(value) and value == int(value)):
        return None
    return int(value) if 0 <= value <= _MAX_WHOLE else None


def _trace_row(line: str, where: str, first: bool) -> dict | None:
    """One JSONL line as a row (None for a provenance line heading the file); a malformed row is one
    ``UserError`` naming ``where`` (file:line), and so is a bad number (``_whole_numbers``)."""
    malformed = UserError(f"{where}: expected a JSON row with step, layer and tokens_per_expert")
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        raise malformed from None
    if first and isinstance(row, dict) and "provenance" in row:
        return None
    if not isinstance(row, dict) or not {"step", "layer", "tokens_per_expert"} <= set(row):
        raise malformed
    return _whole_numbers(row, where)


def _whole_numbers(row: dict, where: str) -> dict:
    """The row's step, layer and counts as whole numbers, or one ``UserError`` naming the first that is not
    (JSON admits NaN, Infinity and fractions, which no count of tokens is)."""
    counts = row["tokens_per_expert"]
    if not isinstance(counts, list) or not counts:
        raise UserError(f"{where}: tokens_per_expert must be a list of token counts, one per expert; {_RECORD}")
    for key in ("step", "layer"):
        if _whole(row[key]) is None:
            raise UserError(f"{where}: {key} is {json.dumps(row[key])}, not a whole number from 0 to 2^53; {_RECORD}")
    parsed = [_whole(x) for x in counts]
    if None in parsed:
        bad = parsed.index(None)
        raise UserError(f"{where}: tokens_per_expert[{bad}] is {json.dumps(counts[bad])}, not a whole number of "
                        f"tokens from 0 to 2^53; {_RECORD}")
    return {"step": _whole(row["step"]), "layer": _whole(row["layer"]), "tokens_per_expert": parsed}


def read_trace(path: str | Path) -> RoutingTrace:
    """The trace in a JSONL file (UTF-8), each bad line refused in one line naming the file and the line."""
    p = Path(path)
    require_file(p, f"trace file {str(path)!r}", "record one with `moetrain train --trace-routing`")
    text = read_text(p, f"trace file {path}", f"save it as UTF-8 or {_RECORD}",
                     "give the JSONL routing trace `moetrain train --trace-routing FILE` writes")
    rows = []
    # split at newlines only, as the line numbers of ``read_text``'s refusals count them
    for line_number, line in enumerate(text.split("\n"), 1):
        if line.strip():
            row = _trace_row(line, f"{p}:{line_number}", line_number == 1)
            if row is not None:
                rows.append(row)
    return parse_trace_rows(rows, source=p.name)


# ---- synthetic traces ---------------------------------------------------------------------------


def _sample_loads(rng: np.random.Generator, probs: np.ndarray, tokens: int, top_k: int) -> np.ndarray:
    """Token-expert counts for ``tokens`` tokens each choosing ``top_k`` experts. A multinomial over
    ``tokens·top_k`` draws: it ignores that one token's k experts are distinct, which only matters
    when one expert's probability nears 1/k."""
    return rng.multinomial(tokens * top_k, probs / probs.sum())


@dataclass(frozen=True)
class TraceShape:
    """Size of a synthetic trace: steps × layers × experts, the tokens of a step and the experts per token
    (the Zipf and drifting traces below and every family of ``moetrain.balance.families``)."""

    num_steps: int
    num_layers: int
    num_experts: int
    num_ranks: int
    """The EP size the trace is meant for: the ``giant`` family sizes its experts against a rank's mean load
    (the Zipf and drifting traces do not use it)."""
    tokens_per_step: int
    top_k: int = 8


def zipf_trace(shape: TraceShape, exponent: float = 1.0, seed: int = 0) -> RoutingTrace:
    """Static Zipf popularity, p(expert of popularity rank i) ∝ 1/i^exponent, shuffled per layer so
    hot experts land anywhere in the contiguous layout; counts resampled every step."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, shape.num_experts + 1) ** exponent
    probs = np.stack([rng.permutation(base) for _ in range(shape.num_layers)])
    loads = np.stack([
        np.stack([_sample_loads(rng, probs[layer], shape.tokens_per_step, shape.top_k)
                  for layer in range(shape.num_layers)])
        for _ in range(shape.num_steps)
    ])
    return RoutingTrace(np.arange(shape.num_steps), np.arange(shape.num_layers), loads, name=f"zipf-s{exponent:g}")


def drifting_trace(shape: TraceShape, num_hot: int = 8, hot_weight: float = 6.0, period: int = 40,
                   seed: int = 0) -> RoutingTrace:
    """A hot set of ``num_hot`` experts, each ``hot_weight`` times as popular as the rest, that drifts:
    every ``period`` steps one hot expert hands its popularity to a new one, linearly over the
    period (a trend a predictor can follow, unlike noise)."""
    rng = np.random.default_rng(seed)
    num_experts = shape.num_experts
    loads = np.zeros((shape.num_steps, shape.num_layers, num_experts), dtype=np.int64)
    for layer in range(shape.num_layers):
        order = rng.permutation(num_experts)
        hot = list(order[:num_hot])
        spare = list(order[num_hot:])
        leaving, arriving = hot[0], spare[0]
        for step in range(shape.num_steps):
            phase = (step % period) / period
            if step and step % period == 0:
                hot.remove(leaving)
                hot.append(arriving)
                spare.remove(arriving)
                spare.append(leaving)
                leaving, arriving = hot[0], spare[0]
            weights = np.ones(num_experts)
            weights[hot] = hot_weight
            weights[leaving] = 1.0 + (hot_weight - 1.0) * (1.0 - phase)
            weights[arriving] = 1.0 + (hot_weight - 1.0) * phase
            loads[step, layer] = _sample_loads(rng, weights, shape.tokens_per_step, shape.top_k)
    return RoutingTrace(np.arange(shape.num_steps), np.arange(shape.num_layers), loads, name=f"drift-h{num_hot}")
