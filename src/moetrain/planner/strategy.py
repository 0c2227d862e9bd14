"""Parallel strategies as columns of numpy arrays, so that the cost model scores many at once.

One ``Strategies`` holds N candidates; column ``tp[i]``, ``pp[i]``, ... is candidate i. Recompute is
coded 0 none / 1 selective / 2 full; the all-to-all kind 0 flat / 1 hierarchical. The cost model's
results (``moetrain.planner.costmodel.StepCosts``) are columns the same way, one entry per candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from moetrain.config.parallel import ParallelConfig

RECOMPUTE_NAMES = ("none", "selective", "full")
A2A_NAMES = ("flat", "hierarchical")


class Columns:
    """A dataclass whose fields are equal-length numpy arrays (or nested ``Columns``): entry i of every
    field describes candidate i, so a subset is one ``take``."""

    def __len__(self) -> int:
        first = getattr(self, fields(self)[0].name)  # type: ignore[arg-type]
        return len(first) if isinstance(first, Columns) else int(np.asarray(first).shape[0])

    def take(self, index):
        """The candidates ``index`` selects (an index array, a mask or a slice), in that order."""
        return type(self)(**{f.name: _take(getattr(self, f.name), index) for f in fields(self)})  # type: ignore

    @classmethod
    def broadcast(cls, n: int, **columns):
        """An instance whose every field is ``columns``' value as ``n`` floats (a scalar is repeated)."""
        return cls(**{name: np.broadcast_to(np.asarray(v, dtype=float), (n,)) for name, v in columns.items()})


def _take(column, index):
    return column.take(index) if isinstance(column, Columns) else np.asarray(column)[index]


@dataclass
class Strategies(Columns):
    tp: np.ndarray
    sp: np.ndarray
    pp: np.ndarray
    vpp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray
    cp: np.ndarray
    dp: np.ndarray
    zero: np.ndarray
    micro_batch: np.ndarray
    recompute: np.ndarray
    a2a: np.ndarray
    overlap: np.ndarray

    @classmethod
    def concat(cls, parts: list[Strategies]) -> Strategies:
        """The layouts of ``parts``, one after another."""
        return cls(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)})

    @classmethod
    def from_parallel(cls, configs: list[ParallelConfig]) -> Strategies:
        def col(get, dtype=np.int64):
            return np.array([get(c) for c in configs], dtype=dtype)

        return cls(
            tp=col(lambda c: c.tp),
            sp=col(lambda c: c.sp, bool),
            pp=col(lambda c: c.pp),
            vpp=col(lambda c: c.vpp),
            ep=col(lambda c: c.ep),
            etp=col(lambda c: c.etp),
            cp=col(lambda c: c.cp),
            dp=col(lambda c: c.dp),
            zero=col(lambda c: c.zero),
            micro_batch=col(lambda c: c.micro_batch),
            recompute=col(lambda c: RECOMPUTE_NAMES.index(c.recompute)),
            a2a=col(lambda c: A2A_NAMES.index(c.a2a)),
            overlap=col(lambda c: c.overlap, bool),
        )

    def to_parallel(self, i: int) -> ParallelConfig:
        return ParallelConfig(
            tp=int(self.tp[i]),
            sp=bool(self.sp[i]),
            pp=int(self.pp[i]),
            vpp=int(self.vpp[i]),
            ep=int(self.ep[i]),
            etp=int(self.etp[i]),
            cp=int(self.cp[i]),
            dp=int(self.dp[i]),
            zero=int(self.zero[i]),
            micro_batch=int(self.micro_batch[i]),
            recompute=RECOMPUTE_NAMES[int(self.recompute[i])],
            a2a=A2A_NAMES[int(self.a2a[i])],
            overlap=bool(self.overlap[i]),
        )
