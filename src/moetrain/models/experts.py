"""SwiGLU feed-forward blocks: a dense one, and E experts computed by grouped GEMMs.

``GroupedExperts`` stores each projection stacked over experts (``w_gate_EDF`` [E, D, F], ``w_up_EDF``,
``w_down_EFD`` [E, F, D]) and runs one grouped GEMM per projection over tokens already sorted by
expert (see ``dispatch.permute``). Wherever torch's ``grouped_mm`` runs (Hopper GPUs in bf16; CPUs in
fp32 and bf16 on recent torch) the group sizes stay on the device as cumulative offsets: no host
read, and nothing data-dependent for ``torch.compile`` to break on. Elsewhere an exact per-expert loop
is used, which reads the group sizes on the host once per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedSiLU(nn.Module):
    """silu(gate) · up: the SwiGLU activation, a module of its own so the memory policy can recompute
    its output instead of saving it (``moetrain.memory``)."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)) (Shazeer 2020)."""

    def __init__(self, hidden: int, ffn_hidden: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn_hidden, bias=False, device=device)
        self.up = nn.Linear(hidden, ffn_hidden, bias=False, device=device)
        self.down = nn.Linear(ffn_hidden, hidden, bias=False, device=device)
        self.act = GatedSiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x), self.up(x)))


_GROUPED_MM_RUNS: dict[tuple[str, tuple[int, int], torch.dtype], bool] = {}
"""Whether this torch has a ``grouped_mm`` kernel for (device type, capability, dtype): probed once."""


def _grouped_mm_runs(device_type: str, capability: tuple[int, int], dtype: torch.dtype) -> bool:
    key = (device_type, capability, dtype)
    if key not in _GROUPED_MM_RUNS:
        _GROUPED_MM_RUNS[key] = _probe_grouped_mm(*key)
    return _GROUPED_MM_RUNS[key]


