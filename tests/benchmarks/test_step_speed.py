"""``benchmarks/step_speed.py --fallback``: the fallback variants run only when a variant failed, and the
record says which failed and why (the GPU suite spends a slot's minutes on the dense mask only when
FlexAttention's variant did not run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from scripts import load_script


def _run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, failing: set[str]) -> dict:
    step_speed = load_script("benchmarks/step_speed.py")
    ran = []

    def run_variant(variant, args):
        ran.append(variant.name)
        if variant.name in failing:
            raise RuntimeError(f"{variant.name} did not compile")
        return step_speed.VariantResult(variant.name, variant.micro_batch, variant.document_mask, 2.0, 1.0,
                                        [2.0, 1.0], 100.0, 0.3, None, 10.0, None)

    monkeypatch.setattr(step_speed, "run_variant", run_variant)
    out = tmp_path / "speed.json"
    monkeypatch.setattr(sys, "argv", ["step_speed.py", "--device", "cpu", "--variants",
                                      "compiled:8:block,eager:8:dense", "--fallback", "compiled:8:dense",
                                      "--out", str(out)])
    step_speed.main()
    record = json.loads(out.read_text())
    assert [v["variant"] for v in record["variants"]] == [n for n in ran if n not in failing]
    return record


def test_the_fallback_runs_only_when_a_variant_failed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    record = _run(monkeypatch, tmp_path, failing=set())
    assert [v["variant"] for v in record["variants"]] == ["compiled:8:block", "eager:8:dense"]
    assert "the fallback (compiled:8:dense) is not run" in capsys.readouterr().out

    record = _run(monkeypatch, tmp_path, failing={"compiled:8:block"})
    assert [v["variant"] for v in record["variants"]] == ["eager:8:dense", "compiled:8:dense"]
    assert record["failed_variants"] == [{"variant": "compiled:8:block",
                                          "error": "RuntimeError: compiled:8:block did not compile"}]
