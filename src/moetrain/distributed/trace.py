"""Per-rank timeline of compute and communication spans, written as Chrome trace JSON.

A ``Tracer`` is activated for a block (``with tracer.active():``); ``span(name, kind)`` records into the
active tracer and costs nothing when none is active. Asynchronous communication records its real
interval: from the moment it is issued to the moment its completion callback fires (``record_async``),
so an exchange that runs while the main thread computes shows up under the compute span. Waiting on
an exchange is a ``wait:<name>`` comm span on the waiting thread's lane: the host is blocked there.
Spans are laid out by host thread: ``main``, and under the overlapped schedule the backward task's
thread (``moetrain.distributed.overlap``); exchanges in flight are on lane ``async``.

``a2a_hidden_fraction`` = (all-to-all time during which the host computed) / (all-to-all time).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

_ACTIVE: ContextVar[Tracer | None] = ContextVar("moetrain_tracer", default=None)


@dataclass
class Span:
    name: str
    kind: str
    """"compute" or "comm"."""
    start_s: float
    end_s: float
    lane: str = "main"


@dataclass
class Tracer:
    rank: int = 0
    spans: list[Span] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextlib.contextmanager
    def active(self) -> Iterator[Tracer]:
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def add(self, span_: Span) -> None:
        with self._lock:
            self.spans.append(span_)

    def chrome_events(self) -> list[dict]:
        origin = min((s.start_s for s in self.spans), default=0.0)
        return [
            {"name": s.name, "cat": s.kind, "ph": "X", "pid": self.rank, "tid": s.lane,
             "ts": (s.start_s - origin) * 1e6, "dur": (s.end_s - s.start_s) * 1e6}
            for s in self.spans
        ]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": self.chrome_events()}))

    def a2a_hidden_fraction(self) -> float:
        return hidden_fraction(self.spans)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _subtract(base: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for start, end in base:
        pieces = [(start, end)]
        for c_start, c_end in cut:
            pieces = [p for a, b in pieces for p in ((a, min(b, c_start)), (max(a, c_end), b)) if p[1] > p[0]]
        out.extend(pieces)
    return out


def hidden_fraction(spans: list[Span], comm_prefix: str = "a2a") -> float:
    """Share of all-to-all time during which the host computed.

    The host computes inside compute spans except while it is blocked in a synchronous collective or
    a wait (a comm span on a host lane, i.e. not ``async``); so a synchronous all-to-all is never
    hidden, and an asynchronous one is hidden for the part of its flight that the host spent
    computing. (Under the overlapped schedule only one of its two threads runs at a time, so their
    compute spans never count twice.)"""
    blocked = _union([(s.start_s, s.end_s) for s in spans if s.kind == "comm" and s.lane != "async"])
    busy = _subtract(_union([(s.start_s, s.end_s) for s in spans if s.kind == "compute"]), blocked)
    total = hidden = 0.0
    for s in spans:
        if s.kind != "comm" or not s.name.startswith(comm_prefix):
            continue
        total += s.end_s - s.start_s
        if s.lane != "async":
            continue
        for start, end in busy:
            hidden += max(0.0, min(end, s.end_s) - max(start, s.start_s))
    return hidden / total if total > 0 else 1.0


@contextlib.contextmanager
def span(name: str, kind: str = "compute") -> Iterator[None]:
    tracer = _ACTIVE.get()
    if tracer is None:
        yield
        return
    start = time.perf_counter()
    thread = threading.current_thread()
    lane = "main" if thread is threading.main_thread() else thread.name
    try:
        yield
    finally:
        tracer.add(Span(name, kind, start, time.perf_counter(), lane))


def record_async(name: str, work: dist.Work) -> None:
    """Record an asynchronous collective from now until its completion callback runs."""
    tracer = _ACTIVE.get()
    if tracer is None:
        return
    start = time.perf_counter()

    def done(fut):  # runs on the communication thread when the exchange finishes
        tracer.add(Span(name, "comm", start, time.perf_counter(), lane="async"))

    work.get_future().then(done)
