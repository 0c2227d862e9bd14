"""Event-driven replay of a pipeline schedule: every rank runs its action list (``schedules``) in
order; an action starts when its rank is free and its inputs have arrived (the previous stage's
forward, the next stage's backward, plus the send/recv time). All-to-all spans are placed on their
own lane, split into the part hidden under compute and the part that stalls the rank.

Per action the durations are:

- ``F`` alone: f + a_f − hidden_alone_f (only the shared expert can hide a dispatch when overlap is on)
- ``B`` alone: b + a_b − hidden_alone_b
- ``FB`` pair (overlap on): f + b + a_f + a_b − min(a_f + a_b, f + b, h_f + h_b): each all-to-all runs under
  the other micro-batch's compute, a layer's under the layer it is paired with, so no more than the
  per-layer caps ``h`` (``LayerCosts.a2a_paired_hidden`` summed over the stage's MoE layers) hide. The
  dependencies allow no more: a layer's dispatch must land before its experts run, and its combine before
  the next layer starts, so a layer whose exchange outlasts the paired compute stalls the pair there; the
  head's and the embedding's compute hide at most the excess of the layer next to them, which the cap
  leaves out.

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
from typing import NamedTuple

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
    hide_paired_forward: np.ndarray | None = None
    """The most a paired step hides of each stage's forward and backward all-to-all (see the module
    docstring); None: as much as the pair's compute (stages whose layers' all-to-all never outlasts it)."""
    hide_paired_backward: np.ndarray | None = None


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


def uniform_costs(num_stages: int, forward: float, backward: float, a2a: float = 0.0, hide_alone: float = 0.0,
                  p2p: float = 0.0) -> StageCosts:
    """Every one of ``num_stages`` global stages (pp·vpp) alike; ``a2a`` and ``hide_alone`` per forward and
    backward together, split evenly between the two."""
    full = lambda x: np.full(num_stages, float(x))  # noqa: E731
    return StageCosts(full(forward), full(backward), full(a2a / 2), full(a2a / 2), full(hide_alone / 2),
                      full(hide_alone / 2), p2p)


class _ActionCost(NamedTuple):
    """What one action costs its rank: compute, the all-to-all it issues, and the part of that all-to-all
    hidden under compute (the rest stalls the rank). A named tuple: the replay's inner loop builds them."""

    compute: float
    comm: float
    hidden: float


class _ActionCosts:
    """What each action costs its rank (see the module docstring): a forward or a backward alone (only the
    shared expert hides a dispatch, and only with overlap on), priced once per global stage, and a fused
    pair, whose all-to-alls run under each other's compute."""

    def __init__(self, costs: StageCosts, overlap: bool) -> None:
        def alone(compute: np.ndarray, comm: np.ndarray, hide: np.ndarray) -> list[_ActionCost]:
            return [_ActionCost(compute[i], comm[i], min(comm[i], hide[i]) if overlap else 0.0)
                    for i in range(len(compute))]

        self._forward = alone(costs.forward, costs.a2a_forward, costs.hide_alone_forward)
        self._backward = alone(costs.backward, costs.a2a_backward, costs.hide_alone_backward)
        unbounded = np.full(len(costs.forward), np.inf)
        self._paired_forward = unbounded if costs.hide_paired_forward is None else costs.hide_paired_forward
        self._paired_backward = unbounded if costs.hide_paired_backward is None else costs.hide_paired_backward

    def of(self, action: Action, rank: int, pp: int) -> _ActionCost:
        """What ``action`` costs on ``rank``."""
        f_stage = action.chunk * pp + rank
        if action.kind == "F":
            return self._forward[f_stage]
        if action.kind == "B":
            return self._backward[f_stage]
        b_stage = action.bwd_chunk * pp + rank
        forward, backward = self._forward[f_stage], self._backward[b_stage]
        compute = forward.compute + backward.compute
        comm = forward.comm + backward.comm
        cap = float(self._paired_forward[f_stage] + self._paired_backward[b_stage])
        return _ActionCost(compute, comm, min(comm, compute, cap))


