"""The runtime's pipeline schedules, seen by the planner's timeline.

One source of truth: ``moetrain.schedules`` (torch-free) generates each pipeline rank's
ordered steps, which the runtime executor runs; this module only re-labels them as flat ``Action``s
(``F``, ``B``, or ``FB`` for an overlapped forward/backward pair) for ``moetrain.planner.timeline``.
Chunk c on rank r is global stage ``c·pp + r`` (Megatron's interleaved placement).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain import schedules as runtime
from moetrain.errors import UserError


@dataclass(frozen=True)
class Action:
    kind: str
    """"F", "B" or "FB" (forward of ``micro_batch``/``chunk`` overlapped with the backward of
    ``bwd_micro_batch``/``bwd_chunk``)."""
    micro_batch: int
    chunk: int = 0
    bwd_micro_batch: int = -1
    bwd_chunk: int = -1

    def __str__(self) -> str:
        if self.kind == "FB":
            return f"F{self.micro_batch}.{self.chunk}|B{self.bwd_micro_batch}.{self.bwd_chunk}"
        return f"{self.kind}{self.micro_batch}.{self.chunk}"


def _as_action(step: runtime.Step) -> Action:
    if isinstance(step, runtime.Overlapped):
        fwd, bwd = step.forward, step.backward
        return Action("FB", fwd.micro_batch, fwd.chunk, bwd.micro_batch, bwd.chunk)
    return Action(step.kind, step.micro_batch, step.chunk)


def build_schedule(pp: int, vpp: int, num_micro: int, overlap: bool) -> list[list[Action]]:
    """Every rank's actions: (interleaved) 1F1B, or with ``overlap`` the paired forward/backward schedule
    (one more warm-up forward per rank, then each forward fused with the next backward)."""
    if pp < 1 or num_micro < 1 or vpp < 1:
        raise UserError(f"schedule needs pp, vpp and micro-batches ≥ 1 (got pp={pp}, vpp={vpp}, m={num_micro})")
    if vpp > 1 and num_micro % pp:
        raise UserError(
            f"interleaved schedule needs micro-batches ({num_micro}) divisible by pp ({pp}); "
            "change the global batch or micro-batch size"
        )
    return [[_as_action(step) for step in rank] for rank in runtime.build_schedule(pp, vpp, num_micro, overlap)]


def one_f_one_b(pp: int, num_micro: int) -> list[list[Action]]:
    """Non-interleaved 1F1B (PipeDream-Flush; Narayanan et al. SC21 §2.2.1)."""
    return build_schedule(pp, 1, num_micro, overlap=False)


def interleaved_one_f_one_b(pp: int, vpp: int, num_micro: int) -> list[list[Action]]:
    """Interleaved 1F1B with ``vpp`` chunks per rank (Narayanan et al. SC21 §2.2.2)."""
    return build_schedule(pp, vpp, num_micro, overlap=False)
