"""Micro-benchmarks behind ``moetrain profile``: the efficiencies of ``planner.calibration.Efficiency``
measured on the local device instead of fitted on published runs. It imports torch and times the
trainer's own model and optimizer step, so it lives on the runtime side; the planner only reads the
calibration file it writes."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from moetrain.config.cluster import ClusterConfig
from moetrain.config.model import ModelConfig
from moetrain.config.training import TrainingConfig
from moetrain.costs.params import count_params
from moetrain.distributed.weight_sync import WeightSync, payload_crc, tensor_views
from moetrain.distributed.world import spawn
from moetrain.errors import UserError
from moetrain.models.attention import document_block_mask
from moetrain.models.transformer import build_model
from moetrain.planner.calibration import arch_of
from moetrain.planner.compute import attention_speed_factor
from moetrain.runtime_base.host_memory import keep_freed_host_memory
from moetrain.runtime_base.optim import build_optimizer, clip_gradients
from moetrain.runtime_base.precision import autocast, autocast_dtype

# (m, n, k). The first two (overhead-bound) give the fixed cost per call, the last three (rate-bound)
# the asymptotic speed; a GPU needs far larger shapes than a CPU core to reach its rate.
GEMM_SHAPES = {
    "cpu": [(64, 64, 64), (128, 256, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 512),
            (1024, 1024, 1024), (2048, 1024, 1024)],
    "cuda": [(64, 64, 64), (128, 128, 128), (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048),
             (4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192)],
}
# Causal fused attention: (batch, heads, head dim, sequence lengths); the measured efficiency is brought to
# head dim 128 (compute.REFERENCE_HEAD_DIM), the dimension ``Efficiency.attention`` refers to.
ATTENTION_SHAPES = {"cpu": (4, 4, 64, (128, 256, 512)), "cuda": (4, 32, 128, (1024, 2048, 4096))}
# Elements per tensor of the bandwidth test: on a GPU well beyond its L2 cache (50 MB on an H100).
BANDWIDTH_ELEMENTS = {"cpu": 8 * 1024 * 1024, "cuda": 128 * 1024 * 1024}
# Calls queued back to back per timing on a GPU: training issues kernels asynchronously, so the fixed
# cost per call is the launch throughput, not the launch-to-completion latency of one synchronised call.
CALLS_PER_TIMING = {"cpu": 1, "cuda": 20}


def _kind(device: str) -> str:
    """"cuda" or "cpu": the key of the per-device tables above."""
    return torch.device(device).type


def _timed(fn, repeats: int, device: str) -> float:
    """Seconds per call of ``fn``: the median of the repeats on a GPU; on a CPU their minimum, since there
    the probes share the cores with whatever else runs (a burst of another process, or of the virtual
    machine's host, can cover most of a probe's repeats), and interference only ever adds time."""
    kind = _kind(device)
    calls = CALLS_PER_TIMING[kind]
    fn()  # warm-up (allocations, kernel selection)
    if kind == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if kind == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times) if kind == "cuda" else np.min(times))


@dataclass(frozen=True)
class GemmLine:
    """GEMM time as a line in FLOPs: seconds = flops × ``seconds_per_flop`` + ``overhead_s``."""

    shapes: list[dict]
    """{m, n, k, seconds} per timed shape (``GEMM_SHAPES``)."""
    seconds_per_flop: float
    """From the large (rate-bound) shapes."""
    overhead_s: float
    """The fixed cost per call, from the small (overhead-bound) shapes."""


def probe_gemm(device: str, dtype: torch.dtype, repeats: int) -> GemmLine:
    """GEMMs: time = flops / (peak·gemm_max) + overhead, a line in flops: fit slope and intercept."""
    flops, seconds, shapes = [], [], []
    for m, n, k in GEMM_SHAPES[_kind(device)]:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        t = _timed(lambda a=a, b=b: a @ b, repeats, device)
        flops.append(2.0 * m * n * k)
        seconds.append(t)
        shapes.append({"m": m, "n": n, "k": k, "seconds": t})
    flops_arr, seconds_arr = np.array(flops), np.array(seconds)
    # Slope from the large GEMMs (rate-bound), the fixed cost from the small ones (overhead-bound): a
    # single line fit lets noise on the large shapes swamp the microseconds of the small ones.
    slope = float(np.median(seconds_arr[-3:] / flops_arr[-3:]))
    intercept = float(max(np.min(seconds_arr[:2] - flops_arr[:2] * slope), 0.0))
    return GemmLine(shapes, slope, intercept)


@dataclass(frozen=True)
class AttentionProbe:
    rows: list[dict]
    """{batch, heads, head_dim, seq, seconds, backward_over_forward} per sequence length."""
    efficiency: float
    """Of the peak, brought to head dim 128: the median over the sequence lengths."""


def probe_attention(device: str, dtype: torch.dtype, repeats: int, cluster: ClusterConfig) -> AttentionProbe:
    """Attention (SDPA, causal): the causal half of 4·b·h·s²·d, forward, against ``cluster``'s peak and
    brought to head dim 128 on Hopper for its architecture (what ``Efficiency.attention`` is; the cost model
    prices the backward at ``layer_costs.ATTENTION_BACKWARD_OVER_FORWARD`` × the forward, and the ratio
    measured here is kept beside it for comparison)."""
    rows, efficiencies = [], []
    peak_flops, arch = cluster.peak_flops("bf16"), arch_of(cluster.device)
    batch, heads, head_dim, seqs = ATTENTION_SHAPES[_kind(device)]
    for seq in seqs:
        q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
        grad = torch.ones_like(q)  # the output has q's shape (q, k and v are the same tensor)
        t = _timed(lambda q=q: F.scaled_dot_product_attention(q, q, q, is_causal=True), repeats, device)
        t_fwd_bwd = _timed(lambda q=q, grad=grad: torch.autograd.grad(
            F.scaled_dot_product_attention(q, q, q, is_causal=True), q, grad), repeats, device)
        f = 4.0 * batch * heads * seq * seq * head_dim / 2
        efficiencies.append(f / t / peak_flops / float(attention_speed_factor(head_dim, arch)))
        rows.append({"batch": batch, "heads": heads, "head_dim": head_dim, "seq": seq, "seconds": t,
                     "backward_over_forward": (t_fwd_bwd - t) / t})
        del q, grad
    return AttentionProbe(rows, float(np.median(efficiencies)))


# The document-masked kernels at the model's own head dims (CUDA only: FlexAttention has no CPU backward):
# (batch, tokens per row) and documents per row, all of equal length from the row's start.
MASKED_ATTENTION_SHAPE = (4, 4096)
MASKED_ATTENTION_DOCUMENTS = 4


@dataclass(frozen=True)
class MaskedAttentionProbe:
    """Forward and backward of the core attention at the model's head dims under a plain causal mask and under
    a document mask (``MASKED_ATTENTION_DOCUMENTS`` equal documents per row), the latter as FlexAttention
    tiles (``block``) and as a dense boolean mask (``dense``), with the tiles each computes."""

    batch: int
    seq: int
    causal_s: float
    block_s: float
    dense_s: float
    block_work: float
    """Tiles the document mask's FlexAttention computes over the causal kernel's (``BlockMask`` counts)."""
    dense_work: float
    """The square's tiles over the causal kernel's."""

    @property
    def block_slowdown(self) -> float:
        """``Efficiency.attention_block_slowdown``: seconds per computed tile over the causal kernel's."""
        return self.block_s / (self.causal_s * self.block_work)

    @property
    def dense_slowdown(self) -> float:
        return self.dense_s / (self.causal_s * self.dense_work)

    def measured(self) -> dict:
        return {"batch": self.batch, "seq": self.seq, "causal_s": self.causal_s, "block_s": self.block_s,
                "dense_s": self.dense_s, "block_work": self.block_work, "dense_work": self.dense_work}


