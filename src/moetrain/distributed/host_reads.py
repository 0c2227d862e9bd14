"""Device→host reads inside a step: the declared ones, and a counter that finds the others.

A read of a device value on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``, or an
operator whose output shape depends on the data, such as ``nonzero`` or boolean indexing) makes the
host wait until the device has caught up: the launch queue drains and the GPU idles while the host
refills it. A step should read only what it must, and say so where it does:

- ``host_read(reason)`` wraps each intended read (the step's one metrics read; under expert
  parallelism, one count exchange per MoE layer and micro-batch, whose sizes the all-to-all needs on
  the host). Inside it, CUDA's sync debug mode is lifted, so a step run under
  ``torch.cuda.set_sync_debug_mode("error")`` fails on any other read.
- ``HostReadCounter`` counts, on any device (CPU too, where nothing actually waits), the reads that
  would make a GPU wait: each declared read by its reason, and each undeclared one by the operator
  or method that did it. It combines a ``TorchDispatchMode`` (operators that read a value or have a
  data-dependent shape) with wrappers of the ``Tensor`` methods that read without an operator
  (``tolist``, ``numpy``, ``cpu``). The dispatch mode sees the thread it was entered on: the overlapped
  schedule's helper thread is seen through the method wrappers only.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
READ_OPS = {
    _aten._local_scalar_dense.default: "item",  # .item(), bool(t), int(t), float(t)
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten.bincount.default: "bincount",  # reads the maximum to size its output
    _aten._unique2.default: "unique",
    _aten.unique_consecutive.default: "unique_consecutive",
    _aten.repeat_interleave.Tensor: "repeat_interleave",
    _aten.equal.default: "equal",
}
"""Operators whose result the host needs before it can go on (a value, or the size of the output)."""
READ_METHODS = ("tolist", "numpy", "cpu")
"""Tensor methods that read device memory on the host without dispatching an operator on CPU tensors."""


@dataclass
class HostReads:
    declared: Counter[str] = field(default_factory=Counter)
    """Reads inside ``host_read(reason)``, by reason."""
    undeclared: list[str] = field(default_factory=list)
    """Every other read: the operator or method, and the line of moetrain code that made it."""


_ACTIVE: list[HostReads] = []
_LOCAL = threading.local()  # depth of declared reads / method wrappers on this thread


def _quiet() -> bool:
    return getattr(_LOCAL, "depth", 0) > 0


@contextlib.contextmanager
def _hushed() -> Iterator[None]:
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        yield
    finally:
        _LOCAL.depth -= 1


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""``.../moetrain/``: the package's folder; a read's place is given relative to it."""
_TORCH_OPTIM = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "optim") + os.sep


def _caller() -> str | None:
    """The innermost moetrain frame outside this module (where the read was written); None for a read
    inside ``torch.optim``, whose step counters live on the host by design (``capturable=False``), so
    reading them never waits for the device."""
    for frame in reversed(traceback.extract_stack()):
        filename = os.path.abspath(frame.filename)
        if filename.startswith(_TORCH_OPTIM):
            return None
        # By the package's own folder, not by a "/moetrain/" in the path: a checkout named moetrain holds
        # its virtual environment, and torch's files, under that name too.
        if filename.startswith(_PACKAGE) and filename != os.path.abspath(__file__):
            return f"{filename[len(_PACKAGE):]}:{frame.lineno}"
    return "?"


def _record(name: str) -> None:
    if _ACTIVE and not _quiet() and (where := _caller()) is not None:
        _ACTIVE[-1].undeclared.append(f"{name} at {where}")


@contextlib.contextmanager
def host_read(reason: str) -> Iterator[None]:
    """An intended device→host read: counted as ``reason``, allowed under CUDA's sync debug mode."""
    if _ACTIVE and not _quiet():
        _ACTIVE[-1].declared[reason] += 1
    cuda_mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    if cuda_mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        with _hushed():
            yield
    finally:
        if cuda_mode:
            torch.cuda.set_sync_debug_mode(cuda_mode)


class _ReadOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = READ_OPS.get(func)
        if name is None and func is _aten.index.Tensor:
            # boolean-mask indexing sizes its output by the mask's count
            indices = args[1] if len(args) > 1 else []
            if any(i is not None and i.dtype == torch.bool for i in indices):
                name = "boolean index"
        if name is not None:
            _record(name)
        return func(*args, **(kwargs or {}))


def _wrap(method_name: str):
    original = getattr(torch.Tensor, method_name)

    def wrapper(self, *args, **kwargs):
        _record(f".{method_name}()")
        with _hushed():
            return original(self, *args, **kwargs)

    return original, wrapper


class HostReadCounter:
    """``with HostReadCounter() as reads:`` … ``reads.declared``, ``reads.undeclared``. Not reentrant."""

    def __enter__(self) -> HostReads:
        self.reads = HostReads()
        _ACTIVE.append(self.reads)
        self._originals = {}
        for name in READ_METHODS:
            original, wrapper = _wrap(name)
            self._originals[name] = original
            setattr(torch.Tensor, name, wrapper)
        self._mode = _ReadOps()
        self._mode.__enter__()
        return self.reads

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        _ACTIVE.remove(self.reads)
