"""One MoE layer, forward + backward, in moetrain, torchtitan and Megatron-Core, with the same weights.

Pangu Ultra MoE expert shapes scaled to one device (issue #27, item 4): hidden 4096 (``--hidden``; Pangu's
is 7680), expert FFN 2048, ``--experts`` 16 experts with top-8 routing, one shared expert of the expert
width, sigmoid scores, top-k weights renormalised and multiplied by ``--route-scale`` (2.5, Pangu's and
DeepSeek-V3's), ``--tokens`` 8192 per micro-batch. No aux losses, no z-loss and no selection bias in any
implementation, so routing is plain top-k of sigmoid(x·Wᵀ).

The implementations (each built with the same math; anything that cannot be matched is written into
the JSON under the implementation's ``config``):

- moetrain: ``moetrain.models.moe.MoE`` (router → permute → grouped GEMM → weighted unpermute, shared
  expert added), with ``torch.nn.functional.grouped_mm`` on CUDA bf16 (SM ≥ 9.0).
- torchtitan 0.3.0: ``torchtitan.models.common.moe.MoE`` with its ``TokenChoiceTopKRouter``
  (``score_func="sigmoid"``, ``route_norm=True``, ``route_scale``), ``LocalTokenDispatcher`` (EP = 1),
  ``GroupedExperts`` (``torch._grouped_mm``) and a ``FeedForward`` shared expert;
  ``load_balance_coeff=None``, so no expert bias. Its experts cast activations and weights to bf16
  inside ``forward`` whatever the parameter dtype: in an fp32 run its error is bf16-sized by design.
- Megatron-Core 0.19.2: ``MoELayer`` from the local spec (``get_moe_module_spec(use_te=False)``), in a
  1-rank ``torch.distributed`` world with every model-parallel size 1. Without Transformer Engine the
  local spec's only training expert module is ``SequentialMLP`` (a loop over experts that reads the
  token counts on the host; 0.19.2 has no torch ``grouped_mm`` training path: its grouped modules are
  TE's ``TEGroupedMLP`` and the inference-only ``InferenceGroupedMLP``). Router: ``TopKRouter`` with
  ``moe_router_score_function="sigmoid"`` (which always renormalises the top-k for k > 1),
  ``moe_router_topk_scaling_factor``, ``moe_router_dtype="fp32"``, ``load_balancing_type="none"``,
  ``moe_aux_loss_coeff=0``; ``bias_activation_fusion=True`` (Megatron's training default: the routing
  probability is applied inside its fused weighted SwiGLU, before the down projection, which is the
  same product); token dispatcher ``alltoall`` on CUDA (Megatron's choice in its MoE recipes) and
  ``allgather`` on CPU (the all-to-all dispatcher needs CUDA streams). On CPU only, the router is a
  subclass whose ``gating`` skips Megatron's move of CPU router weights to CUDA (same gating GEMM).

Precision: parameters and activations in the run's dtype (bf16 on CUDA, fp32 on CPU), no autocast;
every router computes its logits in fp32. The reference is moetrain in the same dtype; in bf16 runs
``bf16_vs_fp32`` is moetrain's own bf16-against-fp32 error, the scale that bf16 disagreements compare to.

Same routing: the router, expert and shared-expert weights are drawn once (moetrain's layout: router
[E, D], ``w_gate_EDF``/``w_up_EDF`` [E, D, F], ``w_down_EFD`` [E, F, D], shared ``nn.Linear`` weights)
and copied into each peer's layout; every implementation gets the same input and the same output
gradient. Before timing, each one's output, input gradient and parameter gradients (mapped back to
moetrain's layout) are compared with moetrain's by relative L2 error (tolerance 1e-5 in fp32, 2e-2 in
bf16 and for torchtitan's bf16 experts), and ``routing_match`` is the fraction of tokens whose chosen
expert set equals moetrain's.

Timing: per iteration, parameter and input gradients set to None, then forward + ``backward`` of a fixed
random output gradient, timed by CUDA events (wall clock on CPU); median of ``--iters`` after
``--warmup`` warm-ups; peak allocated memory over the timed iterations. ``--compile`` adds each
implementation under ``torch.compile`` (the whole MoE module); a failure anywhere is recorded as a
string and the run goes on. A peer that fails to import or build is recorded the same way.

The GPU machine carries the peers as wheels in ``.whl/`` (torchtitan 0.3.0, megatron-core 0.19.2 and
what they import that the machine lacks: spmd_types, tyro, docstring-parser, typeguard):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
    python3 benchmarks/moe_layer_peers.py --compile            # writes benchmarks/results/moe_layer_peers_h100.json

On CPU, ``--smoke`` runs tiny shapes (hidden 64, FFN 32, 8 experts, top-4, 256 tokens, fp32), checks
that every available implementation agrees, exits 1 if one does not, and writes nothing unless --out
(the peers installed into a private target from the same wheels; both import triton, which a CPU-only
torch lacks, so that target needs triton too):

    PYTHONPATH=/tmp/peers-site:$PWD/src python benchmarks/moe_layer_peers.py --smoke
"""  # noqa: E501 — the install line above is quoted whole, to be pasted as it is

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import os
import re
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from _record import write_result
from torch import nn