def _tile_work(block_mask, batch: int, seq: int) -> tuple[float, float]:
    """(the block mask's computed tiles, the square's) over the causal kernel's tiles, per row."""
    n = -(-seq // block_mask.BLOCK_SIZE[0])
    causal = n * (n + 1) / 2
    computed = block_mask.kv_num_blocks.sum().item()
    if block_mask.full_kv_num_blocks is not None:
        computed += block_mask.full_kv_num_blocks.sum().item()
    return computed / batch / causal, n * n / causal


def probe_masked_attention(model: ModelConfig, device: str, dtype: torch.dtype,
                           repeats: int) -> MaskedAttentionProbe | None:
    """The masked kernels' time per tile over the causal kernel's (``documents.core_time_factor``); None off a
    GPU, where FlexAttention has no backward, and where the probe fails: the profile is written without it
    (the slowdowns stay 1) and says why on stderr, so that a GPU slot keeps the rest of its profile."""
    if _kind(device) != "cuda":
        return None
    try:
        return _time_masked_attention(model, device, dtype, repeats)
    except Exception as exc:  # noqa: BLE001 - an optional probe: any failure (compile, memory) leaves it out
        warnings.warn(f"moetrain profile: the masked-attention probe was left out ({type(exc).__name__}: "
                      f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'no message'})", stacklevel=2)
        return None


