"""``profile_device`` is one probe per function composed by ``DeviceProfile``: the efficiencies follow from the
probes' typed results by the formulas, and the measurements keep the keys ``moetrain profile`` writes."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import load_cluster_config, load_model_config
from moetrain.train.profiler import (
    AttentionProbe,
    BandwidthProbe,
    BusProbe,
    DeviceProfile,
    GemmLine,
    GroupedGemmProbe,
    HostTimes,
    MaskedAttentionProbe,
    _tile_work,
    probe_gemm,
    probe_grouped_gemm,
    probe_masked_attention,
    probe_memory_bandwidth,
)


def _profile(host: HostTimes | None, bus: BusProbe | None = None) -> DeviceProfile:
    cluster, model = load_cluster_config("cpu"), load_model_config("tiny-pangu")
    return DeviceProfile(cluster, model, "cpu", torch.float32, GemmLine([{"m": 1, "n": 1, "k": 1, "seconds": 1.0}],
                                                                        2e-12, 3e-6),
                         AttentionProbe([], 0.25), BandwidthProbe(0.5, 10**9), GroupedGemmProbe(16, 64, 1e-3, 7.0),
                         host, bus)


def test_efficiencies_follow_from_the_probes() -> None:
    host = HostTimes(0.01, 0.03, 0.002, 16, (4, 128), 0.09)
    profile = _profile(host, BusProbe(0.1, 0.8))
    eff = profile.efficiencies()
    peak, passes = profile.cluster.peak_flops("bf16"), profile.model.num_layers + profile.model.num_mtp_layers
    assert list(eff) == ["gemm_max", "gemm_overhead_us", "attention", "memory", "moe_overhead_us", "bus_intra",
                         "host_layer_us", "host_optimizer_ms", "host_probe_tokens", "host_wide_layer_us",
                         "host_wide_batch", "host_wide_seq"]
    assert eff["gemm_max"] == pytest.approx(1 / (2e-12 * peak)) and eff["gemm_overhead_us"] == pytest.approx(3.0)
    assert eff["memory"] == pytest.approx(2e9 / (profile.cluster.hbm_bandwidth_tbps * 1e12))
    assert eff["host_layer_us"] == pytest.approx(0.03 / passes * 1e6)
    assert eff["host_wide_layer_us"] == pytest.approx(0.09 / passes * 1e6)
    assert (eff["host_wide_batch"], eff["host_wide_seq"], eff["host_probe_tokens"]) == (4.0, 128.0, 16.0)
    measured = profile.measured()
    assert list(measured) == ["device", "dtype", "gemm", "attention", "elementwise_add_seconds", "grouped_gemm",
                              "host", "all_reduce_seconds"]
    assert measured["dtype"] == "float32" and measured["host"]["wide_shape"] == (4, 128)


def test_without_host_or_bus_their_terms_are_absent() -> None:
    profile = _profile(None)
    assert set(profile.efficiencies()) == {"gemm_max", "gemm_overhead_us", "attention", "memory", "moe_overhead_us"}
    assert "host" not in profile.measured() and "all_reduce_seconds" not in profile.measured()
    # a GPU's host probe has no wide pass
    gpu_host = HostTimes(0.01, 0.03, 0.002, 16)
    assert "wide_forward_backward_s" not in gpu_host.measured()
    assert "host_wide_layer_us" not in gpu_host.efficiencies(profile.model)


def test_cpu_probes_give_a_line_and_a_bandwidth() -> None:
    gemm = probe_gemm("cpu", torch.float32, repeats=1)
    assert gemm.seconds_per_flop > 0 and gemm.overhead_s >= 0 and len(gemm.shapes) == 7
    assert probe_memory_bandwidth("cpu", torch.float32, repeats=1).bytes_moved == 3 * 8 * 1024 * 1024 * 4
    grouped = probe_grouped_gemm(load_model_config("tiny-pangu"), "cpu", torch.float32, 1, gemm)
    assert grouped is not None and grouped.seconds > 0 and grouped.moe_overhead_us >= 0


def test_masked_attention_slowdowns_are_time_per_computed_tile() -> None:
    # causal 1 ms; the block mask computes half the causal tiles in 2 ms: 4x per tile; the dense mask the
    # square (1.6x the causal tiles) in 3.2 ms: 2x per tile
    probe = MaskedAttentionProbe(4, 512, 1e-3, 2e-3, 3.2e-3, 0.5, 1.6)
    profile = _profile(None)
    profile = DeviceProfile(**{**profile.__dict__, "masked_attention": probe})
    eff = profile.efficiencies()
    assert eff["attention_block_slowdown"] == pytest.approx(4.0)
    assert eff["attention_dense_slowdown"] == pytest.approx(2.0)
    assert profile.measured()["masked_attention"]["block_work"] == 0.5


def test_tile_work_counts_the_block_masks_tiles() -> None:
    """512 tokens in 4 tiles a side, 4 documents of one tile each: the block mask keeps the 4 diagonal tiles
    of the causal 10; the square has 16."""
    from moetrain.models.attention import document_block_mask

    document_ids = (torch.arange(512) // 128).expand(2, 512)
    assert _tile_work(document_block_mask(document_ids), 2, 512) == (pytest.approx(0.4), pytest.approx(1.6))


def test_no_masked_attention_probe_off_a_gpu() -> None:
    # FlexAttention has no backward on a CPU: the slowdowns stay unmeasured (1.0, the causal kernel's time)
    assert probe_masked_attention(load_model_config("tiny-pangu"), "cpu", torch.float32, 1) is None


def test_a_failing_masked_attention_probe_leaves_the_profile_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Taken for a GPU on a CPU, the probe fails (no CUDA to synchronise, or, with a torch built for CUDA, no
    driver; FlexAttention has no CPU backward): it is left out with a warning that says why, instead of
    failing the whole profile."""
    import moetrain.train.profiler as profiler

    monkeypatch.setattr(profiler, "MASKED_ATTENTION_SHAPE", (1, 256))
    monkeypatch.setattr(profiler, "_kind", lambda device: "cuda")
    with pytest.warns(UserWarning, match="^moetrain profile: the masked-attention probe was left out "
                                         "\\((AssertionError|NotImplementedError|RuntimeError): .+\\)$"):
        assert probe_masked_attention(load_model_config("tiny-pangu"), "cpu", torch.float32, 1) is None
