"""Compiled layers' gradients against the eager model's, variant by variant: which compiler stage, which
pass and which hook makes a parameter's gradient differ (the H200's tests/gpu run gave
``layers.5.moe.router.weight`` a relative error of 1.0006 in the compiled tiny-pangu, every other
parameter < 1e-4; benchmarks/notes/training.md, "The compiled router gradient on the H200").

    python benchmarks/compiled_grad_check.py --device cuda        # writes compiled_grad_check_<gpu>.json
    python benchmarks/compiled_grad_check.py --device cpu --loop  # rehearsal: CUDA's fp32 per-expert loop

A variant is ``backend:passes:measure``: torch's compiler backend (``inductor``, ``aot_eager``: the same
tracing without Inductor's kernels, ``eager``: Dynamo's graph breaks only), the forward/backward passes
(2: a compiling pass, ``zero_grad``, then the measured pass, as the GPU test runs; 1: the measured pass
only) and how the measured pass runs (``hooks``: ``measure_saved_bytes``' saved-tensor hooks, as in the
test; ``plain``: forward and backward alone). For every parameter off by more than 1e-4 it records the
norm of its gradient over the eager one's and, for a router weight, the gradient split into the eager
model's two parts: through the gating weights and through the balance losses (``gate``, ``aux``: the
least-squares coefficients, 1 and 1 when right, and what neither explains). It records pairs of
parameters whose gradients share storage too. ``--loop`` takes the per-expert loop for the experts on a
CPU (CUDA takes it in fp32: ``grouped_mm`` runs bf16 only there, so each MoE layer breaks its graph).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _record import device_tag, write_result  # noqa: E402

import moetrain.models.experts as experts  # noqa: E402
from moetrain.config import load_model_config  # noqa: E402
from moetrain.config.model import ModelConfig  # noqa: E402
from moetrain.distributed.parallelize import apply_compile  # noqa: E402
from moetrain.memory.measure import measure_saved_bytes  # noqa: E402
from moetrain.models import build_model  # noqa: E402

DEFAULT_VARIANTS = "inductor:2:hooks,inductor:1:hooks,inductor:2:plain,aot_eager:2:hooks,eager:2:hooks"
TOLERANCE = 1e-4
"""The GPU test's bound on a gradient's relative error."""


@dataclass(frozen=True)
class Case:
    cfg: ModelConfig
    ids: torch.Tensor
    device: torch.device


@dataclass(frozen=True)
class Reference:
    """The eager model's gradients, and each router weight's gradient through the gating weights only."""

    grads: dict[str, torch.Tensor]
    gate_parts: dict[str, torch.Tensor]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().float().cpu() for k, p in model.named_parameters() if p.grad is not None}


def _detach_balance_losses(model: torch.nn.Module) -> None:
    """Every router's balance losses as constants: its weight then gets the gating weights' gradient only."""
    for block in model.moe_blocks():
        forward = block.router.forward

        def detached(x_TD, replay_TK=None, forward=forward):
            routing = forward(x_TD, replay_TK)
            return dataclasses.replace(routing, aux_loss=routing.aux_loss.detach())

        block.router.forward = detached


def eager_reference(case: Case) -> Reference:
    full = build_model(case.cfg, device=case.device, seed=0)
    full(case.ids, labels=case.ids).loss.backward()
    gate_only = build_model(case.cfg, device=case.device, seed=0)
    _detach_balance_losses(gate_only)
    gate_only(case.ids, labels=case.ids).loss.backward()
    routers = {k: g for k, g in _grads(gate_only).items() if k.endswith("router.weight")}
    return Reference(_grads(full), routers)


def _compiled_grads(case: Case, backend: str, passes: int, measure: str) -> tuple[dict, list[list[str]]]:
    torch._dynamo.reset()
    model = build_model(case.cfg, device=case.device, seed=0)
    apply_compile(model, backend=backend)
    if passes == 2:
        model(case.ids, labels=case.ids).loss.backward()  # the compilation, as in the GPU test
        model.zero_grad(set_to_none=True)
    if measure == "hooks":
        measure_saved_bytes(model, case.ids, case.ids)
    else:
        model(case.ids, labels=case.ids).loss.backward()
    by_storage: dict[int, list[str]] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            by_storage.setdefault(p.grad.untyped_storage().data_ptr(), []).append(name)
    return _grads(model), [names for names in by_storage.values() if len(names) > 1]


def explain(name: str, grad: torch.Tensor, ref: Reference) -> dict:
    """How a wrong gradient relates to the right one: its norm ratio, and for a router weight the
    least-squares split into the eager gradient's gating and balance-loss parts."""
    right = ref.grads[name]
    row = {"param": name, "rel_err": rel_err(grad, right), "norm_ratio": (grad.norm() / right.norm()).item()}
    if name in ref.gate_parts:
        gate = ref.gate_parts[name].flatten().double()
        basis = torch.stack([gate, right.flatten().double() - gate], dim=1)
        coef = torch.linalg.lstsq(basis, grad.flatten().double().unsqueeze(1)).solution.flatten()
        residual = grad.flatten().double() - basis @ coef
        row.update(gate=coef[0].item(), aux=coef[1].item(), unexplained=(residual.norm() / right.norm()).item())
    return row


def run_variant(case: Case, ref: Reference, variant: str) -> dict:
    backend, passes, measure = variant.split(":")
    try:
        grads, shared = _compiled_grads(case, backend, int(passes), measure)
    except Exception as exc:  # noqa: BLE001  a variant that fails is recorded, the others still run
        traceback.print_exc()
        return {"variant": variant, "error": f"{type(exc).__name__}: {exc}"}
    missing = sorted(set(ref.grads) - set(grads))
    errors = sorted(((rel_err(grads[k], ref.grads[k]), k) for k in ref.grads if k in grads), reverse=True)
    wrong = [explain(k, grads[k], ref) for err, k in errors if err >= TOLERANCE]
    result = {"variant": variant, "worst": {"param": errors[0][1], "rel_err": errors[0][0]},
              "wrong": wrong, "missing_grads": missing, "grads_sharing_storage": shared}
    print(f"{variant:22s} worst {errors[0][0]:.2e} {errors[0][1]}; {len(wrong)} wrong; shared {shared}")
    for row in wrong:
        print("    " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", type=int, default=256, help="the GPU test's 256")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated backend:passes:measure")
    parser.add_argument("--loop", action="store_true", help="per-expert loop on a CPU too (CUDA's fp32 path)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    if args.loop:
        for dtype in (torch.float32, torch.bfloat16):
            experts._GROUPED_MM_RUNS[("cpu", (0, 0), dtype)] = False
    cfg = load_model_config("tiny-pangu")
    ids = torch.randint(0, cfg.vocab_size, (2, args.seq_len), generator=torch.Generator().manual_seed(0))
    case = Case(cfg, ids.to(device), device)
    ref = eager_reference(case)
    rows = [run_variant(case, ref, variant) for variant in args.variants.split(",")]
    out = args.out or f"benchmarks/results/compiled_grad_check_{device_tag()}.json"
    write_result(out, {"model": cfg.name, "seq_len": args.seq_len, "batch": 2, "loop": args.loop,
                       "tolerance": TOLERANCE, "variants": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
