"""Rollout generation's time on one replica: a compute-bound prefill, then decode steps bound by memory.

A replica holds a whole model on ``devices`` devices (its experts split over them, attention replicated:
each device runs its share of the rows) and generates ``rows`` samples: one prefill of the prompts, then
``response_len`` decode steps of one token per row.

Decode is priced with the roofline (Williams et al. 2009, applied to LLM decoding by e.g. Pope et al. 2023,
"Efficiently Scaling Transformer Inference" §2): each decode step reads every weight the step touches once
(for one batch of rows, whatever its size) and the rows' KV cache, and does 2 FLOPs per weight per row, so

    decode step ≈ Σ_layers max(forward FLOPs / GEMM rate, (weights read + KV cache read) / HBM bandwidth)
                  + output head + sampling

The forward FLOPs and their per-call costs are the training cost model's forward of one layer on ``rows``
tokens (``moetrain.planner.layer_costs``), so generation and training use the same efficiencies. Routed
experts are read only where a token of the batch goes: with B·k choices spread evenly over E experts,
E·(1 − (1 − k/E)^B) distinct experts. Prefill is the same forward on rows × prompt_len tokens.

An eager stack also spends host time per layer pass (Python, dispatcher, kernel launches), which on small
models dominates: ``HostCosts`` holds it as measured (``benchmarks/rl_simulate_check.py`` measures it on
a CPU, where the host *is* the device and the two add; on an accelerator the device waits only for what
the host takes beyond the device's own time). The engine adds work of its own between two decode
forwards (the rows' bookkeeping, the KV cache's slots, the replay record): ``HostCosts.engine_step_us``
+ ``engine_row_us`` per row, measured as the engine's decode step at one row and at a few rows less the
model's own forward and the draw at the same rows; on a CPU it adds to each decode forward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from moetrain.config.model import MLAConfig, ModelConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.costs.params import attention_params, decoder_layer_params, layer_norm_params, mlp_params
from moetrain.planner.calibration import Efficiency
from moetrain.planner.compute import gemm_time, memory_time
from moetrain.planner.layer_costs import layer_costs
from moetrain.planner.strategy import Strategies
from moetrain.planner.workload import Workload

# Passes over the [rows, vocab] logits when sampling on an accelerator: scale by the temperature, softmax,
# log-softmax of the chosen token, the draw (each reads and writes fp32).
SAMPLING_PASSES = 4


@dataclass(frozen=True)
class HostCosts:
    """What an eager generation loop spends beside the device's work (measured; zero: none)."""

    layer_forward_us: float = 0.0
    """Time of one decoder layer's forward at a tiny batch (the host floor of a layer pass)."""
    probe_tokens: int = 1
    """Tokens of the batch ``layer_forward_us`` was measured at (its device work is not counted twice)."""
    sample_ns_per_logit: float = 0.0
    """Sampler time per row and vocabulary entry (0: ``SAMPLING_PASSES`` memory passes instead)."""
    host_is_device: bool = False
    """A CPU: host and device are the same cores, so host time adds to the device's instead of hiding it."""
    engine_step_us: float = 0.0
    """The generation engine's own work per decode step beyond its layers' forwards and the draw (the
    rows' bookkeeping, the KV cache's slots, the replay record, stop checks), at one row."""
    engine_row_us: float = 0.0
    """... and per row of the step (the same work grows with the rows still running)."""
    moe_pass_us: float | None = None
    """Fixed cost of a generation MoE layer pass; None: the calibration's ``moe_overhead_us`` (an eager
    stack's dropless token-count sync and kernel chain, as in training); 0: captured graphs with
    fixed-size expert buffers (inference engines: vLLM, SGLang, MindIE), where it does not arise."""

    def engine_step_s(self, rows: int) -> float:
        """The engine's own work in one decode step of ``rows`` rows (on a CPU it adds to the device's; on
        an accelerator the host issues it while the device runs the step's layers)."""
        return (self.engine_step_us + self.engine_row_us * rows) * 1e-6

    def efficiency(self, eff: Efficiency) -> Efficiency:
        """``eff`` with the generation's MoE pass cost."""
        return eff if self.moe_pass_us is None else replace(eff, moe_overhead_us=self.moe_pass_us)


@dataclass(frozen=True)
class GenerationTimes:
    """One replica's generation of its rows."""

    prefill_s: float
    decode_s: float
    decode_step_s: float
    """One decode step (of the mean context)."""
    sampling_s: float
    """Of ``decode_s``: drawing the tokens."""
    decode_memory_bound: bool
    """Whether the decode layers' weight and cache reads, not their FLOPs, set the step time."""

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


