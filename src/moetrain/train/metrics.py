"""Per-step metrics: a JSONL file (one row per optimizer step), a rich progress bar and the summary.

MFU = achieved model FLOP/s over the device's peak: tokens/s × ``training_flops_per_token`` (the one
formula in ``moetrain.costs.flops``, 3 × forward, no recompute counted) / ``ClusterConfig.peak_flops``.
Expert load per MoE layer is max / mean of the tokens routed to each expert in the step: 1.0 is a
perfect balance, num_experts / top_k the worst case.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


@dataclass
class MetricsLogger:
    """Writes one JSON row per step and keeps what the end-of-run summary needs."""

    path: Path | None
    resume: bool = False
    rows: list[dict[str, Any]] = field(default_factory=list)
    _file: TextIO | None = None

    def __post_init__(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A resumed run appends to the interrupted run's file, so the file holds one curve.
            self._file = self.path.open("a" if self.resume else "w", encoding="utf-8")

    def log(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class RoutingTraceWriter:
    """Writes the routing trace read by ``moetrain.balance.traces.read_trace``: JSONL, one row per step and
    MoE layer, ``{"step", "layer", "tokens_per_expert"}`` (token-expert assignments summed over the step's
    micro-batches; a token routed to k experts counts k times)."""

    path: Path
    layers: list[int]
    """Index of each MoE block, in the order of ``ModelOutput.tokens_per_expert`` rows."""
    resume: bool = False
    _file: TextIO | None = None

    def __post_init__(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Like the metrics file, a resumed run appends, so the trace covers the whole run once.
        self._file = self.path.open("a" if self.resume else "w", encoding="utf-8")

    def write(self, step: int, tokens_per_expert: list[list[int]]) -> None:
        assert self._file is not None and len(tokens_per_expert) == len(self.layers)
        for layer, counts in zip(self.layers, tokens_per_expert):
            self._file.write(json.dumps({"step": step, "layer": layer, "tokens_per_expert": counts},
                                        separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  lr {task.fields[lr]:.2e}  {task.fields[tokens_per_s]:,.0f} tok/s"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def summary_table(rows: list[dict[str, Any]], title: str) -> Table:
    """First/last loss, throughput, MFU and per-layer expert load over the run's logged steps."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    if not rows:
        table.add_row("steps", "0")
        return table
    timed = rows[1:] or rows  # step 1 includes one-off start-up costs (allocator warm-up, kernel choice)
    tokens = sum(r["tokens"] for r in timed)
    seconds = sum(r["step_time_s"] for r in timed)
    table.add_row("steps", f"{rows[0]['step']}–{rows[-1]['step']}")
    table.add_row("first loss", f"{rows[0]['loss']:.4f}")
    table.add_row("last loss", f"{rows[-1]['loss']:.4f}")
    table.add_row("tokens/s", f"{tokens / seconds:,.0f}" if seconds > 0 else "n/a")
    table.add_row("mean MFU", f"{sum(r['mfu'] for r in timed) / len(timed):.2%}")
    loads = [r["expert_load_max_over_mean"] for r in timed if r["expert_load_max_over_mean"]]
    if loads:
        num_layers = len(loads[0])
        for layer in range(num_layers):
            mean_load = sum(step_loads[layer] for step_loads in loads) / len(loads)
            last_load = loads[-1][layer]
            table.add_row(f"expert load max/mean, MoE layer {layer}", f"{mean_load:.2f} (last {last_load:.2f})")
    return table


def keep_rows_through(path: Path, step: int) -> int:
    """Drop the JSONL rows of ``path`` whose ``step`` is after ``step`` (a resumed run replays them from
    its checkpoint, so the file keeps one row per step); returns how many were dropped. The file is
    rewritten through a temporary file and a rename, so an interruption leaves the old or the new one."""
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    tmp.replace(path)
    return len(lines) - len(kept)
