"""``eager_only`` keeps a function out of compiled graphs as ``torch.compiler.disable`` does, and importing
the runtime no longer loads the compiler."""

import subprocess
import sys

import torch

from moetrain.runtime_base.eager_only import eager_only


def _graphs_and_calls(decorate) -> tuple[int, list[bool]]:
    """Compile a function that calls a decorated one between two pieces of tensor work; run it three
    times. Returns how many graphs Dynamo made and, per call, whether the decorated function ran while
    Dynamo was compiling."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    seen: list[bool] = []

    @decorate
    def host_side(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return x * 2

    @torch.compile(backend="eager")
    def step(x: torch.Tensor) -> torch.Tensor:
        return host_side(x.sin() + 1).cos()

    x = torch.linspace(0, 1, 6)
    for _ in range(3):
        torch.testing.assert_close(step(x), ((x.sin() + 1) * 2).cos())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return graphs, seen


def test_a_compiled_caller_breaks_its_graph_and_runs_the_function_eager_each_call():
    graphs, seen = _graphs_and_calls(eager_only)
    assert seen == [False, False, False]  # ran at every call, never traced
    assert graphs == 2  # the work before the call and the work after it
    assert (graphs, seen) == _graphs_and_calls(torch.compiler.disable)


def test_an_unwrapped_function_is_traced_into_the_graph():
    """The check above can fail: without the decorator Dynamo traces the function, so what it records
    was read while compiling (Dynamo replays the list's append after each call)."""
    _, seen = _graphs_and_calls(lambda fn: fn)
    assert seen == [True, True, True]


def test_importing_the_runtime_does_not_load_the_compiler():
    code = (
        "import sys, moetrain.train, moetrain.rl.stalesync, moetrain.memory.runtime, moetrain.distributed.etp\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