def kv_cache_bytes_per_token(model: ModelConfig, dtype_bytes: float) -> float:
    """Cache bytes per token and layer: MLA keeps the latent and the shared rotary key (DeepSeek-V2 §2.1);
    GQA keeps K and V per kv head."""
    attn = model.attention
    if isinstance(attn, MLAConfig):
        return (attn.kv_lora_rank + attn.qk_rope_head_dim) * dtype_bytes
    return 2.0 * attn.num_kv_heads * attn.head_dim * dtype_bytes


def _layer_forward(w: Workload, seq_len: int, rows_per_device: int, devices: int, eff: Efficiency,
                   moe_layer: bool) -> float:
    """The cost model's forward of one layer (its a2a's forward half included) on ``rows_per_device`` rows
    of ``seq_len`` tokens per device, experts split over ``devices``."""
    workload = Workload(w.model, w.cluster, seq_len, rows_per_device * devices, w.precision)
    parallel = ParallelConfig(dp=devices, ep=devices if w.model.moe is not None else 1, micro_batch=rows_per_device)
    costs = layer_costs(workload, Strategies.from_parallel([parallel]), eff, moe_layer, 1.0)
    first = lambda v: float(np.asarray(v, dtype=float).ravel()[0])  # noqa: E731
    return first(costs.fwd) + 0.5 * first(costs.a2a)  # no recompute: a2a is forward + backward, equal


def _layer_bytes_read(model: ModelConfig, moe_layer: bool, rows: int, devices: int, weight_bytes: float) -> float:
    """Weight bytes one decode step reads on one device for one layer (routed experts: those the step's
    tokens reach, the device's share)."""
    if not moe_layer or model.moe is None:
        return decoder_layer_params(model, moe_layer=False) * weight_bytes
    moe = model.moe
    touched = moe.num_experts * (1.0 - (1.0 - moe.router.top_k / moe.num_experts) ** rows)
    shared = mlp_params(model, moe.shared_ffn_hidden) if moe.num_shared_experts else 0
    always = attention_params(model) + layer_norm_params(model) + model.hidden_size * moe.num_experts + shared
    return (always + touched / devices * mlp_params(model, moe.expert_ffn_hidden)) * weight_bytes


def _host_layer(device_s: float, probe_s: float, host: HostCosts) -> float:
    floor = host.layer_forward_us * 1e-6
    if host.host_is_device:
        return floor + max(device_s - probe_s, 0.0)
    return max(floor, device_s)


def _layer_kinds(model: ModelConfig) -> list[tuple[bool, int]]:
    """(is an MoE layer, how many) for the model's layers."""
    if model.moe is None:
        return [(False, model.num_layers)]
    return [(False, model.num_dense_layers), (True, model.num_moe_layers)]


@dataclass(frozen=True)
class _Decode:
    """One decode step's parts."""

    layers_s: float
    head_s: float
    sampling_s: float
    memory_bound: bool
    engine_s: float = 0.0
    """The engine's own work (``HostCosts.engine_step_s``) where it adds to the step's time."""

    @property
    def step_s(self) -> float:
        return self.layers_s + self.head_s + self.sampling_s + self.engine_s


