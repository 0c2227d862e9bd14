"""The reward curve of an RL run as a PNG: reward per step (and its running mean), held-out accuracy; the
check of a figure file's suffix that ``rl --plot`` and ``simulate --timeline`` run before their work."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from moetrain.errors import UserError


def figure_formats() -> list[str]:
    """The file suffixes matplotlib writes a figure as (its own list, Pillow's formats included), less pgf
    where its TeX program is missing: matplotlib lists it anyway and fails only when it saves."""
    # lazy, heavy: matplotlib loads only for a run that draws; backend_bases loads no GUI and no pyplot
    import matplotlib
    from matplotlib.backend_bases import FigureCanvasBase

    formats = set(FigureCanvasBase.get_supported_filetypes())
    if shutil.which(matplotlib.rcParams["pgf.texsystem"]) is None:
        formats.discard("pgf")
    return sorted(formats)


def check_figure_file(path: str, flag: str) -> None:
    """Refuse, before the work that draws it, a figure file whose suffix matplotlib cannot write: it would
    fail only after the work (or, with no suffix, silently write PATH.png instead of PATH)."""
    suffix = Path(path).suffix.lower().removeprefix(".")
    formats = figure_formats()
    if suffix in formats:
        return
    problem = "has no suffix" if not suffix else f"has the suffix .{suffix}, which matplotlib cannot write"
    raise UserError(f"{flag} {path} {problem}; end it in one of .{', .'.join(formats)} "
                    f"(e.g. {Path(path).with_suffix('.png')})")


def plot_reward_curve(rows: list[dict[str, Any]], path: Path, title: str, window: int = 10) -> Path:
    # lazy, heavy: matplotlib loads only when a curve is drawn, and its backend is chosen before pyplot loads
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    steps = [r for r in rows if "reward" in r]
    evals = [r for r in rows if "heldout_accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if steps:
        xs, ys = [r["step"] for r in steps], [r["reward"] for r in steps]
        ax.plot(xs, ys, color="tab:blue", alpha=0.3, lw=1, label="reward (step mean)")
        smooth = [sum(ys[max(0, i - window + 1): i + 1]) / len(ys[max(0, i - window + 1): i + 1])
                  for i in range(len(ys))]
        ax.plot(xs, smooth, color="tab:blue", lw=2, label=f"reward ({window}-step mean)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["heldout_accuracy"] for r in evals], "o-", color="tab:red",
                label="held-out accuracy (greedy)")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
