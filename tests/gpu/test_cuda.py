"""The runtime on a CUDA device: the same math as on CPU, the native grouped GEMM, bf16 training, and the
memory policy's swap streams. Skipped where torch sees no GPU (CI); run on a GPU machine with
``pytest tests/gpu``."""

from __future__ import annotations

import copy
import io
import json
import random

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from moetrain.config import TrainingConfig, load_cluster_config, load_model_config
from moetrain.config.run import RunSpec
from moetrain.costs.activations import ActivationShape, model_activation_bytes
from moetrain.distributed.parallelize import apply_compile
from moetrain.memory import MemoryPlan
from moetrain.memory.measure import measure_activations
from moetrain.memory.options import uses_flash_attention
from moetrain.memory.policy import num_blocks
from moetrain.memory.runtime import apply_memory_policy
from moetrain.models import build_model
from moetrain.models.dispatch import permute, unpermute
from moetrain.models.experts import grouped_mm, native_grouped_mm_ok
from moetrain.models.router import Routing, count_tokens_per_expert
from moetrain.train import SuppliedParts, Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SEQ, BATCH = 64, 2


def _ids(vocab: int, device: str, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, seq), generator=torch.Generator().manual_seed(0)).to(device)


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.item(), {k: p.grad.detach().float().cpu() for k, p in model.named_parameters() if p.grad is not None}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_native_grouped_gemm_matches_a_per_expert_fp32_reference():
    torch.manual_seed(0)
    counts = torch.tensor([0, 37, 128, 5, 200, 0, 64, 1], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(8, 256, 512, device="cuda", dtype=torch.bfloat16) * 0.05).requires_grad_(True)
    assert native_grouped_mm_ok(x, w), "H100-class GPU with bf16 should take the fused grouped GEMM"
    out = grouped_mm(x, w, counts)
    out.float().square().sum().backward()

    x32, w32 = x.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    ref = torch.cat([block @ w32[e] for e, block in enumerate(torch.split(x32, counts.tolist()))])
    ref.square().sum().backward()
    assert _rel_err(out.float(), ref) < 1e-2
    assert _rel_err(x.grad.float(), x32.grad) < 2e-2
    assert _rel_err(w.grad.float(), w32.grad) < 2e-2
    assert torch.all(w.grad[0] == 0) and torch.all(w.grad[5] == 0)  # experts with no tokens get no gradient


def test_permute_round_trip_on_cuda_equals_cpu():
    torch.manual_seed(0)
    tokens, experts, top_k = 96, 16, 4
    x = torch.randn(tokens, 32)
    expert_ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)
    results = []
    for device in ("cpu", "cuda"):
        ids_d = expert_ids.to(device)
        routing = Routing(ids_d, weights.to(device), count_tokens_per_expert(ids_d, experts),
                          torch.zeros((), device=device))
        permuted, meta = permute(x.to(device), routing)
        back = unpermute(permuted * 2.0, meta)
        results.append((permuted.cpu(), routing.tokens_per_expert_E.cpu(), back.cpu()))
    (cpu_tokens, cpu_counts, cpu_back), (gpu_tokens, gpu_counts, gpu_back) = results
    assert torch.equal(cpu_counts, gpu_counts)
    assert torch.equal(cpu_tokens, gpu_tokens)
    torch.testing.assert_close(gpu_back, cpu_back, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-pangu", "tiny-qwen3", "tiny-mixtral"])
def test_fp32_model_on_cuda_matches_cpu(name):
    """Same weights, same tokens: loss and gradients on the GPU equal the CPU's up to fp32 rounding
    (TF32 is off by default in torch for fp32 matmuls)."""
    cfg = load_model_config(name)
    cpu_model = build_model(cfg, seed=0)
    gpu_model = copy.deepcopy(cpu_model).to("cuda")
    ids = _ids(cfg.vocab_size, "cpu")
    cpu_loss, cpu_grads = _loss_and_grads(cpu_model, ids)
    gpu_loss, gpu_grads = _loss_and_grads(gpu_model, ids.cuda())
    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-5)
    worst = max((_rel_err(gpu_grads[k], cpu_grads[k]), k) for k in cpu_grads)
    assert worst[0] < 1e-3, worst


