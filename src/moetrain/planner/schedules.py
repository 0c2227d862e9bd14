"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it runs.

An action is a forward (``F``) or backward (``B``) of one micro-batch on one model chunk, or an
overlapped pair (``FB``) that runs one micro-batch's forward together with another's backward so that
each one's all-to-all hides under the other's compute (SPEC §2; DeepSeek-V3's DualPipe pairs the same
way). The simulator (``moetrain.planner.timeline``) replays these lists; a runtime executor can run
the same lists, which keeps the planner's and the runtime's schedules one and the same.

Torch-free. Chunk c on rank r is global stage ``c·pp + r`` (Megatron's interleaved placement).
"""

from __future__ import annotations

from dataclasses import dataclass

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


def one_f_one_b(pp: int, num_micro: int, extra_warmup: int = 0) -> list[list[Action]]:
    """Non-interleaved 1F1B (PipeDream-Flush; Narayanan et al. SC21 §2.2.1). ``extra_warmup`` runs
    that many more forwards first, so that every steady-state F and B belong to different micro-batches
    (what the overlapped pairing needs)."""
    _check(pp, num_micro, 1)
    ranks: list[list[Action]] = []
    for rank in range(pp):
        warmup = min(pp - rank - 1 + extra_warmup, num_micro)
        actions = [Action("F", i) for i in range(warmup)]
        next_f, next_b = warmup, 0
        while next_b < num_micro:
            if next_f < num_micro:
                actions.append(Action("F", next_f))
                next_f += 1
            actions.append(Action("B", next_b))
            next_b += 1
        ranks.append(actions)
    return ranks


def _interleaved_order(pp: int, vpp: int, num_micro: int, backward: bool) -> list[tuple[int, int]]:
    """(micro_batch, chunk) in the order Megatron's interleaved schedule runs them on every rank:
    groups of ``pp`` micro-batches sweep the chunks (backward sweeps the chunks in reverse)."""
    order = []
    for k in range(num_micro * vpp):
        group, within = divmod(k, pp * vpp)
        chunk = within // pp
        micro = group * pp + within % pp
        order.append((micro, vpp - 1 - chunk if backward else chunk))
    return order


def interleaved_one_f_one_b(pp: int, vpp: int, num_micro: int, extra_warmup: int = 0) -> list[list[Action]]:
    """Interleaved 1F1B with ``vpp`` chunks per rank (Narayanan et al. SC21 §2.2.2): warm-up of
    2·(pp − rank − 1) + (vpp − 1)·pp forwards, then one forward and one backward alternately."""
    if vpp == 1:
        return one_f_one_b(pp, num_micro, extra_warmup)
    _check(pp, num_micro, vpp)
    forwards = _interleaved_order(pp, vpp, num_micro, backward=False)
    backwards = _interleaved_order(pp, vpp, num_micro, backward=True)
    total = num_micro * vpp
    ranks = []
    for rank in range(pp):
        warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp + extra_warmup, total)
        actions = [Action("F", m, c) for m, c in forwards[:warmup]]
        next_f, next_b = warmup, 0
        while next_b < total:
            if next_f < total:
                actions.append(Action("F", *forwards[next_f]))
                next_f += 1
            actions.append(Action("B", *backwards[next_b]))
            next_b += 1
        ranks.append(actions)
    return ranks


def overlapped(pp: int, vpp: int, num_micro: int) -> list[list[Action]]:
    """The interleaved (or plain) 1F1B order with one more warm-up forward per rank, every later forward
    fused with the next backward into one ``FB`` step, then the remaining backwards."""
    if vpp > 1:
        _check(pp, num_micro, vpp)
    forwards = _interleaved_order(pp, vpp, num_micro, backward=False)
    backwards = _interleaved_order(pp, vpp, num_micro, backward=True)
    total = num_micro * vpp
    ranks = []
    for rank in range(pp):
        base = pp - rank - 1 if vpp == 1 else 2 * (pp - rank - 1) + (vpp - 1) * pp
        warmup = min(base + 1, total)
        actions = [Action("F", m, c) for m, c in forwards[:warmup]]
        for k in range(warmup, total):
            (fm, fc), (bm, bc) = forwards[k], backwards[k - warmup]
            actions.append(Action("FB", fm, fc, bm, bc))
        actions.extend(Action("B", m, c) for m, c in backwards[total - warmup:])
        ranks.append(actions)
    return ranks


def build_schedule(pp: int, vpp: int, num_micro: int, overlap: bool) -> list[list[Action]]:
    """Every rank's action list. The overlapped schedule runs one more warm-up forward per rank so that
    each fused step pairs different micro-batches and receives both inputs before it starts (the same
    lists as ``moetrain.distributed.schedules.build_schedule``, which the runtime executes; a test
    checks that they are equal)."""
    if not overlap:
        return interleaved_one_f_one_b(pp, vpp, num_micro)
    return overlapped(pp, vpp, num_micro)


def _check(pp: int, num_micro: int, vpp: int) -> None:
    if pp < 1 or num_micro < 1 or vpp < 1:
        raise UserError(f"schedule needs pp, vpp and micro-batches ≥ 1 (got pp={pp}, vpp={vpp}, m={num_micro})")
    if vpp > 1 and num_micro % pp:
        raise UserError(
            f"interleaved schedule needs micro-batches ({num_micro}) divisible by pp ({pp}); "
            "change the global batch or micro-batch size"
        )
