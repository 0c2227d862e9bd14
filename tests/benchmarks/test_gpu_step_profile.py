"""``benchmarks/gpu_step_profile.triton_kernel_sources``: a profiled kernel's source is read back from
Inductor's cache, whole (decorators and body), from the newest graph that has it, and a name is not
mistaken for a longer one it begins."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scripts import load_script

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