def test_bf16_autocast_loss_is_close_to_fp32():
    """Autocast runs the experts through the fused bf16 grouped GEMM; the loss stays within bf16's
    rounding of the fp32 loss."""
    cfg = load_model_config("tiny-pangu")
    model = build_model(cfg, device="cuda", seed=0)
    ids = _ids(cfg.vocab_size, "cuda")
    with torch.no_grad():
        fp32 = model(ids, labels=ids).loss.item()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16 = model(ids, labels=ids).loss.item()
    assert bf16 == pytest.approx(fp32, rel=2e-2)


@pytest.mark.parametrize("options", [("swap_attention", "swap_moe"), ("layer",),
                                     ("norm", "mla_up", "activation", "permute", "router")])
def test_memory_policy_on_cuda_keeps_the_gradients(options):
    """Swap copies to pinned host memory on a side stream and back before backward; recompute
    re-runs the forward. Both give the plain model's gradients on the GPU."""
    cfg = load_model_config("tiny-pangu")
    ids = _ids(cfg.vocab_size, "cuda")
    plain = build_model(cfg, device="cuda", seed=0)
    policed = copy.deepcopy(plain)
    handle = apply_memory_policy(policed, MemoryPlan.uniform(options, num_blocks(cfg)))
    plain_loss, plain_grads = _loss_and_grads(plain, ids)
    loss, grads = _loss_and_grads(policed, ids)
    handle.remove()
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    # Atomic adds in the CUDA backward of index_add/scatter make the order of sums vary between runs.
    worst = max((_rel_err(grads[k], plain_grads[k]), k) for k in plain_grads)
    assert worst[0] < 1e-5, worst


@pytest.mark.parametrize(("name", "dtype"), [("tiny-pangu", torch.float32), ("tiny-pangu", torch.bfloat16),
                                           ("tiny-qwen3", torch.bfloat16), ("tiny-mixtral", torch.bfloat16)])
def test_analytic_activation_bytes_match_the_bytes_saved_on_cuda(name, dtype):
    """The planner's activation formula counts what autograd keeps on the GPU as well (fused attention
    keeps no S×S scores there). Grouped-query attention in fp32 is left out: torch's fused fp32 kernel
    takes no GQA, and the math fallback it then runs is not in the formula (training on CUDA is bf16)."""
    cfg = load_model_config(name)
    model = build_model(cfg, device="cuda", seed=0).to(dtype)
    ids = _ids(cfg.vocab_size, "cuda")
    measured = measure_activations(model, ids, ids)
    dtype_bytes = 4.0 if dtype == torch.float32 else 2.0
    predicted = model_activation_bytes(ActivationShape(cfg, SEQ, BATCH, dtype_bytes, uses_flash_attention(cfg, "cuda")))
    assert predicted["total"] == pytest.approx(measured.total_bytes, rel=0.05)


