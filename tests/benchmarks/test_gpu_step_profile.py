"""``benchmarks/gpu_step_profile``: a profiled kernel's source is read back from Inductor's cache, whole
(decorators and body), from the newest graph that has it, and a name is not mistaken for a longer one it
begins; the device time it reports counts kernels, not the host's ranges mirrored on the device."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scripts import ROOT, load_script

KERNEL = '''@triton_heuristics.persistent_reduction(
    size_hints={{'x': 134217728, 'r0_': 8}},
    filename=__file__,
)
@triton.jit
def {name}(in_out_ptr0, in_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):
    xnumel = {xnumel}
    r0_numel = 8

    tl.store(in_out_ptr0 + (x0), tmp8, None)
'''


def _write(path: Path, text: str, mtime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (mtime, mtime))


def test_kernel_sources_come_whole_from_the_newest_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile = load_script("benchmarks/gpu_step_profile.py")
    name = "triton_per_fused__to_copy_add_index_sum_view_9"
    longer = name + "9"  # begins with the name: must not be taken for it
    # an older graph (a test's tiny model) with the same kernel name, then the profiled run's kernel file, and
    # its wrapper holding the kernel as a string
    _write(tmp_path / "ab" / "old.py", KERNEL.format(name=name, xnumel=2048), 1_000.0)
    _write(tmp_path / "cd" / "new.py", "import triton\n\n" + KERNEL.format(name=longer, xnumel=7)
           + "\n\n" + KERNEL.format(name=name, xnumel=134217728) + "\n\ndef get_args():\n    return []\n", 2_000.0)
    _write(tmp_path / "ef" / "wrapper.py",
           f"{name}_w = async_compile.triton('x', '''\n" + KERNEL.format(name="triton_poi_fused_mul_silu_2",
                                                                         xnumel=4) + "''', device_str='cuda')\n",
           1_500.0)
    sources = profile.triton_kernel_sources([name, "triton_poi_fused_mul_silu_2", "triton_missing_1"], tmp_path)
    assert list(sources) == [name, "triton_poi_fused_mul_silu_2"]
    assert sources[name] == KERNEL.format(name=name, xnumel=134217728).rstrip()
    assert sources["triton_poi_fused_mul_silu_2"].endswith("tl.store(in_out_ptr0 + (x0), tmp8, None)")
    assert sources["triton_poi_fused_mul_silu_2"].startswith("@triton_heuristics.persistent_reduction(")
    assert profile.triton_kernel_sources([name], tmp_path / "absent") == {}
    # a name ``top_kernels`` cut at its limit matches as a prefix
    cut = "triton_poi_fused_mul_si"
    monkeypatch.setattr(profile, "KERNEL_NAME_CHARS", len(cut))
    assert "def triton_poi_fused_mul_silu_2(" in profile.triton_kernel_sources([cut], tmp_path)[cut]


def _event(name: str, start: float, end: float, *, device: bool = True, annotation: bool = False) -> SimpleNamespace:
    """A profiler event as ``gpu_step_profile`` reads one: microseconds, device or host, a range or not."""
    device_type = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device_type,
                           is_user_annotation=annotation)


def test_the_optimizers_range_on_the_device_is_not_counted_as_a_kernel() -> None:
    """Torch mirrors the optimizer's ``record_function`` range onto the device's timeline, spanning the
    optimizer's kernels: device time by kind, the top kernels and the busy time count the kernels once."""
    profile = load_script("benchmarks/gpu_step_profile.py")
    events = [
        _event("ampere_bf16_gemm", 0.0, 4000.0),
        _event("Optimizer.step#AdamW.step", 5000.0, 9000.0, annotation=True),
        _event("multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", 5000.0, 7000.0),
        _event("multi_tensor_apply_kernel<TensorListMetadata>", 8000.0, 9000.0),
        _event("aten::_fused_adamw_", 4900.0, 9100.0, device=False),
    ]
    prof = SimpleNamespace(events=lambda: events)
    assert [e.name for e in profile.device_events(prof)] == [events[0].name, events[2].name, events[3].name]
    assert profile.device_ms_by_kind(prof) == {"gemm": 4.0, "optimizer": 3.0}
    assert [(k["name"], k["device_ms"]) for k in profile.top_kernels(prof, 5)] == [
        ("ampere_bf16_gemm", 4.0), (events[2].name, 2.0), (events[3].name, 1.0)]
    assert profile.busy_seconds(prof) == pytest.approx(7e-3)  # 4 + 2 + 1 ms: the gap inside the range is idle


def test_a_record_from_before_the_fix_has_the_optimizers_range_taken_out() -> None:
    """The H200 record (7b5f6aa) counted ``Optimizer.step#AdamW.step`` (12.678 ms) among the optimizer's
    kernels (30.39 ms in all); the planner check compares the simulator with the 17.712 ms left. A record
    written since says so (``device_time``) and is read as it is."""
    check = load_script("benchmarks/planner_step_check.py")
    record = json.loads((ROOT / "benchmarks/results/step_speed_h200.json").read_text())
    row = next(r for r in record["variants"] if r["variant"] == "compiled:8:block")
    by_kind = check.kernel_ms_by_kind(record, row)
    assert by_kind["optimizer"] == pytest.approx(30.39 - 12.678)
    assert {k: v for k, v in by_kind.items() if k != "optimizer"} == {
        k: v for k, v in row["device_ms_by_kind"].items() if k != "optimizer"}
    assert check.kernel_ms_by_kind({**record, "device_time": "…"}, row) == row["device_ms_by_kind"]
