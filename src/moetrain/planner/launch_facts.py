"""Layout facts that a published run's own launch script states where its validation row is silent.

The validation rows copy what a paper or table prints; a run's released launch script often says more:
the micro-batch size, the interleaving and the gradient-reduction mode. A row left empty there would be
read with the README's defaults (micro-batch 1, no interleaving), which is a different layout from the
one that was measured. ``with_launch_facts`` fills only the cells the row leaves empty, and only for
rows whose ``source`` names the run the script belongs to; a stated cell always wins.

Narayanan et al. (SC21), Table 1 (the ``NAR21-`` rows): Megatron-LM ``examples/sc21/run_table_1.sh``
gives, per model size, ``MBS``, ``--num-layers-per-virtual-pipeline-stage`` (layers per virtual stage:
the stages per rank are layers / pp / that) and ``DDP``: ``torch`` (PyTorch DistributedDataParallel,
whose bucketed all-reduce runs under the backward) for 1.7B-18B, ``local`` (Megatron's own, which
all-reduces after the backward) from 39B on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchFacts:
    """What one run's launch script states. None: the script does not set it either."""

    source_mentions: str
    """Text the row's ``source`` cell must contain: the facts belong to that publication's run."""
    script: str
    """Where the facts are written, quoted into the row's source when they are used."""
    micro_batch: int | None = None
    layers_per_virtual_stage: int | None = None
    """Megatron's ``--num-layers-per-virtual-pipeline-stage``: the row's layers / pp / this are its virtual
    stages per rank."""
    overlapped: tuple[str, ...] = ()
    """Traffic the script's stack overlaps with compute ("DP": gradient reduction under the backward)."""


_SC21 = "Narayanan et al. SC21"
_SC21_SCRIPT = "Megatron-LM examples/sc21/run_table_1.sh"


def _sc21(micro_batch: int, layers_per_virtual_stage: int | None = None, torch_ddp: bool = False) -> LaunchFacts:
    return LaunchFacts(_SC21, _SC21_SCRIPT, micro_batch, layers_per_virtual_stage, ("DP",) if torch_ddp else ())


LAUNCH_FACTS: dict[str, LaunchFacts] = {
    "NAR21-01": _sc21(16, torch_ddp=True),  # 1.7B
    "NAR21-02": _sc21(16, torch_ddp=True),  # 3.6B
    "NAR21-03": _sc21(16, torch_ddp=True),  # 7.5B
    "NAR21-04": _sc21(8, torch_ddp=True),  # 18B
    "NAR21-05": _sc21(4),  # 39B
    "NAR21-06": _sc21(2, 5),  # 76B
    "NAR21-07": _sc21(2, 5),  # 145B
    "NAR21-08": _sc21(1, 3),  # 310B
    "NAR21-09": _sc21(1, 1),  # 530B
    "NAR21-10": _sc21(1),  # 1T
}


def with_launch_facts(row: dict) -> dict:
    """The row with the empty cells its run's launch script states filled in, and the script named in its
    source (the stated overlap as the source phrase ``validation.row_workload`` reads); the row itself when
    no script is known for it."""
    facts = LAUNCH_FACTS.get(row.get("id", ""))
    source = row.get("source") or ""
    if facts is None or facts.source_mentions not in source:
        return row
    filled = dict(row)
    used = []
    vpp = None
    if facts.layers_per_virtual_stage:
        vpp = int(row["layers"]) // int(row["pp"]) // facts.layers_per_virtual_stage
    for column, value in (("micro_batch", facts.micro_batch), ("vpp", vpp)):
        if value is not None and not (row.get(column) or "").strip():
            filled[column] = str(value)
            used.append(f"{column} {value}")
    if facts.overlapped:
        used.append("/".join(facts.overlapped) + " comm overlap")
    if used:
        filled["source"] = f"{source}; from {facts.script}: {', '.join(used)}"
    return filled