def test_swap_lowers_peak_cuda_memory():
    cfg = load_model_config("tiny-pangu")
    ids = _ids(cfg.vocab_size, "cuda", seq=512)
    peaks = {}
    for options in ((), ("swap_attention", "swap_moe")):
        model = build_model(cfg, device="cuda", seed=0)
        # min_swap_numel=0: tiny-pangu's tensors are all below the size the GPU default keeps on the device
        handle = apply_memory_policy(model, MemoryPlan.uniform(options, num_blocks(cfg)),
                                     min_swap_numel=0) if options else None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        model(ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        peaks[options] = torch.cuda.max_memory_allocated() - start
        if handle is not None:
            handle.remove()
        del model
    assert peaks[("swap_attention", "swap_moe")] < 0.9 * peaks[()]


def test_compiled_layers_swapped_whole_keep_the_gradients_and_lower_the_peak():
    """``swap_layer`` around compiled layers copies what each compiled function saves to pinned host memory
    on the side stream and brings it back in backward: the plain compiled model's gradients, a lower peak.
    The partition-only backend saves what Inductor's would (tests/memory) and compiles in seconds."""
    cfg = load_model_config("tiny-pangu")
    ids = _ids(cfg.vocab_size, "cuda", seq=512)
    peaks, grads = {}, {}
    for options in ((), ("swap_layer",)):
        torch._dynamo.reset()
        model = build_model(cfg, device="cuda", seed=0)
        if options:
            apply_memory_policy(model, MemoryPlan.uniform(options, num_blocks(cfg)), min_swap_numel=0, compiled=True)
        apply_compile(model, backend="aot_eager_decomp_partition")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        _, grads[options] = _loss_and_grads(model, ids)
        torch.cuda.synchronize()
        peaks[options] = torch.cuda.max_memory_allocated() - start
        del model
    worst = max((_rel_err(grads[("swap_layer",)][k], grads[()][k]), k) for k in grads[()])
    assert worst[0] < 1e-5, worst
    assert peaks[("swap_layer",)] < 0.9 * peaks[()]


def test_the_host_link_is_measured_on_cuda_only():
    """What the trainer's ``auto`` policy prices swap at: a PCIe/NVLink-C2C copy, between 1 GB/s and 1 TB/s."""
    from moetrain.memory.measure import host_link_bytes_per_s

    assert host_link_bytes_per_s(torch.device("cpu")) is None
    assert 1e9 < host_link_bytes_per_s(torch.device("cuda"), mib=64, repeats=3) < 1e12


def test_trainer_trains_in_bf16_on_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "cache"))
    rng = random.Random(0)
    words = ["the", "king", "queen", "of", "speak", "love", "night", "crown", "my", "lord", "good", "sir"]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(30, 150)))})
                                for _ in range(200)))
    cfg = TrainingConfig(steps=30, global_batch=8, micro_batch=4, seq_len=64, lr=3e-3, warmup_steps=3)
    spec = RunSpec(training=cfg, run={"device": "cuda", "cluster": "h100-sxm-80gb", "data": str(corpus),
                                      "quiet": True})
    trainer = Trainer(spec, SuppliedParts(console=Console(file=io.StringIO())))
    assert trainer.run.autocast_dtype == torch.bfloat16
    rows = trainer.train()
    losses = [row["loss"] for row in rows]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:3]) / 3
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in trainer.run.stage.model.parameters())
    assert rows[-1]["mfu"] > 0


def test_the_host_probe_times_the_fused_update_the_trainer_steps(monkeypatch):
    """``moetrain profile`` prices the optimizer by timing ``probe_host``'s update; on CUDA the trainer steps
    the fused AdamW, so the probe must time that one, not the foreach path's several kernels per list."""
    from moetrain.train.profiler import probe_host

    built = []

    class RecordedAdamW(torch.optim.AdamW):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(torch.optim, "AdamW", RecordedAdamW)
    probe_host(load_model_config("tiny-pangu"), "cuda", repeats=1)
    spec = RunSpec(training=TrainingConfig(steps=1, global_batch=2, micro_batch=2, seq_len=32),
                   run={"device": "cuda", "cluster": "h100-sxm-80gb", "synthetic_data": True, "quiet": True})
    Trainer(spec, SuppliedParts(console=Console(file=io.StringIO())))
    probe, trainer = built[0], built[-1]
    assert trainer.defaults["fused"] is True
    assert (probe.defaults["fused"], probe.defaults["foreach"]) == (True, None)