from moetrain.config import MoEConfig, RouterConfig
from moetrain.models import MoE
from moetrain.models.experts import native_grouped_mm_ok

IMPLEMENTATIONS = ("moetrain", "torchtitan", "megatron")
SMOKE = {"hidden": 64, "ffn": 32, "experts": 8, "top_k": 4, "tokens": 256, "iters": 3, "warmup": 1}
FULL = {"hidden": 4096, "ffn": 2048, "experts": 16, "top_k": 8, "tokens": 8192, "iters": 20, "warmup": 5}


@dataclass(frozen=True)
class Shape:
    hidden: int
    ffn: int
    experts: int
    top_k: int
    shared_experts: int
    tokens: int
    route_scale: float

    @property
    def shared_ffn(self) -> int:
        return self.ffn * self.shared_experts

    def flops(self) -> float:
        """Forward + backward (3× forward) of the router, the routed experts and the shared expert."""
        d = self.hidden
        forward = 2 * self.tokens * d * (self.experts + 3 * self.top_k * self.ffn + 3 * self.shared_ffn)
        return 3.0 * forward


def error_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def rel_l2(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return float("nan")
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def routing_map(expert_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    ids = expert_ids_TK.reshape(-1, expert_ids_TK.shape[-1])
    return torch.zeros(ids.shape[0], num_experts, dtype=torch.bool, device=ids.device).scatter_(1, ids, True)


class Impl:
    """One implementation: its module, how it takes the [T, D] input, and its gradients in moetrain's
    parameter layout (so every gradient compares with moetrain's)."""

    name: str
    module: nn.Module
    config: dict
    exact_in_fp32 = True

    def layout(self, x_TD: torch.Tensor) -> torch.Tensor:
        return x_TD.unsqueeze(0)  # [B=1, T, D]

    def output(self, fn: Callable, inp: torch.Tensor) -> torch.Tensor:
        return fn(inp).reshape(-1, inp.shape[-1])

    def grads(self) -> dict[str, torch.Tensor | None]:
        raise NotImplementedError

    def route(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Chosen experts as a [T, E] boolean map."""
        raise NotImplementedError


class MoetrainImpl(Impl):
    name = "moetrain"

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        cfg = MoEConfig(
            num_experts=shape.experts, expert_ffn_hidden=shape.ffn, num_shared_experts=shape.shared_experts,
            router=RouterConfig(score_function="sigmoid", top_k=shape.top_k, normalize_top_k=True,
                                scaling_factor=shape.route_scale),
        )
        torch.manual_seed(seed)
        block = MoE(shape.hidden, cfg, device=device)
        with torch.no_grad():
            for prm in block.parameters():
                prm.normal_(std=shape.hidden**-0.5)
        self.module = block.to(dtype)
        self.num_experts = shape.experts
        probe = torch.empty(8, shape.hidden, device=device, dtype=dtype)
        native = native_grouped_mm_ok(probe, block.experts.w_gate_EDF)
        self.config = {
            "module": "moetrain.models.moe.MoE",
            "experts": "GroupedExperts, " + ("torch.nn.functional.grouped_mm" if native
                                             else "exact per-expert loop (no native grouped_mm here)"),
            "dispatcher": "LocalDispatcher (argsort permute, weighted index_add unpermute)",
            "router": "sigmoid, top-k renormalised, scaled; fp32 logits",
            "aux_loss": "off (all balance and z-loss coefficients 0, no score bias)",
            "shared_expert": "SwiGLU" if shape.shared_experts else None,
        }

    def output(self, fn: Callable, inp: torch.Tensor) -> torch.Tensor:
        return fn(inp).out_TD.reshape(-1, inp.shape[-1])

    def weights(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())

    def grads(self) -> dict[str, torch.Tensor | None]:
        return {name: prm.grad for name, prm in self.module.named_parameters()}

    def route(self, x_TD: torch.Tensor) -> torch.Tensor:
        return routing_map(self.module.router(x_TD).expert_ids_TK, self.num_experts)


class TorchtitanImpl(Impl):
    name = "torchtitan"
    exact_in_fp32 = False  # GroupedExperts casts to bf16 inside forward

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype,
                 ref: dict[str, torch.Tensor]) -> None:
        from torchtitan.models.common.feed_forward import FeedForward
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.moe import GroupedExperts, RoutedExperts, TokenChoiceTopKRouter
        from torchtitan.models.common.moe import MoE as TitanMoE
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

        d, f, e, k = shape.hidden, shape.ffn, shape.experts, shape.top_k
        shared = None
        if shape.shared_experts:
            fs = shape.shared_ffn
            shared = FeedForward.Config(w1=Linear.Config(in_features=d, out_features=fs),
                                        w2=Linear.Config(in_features=fs, out_features=d),
                                        w3=Linear.Config(in_features=d, out_features=fs))
        cfg = TitanMoE.Config(
            num_experts=e,
            load_balance_coeff=None,
            router=TokenChoiceTopKRouter.Config(
                num_experts=e, gate=Linear.Config(in_features=d, out_features=e), top_k=k,
                score_func="sigmoid", route_norm=True, route_scale=shape.route_scale),
            routed_experts=RoutedExperts.Config(
                inner_experts=GroupedExperts.Config(dim=d, hidden_dim=f, num_experts=e),
                token_dispatcher=LocalTokenDispatcher.Config(num_experts=e, top_k=k)),
            shared_experts=shared,
        )
        with torch.device(device):
            module = cfg.build()
        # Parameters only: its token-count buffer stays fp32, as in torchtitan's training.
        for prm in module.parameters():
            prm.data = prm.data.to(dtype)
        inner = module.routed_experts.inner_experts
        with torch.no_grad():
            module.router.gate.weight.copy_(ref["router.weight"])
            inner.w1_EFD.copy_(ref["experts.w_gate_EDF"].transpose(1, 2))
            inner.w3_EFD.copy_(ref["experts.w_up_EDF"].transpose(1, 2))
            inner.w2_EDF.copy_(ref["experts.w_down_EFD"].transpose(1, 2))
            if shared is not None:
                module.shared_experts.w1.weight.copy_(ref["shared_expert.gate.weight"])
                module.shared_experts.w3.weight.copy_(ref["shared_expert.up.weight"])
                module.shared_experts.w2.weight.copy_(ref["shared_expert.down.weight"])
        self.module, self.num_experts = module, e
        self.config = {
            "module": "torchtitan.models.common.moe.MoE",
            "experts": "GroupedExperts, torch._grouped_mm; casts activations and weights to bf16 inside forward",
            "dispatcher": "LocalTokenDispatcher (EP = 1)",
            "router": "TokenChoiceTopKRouter score_func=sigmoid route_norm=True route_scale; gate under fp32 autocast",
            "aux_loss": "off (load_balance_coeff=None: no expert bias; torchtitan has no aux loss in the layer)",
            "shared_expert": "FeedForward" if shared is not None else None,
        }

    def grads(self) -> dict[str, torch.Tensor | None]:
        m = self.module
        inner = m.routed_experts.inner_experts

        def t(g: torch.Tensor | None) -> torch.Tensor | None:
            return None if g is None else g.transpose(1, 2)

        out = {
            "router.weight": m.router.gate.weight.grad,
            "experts.w_gate_EDF": t(inner.w1_EFD.grad),
            "experts.w_up_EDF": t(inner.w3_EFD.grad),
            "experts.w_down_EFD": t(inner.w2_EDF.grad),
        }
        if m.shared_experts is not None:
            out["shared_expert.gate.weight"] = m.shared_experts.w1.weight.grad
            out["shared_expert.up.weight"] = m.shared_experts.w3.weight.grad
            out["shared_expert.down.weight"] = m.shared_experts.w2.weight.grad
        return out

    def route(self, x_TD: torch.Tensor) -> torch.Tensor:
        _, expert_ids, _ = self.module.router(x_TD.unsqueeze(0), self.module.expert_bias_E)
        return routing_map(expert_ids, self.num_experts)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def megatron_world(device: torch.device) -> None:
    """A 1-rank torch.distributed world with Megatron's model-parallel state all of size 1."""
    import torch.distributed as dist

    for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                                 expert_model_parallel_size=1)


class MegatronImpl(Impl):
    name = "megatron"

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype,
                 ref: dict[str, torch.Tensor], dispatcher: str) -> None:
        import dataclasses

        from megatron.core.extensions.transformer_engine import HAVE_TE
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.moe.moe_utils import router_gating_linear
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.transformer_config import TransformerConfig

        megatron_world(device)
        d, f, e = shape.hidden, shape.ffn, shape.experts
        cfg = TransformerConfig(
            num_layers=1, hidden_size=d, num_attention_heads=1, ffn_hidden_size=f,
            num_moe_experts=e, moe_ffn_hidden_size=f, moe_router_topk=shape.top_k,
            moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=shape.route_scale,
            moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_z_loss_coeff=None, moe_router_enable_expert_bias=False,
            moe_shared_expert_intermediate_size=shape.shared_ffn or None, moe_shared_expert_overlap=False,
            moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=False,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=True,
            bf16=dtype == torch.bfloat16, params_dtype=dtype,
            use_cpu_initialization=device.type == "cpu", perform_initialization=False,
        )
        spec = get_moe_module_spec(use_te=False, num_experts=e, moe_grouped_gemm=False)
        submodules = spec.keywords["submodules"]
        router_note = "TopKRouter"
        if device.type == "cpu":
            class CpuTopKRouter(TopKRouter):
                """TopKRouter whose gating leaves CPU weights on the CPU (Megatron moves them to CUDA)."""

                def gating(self, input: torch.Tensor) -> torch.Tensor:
                    return router_gating_linear(input, self.weight, self.bias, torch.float32)

            submodules = dataclasses.replace(submodules, router=CpuTopKRouter)
            router_note = "TopKRouter subclass whose gating skips the CPU→CUDA weight move (CPU run only)"
        module = spec.func(config=cfg, submodules=submodules).to(device=device, dtype=dtype)
        with torch.no_grad():
            module.router.weight.copy_(ref["router.weight"])
            for i, expert in enumerate(module.experts.local_experts):
                expert.linear_fc1.weight.copy_(torch.cat([ref["experts.w_gate_EDF"][i].t(),
                                                          ref["experts.w_up_EDF"][i].t()]))
                expert.linear_fc2.weight.copy_(ref["experts.w_down_EFD"][i].t())
            if module.shared_experts is not None:
                module.shared_experts.linear_fc1.weight.copy_(torch.cat([ref["shared_expert.gate.weight"],
                                                                         ref["shared_expert.up.weight"]]))
                module.shared_experts.linear_fc2.weight.copy_(ref["shared_expert.down.weight"])
        self.module, self.ffn, self.shared_ffn, self.num_experts = module, f, shape.shared_ffn, e
        self.config = {
            "module": "megatron.core.transformer.moe.moe_layer.MoELayer, local spec (use_te=False)",
            "transformer_engine_installed": bool(HAVE_TE),
            "experts": type(module.experts).__name__ + " (per-expert loop over MLP; host read of token counts)",
            "dispatcher": type(module.token_dispatcher).__name__,
            "router": router_note + "; sigmoid, top-k renormalised (always, k > 1), scaling factor, fp32 logits",
            "aux_loss": "off (load_balancing_type=none, aux_loss_coeff=0, z_loss None, no expert bias)",
            "bias_activation_fusion": True,
            "shared_expert": type(module.shared_experts).__name__ if module.shared_experts is not None else None,
            "world": "1 rank; tensor, pipeline and expert parallel sizes 1",
        }

    def layout(self, x_TD: torch.Tensor) -> torch.Tensor:
        return x_TD.unsqueeze(1)  # [S=T, B=1, D]

    def output(self, fn: Callable, inp: torch.Tensor) -> torch.Tensor:
        return fn(inp)[0].reshape(-1, inp.shape[-1])

    def grads(self) -> dict[str, torch.Tensor | None]:
        m, f = self.module, self.ffn

        def stack(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if any(t is None for t in tensors) else torch.stack(tensors)

        fc1 = [x.linear_fc1.weight.grad for x in m.experts.local_experts]
        fc2 = [x.linear_fc2.weight.grad for x in m.experts.local_experts]
        out = {
            "router.weight": m.router.weight.grad,
            "experts.w_gate_EDF": stack([None if g is None else g[:f].t() for g in fc1]),
            "experts.w_up_EDF": stack([None if g is None else g[f:].t() for g in fc1]),
            "experts.w_down_EFD": stack([None if g is None else g.t() for g in fc2]),
        }
        if m.shared_experts is not None:
            g1, fs = m.shared_experts.linear_fc1.weight.grad, self.shared_ffn
            out["shared_expert.gate.weight"] = None if g1 is None else g1[:fs]
            out["shared_expert.up.weight"] = None if g1 is None else g1[fs:]
            out["shared_expert.down.weight"] = m.shared_experts.linear_fc2.weight.grad
        return out

    def route(self, x_TD: torch.Tensor) -> torch.Tensor:
        _, routing_map_TE = self.module.router(x_TD.unsqueeze(1))
        return routing_map_TE.reshape(-1, self.num_experts).bool()


@dataclass
class Reference:
    x_TD: torch.Tensor
    grad_TD: torch.Tensor
    out_TD: torch.Tensor
    dx_TD: torch.Tensor
    grads: dict[str, torch.Tensor]
    route_TE: torch.Tensor


def run_once(impl: Impl, fn: Callable, x_TD: torch.Tensor, grad_TD: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor | None]]:
    impl.module.zero_grad(set_to_none=True)
    leaf = x_TD.detach().clone().requires_grad_(True)
    out = impl.output(fn, impl.layout(leaf))
    out.backward(grad_TD)
    grads = {k: (None if v is None else v.detach().clone()) for k, v in impl.grads().items()}
    impl.module.zero_grad(set_to_none=True)
    return out.detach(), leaf.grad, grads


def compare(impl: Impl, fn: Callable, ref: Reference, dtype: torch.dtype) -> dict:
    out, dx, grads = run_once(impl, fn, ref.x_TD, ref.grad_TD)
    param_err = {name: rel_l2(grads.get(name), g) for name, g in ref.grads.items()}
    worst = max(param_err, key=lambda n: param_err[n] if param_err[n] == param_err[n] else float("inf"))
    with torch.no_grad():
        match = (impl.route(ref.x_TD) == ref.route_TE).all(-1).float().mean().item()
    tol = 1e-5 if dtype == torch.float32 and impl.exact_in_fp32 else 2e-2
    result = {
        "rel_l2_out": rel_l2(out, ref.out_TD), "rel_l2_dx": rel_l2(dx, ref.dx_TD),
        "rel_l2_dparams_max": param_err[worst], "rel_l2_dparams_worst": worst, "rel_l2_dparams": param_err,
        "routing_match": match, "tolerance": tol,
    }
    errors = [result["rel_l2_out"], result["rel_l2_dx"], *param_err.values()]
    result["agrees"] = all(err <= tol for err in errors)  # NaN (a missing gradient) fails
    return result


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_variant(impl: Impl, fn: Callable, ref: Reference, iters: int, warmup: int, device: torch.device) -> dict:
    leaf = ref.x_TD.detach().clone().requires_grad_(True)
    cuda = device.type == "cuda"

    def clear() -> None:
        impl.module.zero_grad(set_to_none=True)
        leaf.grad = None

    def step() -> None:
        impl.output(fn, impl.layout(leaf)).backward(ref.grad_TD)

    clear()
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    first_call_s = time.perf_counter() - t0
    for _ in range(warmup):
        clear()
        step()
    clear()
    sync(device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start_bytes = torch.cuda.memory_allocated()
    times_ms, events = [], []
    for _ in range(iters):
        clear()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            events.append((begin, end))
        else:
            t = time.perf_counter()
            step()
            times_ms.append((time.perf_counter() - t) * 1e3)
    sync(device)
    if cuda:
        times_ms = [b.elapsed_time(e) for b, e in events]
    result = {
        "median_ms": statistics.median(times_ms), "min_ms": min(times_ms), "max_ms": max(times_ms),
        "first_call_s": first_call_s,
    }
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        result["peak_mem_gib"] = peak / 2**30
        result["peak_over_start_gib"] = (peak - start_bytes) / 2**30
    clear()
    return result


def device_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    known = re.search(r"\b(gh200|gb200|h100|h200|h800|h20|b200|b300|a100|a800|l40s|l40|l4|a10g|a10)\b", name)
    return known.group(1) if known else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def build(name: str, shape: Shape, device: torch.device, dtype: torch.dtype,
          ref_weights: dict[str, torch.Tensor], dispatcher: str) -> Impl:
    if name == "torchtitan":
        return TorchtitanImpl(shape, device, dtype, ref_weights)
    if name == "megatron":
        return MegatronImpl(shape, device, dtype, ref_weights, dispatcher)
    raise ValueError(name)


def print_table(results: dict) -> None:
    base = results.get("moetrain", {}).get("median_ms")
    head = (f"{'implementation':<20}{'status':<9}{'median ms':>10}{'TFLOP/s':>9}{'peak GiB':>9}"
            f"{'vs moetrain':>12}{'err out':>10}{'err dx':>10}{'err dW':>10}{'routing':>9}")
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        status = r["status"] if r.get("agrees", True) else "DISAGREE"

        def num(key: str, fmt: str, r: dict = r) -> str:
            value = r.get(key)
            width = int(re.match(r"\d*", fmt).group() or 0)
            return format(value, fmt) if isinstance(value, float | int) else "-".rjust(width)

        ratio = f"{r['median_ms'] / base:.2f}x" if base and "median_ms" in r else "-"
        print(f"{name:<20}{status:<9}{num('median_ms', '10.3f')}{num('tflops', '9.2f')}{num('peak_mem_gib', '9.2f')}"
              f"{ratio:>12}{num('rel_l2_out', '10.1e')}{num('rel_l2_dx', '10.1e')}"
              f"{num('rel_l2_dparams_max', '10.1e')}{num('routing_match', '9.3f')}")
        if r["status"] != "ok":
            print(f"    {r.get('stage', '')}: {r.get('error', '')}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, help="model dim (default 4096; smoke 64)")
    p.add_argument("--ffn", type=int, help="expert FFN width (default 2048; smoke 32)")
    p.add_argument("--experts", type=int, help="routed experts (default 16; smoke 8)")
    p.add_argument("--top-k", type=int, help="experts per token (default 8; smoke 4)")
    p.add_argument("--shared-experts", type=int, default=1, choices=(0, 1))
    p.add_argument("--tokens", type=int, help="tokens per micro-batch (default 8192; smoke 256)")
    p.add_argument("--route-scale", type=float, default=2.5)
    p.add_argument("--iters", type=int, help="timed iterations (default 20; smoke 3)")
    p.add_argument("--warmup", type=int, help="warm-up iterations (default 5; smoke 1)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--impls", default=",".join(IMPLEMENTATIONS), help="comma list; moetrain always runs")
    p.add_argument("--compile", action="store_true", help="also time each implementation under torch.compile")
    p.add_argument("--megatron-dispatcher", choices=("auto", "alltoall", "allgather"), default="auto",
                   help="auto: alltoall on CUDA, allgather on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny fp32 shapes: check agreement, write only with --out")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/moe_layer_peers_<device>.json)")
    args = p.parse_args()

    defaults = SMOKE if args.smoke else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.dtype or ("fp32" if args.smoke or device.type == "cpu" else "bf16")]
    dispatcher = args.megatron_dispatcher
    if dispatcher == "auto":
        dispatcher = "alltoall" if device.type == "cuda" else "allgather"
    wanted = [n.strip() for n in args.impls.split(",") if n.strip()]
    unknown = set(wanted) - set(IMPLEMENTATIONS)
    if unknown:
        p.error(f"unknown --impls {sorted(unknown)}; choose from {IMPLEMENTATIONS}")
    peers = [n for n in IMPLEMENTATIONS[1:] if n in wanted]
    shape = Shape(args.hidden, args.ffn, args.experts, args.top_k, args.shared_experts, args.tokens, args.route_scale)

    moetrain = MoetrainImpl(shape, device, dtype, args.seed)
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    x_TD = torch.randn(shape.tokens, shape.hidden, generator=gen).to(device=device, dtype=dtype)
    grad_TD = torch.randn(shape.tokens, shape.hidden, generator=gen).to(device=device, dtype=dtype)
    out, dx, grads = run_once(moetrain, moetrain.module, x_TD, grad_TD)
    with torch.no_grad():
        route_TE = moetrain.route(x_TD)
    ref = Reference(x_TD, grad_TD, out, dx, grads, route_TE)
    ref_weights = {k: v.detach() for k, v in moetrain.weights().items()}

    bf16_vs_fp32 = None
    if dtype != torch.float32:
        wide = copy.copy(moetrain)
        wide.module = copy.deepcopy(moetrain.module).float()
        out32, dx32, _ = run_once(wide, wide.module, x_TD.float(), grad_TD.float())
        bf16_vs_fp32 = {"rel_l2_out": rel_l2(out, out32), "rel_l2_dx": rel_l2(dx, dx32)}
        del wide, out32, dx32

    impls: dict[str, Impl] = {"moetrain": moetrain}
    results: dict[str, dict] = {}
    for name in peers:
        try:
            impls[name] = build(name, shape, device, dtype, ref_weights, dispatcher)
        except Exception as exc:  # noqa: BLE001 — a peer that cannot be built is a recorded result
            stage = "import" if isinstance(exc, ImportError) else "build"
            results[name] = {"status": "failed", "stage": stage, "error": error_line(exc)}
            traceback.print_exc(limit=-3)

    variants: list[tuple[str, Impl, bool]] = [(name, impl, False) for name, impl in impls.items()]
    if args.compile:
        variants += [(f"{name}+compile", impl, True) for name, impl in impls.items()]
    for label, impl, compiled in variants:
        entry: dict = {"status": "ok", "compiled": compiled}
        try:
            fn = torch.compile(impl.module) if compiled else impl.module
            entry.update(compare(impl, fn, ref, dtype))
            entry.update(time_variant(impl, fn, ref, args.iters, args.warmup, device))
            entry["tflops"] = shape.flops() / (entry["median_ms"] * 1e-3) / 1e12
        except Exception as exc:  # noqa: BLE001 — recorded, the run goes on
            entry.update(status="failed", stage="check" if "rel_l2_out" not in entry else "time",
                         error=error_line(exc))
            traceback.print_exc(limit=-3)
            impl.module.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results[label] = entry
        print(f"{label}: {entry.get('median_ms', float('nan')):.3f} ms, {entry['status']}", flush=True)
    order = [v[0] for v in variants] + [n for n in results if n not in {v[0] for v in variants}]
    results = {n: results[n] for n in order}

    def ms(name: str) -> float | None:
        r = results.get(name, {})
        return r.get("median_ms") if r.get("status") == "ok" else None

    def best(*names: str) -> float | None:
        times = [t for t in map(ms, names) if t]
        return min(times) if times else None

    speedup = {}  # peer's median over moetrain's: above 1, moetrain is faster
    for peer in peers:
        pairs = {"eager": (ms(peer), ms("moetrain")),
                 "compiled": (ms(f"{peer}+compile"), ms("moetrain+compile")),
                 "best": (best(peer, f"{peer}+compile"), best("moetrain", "moetrain+compile"))}
        speedup[peer] = {k: (a / b if a and b else None) for k, (a, b) in pairs.items()}

    record = {
        "device": device_slug(device),
        "dtype": str(dtype).removeprefix("torch."),
        "precision": f"parameters and activations {str(dtype).removeprefix('torch.')}, no autocast; "
                     "router logits fp32 in every implementation",
        "shape": {**asdict(shape), "shared_ffn": shape.shared_ffn, "score_function": "sigmoid",
                  "normalize_top_k": True, "pangu_ultra_hidden": 7680},
        "aux_loss": "disabled in every implementation (no balance loss, no z-loss, no selection bias)",
        "timing": {"method": ("CUDA events" if device.type == "cuda" else "perf_counter")
                   + " per iteration around forward + backward of a fixed random output gradient, "
                   "gradients set to None before each; median", "iters": args.iters, "warmup": args.warmup,
                   "first_call_s": "wall time of the first forward + backward, compilation included",
                   "peak_mem_gib": "peak allocated over the timed iterations, every implementation's "
                                   "parameters resident; peak_over_start_gib: above the allocation at the "
                                   "start (this variant's activations and gradients)"},
        "flops_per_call": shape.flops(),
        "versions": {"torch": torch.__version__, "torchtitan": version("torchtitan"),
                     "megatron-core": version("megatron-core")},
        "bf16_vs_fp32_moetrain": bf16_vs_fp32,
        "configs": {name: impl.config for name, impl in impls.items()},
        "results": results,
        "speedup_of_moetrain": speedup,
        "smoke": args.smoke,
    }
    print()
    print(f"MoE layer fwd+bwd on {record['device']} ({record['dtype']}): hidden {shape.hidden}, ffn {shape.ffn}, "
          f"{shape.experts} experts, top-{shape.top_k}, {shape.shared_experts} shared, {shape.tokens} tokens")
    if bf16_vs_fp32:
        print(f"moetrain bf16 vs fp32: out {bf16_vs_fp32['rel_l2_out']:.1e}, dx {bf16_vs_fp32['rel_l2_dx']:.1e}")
    print_table(results)
    out_path = args.out
    if out_path is None and not args.smoke:
        out_path = Path(__file__).resolve().parent / "results" / f"moe_layer_peers_{record['device']}.json"
    if out_path:
        write_result(out_path, record)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    disagree = [n for n, r in results.items() if r["status"] == "ok" and not r["agrees"]]
    if disagree:
        print(f"disagree with moetrain: {', '.join(disagree)}", file=sys.stderr)
    failed_own = [n for n in results if n.startswith("moetrain") and results[n]["status"] != "ok"]
    return 1 if args.smoke and (disagree or failed_own) else 0


if __name__ == "__main__":
    sys.exit(main())