def _decode_step(w: Workload, rows: int, devices: int, context: float, eff: Efficiency, host: HostCosts) -> _Decode:
    model, dtype = w.model, w.activation_bytes
    rows_per_device = max(rows // devices, 1)
    kv = rows_per_device * context * kv_cache_bytes_per_token(model, dtype)
    total, memory_bound = 0.0, True
    for moe_layer, count in _layer_kinds(model):
        if count == 0:
            continue
        compute = _layer_forward(w, 1, rows_per_device, devices, eff, moe_layer)
        traffic = float(memory_time(_layer_bytes_read(model, moe_layer, rows, devices, dtype) + kv, w.cluster, eff))
        memory_bound &= traffic >= compute
        device = max(compute, traffic)
        probe = _layer_forward(w, 1, host.probe_tokens, 1, eff, moe_layer) if host.host_is_device else 0.0
        total += count * _host_layer(device, probe, host)
    h, vocab = model.hidden_size, model.vocab_size
    head = max(float(gemm_time(2.0 * h * vocab * rows_per_device, 1, w.cluster, eff, w.precision)),
               float(memory_time(h * vocab * dtype, w.cluster, eff)))
    logits = rows_per_device * vocab
    sampling = (host.sample_ns_per_logit * 1e-9 * logits if host.sample_ns_per_logit
                else float(memory_time(SAMPLING_PASSES * 2 * 4.0 * logits, w.cluster, eff)))
    # The engine's bookkeeping runs on the host between two forwards: on a CPU it adds; on an accelerator
    # it is issued while the device runs the step (the per-layer floor above already bounds the host).
    engine = host.engine_step_s(rows_per_device) if host.host_is_device else 0.0
    return _Decode(total, head, sampling, memory_bound, engine)


def _layers_forward(w: Workload, rows: int, devices: int, seq_len: int, eff: Efficiency, host: HostCosts) -> float:
    """Every decoder layer's forward of ``rows`` sequences of ``seq_len`` tokens on a replica of ``devices``
    devices (each its share of the rows), with the host floor of each layer pass."""
    rows_per_device = max(rows // devices, 1)
    total = 0.0
    for moe_layer, count in _layer_kinds(w.model):
        if count:
            device = _layer_forward(w, seq_len, rows_per_device, devices, eff, moe_layer)
            probe = _layer_forward(w, 1, host.probe_tokens, 1, eff, moe_layer) if host.host_is_device else 0.0
            total += count * _host_layer(device, probe, host)
    return total


@dataclass(frozen=True)
class Replica:
    """One generation replica and the rows it runs: ``rows`` samples on ``devices`` devices (its experts split
    over them, attention replicated: each device runs its share of the rows), with its stack's host costs."""

    rows: int
    devices: int
    host: HostCosts = HostCosts()
    """What its eager stack spends beside the device's work (measured; none by default)."""


def forward_time(w: Workload, replica: Replica, seq_len: int, eff: Efficiency, chunk_rows: int | None = None,
                 head_share: float = 1.0) -> float:
    """A log-prob forward of the replica's rows, whole sequences of ``seq_len`` tokens, in chunks of
    ``chunk_rows`` rows (all at once by default): per chunk every layer (as the prefill), the output head on
    the scored tokens (``head_share`` of them: the completions), and the log-softmax over their logits
    (``SAMPLING_PASSES`` fp32 passes: read and write)."""
    rows, devices, host = replica.rows, replica.devices, replica.host
    eff = host.efficiency(eff)
    chunk = min(chunk_rows or rows, rows)
    chunks = -(-rows // chunk)
    tokens = max(chunk // devices, 1) * seq_len * head_share
    h, vocab = w.model.hidden_size, w.model.vocab_size
    head = float(gemm_time(2.0 * h * vocab * tokens, 1, w.cluster, eff, w.precision))
    softmax = float(memory_time(SAMPLING_PASSES * 2 * 4.0 * tokens * vocab, w.cluster, eff))
    return chunks * (_layers_forward(w, chunk, devices, seq_len, eff, host) + head + softmax)


def generation_time(w: Workload, replica: Replica, prompt_len: int, response_len: int, eff: Efficiency,
                    running_share: float = 1.0) -> GenerationTimes:
    """The replica's rows, each ``response_len`` new tokens after a prompt of ``prompt_len`` (``w``: model,
    cluster and precision; its batch fields are not used). ``running_share``: the mean share of the rows
    still running in a decode step (a row that stopped leaves the batch, and the engine computes the
    running rows only): each decode step is priced at round(share × rows) rows (1: every row runs to
    ``response_len``)."""
    if not 0.0 < running_share <= 1.0:
        raise ValueError(f"running share {running_share} must be in (0, 1]")
    rows, devices, host = replica.rows, replica.devices, replica.host
    eff = host.efficiency(eff)
    prefill = _layers_forward(w, rows, devices, prompt_len, eff, host)
    # The prefill's head runs on each row's last prompt token only (one decode step's head); it gives the
    # first token, so N new tokens take N draws but N - 1 decode forwards (the last token is not fed back).
    running = max(round(running_share * rows), 1)
    decode = _decode_step(w, running, devices, prompt_len + response_len / 2.0, eff, host)
    forwards = max(response_len - 1, 0)
    return GenerationTimes(prefill_s=prefill + decode.head_s,
                           decode_s=(forwards * (decode.layers_s + decode.head_s + decode.engine_s)
                                     + response_len * decode.sampling_s),
                           decode_step_s=decode.step_s, sampling_s=response_len * decode.sampling_s,
                           decode_memory_bound=decode.memory_bound)
