"""``eager_only``: keep a function out of every compiled graph, as ``torch.compiler.disable`` does,
without loading the compiler when the module that uses it is imported.

``torch.compiler.disable`` imports Dynamo at decoration time, so every process that imported the runtime
loaded it. torch's own lazy form, ``torch._disable_dynamo``, wraps the function in one that applies
``torch._dynamo.disable`` on its first call: Dynamo is loaded only where one of these functions runs (an EP
dispatch, a swap or telemetry hook), not in a Ray driver, a CLI, or an eager rank without them. Importing
``moetrain.train``, ``moetrain.rl.stalesync`` and ``moetrain.cli`` took 0.4 CPU-seconds less (FSDP and
DTensor still load much of what Dynamo needs). Dynamo does not trace the wrapper (its module is on Dynamo's
skip list), so a compiled caller breaks its graph at the call, as it would at a disabled function, and the
wrapped function runs eager, everything it calls included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager_only(fn: F) -> F:
    """``fn``, kept out of compiled graphs (it and what it calls run eager), Dynamo loaded on first call."""
    return torch._disable_dynamo(fn)  # type: ignore[return-value]
