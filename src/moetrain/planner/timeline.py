"""Event-driven replay of a pipeline schedule: every rank runs its action list (``schedules``) in
order; an action starts when its rank is free and its inputs have arrived (the previous stage's
forward, the next stage's backward, plus the send/recv time). All-to-all spans are placed on their
own lane, split into the part hidden under compute and the part that stalls the rank.

Per action the durations are:

- ``F`` alone: f + a_f − hidden_alone_f (only the shared expert can hide a dispatch when overlap is on)
- ``B`` alone: b + a_b − hidden_alone_b
- ``FB`` pair (overlap on): f + b + max(0, a_f + a_b − (f + b)): each all-to-all runs under the other
  micro-batch's compute.

A step starts when all its inputs have arrived and its outputs (activation forward, gradient backward)
leave when the whole step is done. The runtime's executor (``moetrain.distributed.pipeline``) receives
both inputs of a fused step before it starts; it posts each half's send when that half ends, but the
halves take turns at every exchange to the end of the step, so the forward's output leaves close to the
end, which the timeline takes. With a pipeline this puts a fused step's forward output behind most of its
backward half, so pairing lengthens the critical path; without interleaving it serialises neighbouring
ranks (about twice the step), with interleaving the other chunks absorb it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moetrain.planner.costmodel import StageTimes
from moetrain.planner.schedules import Action, build_schedule


@dataclass
class StageCosts:
    """Per global stage (chunk·pp + rank), per micro-batch: compute and all-to-all seconds."""

    forward: np.ndarray
    backward: np.ndarray
    a2a_forward: np.ndarray
    a2a_backward: np.ndarray
    hide_alone_forward: np.ndarray
    hide_alone_backward: np.ndarray
    p2p: float = 0.0


@dataclass
class Span:
    rank: int
    start: float
    end: float
    label: str
    lane: str
    """"compute", "a2a-hidden" or "a2a-exposed"."""


@dataclass
class TimelineResult:
    step_time_s: float
    busy_s: list[float]
    bubble_fraction: list[float]
    a2a_total_s: float
    a2a_exposed_s: float
    spans: list[Span] = field(default_factory=list)

    @property
    def a2a_hidden_s(self) -> float:
        return self.a2a_total_s - self.a2a_exposed_s


def uniform_costs(pp: int, vpp: int, forward: float, backward: float, a2a: float = 0.0,
                  hide_alone: float = 0.0, p2p: float = 0.0) -> StageCosts:
    n = pp * vpp
    full = lambda x: np.full(n, float(x))  # noqa: E731
    return StageCosts(full(forward), full(backward), full(a2a / 2), full(a2a / 2), full(hide_alone / 2),
                      full(hide_alone / 2), p2p)


def simulate_timeline(pp: int, vpp: int, num_micro: int, costs: StageCosts, overlap: bool = False,
                      record_spans: bool = False) -> TimelineResult:
    schedule = build_schedule(pp, vpp, num_micro, overlap)
    last_stage = pp * vpp - 1
    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    rank_free = [0.0] * pp
    busy = [0.0] * pp
    pointer = [0] * pp
    spans: list[Span] = []
    a2a_total = 0.0
    a2a_exposed = 0.0

    def f_ready(micro: int, stage: int) -> float | None:
        if stage == 0:
            return 0.0
        end = f_end.get((micro, stage - 1))
        return None if end is None else end + costs.p2p

    def b_ready(micro: int, stage: int) -> float | None:
        if stage == last_stage:
            return f_end.get((micro, stage))
        end = b_end.get((micro, stage + 1))
        return None if end is None else end + costs.p2p

    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for rank in range(pp):
            while pointer[rank] < len(schedule[rank]):
                action: Action = schedule[rank][pointer[rank]]
                f_stage = action.chunk * pp + rank
                if action.kind == "F":
                    ready = f_ready(action.micro_batch, f_stage)
                elif action.kind == "B":
                    ready = b_ready(action.micro_batch, f_stage)
                else:
                    b_stage = action.bwd_chunk * pp + rank
                    r1 = f_ready(action.micro_batch, f_stage)
                    r2 = b_ready(action.bwd_micro_batch, b_stage)
                    ready = None if r1 is None or r2 is None else max(r1, r2)
                if ready is None:
                    break
                start = max(rank_free[rank], ready)
                if action.kind == "F":
                    compute = costs.forward[f_stage]
                    comm = costs.a2a_forward[f_stage]
                    hidden = min(comm, costs.hide_alone_forward[f_stage]) if overlap else 0.0
                elif action.kind == "B":
                    compute = costs.backward[f_stage]
                    comm = costs.a2a_backward[f_stage]
                    hidden = min(comm, costs.hide_alone_backward[f_stage]) if overlap else 0.0
                else:
                    compute = costs.forward[f_stage] + costs.backward[b_stage]
                    comm = costs.a2a_forward[f_stage] + costs.a2a_backward[b_stage]
                    hidden = min(comm, compute)
                exposed = comm - hidden
                end = start + compute + exposed
                if action.kind == "F":
                    f_end[(action.micro_batch, f_stage)] = end
                if action.kind == "FB":
                    # The forward half ends close to the end of the fused step (the halves take turns).
                    f_end[(action.micro_batch, f_stage)] = end
                if action.kind == "B":
                    b_end[(action.micro_batch, f_stage)] = end
                if action.kind == "FB":
                    b_end[(action.bwd_micro_batch, action.bwd_chunk * pp + rank)] = end
                rank_free[rank] = end
                busy[rank] += compute + exposed
                a2a_total += comm
                a2a_exposed += exposed
                if record_spans:
                    spans.append(Span(rank, start, start + compute, str(action), "compute"))
                    if comm > 0:
                        spans.append(Span(rank, start, start + hidden, str(action), "a2a-hidden"))
                        spans.append(Span(rank, start + compute, end, str(action), "a2a-exposed"))
                pointer[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # a schedule whose dependencies cannot be met: a bug in the schedule builder
            raise RuntimeError("pipeline schedule deadlocked")
    step = max(rank_free)
    return TimelineResult(
        step_time_s=step,
        busy_s=busy,
        bubble_fraction=[1.0 - b / step if step > 0 else 0.0 for b in busy],
        a2a_total_s=a2a_total / pp,
        a2a_exposed_s=a2a_exposed / pp,
        spans=spans,
    )


def stage_costs_from_model(stages: StageTimes, index: int, pp: int, vpp: int) -> StageCosts:
    """Per-stage costs of strategy ``index`` from the cost model's ``StepCosts.stages``: every chunk
    carries 1/vpp of a middle stage; the first and last stages add their embedding / head extras."""
    first, middle, last = (float(stages.first_compute_s[index]), float(stages.middle_compute_s[index]),
                           float(stages.last_compute_s[index]))
    n = pp * vpp
    total = np.full(n, middle / vpp)
    a2a = np.full(n, float(stages.other_a2a_s[index]) / vpp)
    hide = np.full(n, float(stages.other_a2a_alone_hidden_s[index]) / vpp)
    if n == 1:
        total[0] = first
    else:
        total[0] += first - middle
        total[-1] += last - middle
    a2a[0] += (float(stages.first_a2a_s[index]) - float(stages.other_a2a_s[index])) / vpp
    hide[0] += (float(stages.first_a2a_alone_hidden_s[index]) - float(stages.other_a2a_alone_hidden_s[index])) / vpp
    share = float(stages.forward_fraction[index])
    return StageCosts(share * total, (1 - share) * total, a2a / 2, a2a / 2, hide / 2, hide / 2, 0.0)


GANTT_COLOURS = {"F": "#4C72B0", "B": "#55A868", "FB": "#8172B2", "a2a-hidden": "#CCCCCC", "a2a-exposed": "#DD8452"}
GANTT_LABELS = {"F": "forward", "B": "backward", "FB": "forward + backward paired (overlap)",
                "a2a-hidden": "all-to-all hidden under compute", "a2a-exposed": "all-to-all exposed (stalls the rank)"}


def gantt_bars(result: TimelineResult) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """(rank, kind) → the (start, width) bars of that rank's lane, kind one of ``GANTT_COLOURS``: drawn as one
    collection each, since a call per bar costs matplotlib a rescale each (minutes for thousands of bars)."""
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for span in result.spans:
        width = span.end - span.start
        if width <= 0:
            continue
        if span.lane == "compute":
            kind = "FB" if "|" in span.label else span.label[0]
        else:
            kind = span.lane
        bars.setdefault((span.rank, kind), []).append((span.start, width))
    return bars


def gantt_png(result: TimelineResult, path: str, title: str = "") -> None:
    """Write ``gantt_figure`` as a PNG."""
    import matplotlib.pyplot as plt  # lazy, heavy: only a figure needs matplotlib

    fig = gantt_figure(result, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def gantt_figure(result: TimelineResult, title: str = ""):
    """Gantt chart: per rank a compute lane (F blue, B green, FB purple) above an all-to-all lane (grey
    hidden, orange exposed), with a legend of the kinds drawn."""
    import matplotlib  # lazy, heavy: only a figure needs matplotlib

    matplotlib.use("Agg")
    # lazy, heavy as matplotlib; pyplot after the backend is chosen (no display on a training machine)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    num_ranks = max((s.rank for s in result.spans), default=0) + 1
    height = 1.6 + 0.6 * num_ranks
    fig, ax = plt.subplots(figsize=(12, height))
    bars = gantt_bars(result)
    for (rank, kind), ranges in bars.items():
        y = (num_ranks - 1 - rank) * 2
        if kind.startswith("a2a"):
            ax.broken_barh(ranges, (y + 0.1, 0.4), facecolors=GANTT_COLOURS[kind])
        else:
            ax.broken_barh(ranges, (y + 0.55, 0.9), facecolors=GANTT_COLOURS[kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks([(num_ranks - 1 - r) * 2 + 1 for r in range(num_ranks)])
    ax.set_yticklabels([f"rank {r}" for r in range(num_ranks)])
    ax.set_xlabel("seconds (per rank: compute lane above, all-to-all lane below)")
    ax.set_title(title or f"pipeline timeline, step {result.step_time_s:.3f} s")
    drawn = {kind for _, kind in bars}
    handles = [Patch(facecolor=colour, label=GANTT_LABELS[kind]) for kind, colour in GANTT_COLOURS.items()
               if kind in drawn]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 3), frameon=False)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1))  # half an inch at the bottom for the legend
    return fig
