"""Per-step metrics: a JSONL file (one row per optimizer step), the progress display and the summary.

The JSONL file is strict JSON: a non-finite float (a diverged loss, an undefined ratio) is written as
``null``, which every JSON reader accepts, where Python's default ``NaN``/``Infinity`` is not JSON; the
rows kept in memory keep the float. Steps are numbered from 1 (the first completed optimizer step).

MFU = achieved model FLOP/s over the device's peak: tokens/s × ``training_flops_per_token`` (the one
formula in ``moetrain.costs.flops``, 3 × forward, no recompute counted) / ``ClusterConfig.peak_flops``.
Expert load per MoE layer is max / mean of the tokens routed to each expert in the step: 1.0 is a
perfect balance, num_experts / top_k the worst case.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from moetrain.config.model import moe_layer_indices

if TYPE_CHECKING:
    from moetrain.config import ModelConfig


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float, at any depth of dicts and lists, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


@dataclass
class MetricsLogger:
    """Writes one JSON row per step and keeps what the end-of-run summary needs."""

    path: Path | None
    resume: bool = False
    tensorboard_dir: Path | None = None
    """Also write each row's numbers as TensorBoard scalars here (needs the optional ``tensorboard``)."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    _file: TextIO | None = None
    _board: Any = None
    _last_at: int = 0
    """Where the last row starts in the file (``amend_last`` rewrites it)."""

    def __post_init__(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A resumed run appends to the interrupted run's file, so the file holds one curve. Not opened
            # for appending: ``amend_last`` writes over the last row in place.
            if not self.resume or not self.path.exists():
                self.path.write_text("", encoding="utf-8")
            self._file = self.path.open("r+", encoding="utf-8")
            self._file.seek(0, 2)
        if self.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # optional dependency (checks.py refuses its absence)

            self._board = SummaryWriter(log_dir=str(self.tensorboard_dir))

    def log(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self._file is not None:
            self._last_at = self._file.tell()
            self._file.write(json.dumps(json_safe(row), allow_nan=False) + "\n")
            self._file.flush()
        self._scalars(row, row)

    def amend_last(self, fields: dict[str, Any]) -> None:
        """Add ``fields`` to the last row, known only after it was logged (what the step's checkpoint save
        cost). The row is logged before the save, so a crash during the save keeps it; it is then written
        again, longer, over itself in one write (a killed process leaves the old row or the new one)."""
        row = self.rows[-1]
        row.update(fields)
        if self._file is not None:
            self._file.seek(self._last_at)
            self._file.write(json.dumps(json_safe(row), allow_nan=False) + "\n")
            self._file.flush()
        self._scalars(fields, row)

    def _scalars(self, fields: dict[str, Any], row: dict[str, Any]) -> None:
        if self._board is not None:
            for tag, value in tensorboard_scalars(fields).items():
                self._board.add_scalar(tag, value, global_step=row["step"])
            self._board.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._board is not None:
            self._board.close()
            self._board = None


def tensorboard_scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row as TensorBoard tags: ``loss``, ``lr``, ... as they are, lists as
    ``expert_load_max_over_mean/3`` (one per MoE block), the layout (constant) left out."""
    scalars: dict[str, float] = {}
    for key, value in row.items():
        if key == "step" or isinstance(value, (bool, dict)):
            continue
        if isinstance(value, (int, float)):
            scalars[key] = float(value)
        elif isinstance(value, list):
            scalars.update({f"{key}/{i}": float(v) for i, v in enumerate(value) if isinstance(v, (int, float))})
    return scalars


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


def moe_layer_labels(model_cfg: ModelConfig) -> list[str]:
    """``MoE layer 2`` for a decoder layer, ``MTP layer 8`` for an MTP module's block (numbered as in the
    routing trace), in the order of the per-layer metrics."""
    return [f"MoE layer {i}" if i < model_cfg.num_layers else f"MTP layer {i}" for i in moe_layer_indices(model_cfg)]


def timed_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows throughput is measured on: not the first (one-off start-up costs: allocator warm-up, kernel
    choice) and none during which torch compiled (``compiled``: the first step of a compiled run, and any
    later one that meets a new shape or mask); all of them when nothing else is left."""
    timed = [r for r in rows[1:] if not r.get("compiled")]
    return timed or rows[1:] or rows


def timed_steps_note(rows: list[dict[str, Any]]) -> str | None:
    """Which steps ``timed_rows`` left out, in words, when a step after the first compiled (None: none did)."""
    if not any(r.get("compiled") for r in rows[1:]):
        return None
    timed = timed_rows(rows)
    if any(r.get("compiled") for r in timed):
        return f"{len(timed)} of {len(rows)}, every one compiling: a longer run measures the compiled speed"
    return f"{len(timed)} of {len(rows)} (left out: step 1 and {len(rows) - 1 - len(timed)} later that compiled)"


def summary_table(rows: list[dict[str, Any]], title: str, model_cfg: ModelConfig | None = None,
                  show_mfu: bool = True) -> Table:
    """First/last loss, throughput, MFU and per-layer expert load over the run's logged steps. With the
    run's ``model_cfg`` the load rows name their layer (MTP blocks as such); without it they are numbered
    ``MoE block 0, 1, ...`` in metrics order, which says nothing of the layer. ``show_mfu`` False leaves MFU
    out (a CPU run: its peak is nominal, so the figure would mean nothing; tokens/s says the speed)."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    if not rows:
        table.add_row("steps", "0")
        return table
    timed = timed_rows(rows)
    tokens = sum(r["tokens"] for r in timed)
    seconds = sum(r["step_time_s"] for r in timed)
    table.add_row("steps", f"{rows[0]['step']}–{rows[-1]['step']}")
    if note := timed_steps_note(rows):
        table.add_row("timed steps", note)
    table.add_row("first loss", f"{rows[0]['loss']:.4f}")
    table.add_row("last loss", f"{rows[-1]['loss']:.4f}")
    table.add_row("tokens/s", f"{tokens / seconds:,.0f}" if seconds > 0 else "n/a")
    if show_mfu:
        table.add_row("mean MFU", f"{sum(r['mfu'] for r in timed) / len(timed):.2%}")
    loads = [r["expert_load_max_over_mean"] for r in timed if r["expert_load_max_over_mean"]]
    if loads:
        num_blocks = len(loads[0])
        labels = moe_layer_labels(model_cfg) if model_cfg is not None else []
        assert not labels or len(labels) == num_blocks, "MoE block count differs from the model config's"
        labels = labels or [f"MoE block {k}" for k in range(num_blocks)]
        for block, label in enumerate(labels):
            mean_load = sum(step_loads[block] for step_loads in loads) / len(loads)
            last_load = loads[-1][block]
            table.add_row(f"expert load max/mean, {label}", f"{mean_load:.2f} (last {last_load:.2f})")
    return table


# ----- the progress display -----
_NONE = "—"


def format_step_stats(row: dict[str, Any] | None) -> str:
    """``loss 6.1234 lr 2.9e-03 tokens/s 3,210``; "—" for each value before the first step (no row)."""
    if row is None:
        return f"loss {_NONE} lr {_NONE} tokens/s {_NONE}"
    text = f"loss {row['loss']:.4f} lr {row['lr']:.1e} tokens/s {row['tokens_per_s']:,.0f}"
    if "reward" in row:  # an RL step (moetrain.rl): what it earned, and held-out accuracy where evaluated
        text += f" reward {row['reward']:.3f}"
        if "heldout_accuracy" in row:
            text += f" held-out {row['heldout_accuracy']:.1%}"
    return text


class _StatsColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(format_step_stats(task.fields.get("row")))


@dataclass(frozen=True)
class PlainLineCadence:
    """When ``TrainingProgress`` writes a plain line (not on a terminal): every ``every_steps`` steps (0 counts
    as 1) or ``every_s`` seconds of ``clock``, whichever comes first."""

    every_steps: int = 10
    every_s: float = 30.0
    clock: Callable[[], float] = time.monotonic


class TrainingProgress:
    """The trainer's progress display, used as a context manager around the steps.

    On a terminal: a rich progress bar. Elsewhere (a log file, a cluster job's output) a bar is either
    invisible or thousands of redrawn lines, so it writes a plain line instead, ``step 40/200 loss 6.1234
    lr 2.9e-03 tokens/s 3,210``, every ``cadence.every_steps`` steps or ``cadence.every_s`` seconds, whichever
    comes first, and at the last step (and at the end for the last step seen, when the run stops early).
    ``update`` takes the step just completed (numbered from 1, like the metrics file) and its metrics row."""

    def __init__(self, console: Console, total_steps: int, start_step: int = 0, enabled: bool = True,
                 cadence: PlainLineCadence = PlainLineCadence()) -> None:
        self.console, self.total_steps, self.start_step, self.enabled = console, total_steps, start_step, enabled
        self.every_steps, self.every_s, self.clock = max(cadence.every_steps, 1), cadence.every_s, cadence.clock
        self._progress: Progress | None = None
        self._task: Any = None
        self._last_print = 0.0
        self._pending: tuple[int, dict[str, Any]] | None = None
        """The newest step not printed yet (plain mode), printed at the end."""

    def __enter__(self) -> TrainingProgress:
        self._last_print = self.clock()
        if self.enabled and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), _StatsColumn(), TimeRemainingColumn(),
                console=self.console, transient=False)
            self._task = self._progress.add_task("train", total=self.total_steps, completed=self.start_step, row=None)
            self._progress.start()
        return self

    def update(self, step: int, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=step, row=row)
            return
        now = self.clock()
        if step >= self.total_steps or step % self.every_steps == 0 or now - self._last_print >= self.every_s:
            self._print(step, row)
            self._last_print, self._pending = now, None
        else:
            self._pending = (step, row)

    def _print(self, step: int, row: dict[str, Any]) -> None:
        self.console.print(f"step {step}/{self.total_steps} {format_step_stats(row)}",
                           markup=False, highlight=False, soft_wrap=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        elif self._pending is not None:
            self._print(*self._pending)
            self._pending = None


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
