"""The train → generate → train switch of RL Fusion, as explicit ordered phases with their cost.

One cycle per RL step, always in this order: ``offload`` (optimizer state and gradients to host, or
skipped when generation fits), ``reshard`` (the weight sync into the generation layout), ``generate``,
``free`` (the KV cache), ``restore`` (the offloaded state back). A phase called out of turn raises
``SwitchOrderError``: generating before the reshard would sample with stale weights, training before the
restore would step without its moments. Each phase records its wall time and its peak memory: on CUDA
the allocator's peak (reset at the phase's start), on a CPU the process's resident set sampled every
few milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

PHASES = ("offload", "reshard", "generate", "free", "restore")
RSS_SAMPLE_S = 0.002


class SwitchOrderError(RuntimeError):
    pass


@dataclass(frozen=True)
class PhaseRecord:
    name: str
    seconds: float
    peak_bytes: int
    """Device allocator peak on CUDA; resident set size peak on a CPU."""
    skipped: bool = False


class Switch:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.records: list[PhaseRecord] = []
        """This cycle's phases so far (cleared when a new cycle starts with ``offload``)."""
        self._next = 0

    @property
    def expected(self) -> str:
        return PHASES[self._next]

    @contextlib.contextmanager
    def phase(self, name: str, skipped: bool = False) -> Iterator[None]:
        if name != self.expected:
            raise SwitchOrderError(f"switch phase {name!r} out of order: {self.expected!r} comes next "
                                   f"(order: {' → '.join(PHASES)})")
        if name == PHASES[0]:
            self.records = []
        with _peak_memory(self.device) as peak:
            start = time.perf_counter()  # the sampler's start and stop are not the phase's time
            yield
            seconds = time.perf_counter() - start
        self.records.append(PhaseRecord(name, seconds, peak(), skipped))
        self._next = (self._next + 1) % len(PHASES)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    def metrics(self) -> dict[str, float | bool]:
        """The cycle's row fields: ``switch_<phase>_s``, ``switch_<phase>_peak_mib``, the total."""
        row: dict[str, float | bool] = {}
        for r in self.records:
            row[f"switch_{r.name}_s"] = r.seconds
            row[f"switch_{r.name}_peak_mib"] = r.peak_bytes / 2**20
        row["switch_s"] = self.seconds
        row["offloaded"] = any(r.name == "offload" and not r.skipped for r in self.records)
        return row


@contextlib.contextmanager
def _peak_memory(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield lambda: torch.cuda.max_memory_allocated(device)
        torch.cuda.synchronize(device)
        return
    sampler = _RssSampler()
    with sampler:
        yield lambda: sampler.peak


class _RssSampler:
    """The resident set's peak while the block runs (a thread reading /proc/self/statm)."""

    def __init__(self) -> None:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_S):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