def test_sdpa_is_a_fused_kernel_for_the_mla_head_dims():
    """MLA's query-key head (nope + rope) is wider than its value head; on the GPU SDPA still takes a
    fused kernel (no S×S probabilities in memory), which the activation formula assumes."""
    cfg = load_model_config("tiny-pangu")
    att = cfg.attention
    q = torch.randn(1, att.num_heads, 1024, att.qk_head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, att.num_heads, 1024, att.v_head_dim, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    F.scaled_dot_product_attention(q, q, v, is_causal=True)
    torch.cuda.synchronize()
    scores_bytes = att.num_heads * 1024 * 1024 * 2
    assert torch.cuda.max_memory_allocated() - start < scores_bytes / 4


def test_profile_measures_the_host_issue_floor_and_the_masked_attention_on_cuda():
    """On a GPU the profile times the runtime's own model at 16 tokens: the host's issue time per layer pass
    and per optimizer step, which the simulator uses as a floor (CPU profiles leave them at 0). It also
    times the document mask's kernels at the model's head dims, per computed tile against the causal
    kernel: FlexAttention's tiles (fewer than the causal kernel's, 4 documents a row) and the dense mask's
    (the whole square); CPU profiles leave those slowdowns at 1."""
    from moetrain.train.profiler import profile_device

    measured, efficiencies = profile_device(load_cluster_config("h100-sxm-80gb"), load_model_config("tiny-pangu"),
                                            "cuda", repeats=2)
    host = measured["host"]
    assert 0 < host["forward_s"] < host["forward_backward_s"]
    assert efficiencies["host_layer_us"] > 0 and efficiencies["host_optimizer_ms"] > 0
    # a kernel launch costs microseconds, so an eager layer pass of tens of kernels costs well above 10 µs
    assert efficiencies["host_layer_us"] > 10
    masked = measured["masked_attention"]
    assert masked["seq"] == 1024 and 0 < masked["block_work"] < 1 < masked["dense_work"]
    assert efficiencies["attention_block_slowdown"] > 0 and efficiencies["attention_dense_slowdown"] > 0


def test_block_document_mask_on_cuda_equals_the_dense_mask_forward_and_backward():
    """FlexAttention tiles, compiled as in a compiled layer (eagerly flex_attention is an unfused reference),
    against SDPA with the dense boolean mask: MLA's head dims (192 query-key, 128 value) in bf16, rows of
    several documents (boundaries inside tiles) and of one; every row masked, and only the boundary rows
    (the causal kernel over every row, the masked one over those rows, as the runtime runs it)."""
    from moetrain.data import boundary_rows
    from moetrain.models.attention import build_attention_context, core_attention

    torch.manual_seed(0)
    batch, heads, seq = 3, 8, 1024
    lengths = [[300, 500, 224], [1024], [1000, 24]]
    docs_cpu = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])
    docs, rows = docs_cpu.cuda(), boundary_rows(docs_cpu).cuda()
    ids = torch.zeros(batch, seq, dtype=torch.long, device="cuda")
    q, k = (torch.randn(batch, heads, seq, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    v = torch.randn(batch, heads, seq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(batch, heads, seq, 128, device="cuda", dtype=torch.bfloat16)
    attend = torch.compile(lambda q, k, v, ctx: core_attention(q, k, v, ctx, 192**-0.5, "sdpa"))
    results = []
    for mask, boundary in (("dense", None), ("block", None), ("dense", rows), ("block", rows)):
        ctx = build_attention_context(ids, docs, document_mask=mask, boundary_rows_R=boundary)
        out = attend(q, k, v, ctx)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    for dense, *others in zip(*results):
        for other in others:
            assert _rel_err(other.float(), dense.float()) < 1e-2


def test_compiled_memory_policy_on_cuda_keeps_less_and_the_gradients():
    """The recompute options in compiled layers (checkpoint wrappers; the compiler recomputes their outputs)
    keep fewer bytes than the compiled model without them, with the eager model's gradients."""
    from moetrain.costs.activations import SELECTIVE_OPTIONS
    from moetrain.distributed.parallelize import apply_compile
    from moetrain.memory.measure import measure_saved_bytes

    cfg = load_model_config("tiny-pangu")
    ids = _ids(cfg.vocab_size, "cuda", seq=256)
    _, eager_grads = _loss_and_grads(build_model(cfg, device="cuda", seed=0), ids)
    kept = {}
    for options in ((), tuple(sorted(SELECTIVE_OPTIONS))):
        torch._dynamo.reset()
        model = build_model(cfg, device="cuda", seed=0)
        if options:
            apply_memory_policy(model, MemoryPlan.uniform(options, num_blocks(cfg)), compiled=True)
        apply_compile(model)
        model(ids, labels=ids).loss.backward()  # the compilation
        model.zero_grad(set_to_none=True)
        kept[options] = measure_saved_bytes(model, ids, ids)
        grads = {k: p.grad.detach().float().cpu() for k, p in model.named_parameters() if p.grad is not None}
        # Every parameter off, not just the worst: on the H200 (torch 2.11) the worst was a router weight at
        # 1.0006, and torch 2.11 on a CPU shows why: every routed expert had no gradient (1.0) and every
        # router its balance losses' only. Dynamo 2.11 zeroes the gradient of an autograd.Function that
        # returns a no-op cast, as the fp32 combine's ``.to(fp32)`` did (moetrain.models.dispatch;
        # tests/models/test_dispatch_compiled.py; benchmarks/notes/training.md).
        wrong = sorted(((err, k) for k in eager_grads if (err := _rel_err(grads[k], eager_grads[k])) >= 1e-4),
                       reverse=True)
        assert not wrong, (options, f"{len(wrong)} of {len(eager_grads)} gradients off", wrong[:6])
    assert kept[tuple(sorted(SELECTIVE_OPTIONS))] < 0.85 * kept[()]