@dataclass
class _Arrivals:
    """When each (micro-batch, stage) finished its forward and its backward: what the next action waits for."""

    last_stage: int
    p2p: float
    f_end: dict[tuple[int, int], float] = field(default_factory=dict)
    b_end: dict[tuple[int, int], float] = field(default_factory=dict)

    def forward_input(self, micro: int, stage: int) -> float | None:
        """When the forward of ``micro`` on ``stage`` has its input (None: not yet produced)."""
        if stage == 0:
            return 0.0
        end = self.f_end.get((micro, stage - 1))
        return None if end is None else end + self.p2p

    def backward_input(self, micro: int, stage: int) -> float | None:
        """When the backward of ``micro`` on ``stage`` has its gradient (the last stage: its own forward)."""
        if stage == self.last_stage:
            return self.f_end.get((micro, stage))
        end = self.b_end.get((micro, stage + 1))
        return None if end is None else end + self.p2p

    def ready(self, action: Action, rank: int, pp: int) -> float | None:
        """When every input of ``action`` on ``rank`` has arrived (None: one has not been produced yet)."""
        f_stage = action.chunk * pp + rank
        if action.kind == "F":
            return self.forward_input(action.micro_batch, f_stage)
        if action.kind == "B":
            return self.backward_input(action.micro_batch, f_stage)
        r1 = self.forward_input(action.micro_batch, f_stage)
        r2 = self.backward_input(action.bwd_micro_batch, action.bwd_chunk * pp + rank)
        return None if r1 is None or r2 is None else max(r1, r2)

    def finish(self, action: Action, rank: int, pp: int, end: float) -> None:
        """Record ``action``'s outputs as leaving at ``end`` (a fused pair's forward half too: the halves take
        turns to the end of the step)."""
        if action.kind in ("F", "FB"):
            self.f_end[(action.micro_batch, action.chunk * pp + rank)] = end
        if action.kind == "B":
            self.b_end[(action.micro_batch, action.chunk * pp + rank)] = end
        if action.kind == "FB":
            self.b_end[(action.bwd_micro_batch, action.bwd_chunk * pp + rank)] = end


def simulate_timeline(pp: int, vpp: int, num_micro: int, costs: StageCosts, overlap: bool = False,
                      record_spans: bool = False) -> TimelineResult:
    """Replay the schedule of ``pp`` ranks × ``vpp`` chunks over ``num_micro`` micro-batches: each rank runs its
    next action as soon as the rank is free and the action's inputs have arrived."""
    schedule = build_schedule(pp, vpp, num_micro, overlap)
    arrivals = _Arrivals(last_stage=pp * vpp - 1, p2p=costs.p2p)
    action_costs = _ActionCosts(costs, overlap)
    rank_free = [0.0] * pp
    busy = [0.0] * pp
    pointer = [0] * pp
    spans: list[Span] = []
    a2a_total = 0.0
    a2a_exposed = 0.0
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for rank in range(pp):
            while pointer[rank] < len(schedule[rank]):
                action: Action = schedule[rank][pointer[rank]]
                ready = arrivals.ready(action, rank, pp)
                if ready is None:
                    break
                start = max(rank_free[rank], ready)
                cost = action_costs.of(action, rank, pp)
                exposed = cost.comm - cost.hidden
                end = start + cost.compute + exposed
                arrivals.finish(action, rank, pp, end)
                rank_free[rank] = end
                busy[rank] += cost.compute + exposed
                a2a_total += cost.comm
                a2a_exposed += exposed
                if record_spans:
                    spans.extend(_action_spans(rank, start, end, str(action), cost))
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


def _action_spans(rank: int, start: float, end: float, label: str, cost: _ActionCost) -> list[Span]:
    """An action's compute span, and with an all-to-all its hidden part (from the start) and its exposed part
    (after the compute, to the end)."""
    spans = [Span(rank, start, start + cost.compute, label, "compute")]
    if cost.comm > 0:
        spans.append(Span(rank, start, start + cost.hidden, label, "a2a-hidden"))
        spans.append(Span(rank, start + cost.compute, end, label, "a2a-exposed"))
    return spans


def stage_costs_from_model(stages: StageTimes, index: int, pp: int, vpp: int) -> StageCosts:
    """Per-stage costs of strategy ``index`` from the cost model's ``StepCosts.stages``: every chunk
    carries 1/vpp of a middle stage; the first and last stages add their embedding / head extras."""
    first, middle, last = (float(stages.first_compute_s[index]), float(stages.middle_compute_s[index]),
                           float(stages.last_compute_s[index]))
    n = pp * vpp
    total = np.full(n, middle / vpp)
    if n == 1:
        total[0] = first
    else:
        total[0] += first - middle
        total[-1] += last - middle

    def per_stage(first_s: np.ndarray, other_s: np.ndarray) -> np.ndarray:
        """An all-to-all quantity of every global stage: 1/vpp of a stage's, the first stage's own (its dense
        layers have none)."""
        values = np.full(n, float(other_s[index]) / vpp)
        values[0] += (float(first_s[index]) - float(other_s[index])) / vpp
        return values

    a2a = per_stage(stages.first_a2a_s, stages.other_a2a_s)
    hide = per_stage(stages.first_a2a_alone_hidden_s, stages.other_a2a_alone_hidden_s)
    paired = per_stage(stages.first_a2a_paired_hidden_s, stages.other_a2a_paired_hidden_s)
    share = float(stages.forward_fraction[index])
    return StageCosts(share * total, (1 - share) * total, a2a / 2, a2a / 2, hide / 2, hide / 2, 0.0,
                      paired / 2, paired / 2)


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