def _probe_grouped_mm(device_type: str, capability: tuple[int, int], dtype: torch.dtype) -> bool:
    if not hasattr(F, "grouped_mm") or (device_type == "cuda" and (capability < (9, 0) or dtype != torch.bfloat16)):
        return False
    try:
        x = torch.ones(4, 8, device=device_type, dtype=dtype)
        F.grouped_mm(x, torch.ones(2, 8, 8, device=device_type, dtype=dtype),
                     offs=torch.tensor([1, 4], device=device_type, dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def probe_grouped_mm(device: torch.device) -> None:
    """Probe the kernels for ``device`` now, eagerly: a compiled layer must find the answer, not run
    the probe inside its trace (``moetrain.distributed.parallelize.apply_compile`` calls this)."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    for dtype in (torch.float32, torch.bfloat16):
        _grouped_mm_runs(device.type, capability, dtype)


def native_grouped_mm_ok(x: torch.Tensor, w: torch.Tensor, *inner_dims: int) -> bool:
    """Whether ``grouped_mm`` serves x (and w, same dtype) with these matrix dims (default: w's two)."""
    dims = inner_dims or w.shape[-2:]
    if x.device.type not in ("cpu", "cuda") or any(d % 8 for d in dims):
        return False  # the kernels want 16-byte aligned rows
    capability = torch.cuda.get_device_capability(x.device) if x.is_cuda else (0, 0)
    return x.dtype == w.dtype and _grouped_mm_runs(x.device.type, capability, x.dtype)


@torch.library.custom_op("moetrain::grouped_mm", mutates_args=())
def _opaque_grouped_mm(x_PK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm`` behind an opaque op: torch's compiler traces ``grouped_mm`` in bf16 only, yet the
    CPU kernel also runs fp32, so a compiled fp32 layer calls it through this op instead."""
    return F.grouped_mm(x_PK, w_EKN, offs=offsets_E)


@_opaque_grouped_mm.register_fake
def _(x_PK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return x_PK.new_empty(x_PK.shape[0], w_EKN.shape[-1])


@torch.library.custom_op("moetrain::grouped_weight_grad", mutates_args=())
def _opaque_weight_grad(x_PK: torch.Tensor, grad_PN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return F.grouped_mm(x_PK.t(), grad_PN, offs=offsets_E)


@_opaque_weight_grad.register_fake
def _(x_PK: torch.Tensor, grad_PN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return x_PK.new_empty(offsets_E.shape[0], x_PK.shape[1], grad_PN.shape[1])


def _opaque_setup(ctx, inputs, output) -> None:
    x_PK, w_EKN, offsets_E = inputs
    ctx.save_for_backward(x_PK, w_EKN, offsets_E)


def _opaque_backward(ctx, grad_PN: torch.Tensor):
    x_PK, w_EKN, offsets_E = ctx.saved_tensors
    grad_PN = grad_PN.contiguous()  # a broadcast gradient (stride 0) is refused by the kernel
    grad_x = _opaque_grouped_mm(grad_PN, w_EKN.transpose(1, 2).contiguous(), offsets_E)
    return grad_x, _opaque_weight_grad(x_PK, grad_PN, offsets_E), None


_opaque_grouped_mm.register_autograd(_opaque_backward, setup_context=_opaque_setup)


def _native(x_PK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    if x_PK.dtype == torch.bfloat16:
        return F.grouped_mm(x_PK, w_EKN, offs=offsets_E)
    return _opaque_grouped_mm(x_PK, w_EKN, offsets_E)


def group_offsets(tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """End row of each expert's block (int32, on the device): what the grouped GEMM kernel takes."""
    return torch.cumsum(tokens_per_expert_E, dim=0).to(torch.int32)


def grouped_mm(x_PK: torch.Tensor, w_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor,
               offsets_E: torch.Tensor | None = None) -> torch.Tensor:
    """Row block e of ``x`` (``tokens_per_expert[e]`` rows, blocks in expert order) times ``w[e]``.
    ``offsets_E``: ``group_offsets(tokens_per_expert_E)`` when the caller already has it (one per layer,
    shared by its GEMMs, so backward keeps one copy)."""
    if torch.is_autocast_enabled(x_PK.device.type):
        dtype = torch.get_autocast_dtype(x_PK.device.type)
        x_PK, w_EKN = x_PK.to(dtype), w_EKN.to(dtype)
    if native_grouped_mm_ok(x_PK, w_EKN):
        return _native(x_PK, w_EKN, group_offsets(tokens_per_expert_E) if offsets_E is None else offsets_E)
    blocks = torch.split(x_PK, tokens_per_expert_E.tolist())
    # unbind, not w[e]: the backward of E separate selects would add E full-size zero gradients
    outs = [block @ w_KN for block, w_KN in zip(blocks, w_EKN.unbind(0))]
    return torch.cat(outs) if outs else x_PK.new_zeros(0, w_EKN.shape[-1])


def grouped_weight_grad(x_PK: torch.Tensor, grad_PN: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """[E, K, N]: for each expert e, its row block of ``x`` transposed times its block of ``grad`` (the
    weight gradient of ``grouped_mm``), with the same device-side offsets and the same loop fallback."""
    if native_grouped_mm_ok(x_PK, grad_PN, x_PK.shape[-1], grad_PN.shape[-1]):
        offsets_E = group_offsets(tokens_per_expert_E)
        if x_PK.dtype == torch.bfloat16:
            return F.grouped_mm(x_PK.t(), grad_PN, offs=offsets_E)
        return _opaque_weight_grad(x_PK, grad_PN.contiguous(), offsets_E)
    sizes = tokens_per_expert_E.tolist()
    return torch.stack([x.t() @ g for x, g in zip(x_PK.split(sizes), grad_PN.split(sizes))])


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_gate_EDF = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden, device=device))
        self.w_up_EDF = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden, device=device))
        self.w_down_EFD = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden, device=device))
        self.act = GatedSiLU()

    def forward(self, tokens_PD: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        offsets_E = group_offsets(tokens_per_expert_E)
        gate = grouped_mm(tokens_PD, self.w_gate_EDF, tokens_per_expert_E, offsets_E)
        up = grouped_mm(tokens_PD, self.w_up_EDF, tokens_per_expert_E, offsets_E)
        return grouped_mm(self.act(gate, up), self.w_down_EFD, tokens_per_expert_E, offsets_E)
