"""``eager_only``: keep a function out of every compiled graph, as ``torch.compiler.disable`` does,
without loading the compiler when the module that uses it is imported.

``torch.compiler.disable`` imports Dynamo at decoration time: about 2 CPU-seconds in every process that
imports the distributed runtime, most of which never compile (torchrun ranks of an eager run, Ray actors,
CLI subprocesses). torch's own lazy form, ``torch._disable_dynamo``, wraps the function in one that
applies ``torch._dynamo.disable`` on its first call. Dynamo does not trace that wrapper (its module is on
Dynamo's skip list), so a compiled caller breaks its graph at the call, as it would at a disabled function,
and the wrapped function runs eager, everything it calls included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager_only(fn: F) -> F:
    """``fn``, kept out of compiled graphs (it and what it calls run eager), Dynamo loaded on first call."""
    return torch._disable_dynamo(fn)  # type: ignore[return-value]