def _time_masked_attention(model: ModelConfig, device: str, dtype: torch.dtype, repeats: int) -> MaskedAttentionProbe:
    attn = model.attention
    batch, seq = MASKED_ATTENTION_SHAPE[0], min(MASKED_ATTENTION_SHAPE[1], model.max_seq_len)
    q = torch.randn(batch, attn.num_heads, seq, attn.qk_head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    v = torch.randn(batch, attn.num_heads, seq, attn.v_head_dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.ones(batch, attn.num_heads, seq, attn.v_head_dim, device=device, dtype=dtype)
    document_ids = (torch.arange(seq, device=device) * MASKED_ATTENTION_DOCUMENTS // seq).expand(batch, seq)
    block_mask = document_block_mask(document_ids)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    dense_mask = ((document_ids.unsqueeze(2) == document_ids.unsqueeze(1)) & causal).unsqueeze(1)
    flex = torch.compile(flex_attention)  # the runtime's block path: the compiler generates the fused kernel

    def forward_backward(attend):
        return lambda: torch.autograd.grad(attend(), (q, k, v), grad)

    causal_s = _timed(forward_backward(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                      repeats, device)
    block_s = _timed(forward_backward(lambda: flex(q, k, v, block_mask=block_mask)), repeats, device)
    dense_s = _timed(forward_backward(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask)),
                     repeats, device)
    block_work, dense_work = _tile_work(block_mask, batch, seq)
    return MaskedAttentionProbe(batch, seq, causal_s, block_s, dense_s, block_work, dense_work)


@dataclass(frozen=True)
class BandwidthProbe:
    seconds: float
    """Per element-wise add."""
    bytes_moved: int
    """Read and written by it."""


def probe_memory_bandwidth(device: str, dtype: torch.dtype, repeats: int) -> BandwidthProbe:
    """Memory bandwidth: an element-wise add reads two tensors and writes one."""
    x = torch.randn(BANDWIDTH_ELEMENTS[_kind(device)], device=device, dtype=dtype)
    y = torch.randn_like(x)
    t = _timed(lambda: torch.add(x, y), repeats, device)
    return BandwidthProbe(t, 3 * x.numel() * x.element_size())


@dataclass(frozen=True)
class GroupedGemmProbe:
    experts: int
    tokens_per_expert: int
    seconds: float
    moe_overhead_us: float
    """The MoE layer's fixed overhead per pass: 3 × the excess of one grouped call over the GEMM line."""


GROUPED_TOKENS_PER_EXPERT = 64


def probe_grouped_gemm(model: ModelConfig, device: str, dtype: torch.dtype, repeats: int,
                       gemm: GemmLine) -> GroupedGemmProbe | None:
    """Grouped GEMM over the model's experts: one fused call on CUDA, a per-expert loop on CPU. The time
    beyond the same FLOPs as one GEMM (``gemm``) is the MoE layer's fixed overhead per pass. None for a
    dense model."""
    if model.moe is None:
        return None
    experts, width, hidden = model.moe.num_experts, model.moe.expert_ffn_hidden, model.hidden_size
    tokens_per_expert = GROUPED_TOKENS_PER_EXPERT
    xs = torch.randn(experts * tokens_per_expert, hidden, device=device, dtype=dtype)
    w = torch.randn(experts, hidden, width, device=device, dtype=dtype)
    offsets = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * tokens_per_expert
    grouped_mm = getattr(F, "grouped_mm", None)
    if device.startswith("cuda") and grouped_mm is not None:
        fn = lambda: grouped_mm(xs, w, offs=offsets)  # noqa: E731
    else:
        chunks = xs.split(tokens_per_expert)
        fn = lambda: [c @ w[i] for i, c in enumerate(chunks)]  # noqa: E731
    t = _timed(fn, repeats, device)
    ideal = 2.0 * xs.shape[0] * hidden * width * gemm.seconds_per_flop + gemm.overhead_s
    # The three expert matrices each pay it: per MoE pass ≈ 3 × the excess of one grouped call.
    return GroupedGemmProbe(experts, tokens_per_expert, t, max(t - ideal, 0.0) * 3 * 1e6)


@dataclass(frozen=True)
class BusProbe:
    all_reduce_seconds: float
    """Per all-reduce of 16 MiB over the world."""
    bus_intra: float
    """The ring all-reduce's bus bandwidth over the cluster's in-node link."""


def probe_bus(cluster: ClusterConfig, device: str, repeats: int) -> BusProbe | None:
    """Collectives, when launched under torchrun with more than one rank; None otherwise."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    world = dist.get_world_size()
    buf = torch.randn(16 * 1024 * 1024 // 4, device=device)
    t = _timed(lambda: dist.all_reduce(buf), repeats, device)
    bus_bw = 2 * (world - 1) / world * buf.numel() * 4 / t
    return BusProbe(t, bus_bw / (cluster.intra_node_gbps * 1e9))


@dataclass(frozen=True)
class DeviceProfile:
    """Every probe of ``profile_device`` on one device, against ``cluster``'s peaks."""

    cluster: ClusterConfig
    model: ModelConfig
    device_name: str
    dtype: torch.dtype
    gemm: GemmLine
    attention: AttentionProbe
    bandwidth: BandwidthProbe
    grouped_gemm: GroupedGemmProbe | None
    host: HostTimes | None
    bus: BusProbe | None
    masked_attention: MaskedAttentionProbe | None = None

    def measured(self) -> dict:
        """The raw measurements, as ``moetrain profile --json`` prints them."""
        out: dict = {"device": self.device_name, "dtype": str(self.dtype).removeprefix("torch."),
                     "gemm": self.gemm.shapes, "attention": self.attention.rows,
                     "elementwise_add_seconds": self.bandwidth.seconds}
        if self.grouped_gemm is not None:
            g = self.grouped_gemm
            out["grouped_gemm"] = {"experts": g.experts, "tokens_per_expert": g.tokens_per_expert,
                                   "seconds": g.seconds}
        if self.host is not None:
            out["host"] = self.host.measured()
        if self.bus is not None:
            out["all_reduce_seconds"] = self.bus.all_reduce_seconds
        if self.masked_attention is not None:
            out["masked_attention"] = self.masked_attention.measured()
        return out

    def efficiencies(self) -> dict[str, float]:
        """The calibration's per-architecture values (``planner.calibration.Efficiency``'s fields)."""
        peak = self.cluster.peak_flops("bf16")
        out = {
            "gemm_max": float(1.0 / (self.gemm.seconds_per_flop * peak)),
            "gemm_overhead_us": float(self.gemm.overhead_s * 1e6),
            "attention": self.attention.efficiency,
            "memory": float(self.bandwidth.bytes_moved / self.bandwidth.seconds
                            / (self.cluster.hbm_bandwidth_tbps * 1e12)),
            "moe_overhead_us": float(self.grouped_gemm.moe_overhead_us if self.grouped_gemm else 0.0),
        }
        if self.bus is not None:
            out["bus_intra"] = float(self.bus.bus_intra)
        if self.host is not None:
            out.update(self.host.efficiencies(self.model))
        if self.masked_attention is not None:
            out["attention_block_slowdown"] = float(self.masked_attention.block_slowdown)
            out["attention_dense_slowdown"] = float(self.masked_attention.dense_slowdown)
        return out


def probe_device(cluster: ClusterConfig, model: ModelConfig, device: str, repeats: int) -> DeviceProfile:
    """Every probe on ``device``: the GEMM line, attention, memory bandwidth, the model's grouped GEMM, the
    runtime model's host times and (under torchrun) the all-reduce's bus bandwidth."""
    kind = _kind(device)
    if kind == "cpu":
        keep_freed_host_memory()  # the runtime's CPU processes do: the probes run under the same allocator
    dtype = torch.float32 if kind == "cpu" else torch.bfloat16
    gemm = probe_gemm(device, dtype, repeats)
    attention = probe_attention(device, dtype, repeats, cluster)
    bandwidth = probe_memory_bandwidth(device, dtype, repeats)
    grouped = probe_grouped_gemm(model, device, dtype, repeats, gemm)
    host = probe_host(model, device, repeats)
    masked = probe_masked_attention(model, device, dtype, repeats)
    if kind == "cuda":
        torch.cuda.empty_cache()  # the probe model's memory goes back before the training run
    return DeviceProfile(cluster, model, torch.cuda.get_device_name(device) if kind == "cuda" else device, dtype,
                         gemm, attention, bandwidth, grouped, host, probe_bus(cluster, device, repeats), masked)


def profile_device(cluster: ClusterConfig, model: ModelConfig, device: str, repeats: int) -> tuple[dict, dict]:
    """(raw measurements, fitted efficiencies) for ``cluster``'s peaks on ``device``."""
    profile = probe_device(cluster, model, device, repeats)
    return profile.measured(), profile.efficiencies()


# Runtime models up to this many parameters are built for the host-time measurement (16 B per parameter
# for weights, gradients and AdamW moments must fit beside the training run that follows).
HOST_PROBE_MAX_PARAMS = {"cuda": 3e9, "cpu": 2e8}
HOST_PROBE_TOKENS = 16
# On a CPU, a second probe at the micro-batch CPU runs train at: (sequences, tokens each), the tokens
# capped at the model's context.
HOST_WIDE_PROBE = (4, 128)


@dataclass(frozen=True)
class HostTimes:
    """Host seconds of the runtime's model at ``tokens`` tokens (``probe_host``)."""

    forward_s: float
    forward_backward_s: float
    optimizer_s: float
    tokens: int
    wide_shape: tuple[int, int] | None = None
    """On a CPU: (sequences, tokens each) of the wide pass (``HOST_WIDE_PROBE``)."""
    wide_forward_backward_s: float | None = None

    def measured(self) -> dict:
        out = {"forward_s": self.forward_s, "forward_backward_s": self.forward_backward_s,
               "optimizer_s": self.optimizer_s, "tokens": self.tokens}
        if self.wide_forward_backward_s is not None:
            out.update(wide_shape=self.wide_shape, wide_forward_backward_s=self.wide_forward_backward_s)
        return out

    def efficiencies(self, model: ModelConfig) -> dict[str, float]:
        """Per layer pass, as the simulator counts them (decoder layers and MTP blocks), and per step."""
        layer_passes = model.num_layers + model.num_mtp_layers
        out = {"host_layer_us": self.forward_backward_s / layer_passes * 1e6,
               "host_optimizer_ms": self.optimizer_s * 1e3, "host_probe_tokens": float(self.tokens)}
        if self.wide_forward_backward_s is not None:
            out["host_wide_layer_us"] = self.wide_forward_backward_s / layer_passes * 1e6
            out["host_wide_batch"], out["host_wide_seq"] = map(float, self.wide_shape)
        return out


def probe_host(model_cfg: ModelConfig, device: str, repeats: int) -> HostTimes | None:
    """Seconds the host needs to issue one micro-batch's forward+backward (and the forward alone) of the
    runtime's model, and one optimizer step, measured on a batch of ``HOST_PROBE_TOKENS`` tokens: the
    device finishes each of those kernels faster than eager PyTorch issues the next, so the elapsed time
    is the host's (Python, dispatcher, kernel launches), which sets a floor under every step however small
    the kernels. On a GPU it is a floor under each pass; on a CPU, where the host is the device, the same
    time holds the (small) work too, and the cost model adds what it has beyond the device work it prices
    at these tokens (``costmodel._host_excess``); there a second, wide pass is timed as well, since the
    excess grows with the tokens. None for models too large to build here."""
    if count_params(model_cfg).total_with_mtp > HOST_PROBE_MAX_PARAMS[_kind(device)]:
        return None
    cfg = TrainingConfig()  # the trainer's defaults: its precision rule, clipping and AdamW
    model = build_model(model_cfg, device=device, seed=0)
    optimizer = build_optimizer(model, cfg)
    ids = torch.randint(0, model_cfg.vocab_size, (1, HOST_PROBE_TOKENS), device=device)
    kind = _kind(device)
    dtype = autocast_dtype(cfg.dtype, kind)

    def forward():
        with autocast(dtype, kind):
            return model(ids, labels=ids).loss

    def forward_backward():
        forward().backward()

    def optimizer_step():  # the trainer's step without zeroing the gradients, so that it can repeat
        clip_gradients(model.parameters(), cfg.grad_clip)
        optimizer.step()

    forward_s = _timed(forward, repeats, device)
    forward_backward_s = _timed(forward_backward, repeats, device)
    optimizer_s = _timed(optimizer_step, repeats, device)
    if kind != "cpu":
        return HostTimes(forward_s, forward_backward_s, optimizer_s, HOST_PROBE_TOKENS)
    wide_pass, wide_shape = _wide_pass(model, model_cfg, device, dtype)
    return HostTimes(forward_s, forward_backward_s, optimizer_s, HOST_PROBE_TOKENS, wide_shape,
                     _timed(wide_pass, repeats, device))


def _host_issue_times(model_cfg: ModelConfig, device: str, repeats: int) -> dict | None:
    """``probe_host`` as the measurements' dict (``forward_s``, ``forward_backward_s``, ...)."""
    host = probe_host(model_cfg, device, repeats)
    return None if host is None else host.measured()


def _wide_pass(model, model_cfg: ModelConfig, device: str, dtype) -> tuple:
    """(a forward and backward of ``model`` on ``HOST_WIDE_PROBE``'s micro-batch, its (sequences, tokens))."""
    batch, seq = HOST_WIDE_PROBE[0], min(HOST_WIDE_PROBE[1], model_cfg.max_seq_len)
    ids = torch.randint(0, model_cfg.vocab_size, (batch, seq), device=device)

    def forward_backward():
        with autocast(dtype, _kind(device)):
            loss = model(ids, labels=ids).loss
        loss.backward()

    return forward_backward, (batch, seq)


def _wide_pass_seconds(rank: int, world_size: int, model_cfg: ModelConfig, repeats: int) -> float:
    """This rank's seconds per wide pass (``_wide_pass``) while every rank runs ``repeats`` of them back to
    back, started together (one thread per rank, the model built here), as training keeps the cores busy."""
    torch.set_num_threads(1)
    keep_freed_host_memory()
    model = build_model(model_cfg, device="cpu", seed=0)
    wide_pass, _ = _wide_pass(model, model_cfg, "cpu", None)
    wide_pass()  # warm-up
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        wide_pass()
    return (time.perf_counter() - start) / repeats


def profile_shared_host(model_cfg: ModelConfig, ranks: int, repeats: int = 5, rounds: int = 3) -> dict:
    """How ranks computing on one host's cores slow each other (memory bandwidth, caches and clock are the
    host's): the wide pass of the runtime's model on one rank alone, then on ``ranks`` ranks at once,
    ``rounds`` times, and alone once more. Each together run is set against the mean of the two alone runs
    around it (a virtual machine's speed drifts by a fifth within minutes); ``slowdown`` is the median of
    those ratios (the slowest rank's time together over the time alone), at least 1."""
    alone = [spawn(_wide_pass_seconds, 1, model_cfg, repeats)[0]]
    together = []
    for _ in range(rounds):
        together.append(max(spawn(_wide_pass_seconds, ranks, model_cfg, repeats)))
        alone.append(spawn(_wide_pass_seconds, 1, model_cfg, repeats)[0])
    ratios = [t / ((before + after) / 2) for t, before, after in zip(together, alone[:-1], alone[1:], strict=True)]
    return {"ranks": ranks, "alone_s": alone, "together_s": together, "ratios": ratios,
            "slowdown": max(float(np.median(ratios)), 1.0)}


# ----- collectives and the weight sync's host work (``moetrain profile --comm``) -----
# Message sizes of the collective probe: latency-bound to bandwidth-bound on a CPU's gloo over loopback.
COMM_BYTES = (4 << 10, 64 << 10, 512 << 10, 4 << 20)
COMM_KINDS = ("all_reduce", "all_gather", "all_to_all", "send_recv")
SYNC_PROBE_BYTES = 4 << 20


def _comm_ranks(rank: int, world_size: int, sizes: tuple[int, ...], repeats: int, calls: int) -> list[dict]:
    """This rank's seconds per collective: each kind and size on the whole world and on disjoint pairs
    (every pair at once, as a 2-way TP/EP/DP group of a layout runs beside the others), ``calls`` back to
    back per timing (as a step issues them), the median of ``repeats`` timings."""
    # the flat all-gather: ``all_gather_single`` since torch 2.13 (the old name warns there), the old name before
    all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    torch.set_num_threads(1)
    world = dist.group.WORLD
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world_size - 1, 2)]  # every rank creates every group
    mine = pairs[rank // 2]
    rows = []
    groups = [(world, world_size)] + ([(mine, 2)] if world_size > 2 else [])  # 2 ranks: the pair is the world
    for group, group_size in groups:
        for kind in COMM_KINDS:
            if kind == "send_recv" and group_size != world_size:
                continue  # a send is between two ranks whatever the group
            for size in sizes:
                n = size // 4
                if kind == "all_reduce":
                    buf = torch.zeros(n)
                    op = lambda buf=buf, group=group: dist.all_reduce(buf, group=group)  # noqa: E731
                elif kind == "all_gather":  # the gathered output is ``size`` bytes
                    out, part = torch.zeros(n - n % group_size), torch.zeros(n // group_size)
                    op = lambda out=out, part=part, group=group: all_gather_flat(out, part, group=group)  # noqa: E731
                elif kind == "all_to_all":  # each rank sends ``size`` bytes, all destinations together
                    src, dst = torch.zeros(n - n % group_size), torch.zeros(n - n % group_size)
                    op = lambda src=src, dst=dst, group=group: dist.all_to_all_single(dst, src, group=group)  # noqa: E731
                else:  # one way, even rank to odd rank, every pair at once
                    buf, peer = torch.zeros(n), rank ^ 1
                    op = ((lambda buf=buf, peer=peer: dist.send(buf, peer)) if rank % 2 == 0
                          else (lambda buf=buf, peer=peer: dist.recv(buf, peer)))
                op()
                times = []
                for _ in range(repeats):
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(calls):
                        op()
                    times.append((time.perf_counter() - start) / calls)
                rows.append({"kind": kind, "group": group_size, "bytes": size, "seconds": float(np.median(times))})
    dist.barrier()
    return rows


def profile_collectives(world_size: int, sizes: tuple[int, ...] = COMM_BYTES, repeats: int = 5,
                        calls: int = 10) -> list[dict]:
    """Gloo collectives on ``world_size`` local ranks of one thread each (the layout's own processes):
    {kind, group, bytes, seconds} per measurement, the slowest rank's time. Bytes as the planner's
    formulas take them (``planner.comm``): the all-reduce's buffer, the all-gather's gathered output, what
    one rank sends in an all-to-all, one send."""
    if world_size < 2 or world_size % 2:
        raise UserError(f"the collective probe runs on an even number of ranks, 2 or more (got {world_size})")
    per_rank = spawn(_comm_ranks, world_size, tuple(sizes), repeats, calls)
    rows = []
    for i, row in enumerate(per_rank[0]):
        rows.append({**row, "seconds": max(r[i]["seconds"] for r in per_rank)})
    return rows


def _whole_sync(rank: int, world_size: int, model_cfg: ModelConfig, bucket_bytes: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    models = [build_model(model_cfg, torch.device("cpu"), seed=seed) for seed in (0, 1)]
    views = [tensor_views({n: v.detach() for n, v in m.state_dict(keep_vars=True).items()}, None) for m in models]
    sync = WeightSync.plan(views[0], views[1], bucket_bytes, torch.distributed.group.WORLD)
    num_bytes = sum(bucket.nbytes for bucket in sync.buckets)
    seconds = _timed(lambda: sync.run(0), repeats, "cpu")
    return {"bytes": num_bytes, "boxes": sum(len(bucket.items) for bucket in sync.buckets),
            "buckets": len(sync.buckets), "seconds": seconds, "host_bytes_per_s": 2.0 * num_bytes / seconds}


def profile_weight_sync(model_cfg: ModelConfig, repeats: int = 5, bucket_bytes: int = SYNC_PROBE_BYTES) -> dict:
    """The weight sync's host work as it runs on the runtime's model (``distributed.weight_sync``): one rank
    syncs a whole model into another copy, every box local, so every byte is packed into a bucket and
    written into the other copy, each with its CRC-32, box by box, with the sync's per-box and per-bucket
    work (views, copies, the header, the checks) included; one thread. ``host_bytes_per_s``: bytes packed
    or written per second (2 × the model's bytes over the sync's time), the rate of one side's work."""
    return spawn(_whole_sync, 1, model_cfg, bucket_bytes, repeats)[0]


def profile_sync_rates(repeats: int = 5, num_bytes: int = SYNC_PROBE_BYTES) -> dict:
    """The weight sync's host work per byte on one thread (``distributed.weight_sync``): a copy (the mean of
    a bucket packed into a fresh tensor and a box written into existing weights) and a CRC-32 (the sync's
    own ``payload_crc``: the bytes to host, then zlib), as bytes per second."""
    keep_freed_host_memory()  # as the runtime's CPU processes, which run the sync
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    pack = _timed(lambda: torch.cat([src, src[:16]]), repeats, "cpu")  # into a fresh bucket, as ``_pack``
    write = _timed(lambda: dst.copy_(src), repeats, "cpu")  # into existing weights, as ``_receive``
    crc = _timed(lambda: payload_crc([src]), repeats, "cpu")
    copy = (pack + write) / 2.0  # a synced byte is copied once each way
    return {"bytes": num_bytes, "pack_seconds": pack, "write_seconds": write, "crc_seconds": crc,
            "copy_bytes_per_s": num_bytes / copy, "crc_bytes_per_s": num_bytes / crc}
